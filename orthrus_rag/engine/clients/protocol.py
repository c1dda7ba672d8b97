"""`EngineClient`: the one seam everything above the engine calls through, and the errors it raises.

Pipelines, retrievers (the `Embedder`), the OpenAI server, the LangChain components, `orthrus-rag run` and the
benchmarks' load drivers all take an `EngineClient`. Four implement it: `AsyncEngine` (one engine in this process,
engine/async_engine.py), `DeploymentClient` (the two-process baselines, or a benchmark peer), `RemoteClient` (a
running `orthrus-rag serve`, over HTTP) and `RayServeClient` (engine replicas on Ray Serve, entrypoints/ray/). What
the embeddings of a client are (`EmbeddingSpace`) travels with it, so an index built through one client is searched
only through a client of the same space. Callers catch the errors below, never an implementation's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from orthrus_rag.outputs import EmbeddingOutput, GenerationOutput
from orthrus_rag.params import EmbeddingSpace, PoolingParams, RerankParams, SamplingParams, pairs_of


# ---- what a request through the seam can fail with -------------------------------------------------------------
class EngineQueueFull(RuntimeError):
    """More unfinished requests than the client's `max_in_flight`; retry later (the server answers 429)."""


class RequestAborted(RuntimeError):
    """The request was aborted before it finished."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id!r} was aborted")
        self.request_id = request_id


class EngineShutdown(RuntimeError):
    """The client was shut down before the request finished."""


class EngineUnavailable(RuntimeError):
    """The replica serving the request failed (a scale-out deployment, entrypoints/ray/); retry: another replica
    takes it."""


class RequestFailed(RuntimeError):
    """One request failed in the serving system (bad input, a pooling error); other requests go on."""


class ClientFailed(RuntimeError):
    """The serving system failed as a whole (a dead worker, a stall); every waiting request gets this, its
    `__cause__` is the system's own error. Iter-RetGen stops the run on it (what it recorded stays, and
    `resume=` continues) rather than recording every remaining question as failed."""


@runtime_checkable
class EngineClient(Protocol):
    """Generate and embed through some serving of the engine. Async methods run on the caller's event loop (one
    per client: its first request binds it); `embed_sync` is the blocking form for code outside any loop."""

    name: str  # for logs and run labels, e.g. "engine (orthrus)", "dedicated (1, 1)"
    tokenizer: Any  # the generation model's tokenizer (its chat template renders prompts); None if unknown

    @property
    def embedding_space(self) -> EmbeddingSpace: ...

    @property
    def max_in_flight(self) -> int:
        """Requests admitted at once without refusing any (what a pipeline's concurrency is sized from)."""
        ...

    @property
    def num_in_flight(self) -> int: ...

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> GenerationOutput: ...

    def generate_stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                        request_id: str | None = None) -> AsyncIterator[GenerationOutput]:
        """Growing snapshots, the last with `finished=True`; leaving early aborts the request."""
        ...

    async def embed(self, text: str | Sequence[int], params: PoolingParams | None = None,
                    request_id: str | None = None) -> EmbeddingOutput: ...

    async def embed_many(self, texts: Sequence[str | Sequence[int]],
                         params: PoolingParams | None = None) -> list[EmbeddingOutput]:
        """Submitted together, so they share steps; outputs in input order."""
        ...

    def embed_sync(self, texts: Sequence[str | Sequence[int]],
                   params: PoolingParams | None = None) -> list[EmbeddingOutput]: ...

    async def abort(self, request_id: str) -> bool:
        """Stop a request and free its work; False when it is unknown or finished."""
        ...

    def observe_steps(self, observer: Callable[[Any], None]) -> Callable[[], None] | None:
        """Call `observer` with every engine step's `StepStats`; returns the function that stops it, or None
        where the client cannot see its steps (another process, another machine)."""
        ...

    async def aclose(self) -> None:
        """Release what the client owns (idempotent)."""
        ...


@runtime_checkable
class BulkQuota(Protocol):
    """What a client that keeps bulk requests (priority > 0, params.is_bulk) to a limit of their own has beside
    `EngineClient`'s: only `AsyncEngine` does; every other client counts them under its one `max_in_flight`."""

    @property
    def max_bulk_in_flight(self) -> int: ...

    @property
    def num_bulk_in_flight(self) -> int: ...


@runtime_checkable
class PlanHolder(Protocol):
    """A client whose steps run in this process, so it can say what runs them (engine/executor/plan.py): only
    `AsyncEngine`; a deployment's or a replica's engines each have their own."""

    @property
    def plan(self) -> Any: ...  # an ExecutionPlan


def execution_plan(client: object) -> Any:
    """The client's ExecutionPlan where its steps run in this process, else None."""
    return client.plan if isinstance(client, PlanHolder) else None


class PairScoring:
    """`score` for a client built on `score_pairs` (one rerank call's pairs submitted together), and the check a
    client that forwards pairs makes before it sends any (`reranker_names`: what its engines load)."""

    reranker_names: list[str]

    async def score(self, query: str, documents: Sequence[str], params: RerankParams | None = None) -> list[float]:
        """Each document's relevance to `query`, in the documents' order."""
        return [out.score for out in await self.score_pairs(pairs_of(query, documents), params)]

    def _require_reranker(self) -> None:
        if not self.reranker_names:
            raise ValueError("this deployment loads no reranker; set model.rerankers")


def refuse_inside_event_loop() -> None:
    """A blocking call from inside a running event loop would stall the loop it waits on."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError("a blocking embedding call inside a running event loop would block it; "
                       "await the async API (aembed_documents / aembed_query / embed_many) instead")


class InFlight:
    """A client's count of requests sent and not yet answered (its `num_in_flight`), for clients whose requests
    live elsewhere (a server, replicas): `with in_flight(n): await ...`."""

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def __call__(self, n: int = 1) -> Iterator[None]:
        self.count += n
        try:
            yield
        finally:
            self.count -= n
