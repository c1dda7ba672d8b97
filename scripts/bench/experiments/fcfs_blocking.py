"""Worst case for FCFS (paper: 375 generations of 1,024 tokens, then 250 embeddings, all at once): a burst of
long generations that fills the sequence slots, then a burst of embeddings behind it; latency per kind."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from ..driver import RunResult, by_group, open_loop, rows
from ..harness import Session, first_peer, workload
from ..report import _plt, _save, caption, markdown_table, plot_latency_cdf, plot_step_mix, result_rows, write_json
from ..workloads import fcfs_blocking

logger = logging.getLogger(__name__)
# `experiment=fcfs_blocking` (scripts/benchmark.py): these settings over bench.yaml's, any key of it
CONFIG = """
# Paper: 375 generations of 1,024 tokens, then 250 embeddings, all at time 0, max_num_seqs below the burst.
# Here: 48 generations of 128 tokens, then 64 embeddings (32 words each), with 32 sequence slots, so a
# second wave of generations waits and, under strict FCFS, the embeddings wait behind it. Lengths do not vary
# here (spread 0): with varied lengths the first short generations free slots early and the blocking shrinks
# (measured: hetero-fcfs embedding p99 4.8 s against orthrus' 4.3 s with spread 0.5).
experiment:
  name: fcfs_blocking
  num_generate: 48
  num_embed: 64
  long_max_tokens: 128
  drain_timeout_s: 900
scheduler:
  max_num_seqs: 32
workload:
  spread: 0.0
"""
GROUP = "burst"


def run_system(session: Session, cfg: DictConfig) -> dict[str, RunResult]:
    x = cfg.experiment
    burst = fcfs_blocking(x.num_generate, x.num_embed, workload(cfg), x.long_max_tokens)
    res = session.run(open_loop(session.client, burst, None, drain_timeout_s=x.drain_timeout_s,
                                 label=f"{session.name} burst"))
    return {GROUP: res}


def report(cfg: DictConfig, results: dict[str, dict[str, dict]], out: Path) -> None:
    # NOTE: the window is each system's own makespan, so req/s is the burst size over the time to finish it
    for runs in results.values():
        run = runs[GROUP]
        run["window_s"] = max((r["finish_s"] for r in run["records"] if r["finish_s"] is not None), default=0.0)
    table_rows = rows(results, [GROUP])
    for r in table_rows:
        r["makespan_s"] = r["window_s"]
    write_json(out / "results.json", {"rows": table_rows, "runs": results})
    table = markdown_table(table_rows, baseline=cfg.baseline, peer=first_peer(cfg, results), group_name="workload")
    table += "\nmakespan (s): " + ", ".join(f"{r['system']} {r['makespan_s']:.1f}" for r in table_rows) + "\n"
    (out / "table.md").write_text(table)
    plot_latency_cdf(by_group(results, GROUP), out / "latency_cdf.png", title="(FCFS-blocking burst)")
    plot_step_mix(by_group(results, GROUP), out / "step_mix.png", title="(FCFS-blocking burst)")
    logger.info("\n%s", table)


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Each system's embedding p99 (what strict FCFS inflates) and its makespan for the burst, side by side.
    `results`: docs/benchmarks/results/paper-fcfs-blocking.json or a run's results.json. Redraw:
    `python scripts/bench/report.py docs/benchmarks/results/paper-fcfs-blocking.json`."""
    rows = result_rows(results)["rows"]
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(8, 4))
    names = [r["system"] for r in rows]
    colors = ["tab:blue" if n == "orthrus" else "tab:gray" if n in ("vllm", "hf") else "tab:cyan" for n in names]
    for ax, values, title, unit in (
            (axes[0], [r["kinds"]["embed"]["p99_s"] for r in rows], "embedding p99", "seconds"),
            (axes[1], [r["makespan_s"] for r in rows], "makespan of the burst", "seconds")):
        ax.barh(names, values, color=colors)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.1f}", va="center", fontsize=7)
        ax.set(title=f"{title} (lower is better)", xlabel=unit)
        ax.invert_yaxis()
        ax.margins(x=0.15)
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle("Worst-case FCFS blocking: 48 long generations, then 64 embeddings at once", fontsize=10)
    caption(fig, results.get("machine", ""), results.get("measured"))
    names_out = results.get("plots") or ["fcfs-blocking.png"]
    return [_save(fig, Path(out_dir) / names_out[0])]
