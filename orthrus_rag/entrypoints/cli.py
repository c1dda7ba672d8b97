"""Console entry point `orthrus-rag`.

    orthrus-rag run [overrides...]     answer a dataset's questions (Hydra; e.g. dataset=2wiki dataset.path=...)
    orthrus-rag run resume=RUN_DIR     continue a run that stopped: its recorded questions are skipped, those
                                       that failed retryably (a dead replica, a timeout) asked again
    orthrus-rag run -m scheduler=orthrus,hetero_fcfs ...   a sweep: one run folder per job under run_dir
    orthrus-rag summarize PATH...      table run folders (a sweep's jobs) side by side
    orthrus-rag compare BASE OTHER     two runs of one dataset, paired per question: each metric's difference
                                       with a bootstrap interval, questions gained and lost
    orthrus-rag export RUN_DIR         a run's records in FlashRAG's result shape (intermediate_data.json)
    orthrus-rag index [overrides...]   build and save the retrieval index of a dataset's corpus
    orthrus-rag serve [overrides...]   the OpenAI-compatible server (e.g. serve.port=8000 serve.api_key=...)
    orthrus-rag ask ["QUESTION"] [overrides...]   answer a question over your index (retriever.index_dir=...),
                                       streamed, with its searches' passages cited; without one, a prompt
    orthrus-rag demo                   generate and embed together on the built-in models, show the mixed steps
    orthrus-rag --version

Exit codes: 0 every question answered; 1 some questions failed (summary.json says which and why) or the run
stopped part-way (resume= continues it); 2 bad configuration (nothing ran).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from pathlib import Path

from orthrus_rag.entrypoints.cli_errors import EXIT_CONFIG, EXIT_FAILED, EXIT_OK

DEMO_PROMPTS = [
    "Question: Who wrote the novel Pride and Prejudice?\nAnswer:",
    "The three primary colours are",
    "Write one sentence about the sea:",
    "def fibonacci(n):",
]
DEMO_TEXTS = [
    "Jane Austen published Pride and Prejudice in 1813.",
    "Red, yellow and blue are traditionally called primary colours.",
    "The Pacific is the largest and deepest ocean on Earth.",
    "Multi-hop questions need facts from more than one document.",
] * 4


def demo(args: argparse.Namespace) -> int:
    from orthrus_rag import Engine, PoolingParams, SamplingParams

    engine = Engine.from_pretrained(args.model, embedding_model=args.embedding_model,
                                    max_num_batched_tokens=args.max_num_batched_tokens, max_chunk_tokens=32)
    start = time.perf_counter()
    gens, embs = engine.run(prompts=DEMO_PROMPTS, sampling_params=SamplingParams(max_tokens=args.max_tokens,
                                                                                 temperature=0.0),
                            texts=DEMO_TEXTS, pooling_params=PoolingParams(pooling="mean", normalize=True))
    elapsed = time.perf_counter() - start
    for g in gens:
        print(f"--- {DEMO_PROMPTS[gens.index(g)]!r}\n{g.text.strip()}")
    sims = embs[0].embedding @ embs[1].embedding, embs[0].embedding @ embs[4].embedding
    print(f"\n{len(embs)} embeddings of dimension {embs[0].embedding.shape[-1]}; "
          f"cos(text0, text1)={sims[0]:.3f}, cos(text0, same text)={sims[1]:.3f}")
    stats = list(engine.step_stats)
    mixed = sum(s.is_mixed for s in stats)
    print(f"\n{len(stats)} engine steps in {elapsed:.1f} s; {mixed} carried embedding and generation tokens "
          "together. First steps (embed / prefill / decode / encoder tokens):")
    for s in stats[:8]:
        print(f"  step {s.step:3d}: {s.num_embed_tokens:4d} {s.num_prefill_tokens:4d} {s.num_decode_tokens:4d} "
              f"{s.num_encoder_tokens:4d}")
    return 0


# third-party loggers whose INFO lines say nothing a user acts on: FAISS's loader (which SIMD build it tried, one
# line per miss) and the HTTP clients' per-request lines; their warnings still show
QUIET_LOGGERS = ("faiss.loader", "httpx", "httpcore")


def _quiet_third_party() -> None:
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def _hydra(command: str, argv: list[str], question: str | None = None) -> int:
    """Compose the config with Hydra (overrides, --help, --cfg job, multirun) and call the plain function;
    returns the worst exit code of its jobs. `question`: `ask`'s."""
    import hydra
    from omegaconf import DictConfig

    from orthrus_rag.config.app import register_configs

    register_configs()
    codes: list[int] = []
    started: list[bool] = []

    @hydra.main(version_base=None, config_path="pkg://orthrus_rag.conf", config_name="config")
    def entry(cfg: DictConfig) -> None:
        started.append(True)
        codes.append(_job(command, cfg, question))

    problem = _argv_problem(argv)
    if problem is not None:  # NOTE: before Hydra creates a run folder
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    overrides = {"serve": _serve_overrides, "plan": _plan_overrides, "ask": _plan_overrides}.get(
        command, _resume_overrides)(argv)
    sys.argv, saved = [f"orthrus-rag {command}", *overrides], sys.argv
    try:
        entry()
    except SystemExit as exc:  # NOTE: Hydra exits before any job for a bad override or config
        if exc.code not in (0, None) and not started:
            return EXIT_CONFIG
        raise
    finally:
        sys.argv = saved
    return max(codes, default=0)


