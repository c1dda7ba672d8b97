"""`DeploymentClient`: an `EngineClient` over a system driven one request at a time (`submit` / `poll` /
`shutdown`: a two-process deployment, engine/deploy/, or a benchmark peer, scripts/bench/peer_client.py).

Such a system is made for one caller that submits and polls in a loop; callers of the seam instead await single
results from many coroutines. The bridge owns the system on one pump thread:
requests queued from any thread or event loop reach the client there, between polls, and each finished output
resolves its request's `concurrent.futures.Future` (which coroutines await through `asyncio.wrap_future`). So
the in-process engine, the two-process deployments (`dedicated`, `disagg-pd`) and the benchmark peers serve the
same pipeline code.

Failures stay with the request that caused them: an output that reports an error, or a request the client
rejects, fails only its own future (`RequestFailed`). A client that fails as a whole, or one that returns
nothing for `stall_timeout_s` while requests wait, fails every waiting request (`ClientFailed`); the bridge then
refuses new ones.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from orthrus_rag.embedding_formats import adapter_prefixes
from orthrus_rag.engine.clients.protocol import ClientFailed, PairScoring, RequestFailed, refuse_inside_event_loop
from orthrus_rag.engine.deploy.spec import WorkerError
from orthrus_rag.outputs import EmbeddingOutput, EngineOutput, GenerationOutput, ScoreOutput
from orthrus_rag.params import EmbeddingSpace, PoolingParams, RerankParams, SamplingParams

logger = logging.getLogger(__name__)


class DeploymentClient(PairScoring):
    """Generate / embed through a system's `client.submit` / `poll` / `shutdown`, which it then owns.

    `tokenizer` and `embedding_space` say what the system serves (it is opaque from here): the generation model's
    tokenizer, and whose embeddings these are (an index built through the in-process engine serves here too when
    the workers run this project's engine, `embedding_space.kind == "engine"`).

    `poll_s`: the longest a poll waits for the first finished output while requests are in flight, i.e. how late
    a new request can reach the client. `max_in_flight` bounds the requests handed to the client at once (more
    wait in the bridge's queue), so a big batch of embeddings cannot flood a deployment's inbox.
    """

    def __init__(self, client: Any, poll_s: float = 0.02, stall_timeout_s: float = 600.0,
                 max_in_flight: int = 4096, name: str = "deployment", tokenizer: Any = None,
                 embedding_space: EmbeddingSpace | None = None, reranker_names: Sequence[str] = ()) -> None:
        if poll_s <= 0 or stall_timeout_s <= 0 or max_in_flight < 1:
            raise ValueError("poll_s and stall_timeout_s must be positive and max_in_flight at least 1")
        self.client, self.name, self.tokenizer = client, name, tokenizer
        self.reranker_names = list(reranker_names)  # what the workers' engines load (`model.rerankers`)
        self._space = embedding_space or EmbeddingSpace("unknown")
        self.poll_s, self.stall_timeout_s, self.max_in_flight = poll_s, stall_timeout_s, max_in_flight
        self._inbox: queue.Queue[tuple[str, str, Any, Any, Future]] = queue.Queue()
        self._in_flight: dict[str, Future] = {}
        self._queued: dict[str, Future] = {}  # submitted, not yet handed to the client (abort cancels these)
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # NOTE: orders a submit's checks + put against the pump's final drain
        self._error: ClientFailed | None = None
        self._closed = False
        self._drained = False
        self._thread = threading.Thread(target=self._pump, name=f"{name}-pump", daemon=True)
        self._thread.start()

    @property
    def embedding_space(self) -> EmbeddingSpace:
        return self._space

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight) + self._inbox.qsize()

    def observe_steps(self, observer: Callable[[Any], None]) -> None:
        return None  # NOTE: the steps run in other processes

    # ---- submitting (any thread) ---------------------------------------------------------------------------
    def submit(self, kind: str, input: str | Sequence[int],
               params: SamplingParams | PoolingParams | None = None, request_id: str | None = None) -> Future:
        """Queue one request; its future resolves to the finished output or fails with `RequestFailed`."""
        if kind not in ("generate", "embed", "score"):
            raise ValueError(f"unknown request kind {kind!r}; expected 'embed', 'generate' or 'score'")
        future: Future = Future()
        with self._lock:
            if self._error is not None:
                raise ClientFailed(str(self._error)) from self._error.__cause__
            if self._closed or self._drained:
                raise RuntimeError("the DeploymentClient is shut down")
            rid = request_id or f"{kind[:3]}-{next(self._ids)}"
            self._queued[rid] = future
            self._inbox.put((kind, rid, input, params, future))
        return future

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> GenerationOutput:
        return await asyncio.wrap_future(self.submit("generate", prompt, params, request_id))

    async def generate_stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                              request_id: str | None = None) -> AsyncIterator[GenerationOutput]:
        """The finished output as the one snapshot: the system reports only finished requests."""
        yield await self.generate(prompt, params, request_id)

    async def embed(self, text: str | Sequence[int], params: PoolingParams | None = None,
                    request_id: str | None = None) -> EmbeddingOutput:
        return await asyncio.wrap_future(self.submit("embed", text, params, request_id))

    async def abort(self, request_id: str) -> bool:
        """Cancel a request still queued here (it never reaches the system); False once it was handed over, since a
        submit/poll system cannot stop a request (the caller may still stop awaiting it)."""
        future = self._queued.get(request_id)
        return future is not None and future.cancel()

    async def embed_many(self, texts: Sequence[str | Sequence[int]],
                         params: PoolingParams | None = None) -> list[EmbeddingOutput]:
        """Submitted together, so they share the serving system's steps; outputs in input order."""
        futures = [asyncio.wrap_future(self.submit("embed", t, params)) for t in texts]
        return list(await asyncio.gather(*futures))

    async def score_pairs(self, pairs: Sequence[tuple[str, str]],
                          params: RerankParams | None = None) -> list[ScoreOutput]:
        """(query, document) pairs submitted together, scored where the system routes scoring; a failed pair fails
        the call (`RequestFailed`)."""
        self._require_reranker()
        futures = [asyncio.wrap_future(self.submit("score", tuple(pair), params)) for pair in pairs]
        outs = await asyncio.gather(*futures)
        return [ScoreOutput(o.request_id, float(o.embedding[0]), len(o.prompt_token_ids), o.metrics) for o in outs]

    def embed_sync(self, texts: Sequence[str | Sequence[int]], params: PoolingParams | None = None,
                   timeout_s: float | None = None) -> list[EmbeddingOutput]:
        """Blocking `embed_many` (not from inside an event loop that other requests need)."""
        refuse_inside_event_loop()
        futures = [self.submit("embed", t, params) for t in texts]
        return [f.result(timeout_s) for f in futures]

    def generate_sync(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                      timeout_s: float | None = None) -> GenerationOutput:
        return self.submit("generate", prompt, params).result(timeout_s)

    # ---- the pump thread: the only one that touches the client -------------------------------------------
    def _pump(self) -> None:
        last_output = time.monotonic()
        try:
            while not self._stop.is_set():
                self._take_requests(block=not self._in_flight)
                if not self._in_flight:
                    last_output = time.monotonic()
                    continue
                try:
                    outputs = self.client.poll(self.poll_s)
                except WorkerError as exc:
                    if not exc.request_ids:
                        raise
                    self._fail(exc.request_ids, RequestFailed(str(exc)))  # one rejected request; the rest go on
                    continue
                if outputs:
                    last_output = time.monotonic()
                for out in outputs:
                    self._resolve(out)
                if time.monotonic() - last_output > self.stall_timeout_s:
                    raise TimeoutError(f"no output for {self.stall_timeout_s:g} s with "
                                       f"{len(self._in_flight)} requests in flight")
        except BaseException as exc:  # noqa: BLE001 (reported to every waiting caller)
            failure = ClientFailed(f"the serving client failed: {type(exc).__name__}: {exc}")
            failure.__cause__ = exc
            self._error = failure  # NOTE: first: nothing below (a broken log handler, say) may lose the cause
            logger.error("serving client failed: %s", exc)
        finally:
            reason = self._error or RuntimeError("the DeploymentClient was shut down")
            with self._lock:  # no submit can queue behind this drain
                self._drained = True
            self._fail(list(self._in_flight), reason)
            while True:
                try:
                    *_, future = self._inbox.get_nowait()
                except queue.Empty:
                    break
                _set_exception(future, reason)

    def _take_requests(self, block: bool) -> None:
        """Hand queued requests to the client (waiting briefly for one when nothing is in flight)."""
        while len(self._in_flight) < self.max_in_flight:
            try:
                kind, rid, input, params, future = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            self._queued.pop(rid, None)
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                self.client.submit(kind, rid, input, params)
            except (ValueError, TypeError) as exc:  # bad input, refused before it reached the system
                future.set_exception(RequestFailed(f"{type(exc).__name__}: {exc}"))
                continue
            except BaseException:
                self._in_flight[rid] = future  # NOTE: the client failed; the pump fails this one with the rest
                raise
            self._in_flight[rid] = future

    def _resolve(self, out: EngineOutput) -> None:
        future = self._in_flight.pop(out.request_id, None)
        if future is None:
            logger.warning("an output for unknown request %s was dropped", out.request_id)
            return
        error = _error_of(out)
        if error is not None:
            future.set_exception(RequestFailed(f"request {out.request_id} failed: {error}"))
        else:
            future.set_result(out)

    def _fail(self, request_ids: Sequence[str], exc: BaseException) -> None:
        for rid in request_ids:
            future = self._in_flight.pop(rid, None)
            if future is not None:
                _set_exception(future, exc)

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 30.0, close_client: bool = True) -> None:
        """Fail what is still waiting, stop the pump and shut the client down (unless `close_client` is False:
        its owner keeps it, e.g. a shared engine). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # NOTE: still inside the client: shutting it down here would race the pump
            logger.warning("the bridge's pump thread did not stop within %.0f s; the client is left to it",
                           timeout_s)
            return
        if close_client:
            self.client.shutdown()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.shutdown)  # NOTE: joins threads and worker processes: off the event loop

    def __enter__(self) -> "DeploymentClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _error_of(out: EngineOutput) -> str | None:
    if isinstance(out, EmbeddingOutput):  # NOTE: an aborted one has no vector: never a result
        return out.error or {"error": "pooling failed", "abort": "aborted"}.get(out.finish_reason or "")
    if out.finish_reason == "error":
        return out.text or "generation failed"
    if out.finish_reason == "abort":
        return "aborted"
    return None


def _set_exception(future: Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def start_deployment(mode: str, config: Any, threads: tuple[int, ...]) -> DeploymentClient:
    """The `dedicated` or `disagg-pd` workers of an `EngineConfig` (each worker's), as an `EngineClient`."""
    from orthrus_rag.engine.deploy import DEPLOYMENTS

    deployment = DEPLOYMENTS[mode](config, threads)
    mc = config.model
    try:
        tokenizer = load_tokenizer(mc.name)
        encoder_pooling = encoder_pooling_of(mc.embedding_model)
    except BaseException:
        deployment.shutdown()
        raise
    # NOTE: the workers' engines name each adapter after its folder, in load order (slots from 1)
    slots = {Path(a).name: i for i, a in enumerate(mc.embedding_adapters, start=1)}
    prefixes = adapter_prefixes({Path(a).name: a for a in mc.embedding_adapters})
    space = EmbeddingSpace(mc.name, mc.embedding_model, tuple(mc.embedding_adapters), slots, encoder_pooling,
                           adapter_prefixes=prefixes)
    return DeploymentClient(deployment, name=f"{mode} {threads}", tokenizer=tokenizer, embedding_space=space,
                            reranker_names=mc.rerankers)


def encoder_pooling_of(embedding_model: str | None) -> dict:
    """The sentence-transformers pooling a separate embedding model ships with ({} for none)."""
    if embedding_model is None:
        return {}
    from orthrus_rag.models.bert import read_sentence_transformers_pooling
    from orthrus_rag.models.registry import resolve_model_path

    return read_sentence_transformers_pooling(resolve_model_path(embedding_model))


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    from orthrus_rag.models.registry import resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path(model)))
