"""Ratio sweep (paper Fig. "throughput per ratio"): closed-loop clients at saturation, embed:gen mixes from
9:1 to 1:9; completed requests/s and latency per kind for every system."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from ..driver import RunResult, closed_loop, summarize
from ..harness import Session, workload
from ..report import markdown_table, plot_latency_cdf, plot_step_mix, plot_throughput, write_json
from ..workloads import mixed_stream
from .common import by_group, first_peer, rows

logger = logging.getLogger(__name__)


def run_system(session: Session, cfg: DictConfig) -> dict[str, RunResult]:
    x = cfg.experiment
    out: dict[str, RunResult] = {}
    for i, ratio in enumerate(x.ratios):
        e, g = (float(v) for v in str(ratio).split(":"))
        if i and x.fresh_system_per_mix:
            session.reset()
        stream = mixed_stream(e / (e + g), workload(cfg), prefix=str(ratio))
        res = session.run(closed_loop(session.client, stream, x.clients, x.duration_s,
                                      drain_timeout_s=x.drain_timeout_s, label=f"{session.name} {ratio}",
                                      warmup_s=x.warmup_s))
        k = summarize(res)["kinds"]
        logger.info("%s %s: embed %.2f req/s (p95 %.2f s), generate %.2f req/s (p95 %.2f s)", session.name, ratio,
                    k["embed"]["throughput_rps"], k["embed"]["p95_s"], k["generate"]["throughput_rps"],
                    k["generate"]["p95_s"])
        out[str(ratio)] = res
        if any(r.finish_s is None for r in res.records) and i + 1 < len(x.ratios):
            session.reset()  # NOTE: leftovers would load the next mix; start clean
    return out


def report(cfg: DictConfig, results: dict[str, dict[str, dict]], out: Path) -> None:
    groups = [str(r) for r in cfg.experiment.ratios]
    table_rows = rows(results, groups)
    write_json(out / "results.json", {"rows": table_rows, "runs": results})
    table = markdown_table(table_rows, baseline=cfg.baseline, peer=first_peer(cfg, results))
    (out / "table.md").write_text(table)
    plot_throughput(table_rows, out / "throughput.png")
    for g in groups:
        tag = g.replace(":", "-")
        plot_latency_cdf(by_group(results, g), out / f"latency_cdf_{tag}.png", title=f"({g})")
        plot_step_mix(by_group(results, g), out / f"step_mix_{tag}.png", title=f"({g})")
    logger.info("\n%s", table)
