"""Rerank calls mixed with chat and embeddings: closed-loop clients send a mix of the three kinds, and each system
serves all of them. `orthrus` scores every pair in the one loop beside the generations; `dedicated` scores in its
pooling process (with the embeddings) beside a generation process, one core each (a separate scoring process, as
vLLM serves scoring from a pooling-runner instance). Completed requests/s and latency per kind; a rerank call is one
query against `documents` passages, and its latency is the whole call's."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from ..driver import SCORE, RunResult, by_group, closed_loop, rows, summarize
from ..harness import Session, workload
from ..report import (
    _fmt,
    _plt,
    _save,
    caption,
    plot_latency_cdf,
    plot_step_mix,
    result_rows,
    style_bars,
    write_json,
)
from ..workloads import make_score_request, rerank_stream

logger = logging.getLogger(__name__)
# `experiment=rerank_mix` (scripts/benchmark.py): these settings over bench.yaml's, any key of it
CONFIG = """
# 64 closed-loop clients; a mix is embed:score:generate request shares (a score request is one rerank call of
# `documents` passages). The generation backbone reranks (Qwen3-Reranker's yes/no reading, engine/rerankers.py).
experiment:
  name: rerank_mix
  mixes: ["4:2:4", "2:1:7"]
  documents: 10
  clients: 64
  duration_s: 60
  warmup_s: 15
  drain_timeout_s: 180
model:
  rerankers: [backbone]
systems: [orthrus, dedicated]
peers: []
"""
KINDS3 = ("embed", SCORE, "generate")
LABELS = {"embed": "embeddings", SCORE: "rerank calls", "generate": "generations"}


def parse_mix(mix: str) -> tuple[float, float]:
    """"embed:score:generate" shares -> (p_embed, p_score)."""
    parts = [float(v) for v in str(mix).split(":")]
    if len(parts) != 3 or min(parts) < 0 or sum(parts) <= 0:
        raise ValueError(f"a mix is three non-negative shares embed:score:generate, got {mix!r}")
    e, s, g = parts
    return e / (e + s + g), s / (e + s + g)


def run_system(session: Session, cfg: DictConfig) -> dict[str, RunResult]:
    import random

    x = cfg.experiment
    if not callable(getattr(session.client, "score", None)):
        raise ValueError(f"{session.name} cannot score (no `score` on its client); "
                         "run this experiment on in-process systems or dedicated / disagg-pd")
    # NOTE: one call first, so a reranker's one-off costs (its first forward) fall outside every mix
    warm = make_score_request(random.Random(0), "warm-score", workload(cfg), 2)
    session.run(session.client.score(warm.input[0], list(warm.input[1]), warm.params))
    out: dict[str, RunResult] = {}
    for i, mix in enumerate(x.mixes):
        p_embed, p_score = parse_mix(mix)
        stream = rerank_stream(p_embed, p_score, workload(cfg), int(x.documents), prefix=str(mix))
        res = session.run(closed_loop(session.client, stream, x.clients, x.duration_s,
                                      drain_timeout_s=x.drain_timeout_s, label=f"{session.name} {mix}",
                                      warmup_s=x.warmup_s))
        k = summarize(res)["kinds"]
        logger.info("%s %s: %s", session.name, mix, ", ".join(
            f"{kind} {k[kind]['throughput_rps']:.2f} req/s (p95 {k[kind]['p95_s']:.2f} s)" for kind in KINDS3))
        out[str(mix)] = res
        if any(r.finish_s is None for r in res.records) and i + 1 < len(x.mixes):
            session.reset()  # NOTE: leftovers would load the next mix; start clean
    return out


def table(table_rows: list[dict], baseline: str = "dedicated") -> str:
    """Per mix and system: requests/s and p50/p95 per kind, and req/s × the baseline's in the same mix."""
    base = {r["group"]: r for r in table_rows if r["system"] == baseline}
    head = ["mix (emb:score:gen)", "system"] + [f"{LABELS[k]}/s (p50 / p95 s)" for k in KINDS3]
    head += [f"req/s × {baseline} ({' / '.join(k[:3] for k in KINDS3)})", "CPU %"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table_rows:
        k, other = r["kinds"], base.get(r["group"])
        cells = [str(r["group"]), r["system"]]
        cells += [f"{_fmt(k[kind]['throughput_rps'])} ({_fmt(k[kind]['p50_s'])} / {_fmt(k[kind]['p95_s'])})"
                  for kind in KINDS3]
        cells.append(" / ".join(_fmt(k[kind]["throughput_rps"] / other["kinds"][kind]["throughput_rps"])
                                if other and other["kinds"][kind]["throughput_rps"] else "–" for kind in KINDS3))
        cells.append(_fmt(r.get("cpu_mean_pct"), 0))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(cfg: DictConfig, results: dict[str, dict[str, dict]], out: Path) -> None:
    groups = [str(m) for m in cfg.experiment.mixes]
    table_rows = rows(results, groups)
    write_json(out / "results.json", {"rows": table_rows, "runs": results})
    text = table(table_rows, cfg.baseline)
    (out / "table.md").write_text(text)
    plot_results({"results": {"rows": table_rows}, "plots": ["rerank_mix.png"]}, out)
    for g in groups:
        tag = g.replace(":", "-")
        plot_latency_cdf(by_group(results, g), out / f"latency_cdf_{tag}.png", title=f"({g})", kinds=KINDS3)
        plot_step_mix(by_group(results, g), out / f"step_mix_{tag}.png", title=f"({g})")
    logger.info("\n%s", text)


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Requests/s and p95 latency of each kind, a bar per system, for every mix (`results`:
    docs/benchmarks/results/rerank-mix-*.json or a run's results.json). Redraw:
    `python scripts/bench/report.py docs/benchmarks/results/<file>.json`."""
    table_rows = result_rows(results)["rows"]
    groups = list(dict.fromkeys(r["group"] for r in table_rows))
    systems = list(dict.fromkeys(r["system"] for r in table_rows))
    plt = _plt()
    fig, axes = plt.subplots(len(groups), 2, figsize=(9, 3.6 * len(groups)), squeeze=False)
    width = 0.8 / max(1, len(systems))
    for (ax_rps, ax_p95), g in zip(axes, groups):
        for j, system in enumerate(systems):
            r = next((r for r in table_rows if r["group"] == g and r["system"] == system), None)
            if r is None:
                continue
            xs = np.arange(len(KINDS3)) + (j - (len(systems) - 1) / 2) * width
            ax_rps.bar(xs, [r["kinds"][k]["throughput_rps"] for k in KINDS3], width, label=system)
            ax_p95.bar(xs, [r["kinds"][k]["p95_s"] for k in KINDS3], width, label=system)
        for ax, what in ((ax_rps, "completed requests/s (higher is better)"),
                         (ax_p95, "p95 latency, s (lower is better)")):
            ax.set_xticks(np.arange(len(KINDS3)), [LABELS[k] for k in KINDS3])
            ax.set_title(f"{what}; mix {g}")
        style_bars(ax_rps, ax_p95, legend=True)
    caption(fig, results.get("machine", ""), results.get("measured"))
    names = results.get("plots") or ["rerank_mix.png"]
    return [_save(fig, Path(out_dir) / names[0])]
