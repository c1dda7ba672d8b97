"""A minimal OpenAI files and vector-stores surface over the server's one live index, so the official `openai`
client can upload files, make vector stores, search them and hand them to the Responses API's `file_search`.

- `POST /v1/files` (multipart `file`, `purpose`) keeps an uploaded UTF-8 text file until a vector store takes it;
  `GET /v1/files/{id}` reads its card.
- `POST /v1/vector_stores` (`name`, `file_ids`), `GET /v1/vector_stores[/{id}]`; `POST /v1/vector_stores/{id}/files`
  (`file_id`), `GET /v1/vector_stores/{id}/files[/{file_id}]`; `POST /v1/vector_stores/{id}/search` (`query`,
  `max_num_results`).

A vector store is a named set of files whose passages live in the index: adding a file to a store cuts it into
passages (ids `<file id>#<n>`, title its filename) and adds them to the index as `/v1/documents` adds documents
(bulk work, searchable and durable when the call returns), once however many stores take it. The store
`vs_index` is the whole index: every document, the ones added over `/v1/documents` included (each its own "file":
file_id its document id, filename its title). A search of another store asks the index for more hits and keeps
those of the store's files. The registry (stores, file cards, which passages came from which file) is kept in the
index's folder (`vector_stores.json`); an uploaded file no store has taken yet lives in memory only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from orthrus_rag.atomic import atomic_write
from orthrus_rag.data.corpus import split_text, text_splitter
from orthrus_rag.data.types import Passage
from orthrus_rag.entrypoints.openai.documents import Documents
from orthrus_rag.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger(__name__)
INDEX_STORE = "vs_index"  # the whole index
REGISTRY_FILE = "vector_stores.json"
MAX_NUM_RESULTS = 50  # OpenAI's bound for file_search and vector-store searches
MAX_FILE_BYTES = 8 << 20
MAX_PENDING_BYTES = 64 << 20  # uploads no store has taken yet, in all (they are held in memory until one does)
CHUNK_WORDS, CHUNK_OVERLAP = 160, 32  # passages the default embedders (256-token windows) take whole
Hit = tuple[Passage, float]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateStoreRequest(_Strict):
    name: str = Field(default="", max_length=256)
    file_ids: list[str] = Field(default_factory=list, max_length=500)
    metadata: dict[str, str] | None = None


class AddFileRequest(_Strict):
    file_id: str = Field(min_length=1)
    attributes: dict[str, Any] | None = None
    chunking_strategy: dict[str, Any] | None = None


class StoreSearchRequest(_Strict):
    query: str | list[str]
    max_num_results: int = Field(default=10, ge=1, le=MAX_NUM_RESULTS)
    rewrite_query: bool = False
    filters: dict[str, Any] | None = None
    ranking_options: dict[str, Any] | None = None


def refuse_unsupported(body: BaseModel, names: tuple[str, ...]) -> None:
    """A field the client's types offer but this server does not act on is a 400 naming it, not a silent no-op
    (null, false and `{"type": "auto"}` chunking pass: they ask for nothing)."""
    for name in names:
        value = getattr(body, name)
        if value not in (None, False, {}, {"type": "auto"}):
            raise OpenAIError(400, f"{name} is not supported by this server", param=name, code="unsupported")


@dataclass
class FileCard:
    id: str
    filename: str
    bytes: int
    created_at: int
    purpose: str
    passage_ids: list[str] = field(default_factory=list)  # empty until a store takes it

    def card(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed"}


@dataclass
class Store:
    id: str
    name: str
    created_at: int
    file_ids: list[str] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)


def not_found(what: str, ident: str, param: str) -> OpenAIError:
    return OpenAIError(404, f"no {what} with id {ident!r}", "not_found_error", param=param, code=f"{what}_not_found"
                       .replace(" ", "_"))


class VectorStores:
    """The registry and its operations; the routes' side of it (`add_vector_store_routes`)."""

    def __init__(self, documents: Documents) -> None:
        self.documents = documents
        self.files: dict[str, FileCard] = {}
        self.stores: dict[str, Store] = {}
        self._texts: dict[str, str] = {}  # uploaded and not yet indexed
        self._indexing: dict[str, asyncio.Lock] = {}  # one indexing of a file at a time (two stores may ask at once)
        self._load()

    # ---- the registry on disk ---------------------------------------------------------------------------------
    @property
    def _path(self) -> Path | None:
        folder = getattr(self.documents.index, "folder", None)
        return Path(folder) / REGISTRY_FILE if folder is not None else None

    def _load(self) -> None:
        path = self._path
        if path is None or not path.exists():
            return
        saved = json.loads(path.read_text())
        self.files = {f["id"]: FileCard(**f) for f in saved.get("files", [])}
        self.stores = {s["id"]: Store(**s) for s in saved.get("stores", [])}

    def _save(self) -> None:
        path = self._path
        if path is None:
            return
        indexed = [asdict(f) for f in self.files.values() if f.passage_ids]
        with atomic_write(path, "w") as f:
            json.dump({"files": indexed, "stores": [asdict(s) for s in self.stores.values()]}, f)

    # ---- files --------------------------------------------------------------------------------------------------
    def upload(self, filename: str, data: bytes, purpose: str) -> dict[str, Any]:
        if not data:
            raise OpenAIError(400, f"file {filename!r} is empty", param="file", code="empty_file")
        if len(data) > MAX_FILE_BYTES:
            raise OpenAIError(413, f"file {filename!r} has {len(data)} bytes; the limit is {MAX_FILE_BYTES}",
                              param="file", code="file_too_large")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise OpenAIError(400, f"file {filename!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); this "
                              "server indexes text files", param="file", code="unsupported_file") from None
        pending = sum(len(t.encode()) for t in self._texts.values())
        if pending + len(data) > MAX_PENDING_BYTES:
            raise OpenAIError(429, f"{pending} bytes of uploads wait for a vector store already (the limit is "
                              f"{MAX_PENDING_BYTES}); add them to a store first", param="file", code="too_many_pending")
        if not text.strip():
            raise OpenAIError(400, f"file {filename!r} holds no text", param="file", code="empty_file")
        card = FileCard(f"file-{uuid.uuid4().hex[:24]}", filename, len(data), int(time.time()), purpose)
        self.files[card.id] = card
        self._texts[card.id] = text
        return card.card()

    def file(self, file_id: str) -> FileCard:
        card = self.files.get(file_id)
        if card is None:
            raise not_found("file", file_id, "file_id")
        return card

    # ---- stores -------------------------------------------------------------------------------------------------
    def store(self, store_id: str) -> Store:
        if store_id == INDEX_STORE:
            self.documents.require()
            return Store(INDEX_STORE, "the server's index", 0)
        found = self.stores.get(store_id)
        if found is None:
            raise not_found("vector store", store_id, "vector_store_id")
        return found

    async def create(self, body: CreateStoreRequest) -> dict[str, Any]:
        self.documents.require()
        for file_id in body.file_ids:  # NOTE: every file known and readable before any is indexed
            self._readable(self.file(file_id))
        store = Store(f"vs_{uuid.uuid4().hex[:24]}", body.name, int(time.time()), metadata=dict(body.metadata or {}))
        for file_id in body.file_ids:
            await self._add_file(store, file_id)
        self.stores[store.id] = store  # NOTE: listed once its files are in (a failed add leaves no half-made store)
        self._save()
        return self.card(store)

    async def add_file(self, store_id: str, file_id: str) -> dict[str, Any]:
        store = self.store(store_id)
        if store.id == INDEX_STORE:
            raise OpenAIError(400, f"{INDEX_STORE} is the whole index: add documents with POST /v1/documents, or "
                              "make a vector store for files", param="vector_store_id", code="read_only_store")
        card = await self._add_file(store, file_id)
        self._save()
        return self.file_card(store, card)

    def _readable(self, card: FileCard) -> None:
        if not card.passage_ids and card.id not in self._texts:
            raise OpenAIError(409, f"file {card.id!r} was not kept across a restart; upload it again",
                              param="file_id", code="file_gone")

    async def _add_file(self, store: Store, file_id: str) -> FileCard:
        card = self.file(file_id)
        lock = self._indexing.setdefault(file_id, asyncio.Lock())
        async with lock:  # NOTE: a second store asking meanwhile finds it indexed
            await self._index_file(card)
        self._indexing.pop(file_id, None)
        if file_id not in store.file_ids:
            store.file_ids.append(file_id)
        return card

    async def _index_file(self, card: FileCard) -> None:
        file_id = card.id
        self._readable(card)
        if not card.passage_ids:
            text = self._texts[file_id]
            chunks = split_text(text_splitter(card.filename.lower().endswith(".md"), CHUNK_WORDS, CHUNK_OVERLAP), text)
            if not chunks:
                raise OpenAIError(400, f"file {file_id!r} ({card.filename}) holds no text", param="file_id",
                                  code="empty_file")
            passages = [Passage(f"{file_id}#{k}", card.filename, chunk) for k, chunk in enumerate(chunks)]
            await self.documents.add_passages(passages)
            card.passage_ids = [p.id for p in passages]
            self._texts.pop(file_id, None)

    def card(self, store: Store) -> dict[str, Any]:
        n = len(self.documents.require()) if store.id == INDEX_STORE else len(store.file_ids)
        size = sum(self.files[f].bytes for f in store.file_ids if f in self.files)
        return {"id": store.id, "object": "vector_store", "created_at": store.created_at, "name": store.name,
                "usage_bytes": size, "status": "completed", "last_active_at": store.created_at,
                "file_counts": {"in_progress": 0, "completed": n, "failed": 0, "cancelled": 0, "total": n},
                "metadata": store.metadata, "expires_after": None, "expires_at": None}

    def file_card(self, store: Store, card: FileCard) -> dict[str, Any]:
        return {"id": card.id, "object": "vector_store.file", "created_at": card.created_at,
                "vector_store_id": store.id, "status": "completed", "usage_bytes": card.bytes, "last_error": None,
                "attributes": {}, "chunking_strategy": {"type": "static", "static": {
                    "max_chunk_size_tokens": CHUNK_WORDS, "chunk_overlap_tokens": CHUNK_OVERLAP}}}

    def listing(self) -> dict[str, Any]:
        stores = ([self.store(INDEX_STORE)] if self.documents.index is not None else []) + list(self.stores.values())
        data = [self.card(s) for s in stores]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": False}

    # ---- search -------------------------------------------------------------------------------------------------
    async def search(self, store_ids: list[str], query: str, k: int, disconnected: Any = None) -> list[Hit]:
        """The best `k` passages of the union of `store_ids` (an empty list: the whole index) for `query`."""
        stores = [self.store(s) for s in store_ids]  # NOTE: a 404 for an unknown one before any search
        index = self.documents.require()
        if not stores or any(s.id == INDEX_STORE for s in stores):
            return await self.documents.search_hits(query, k, disconnected)
        allowed = {pid for s in stores for f in s.file_ids if f in self.files for pid in self.files[f].passage_ids}
        if not allowed:
            return []
        # NOTE: over-fetch and keep the store's passages (the index holds other documents too)
        wide = max(1, min(len(index), max(10 * k, len(allowed) + k, 100)))
        hits = await self.documents.search_hits(query, wide, disconnected)
        return [(p, s) for p, s in hits if p.id in allowed][:k]

    def result(self, passage: Passage, score: float) -> dict[str, Any]:
        """One hit as the vector-store search and file_search results show it."""
        file_id = passage.id.split("#", 1)[0] if passage.id.split("#", 1)[0] in self.files else passage.id
        return {"file_id": file_id, "filename": passage.title or file_id, "score": float(score), "attributes": {},
                "text": passage.text}


