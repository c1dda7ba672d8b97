"""Three-phase workload (paper: 250 requests per phase at 10% / 50% / 90% embeddings, at most C in flight):
per-phase throughput and how busy the hardware was (CPU use, and for one engine the share of the step budget
filled)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from ..driver import RunResult, closed_loop
from ..harness import Session, first_peer, workload
from ..report import _fmt, _plt, _save, caption, plot_latency_cdf, plot_step_mix, result_rows, write_json
from ..workloads import three_phase

logger = logging.getLogger(__name__)
# `experiment=three_phase` (scripts/benchmark.py): these settings over bench.yaml's, any key of it
CONFIG = """
# Paper: 250 requests per phase (10% / 50% / 90% embeddings), at most C in flight. Here: 200 per phase,
# 64 clients, the shared workload sizes (32 words, 32 tokens).
experiment:
  name: three_phase
  per_phase: 200
  fractions: [0.1, 0.5, 0.9]
  clients: 64
  drain_timeout_s: 600
"""
GROUP = "all"


def run_system(session: Session, cfg: DictConfig) -> dict[str, RunResult]:
    x = cfg.experiment
    phases = three_phase(x.per_phase, workload(cfg), tuple(x.fractions))
    reqs = [r for phase in phases for r in phase]
    res = session.run(closed_loop(session.client, reqs, x.clients, None, drain_timeout_s=x.drain_timeout_s,
                                  label=f"{session.name} three-phase"))
    return {GROUP: res}


def phase_stats(run: dict, budget: int) -> list[dict]:
    """Per phase, over disjoint time windows (phase k: from its first submission to the next phase's first; the
    last phase until everything finished, so it includes the drain): completions per second (any phase's),
    latency per kind of the phase's own requests, mean CPU % and (one engine) the share of the step budget
    filled and the share of time spent in steps."""
    recs = run["records"]
    phases = sorted({r["tags"]["phase"] for r in recs})
    firsts = [min(r["start_s"] for r in recs if r["tags"]["phase"] == k) for k in phases]
    end = max((r["finish_s"] for r in recs if r["finish_s"] is not None), default=float("nan"))
    out = []
    for i, k in enumerate(phases):
        t0, t1 = firsts[i], firsts[i + 1] if i + 1 < len(phases) else end
        span = t1 - t0
        own = [r for r in recs if r["tags"]["phase"] == k]
        done = [r for r in own if r["finish_s"] is not None and r["error"] is None]
        finished = sum(r["finish_s"] is not None and r["error"] is None and t0 < r["finish_s"] <= t1 for r in recs)
        row = {"phase": k, "embed_frac": sum(r["kind"] == "embed" for r in own) / len(own),
               "completed": len(done), "unfinished": len(own) - len(done), "window_s": [t0, t1], "span_s": span,
               "throughput_rps": finished / span if span > 0 else float("nan")}
        for kind in ("embed", "generate"):
            lat = [r["finish_s"] - r["start_s"] for r in done if r["kind"] == kind]
            row[f"{kind}_p50_s"], row[f"{kind}_p99_s"] = (np.percentile(lat, [50, 99]).tolist() if lat
                                                          else [float("nan")] * 2)
        cpu = [c for t, c in run["cpu"] if t0 <= t <= t1]
        row["cpu_mean_pct"] = float(np.mean(cpu)) if cpu else float("nan")
        steps = [s for s in run["steps"] if t0 <= s["t"] <= t1]
        row["budget_fill"] = (float(np.mean([(s["embed"] + s["prefill"] + s["decode"]) / budget for s in steps]))
                              if steps else float("nan"))
        row["busy_frac"] = (sum(s["step_time"] for s in steps) / span) if steps and span > 0 else float("nan")
        out.append(row)
    return out


def report(cfg: DictConfig, results: dict[str, dict[str, dict]], out: Path) -> None:
    budget = cfg.scheduler.max_num_batched_tokens
    stats = {system: phase_stats(runs[GROUP], budget) for system, runs in results.items()}
    write_json(out / "results.json", {"phases": stats, "runs": results})
    refs = [r for r in (cfg.baseline, first_peer(cfg, results)) if r and r in stats]
    head = ["phase (embed %)", "system", "window s", "req/s", *[f"× {r}" for r in refs], "emb p50/p99 s", "gen p50/p99 s",
            "CPU %", "budget filled", "engine busy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    phases = max((len(s) for s in stats.values()), default=0)
    for k in range(phases):
        for system, rows in stats.items():
            if k >= len(rows):
                continue
            r = rows[k]
            cells = [f"{k + 1} ({100 * r['embed_frac']:.0f}%)", system,
                     f"{r['window_s'][0]:.0f}-{r['window_s'][1]:.0f}", _fmt(r["throughput_rps"])]
            cells += [_fmt(r["throughput_rps"] / stats[ref][k]["throughput_rps"]) + "×" for ref in refs]
            cells += [f"{_fmt(r['embed_p50_s'])}/{_fmt(r['embed_p99_s'])}",
                      f"{_fmt(r['generate_p50_s'])}/{_fmt(r['generate_p99_s'])}", _fmt(r["cpu_mean_pct"], 0),
                      _fmt(100 * r["budget_fill"], 0) + "%" if r["budget_fill"] == r["budget_fill"] else "–",
                      _fmt(100 * r["busy_frac"], 0) + "%" if r["busy_frac"] == r["busy_frac"] else "–"]
            lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    plot_completions(results, out / "completions.png")
    plot_latency_cdf({s: runs[GROUP] for s, runs in results.items()}, out / "latency_cdf.png", title="(three-phase)")
    plot_step_mix({s: runs[GROUP] for s, runs in results.items()}, out / "step_mix.png", title="(three-phase)")
    logger.info("\n%s", table)


def plot_completions(results: dict[str, dict[str, dict]], path: Path, bin_s: float = 2.0) -> Path:
    """Completed requests/s over time per system, phases shaded by their first submission."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 4))
    for system, runs in results.items():
        fin = np.array([r["finish_s"] for r in runs[GROUP]["records"] if r["finish_s"] is not None])
        if not len(fin):
            continue
        edges = np.arange(0.0, fin.max() + bin_s, bin_s)
        ax.plot(edges[:-1], np.histogram(fin, edges)[0] / bin_s, label=system)
    ax.set(title="completed requests/s (three phases: 10% / 50% / 90% embeddings)", xlabel="time (s)",
           ylabel="requests/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Completed requests/s per phase, one bar per system. `results`: docs/benchmarks/results/paper-three-phase.json
    or a run's results.json. Redraw: `python scripts/bench/report.py docs/benchmarks/results/paper-three-phase.json`."""
    phases = result_rows(results)["phases"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    systems = list(phases)
    n = max(len(rows) for rows in phases.values())
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        rows = phases[system]
        xs = [k + (i - (len(systems) - 1) / 2) * width for k in range(len(rows))]
        ax.bar(xs, [r["throughput_rps"] for r in rows], width, label=system)
    first = phases[systems[0]]
    ax.set_xticks(range(n), [f"phase {k + 1} ({100 * first[k]['embed_frac']:.0f}% embeddings)" for k in range(n)])
    ax.set(title="Three phases: completed requests/s per phase (higher is better)", ylabel="requests/s")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=2)
    caption(fig, results.get("machine", ""), results.get("measured"))
    names_out = results.get("plots") or ["three-phase.png"]
    return [_save(fig, Path(out_dir) / names_out[0])]
