"""Where the engine's corpus-embedding time goes, without a profiler's per-op overhead: the builder's own path
(`embed_documents` through the engine, as `orthrus-rag index` runs it) over the first passages of a corpus, with the
separate encoder's forward, its attention and the runner's steps timed apart by wrapping them. Prints one line.

    .venv/bin/python scripts/probe_encoder_time.py --corpus runs/corpus/2wiki_200k.jsonl.gz --count 1000 --dtype auto
    .venv/bin/python scripts/probe_encoder_time.py ... --override model.cpu_prefill_kernel=false   # SDPA attention
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path

import torch
import yaml
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_corpus_embed as bench  # noqa: E402 (a sibling script)
from step_phases import TOTALS, timed  # noqa: E402 (its timers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override of the engine (e.g. model.cpu_prefill_kernel=false); repeatable")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    from orthrus_rag.engine.executor.runner import ModelRunner
    from orthrus_rag.entrypoints.clients import build_client
    from orthrus_rag.entrypoints.embedding import build_embedder
    from orthrus_rag.models.bert import BertEncoder, Packing

    for owner, name, label in [(ModelRunner, "execute", "steps"), (BertEncoder, "forward", "encoder_forward"),
                               (Packing, "attend", "attention")]:
        timed(owner, name, label)
    texts = bench.read_passages(args.corpus, args.count + 32)
    warm, texts = texts[:32], texts[32:]
    cfg = bench._engine_cfg("minilm", args.dtype, args.threads, 512)
    for item in args.override:
        key, _, value = item.partition("=")
        OmegaConf.update(cfg, key, yaml.safe_load(value), merge=False)
    client = build_client(cfg)
    try:
        embedder = build_embedder(cfg, client, batch_size=len(texts))
        embedder.embed_documents(warm)
        TOTALS.clear()
        start = time.perf_counter()
        embedder.embed_documents(texts)
        wall = time.perf_counter() - start
    finally:
        asyncio.run(client.aclose())
    label = " ".join([args.dtype, *args.override])
    print(f"{label}: {len(texts)} passages in {wall:.2f} s ({len(texts) / wall:.1f}/s); "
          + ", ".join(f"{k} {TOTALS[k]:.2f} s" for k in ("steps", "encoder_forward", "attention")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
