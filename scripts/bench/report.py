"""Benchmark reports: JSON, a markdown table with ratios against `dedicated` (and a peer), PNG plots.

Rows are `summarize()` dicts with a `system` and a `group` (e.g. the embed:gen ratio) added; runs are
`RunResult.to_dict()` dicts, so a report can be redrawn from the JSON alone.

As a command it redraws the plots of committed result files (docs/benchmarks/results/*.json): each file names the
script that owns its plots, whose `plot_results(results, out_dir)` draws them.

    python scripts/bench/report.py docs/benchmarks/results/ratio-sweep-amx-xeon.json [--out docs/benchmarks/img]
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)
KINDS = ("embed", "generate")
MIX = (("embed", "tab:blue"), ("encoder", "tab:cyan"), ("prefill", "tab:orange"), ("decode", "tab:red"))


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path


def _fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _ratio(a: float, b: float | None) -> str:
    return "–" if not b else f"{a / b:.2f}×"


def markdown_table(rows: list[dict], baseline: str = "dedicated", peer: str | None = None,
                   group_name: str = "mix") -> str:
    """One line per (group, system): requests/s and latency p50/p95/p99 per kind, × the baseline's and the
    peer's throughput in the same group."""
    by_key = {(r["group"], r["system"]): r for r in rows}
    refs = [name for name in (baseline, peer) if name and any(r["system"] == name for r in rows)]
    head = [group_name, "system", "emb req/s", "gen req/s", "emb p50/p95/p99 s", "gen p50/p95/p99 s"]
    head += [f"{k} × {ref}" for ref in refs for k in ("emb", "gen")] + ["CPU %"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        k = r["kinds"]
        cells = [str(r["group"]), r["system"]] + [_fmt(k[kind]["throughput_rps"]) for kind in KINDS]
        cells += ["/".join(_fmt(k[kind][p]) for p in ("p50_s", "p95_s", "p99_s")) for kind in KINDS]
        for ref in refs:
            other = by_key.get((r["group"], ref))
            cells += [_ratio(k[kind]["throughput_rps"], other["kinds"][kind]["throughput_rps"] if other else None)
                      for kind in KINDS]
        cells.append(_fmt(r.get("cpu_mean_pct"), 0))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib.category").setLevel(logging.WARNING)  # mixes like "9:1" are categories on purpose
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(rows: list[dict], path: str | Path) -> Path:
    """Completed requests/s per kind against the mix, one line per system."""
    plt = _plt()
    groups = list(dict.fromkeys(r["group"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, kind in zip(axes, (*KINDS, "total")):
        for system in systems:
            ys = []
            for g in groups:
                r = next((r for r in rows if r["group"] == g and r["system"] == system), None)
                ks = r["kinds"] if r else None
                ys.append(np.nan if ks is None else sum(ks[k]["throughput_rps"] for k in KINDS) if kind == "total"
                          else ks[kind]["throughput_rps"])
            ax.plot(groups, ys, marker="o", label=system)
        ax.set(title=f"{kind} requests/s", xlabel="embed:gen")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def plot_latency_cdf(runs: dict[str, dict], path: str | Path, title: str = "",
                     kinds: tuple[str, ...] = KINDS) -> Path:
    """Latency CDF per kind, one line per system (`runs`: system -> RunResult dict)."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4))
    for ax, kind in zip(axes, kinds):
        for system, run in runs.items():
            lat = np.sort([r["finish_s"] - r["start_s"] for r in run["records"]
                           if r["kind"] == kind and r["finish_s"] is not None])
            if len(lat):
                ax.step(np.r_[0.0, lat], np.arange(len(lat) + 1) / len(lat), where="post", label=system)
        ax.set(title=f"{kind} latency {title}", xlabel="latency (s)", ylabel="fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_step_mix(runs: dict[str, dict], path: str | Path, bin_s: float = 1.0, title: str = "") -> Path | None:
    """Tokens per second by kind of work over time, one panel per system that logged its engine steps."""
    runs = {name: run for name, run in runs.items() if run["steps"]}
    if not runs:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.4 * len(runs)), sharex=True, squeeze=False)
    for ax, (system, run) in zip(axes[:, 0], runs.items()):
        t = np.array([s["t"] for s in run["steps"]])
        edges = np.arange(0.0, t.max() + bin_s, bin_s)
        layers = [np.histogram(t, edges, weights=[s[k] for s in run["steps"]])[0] / bin_s for k, _ in MIX]
        ax.stackplot(edges[:-1], *layers, labels=[k for k, _ in MIX], colors=[c for _, c in MIX], step="post")
        ax.set(ylabel="tokens/s", title=f"{system} {title}")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("time (s)")
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = getattr(fig, "_bench_caption", 0)
    if not getattr(fig, "_bench_laid_out", False):  # a caller that laid the figure out itself sets this
        fig.tight_layout(rect=(0, 0.01 + lines * 0.1 / fig.get_figheight(), 1, 1) if lines else None)
    fig.savefig(path, dpi=100)
    fig.clf()
    _plt().close(fig)
    logger.info("wrote %s", path)
    return path


def style_bars(*axes, legend: bool = False) -> None:
    """The house style of a bar panel in the docs' plots: a small title, a light grid along y, a small legend."""
    for ax in axes:
        ax.title.set_fontsize(9)
        ax.grid(axis="y", alpha=0.3)
        if legend:
            ax.legend(fontsize=7)


def caption(fig, machine: str, measured: str | None = None) -> None:
    """The machine (and the date measured) in small lines under the plot."""
    import textwrap

    text = machine + (f"; measured {measured}" if measured else "")
    width = int(fig.get_figwidth() * 19)  # characters of 6.5 pt text across the figure
    lines = textwrap.wrap(text, width)
    fig.text(0.01, 0.008, "\n".join(lines), fontsize=6.5, color="0.35", ha="left", va="bottom")
    fig._bench_caption = len(lines)


def _load_owner(script: str | Path):
    """Import the script that owns a results file's plots. scripts/ goes on sys.path first, so `from bench import
    ...` works inside it, and a module inside the `bench` package (scripts/bench/experiments/ratio_sweep.py) is
    imported under its package name, so its relative imports resolve."""
    import importlib
    import importlib.util
    import sys

    root = Path(__file__).resolve().parents[2]
    scripts_dir = root / "scripts"
    path = Path(script)
    path = (path if path.is_absolute() else root / path).resolve()
    if str(scripts_dir) not in sys.path:
        sys.path.insert(0, str(scripts_dir))
    try:
        parts = path.relative_to(scripts_dir).with_suffix("").parts
    except ValueError:
        parts = (path.stem,)
    name = ".".join(parts)
    if name in sys.modules:
        return sys.modules[name]
    if len(parts) > 1:
        importlib.import_module(".".join(parts[:-1]))  # the parent package, for relative imports
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if not hasattr(module, "plot_results"):
        raise SystemExit(f"{path} has no plot_results(results, out_dir)")
    return module


def result_rows(results: dict) -> dict:
    """The figures of a committed results file (its "results" key), or a run's own results.json as it is."""
    return results.get("results", results) if isinstance(results.get("results"), (dict, list)) else results


def main(argv: list[str] | None = None) -> int:
    """Redraw the plots of committed benchmark result files."""
    import argparse

    parser = argparse.ArgumentParser(prog="report.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path, help="result JSON files to redraw")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the PNGs (default: img/ next to the results/ folder of each file, "
                             "i.e. docs/benchmarks/img)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    written: list[Path] = []
    for file in args.files:
        results = json.loads(Path(file).read_text())
        if not results.get("plots"):
            print(f"{file}: no plots listed")
            continue
        out = args.out or Path(file).resolve().parent.parent / "img"
        out.mkdir(parents=True, exist_ok=True)
        paths = _load_owner(results["script"]).plot_results(results, out)
        for p in paths:
            print(p)
        written += paths
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
