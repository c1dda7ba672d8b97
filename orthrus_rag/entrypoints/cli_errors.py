"""What `orthrus-rag` tells a user when a command stops: one line naming the cause and the fix, and the exit code.

Exit codes: 0 every question answered; 1 the run finished with failed questions, or stopped part-way (a full
disk, a dead serving backend, an interrupt: what was recorded is kept and `resume=` continues it); 2 the run could
not start (a bad configuration or input, a dataset or model the hub could not provide, a run folder that cannot
be written). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
_NETWORK_MODULES = ("huggingface_hub", "httpx", "httpcore", "requests", "urllib3", "aiohttp", "fsspec")
_HUB_FIX = ("work offline with a built-in model (smollm2-135m-instruct, all-minilm-l6-v2), a local model folder or "
            "dataset file (dataset.path=...), or allow network access (HF_HUB_OFFLINE=0)")


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _is_network(exc: BaseException) -> bool:
    return any(type(e).__module__.split(".")[0] in _NETWORK_MODULES for e in _chain(exc))


def describe_error(exc: BaseException, run_dir: str | None = None) -> tuple[int, str] | None:
    """(exit code, message) for an error a user can act on; None for a bug. `run_dir` fills in the resume hint."""
    described = _describe(exc)
    if described is None or run_dir is None:
        return described
    return described[0], described[1].replace("<run_dir>", str(run_dir))


def _describe(exc: BaseException) -> tuple[int, str] | None:
    from orthrus_rag.data.loaders import DatasetUnavailableError
    from orthrus_rag.pipelines.run_store import RunStoreError
    from orthrus_rag.retrievers.faiss_index import FaissMissing

    if isinstance(exc, KeyboardInterrupt):
        return EXIT_FAILED, "interrupted; every answered question is recorded: continue with resume=<run_dir>"
    if isinstance(exc, RunStoreError):
        return (EXIT_FAILED if exc.num_records else EXIT_CONFIG), f"error: {exc}"
    if isinstance(exc, (DatasetUnavailableError, FaissMissing)):
        return EXIT_CONFIG, f"error: {exc}"
    if isinstance(exc, ValueError):  # bad configuration or input (the message says which)
        return EXIT_CONFIG, f"error: {exc}"
    if _is_network(exc):
        return EXIT_CONFIG, f"error: the hub could not provide a model or dataset ({_first_line(exc)}); {_HUB_FIX}"
    if _is_backend_failure(exc):
        return EXIT_FAILED, (f"error: the serving backend failed ({_first_line(exc)}); the questions answered "
                             "before are recorded: continue with resume=<run_dir>")
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return EXIT_FAILED, (f"error: {exc.strerror or _first_line(exc)}{where}; free space or fix permissions, "
                             "then run again (a started run continues with resume=<run_dir>)")
    return None


def _is_backend_failure(exc: BaseException) -> bool:
    from orthrus_rag.engine.clients.protocol import ClientFailed, EngineShutdown

    return isinstance(exc, (EngineShutdown, ClientFailed))
