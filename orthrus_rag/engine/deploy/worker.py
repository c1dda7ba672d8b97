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
from orthrus_rag.engine.engine import Engine, Output
from orthrus_rag.engine.handoff import HandoffOutput
from orthrus_rag.engine.deploy.spec import WorkItem, build_engine_for, dumps, loads
from orthrus_rag.outputs import EmbeddingOutput

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
    def __init__(self, engine: Engine, role: str, inbox: Any, results: Any, handoff_to: Any) -> None:
        self.engine = engine
        self.role = role
        self.inbox = inbox
        self.results = results
        self.handoff_to = handoff_to
        self.tags: dict[str, tuple[int, int]] = {}  # request id -> (batch, index in the caller's list)
        self._last_parent_check = time.monotonic()

    def serve(self) -> None:
        """Receive, add, step while work exists, send finished outputs back; ends on `stop` or parent exit."""
        while True:
            for msg in self._receive(block=not self.engine.has_unfinished()):
                if msg[0] == "stop":
                    return
                self._handle(msg)
            if self.engine.has_unfinished():
                self._step()

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
            for rid, (batch, _) in list(self.tags.items()):
                if batch == msg[1]:
                    self.engine.abort(rid)
                    del self.tags[rid]
        elif tag == "handoff":
            _, batch, index, handoff = msg
            self.tags[self.engine.add_prefilled(handoff)] = (batch, index)
        else:
            raise ValueError(f"unknown message {tag!r}")

    def _submit(self, batch: int, items: list[WorkItem]) -> None:
        """Add every item or none (like Engine.run: bad input is rejected before anything runs)."""
        added: list[str] = []
        try:
            for item in items:
                if item.kind == "generate":
                    rid = self.engine.add_generate(item.input, item.params, item.request_id,
                                                   handoff=self.handoff_to is not None)
                else:
                    rid = self.engine.add_embed(item.input, item.params, item.request_id)
                added.append(rid)
        except (ValueError, TypeError) as exc:
            for rid in added:
                self.engine.abort(rid)
            self.results.put(dumps(("rejected", self.role, batch, f"{type(exc).__name__}: {exc}")))
            return
        self.tags.update((item.request_id, (batch, item.index)) for item in items)
        self.results.put(dumps(("accepted", self.role, batch, None)))

    def _step(self) -> None:
        num_steps = self.engine.num_steps
        outputs = self.engine.step()
        if self.engine.num_steps == num_steps:
            raise RuntimeError(f"{self.role} engine stalled: {len(self.engine.requests)} unfinished requests, "
                               "none schedulable")
        by_batch: dict[int, list[tuple[int, Output]]] = defaultdict(list)
        for out in outputs:
            if not out.finished:
                continue
            batch, index = self.tags.pop(out.request_id)
            if isinstance(out, HandoffOutput):
                self.handoff_to.put(dumps(("handoff", batch, index, out)))
            else:
                by_batch[batch].append((index, _compact(out)))
        for batch, items in by_batch.items():
            self.results.put(dumps(("outputs", self.role, batch, items)))


def _compact(out: Output) -> Output:
    """An embedding that views a larger tensor would pickle that whole storage; send a copy of just itself."""
    if isinstance(out, EmbeddingOutput) and out.embedding.untyped_storage().nbytes() > out.embedding.nbytes:
        out.embedding = out.embedding.clone()
    return out
