"""Where an index build's resident memory goes, shard by shard: the builder's embedder (an `orthrus-rag index`
engine, `_index_engine` settings) over generated passages; after each shard the RSS, the RSS once glibc's free
pages are handed back (`release_free_memory`), Python's allocated blocks and the object types that grew. Flat
blocks and a falling RSS after the trim say the growth is the C heap's free memory; an RSS that still grows after
it is native memory something keeps (docs/benchmarks/corpus-embedding.md).

    .venv/bin/python scripts/probe_index_memory.py --shard-size 2048 --shards 6 -- model.dtype=auto
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from collections import Counter

import psutil


def rss_gib() -> float:
    return round(psutil.Process().memory_info().rss / 2**30, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shard-size", type=int, default=2048)
    ap.add_argument("--shards", type=int, default=6)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides (after --)")
    args = ap.parse_args()
    from hydra import compose, initialize_config_module

    from orthrus_rag.config.app import register_configs
    from orthrus_rag.data.generated_corpus import generate_passages
    from orthrus_rag.entrypoints.clients import build_client
    from orthrus_rag.entrypoints.commands import _index_engine
    from orthrus_rag.entrypoints.embedding import build_embedder
    from orthrus_rag.memory import release_free_memory

    register_configs()
    with initialize_config_module(config_module="orthrus_rag.conf", version_base=None):
        cfg = compose(config_name="config", overrides=["progress=false", *args.overrides])
    _index_engine(cfg)
    client = build_client(cfg)
    print(json.dumps({"loaded_rss_gib": rss_gib()}), flush=True)
    try:
        embedder = build_embedder(cfg, client, batch_size=args.shard_size)
        before: Counter = Counter()
        for shard in range(args.shards):
            texts = [p.contents for p in generate_passages(args.shard_size, 0, start=shard * args.shard_size)]
            started = time.perf_counter()
            embedder.embed_documents(texts)
            seconds = time.perf_counter() - started
            del texts
            gc.collect()
            rss = rss_gib()
            release_free_memory()
            counts = Counter(type(o).__name__ for o in gc.get_objects())
            grew = sorted(((k, counts[k] - before[k]) for k in counts if counts[k] > before[k]),
                          key=lambda kv: -kv[1])[:5] if shard else []
            before = counts
            print(json.dumps({"shard": shard, "passages_per_s": round(args.shard_size / seconds, 1), "rss_gib": rss,
                              "rss_after_trim_gib": rss_gib(), "python_blocks": sys.getallocatedblocks(),
                              "grew": grew}), flush=True)
    finally:
        asyncio.run(client.aclose())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
