"""Reranking on 2WikiMultihopQA: what a reranker buys (recall@5, EM / F1) and what it costs (q/s, p99), against no
reranking, in one run on the same cores.

    .venv/bin/python scripts/bench_rerank.py --questions dev.jsonl --rerankers backbone \\
        --out docs/benchmarks/results/rerank-epyc-avx512.json

(`dev.jsonl`: a 2WikiMultihopQA dev file.) For each setting, `orthrus-rag run` answers the questions with standard
RAG (one retrieval: recall@5 is the reranker's alone) and with Iter-RetGen (three retrievals a question; q/s and p99
are over the whole chain). The settings are MiniLM's top 5 as they come (no reranking), and MiniLM's top
`--candidates` (50) reranked to 5 by each reranker named in `--rerankers`. Each reranker is a `model.rerankers` entry,
such as `backbone`, `backbone+NAME` (with `--adapter NAME=FOLDER`) or a cross-encoder's folder. The index is built
once from the file's paragraphs. `python scripts/bench/report.py <results file>` redraws the figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("bench_rerank")
ROOT = Path(__file__).resolve().parents[1]
METHODS = {"standard": ["pipeline=standard_rag"], "iter_retgen": ["pipeline=iter_retgen", "pipeline.iterations=3"]}
METRICS = ("recall@2", "recall@5", "em", "f1", "acc")
METHOD_LABELS = {"standard": "standard RAG", "iter_retgen": "Iter-RetGen (3 rounds)"}


def settings(rerankers: list[str], candidates: int, top_k: int) -> dict[str, list[str]]:
    """Each setting's `orthrus-rag run` overrides: none, then one per reranker."""
    out = {"none": [f"retriever.k={top_k}"]}
    for r in rerankers:
        out[r] = [f"retriever.k={candidates}", f"pipeline.top_k={top_k}", f"model.rerankers=[{r}]",
                  "pipeline.reranker=default"]
    return out


def loads(setting: str, adapters: dict[str, str]) -> list[str]:
    """The adapter a `backbone+NAME` setting reads through, and no other (a setting runs with what it names)."""
    _, plus, name = setting.partition("+")
    return [adapters[name]] if plus and name in adapters else []


def row(setting: str, method: str, summary: dict[str, Any]) -> dict[str, Any]:
    out = {"setting": setting, "method": method, "questions": summary["num_questions"],
           "qps": summary["throughput_qps"], "p99_s": summary["latency_s"]["p99"],
           "retrieve_s": summary.get("retrieve_s"), "wall_time_s": summary["wall_time_s"]}
    out.update({m: summary.get(m) for m in METRICS})
    return out


def run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"{' '.join(cmd[:6])} ... failed; see {log}")


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| method | setting | recall@5 | EM | F1 | acc | q/s | p99 (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['setting']} | {r['recall@5']:.3f} | {r['em']:.3f} | {r['f1']:.3f} | "
                     f"{r['acc']:.3f} | {r['qps']:.3f} | {r['p99_s']:.2f} |")
    return "\n".join(lines)


