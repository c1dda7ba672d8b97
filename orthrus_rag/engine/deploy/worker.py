"""A deployment's worker process: one engine, a loop, messages in and out.

Messages are pickled tuples `(tag, ...)`. In (the worker's inbox): `("submit", batch, [WorkItem])`,
`("abort", batch)`, `("handoff", batch, index, HandoffOutput)` from a prefill worker, `("stop",)`.
Out (the shared results queue): `(tag, role, batch, payload)` with tag `ready`, `accepted`, `rejected` (payload: the
error), `outputs` (payload: [(index, output)]) or `fatal` (payload: a traceback; the worker then exits).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import time
import traceback
from collections import defaultdict
from typing import Any

import torch

from orthrus_rag.config import EngineConfig
from orthrus_rag.engine.deploy.spec import WorkItem, build_engine_for, dumps, loads
from orthrus_rag.engine.engine import Engine
from orthrus_rag.engine.loop import EngineLoop, StepFailed
from orthrus_rag.engine.core.request import RequestKind
from orthrus_rag.outputs import EmbeddingOutput, EngineOutput, HandoffOutput, error_output

logger = logging.getLogger(__name__)
IDLE_POLL_S = 0.5  # how often an idle worker checks that its parent is still alive


def worker_main(config: EngineConfig, role: str, num_threads: int, inbox: Any, results: Any,
                handoff_to: Any = None) -> None:
    """Entry point of a spawned worker: build the engine, then serve until told to stop or the parent is gone.
    With `handoff_to` (a prefill worker), generations go to that queue once their first token is sampled."""
    stopped = False
    try:
        torch.set_num_threads(num_threads)
        engine = build_engine_for(config, num_threads)
        results.put(dumps(("ready", role, None, None)))
        _Worker(engine, role, inbox, results, handoff_to).serve()
        stopped = True
    except BaseException:  # NOTE: report anything, even KeyboardInterrupt, so the caller never waits in vain
        results.put(dumps(("fatal", role, None, traceback.format_exc())))
    finally:
        # NOTE: unread messages must not keep a stopping worker alive (a queue flushes its buffer at exit)
        if handoff_to is not None:
            handoff_to.cancel_join_thread()
        if stopped:
            results.cancel_join_thread()


class _Worker:
    """A thin shell around the engine's `EngineLoop`: messages in, outputs out. A step that raises fails every
    request it held (each comes back as an error output naming the cause) and the worker serves on."""

    def __init__(self, engine: Engine, role: str, inbox: Any, results: Any, handoff_to: Any) -> None:
        self.engine = engine
        self.loop = EngineLoop(engine)
        self.role = role
        self.inbox = inbox
        self.results = results
        self.handoff_to = handoff_to
        self.outgoing: dict[int, list[tuple[int, EngineOutput]]] = defaultdict(list)  # batch -> (index, output)
        self._last_parent_check = time.monotonic()

    def serve(self) -> None:
        """Receive, add, step while work exists, send finished outputs back; ends on `stop` or parent exit."""
        while True:
            for msg in self._receive(block=not self.loop.has_work):
                if msg[0] == "stop":
                    return
                self._handle(msg)
            if self.loop.has_work:
                self._step()
            self._send()

    def _receive(self, block: bool) -> list[tuple]:
        msgs: list[tuple] = []
        try:
            if block:
                msgs.append(loads(self.inbox.get(timeout=IDLE_POLL_S)))
            while True:
                msgs.append(loads(self.inbox.get_nowait()))
        except queue.Empty:
            pass
        # NOTE: also while busy (at most every IDLE_POLL_S): an orphan must not keep stepping a backlog
        now = time.monotonic()
        if (block and not msgs) or now - self._last_parent_check >= IDLE_POLL_S:
            self._last_parent_check = now
            parent = mp.parent_process()
            if parent is not None and not parent.is_alive():
                return [("stop",)]
        return msgs

    def _handle(self, msg: tuple) -> None:
        tag = msg[0]
        if tag == "submit":
            self._submit(msg[1], msg[2])
        elif tag == "abort":
            for rid, sink in list(self.loop.sinks.items()):
                if sink.batch == msg[1]:
                    sink.silent = True  # NOTE: the caller gave this batch up; nothing of it goes back
                    self.loop.abort(rid)
        elif tag == "handoff":
            _, batch, index, handoff = msg
            self.loop.add_prefilled(handoff, _Sink(self, batch, index, "generate", handoff.request_id))
        else:
            raise ValueError(f"unknown message {tag!r}")

    def _submit(self, batch: int, items: list[WorkItem]) -> None:
        """Add every item or none (like Engine.run: bad input is rejected before anything runs)."""
        handoff = self.handoff_to is not None
        try:
            for item in items:  # NOTE: one sink per item; a refused item undoes the batch's others below
                self.loop.add(RequestKind(item.kind), item.request_id, item.input, item.params,
                              _Sink(self, batch, item.index, item.kind, item.request_id),
                              handoff=handoff and item.kind == "generate")
        except (ValueError, TypeError) as exc:
            for item in items:
                sink = self.loop.sinks.get(item.request_id)
                if sink is not None and sink.batch == batch:
                    sink.silent = True
                    self.loop.abort(item.request_id)
            self.results.put(dumps(("rejected", self.role, batch, f"{type(exc).__name__}: {exc}")))
            return
        self.results.put(dumps(("accepted", self.role, batch, None)))

    def _step(self) -> None:
        num_steps = self.engine.num_steps
        try:
            self.loop.run_step()
        except StepFailed:  # NOTE: its requests got error outputs naming the cause (sent below); serve on
            return
        if self.engine.num_steps == num_steps:
            raise RuntimeError(f"{self.role} engine stalled: {len(self.engine.unfinished_request_ids())} "
                               "unfinished requests, none schedulable")

    def _send(self) -> None:
        for batch, items in self.outgoing.items():
            self.results.put(dumps(("outputs", self.role, batch, items)))
        self.outgoing.clear()


class _Sink:
    """One request's `EngineLoop` sink in a worker: its final output goes back to the caller (`batch`, `index`),
    a handoff to the decode worker, a failure as an error output."""

    def __init__(self, worker: _Worker, batch: int, index: int, kind: str, request_id: str) -> None:
        self.worker, self.batch, self.index, self.kind, self.request_id = worker, batch, index, kind, request_id
        self.silent = False

    def put(self, output: EngineOutput) -> None:
        if not output.finished or self.silent:
            return
        if isinstance(output, HandoffOutput):
            self.worker.handoff_to.put(dumps(("handoff", self.batch, self.index, output)))
        else:
            self.worker.outgoing[self.batch].append((self.index, _compact(output)))

    def fail(self, exc: BaseException) -> None:
        if not self.silent:
            message = f"{type(exc).__name__}: {exc}"
            self.worker.outgoing[self.batch].append((self.index, error_output(self.kind, self.request_id, message)))


def _compact(out: EngineOutput) -> EngineOutput:
    """An embedding that views a larger tensor would pickle that whole storage; send a copy of just itself."""
    if isinstance(out, EmbeddingOutput) and out.embedding.untyped_storage().nbytes() > out.embedding.nbytes:
        out.embedding = out.embedding.clone()
    return out
