"""`ClientEmbedder`: an `Embedder` over a `ClientBridge`, i.e. over a deployment (`dedicated`) or a peer."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from orthrus_rag.engine.clients import ClientBridge
from orthrus_rag.params import PoolingParams
from orthrus_rag.retrievers.embedder import (EmbedderMethods, _concat, _stack, batches, pooling_identity,
                                             refuse_inside_event_loop)


class ClientEmbedder(EmbedderMethods):
    """Embeds documents and queries through `bridge` with their own `PoolingParams`.

    The serving system is opaque here, so the caller says what it serves: `kind` (e.g. "engine" when the workers
    run this project's engine, whose vectors equal the in-process engine's; a peer's name otherwise), the models
    and the adapter. The dimension is asked of the system once.
    """

    def __init__(self, bridge: ClientBridge, model: str, embedding_model: str | None = None, kind: str = "engine",
                 adapters: list[str] | None = None, adapter: str | None = None,
                 document_params: PoolingParams | None = None, query_params: PoolingParams | None = None,
                 batch_size: int = 256, dimension: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.bridge = bridge
        self.batch_size = batch_size
        self.document_params = document_params or PoolingParams()
        self.query_params = query_params or replace(self.document_params)
        for params in (self.document_params, self.query_params):
            if params.pooling == "all" and params.head is None:
                raise ValueError("pooling='all' without a head gives one vector per token; pass a head")
            if params.adapter != self.document_params.adapter:
                raise ValueError("documents and queries must embed with the same adapter")
        if dimension is None:
            dimension = int(self._embed_sync(["dimension probe"], self.document_params).shape[1])
        self.identity: dict[str, Any] = pooling_identity(
            kind, model, embedding_model, list(adapters or []), adapter or self.document_params.adapter,
            self.document_params, self.query_params, dimension)

    def _embed_sync(self, texts: list[str], params: PoolingParams) -> np.ndarray:
        refuse_inside_event_loop()
        return _concat([_stack(self.bridge.embed_sync(list(chunk), params))
                        for chunk in batches(texts, self.batch_size, "embedding")])

    async def _aembed(self, texts: list[str], params: PoolingParams) -> np.ndarray:
        return _concat([_stack(await self.bridge.embed_many(list(chunk), params))
                        for chunk in batches(texts, self.batch_size, "embedding")])