_OVERRIDE = re.compile(r"^[+~]{0,2}[\w.\-/@]+=|^-")  # a Hydra override (key=value) or a flag (--help, -m)
_FLAGS_WITH_VALUES = ("--cfg", "-c", "--package", "-p", "--info", "-i")  # Hydra's: `--cfg job` names no question


def _question(argv: list[str]) -> tuple[str | None, list[str]]:
    """`ask`'s question (its first argument that is not an override, a flag or a flag's value) and the rest."""
    for i, arg in enumerate(argv):
        if not _OVERRIDE.match(arg) and not (i and argv[i - 1] in _FLAGS_WITH_VALUES):
            return arg, argv[:i] + argv[i + 1:]
    return None, argv


def _value(argv: list[str], key: str) -> str | None:
    """The last `key=value` override of `argv` (Hydra's rule: the last one wins)."""
    return next((a.split("=", 1)[1] for a in reversed(argv) if a.split("=", 1)[0].lstrip("+~") == key), None)


def _argv_problem(argv: list[str]) -> str | None:
    """What is wrong with the overrides before Hydra runs (and makes folders): a resume folder that does not
    exist, or two different run folders (`run_dir` is where the records go; `hydra.run.dir` / `hydra.sweep.dir`
    would silently win over it)."""
    resume = _value(argv, "resume")
    if resume not in (None, "null") and not Path(resume).is_dir():
        return f"resume: no such run folder: {resume}"
    run_dir = _value(argv, "run_dir")
    for key in ("hydra.run.dir", "hydra.sweep.dir"):
        other = _value(argv, key)
        if run_dir is not None and other is not None and other not in (run_dir, "${run_dir}"):
            return (f"run_dir={run_dir} and {key}={other} name two different folders; give run_dir alone (the "
                    "records, the summary and Hydra's files all go there)")
    return None


def _serve_overrides(argv: list[str]) -> list[str]:
    """A server has no run folder: Hydra writes no `.hydra/` and no log file (its log goes to the terminal)."""
    if _value(argv, "hydra.run.dir") is not None:
        return argv
    return [*argv, "hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout"]


def _plan_overrides(argv: list[str]) -> list[str]:
    """`plan` writes no folder and prints the plan alone on stdout (its log stays on stderr: `> plan.txt` works)."""
    return [*argv, "hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout"]


def _resume_overrides(argv: list[str]) -> list[str]:
    """A resumed run writes into the folder it continues, and keeps the Hydra files of its first session there."""
    resume = any(a.startswith("resume=") and a != "resume=null" for a in argv)
    if resume and not any(a.startswith("hydra.run.dir=") for a in argv):
        return [*argv, "hydra.run.dir=${resume}", "hydra.output_subdir=null"]
    return argv


