"""An asyncio front end for the sync Engine: many coroutines share one engine owned by one background thread.

The thread is a thin shell around the engine's one `EngineLoop`: it drains a thread-safe command queue (add,
abort, stop) into it, steps it while work exists and hands results to the event loop with
`call_soon_threadsafe`; futures, stream queues and the pending count live on the event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import torch

from orthrus_rag.engine.async_sinks import Sink, Snapshots
from orthrus_rag.engine.clients.protocol import EngineQueueFull, EngineShutdown, PairScoring, refuse_inside_event_loop
from orthrus_rag.engine.core.request import RequestKind
from orthrus_rag.engine.engine import Engine
from orthrus_rag.engine.executor.plan import ExecutionPlan
from orthrus_rag.engine.loop import EngineLoop, StepFailed
from orthrus_rag.machine import release_openmp_pool
from orthrus_rag.outputs import EmbeddingOutput, GenerationOutput, ScoreOutput, StepStats
from orthrus_rag.params import EmbeddingSpace, PoolingParams, RerankParams, SamplingParams, is_bulk

logger = logging.getLogger(__name__)


class _Outbox:
    """The engine thread's side of one request's sink (an `EngineLoop` sink): results wait in the outbox until
    the thread hands the batch to the event loop."""

    def __init__(self, owner: "AsyncEngine", sink: Sink) -> None:
        self.owner, self.sink = owner, sink  # NOTE: the owner's outbox list is replaced at every flush

    def put(self, output: Any) -> None:
        self.owner._outbox.append((self.sink, output, output.finished))

    def fail(self, exc: BaseException) -> None:
        self.owner._outbox.append((self.sink, exc, True))


class AsyncEngine(PairScoring):
    """One in-process `Engine` as an `EngineClient` (engine/clients/protocol.py): embeddings and generations from
    every coroutine share its steps. `max_in_flight` bounds its unfinished requests (more: `EngineQueueFull`).

    Bulk requests (`priority > 0`: documents ingested while serving) are counted apart, against
    `max_bulk_in_flight` (default: `max_in_flight`): an ingest in flight never takes a serving request's place, so
    it never turns a serving request into a 429, and `num_in_flight` (what the server's admission reads) counts
    serving requests only."""

    def __init__(self, engine: Engine, max_in_flight: int = 1024, max_bulk_in_flight: int | None = None) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        if max_bulk_in_flight is not None and max_bulk_in_flight < 1:
            raise ValueError(f"max_bulk_in_flight must be at least 1, got {max_bulk_in_flight}")
        self._engine = engine
        self.name = f"engine ({engine.config.scheduler.policy})"
        self.tokenizer = engine.tokenizer
        self.max_in_flight = max_in_flight
        self.max_bulk_in_flight = max_bulk_in_flight or max_in_flight
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Future[None] | None = None
        self._closed = False
        self._sync_lock = threading.Lock()  # embed_sync on the sync engine, before the loop thread owns it
        self._num_in_flight = 0  # event-loop side: submitted and not yet finished/failed
        self._num_bulk_in_flight = 0  # the same, of bulk requests (priority > 0), which _num_in_flight leaves out
        self._ids = itertools.count()
        # engine-thread side
        self._loop_core = EngineLoop(engine)
        # NOTE: the engine will step on a thread of its own: the OpenMP pool of the thread that built it (and builds
        # this front end, e.g. LangChain's LocalOrthrus, whose event loop runs elsewhere) would only idle beside it
        release_openmp_pool()
        self._outbox: list[tuple[Sink, Any, bool]] = []

    @classmethod
    def from_pretrained(cls, *args: Any, max_in_flight: int = 1024, **kwargs: Any) -> "AsyncEngine":
        return cls(Engine.from_pretrained(*args, **kwargs), max_in_flight=max_in_flight)

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def plan(self) -> ExecutionPlan:
        """What runs each part of this engine's steps (a `PlanHolder`: engine/clients/protocol.py)."""
        return self._engine.plan

    @property
    def num_in_flight(self) -> int:
        """Serving requests submitted and unfinished (bulk ones are `num_bulk_in_flight`)."""
        return self._num_in_flight

    @property
    def num_bulk_in_flight(self) -> int:
        return self._num_bulk_in_flight

    @property
    def embedding_space(self) -> EmbeddingSpace:
        return self._engine.embedding_space

    def observe_steps(self, observer: Callable[[StepStats], None]) -> Callable[[], None]:
        """`observer` sees every step (on the engine's thread) until the returned function is called."""
        observers = self._engine.step_observers
        observers.append(observer)
        return lambda: observer in observers and observers.remove(observer)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop this engine is bound to (by its first request), or None before that."""
        return self._loop

    # ---- public API (event loop) ------------------------------------------------------------------------
    async def embed(self, text: str | Sequence[int], params: PoolingParams | None = None,
                    request_id: str | None = None) -> EmbeddingOutput:
        sink = self._submit(RequestKind.EMBED, request_id, text, params, stream=False)
        out = await self._await(sink)
        if out.error is not None:
            raise RuntimeError(f"embedding {out.request_id} failed: {out.error}")
        return out

    async def embed_many(self, texts: Sequence[str | Sequence[int]],
                         params: PoolingParams | None = None) -> list[EmbeddingOutput]:
        return await _all([self.embed(t, params) for t in texts])

    def embed_sync(self, texts: Sequence[str | Sequence[int]],
                   params: PoolingParams | None = None) -> list[EmbeddingOutput]:
        """Blocking embeddings from outside the event loop: before the first async request (an index built before
        a run starts) the engine is not yet the loop thread's, so it runs here; after, they go through the loop."""
        refuse_inside_event_loop()
        if self._loop is None:
            with self._sync_lock:
                if self._loop is None:
                    return self._engine.embed(list(texts), params)
        if self._loop.is_closed() or not self._loop.is_running():
            raise RuntimeError("the AsyncEngine's event loop is not running; embed from inside it (async API)")
        return asyncio.run_coroutine_threadsafe(self.embed_many(texts, params), self._loop).result()

    @property
    def reranker_names(self) -> list[str]:
        """The loaded rerankers (`model.rerankers`), the default first."""
        return list(self._engine.rerankers)

    async def score_pairs(self, pairs: Sequence[tuple[str, str]],
                          params: RerankParams | None = None) -> list[ScoreOutput]:
        """(query, document) pairs scored in the shared steps, in order. A bad pair fails the call (ValueError
        naming it) and the others are aborted."""
        return await _all([self._score(pair, params) for pair in pairs])

    async def _score(self, pair: tuple[str, str], params: RerankParams | None) -> ScoreOutput:
        out = await self._await(self._submit(RequestKind.SCORE, None, pair, params, stream=False))
        if out.error is not None:
            raise RuntimeError(f"scoring {out.request_id} failed: {out.error}")
        return ScoreOutput(out.request_id, float(out.embedding[0]), len(out.prompt_token_ids), out.metrics)

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> GenerationOutput:
        await self._prepare(params)
        sink = self._submit(RequestKind.GENERATE, request_id, prompt, params, stream=False)
        return await self._await(sink)

    async def generate_stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                              request_id: str | None = None) -> AsyncIterator[GenerationOutput]:
        """Yield growing snapshots; the last has `finished=True` (finish_reason "abort" if aborted). Leaving
        the loop early (break, cancellation) aborts the request."""
        await self._prepare(params)
        sink = self._submit(RequestKind.GENERATE, request_id, prompt, params, stream=True)
        async with contextlib.aclosing(self._stream(sink)) as items:  # NOTE: leaving early closes it: an abort
            async for item in items:
                yield item

    async def _stream(self, sink: Sink) -> AsyncIterator[GenerationOutput]:
        done = False
        try:
            while not done:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
        finally:
            if not done and not self._closed:
                self._commands.put(("abort", sink.request_id, None))

    async def continue_(self, request_id: str, appended: str | Sequence[int] = (),
                        params: SamplingParams | None = None) -> GenerationOutput:
        """Continue the finished generation `request_id` (it set `SamplingParams.hold_kv_s`) with `appended`, its KV
        kept (Engine.continue_); the output holds the continuation's new tokens and text."""
        await self._prepare(params)
        sink = self._submit(RequestKind.GENERATE, request_id, appended, params, stream=False, continued=True)
        return await self._await(sink)

    async def continue_stream(self, request_id: str, appended: str | Sequence[int] = (),
                              params: SamplingParams | None = None) -> AsyncIterator[GenerationOutput]:
        """`continue_` as growing snapshots (as `generate_stream`)."""
        await self._prepare(params)
        sink = self._submit(RequestKind.GENERATE, request_id, appended, params, stream=True, continued=True)
        async with contextlib.aclosing(self._stream(sink)) as items:  # NOTE: leaving early closes it: an abort
            async for item in items:
                yield item

    async def release(self, request_id: str) -> bool:
        """Forget a finished generation nobody will continue: its record and held KV go now (Engine.release)."""
        if self._closed or (self._stopped is not None and self._stopped.done()):
            return False
        self._bind()
        reply = self._loop.create_future()
        self._commands.put(("release", request_id, reply))
        return await reply

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its blocks are freed at once. False if it is unknown or already finished."""
        if self._closed or (self._stopped is not None and self._stopped.done()):
            return False  # NOTE: a dead loop thread would never answer
        self._bind()
        reply = self._loop.create_future()
        self._commands.put(("abort", request_id, reply))
        return await reply

    async def aclose(self) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop the loop thread; unfinished requests fail with EngineShutdown. Idempotent."""
        if self._closed:
            if self._stopped is not None:
                await asyncio.shield(self._stopped)
            return
        self._closed = True
        if self._thread is None:
            return
        self._commands.put(("stop",))
        await asyncio.shield(self._stopped)
        self._thread.join()

    async def __aenter__(self) -> "AsyncEngine":
        self._bind()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # ---- event-loop helpers -----------------------------------------------------------------------------
    async def _prepare(self, params: SamplingParams | None) -> None:
        """Compile a request's constraint in a worker thread (a ValueError names what is wrong), so the engine
        thread only copies the cached matcher and no step waits on a compile."""
        if params is not None and params.structured_outputs is not None:
            await asyncio.to_thread(self._engine.grammars.prepare, params.structured_outputs)

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            with self._sync_lock:  # NOTE: an embed_sync still running on the sync engine finishes first
                self._start(loop)
        elif loop is not self._loop:
            raise RuntimeError("AsyncEngine is bound to another event loop")

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is None:
            self._loop = loop
            self._stopped = loop.create_future()
            self._thread = threading.Thread(target=self._run, name="orthrus-async-engine", daemon=True)
            # NOTE: and the binding thread's, built since (embed_sync ran here), for the same reason
            release_openmp_pool()
            self._thread.start()

    def _submit(self, kind: RequestKind, request_id: str | None, input: Any, params: Any, stream: bool,
                continued: bool = False) -> Sink:
        if self._closed or (self._stopped is not None and self._stopped.done()):  # shut down, or the thread died
            raise EngineShutdown("AsyncEngine is shut down")
        self._bind()
        bulk = is_bulk(params)
        if bulk and self._num_bulk_in_flight >= self.max_bulk_in_flight:
            raise EngineQueueFull(f"{self._num_bulk_in_flight} bulk requests are pending; the limit is "
                                  f"{self.max_bulk_in_flight}")
        if not bulk and self._num_in_flight >= self.max_in_flight:
            raise EngineQueueFull(f"{self._num_in_flight} requests are pending; the limit is {self.max_in_flight}")
        rid = request_id or f"async-{kind.value}-{next(self._ids)}"
        sink = (Sink(rid, queue=Snapshots(), bulk=bulk) if stream
                else Sink(rid, future=self._loop.create_future(), bulk=bulk))
        if bulk:
            self._num_bulk_in_flight += 1
        else:
            self._num_in_flight += 1
        self._commands.put(("continue" if continued else "add", kind, rid, input, params, stream, sink))
        return sink

    async def _await(self, sink: Sink) -> Any:
        try:
            return await sink.future
        except asyncio.CancelledError:
            if not self._closed:  # the caller gave up: free the engine's work too
                self._commands.put(("abort", sink.request_id, None))
            raise

    def _deliver(self, batch: list[tuple[Sink, Any, bool]]) -> None:
        for sink, item, final in batch:
            sink.put(item)
            if sink.bulk:
                self._num_bulk_in_flight -= int(final)
            else:
                self._num_in_flight -= int(final)

    # ---- engine thread: a thin shell around the one EngineLoop -----------------------------------------------
    def _run(self) -> None:
        cmds: list[tuple] = []
        if self._engine.config.num_threads is not None:
            torch.set_num_threads(self._engine.config.num_threads)  # NOTE: OpenMP's thread count is per thread
        try:
            while True:
                # NOTE: block when idle (no busy spin); otherwise take whatever arrived and step
                cmds = self._drain([] if self._loop_core.has_work else [self._commands.get()])
                if any(cmd[0] == "stop" for cmd in cmds):
                    break
                for cmd in cmds:
                    self._handle(cmd)
                cmds = []
                if self._loop_core.has_work:
                    with contextlib.suppress(StepFailed):  # NOTE: its requests failed with the cause; serve on
                        self._loop_core.run_step()
                self._flush()
        except Exception:  # NOTE: e.g. the event loop closed under us; don't leave callers or blocks behind
            logger.exception("async engine loop failed")
        finally:
            self._close(cmds)

    def _drain(self, cmds: list[tuple]) -> list[tuple]:
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] in ("abort", "release"):
            ok = self._loop_core.abort(cmd[1]) if cmd[0] == "abort" else self._engine.release(cmd[1])
            if cmd[2] is not None:
                self._outbox.append((Sink("", future=cmd[2]), ok, False))
            return
        op, kind, rid, input, params, stream, sink = cmd
        try:
            if op == "continue":
                self._loop_core.continue_(rid, input, params, _Outbox(self, sink), stream=stream)
            else:
                self._loop_core.add(kind, rid, input, params, _Outbox(self, sink), stream=stream)
        except Exception as exc:  # bad input: never reaches a step
            self._outbox.append((sink, exc, True))

    def _flush(self) -> None:
        if self._outbox:
            batch, self._outbox = self._outbox, []
            self._loop.call_soon_threadsafe(self._deliver, batch)

    def _close(self, cmds: list[tuple]) -> None:
        """Fail everything still unfinished or queued, free the engine's blocks and signal the event loop."""
        err = EngineShutdown("AsyncEngine was shut down before the request finished")
        try:
            self._loop_core.fail_all(err)
        except Exception:  # NOTE: still signal the event loop below, or every caller would wait forever
            logger.exception("failing the pending requests at shutdown failed")
        for cmd in self._drain(cmds):
            if cmd[0] in ("add", "continue"):
                self._outbox.append((cmd[-1], err, True))
            elif cmd[0] in ("abort", "release") and cmd[2] is not None:
                self._outbox.append((Sink("", future=cmd[2]), False, False))
        self._outbox.append((Sink("", future=self._stopped), None, False))
        with contextlib.suppress(RuntimeError):  # NOTE: the event loop may be closed under us: nobody to tell
            self._flush()


async def _all(coros: list[Any]) -> list[Any]:
    """Every result in order; if one fails (or the caller is cancelled), the rest are cancelled, which aborts their
    engine requests: no orphaned work."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
