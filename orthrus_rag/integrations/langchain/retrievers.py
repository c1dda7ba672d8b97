"""`OrthrusRetriever`: a LangChain retriever over the project's retrievers (dense FAISS, BM25, hybrid), and
`LangChainEmbedder`, which lets that retriever embed through any LangChain `Embeddings` (e.g. `OrthrusEmbeddings` against a server)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field

from orthrus_rag.data.types import Passage
from orthrus_rag.retrievers import DenseRetriever, LiveIndex


class LangChainEmbedder:
    """The retriever's `Embedder` protocol over a LangChain `Embeddings`. `identity` names what built the
    vectors, so an index saved with one is not searched with another."""

    def __init__(self, embeddings: Embeddings, name: str | None = None) -> None:
        self.embeddings = embeddings
        model = getattr(embeddings, "model", None)
        self.identity: dict[str, Any] = {"kind": "langchain", "class": type(embeddings).__name__,
                                         "model": name or model}

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        return _matrix(self.embeddings.embed_documents(list(texts)))

    def embed_query(self, text: str) -> np.ndarray:
        return np.asarray(self.embeddings.embed_query(text), dtype=np.float32)

    async def aembed_documents(self, texts: list[str]) -> np.ndarray:
        return _matrix(await self.embeddings.aembed_documents(list(texts)))

    # documents added to a live index: bulk work where the embeddings can send it (OrthrusEmbeddings), else as any
    def embed_documents_bulk(self, texts: list[str]) -> np.ndarray:
        bulk = getattr(self.embeddings, "embed_documents_bulk", self.embeddings.embed_documents)
        return _matrix(bulk(list(texts)))

    async def aembed_documents_bulk(self, texts: list[str]) -> np.ndarray:
        bulk = getattr(self.embeddings, "aembed_documents_bulk", self.embeddings.aembed_documents)
        return _matrix(await bulk(list(texts)))

    async def aembed_query(self, text: str) -> np.ndarray:
        return np.asarray(await self.embeddings.aembed_query(text), dtype=np.float32)


def _matrix(rows: Sequence[Sequence[float]]) -> np.ndarray:
    return np.asarray(rows, dtype=np.float32).reshape(len(rows), -1)


def _passages(documents: Sequence[Document], ids: Sequence[str] | None) -> list[Passage]:
    documents = list(documents)
    if ids is not None and len(ids) != len(documents):
        raise ValueError(f"{len(ids)} ids for {len(documents)} documents")
    passages = []
    for i, doc in enumerate(documents):
        doc_id = ids[i] if ids is not None else (doc.id or doc.metadata.get("id"))
        if doc_id is None:
            raise ValueError(f"documents[{i}] has no id: give it one (Document(id=...) or ids=[...])")
        passages.append(Passage(str(doc_id), str(doc.metadata.get("title", "")), doc.page_content))
    return passages


def _document(passage: Passage, score: float) -> Document:
    return Document(page_content=passage.text, id=passage.id,
                    metadata={"id": passage.id, "title": passage.title, "score": score})


class OrthrusRetriever(BaseRetriever):
    """Top-`k` passages of a FAISS index as `Document`s (`metadata`: id, title, score).

    ```python
    retriever = OrthrusRetriever.from_texts(texts, OrthrusEmbeddings(engine=engine), k=3)
    chain = {"context": retriever, "question": RunnablePassthrough()} | prompt | ChatOrthrus(engine=engine)
    retriever.add_documents([Document("...", id="doc-7", metadata={"title": "..."})])   # searchable at once
    retriever.delete(["doc-7"])
    ```
    Over a `LiveIndex` (what `from_texts` / `from_passages` build, in memory; `LiveIndex.open(folder, embedder)`
    for a saved index, whose adds and deletes are kept in its folder) it takes documents and deletions as a
    LangChain vector store does (`add_documents`, `delete`, and their async forms).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: Any = Field(exclude=True)
    """A built retriever of any kind (retrievers/kinds.py): a `DenseRetriever` (its embedder embeds the queries),
    a `BM25Retriever` or a `HybridRetriever`, e.g. `open_retriever(folder, kind, embedder)` of a saved index."""
    k: int = Field(default=4, ge=1)
    """Passages per query."""

    @classmethod
    def from_passages(cls, passages: Sequence[Passage], embeddings: Embeddings, k: int = 4,
                      index_type: str = "flat", **retriever_kwargs: Any) -> "OrthrusRetriever":
        dense = DenseRetriever(LangChainEmbedder(embeddings), index_type=index_type, **retriever_kwargs)
        dense.build(list(passages))
        return cls(retriever=LiveIndex.in_memory(dense), k=k)

    @classmethod
    def from_texts(cls, texts: Sequence[str], embeddings: Embeddings, titles: Sequence[str] | None = None,
                   k: int = 4, **kwargs: Any) -> "OrthrusRetriever":
        titles = list(titles) if titles is not None else [""] * len(texts)
        if len(titles) != len(texts):
            raise ValueError(f"{len(titles)} titles for {len(texts)} texts")
        passages = [Passage(str(i), title, text) for i, (title, text) in enumerate(zip(titles, texts))]
        return cls.from_passages(passages, embeddings, k=k, **kwargs)

    def add_documents(self, documents: Sequence[Document], ids: Sequence[str] | None = None,
                      truncate: bool = False) -> list[str]:
        """Embed and add `documents` (id: `ids`, else the document's `id`, else `metadata["id"]`; title:
        `metadata["title"]`); searchable when this returns. A batch with an empty document, a repeated id or one
        present already is refused whole (`DocumentError`, a ValueError naming each)."""
        return self._live().add(_passages(documents, ids), truncate=truncate)

    async def aadd_documents(self, documents: Sequence[Document], ids: Sequence[str] | None = None,
                             truncate: bool = False) -> list[str]:
        return await self._live().aadd(_passages(documents, ids), truncate=truncate)

    def delete(self, ids: Sequence[str]) -> list[str]:
        """Remove the documents of `ids` (refused whole, naming them, when any is not present)."""
        return self._live().delete(list(ids))

    async def adelete(self, ids: Sequence[str]) -> list[str]:
        import asyncio

        return await asyncio.to_thread(self._live().delete, list(ids))

    def _live(self) -> LiveIndex:
        if not isinstance(self.retriever, LiveIndex):
            raise TypeError(f"adding or deleting documents needs a LiveIndex (from_texts / from_passages build one; "
                            f"LiveIndex.open(folder, embedder) opens a saved index); this retriever is a "
                            f"{type(self.retriever).__name__}")
        return self.retriever

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                **kwargs: Any) -> list[Document]:
        return [_document(p, s) for p, s in self.retriever.search(query, kwargs.get("k", self.k))]

    async def _aget_relevant_documents(self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun,
                                       **kwargs: Any) -> list[Document]:
        return [_document(p, s) for p, s in await self.retriever.asearch(query, kwargs.get("k", self.k))]