def _job(command: str, cfg, question: str | None = None) -> int:  # noqa: ANN001 (a DictConfig)
    """One Hydra job: errors a user can act on become one line and an exit code (a sweep's other jobs go on)."""
    from orthrus_rag.entrypoints.cli_errors import describe_error

    _quiet_third_party()  # NOTE: again here: Hydra has just configured this job's logging
    try:
        cfg = _job_config(command, cfg)
        return _task(command, cfg, question)
    except (Exception, KeyboardInterrupt) as exc:
        described = describe_error(exc, cfg.resume or cfg.run_dir)
        if described is None:  # a bug: keep the traceback
            raise
        code, message = described
        logging.getLogger(__name__).debug("stopped", exc_info=True)
        print(message, file=sys.stderr)
        if code == EXIT_CONFIG and cfg.resume is None:
            _remove_unstarted(Path(cfg.run_dir))
        if isinstance(exc, KeyboardInterrupt):  # NOTE: stop a sweep too, not just this job
            raise SystemExit(code) from None
        return code


def _remove_unstarted(folder: Path) -> None:
    """A run that could not start leaves no folder behind: remove `folder` if it holds nothing but what Hydra wrote
    at job start (`.hydra/`, the job's log), so the same `run_dir` works once the config is fixed."""
    import shutil

    if not folder.is_dir() or folder.resolve() == Path.cwd().resolve():
        return
    entries = list(folder.iterdir())
    if all(e.name == ".hydra" or (e.suffix == ".log" and e.is_file()) for e in entries):
        _detach_file_logs(folder)
        shutil.rmtree(folder, ignore_errors=True)


def _detach_file_logs(folder: Path) -> None:
    """Close the log handlers Hydra opened into `folder`: a handler left on a removed file raises
    FileNotFoundError at the next record it reopens for (in this process: a test, a notebook, a second command)."""
    root = folder.resolve()
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    for log in loggers:
        for handler in list(getattr(log, "handlers", [])):
            path = getattr(handler, "baseFilename", None)
            if path is not None and Path(path).resolve().is_relative_to(root):
                log.removeHandler(handler)
                handler.close()


