"""Iter-RetGen (or any RAG method) on 2WikiMultihopQA per system: question throughput and p50/p95/p99 end-to-end
latency, with answer quality alongside (it should not change with the policy beyond sampling noise).

Each policy or deployment is one `orthrus-rag run` (the command a user runs: `scheduler=orthrus`, ...,
`deploy=dedicated`), in its own process, into `out/<system>/`; a peer runs the same app through
`scripts/peer.py run` under its own interpreter. The table is built from the runs' summary.json and records.jsonl.
`plot_results` redraws the committed figures (docs/benchmarks/results/methods-*.json) through
scripts/bench/report.py; the page is docs/benchmarks/methods.md."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from orthrus_rag.engine.clients import SYSTEMS

from ..harness import ROOT, peer_python
from ..peer_client import PEERS
from ..report import _fmt, _plt, _save, style_bars, write_json

logger = logging.getLogger(__name__)
# `experiment=iter_retgen` (scripts/benchmark.py): these settings over bench.yaml's, any key of it
CONFIG = """
# Paper: Iter-RetGen on 2WikiMultihopQA (500 questions, text-davinci-003). Here: the first `limit` questions of
# the 2WikiMultihopQA dev file at `dataset_path` (override it: experiment.dataset_path=dev.jsonl), all in flight
# at once, 2 iterations, top-5, 3-shot prompts of ~1,000 tokens, SmolLM2 generating and all-MiniLM-L6-v2
# embedding. Every system runs the same `orthrus-rag run`:
# the four policies in one engine (both cores), the dedicated and disagg-pd deployments (one core per worker),
# and the peers (vLLM: two engines, one core each; built by `make peers`) through `scripts/peer.py run`.
experiment:
  name: iter_retgen
  dataset_path: dev.jsonl  # the 2WikiMultihopQA dev file you downloaded
  app_experiment: 2wiki_dev200
  limit: 40
  # the methods to compare (`pipeline=<name>` of each run, into out/<method>/<system>/, with one table of
  # all); null: the app experiment's own (Iter-RetGen), into out/<system>/
  methods: null
  policies: [orthrus, qlen-priority, hetero-fcfs, unified-homo, dedicated, disagg-pd]
  peers: [vllm]  # null: the shared `peers` list; the transformers peer (`hf`) works too but takes far longer
  overrides: []  # more `orthrus-rag run` overrides, e.g. ["model=smollm2_backbone", "pipeline.max_tokens=64"]
  timeout_s: 3600
peer_options:
  vllm:
    max_model_len: 8192  # SmolLM2's window, as this engine allows: the longest 3-shot prompts pass 2,048 tokens
"""
# bench.yaml's nodes that every system's `orthrus-rag run` shares, key by key (they are the CLI's nodes); the model
# is the app experiment's
SHARED_NODES = ("cache", "scheduler")


def cli() -> list[str]:
    exe = Path(sys.executable).with_name("orthrus-rag")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "orthrus_rag.entrypoints.cli"]


def app_overrides(cfg: DictConfig, run_dir: Path) -> list[str]:
    """The `orthrus-rag run` overrides every system of the experiment shares."""
    x = cfg.experiment
    data: list[str] = []
    if x.dataset_path is not None:  # None: the app experiment's own dataset (e.g. the synthetic one)
        dataset = Path(x.dataset_path)
        dataset = dataset if dataset.is_absolute() else ROOT / dataset
        if not dataset.exists():
            raise FileNotFoundError(f"experiment.dataset_path {dataset} does not exist (pass the 2WikiMultihopQA dev "
                                    "file: experiment.dataset_path=<path>)")
        data = [f"dataset.path={dataset}"]
    if x.limit is not None:
        data.append(f"dataset.limit={x.limit}")
    return [f"experiment={x.app_experiment}", *data, f"run_dir={run_dir}", "progress=false",
            *(f"{node}.{k}={_override_value(v)}" for node in SHARED_NODES for k, v in cfg[node].items()),
            *x.overrides]


def _override_value(value: object) -> str:
    return "null" if value is None else str(value)


def system_command(cfg: DictConfig, system: str, run_dir: Path, method: str | None = None) -> list[str] | None:
    """The command that runs the app's method (`method`: `pipeline=<method>`; None: the app experiment's,
    Iter-RetGen) on `system`: `orthrus-rag run scheduler=<policy>` or `deploy=<deployment>`, or `peer.py run` under
    the peer's interpreter (None when that is not installed)."""
    shared = app_overrides(cfg, run_dir) + ([f"pipeline={method}"] if method is not None else [])
    if system in PEERS:
        python = peer_python(cfg, system)
        if python is None:
            return None
        opts = cfg.peer_options.get(system)
        options = OmegaConf.to_container(opts, resolve=True) if isinstance(opts, DictConfig) else dict(opts or {})
        return [python, str(ROOT / "scripts" / "peer.py"), "run", "--peer", system,
                "--options", json.dumps(options), "--", *shared]
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; expected one of {', '.join((*SYSTEMS, *PEERS))}")
    group = system.replace("-", "_")  # the config group's file name
    if system in ("dedicated", "disagg-pd"):  # a deployment of the engine (its policy: the default, orthrus)
        engine = [f"deploy={group}", f"deploy.threads=[{','.join(str(t) for t in cfg.threads.split)}]"]
    else:
        engine = [f"scheduler={group}"]
    return [*cli(), "run", *shared, *engine]


