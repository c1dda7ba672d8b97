"""Many LoRA adapters in one engine: the same mixed load (generations and embeddings in shared steps) with the
generation requests spread evenly over 0, 1, 4 and 16 adapters, for each way of adding the adapters' updates
(`per_slot`: two small products per adapter and module; `stacked`: every adapter's A and B in one product each).

    python scripts/bench_lora.py                       # dtype auto, 1 thread, adapters of rank 8 on all 7 projections
    python scripts/bench_lora.py --dtype float32 --counts 0,1,4,16 --repeats 2

The adapters are random (scripts/make_lora_adapter.py's `make_adapter`), written to a temporary folder. Runs
alternate kernels and counts (A B ... B A) so drift hits every column alike. One JSON line per run, then a summary
per (count, kernel): generated tokens per second and its ratio to the base alone. `plot_results` redraws the
committed figure (docs/benchmarks/results/features-lora-*.json; the page is docs/benchmarks/features.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Draw the PNG a committed results file names (docs/benchmarks/results/features-lora-*.json, redrawn by
    scripts/bench/report.py): generated tokens/s against the number of adapters, one line per kernel, from the
    summary lines (`results["results"]["rows"]`; the base row, 0 adapters, starts every line)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench.report import _plt, _save, caption

    rows = results["results"]["rows"]
    base = next(r for r in rows if r["adapters"] == 0)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = {"auto": "auto (the fused C++ kernel, default)", "per_slot": "per_slot (torch ops)",
              "stacked": "stacked (torch ops)"}
    for kernel in dict.fromkeys(r["kernel"] for r in rows if r["adapters"]):
        mine = [base] + sorted((r for r in rows if r["kernel"] == kernel and r["adapters"]),
                               key=lambda r: r["adapters"])
        ax.plot([r["adapters"] for r in mine], [r["gen_tok_s"] for r in mine], marker="o",
                label=labels.get(kernel, kernel))
    ax.set_xscale("symlog", linthresh=1)
    ticks = sorted({r["adapters"] for r in rows})
    ax.set_xticks(ticks, [str(v) for v in ticks])
    ax.set(title="Many LoRA adapters in one mixed load (rank 8, all seven projections)",
           xlabel="distinct adapters among the generations", ylabel="generated tokens/s", ylim=(0, None))
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    caption(fig, results["machine"], results.get("measured"))
    return [_save(fig, Path(out_dir) / results["plots"][0])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--counts", default="0,1,4,16")
    ap.add_argument("--kernels", default="per_slot,stacked")
    ap.add_argument("--generations", type=int, default=32)
    ap.add_argument("--embeddings", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from orthrus_rag import Engine, SamplingParams
    from orthrus_rag.layers.lora import set_lora_kernel
    from orthrus_rag.machine import cpu_model
    from orthrus_rag.models.registry import resolve_model_path
    from scripts.make_lora_adapter import make_adapter

    counts = [int(c) for c in args.counts.split(",")]
    kernels = args.kernels.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="orthrus-lora-bench-"))
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(args.model)), dtype=torch.float32)
    names = [f"a{i}" for i in range(max(counts))]
    for i, name in enumerate(names):
        make_adapter(hf, str(tmp / name), rank=args.rank, alpha=2 * args.rank, init="random", seed=i,
                     targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    del hf
    engine = Engine.from_pretrained(args.model, dtype=args.dtype,
                                    adapters={n: str(tmp / n) for n in names}, num_threads=args.threads)
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write a line about topic number {i}."}],
                                       tokenize=False, add_generation_prompt=True) for i in range(args.generations)]
    texts = [f"Passage {i}: a short text about topic {i % 7} and its history." for i in range(args.embeddings)]
    engine.run(prompts[:4], SamplingParams(max_tokens=4, temperature=0), texts[:4])  # warm-up

    def run(count: int, kernel: str) -> dict:
        set_lora_kernel(engine.runner.model, kernel)
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                                 adapter=names[i % count] if count else None) for i in range(args.generations)]
        engine.step_stats.clear()
        t0 = time.perf_counter()
        gens, embs = engine.run(prompts, params, texts)
        wall = time.perf_counter() - t0
        steps = list(engine.step_stats)
        decode = [s.step_time for s in steps if s.num_decode_tokens and not s.num_prefill_tokens
                  and not s.num_embed_tokens]
        return {"adapters": count, "kernel": kernel, "cpu": cpu_model(), "threads": args.threads,
                "dtype": str(next(engine.runner.model.parameters()).dtype), "rank": args.rank,
                "wall_s": round(wall, 2), "gen_tok_s": round(sum(len(o.token_ids) for o in gens) / wall, 1),
                "emb_per_s": round(len(embs) / wall, 1), "mixed_steps": sum(s.is_mixed for s in steps),
                "max_adapters_in_a_step": max((s.num_adapters for s in steps), default=0),
                "decode_step_ms_median": round(1e3 * statistics.median(decode), 2) if decode else None}

    plan = [(c, k) for c in counts for k in (kernels if c else kernels[:1])]
    order = (plan + plan[::-1]) * args.repeats
    results: dict[tuple[int, str], list[dict]] = {p: [] for p in plan}
    for count, kernel in order:
        row = run(count, kernel)
        results[(count, kernel)].append(row)
        print(json.dumps(row), flush=True)
    base = statistics.median(r["gen_tok_s"] for r in results[plan[0]])
    for (count, kernel), rows in results.items():
        tok_s = statistics.median(r["gen_tok_s"] for r in rows)
        print(json.dumps({"summary": True, "adapters": count, "kernel": kernel if count else "base",
                          "gen_tok_s": tok_s, "vs_base": round(tok_s / base, 3),
                          "emb_per_s": statistics.median(r["emb_per_s"] for r in rows),
                          "decode_step_ms_median": statistics.median(r["decode_step_ms_median"] or 0 for r in rows)}),
              flush=True)


if __name__ == "__main__":
    main()
