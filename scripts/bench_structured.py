"""What structured outputs cost in a mixed load: the same generations and embeddings with 0%, 10% and 100% of the
generations constrained by a nested JSON schema, in one engine, run alternately (A B C C B A).

Reports per run: generated tokens per second, embeddings per second, the median decode-step time, and per
constrained row the time the runner waited for and applied the grammar masks (on the step's critical path) and
the time spent filling them (in a worker thread, overlapping the forward). Prompts ask for JSON
in every run, so the unconstrained rows write similar text; only the constraint differs.

    python scripts/bench_structured.py                       # dtype auto (bf16 where the CPU has it), 1 thread
    python scripts/bench_structured.py --dtype float32 --threads 2

One JSON line per run, then a summary line per fraction (median over the repeats). `plot_results` redraws the
committed figure (docs/benchmarks/results/features-structured-*.json; the page is docs/benchmarks/features.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Draw the PNG a committed results file names (docs/benchmarks/results/features-structured-*.json, redrawn by
    scripts/bench/report.py): generated tokens/s and the median decode step per constrained fraction, from the
    summary lines (`results["results"]["rows"]`)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench.report import _plt, _save, caption, style_bars

    rows = sorted(results["results"]["rows"], key=lambda r: r["constrained_fraction"])
    labels = [f"{r['constrained_fraction']:.0%}" for r in rows]
    plt = _plt()
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(7, 4))
    bars = ax_t.bar(labels, [r["gen_tok_s"] for r in rows], color="tab:blue")
    ax_t.bar_label(bars, [f"{r['gen_tok_s']:g}" for r in rows], fontsize=7)
    ax_t.set(title="generated tokens/s", xlabel="generations under a JSON schema", ylabel="tokens/s")
    bars = ax_s.bar(labels, [r["decode_step_ms_median"] for r in rows], color="tab:orange")
    ax_s.bar_label(bars, [f"{r['decode_step_ms_median']:g}" for r in rows], fontsize=7)
    ax_s.set(title="median decode step", xlabel="generations under a JSON schema", ylabel="ms")
    style_bars(ax_t, ax_s)
    fig.suptitle("Structured outputs in a mixed load (40 generations, 80 embeddings)", fontsize=10)
    caption(fig, results["machine"], results.get("measured"))
    return [_save(fig, Path(out_dir) / results["plots"][0])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--generations", type=int, default=40)
    ap.add_argument("--embeddings", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--fractions", default="0,0.1,1")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from orthrus_rag import Engine, SamplingParams
    from orthrus_rag.engine.executor import runner as runner_module
    from orthrus_rag.machine import cpu_model
    from orthrus_rag.params import StructuredOutputsParams
    from orthrus_rag.structured import bitmask

    schema = {"type": "object", "additionalProperties": False, "required": ["answer", "confidence", "evidence"],
              "properties": {"answer": {"type": "string", "maxLength": 40},
                             "confidence": {"enum": ["low", "medium", "high"]},
                             "evidence": {"type": "array", "maxItems": 3, "items": {
                                 "type": "object", "additionalProperties": False, "required": ["title", "year"],
                                 "properties": {"title": {"type": "string", "maxLength": 40},
                                                "year": {"type": "integer", "minimum": 1000, "maximum": 2100}}}}}}
    spec = StructuredOutputsParams(json=schema)
    engine = Engine.from_pretrained(args.model, dtype=args.dtype)
    tok = engine.tokenizer
    topics = ["the Eiffel Tower", "penicillin", "the printing press", "Mount Everest", "the telephone", "DNA",
              "the steam engine", "the Internet"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"As JSON, report a finding about "
                                         f"{topics[i % len(topics)]} with evidence (case {i})."}],
                                       tokenize=False, add_generation_prompt=True) for i in range(args.generations)]
    texts = [f"Passage {i}: a short text about {topics[i % len(topics)]} and its history." for i in
             range(args.embeddings)]
    engine.grammars.prepare(spec)  # the compile is once per schema, not part of the load

    masked_s = [0.0, 0.0]  # critical path (wait + apply), fill (worker thread)
    real_constrain, real_filled = bitmask.constrain, bitmask._filled

    def timed(fn, slot):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                masked_s[slot] += time.perf_counter() - t0
        return wrapper

    runner_module.constrain = timed(real_constrain, 0)  # the runner's own reference
    bitmask._filled = timed(real_filled, 1)
    fractions = [float(f) for f in args.fractions.split(",")]

    def run(fraction: float) -> dict:
        n = round(fraction * args.generations)
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                 structured_outputs=spec if i < n else None) for i in range(args.generations)]
        engine.step_stats.clear()
        masked_s[0] = masked_s[1] = 0.0
        t0 = time.perf_counter()
        gens, embs = engine.run(prompts, params, texts)
        wall = time.perf_counter() - t0
        steps = list(engine.step_stats)
        decode = [s.step_time for s in steps if s.num_decode_tokens and not s.num_prefill_tokens
                  and not s.num_embed_tokens]
        rows = sum(s.num_constrained_rows for s in steps)
        tokens = sum(len(o.token_ids) for o in gens)
        valid = 0
        for o in gens[:n]:
            try:
                json.loads(o.text)
                valid += 1
            except json.JSONDecodeError:
                pass
        return {"constrained_fraction": fraction, "constrained_requests": n, "cpu": cpu_model(),
                "dtype": str(next(engine.runner.model.parameters()).dtype), "threads": args.threads,
                "wall_s": round(wall, 2), "gen_tok_s": round(tokens / wall, 1), "generated_tokens": tokens,
                "emb_per_s": round(len(embs) / wall, 1), "steps": len(steps),
                "mixed_steps": sum(s.is_mixed for s in steps),
                "decode_step_ms_median": round(1e3 * statistics.median(decode), 2) if decode else None,
                "mask_ms_per_constrained_row": round(1e3 * masked_s[0] / rows, 3) if rows else None,
                "fill_ms_per_constrained_row": round(1e3 * masked_s[1] / rows, 3) if rows else None,
                "mask_share_of_wall": round(masked_s[0] / wall, 4), "valid_json": f"{valid}/{n}",
                "lengths_cut": sum(o.finish_reason == "length" for o in gens[:n])}

    # warm-up, constrained too: llguidance builds its lexer's states lazily, shared by every copy of the compiled
    # grammar, so the first requests of a new schema pay more per token than the rest (3.4 against 0.14 ms a row
    # on the EPYC); a server meets that once per schema
    engine.run(prompts[:8], [SamplingParams(max_tokens=args.max_tokens, temperature=0, structured_outputs=spec)] * 8,
               texts[:4])
    results: dict[float, list[dict]] = {f: [] for f in fractions}
    for fraction in fractions + fractions[::-1]:
        row = run(fraction)
        results[fraction].append(row)
        print(json.dumps(row), flush=True)
    for fraction, rows in results.items():
        print(json.dumps({"summary": True, "constrained_fraction": fraction,
                          "gen_tok_s": statistics.median(r["gen_tok_s"] for r in rows),
                          "emb_per_s": statistics.median(r["emb_per_s"] for r in rows),
                          "decode_step_ms_median": statistics.median(r["decode_step_ms_median"] or 0 for r in rows),
                          "mask_ms_per_constrained_row": rows[0]["mask_ms_per_constrained_row"],
                          "fill_ms_per_constrained_row": rows[0]["fill_ms_per_constrained_row"]}), flush=True)


if __name__ == "__main__":
    main()