def add_vector_store_routes(app: FastAPI, stores: VectorStores, v1: list) -> None:
    @app.post("/v1/files", dependencies=v1)
    async def upload(request: Request) -> dict[str, Any]:
        form = await request.form()
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise OpenAIError(400, "a multipart upload needs its file in the `file` field", param="file")
        purpose = form.get("purpose")
        return stores.upload(upload.filename or "upload.txt", await upload.read(),
                             purpose if isinstance(purpose, str) else "assistants")

    @app.get("/v1/files/{file_id}", dependencies=v1)
    async def file(file_id: str) -> dict[str, Any]:
        return stores.file(file_id).card()

    @app.post("/v1/vector_stores", dependencies=v1)
    async def create(body: CreateStoreRequest) -> dict[str, Any]:
        return await stores.create(body)

    @app.get("/v1/vector_stores", dependencies=v1)
    async def listing() -> dict[str, Any]:
        return stores.listing()

    @app.get("/v1/vector_stores/{store_id}", dependencies=v1)
    async def one(store_id: str) -> dict[str, Any]:
        return stores.card(stores.store(store_id))

    @app.post("/v1/vector_stores/{store_id}/files", dependencies=v1)
    async def add_file(store_id: str, body: AddFileRequest) -> dict[str, Any]:
        refuse_unsupported(body, ("attributes", "chunking_strategy"))
        return await stores.add_file(store_id, body.file_id)

    @app.get("/v1/vector_stores/{store_id}/files", dependencies=v1)
    async def files(store_id: str) -> dict[str, Any]:
        store = stores.store(store_id)
        data = [stores.file_card(store, stores.files[f]) for f in store.file_ids if f in stores.files]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": False}

    @app.get("/v1/vector_stores/{store_id}/files/{file_id}", dependencies=v1)
    async def store_file(store_id: str, file_id: str) -> dict[str, Any]:
        store = stores.store(store_id)
        if file_id not in store.file_ids:
            raise not_found("file", file_id, "file_id")
        return stores.file_card(store, stores.file(file_id))

    @app.post("/v1/vector_stores/{store_id}/search", dependencies=v1)
    async def search(store_id: str, body: StoreSearchRequest, request: Request) -> dict[str, Any]:
        refuse_unsupported(body, ("rewrite_query", "filters", "ranking_options"))
        queries = [body.query] if isinstance(body.query, str) else list(body.query)
        if not queries or any(not q.strip() for q in queries):
            raise OpenAIError(400, "query is empty", param="query", code="empty_query")
        hits = await stores.search([store_id], " ".join(queries), body.max_num_results, request.is_disconnected)
        data = []
        for passage, score in hits:
            r = stores.result(passage, score)
            data.append({"file_id": r["file_id"], "filename": r["filename"], "score": r["score"],
                         "attributes": {}, "content": [{"type": "text", "text": r["text"]}]})
        return {"object": "vector_store.search_results.page", "search_query": queries, "data": data,
                "has_more": False, "next_page": None}
