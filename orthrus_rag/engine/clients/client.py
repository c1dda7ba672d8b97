"""A client seam for load generation: submit requests one at a time, poll for finished outputs.

Every system of the same engine is driven through it, so a benchmark measures them all from the caller side:
- `InProcessClient`: one `Engine` in this process, stepped by the caller's `poll` (policies `orthrus`,
  `qlen-priority`, `hetero-fcfs`, `unified-homo`).
- `DedicatedDeployment` / `DisaggPDDeployment`: two worker processes; `poll` reads their results queue.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

from orthrus_rag.config import EngineConfig
from orthrus_rag.engine.loop import EngineLoop, StepFailed
from orthrus_rag.engine.core.request import RequestKind
from orthrus_rag.engine.deploy.deployments import DEPLOYMENTS
from orthrus_rag.engine.deploy.spec import build_engine_for
from orthrus_rag.engine.core.policies import POLICIES
from orthrus_rag.engine.stats import StepStats
from orthrus_rag.outputs import EngineOutput, error_output
from orthrus_rag.params import PoolingParams, SamplingParams

if TYPE_CHECKING:
    from orthrus_rag.engine.engine import Engine

logger = logging.getLogger(__name__)
Kind = Literal["embed", "generate"]
IN_PROCESS_SYSTEMS = tuple(POLICIES)  # one engine, the policy decides
SYSTEMS = (*POLICIES, *DEPLOYMENTS)  # + "dedicated", "disagg-pd"


class ServingClient(Protocol):
    """What a load generator needs from a serving system. Request ids must be unique among unfinished requests."""

    def submit(self, kind: Kind, request_id: str, input: str | Sequence[int],
               params: SamplingParams | PoolingParams | None) -> None:
        """Queue one request; returns at once."""
        ...

    def poll(self, timeout_s: float) -> list[EngineOutput]:
        """Finished outputs since the last poll (possibly none); waits at most about `timeout_s` when idle."""
        ...

    def shutdown(self) -> None:
        """Release the system (idempotent)."""
        ...


class InProcessClient:
    """An `Engine` driven from the caller's thread through its `EngineLoop`: `poll` runs one step when work
    exists. A step that raises fails every request in flight: each comes back as an error output.

    `step_log` keeps (monotonic end time, StepStats) of every step it ran: the per-step token mix over time."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self.loop = EngineLoop(engine)
        self.step_log: list[tuple[float, StepStats]] = []
        self._done: list[EngineOutput] = []

    def submit(self, kind: Kind, request_id: str, input: str | Sequence[int],
               params: SamplingParams | PoolingParams | None) -> None:
        self.loop.add(RequestKind(kind), request_id, input, params, _RequestSink(self, kind, request_id))

    def poll(self, timeout_s: float) -> list[EngineOutput]:
        if self.loop.has_work:
            num_steps = self.engine.num_steps
            with contextlib.suppress(StepFailed):  # NOTE: its requests come back as error outputs
                self.loop.run_step()
            if self.engine.num_steps > num_steps:
                self.step_log.append((time.monotonic(), self.engine.step_stats[-1]))
        elif not self._done:
            time.sleep(max(0.0, timeout_s))
        done, self._done = self._done, []
        return done

    def shutdown(self) -> None:
        self.loop.fail_all(RuntimeError("the client was shut down"))
        self.engine.shutdown()


class _RequestSink:
    """One request's `EngineLoop` sink: its final output, or an error output naming why it failed."""

    def __init__(self, client: InProcessClient, kind: str, request_id: str) -> None:
        self.client, self.kind, self.request_id = client, kind, request_id  # NOTE: poll replaces client._done

    def put(self, output: Any) -> None:
        if output.finished:
            self.client._done.append(output)

    def fail(self, exc: BaseException) -> None:
        self.client._done.append(error_output(self.kind, self.request_id, f"{type(exc).__name__}: {exc}"))


def make_client(system: str, config: EngineConfig, threads: int | Sequence[int] | None = None) -> ServingClient:
    """A client for `system` (one of SYSTEMS) built from `config` (an in-process system replaces its policy). `threads`: torch threads of the in-process
    engine (default 2), or per worker of a two-process deployment (default 1 each)."""
    if system in IN_PROCESS_SYSTEMS:
        num_threads = 2 if threads is None else (threads if isinstance(threads, int) else sum(threads))
        policy = replace(config, scheduler=replace(config.scheduler, policy=system))
        return InProcessClient(build_engine_for(policy, num_threads))
    if system in DEPLOYMENTS:
        per_worker = (1, 1) if threads is None else ((threads, threads) if isinstance(threads, int)
                                                     else tuple(threads))
        return DEPLOYMENTS[system](config, per_worker)
    raise ValueError(f"unknown system {system!r}; expected one of {', '.join(SYSTEMS)}")