def run_one(cfg: DictConfig, system: str, out: Path, method: str | None = None) -> dict | None:
    run_dir = out / system
    cmd = system_command(cfg, system, run_dir, method)
    if cmd is None:
        logger.warning("%s skipped: %s not found (install it with `make peers`)", system, cfg.peers_python)
        return None
    logger.info("%s: %s", system, " ".join(cmd))
    try:
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=cfg.experiment.timeout_s)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        logger.error("%s failed (%s); its row is missing", system, exc)  # the other systems' rows still count
        return None
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines() if line]
    return {"summary": summary, "latencies": [r["latency_s"] for r in records if r.get("error") is None]}


def main(cfg: DictConfig, out: Path) -> None:
    x = cfg.experiment
    peers = cfg.peers if x.get("peers") is None else x.peers
    methods = list(x.get("methods") or [None])
    by_method: dict[str, dict[str, dict]] = {}
    for method in methods:
        # NOTE: one method keeps the layout (and table) of a plain Iter-RetGen run: out/<system>/
        where = out if method is None else out / method
        results = {}
        for system in [*x.policies, *peers]:
            got = run_one(cfg, system, where, method)
            if got is not None:
                results[system] = got
        report(cfg, results, where)
        if method is not None:
            by_method[method] = {s: r["summary"] for s, r in results.items()}
    if by_method:
        report_methods(cfg, by_method, out)


