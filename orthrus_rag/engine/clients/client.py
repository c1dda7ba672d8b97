"""A client seam for load generation: submit requests one at a time, poll for finished outputs.

Every system of the same engine is driven through it, so a benchmark measures them all from the caller side:
- `InProcessClient`: one `Engine` in this process, stepped by the caller's `poll` (policies `orthrus`,
  `qlen-priority`, `hetero-fcfs`, `unified-homo`).
- `DedicatedDeployment` / `DisaggPDDeployment`: two worker processes; `poll` reads their results queue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Literal, Protocol

from orthrus_rag.config import EngineConfig
from orthrus_rag.engine.deploy.deployments import DEPLOYMENTS
from orthrus_rag.engine.deploy.spec import build_engine_for
from orthrus_rag.engine.policies import POLICIES
from orthrus_rag.engine.stats import StepStats
from orthrus_rag.outputs import EmbeddingOutput, GenerationOutput
from orthrus_rag.params import PoolingParams, SamplingParams

if TYPE_CHECKING:
    from orthrus_rag.engine.engine import Engine

logger = logging.getLogger(__name__)
Kind = Literal["embed", "generate"]
Output = GenerationOutput | EmbeddingOutput
IN_PROCESS_SYSTEMS = POLICIES  # one engine, the policy decides
SYSTEMS = (*POLICIES, *DEPLOYMENTS)  # + "dedicated", "disagg-pd"


class ServingClient(Protocol):
    """What a load generator needs from a serving system. Request ids must be unique among unfinished requests."""

    def submit(self, kind: Kind, request_id: str, input: str | Sequence[int],
               params: SamplingParams | PoolingParams | None) -> None:
        """Queue one request; returns at once."""
        ...

    def poll(self, timeout_s: float) -> list[Output]:
        """Finished outputs since the last poll (possibly none); waits at most about `timeout_s` when idle."""
        ...

    def shutdown(self) -> None:
        """Release the system (idempotent)."""
        ...


class InProcessClient:
    """An `Engine` driven from the caller's thread: `poll` runs one engine step when work exists.

    `step_log` keeps (monotonic end time, StepStats) of every step it ran: the per-step token mix over time."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self.step_log: list[tuple[float, StepStats]] = []

    def submit(self, kind: Kind, request_id: str, input: str | Sequence[int],
               params: SamplingParams | PoolingParams | None) -> None:
        if kind == "generate":
            assert params is None or isinstance(params, SamplingParams)
            self.engine.add_generate(input, params, request_id)
        elif kind == "embed":
            assert params is None or isinstance(params, PoolingParams)
            self.engine.add_embed(input, params, request_id)
        else:
            raise ValueError(f"unknown request kind {kind!r}; expected 'embed' or 'generate'")

    def poll(self, timeout_s: float) -> list[Output]:
        if not self.engine.has_unfinished():
            time.sleep(max(0.0, timeout_s))
            return []
        num_steps = self.engine.num_steps
        outputs = self.engine.step()
        if self.engine.num_steps > num_steps:
            self.step_log.append((time.monotonic(), self.engine.step_stats[-1]))
        return [o for o in outputs if o.finished and isinstance(o, (GenerationOutput, EmbeddingOutput))]

    def shutdown(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
        self.engine.shutdown()


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
