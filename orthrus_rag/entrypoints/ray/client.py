"""`RayServeClient`: the `EngineClient` over a deployment handle of `EngineReplica`s. The ingress serves it with the
same FastAPI app as `orthrus-rag serve`; a run drives Iter-RetGen through it (no HTTP hop). Ray's request router
picks the replica of each call; cancelling a call (a client that went away) cancels it in the replica, whose
AsyncEngine aborts the engine request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from orthrus_rag.engine.clients.protocol import EngineUnavailable, InFlight, PairScoring, refuse_inside_event_loop
from orthrus_rag.outputs import EmbeddingOutput, GenerationOutput, ScoreOutput
from orthrus_rag.params import EmbeddingSpace, PoolingParams, RerankParams, SamplingParams

RETRIES = 2  # a call whose replica died is sent again this many times (the router picks a live one): deploy.retries


def _replica_failures() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorUnavailableError, RayActorError

    return RayActorError, ActorUnavailableError


class RayServeClient(PairScoring):
    def __init__(self, handle: Any, tokenizer: Any, embedding_space: EmbeddingSpace, max_in_flight: int,
                 name: str = "ray-serve", on_close: Callable[[], None] | None = None,
                 expected_replicas: int | None = None, retries: int = RETRIES,
                 reranker_names: Sequence[str] = ()) -> None:
        self.handle = handle
        self.reranker_names = list(reranker_names)  # what the replicas' engines load (`model.rerankers`)
        self.retries = retries
        self.expected_replicas = expected_replicas
        self._on_close = on_close
        self.tokenizer = tokenizer
        self.embedding_space = embedding_space
        self.max_in_flight = max_in_flight
        self.name = name
        self._counted = InFlight()

    @property
    def num_in_flight(self) -> int:
        return self._counted.count


    async def _call(self, method: str, *args: Any) -> Any:
        """`method` on some replica; sent again when its replica dies (nothing of it reached the caller yet), and
        `EngineUnavailable` (HTTP 503, retryable) once the retries are spent."""
        failures = _replica_failures()
        for attempt in range(self.retries + 1):
            try:
                return await getattr(self.handle, method).remote(*args)
            except failures as exc:
                if attempt == self.retries:
                    raise EngineUnavailable(f"the replica serving this request failed ({type(exc).__name__}); "
                                            "retry") from exc
        raise AssertionError("unreachable")

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> GenerationOutput:
        with self._counted(1):
            return await self._call("generate", prompt, params)

    async def generate_stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                              request_id: str | None = None) -> AsyncIterator[GenerationOutput]:
        """Snapshots from one replica; a replica that dies before the first is replaced (the request is sent
        again), after it the stream ends with `EngineUnavailable` (its text so far was already sent)."""
        failures = _replica_failures()
        with self._counted(1):
            for attempt in range(self.retries + 1):
                stream = self.handle.options(stream=True).generate_stream.remote(prompt, params)
                done = started = False
                try:
                    async for snapshot in stream:
                        started, done = True, snapshot.finished
                        yield snapshot
                    return
                except failures as exc:
                    if started or attempt == self.retries:
                        raise EngineUnavailable(f"the replica serving this stream failed ({type(exc).__name__})"
                                                "; retry") from exc
                finally:
                    if not done:
                        stream.cancel()  # NOTE: the replica's generator is cancelled, its engine request aborted

    async def embed(self, text: str | Sequence[int], params: PoolingParams | None = None,
                    request_id: str | None = None) -> EmbeddingOutput:
        with self._counted(1):
            return await self._call("embed", text, params)

    async def embed_many(self, texts: Sequence[str | Sequence[int]],
                         params: PoolingParams | None = None) -> list[EmbeddingOutput]:
        with self._counted(len(texts)):
            return await self._call("embed_many", list(texts), params)

    async def score_pairs(self, pairs: Sequence[tuple[str, str]],
                          params: RerankParams | None = None) -> list[ScoreOutput]:
        """(query, document) pairs scored in one replica's shared steps, in order."""
        self._require_reranker()
        with self._counted(len(pairs)):
            return await self._call("score_pairs", [tuple(p) for p in pairs], params)

    def embed_sync(self, texts: Sequence[str | Sequence[int]],
                   params: PoolingParams | None = None) -> list[EmbeddingOutput]:
        refuse_inside_event_loop()
        return self.handle.embed_many.remote(list(texts), params).result()

    async def abort(self, request_id: str) -> bool:
        return False  # NOTE: requests are cancelled through their calls (cancelling the awaiting task)

    def observe_steps(self, observer: Callable[[Any], None]) -> None:
        return None  # NOTE: the steps run in the replicas' processes

    # ---- what the server's /health and /metrics add (api.py) --------------------------------------------------------
    async def _reports(self) -> dict[str, str]:
        from orthrus_rag.entrypoints.ray.board import board

        try:
            return await board().fresh.remote()
        except Exception:  # noqa: BLE001 (no board yet: no replica has published)
            return {}

    async def health(self) -> dict[str, Any]:
        """Replicas publishing now against the configured count."""
        up = len(await self._reports())
        return {"replicas_up": up, "replicas_expected": self.expected_replicas,
                "degraded": self.expected_replicas is not None and up < self.expected_replicas}

    async def metrics_text(self, own: str) -> str:
        from orthrus_rag.entrypoints.ray.board import merge_exposition

        return merge_exposition(own, await self._reports())

    async def aclose(self) -> None:
        close, self._on_close = self._on_close, None
        if close is not None:
            await asyncio.to_thread(close)
