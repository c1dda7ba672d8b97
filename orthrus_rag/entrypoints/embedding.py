"""How the configured retriever embeds (`retriever.*` over a client's embedding space): the documents' and the
queries' pooling, and the `EngineEmbedder` that `run`, `index` and `serve` search and ingest through."""

from __future__ import annotations

from typing import Any


def on_encoder(cfg: Any) -> bool:
    """Whether the retriever embeds on the separate encoder (one is loaded and no backbone adapter is asked for)."""
    return cfg.model.embedding_model is not None and cfg.retriever.adapter is None


def pooling_of(cfg: Any, client: Any) -> tuple[Any, Any]:
    """Document and query pooling: the encoder's own pooling, or the configured one on the backbone."""
    from orthrus_rag.params import PoolingParams

    adapter = cfg.retriever.adapter
    if on_encoder(cfg):
        base = dict(client.embedding_space.encoder_pooling)
    else:
        base = {"pooling": cfg.retriever.pooling, "normalize": True}
    # NOTE: corpora hold passages longer than an encoder's window; cut them as sentence-transformers does.
    # A query is what the next hop of a chain waits on: latency-critical (priority < 0) for the orthrus policy
    # An adapter whose card names query / document prefixes gets them by input type (EmbeddingSpace.formatted);
    # retriever.query_instruction, when set, replaces the query's
    return (PoolingParams(**base, truncate=True, adapter=adapter, input_type="document"),
            PoolingParams(**base, instruction=cfg.retriever.query_instruction, truncate=True, priority=-1,
                          adapter=adapter, input_type="query"))


def build_embedder(cfg: Any, client: Any, batch_size: int = 256):  # -> EngineEmbedder
    from orthrus_rag.retrievers import EngineEmbedder

    doc, query = pooling_of(cfg, client)
    return EngineEmbedder(client, doc, query, batch_size=batch_size)
