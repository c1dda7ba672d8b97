"""The server's index: `POST /v1/search`, `POST /retrieve` (the retrieval-server shape that reasoning-search
training frameworks call, Search-R1's: many rollouts' queries in one request), and live ingestion: `POST
/v1/documents`, `GET` / `DELETE /v1/documents/{id}`, `DELETE /v1/documents` (ids in the body).

The routes exist on every server; without an index (`orthrus-rag serve` started without `retriever.index_dir`)
they answer 404 saying how to give it one. Added documents embed as bulk work in the engine's own steps
(retrievers/live_index.py), so queries and generations keep their latency while an ingest uses the slack; an
add is searchable and on disk when its 200 is sent. Ingests run one at a time (FIFO), so concurrent ones queue
rather than fail. A batch with any bad document (empty, too long, an id present already or repeated) is refused
whole with a 400 / 409 naming each one; a delete naming an unknown id is refused whole with a 404.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from orthrus_rag.data.types import Passage
from orthrus_rag.entrypoints.openai.errors import OpenAIError
from orthrus_rag.entrypoints.openai.schemas import MAX_INPUTS, MAX_TEXT_CHARS
from orthrus_rag.entrypoints.openai.service import OpenAIService
from orthrus_rag.retrievers.live_index import DocumentError, LiveIndex

logger = logging.getLogger(__name__)
MAX_SEARCH_K = 1000
DEFAULT_RETRIEVE_K = 3  # Search-R1's retrieval server's default


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DocumentIn(_Strict):
    id: str = Field(min_length=1, max_length=512)
    text: str = Field(max_length=MAX_TEXT_CHARS)
    title: str = Field(default="", max_length=4096)


class AddDocumentsRequest(_Strict):
    documents: list[DocumentIn] = Field(min_length=1, max_length=MAX_INPUTS)
    # cut a document longer than the embedding model's window instead of refusing it (sentence-transformers' way)
    truncate: bool = False


class DeleteDocumentsRequest(_Strict):
    ids: list[str] = Field(min_length=1, max_length=MAX_INPUTS)


class SearchRequest(_Strict):
    query: str = Field(min_length=1, max_length=MAX_TEXT_CHARS)
    k: int = Field(default=5, ge=1, le=MAX_SEARCH_K)


class RetrieveRequest(_Strict):
    """Search-R1's retrieval-server request: `topk` passages for each query, with their scores if asked."""

    queries: list[str] = Field(min_length=1, max_length=MAX_INPUTS)
    topk: int | None = Field(default=None, ge=1, le=MAX_SEARCH_K)  # None: DEFAULT_RETRIEVE_K
    return_scores: bool = False


def _search_r1_document(passage: Passage) -> dict[str, Any]:
    """A passage as Search-R1's corpus holds one: `contents` is the quoted title, a newline, then the text (what its
    clients split back apart); the fields apart as well."""
    return {"id": passage.id, "contents": f'"{passage.title}"\n{passage.text}', "title": passage.title,
            "text": passage.text}


