"""`OrthrusEmbeddings`: LangChain `Embeddings` served by the co-scheduled engine (in-process or by base URL)."""

from __future__ import annotations

from langchain_core.embeddings import Embeddings

from orthrus_rag.integrations.langchain._base import OrthrusConnection
from orthrus_rag.retrievers.embedder import BULK_PRIORITY


class OrthrusEmbeddings(OrthrusConnection, Embeddings):
    """Embeddings of documents and queries through the engine's /v1/embeddings semantics. Documents go as
    `input_type="document"`, queries as `"query"`, so an embedding adapter with prefixes gets the right one.

    ```python
    emb = OrthrusEmbeddings(engine=engine)                      # in-process
    emb = OrthrusEmbeddings(base_url="http://127.0.0.1:8000/v1", model="all-minilm-l6-v2")
    emb.embed_query("who wrote Pride and Prejudice?")
    emb.embed_documents_bulk(texts)   # an ingest: runs only on what queries and generations leave of each step
    ```
    """

    model: str | None = None
    """The embedding model's served name; None: the server's (first) embedding model."""
    batch_size: int = 256
    """Texts per request."""

    def _model(self) -> str:
        return self.model or self.transport.embedding_models[0]

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self._documents(texts, 0)

    def embed_documents_bulk(self, texts: list[str]) -> list[list[float]]:
        """`embed_documents` as bulk work (priority `BULK_PRIORITY`): every scheduling policy puts it below queries
        and generations (within `scheduler.bulk_step_tokens` / `bulk_min_tokens`). What
        `OrthrusRetriever.add_documents` embeds with."""
        return self._documents(texts, BULK_PRIORITY)

    def _documents(self, texts: list[str], priority: int) -> list[list[float]]:
        texts = list(texts)
        out: list[list[float]] = []
        for start in range(0, len(texts), self.batch_size):
            out.extend(self.transport.embed(texts[start:start + self.batch_size], self._model(), "document",
                                            priority))
        return out

    def embed_query(self, text: str) -> list[float]:
        return self.transport.embed([text], self._model(), "query")[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        return await self._adocuments(texts, 0)

    async def aembed_documents_bulk(self, texts: list[str]) -> list[list[float]]:
        """`embed_documents_bulk` on the caller's event loop."""
        return await self._adocuments(texts, BULK_PRIORITY)

    async def _adocuments(self, texts: list[str], priority: int) -> list[list[float]]:
        texts = list(texts)
        out: list[list[float]] = []
        for start in range(0, len(texts), self.batch_size):
            out.extend(await self.transport.aembed(texts[start:start + self.batch_size], self._model(), "document",
                                                   priority))
        return out

    async def aembed_query(self, text: str) -> list[float]:
        return (await self.transport.aembed([text], self._model(), "query"))[0]
