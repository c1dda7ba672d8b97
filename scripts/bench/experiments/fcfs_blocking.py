"""Worst case for FCFS (paper: 375 generations of 1,024 tokens, then 250 embeddings, all at once): a burst of
long generations that fills the sequence slots, then a burst of embeddings behind it; latency per kind."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from ..driver import RunResult, open_loop
from ..harness import Session, workload
from ..report import markdown_table, plot_latency_cdf, plot_step_mix, write_json
from ..workloads import fcfs_blocking
from .common import by_group, first_peer, rows

logger = logging.getLogger(__name__)
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
