"""Iter-RetGen on 2WikiMultihopQA per scheduling policy: question throughput and p50/p95/p99 end-to-end
latency, with answer quality alongside (it must not change with the policy beyond sampling noise).

Each policy is one `orthrus-rag run` (the command a user runs), in its own process, into `out/<policy>/`;
the table is built from the runs' summary.json and records.jsonl."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from ..harness import ROOT
from ..report import _fmt, _plt, _save, write_json

logger = logging.getLogger(__name__)


def cli() -> list[str]:
    exe = Path(sys.executable).with_name("orthrus-rag")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "orthrus_rag.cli"]


def run_policy(cfg: DictConfig, policy: str, out: Path) -> dict:
    x = cfg.experiment
    run_dir = out / policy
    data: list[str] = []
    if x.dataset_path is not None:  # None: the app experiment's own dataset (e.g. the synthetic one)
        dataset = Path(x.dataset_path)
        dataset = dataset if dataset.is_absolute() else ROOT / dataset
        if not dataset.exists():
            raise FileNotFoundError(f"experiment.dataset_path {dataset} does not exist (see ../shared/data/README)")
        data = [f"dataset.path={dataset}"]
    if x.limit is not None:
        data.append(f"dataset.limit={x.limit}")
    cmd = [*cli(), "run", f"experiment={x.app_experiment}", *data, f"engine={policy.replace('-', '_')}", f"run_dir={run_dir}", "progress=false",
           f"engine.max_num_batched_tokens={cfg.engine.max_num_batched_tokens}",
           f"engine.max_chunk_tokens={cfg.engine.max_chunk_tokens}", f"engine.max_num_seqs={cfg.engine.max_num_seqs}",
           f"engine.min_share={cfg.engine.min_share}", *x.overrides]
    logger.info("%s: %s", policy, " ".join(cmd))
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=x.timeout_s)
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines() if line]
    return {"summary": summary, "latencies": [r["latency_s"] for r in records if r.get("error") is None]}


def main(cfg: DictConfig, out: Path) -> None:
    results = {p: run_policy(cfg, p, out) for p in cfg.experiment.policies}
    report(cfg, results, out)


def report(cfg: DictConfig, results: dict[str, dict], out: Path) -> None:
    write_json(out / "results.json", {"policies": {p: r["summary"] for p, r in results.items()}})
    head = ["policy", "q/s", "× orthrus", "latency p50/p95/p99 s", "retrieval p50/p95 s", "generation p50/p95 s",
            "EM", "F1", "recall@5", "steps (mixed)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ref = results.get("orthrus", {}).get("summary", {}).get("throughput_qps")
    for policy, r in results.items():
        s = r["summary"]
        pct = lambda d: [d.get(k) for k in ("p50", "p95", "p99")]  # noqa: E731
        lat, ret, gen = pct(s["latency_s"]), pct(s["retrieve_s"]), pct(s["generate_s"])
        eng = s.get("engine", {})
        lines.append("| " + " | ".join([
            policy, _fmt(s["throughput_qps"], 3), _fmt(s["throughput_qps"] / ref) + "×" if ref else "–",
            "/".join(_fmt(v, 1) for v in lat), "/".join(_fmt(v, 1) for v in ret[:2]),
            "/".join(_fmt(v, 1) for v in gen[:2]), _fmt(s["em"], 3), _fmt(s["f1"], 3),
            _fmt(s.get("recall@5"), 3), f"{eng.get('num_steps', 0):,} ({eng.get('num_mixed_steps', 0):,})"]) + " |")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for policy, r in results.items():
        lat = np.sort(r["latencies"])
        if len(lat):
            ax.step(np.r_[0.0, lat], np.arange(len(lat) + 1) / len(lat), where="post", label=policy)
    ax.set(title="Iter-RetGen end-to-end latency per question", xlabel="latency (s)", ylabel="fraction")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, out / "latency_cdf.png")
    logger.info("\n%s", table)