def _job_config(command: str, cfg):  # noqa: ANN001, ANN202 (DictConfigs)
    """The job's run folder is Hydra's output folder (a sweep: one per job); a bare `resume=DIR` (operational
    overrides aside; for `index`, any) continues with the config DIR was started with."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    from orthrus_rag.config.app import OPERATIONAL_KEYS
    from orthrus_rag.config.saved import resumed_config
    from orthrus_rag.pipelines.run_store import CONFIG, RunStore

    hc = HydraConfig.get()
    if cfg.resume is not None and hc.mode == RunMode.MULTIRUN:
        raise ValueError("resume= continues one run folder, not a sweep: resume each job on its own "
                         "(orthrus-rag run resume=<sweep folder>/<job number>)")
    cfg.run_dir = hc.runtime.output_dir
    if cfg.resume is None:
        return cfg
    keys = {o.key_or_group for o in OverridesParser.create().parse_overrides(list(hc.overrides.task))}
    saved = RunStore(cfg.resume).read_text(CONFIG)
    if saved is not None and (keys <= set(OPERATIONAL_KEYS) or command == "index"):
        # NOTE: an index folder may be resumed as another index (retriever=hybrid, another factory): IndexBuilder
        # refuses a change of corpus, embedder or shard size by itself
        return resumed_config(saved, cfg, keys, any_key=command == "index")
    return cfg  # NOTE: app.run checks it against the saved config and names any difference


def _task(command: str, cfg, question: str | None = None) -> int:  # noqa: ANN001 (a DictConfig)
    from orthrus_rag.entrypoints import commands as app

    if command in ("plan", "ask"):
        for handler in logging.getLogger().handlers:  # NOTE: the log on stderr, the plan or answer alone on stdout
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
                handler.setStream(sys.stderr)
    if command == "ask":
        from orthrus_rag.entrypoints.ask import ask

        return ask(cfg, question)
    if command == "plan":
        from orthrus_rag.config.build import engine_config_from
        from orthrus_rag.engine.engine import Engine

        print(Engine.from_config(engine_config_from(cfg)).plan)
        return EXIT_OK

    if command == "serve":
        from orthrus_rag.entrypoints.openai import serve

        serve(cfg)
        return EXIT_OK
    if command == "index":
        print(f"index saved to {app.index(cfg)}")
        return EXIT_OK
    summary = app.run(cfg)
    from orthrus_rag.pipelines import format_table

    folder = cfg.resume or cfg.run_dir
    print(format_table(summary))
    eng = summary.get("engine")
    if eng is None:  # a deployment: its workers' steps are not seen here
        print(f"served by {summary['config']['serving']}; records in {folder}")
    else:
        print(f"engine: {eng['num_steps']} steps, {eng['num_mixed_steps']} carried embedding and generation tokens "
              f"together; records in {folder}")
    if summary["num_failed"]:
        reasons = ", ".join(f"{n} {reason}" for reason, n in summary["failures"].items())
        print(f"{summary['num_failed']} of {summary['num_questions']} questions failed ({reasons}); "
              f"summary.json lists them under 'failed'", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def summarize(args: argparse.Namespace) -> int:
    from orthrus_rag.pipelines.sweep import find_runs, sweep_table

    try:
        runs = find_runs(args.paths)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if not runs:
        print(f"error: no run folders (with summary.json) under {', '.join(args.paths)}", file=sys.stderr)
        return EXIT_CONFIG
    base = Path(args.paths[0]) if len(args.paths) == 1 else None
    print(sweep_table(runs, base))
    return EXIT_OK


def compare(args: argparse.Namespace) -> int:
    from orthrus_rag.pipelines.compare import compare_runs, comparison_table

    try:
        result = compare_runs(args.base, args.other, resamples=args.resamples, seed=args.seed, level=args.level)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(comparison_table(result))
    return EXIT_OK


def export(args: argparse.Namespace) -> int:
    from orthrus_rag.pipelines.export import export_run

    try:
        path = export_run(args.run_dir, args.format, args.out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"exported to {path}")
    return EXIT_OK


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("orthrus-rag")
    except PackageNotFoundError:  # NOTE: run from a checkout without an install (PYTHONPATH)
        from orthrus_rag import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("run", "index", "serve", "plan", "ask"):
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        _quiet_third_party()
        question, rest = _question(argv[1:]) if argv[0] == "ask" else (None, argv[1:])
        return _hydra(argv[0], rest, question)
    parser = argparse.ArgumentParser(prog="orthrus-rag", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"orthrus-rag {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="answer a dataset's questions (Hydra overrides follow)")
    sub.add_parser("index", help="build a dataset's retrieval index (Hydra overrides follow)")
    p = sub.add_parser("summarize", help="table run folders (e.g. a sweep's jobs) side by side")
    p.add_argument("paths", nargs="+", help="run folders, or folders holding them (a sweep's run_dir)")
    p = sub.add_parser("compare", help="two runs of one dataset, paired per question (bootstrap intervals)")
    p.add_argument("base", help="run folder: the reference")
    p.add_argument("other", help="run folder: the run compared with it")
    p.add_argument("--resamples", type=int, default=10_000, help="bootstrap draws (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="the draws' seed (default 0: a table is reproducible)")
    p.add_argument("--level", type=float, default=0.95, help="the intervals' coverage (default 0.95)")
    p = sub.add_parser("export", help="a run's records in FlashRAG's result shape, for its evaluator")
    p.add_argument("run_dir", help="run folder (records.jsonl)")
    p.add_argument("--format", default="flashrag", choices=["flashrag"], help="the shape (default flashrag)")
    p.add_argument("--out", default=None, help="file to write (default RUN_DIR/intermediate_data.json)")
    sub.add_parser("serve", help="the OpenAI-compatible server (Hydra overrides follow)")
    sub.add_parser("ask", help="answer a question over your index, streamed and cited (the question, then Hydra "
                               "overrides; without a question, a prompt)")
    sub.add_parser("plan", help="load the engine a config builds and print its execution plan: what runs each part "
                                "of a step here (Hydra overrides follow)")
    p = sub.add_parser("demo", help="generate and embed together on the built-in models")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--embedding-model", default=None,
                   help="separate encoder (e.g. all-minilm-l6-v2); default: embed with the shared backbone")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return {"demo": demo, "summarize": summarize, "compare": compare, "export": export}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
