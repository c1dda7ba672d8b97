"""Ratio sweep (paper Fig. "throughput per ratio"): closed-loop clients at saturation, embed:gen mixes from
9:1 to 1:9; completed requests/s and latency per kind for every system."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from ..driver import RunResult, by_group, closed_loop, rows, summarize
from ..harness import Session, first_peer, workload
from ..report import (
    _plt,
    _save,
    caption,
    markdown_table,
    plot_latency_cdf,
    plot_step_mix,
    plot_throughput,
    result_rows,
    write_json,
)
from ..workloads import mixed_stream

logger = logging.getLogger(__name__)
# `experiment=ratio_sweep` (scripts/benchmark.py): these settings over bench.yaml's, any key of it
CONFIG = """
# Paper: 64 closed-loop clients x 120 s per mix, inputs of 128 words, max_tokens 150 at temperature 0.7.
# Here: 64 clients x 35 s per mix, of which the first 10 s are warm-up (not counted), 16-48 words,
# 16-48 tokens (ignore_eos: a generation's work is its drawn length on every system).
experiment:
  name: ratio_sweep
  ratios: ["9:1", "7:3", "5:5", "3:7", "1:9"]
  clients: 64
  duration_s: 35
  warmup_s: 10
  drain_timeout_s: 120
  fresh_system_per_mix: false  # true: a new engine per mix (slower; leftovers restart it anyway)
"""


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


PEER = "vllm"
KIND_STYLE = {"embed": ("o", "-"), "generate": ("s", "--")}


def _series(row: dict) -> str:
    """The legend name of a row: its system, and its latency targets where it had any."""
    if row["system"] == "orthrus+slo" and row.get("slo"):
        return "orthrus + latency targets"
    return {"orthrus": "orthrus, no targets"}.get(row["system"], row["system"])


def _against_peer(rows: list[dict], key: str, path: Path, machine: str, measured: str | None) -> Path:
    """Each kind's `key` (throughput_rps or p95_s) over the vLLM pair's in the same mix, one line per series."""
    plt = _plt()
    groups = list(dict.fromkeys(r["group"] for r in rows))
    peer = {r["group"]: r for r in rows if r["system"] == PEER}
    series: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r["system"] != PEER and r.get("plot", True) and r["group"] in peer:
            series.setdefault(_series(r), {})[r["group"]] = r
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    top = 1.1
    for color, (name, by_group) in zip(colors, series.items()):
        for kind, (marker, ls) in KIND_STYLE.items():
            xs = [g for g in groups if g in by_group]
            ys = [by_group[g]["kinds"][kind][key] / peer[g]["kinds"][kind][key] for g in xs]
            ax.plot(xs, ys, marker=marker, ls=ls, color=color, label=f"{name}: {kind}")
            top = max([top, *ys])
    ax.axhline(1.0, color="0.3", lw=1, label="the vLLM pair (= 1)")
    if key == "p95_s":
        ax.axhline(1.1, color="0.5", lw=0.8, ls=":", label="1.1x the pair")
        ax.set(title="p95 latency per kind over the vLLM pair's (lower is better)", ylabel="p95 / the pair's p95 (x)")
    else:
        ax.set(title="requests/s per kind over the vLLM pair's (higher is better)",
               ylabel="req/s / the pair's req/s (x)")
    ax.set_xlabel("embed:gen mix (64 closed-loop clients)")
    ax.set_ylim(0, top * 1.45)  # room for the legend above the lines
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper center")
    caption(fig, machine, measured)
    return _save(fig, path)


def _against_baseline(rows: list[dict], path: Path, machine: str, measured: str | None,
                      baseline: str = "dedicated") -> Path:
    """Each system's req/s per kind over `baseline`'s in the same mix (two panels, one per kind); without that
    system in the rows, the req/s themselves."""
    plt = _plt()
    groups = list(dict.fromkeys(r["group"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    base = {r["group"]: r for r in rows if r["system"] == baseline}
    fig, axes = plt.subplots(1, 2, figsize=(8, 4), sharey=bool(base))
    for ax, kind in zip(axes, ("embed", "generate")):
        for system in systems:
            if base and system == baseline:
                continue
            by_group = {r["group"]: r for r in rows if r["system"] == system}
            xs = [g for g in groups if g in by_group and (not base or g in base)]
            ys = [by_group[g]["kinds"][kind]["throughput_rps"] / (base[g]["kinds"][kind]["throughput_rps"]
                                                                 if base else 1.0) for g in xs]
            ax.plot(xs, ys, marker="o", label=system)
        if base:
            ax.axhline(1.0, color="0.3", lw=1, label=f"{baseline} (= 1)")
            ax.set(title=f"{kind}: req/s over {baseline}'s", ylabel=f"req/s / {baseline}'s (x)")
        else:
            ax.set(title=f"{kind} requests/s", ylabel="completed requests/s")
        ax.set_xlabel("embed:gen mix")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    caption(fig, machine, measured)
    return _save(fig, path)


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """The PNGs a results file names (docs/benchmarks/results/ratio-sweep-*.json, or a run's own results.json):
    `*-throughput.png` each kind's req/s over the vLLM pair's by mix, `*-p95.png` each kind's p95 over the pair's,
    any other name each system's req/s over `dedicated`'s by mix. Redraw: `python scripts/bench/report.py <file>`."""
    rows = result_rows(results)["rows"]
    has_peer = any(r["system"] == PEER for r in rows)
    names = results.get("plots") or (["ratio-sweep-throughput.png", "ratio-sweep-p95.png"] if has_peer
                                     else ["ratio-sweep-rps.png"])
    machine, measured = results.get("machine", ""), results.get("measured")
    out = []
    for name in names:
        path = Path(out_dir) / name
        if name.endswith("-throughput.png") and has_peer:
            out.append(_against_peer(rows, "throughput_rps", path, machine, measured))
        elif name.endswith("-p95.png") and has_peer:
            out.append(_against_peer(rows, "p95_s", path, machine, measured))
        else:
            out.append(_against_baseline(rows, path, machine, measured))
    return out
