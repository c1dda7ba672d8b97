"""The embedding seam of retrieval: an `Embedder` protocol and `EngineEmbedder`, which embeds through any
`EngineClient`."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

import numpy as np
from tqdm.auto import tqdm

from orthrus_rag.engine.async_engine import AsyncEngine
from orthrus_rag.engine.clients.protocol import EngineClient, RequestFailed
from orthrus_rag.engine.engine import Engine
from orthrus_rag.params import PoolingParams

logger = logging.getLogger(__name__)
# what documents ingested while serving embed at: bulk work (PoolingParams.priority > 0), which every scheduling
# policy runs only on the budget that queries and generations leave
BULK_PRIORITY = 1


@runtime_checkable
class Embedder(Protocol):
    """Turns documents and queries into vectors of one space.

    `identity` says what built the vectors (model, adapter, pooling, normalize, dimension, query instruction);
    an index saved with one identity is only searched with an embedder of the same identity.

    A live index's adds (`LiveIndex.add` / `aadd`) embed through `embed_documents_bulk` / `aembed_documents_bulk`
    where an embedder has them (bulk work, `BULK_PRIORITY`: LangChain's `OrthrusEmbeddings`), else through
    `embed_documents`; `EngineEmbedder` has its own per-text bulk path (`embed_bulk`), which names bad texts.
    """

    identity: dict[str, Any]

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        """float32 [n, d]."""
        ...

    def embed_query(self, text: str) -> np.ndarray:
        """float32 [d]."""
        ...

    async def aembed_documents(self, texts: list[str]) -> np.ndarray: ...

    async def aembed_query(self, text: str) -> np.ndarray: ...


def batches(items: Sequence[Any], batch_size: int, desc: str) -> Iterator[Sequence[Any]]:
    """Yield `items` in slices of `batch_size` under a tqdm bar (off when not a tty or when one batch does)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    quiet = len(items) <= batch_size or not sys.stderr.isatty()
    with tqdm(total=len(items), desc=desc, unit="text", disable=quiet) as bar:
        for start in range(0, len(items), batch_size):
            chunk = items[start:start + batch_size]
            yield chunk
            bar.update(len(chunk))


class EmbedderMethods:
    """The public `Embedder` methods, over `_embed_sync(texts, params)` / `_aembed(texts, params)` and the
    `document_params` / `query_params` of a concrete embedder."""

    document_params: PoolingParams
    query_params: PoolingParams

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        return self._embed_sync(list(texts), self.document_params)

    def embed_query(self, text: str) -> np.ndarray:
        return self._embed_sync([text], self.query_params)[0]

    def embed_queries(self, texts: list[str]) -> np.ndarray:
        """Many queries submitted together, so they share engine steps."""
        return self._embed_sync(list(texts), self.query_params)

    async def aembed_documents(self, texts: list[str]) -> np.ndarray:
        return await self._aembed(list(texts), self.document_params)

    async def aembed_query(self, text: str) -> np.ndarray:
        return (await self._aembed([text], self.query_params))[0]

    async def aembed_queries(self, texts: list[str]) -> np.ndarray:
        return await self._aembed(list(texts), self.query_params)

    def _embed_sync(self, texts: list[str], params: PoolingParams) -> np.ndarray:
        raise NotImplementedError

    async def _aembed(self, texts: list[str], params: PoolingParams) -> np.ndarray:
        raise NotImplementedError


class EngineEmbedder(EmbedderMethods):
    """The one `Embedder` over an `EngineClient` (engine/clients/protocol.py): the in-process `AsyncEngine`, a
    deployment's `DeploymentClient`, a peer or a `RemoteClient`. A bare `Engine` is taken as its `AsyncEngine`.

    Documents and queries pool with their own `PoolingParams` (e.g. queries with an instruction prefix); both
    must route to the same model and adapter. Defaults: the client's default pooling (the encoder's own when it
    has a separate embedding model, else mean pooling with L2 normalisation on the decoder), as documents and
    queries (`input_type`: an embedding adapter's card may prefix each). The vectors'
    dimension is asked of the client once (a pooling head may change it)."""

    def __init__(self, client: EngineClient | Engine, document_params: PoolingParams | None = None,
                 query_params: PoolingParams | None = None, batch_size: int = 256,
                 dimension: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.client: EngineClient = AsyncEngine(client) if isinstance(client, Engine) else client
        # NOTE: embed_many submits a whole batch; stay under the client's in-flight limit
        self.batch_size = min(batch_size, self.client.max_in_flight)
        space = self.client.embedding_space
        # NOTE: an adapter's query / document prefixes filled in here, so the index's identity records them
        doc = document_params or replace(space.default_pooling(), input_type="document")
        query = query_params or replace(doc, input_type="query" if doc.input_type else None)
        self.document_params, self.query_params = space.formatted(doc), space.formatted(query)
        for params in (self.document_params, self.query_params):
            if params.pooling == "all" and params.head is None:
                raise ValueError("pooling='all' without a head gives one vector per token; pass a head")
        route = space.route(self.document_params)
        if route != space.route(self.query_params):
            raise ValueError(f"documents embed on {route.name} but queries on "
                             f"{space.route(self.query_params).name}; both must use the same model and adapter")
        if dimension is None and self.document_params.head is None:  # NOTE: a head may change the width
            dimension = space.dimension(route)
        if dimension is None:
            dimension = int(self._embed_sync(["dimension probe"], self.document_params).shape[1])
        self.identity: dict[str, Any] = pooling_identity(
            space.kind, space.model, space.embedding_model if route.on_encoder else None, list(space.adapters),
            route.adapter, self.document_params, self.query_params, dimension)

    def _embed_sync(self, texts: list[str], params: PoolingParams) -> np.ndarray:
        return _concat([_stack(self.client.embed_sync(list(chunk), params))
                        for chunk in batches(texts, self.batch_size, "embedding")])

    def bulk_params(self, truncate: bool) -> PoolingParams:
        return replace(self.document_params, priority=BULK_PRIORITY, truncate=truncate)

    async def aembed_bulk(self, texts: Sequence[str], truncate: bool = False) -> list[np.ndarray | Exception]:
        """Documents as bulk work (`BULK_PRIORITY`), each its own request, at most `batch_size` in flight; a text
        the engine refuses (longer than the model takes, unless `truncate`) gets its error in its place, so a
        caller can name every bad one and keep none of the batch."""
        params = self.bulk_params(truncate)
        results: list[np.ndarray | Exception] = []
        for start in range(0, len(texts), self.batch_size):
            window = [self.client.embed(t, params) for t in texts[start:start + self.batch_size]]
            for out in await asyncio.gather(*window, return_exceptions=True):
                if isinstance(out, asyncio.CancelledError):
                    raise out
                results.append(out if isinstance(out, Exception) else _stack([out])[0])
        return results

    def embed_bulk(self, texts: Sequence[str], truncate: bool = False) -> list[np.ndarray | Exception]:
        """`aembed_bulk` from outside any event loop. A batch the engine refuses is asked again one text at a
        time, to find the texts at fault (only on that path)."""
        params = self.bulk_params(truncate)
        try:
            return list(self._embed_sync(list(texts), params))
        except (ValueError, RequestFailed):
            pass
        results: list[np.ndarray | Exception] = []
        for text in texts:
            try:
                results.append(self._embed_sync([text], params)[0])
            except (ValueError, RequestFailed) as exc:
                results.append(exc)
        return results

    async def _aembed(self, texts: list[str], params: PoolingParams) -> np.ndarray:
        return _concat([_stack(await self.client.embed_many(list(chunk), params))
                        for chunk in batches(texts, self.batch_size, "embedding")])


def pooling_identity(kind: str, model: str, embedding_model: str | None, adapters: list[str], adapter: str | None,
                     doc: PoolingParams, query: PoolingParams, dimension: int | None) -> dict[str, Any]:
    """What made an index's vectors: `kind` is who served them ("engine" for this project's engine in any
    deployment, or a peer's name), then the models and pooling of documents and queries."""
    identity = {
        "kind": kind,
        "model": model,
        "embedding_model": embedding_model,
        "adapters": list(adapters),
        "adapter": adapter,
        "pooling": doc.pooling,
        "normalize": doc.normalize,
        "document_instruction": doc.instruction,
        "query_pooling": query.pooling,
        "query_normalize": query.normalize,
        "query_instruction": query.instruction,
        "append_eos": doc.wants_eos,
        "head": _name(doc.head),
        "dimension": dimension,
    }
    if doc.end_token is not None:  # NOTE: only when set, so indexes saved before the field existed still match
        identity["end_token"] = doc.end_token
    return identity


def _stack(outputs: Sequence[Any]) -> np.ndarray:
    vectors = [o.embedding.detach().float().cpu().numpy() for o in outputs]
    if any(v.ndim != 1 for v in vectors):
        raise ValueError("the engine returned per-token embeddings; use a pooling that gives one vector")
    return np.stack(vectors).astype(np.float32, copy=False)


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return np.zeros((0, 0), dtype=np.float32)
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)


def _name(fn: Any) -> str | None:
    if fn is None:
        return None
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
