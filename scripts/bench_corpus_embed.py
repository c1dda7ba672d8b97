"""Corpus embedding throughput, side by side in one run: the engine (what `orthrus-rag index` runs: one shard of
passages submitted as one batch to the in-process engine) against sentence-transformers `encode` (what FlashRAG's
index builder runs), same passages, same model, same torch threads.

    .venv/bin/python scripts/bench_corpus_embed.py --corpus runs/corpus.jsonl.gz --count 2000 --threads 2
    .venv/bin/python scripts/bench_corpus_embed.py ... --models minilm backbone   # + SmolLM2 under its adapter

Models: `minilm` (all-MiniLM-L6-v2, mean pooling, L2) and `backbone` (SmolLM2-135M under the shipped embedding
adapter `smollm2_embed`, mean pooling, L2, documents with the adapter card's prefix: sentence-transformers loads
the same PEFT adapter onto the same backbone). Both sides truncate at the same length: MiniLM's 512 positions,
the backbone's `--max-len`. Columns: the engine at
fp32 and at `auto` (bf16 where the CPU has bf16 dot products), sentence-transformers at fp32 and bf16, at batch
32 (its default) and `--st-batch` (FlashRAG's builder uses 256+). Each column: a warm-up on 32 passages, then
`--count` passages timed; passages/s and tokens/s (the model's own token counts). One JSON line per column, then a
table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

logger = logging.getLogger("bench_corpus_embed")


def read_passages(path: Path, count: int) -> list[str]:
    """The first `count` passages' contents ("title\\ntext") of a FlashRAG JSONL file."""
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                out.append(row["contents"] if "contents" in row else f"{row.get('title', '')}\n{row['text']}")
            if len(out) >= count:
                break
    return out


def _engine_cfg(model: str, dtype: str, threads: int, max_len: int) -> Any:
    from hydra import compose, initialize_config_module

    from orthrus_rag.config.app import register_configs

    register_configs()
    overrides = [f"model.dtype={dtype}", f"deploy.num_threads={threads}", "progress=false",
                 # NOTE: embedding-only steps: the budget a shard's passages fill (the index command's use)
                 "scheduler.max_num_batched_tokens=4096", "scheduler.max_num_seqs=256", "cache.kv_cache_gib=0.25"]
    overrides += ["model=smollm2_backbone", f"model.max_model_len={max_len}"] if model == "backbone" else \
        ["model=smollm2"]
    with initialize_config_module(config_module="orthrus_rag.conf", version_base=None):
        return compose(config_name="config", overrides=overrides)


def bench_engine(model: str, dtype: str, texts: list[str], threads: int, max_len: int) -> dict[str, Any]:
    import asyncio

    from orthrus_rag.entrypoints.clients import build_client
    from orthrus_rag.entrypoints.commands import _embedder

    cfg = _engine_cfg(model, dtype, threads, max_len)
    client = build_client(cfg)
    try:
        embedder = _embedder(cfg, client, batch_size=len(texts))
        embedder.embed_documents(texts[:32])  # warm-up (kernels, first shapes)
        start = time.perf_counter()
        vectors = embedder.embed_documents(texts)
        seconds = time.perf_counter() - start
    finally:
        asyncio.run(client.aclose())
    return {"system": "orthrus", "dtype": dtype, "batch": len(texts), "seconds": seconds, "dim": vectors.shape[1]}


def _st_model(model: str, dtype: str, max_len: int) -> Any:
    from sentence_transformers import SentenceTransformer, models

    from orthrus_rag.models.registry import resolve_adapter_path, resolve_model_path

    if model == "minilm":
        st = SentenceTransformer(str(resolve_model_path("all-minilm-l6-v2")), device="cpu")
    else:
        word = models.Transformer(str(resolve_model_path("smollm2-135m-instruct")), max_seq_length=max_len)
        if word.tokenizer.pad_token is None:  # NOTE: a decoder's tokenizer; masked mean pooling ignores padding
            word.tokenizer.pad_token = word.tokenizer.eos_token
        st = SentenceTransformer(modules=[word, models.Pooling(word.get_word_embedding_dimension(), "mean"),
                                          models.Normalize()], device="cpu")
        st.load_adapter(str(resolve_adapter_path("smollm2_embed")))
    st.max_seq_length = 512 if model == "minilm" else max_len
    return st.to(torch.bfloat16) if dtype == "bfloat16" else st


def _backbone_prefix() -> str:
    from orthrus_rag.models.registry import resolve_adapter_path

    card = json.loads((resolve_adapter_path("smollm2_embed") / "orthrus_embedding.json").read_text())
    return card.get("document_instruction") or ""


def bench_st(model: str, dtype: str, batch: int, texts: list[str], max_len: int) -> dict[str, Any]:
    st = _st_model(model, dtype, max_len)
    if model == "backbone":
        texts = [_backbone_prefix() + t for t in texts]
    st.encode(texts[:32], batch_size=batch, normalize_embeddings=True)
    start = time.perf_counter()
    vectors = st.encode(texts, batch_size=batch, normalize_embeddings=True, show_progress_bar=False)
    seconds = time.perf_counter() - start
    return {"system": "sentence-transformers", "dtype": dtype, "batch": batch, "seconds": seconds,
            "dim": int(vectors.shape[1])}


def token_count(model: str, texts: list[str], max_len: int) -> int:
    from transformers import AutoTokenizer

    from orthrus_rag.models.registry import resolve_model_path

    name = "all-minilm-l6-v2" if model == "minilm" else "smollm2-135m-instruct"
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(name)))
    limit = 512 if model == "minilm" else max_len
    return sum(min(len(ids), limit) for ids in tokenizer(texts)["input_ids"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True, help="FlashRAG JSONL (.gz) passages")
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=512, help="the backbone's tokens per passage, both sides")
    ap.add_argument("--models", nargs="+", choices=("minilm", "backbone"), default=["minilm"])
    ap.add_argument("--engine-dtypes", nargs="+", default=["float32", "auto"])
    ap.add_argument("--st-dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--st-batch", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--out", type=Path, default=None, help="append the JSON lines to this file")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(args.threads)
    texts = read_passages(args.corpus, args.count)
    rows = []
    for model in args.models:
        tokens = token_count(model, texts, args.max_len)
        runs = [lambda d=d: bench_engine(model, d, texts, args.threads, args.max_len) for d in args.engine_dtypes]
        runs += [lambda d=d, b=b: bench_st(model, d, b, texts, args.max_len)
                 for d in args.st_dtypes for b in args.st_batch]
        for run in runs:
            row = {"model": model, "passages": len(texts), "tokens": tokens, "threads": args.threads, **run()}
            row["passages_per_s"] = round(len(texts) / row["seconds"], 2)
            row["tokens_per_s"] = round(tokens / row["seconds"], 1)
            print(json.dumps(row), flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            rows.append(row)
    print(f"\n{'model':9} {'system':22} {'dtype':9} {'batch':>6} {'passages/s':>11} {'tokens/s':>9}")
    for r in rows:
        print(f"{r['model']:9} {r['system']:22} {r['dtype']:9} {r['batch']:>6} {r['passages_per_s']:>11} "
              f"{r['tokens_per_s']:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
