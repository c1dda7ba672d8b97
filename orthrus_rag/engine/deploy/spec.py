"""What the deployments share: work items, errors, and how a worker builds its engine
(from a picklable `EngineConfig`, made by orthrus_rag/config/build.py)."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from orthrus_rag.config import EngineConfig
from orthrus_rag.params import PoolingParams, SamplingParams

if TYPE_CHECKING:
    from orthrus_rag.engine.engine import Engine

Inputs = str | Sequence[str | Sequence[int]]


def build_engine_for(config: EngineConfig, num_threads: int) -> "Engine":
    """The engine a worker runs, with torch limited to `num_threads` intra-op threads."""
    from orthrus_rag.engine.engine import Engine

    return Engine.from_config(replace(config, num_threads=num_threads))


@dataclass
class WorkItem:
    """One request of a `run()` call, as sent to a worker; `index` is its place in the caller's list."""

    index: int
    request_id: str
    kind: str  # "generate" | "embed"
    input: str | Sequence[int]
    params: SamplingParams | PoolingParams | None


class WorkerError(RuntimeError):
    """A deployment's worker rejected a request, failed or disappeared; `remote_traceback` is its side.

    `request_ids`: the requests a rejection concerns (empty when the whole deployment failed)."""

    def __init__(self, message: str, remote_traceback: str | None = None,
                 request_ids: Sequence[str] = ()) -> None:
        super().__init__(message if remote_traceback is None else f"{message}\n--- worker traceback ---\n"
                         f"{remote_traceback.rstrip()}")
        self.remote_traceback = remote_traceback
        self.request_ids = tuple(request_ids)


def dumps(message: tuple) -> bytes:
    """Pickle a message in the sender, so an unpicklable argument fails in the caller, not in a queue's feeder
    thread. NOTE: plain pickle copies tensors by value (torch's ForkingPickler would move them to shared memory,
    whose file descriptors must outlive the receive)."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(raw: bytes) -> tuple:
    return pickle.loads(raw)
