"""Open-loop Poisson arrivals at several rates (paper: latency-throughput curves): each request's latency counts
from its scheduled arrival, so a system that falls behind shows it in its tail."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from ..driver import RunResult, by_group, open_loop
from ..harness import Session, first_peer, workload
from ..report import _fmt, _plt, _save, caption, plot_latency_cdf, result_rows, write_json
from ..workloads import poisson

logger = logging.getLogger(__name__)
# `experiment=poisson` (scripts/benchmark.py): these settings over bench.yaml's, any key of it
CONFIG = """
# Paper: Poisson arrivals at several rates, latency-throughput curves per policy. Here: half embeddings,
# 25 s of arrivals per rate (then the backlog drains), rates from light load to past saturation.
experiment:
  name: poisson
  rates: [4, 8, 16]
  embed_fraction: 0.5
  duration_s: 25
  drain_timeout_s: 180
"""
KINDS = ("embed", "generate")


def run_system(session: Session, cfg: DictConfig) -> dict[str, RunResult]:
    x = cfg.experiment
    out: dict[str, RunResult] = {}
    for i, rate in enumerate(x.rates):
        if i:
            session.reset()  # NOTE: every rate starts from an idle system (a backlog would carry over)
        # a Poisson process over the window: draw more arrivals than expected, keep those inside it
        n = int(2 * float(rate) * x.duration_s) + 20
        schedule = [r for r in poisson(float(rate), n, x.embed_fraction, workload(cfg)) if r.arrival_s < x.duration_s]
        out[str(rate)] = session.run(open_loop(session.client, schedule, x.duration_s,
                                               drain_timeout_s=x.drain_timeout_s, label=f"{session.name} {rate}/s"))
    return out


def curve_point(run: dict, offered: float) -> dict:
    """Achieved completions/s within the arrival window, and latency of every request that finished (backlog
    included), per kind."""
    window = run["window_s"]
    recs = run["records"]
    done = [r for r in recs if r["finish_s"] is not None and r["error"] is None]
    point = {"offered_rps": offered, "submitted": len(recs), "completed": len(done),
             "unfinished": len(recs) - len(done),
             "achieved_rps": sum(r["finish_s"] <= window for r in done) / window if window else float("nan")}
    for kind in KINDS:
        lat = [r["finish_s"] - r["start_s"] for r in done if r["kind"] == kind]
        p = np.percentile(lat, [50, 95, 99]).tolist() if lat else [float("nan")] * 3
        point.update({f"{kind}_p50_s": p[0], f"{kind}_p95_s": p[1], f"{kind}_p99_s": p[2]})
    return point


def report(cfg: DictConfig, results: dict[str, dict[str, dict]], out: Path) -> None:
    rates = [str(r) for r in cfg.experiment.rates]
    curves = {s: [curve_point(runs[r], float(r)) for r in rates if r in runs] for s, runs in results.items()}
    write_json(out / "results.json", {"curves": curves, "runs": results})
    refs = [r for r in (cfg.baseline, first_peer(cfg, results)) if r and r in curves]
    head = ["offered req/s", "system", "achieved req/s", "emb p50/p95/p99 s", "gen p50/p95/p99 s",
            *[f"gen p99 × {r}" for r in refs], "unfinished"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, rate in enumerate(rates):
        for system, pts in curves.items():
            if i >= len(pts):
                continue
            p = pts[i]
            cells = [rate, system, _fmt(p["achieved_rps"])]
            cells += ["/".join(_fmt(p[f"{k}_{q}_s"]) for q in ("p50", "p95", "p99")) for k in KINDS]
            cells += [_fmt(p["generate_p99_s"] / curves[ref][i]["generate_p99_s"]) + "×" for ref in refs]
            cells.append(str(p["unfinished"]))
            lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    plot_curves(curves, out / "latency_throughput.png")
    for r in rates:
        plot_latency_cdf(by_group(results, r), out / f"latency_cdf_{r}rps.png", title=f"({r} req/s offered)")
    logger.info("\n%s", table)


def plot_curves(curves: dict[str, list[dict]], path: Path) -> Path:
    """p50 and p99 latency per kind against achieved throughput, one line per system."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, kind in zip(axes, KINDS):
        for system, pts in curves.items():
            x = [p["achieved_rps"] for p in pts]
            line, = ax.plot(x, [p[f"{kind}_p99_s"] for p in pts], marker="o", label=f"{system} p99")
            ax.plot(x, [p[f"{kind}_p50_s"] for p in pts], marker=".", ls="--", color=line.get_color())
        ax.set(title=f"{kind} latency (solid p99, dashed p50)", xlabel="achieved requests/s (both kinds)",
               ylabel="latency (s)", yscale="log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """p99 latency per kind against the offered rate, one line per system (log scale). `results`:
    docs/benchmarks/results/paper-poisson.json or a run's results.json. Redraw:
    `python scripts/bench/report.py docs/benchmarks/results/paper-poisson.json`."""
    curves = result_rows(results)["curves"]
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(8, 4), sharey=True)
    for ax, kind in zip(axes, KINDS):
        for system, pts in curves.items():
            ax.plot([p["offered_rps"] for p in pts], [p[f"{kind}_p99_s"] for p in pts], marker="o", label=system,
                    lw=2.2 if system == "orthrus" else 1.2)
        ax.set(title=f"{kind} p99 latency", xlabel="offered requests/s (half embeddings)", yscale="log")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("p99 latency (s), log scale")
    axes[0].legend(fontsize=7)
    caption(fig, results.get("machine", ""), results.get("measured"))
    names_out = results.get("plots") or ["poisson.png"]
    return [_save(fig, Path(out_dir) / names_out[0])]
