"""`OrthrusReranker`: a LangChain document compressor that reranks with a reranker the engine serves (in-process or
by base URL), in the same steps as the engine's embeddings and generations."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.documents import BaseDocumentCompressor, Document

from orthrus_rag.integrations.langchain._base import OrthrusConnection


class OrthrusReranker(OrthrusConnection, BaseDocumentCompressor):
    """The best `top_n` documents for a query, best first, each with its `relevance_score` in its metadata (as
    LangChain's Cohere and Jina rerankers give it).

    ```python
    reranker = OrthrusReranker(engine=engine, top_n=3)          # in-process: the engine's default reranker
    reranker = OrthrusReranker(base_url="http://127.0.0.1:8000/v1", model="backbone")
    retriever = ContextualCompressionRetriever(base_compressor=reranker, base_retriever=OrthrusRetriever(...))
    ```
    """

    model: str | None = None
    """A served reranker's name (`model.rerankers`); None: the server's default (the first)."""
    top_n: int | None = 3
    """Documents kept; None: all of them, reordered."""

    def compress_documents(self, documents: Sequence[Document], query: str,
                           callbacks: Any = None) -> Sequence[Document]:
        if not documents:
            return []
        return _kept(documents, self.transport.rerank(query, [d.page_content for d in documents], self.model,
                                                      self.top_n))

    async def acompress_documents(self, documents: Sequence[Document], query: str,
                                  callbacks: Any = None) -> Sequence[Document]:
        if not documents:
            return []
        return _kept(documents, await self.transport.arerank(query, [d.page_content for d in documents], self.model,
                                                             self.top_n))


def _kept(documents: Sequence[Document], results: list[dict[str, Any]]) -> list[Document]:
    """The documents the results name, in their order, each a copy with its score in its metadata."""
    out = []
    for r in results:
        doc = documents[r["index"]]
        out.append(Document(page_content=doc.page_content, id=doc.id,
                            metadata={**doc.metadata, "relevance_score": r["relevance_score"]}))
    return out
