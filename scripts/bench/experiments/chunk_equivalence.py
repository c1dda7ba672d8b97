"""Chunk equivalence: embeddings pooled incrementally over chunks of a sequence against the whole sequence
pooled at once from transformers' own hidden states (an independent reference); min cosine and max abs
difference per pooler and chunk size. Not a timing: it shows what chunking costs in accuracy (nothing, up to
float32 rounding)."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch
from omegaconf import DictConfig

from ..report import _plt, _save, caption, result_rows, write_json
from ..workloads import make_text

logger = logging.getLogger(__name__)
# `experiment=chunk_equivalence` (scripts/benchmark.py): these settings over bench.yaml's, any key of it
CONFIG = """
# Paper: min cosine similarity of chunked vs whole-sequence embeddings per pooler and chunk size.
# Here: SmolLM2 backbone, 4 texts of 384 words (384 tokens: the workload's words are one token each; 48
# words for chunks below 16 tokens),
# every pooler, chunk sizes 1 to 512, against transformers' own hidden states pooled at once.
experiment:
  name: chunk_equivalence
  poolers: [mean, weighted_mean, cls, first, last, all]
  chunk_sizes: [1, 7, 16, 64, 128, 512]
  num_texts: 4
  words: 384
  short_words: 48
  min_chunk_for_long: 16
systems: []
peers: []
"""


def reference(hf, tokenizer, ids: list[int], params) -> torch.Tensor:
    from orthrus_rag.layers.pooler import pool_whole

    with torch.inference_mode():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
    return pool_whole(hidden, params)


def main(cfg: DictConfig, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    from orthrus_rag import Engine
    from orthrus_rag.models.registry import resolve_model_path
    from orthrus_rag.params import PoolingParams

    x = cfg.experiment
    torch.set_num_threads(cfg.threads.inproc)
    # NOTE: an exactness check of chunked pooling against transformers' fp32: fp32 on both sides, whatever "auto"
    # would pick on this CPU (bf16 rounding would hide what chunking does)
    engine = Engine.from_pretrained(cfg.model.name, num_blocks=cfg.cache.num_blocks, dtype="float32",
                                    max_num_batched_tokens=max(x.chunk_sizes), max_chunk_tokens=max(x.chunk_sizes))
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(cfg.model.name)), dtype=torch.float32).eval()
    tok = engine.tokenizer
    rng = random.Random(cfg.seed)
    texts = {n: [make_text(rng, n) for _ in range(x.num_texts)] for n in {x.words, x.short_words}}
    results = []
    for pooling in x.poolers:
        params = PoolingParams(pooling=pooling, normalize=pooling != "all")
        for chunk in x.chunk_sizes:
            words = x.short_words if chunk < x.min_chunk_for_long else x.words
            # NOTE: every embedding of a step shares the budget, so chunk c with budget c = one chunk per step
            engine.scheduler.config.max_chunk_tokens = chunk
            engine.scheduler.config.max_num_batched_tokens = chunk
            outs = engine.embed(texts[words], params)
            cos, diff, lengths = [], [], []
            for text, o in zip(texts[words], outs):
                want = reference(hf, tok, o.prompt_token_ids, params)
                got = o.embedding
                lengths.append(len(o.prompt_token_ids))
                a, b = got, want
                c = torch.nn.functional.cosine_similarity(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]))
                cos.append(float(c.min()))
                diff.append(float((a - b).abs().max()))
            row = {"pooler": pooling, "chunk": chunk, "tokens": f"{min(lengths)}-{max(lengths)}",
                   "chunks_per_text": -(-max(lengths) // chunk), "min_cosine": min(cos), "max_abs_diff": max(diff)}
            logger.info("%s", row)
            results.append(row)
    write_json(out / "results.json", {"rows": results})
    lines = ["| pooler | chunk tokens | text tokens | chunks per text | min cosine | max abs diff |",
             "|---|---:|---|---:|---:|---:|"]
    lines += [f"| {r['pooler']} | {r['chunk']} | {r['tokens']} | {r['chunks_per_text']} | {r['min_cosine']:.7f} | "
              f"{r['max_abs_diff']:.2e} |" for r in results]
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    logger.info("\n%s", table)


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """The largest absolute difference from the whole-sequence reference against the chunk size, one line per
    pooler (log scale; fp32 rounding is ~1e-7 for a normalised vector). `results`:
    docs/benchmarks/results/paper-chunk-equivalence.json or a run's results.json. Redraw:
    `python scripts/bench/report.py docs/benchmarks/results/paper-chunk-equivalence.json`."""
    rows = result_rows(results)["rows"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for pooler in dict.fromkeys(r["pooler"] for r in rows):
        pts = sorted((r["chunk"], r["max_abs_diff"]) for r in rows if r["pooler"] == pooler)
        worst = min(r["min_cosine"] for r in rows if r["pooler"] == pooler)
        ax.plot([c for c, _ in pts], [d for _, d in pts], marker="o", label=f"{pooler} (min cosine {worst:.7f})")
    ax.set(title="Chunked against whole-sequence embeddings (fp32)", xlabel="chunk size (tokens per step)",
           ylabel="max absolute difference", xscale="log", yscale="log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="center left", ncol=2)
    caption(fig, results.get("machine", ""), results.get("measured"))
    names_out = results.get("plots") or ["chunk-equivalence.png"]
    return [_save(fig, Path(out_dir) / names_out[0])]