class Documents:
    """The routes' side of one `LiveIndex` (or of none)."""

    def __init__(self, index: LiveIndex | None, service: OpenAIService) -> None:
        self.index, self.service = index, service
        self._ingest: asyncio.Lock | None = None  # NOTE: made on the server's loop, at its first ingest

    def require(self) -> LiveIndex:
        if self.index is None:
            raise OpenAIError(404, "this server has no index: start it with retriever.index_dir=<folder> (built by "
                              "`orthrus-rag index`, or made empty with serve.create_index=true)",
                              "not_found_error", code="no_index")
        return self.index

    async def add(self, body: AddDocumentsRequest, disconnected: Any) -> dict[str, Any]:
        passages = [Passage(d.id, d.title, d.text) for d in body.documents]
        ids = await self.add_passages(passages, body.truncate, disconnected)
        return {"object": "list", "data": [{"object": "document", "id": i} for i in ids],
                "num_documents": len(self.require())}

    async def add_passages(self, passages: list[Passage], truncate: bool = True, disconnected: Any = None,
                           ) -> list[str]:
        """Embed and add `passages` (bulk work), one ingest at a time; their ids, searchable when this returns."""
        index = self.require()
        if self._ingest is None:
            self._ingest = asyncio.Lock()
        async with self._ingest:
            return await self._guard(index.aadd(passages, truncate=truncate), disconnected)

    async def search_hits(self, query: str, k: int, disconnected: Any = None) -> list[tuple[Passage, float]]:
        """The index's best `k` passages for `query`."""
        return await self._guard(self.require().asearch(query, k), disconnected)

    async def delete(self, ids: list[str]) -> dict[str, Any]:
        index = self.require()
        deleted = await self._guard(asyncio.to_thread(index.delete, ids))
        return {"object": "list", "data": [{"object": "document", "id": i, "deleted": True} for i in deleted],
                "num_documents": len(index)}

    def get(self, doc_id: str) -> dict[str, Any]:
        passage = self.require().get(doc_id)
        if passage is None:
            raise OpenAIError(404, f"no document with id {doc_id!r}", "not_found_error", param="id",
                              code="document_not_found")
        return {"object": "document", "id": passage.id, "title": passage.title, "text": passage.text}

    async def search(self, body: SearchRequest, disconnected: Any) -> dict[str, Any]:
        hits = await self.search_hits(body.query, body.k, disconnected)
        return {"object": "list", "data": [{"object": "search_result", "id": p.id, "title": p.title,
                                            "text": p.text, "score": score} for p, score in hits]}

    async def retrieve(self, body: RetrieveRequest, disconnected: Any) -> dict[str, Any]:
        empty = [i for i, q in enumerate(body.queries) if not q.strip()]
        if empty:
            raise OpenAIError(400, f"queries {empty[:10]} are empty", param="queries", code="empty_query")
        k = body.topk or DEFAULT_RETRIEVE_K
        results = await self._guard(self.require().abatch_search(body.queries, k), disconnected)
        if body.return_scores:
            return {"result": [[{"document": _search_r1_document(p), "score": score} for p, score in hits]
                               for hits in results]}
        return {"result": [[_search_r1_document(p) for p, _ in hits] for hits in results]}

    async def _guard(self, coro: Any, disconnected: Any = None) -> Any:
        try:
            return await self.service.guard(_documents_first(coro), disconnected)
        except _Refused as exc:
            raise OpenAIError(exc.error.status, str(exc.error), param="documents" if exc.error.status != 404
                              else "ids", code={400: "invalid_document", 404: "document_not_found",
                                                409: "duplicate_id"}.get(exc.error.status)) from None


class _Refused(Exception):
    """A DocumentError carried past `OpenAIService.guard` (which maps every ValueError to a plain 400)."""

    def __init__(self, error: DocumentError) -> None:
        self.error = error


async def _documents_first(coro: Any) -> Any:
    try:
        return await coro
    except DocumentError as exc:
        raise _Refused(exc) from None


def add_document_routes(app: FastAPI, documents: Documents, v1: list) -> None:
    @app.post("/v1/search", dependencies=v1)
    async def search(body: SearchRequest, request: Request) -> dict[str, Any]:
        return await documents.search(body, request.is_disconnected)

    @app.post("/retrieve", dependencies=v1)
    async def retrieve(body: RetrieveRequest, request: Request) -> dict[str, Any]:
        return await documents.retrieve(body, request.is_disconnected)

    @app.post("/v1/documents", dependencies=v1)
    async def add(body: AddDocumentsRequest, request: Request) -> dict[str, Any]:
        return await documents.add(body, request.is_disconnected)

    @app.delete("/v1/documents", dependencies=v1)
    async def delete_many(body: DeleteDocumentsRequest) -> dict[str, Any]:
        return await documents.delete(body.ids)

    @app.delete("/v1/documents/{doc_id:path}", dependencies=v1)
    async def delete_one(doc_id: str) -> dict[str, Any]:
        return await documents.delete([doc_id])

    @app.get("/v1/documents/{doc_id:path}", dependencies=v1)
    async def get(doc_id: str) -> dict[str, Any]:
        return documents.get(doc_id)
