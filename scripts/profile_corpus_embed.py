"""Where corpus embedding's time goes, the engine beside sentence-transformers: the same passages through both
(scripts/bench_corpus_embed.py's setup: same model files, cut at the same length, same threads) under the torch
profiler; prints each side's wall time, its time inside torch ops by kind (GEMMs, attention, the rest) and its top
ops by self CPU time. What is not inside an op ran in Python (tokenizing, scheduling, pooling glue).

    .venv/bin/python scripts/profile_corpus_embed.py --corpus runs/corpus/2wiki_200k.jsonl.gz --count 500 \
        --model minilm --dtype auto
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_corpus_embed as bench  # noqa: E402 (a sibling script)

GEMM = ("addmm", "mm", "linear", "matmul", "bmm", "mkldnn", "onednn", "baddbmm")
ATTENTION = ("scaled_dot_product", "flash_attention", "_efficient_attention", "softmax")


def _kind(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ATTENTION):
        return "attention"
    if any(k in low for k in GEMM):
        return "gemm"
    return "other"


def profiled(run: Any) -> tuple[float, Any]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
    return seconds, prof


def report(name: str, seconds: float, prof: Any, top: int) -> None:
    events = prof.key_averages()
    by_kind: Counter[str] = Counter()
    for e in events:
        by_kind[_kind(e.key)] += e.self_cpu_time_total / 1e6
    inside = sum(by_kind.values())
    print(f"\n== {name}: {seconds:.2f} s wall; inside torch ops {inside:.2f} s "
          f"(gemm {by_kind['gemm']:.2f}, attention {by_kind['attention']:.2f}, other {by_kind['other']:.2f})")
    print(events.table(sort_by="self_cpu_time_total", row_limit=top))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--count", type=int, default=500)
    ap.add_argument("--model", choices=("minilm", "backbone"), default="minilm")
    ap.add_argument("--dtype", default="auto", help="the engine's model.dtype; sentence-transformers runs bf16 for "
                                                    "auto where the CPU has it, else fp32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--st-batch", type=int, default=32)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    texts = bench.read_passages(args.corpus, args.count + 32)
    warm, texts = texts[:32], texts[32:]

    import asyncio

    from orthrus_rag.entrypoints.clients import build_client
    from orthrus_rag.entrypoints.embedding import build_embedder

    cfg = bench._engine_cfg(args.model, args.dtype, args.threads, args.max_len)
    client = build_client(cfg)
    try:
        embedder = build_embedder(cfg, client, batch_size=len(texts))
        embedder.embed_documents(warm)
        seconds, prof = profiled(lambda: embedder.embed_documents(texts))
    finally:
        asyncio.run(client.aclose())
    report(f"orthrus ({args.dtype})", seconds, prof, args.top)

    from orthrus_rag.config.engine import ModelConfig

    st_dtype = "bfloat16" if ModelConfig(dtype=args.dtype).torch_dtype == torch.bfloat16 else "float32"
    st = bench._st_model(args.model, st_dtype, args.max_len)
    prefixed = [bench._backbone_prefix() + t for t in texts] if args.model == "backbone" else texts
    st.encode(warm, batch_size=args.st_batch)
    seconds, prof = profiled(lambda: st.encode(prefixed, batch_size=args.st_batch, normalize_embeddings=True))
    report(f"sentence-transformers ({st_dtype}, batch {args.st_batch})", seconds, prof, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
