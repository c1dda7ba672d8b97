"""Serving under load with and without a concurrent bulk ingest, and the two-process answer (`dedicated`).

Each row in a fresh system (bench.yaml's engine, SmolLM2-135M generating, all-MiniLM-L6-v2 embedding, dtype=auto):
1. `idle ingest`: `LiveIndex.aadd` in batches (bulk work: PoolingParams.priority > 0) into an empty
   `LiveIndex.create` index (or a copy of `--index-dir`), nothing else running: the idle embedding rate;
2. `serving`: the ratio sweep's closed-loop clients at `--ratio` 5:5, `--warmup-s` then the measured `--window-s`:
   per kind p50/p95 and req/s;
3. `serving + ingest`: the same while the ingest runs in the same engine and event loop: p95 and req/s x row 2,
   ingest rate during the window x row 1;
4. `dedicated + ingest`: the `dedicated` deployment (generation and embedding processes, 1 core each) serving the
   same clients while the ingest goes to its embedding process (`--dedicated-baselines`: its own rows 1-2 too).
An ingest outlasting the window goes on (serving stopped) until done or `--ingest-timeout-s`. The target column:
serving p95 within 1.1x of no ingest and ingest >= 0.5x idle ("met" / "missed"). Full run (2 cores, nothing else
running; ~1 h):

    .venv/bin/python scripts/make_corpus.py --out runs/corpus50k.jsonl.gz --generate 50000
    .venv/bin/python scripts/bench_ingest.py --corpus runs/corpus50k.jsonl.gz --count 50000 --window-s 60 \\
        --out runs/bench_ingest/results.json

Dry run: `--corpus runs/corpus300.jsonl.gz --count 200 --window-s 5 --warmup-s 1 --clients 8`. `plot_results`
redraws the committed figures (docs/benchmarks/results/ingest-*.json, through scripts/bench/report.py; the page is
docs/benchmarks/ingest.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # `bench` is scripts/bench/

from bench.driver import closed_loop, summarize  # noqa: E402
from bench.harness import Session, register_experiments, system_factory, warm_up, workload  # noqa: E402
from bench.workloads import mixed_stream  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from orthrus_rag.data.corpus import read_jsonl  # noqa: E402
from orthrus_rag.data.types import Passage  # noqa: E402

logger = logging.getLogger("bench_ingest")
ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "scripts" / "bench" / "conf"
ISA_FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
TARGET_P95, TARGET_INGEST = 1.1, 0.5
LOG_EVERY_S = 30.0


@dataclass(frozen=True)
class Row:
    name: str
    system: str
    serves: bool
    ingests: bool


ROWS = [Row("idle ingest", "orthrus", False, True), Row("serving", "orthrus", True, False),
        Row("serving + ingest", "orthrus", True, True), Row("dedicated + ingest", "dedicated", True, True)]
DEDICATED_BASELINES = [Row("dedicated idle ingest", "dedicated", False, True),
                       Row("dedicated serving", "dedicated", True, False)]


@dataclass
class IngestLog:
    t0: float
    batches: list[tuple[float, int]] = field(default_factory=list)  # (s after t0, passages) per finished aadd
    finished: bool = False
    error: str | None = None

    def added(self) -> int:
        return sum(n for _, n in self.batches)

    def rate(self, a: float, b: float) -> float | None:
        """Passages/s over [a, b] (s after t0), the cumulative count interpolated between finished batches; an
        ingest that finished inside the interval is measured up to its end. None: it finished before `a`."""
        if not self.batches:
            return 0.0
        t = np.array([0.0] + [s for s, _ in self.batches])
        n = np.cumsum([0] + [k for _, k in self.batches])
        end = min(b, float(t[-1])) if self.finished else b
        if end <= a:
            return None
        return float((np.interp(end, t, n) - np.interp(a, t, n)) / (end - a))


async def ingest(index: Any, passages: list[Passage], batch: int, concurrency: int, truncate: bool,
                 log: IngestLog) -> None:
    """`index.aadd` over `passages` in batches, `concurrency` adds in flight; progress into `log`."""
    starts = iter(range(0, len(passages), batch))  # NOTE: shared by the workers (one event loop: no race)
    last = [time.monotonic()]

    async def worker() -> None:
        for start in starts:
            chunk = passages[start:start + batch]
            await index.aadd(chunk, truncate=truncate)
            log.batches.append((time.monotonic() - log.t0, len(chunk)))
            if time.monotonic() - last[0] >= LOG_EVERY_S:
                last[0] = time.monotonic()
                logger.info("ingest: %d/%d added", log.added(), len(passages))

    await asyncio.gather(*[worker() for _ in range(concurrency)])
    log.finished = True


def open_index(client: Any, folder: Path, args: argparse.Namespace) -> Any:
    from orthrus_rag.retrievers import EngineEmbedder, LiveIndex

    embedder = EngineEmbedder(client, batch_size=args.batch_size)
    if args.index_dir is None:
        return LiveIndex.create(folder, embedder)
    shutil.copytree(args.index_dir, folder, dirs_exist_ok=True)
    return LiveIndex.open(folder, embedder)


async def measure(session: Session, row: Row, cfg: DictConfig, args: argparse.Namespace,
                  passages: list[Passage], folder: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    log = IngestLog(time.monotonic())
    task = None
    if row.ingests:
        index = await asyncio.to_thread(open_index, session.client, folder, args)
        log.t0 = time.monotonic()
        task = asyncio.ensure_future(ingest(index, passages, args.batch_size, args.ingest_concurrency,
                                            not args.no_truncate, log))
    if row.serves:
        e, g = (float(v) for v in args.ratio.split(":"))
        stream = mixed_stream(e / (e + g), workload(cfg), prefix=args.ratio)
        res = await closed_loop(session.client, stream, args.clients, args.warmup_s + args.window_s,
                                drain_timeout_s=args.drain_timeout_s, label=row.name, warmup_s=args.warmup_s)
        s = summarize(res)
        out["serving"] = {"kinds": s["kinds"], "unfinished": s["unfinished"], "steps": s.get("steps"),
                          "cpu_mean_pct": s["cpu_mean_pct"]}
        if task is not None and args.stop_ingest_with_window:
            task.cancel()
    if task is not None:
        left = args.ingest_timeout_s - (time.monotonic() - log.t0)
        await asyncio.wait([task], timeout=max(0.0, left))
        if not task.done():
            logger.warning("%s: ingest unfinished after %.0f s; stopped", row.name, args.ingest_timeout_s)
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if not task.cancelled() and task.exception() is not None:
            log.error = f"{type(task.exception()).__name__}: {task.exception()}"
            logger.error("%s: ingest failed: %s", row.name, log.error)
        elapsed = log.batches[-1][0] if log.batches else 0.0
        window = (args.warmup_s, args.warmup_s + args.window_s) if row.serves else (0.0, elapsed)
        out["ingest"] = {"added": log.added(), "of": len(passages), "finished": log.finished, "error": log.error,
                         "total_s": elapsed if log.finished else None, "window_s": list(window),
                         "passages_per_s": log.rate(*window), "batches": len(log.batches)}
    return out


def run_row(row: Row, cfg: DictConfig, args: argparse.Namespace, passages: list[Passage]) -> dict[str, Any]:
    logger.info("== %s (%s)", row.name, row.system)
    t0 = time.monotonic()
    session = Session(row.system, system_factory(row.system, cfg))
    scratch = Path(tempfile.mkdtemp(prefix="ingest_", dir=args.scratch))
    try:
        ready_s = time.monotonic() - t0
        session.run(warm_up(session.client, workload(cfg)))
        got = session.run(measure(session, row, cfg, args, passages, scratch / "index"))
    finally:
        session.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    result = {**asdict(row), "ready_s": ready_s, "wall_s": time.monotonic() - t0, **got}
    logger.info("%s done in %.0f s\n%s", row.name, result["wall_s"], table([result]))
    return result


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b or math.isnan(a) or math.isnan(b) else a / b


def compare(rows: list[dict[str, Any]]) -> None:
    """Each serving + ingest row against the no-ingest serving row and the idle-ingest row of its own system
    (if run), else of the in-process one; the target's verdict beside them (`goal_met`)."""
    def find(system: str, serves: bool, ingests: bool) -> dict[str, Any] | None:
        match = [r for r in rows if r["serves"] == serves and r["ingests"] == ingests and "error" not in r]
        return next((r for r in match if r["system"] == system), next(iter(match), None))

    for r in rows:
        if not (r["serves"] and r["ingests"]) or "error" in r:
            continue
        serve, idle = find(r["system"], True, False), find(r["system"], False, True)
        vs: dict[str, Any] = {"serving_baseline": serve and serve["name"], "ingest_baseline": idle and idle["name"]}
        for kind in ("embed", "generate"):
            for m in ("p95_s", "throughput_rps"):
                base = serve["serving"]["kinds"][kind][m] if serve else None
                vs[f"{kind}_{m}"] = ratio(r["serving"]["kinds"][kind][m], base)
        vs["ingest"] = ratio(r["ingest"]["passages_per_s"], idle["ingest"]["passages_per_s"] if idle else None)
        p95s = [vs["embed_p95_s"], vs["generate_p95_s"]]
        vs["goal_met"] = (None if None in (*p95s, vs["ingest"])
                          else all(p <= TARGET_P95 for p in p95s) and vs["ingest"] >= TARGET_INGEST)
        r["vs"] = vs


def fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(rows: list[dict[str, Any]]) -> str:
    head = ["row", "system", "embed p50 s", "embed p95 s", "embed req/s", "gen p50 s", "gen p95 s", "gen req/s",
            "p95 x no-ingest (e/g)", "req/s x no-ingest (e/g)", "ingest p/s", "x idle", "ingest total s", "target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        k, ing, vs = (r.get("serving") or {}).get("kinds", {}), r.get("ingest") or {}, r.get("vs") or {}
        cells = [r["name"], r["system"]]
        for kind in ("embed", "generate"):
            cells += [fmt(k.get(kind, {}).get(m)) for m in ("p50_s", "p95_s", "throughput_rps")]
        cells += [f"{fmt(vs.get('embed_p95_s'))} / {fmt(vs.get('generate_p95_s'))}" if vs else "-",
                  f"{fmt(vs.get('embed_throughput_rps'))} / {fmt(vs.get('generate_throughput_rps'))}" if vs else "-",
                  fmt(ing.get("passages_per_s"), ".1f"), fmt(vs.get("ingest")),
                  fmt(ing.get("total_s"), ".1f") if ing else "-",
                  {True: "met", False: "missed"}.get(vs.get("goal_met"), "failed" if "error" in r else "-")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine(cfg: DictConfig) -> dict[str, Any]:
    import torch

    from orthrus_rag.config.build import engine_config_from
    from orthrus_rag.machine import cpu_flags, cpu_model

    flags = cpu_flags()
    return {"cpu_model": cpu_model(), "cores": os.cpu_count(), "isa": {f: f in flags for f in ISA_FLAGS},
            "torch": torch.__version__, "dtype": str(engine_config_from(cfg).model.torch_dtype)}


def bench_config(args: argparse.Namespace) -> DictConfig:
    from hydra import compose, initialize_config_dir

    overrides = ["experiment=ratio_sweep", f"++model.embedding_model={args.embedding_model}",
                 f"++model.dtype={args.dtype}", *args.override]
    register_experiments()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("bench", overrides=overrides)


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Draw the PNG a committed results file names: for each row that serves and ingests (one per setting), its
    serving p95 against no ingest (embeddings and generations) over its ingest rate against idle, from the rows'
    `vs` ratios as `compare` writes them (`results["results"]["rows"]`); the target's box shaded."""
    from bench.report import _plt, _save, caption

    rows = [r for r in results["results"]["rows"] if r.get("vs")]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.axhline(TARGET_P95, color="tab:green", ls="--", lw=1)
    ax.axvline(TARGET_INGEST, color="tab:green", ls="--", lw=1)
    ax.fill_between([TARGET_INGEST, 2.0], 0.5, TARGET_P95, color="tab:green", alpha=0.08)
    ax.text(TARGET_INGEST + 0.01, TARGET_P95 * 0.985, "target: p95 ≤ 1.1×,\ningest ≥ 0.5× idle", fontsize=7,
            color="tab:green", va="top")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    top = max(max(r["vs"]["embed_p95_s"], r["vs"]["generate_p95_s"]) for r in rows)
    for i, r in enumerate(rows):
        vs, c = r["vs"], colors[i % len(colors)]
        x = vs["ingest"]
        ax.plot([x, x], [vs["embed_p95_s"], vs["generate_p95_s"]], color=c, lw=1, alpha=0.5)
        ax.plot(x, vs["embed_p95_s"], "o", color=c, label=r.get("setting") or r["name"])
        ax.plot(x, vs["generate_p95_s"], "^", color=c)
    ax.plot([], [], "o", color="0.4", label="● embeddings' p95, ▲ generations' p95")
    ax.set(title="Ingest while serving 64 clients at 5:5: serving p95 against ingest rate",
           xlabel="ingest rate while serving (× the idle ingest rate)", ylabel="serving p95 (× without ingest)",
           xlim=(0, max(0.8, max(r["vs"]["ingest"] for r in rows) + 0.1)), ylim=(0.9, max(1.6, top * 1.1)))
    if top > 2:  # one far setting would flatten the rest: log scale
        ax.set_yscale("log")
        ticks = [1, 1.1, 1.25, 1.5, 2, 3, 5, 8]
        ax.set_yticks([v for v in ticks if v <= top * 1.1], [f"{v:g}" for v in ticks if v <= top * 1.1])
        ax.minorticks_off()
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    caption(fig, results["machine"], results.get("measured"))
    return [_save(fig, Path(out_dir) / results["plots"][0])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, required=True, help="FlashRAG JSONL (.jsonl or .jsonl.gz)")
    p.add_argument("--count", type=int, default=50000, help="passages each ingest adds")
    p.add_argument("--idle-count", type=int, default=None, help="passages of the idle rows (default --count)")
    p.add_argument("--window-s", type=float, default=60.0, help="the measured serving window, after the warm-up")
    p.add_argument("--warmup-s", type=float, default=10.0, help="serving before the window (not counted)")
    p.add_argument("--clients", type=int, default=None, help="closed-loop clients (default: ratio_sweep's, 64)")
    p.add_argument("--ratio", default="5:5", help="embed:generate mix of the clients")
    p.add_argument("--batch-size", type=int, default=256, help="passages per LiveIndex.aadd")
    p.add_argument("--ingest-concurrency", type=int, default=1, help="aadd calls in flight")
    p.add_argument("--ingest-timeout-s", type=float, default=3600.0, help="an ingest is stopped after this")
    p.add_argument("--stop-ingest-with-window", action="store_true", help="stop the ingest when serving ends")
    p.add_argument("--drain-timeout-s", type=float, default=120.0)
    p.add_argument("--index-dir", type=Path, default=None, help="a small saved dense index to add to (copied)")
    p.add_argument("--no-truncate", action="store_true", help="refuse passages longer than the encoder takes")
    p.add_argument("--embedding-model", default="all-minilm-l6-v2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a bench.yaml override (Hydra syntax), e.g. scheduler.max_num_batched_tokens=512; repeat")
    p.add_argument("--dedicated-baselines", action="store_true",
                   help="also the dedicated deployment's own idle-ingest and serving rows")
    p.add_argument("--rows", nargs="+", default=None, metavar="NAME",
                   help="run only these rows, by name (e.g. 'serving + ingest'): a variant beside a full run's "
                        "baselines; a row's ratios need its baselines in the same run")
    p.add_argument("--scratch", type=Path, default=ROOT / "runs" / "bench_ingest" / "scratch")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_ingest" / "results.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.count < 1 or args.batch_size < 1 or args.ingest_concurrency < 1 or args.window_s <= 0:
        p.error("--count, --batch-size, --ingest-concurrency and --window-s must be positive")
    cfg = bench_config(args)
    args.clients = args.clients or int(cfg.experiment.clients)
    rows = ROWS + (DEDICATED_BASELINES if args.dedicated_baselines else [])
    if args.rows is not None:
        known = {r.name: r for r in ROWS + DEDICATED_BASELINES}
        if unknown := [n for n in args.rows if n not in known]:
            p.error(f"--rows: no row named {', '.join(map(repr, unknown))}; rows: {', '.join(map(repr, known))}")
        rows = [known[n] for n in dict.fromkeys(args.rows)]
    need = max(args.count, args.idle_count or 0)
    passages = [x for _, x in zip(range(need), read_jsonl(args.corpus))]
    if len(passages) < need:
        p.error(f"{args.corpus} holds {len(passages)} passages; --count asks for {need}")
    info = machine(cfg)
    logger.info("machine: %s", json.dumps(info))
    args.scratch.mkdir(parents=True, exist_ok=True)
    t0, results = time.monotonic(), []
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    doc = {"machine": info, "args": settings, "goal": {"p95_x_max": TARGET_P95, "ingest_x_min": TARGET_INGEST},
           "config": OmegaConf.to_container(cfg, resolve=True), "rows": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for row in rows:
        n = args.count if row.serves or args.idle_count is None else args.idle_count
        try:
            results.append(run_row(row, cfg, args, passages[:n]))
        except Exception as exc:  # noqa: BLE001 (this row's system failed: recorded, the next row runs)
            logger.exception("%s failed", row.name)
            results.append({**asdict(row), "error": f"{type(exc).__name__}: {exc}"})
        compare(results)
        doc.update(table=(md := table(results)), wall_s=time.monotonic() - t0)  # NOTE: written after every row
        args.out.write_text(json.dumps(_nan_free(doc), indent=1, allow_nan=False, default=str))
    print(f"CPU: {info['cpu_model']} ({info['cores']} cores), "
          + ", ".join(f"{f}={'yes' if v else 'no'}" for f, v in info["isa"].items()) + f", dtype {info['dtype']}")
    print(md)
    logger.info("wrote %s in %.0f s", args.out, doc["wall_s"])
    return 0


def _nan_free(x: Any) -> Any:
    """NaN (a kind with no completions) as null: strict JSON."""
    if isinstance(x, dict):
        return {k: _nan_free(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_nan_free(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


if __name__ == "__main__":  # NOTE: the dedicated deployment spawns workers, which re-import this module
    raise SystemExit(main())