def plot_results(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Standard RAG's recall@5 per setting, and questions/s per setting for each method measured."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import numpy as np
    from bench.report import _plt, _save, caption

    rows = results["results"]["rows"]
    names = list(dict.fromkeys(r["setting"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    plt = _plt()
    fig, (ax_r, ax_q) = plt.subplots(1, 2, figsize=(9, 3.6))
    ax_r.bar(range(len(names)), [next((r["recall@5"] for r in rows if r["setting"] == n and r["method"] == "standard"),
                                      0.0) for n in names])
    ax_r.set_title("recall@5 (standard RAG)", fontsize=9)
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        xs = np.arange(len(names)) + (j - (len(methods) - 1) / 2) * width
        ax_q.bar(xs, [next((r["qps"] for r in rows if r["setting"] == n and r["method"] == method), 0.0)
                      for n in names], width, label=METHOD_LABELS.get(method, method))
    ax_q.set_title("questions / s", fontsize=9)
    ax_q.legend(fontsize=7)
    for ax in (ax_r, ax_q):
        ax.set_xticks(range(len(names)), names, fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    caption(fig, results["machine"], results.get("measured"))
    return [_save(fig, Path(out_dir) / results["plots"][0])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", required=True, help="2WikiMultihopQA dev JSONL (its paragraphs are the corpus)")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--rerankers", default="backbone", help="comma-separated model.rerankers entries")
    ap.add_argument("--adapter", action="append", default=[], metavar="NAME=FOLDER",
                    help="a LoRA adapter a `backbone+NAME` reranker reads through (repeat)")
    ap.add_argument("--candidates", type=int, default=50, help="passages the retriever gives the reranker")
    ap.add_argument("--top-k", type=int, default=5, help="passages kept for the prompt")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--work", type=Path, default=Path("runs/bench_rerank"))
    ap.add_argument("--out", type=Path, default=None, help="the results file (docs/benchmarks/results/X.json)")
    ap.add_argument("--resume", action="store_true",
                    help="read back the runs that finished in --work (same questions, rerankers and machine) "
                         "instead of running them again")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: the table and --out from the runs that finished in --work")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "orthrus_rag.entrypoints.cli"]
    common = ["dataset=2wiki", f"dataset.path={args.questions}", f"dataset.limit={args.limit}", "progress=false"]
    adapters = {name: f"+model.adapters.{name}={folder}"
                for name, _, folder in (a.partition("=") for a in args.adapter)}
    index = work / "index"
    if not args.report_only and not (index / "index" / "manifest.json").is_file():
        run(cli + ["index", "dataset=2wiki", f"dataset.path={args.questions}", f"run_dir={index}"], work / "index.log")
    rows = []
    # NOTE: method by method, so the quality of every setting (standard RAG, the fast one) is in before the
    # Iter-RetGen timings; with --resume a run that finished (its summary.json) is read, not run again
    for method in [m for m in args.methods.split(",") if m]:
        for setting, overrides in settings([r for r in args.rerankers.split(",") if r], args.candidates,
                                           args.top_k).items():
            run_dir = work / "runs" / f"{setting.replace('/', '_')}-{method}"
            summary = run_dir / "summary.json"
            if args.report_only and not summary.is_file():
                logger.warning("%s %s: not run yet (no %s); left out", setting, method, summary)
                continue
            if (args.resume or args.report_only) and summary.is_file():
                logger.info("%s %s: finished before (%s), read back", setting, method, summary)
            else:
                if summary.is_file():
                    summary.unlink()  # NOTE: a stale summary must not stand in for a run that fails now
                run(cli + ["run", *common, f"retriever.index_dir={index / 'index'}", f"run_dir={run_dir}",
                           *METHODS[method], *overrides, *loads(setting, adapters)],
                    work / f"{run_dir.name}.log")
            rows.append(row(setting, method, json.loads(summary.read_text())))
            logger.info("%s %s: recall@5 %.3f, EM %.3f, %.3f q/s", setting, method, rows[-1]["recall@5"],
                        rows[-1]["em"], rows[-1]["qps"])
    print(table(rows))
    if args.out is not None:
        import torch

        sys.path.insert(0, str(ROOT / "scripts"))
        from bench_flashrag import machine

        m = machine()
        results = {
            "workload": f"the first {args.limit} 2WikiMultihopQA dev questions, SmolLM2-135M-Instruct generating, "
                        f"all-MiniLM-L6-v2's top {args.top_k} (no reranking) against its top {args.candidates} "
                        f"reranked to {args.top_k}; standard RAG and Iter-RetGen (3 rounds)",
            "machine": f"{m['cpu']}, {m['isa']}, {m['cores']} cores; torch {torch.__version__}, dtype auto",
            "measured": datetime.date.today().isoformat(),
            "command": [" ".join(["python", "scripts/bench_rerank.py", *(argv or sys.argv[1:])])],
            "script": "scripts/bench_rerank.py", "plots": [args.out.stem + ".png"],
            "results": {"rows": rows, "limit": args.limit, "candidates": args.candidates, "top_k": args.top_k}}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        img = args.out.parent.parent / "img" if args.out.parent.name == "results" else args.out.parent
        plot_results(results, img)
    return 0


if __name__ == "__main__":
    sys.exit(main())
