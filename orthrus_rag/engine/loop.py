"""`EngineLoop`: the one owner of `Engine.step`. Every front end (the asyncio engine, a deployment's worker process,
`Engine.run_until_done`) is a thin shell around it. It takes commands keyed by `RequestKind` (add, continue, abort),
steps the engine, and routes each output to the sink of its request: streaming snapshots as they come, the final
output once. A step that raises fails every pending request, of every sink, with that error as the cause (their KV
blocks freed), and the loop goes on serving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from orthrus_rag.engine.core.request import RequestKind
from orthrus_rag.outputs import EngineOutput
from orthrus_rag.params import PoolingParams, RerankParams, SamplingParams

logger = logging.getLogger(__name__)


class RequestSink(Protocol):
    """Where one request's results go. Called on the loop's thread; must not block."""

    def put(self, output: EngineOutput) -> None:
        """A streaming snapshot (`output.finished` False) or the request's final output (an abort included)."""

    def fail(self, exc: BaseException) -> None:
        """The request failed as a whole (its step raised, the loop shut down); nothing follows."""


class StepFailed(RuntimeError):
    """An engine step raised (its `__cause__`); every request pending at that moment failed with that error."""


class EngineLoop:
    """Commands in, outputs out, for one engine. `orphan`: where outputs of requests that have no sink go (added
    to the engine directly, as `Engine.run` does); None drops them."""

    # NOTE: `engine` is an Engine (engine/engine.py), not imported here: Engine.run_until_done builds a loop itself
    def __init__(self, engine: Any, orphan: Callable[[EngineOutput], None] | None = None) -> None:
        self.engine = engine
        self.orphan = orphan
        self.sinks: dict[str, RequestSink] = {}

    # ---- commands ---------------------------------------------------------------------------------------------
    def add(self, kind: RequestKind, request_id: str | None, input: Any,
            params: SamplingParams | PoolingParams | RerankParams | None,
            sink: RequestSink, *, stream: bool = False, handoff: bool = False) -> str:
        """Queue one request whose results go to `sink`; bad input raises (ValueError / TypeError) and adds
        nothing. The one place that dispatches on the kind of a request."""
        if kind is RequestKind.GENERATE:
            rid = self.engine.add_generate(input, params, request_id, stream=stream, handoff=handoff)
        elif kind is RequestKind.EMBED:
            rid = self.engine.add_embed(input, params, request_id)
        elif kind is RequestKind.SCORE:  # input: a (query, document) pair
            if not isinstance(input, (tuple, list)) or len(input) != 2:
                raise TypeError("a scoring request's input is a (query, document) pair")
            rid = self.engine.add_score(input[0], input[1], params, request_id)
        else:
            kinds = ", ".join(k.value for k in RequestKind)
            raise ValueError(f"unknown request kind {kind!r}; expected one of {kinds}")
        self.sinks[rid] = sink
        return rid

    def continue_(self, request_id: str, appended: Any, params: SamplingParams | None, sink: RequestSink, *,
                  stream: bool = False) -> str:
        """Continue a finished generation with appended tokens (Engine.continue_); bad input raises, adds nothing."""
        rid = self.engine.continue_(request_id, appended, params, stream=stream)
        self.sinks[rid] = sink
        return rid

    def add_prefilled(self, handoff: Any, sink: RequestSink) -> str:
        """Continue a generation another engine prefilled (engine/handoff.py)."""
        rid = self.engine.add_prefilled(handoff)
        self.sinks[rid] = sink
        return rid

    def abort(self, request_id: str) -> bool:
        """Abort a request: its blocks are freed at once and its sink gets a final output with finish_reason
        "abort". False if it is unknown or already finished."""
        out = self.engine.abort(request_id)
        if out is None:
            return False
        sink = self.sinks.pop(request_id, None)
        if sink is not None:
            sink.put(out)
        return True

    # ---- stepping -----------------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def run_step(self) -> None:
        """One engine step, its outputs routed; a step that raises fails every pending request and raises
        `StepFailed` (the engine is then empty and usable again)."""
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing %d pending requests",
                             len(self.engine.unfinished_request_ids()))
            self.fail_all(exc)  # NOTE: each caller gets the cause itself
            raise StepFailed(f"the engine step failed: {type(exc).__name__}: {exc}") from exc
        for out in outputs:
            sink = self.sinks.pop(out.request_id, None) if out.finished else self.sinks.get(out.request_id)
            if sink is not None:
                sink.put(out)
            elif self.orphan is not None:
                self.orphan(out)

    def fail_all(self, exc: BaseException) -> None:
        """Abort every request in the engine (freeing its blocks) and fail each sink's request with `exc`."""
        for rid in self.engine.unfinished_request_ids():
            self.engine.abort(rid)
        sinks, self.sinks = self.sinks, {}
        for sink in sinks.values():
            sink.fail(exc)

    def run_until_done(self, max_steps: int) -> None:
        """Step until the engine has no unfinished request; RuntimeError past `max_steps` steps."""
        for _ in range(max_steps):
            if not self.has_work:
                return
            self.run_step()
        if self.has_work:
            raise RuntimeError(f"requests unfinished after {max_steps} steps")