def report_methods(cfg: DictConfig, by_method: dict[str, dict[str, dict]], out: Path) -> None:
    """One table over methods x systems: answer quality, how much each method retrieves and generates
    per question, and each system's q/s and p99 beside the first peer's."""
    write_json(out / "results.json", {"methods": by_method})
    head = ["method", "system", "EM", "F1", "acc", "recall@5", "retrievals / q", "generated tokens / q", "q/s",
            "p99 s", "q/s × peer", "p99 × peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, systems in by_method.items():
        peer = next((systems[p] for p in systems if p in PEERS), None)
        for system, s in systems.items():
            qps, p99 = s["throughput_qps"], s["latency_s"]["p99"]
            lines.append("| " + " | ".join([
                method, system, _fmt(s["em"], 3), _fmt(s["f1"], 3), _fmt(s["acc"], 3), _fmt(s.get("recall@5"), 3),
                _fmt(s.get("retrievals_per_question"), 2), _fmt(s.get("generated_tokens_per_question"), 1),
                _fmt(qps, 3), _fmt(p99, 1),
                _fmt(qps / peer["throughput_qps"]) + "×" if peer else "–",
                _fmt(p99 / peer["latency_s"]["p99"]) + "×" if peer else "–"]) + " |")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    logger.info("\n%s", table)


def report(cfg: DictConfig, results: dict[str, dict], out: Path) -> None:
    write_json(out / "results.json", {"policies": {p: r["summary"] for p, r in results.items()}})
    base, peer = cfg.baseline, next((p for p in results if p in PEERS), None)
    refs = {name: results[name]["summary"] for name in (base, peer) if name in results}
    ratio = lambda s, name, get: _fmt(get(s) / get(refs[name])) + "×" if name in refs else "–"  # noqa: E731
    qps = lambda s: s["throughput_qps"]  # noqa: E731
    p99 = lambda s: s["latency_s"]["p99"]  # noqa: E731
    head = ["system", "q/s", f"q/s × {base}", f"q/s × {peer or 'peer'}", "latency p50/p95/p99 s",
            f"p99 × {base}", f"p99 × {peer or 'peer'}", "retrieval p50/p95 s", "generation p50/p95 s", "EM", "F1",
            "recall@5", "steps (mixed)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for system, r in results.items():
        s = r["summary"]
        pct = lambda d: [d.get(k) for k in ("p50", "p95", "p99")]  # noqa: E731
        lat, ret, gen = pct(s["latency_s"]), pct(s["retrieve_s"]), pct(s["generate_s"])
        eng = s.get("engine")
        steps = f"{eng.get('num_steps', 0):,} ({eng.get('num_mixed_steps', 0):,})" if eng else "–"
        lines.append("| " + " | ".join([
            system, _fmt(qps(s), 3), ratio(s, base, qps), ratio(s, peer, qps), "/".join(_fmt(v, 1) for v in lat),
            ratio(s, base, p99), ratio(s, peer, p99), "/".join(_fmt(v, 1) for v in ret[:2]),
            "/".join(_fmt(v, 1) for v in gen[:2]), _fmt(s["em"], 3), _fmt(s["f1"], 3),
            _fmt(s.get("recall@5"), 3), steps]) + " |")
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


SYSTEM_COLORS = {"orthrus": "tab:blue", "orthrus_resubmit": "tab:cyan", "dedicated": "tab:gray",
                 "vllm": "tab:orange"}
SYSTEM_LABELS = {"orthrus": "orthrus (one engine, 2 cores)", "orthrus_resubmit": "orthrus, each round re-submitted",
                 "dedicated": "dedicated (2 workers, 1 core each)", "vllm": "vLLM pair (1 core each)"}


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Draw the PNGs a committed results file names (`results["plots"]`): per method, q/s and p99 of each system
    (grouped bars, the engine's ratio to the vLLM pair above its bar) from `results["results"]["methods"]`; or, for
    a file with `answer_format` / `embedding_recall` results, answer quality per answer format and recall per
    embedding."""
    from bench.report import caption

    body, out_dir = results["results"], Path(out_dir)
    plt = _plt()
    if "methods" in body:
        fig = _plot_methods(plt, body["methods"])
    else:
        fig = _plot_quality(plt, body)
    caption(fig, results["machine"], results.get("measured"))
    return [_save(fig, out_dir / results["plots"][0])]


def _plot_methods(plt, by_method: dict[str, dict[str, dict]]):
    methods = list(by_method)
    systems = [s for s in SYSTEM_COLORS if any(s in by_method[m] for m in methods)]
    width = 0.8 / len(systems)
    fig, (ax_q, ax_p) = plt.subplots(1, 2, figsize=(9, 4))
    x = np.arange(len(methods))
    for i, system in enumerate(systems):
        qps = [by_method[m].get(system, {}).get("throughput_qps", np.nan) for m in methods]
        p99 = [by_method[m].get(system, {}).get("latency_s", {}).get("p99", np.nan) for m in methods]
        pos = x + (i - (len(systems) - 1) / 2) * width
        ax_q.bar(pos, qps, width, color=SYSTEM_COLORS[system], label=SYSTEM_LABELS.get(system, system))
        ax_p.bar(pos, p99, width, color=SYSTEM_COLORS[system])
        if system == "orthrus":
            for j, m in enumerate(methods):
                peer = by_method[m].get("vllm")
                if peer and not np.isnan(qps[j]):
                    ax_q.annotate(f"{qps[j] / peer['throughput_qps']:.2f}×", (pos[j], qps[j]), ha="center",
                                  va="bottom", fontsize=7)
    for ax, title, label in ((ax_q, "throughput (× the vLLM pair above the engine's bar)", "questions/s"),
                             (ax_p, "p99 latency per question", "seconds")):
        ax.set_xticks(x, [m.replace("_top3", " (top-3)").replace("_", " ") for m in methods], fontsize=8)
        ax.set(title=title, ylabel=label)
        style_bars(ax)
    ax_q.legend(fontsize=7, loc="upper right")
    fig.suptitle("RAG methods on 2WikiMultihopQA-200, every question in flight", fontsize=10)
    return fig


def _plot_quality(plt, body: dict):
    fig, (ax_a, ax_e) = plt.subplots(1, 2, figsize=(9, 4))
    formats = body.get("answer_format", {})
    metrics = ("em", "f1", "acc")
    x = np.arange(len(formats))
    for i, metric in enumerate(metrics):
        ax_a.bar(x + (i - 1) * 0.27, [formats[f][metric] for f in formats], 0.27, label=metric.upper())
    ax_a.set_xticks(x, list(formats))
    ax_a.set(title="Iter-RetGen by pipeline.answer_format", ylabel="score (0-1)", xlabel="answer format")
    recall = body.get("embedding_recall", {})
    names = list(recall)
    x = np.arange(len(names))
    for i, k in enumerate(("recall@2", "recall@5", "recall@10")):
        ax_e.bar(x + (i - 1) * 0.27, [recall[n][k] for n in names], 0.27, label=k)
    short = [n.replace(", no training", "").replace(" prompt", "").replace(", ", "\n").replace(" + ", " +\n")
             for n in names]
    ax_e.set_xticks(x, short, fontsize=7)
    ax_e.set(title="Supporting-paragraph recall by embedding", ylabel="recall (0-1)")
    style_bars(ax_a, ax_e, legend=True)
    return fig
