"""How the LangChain components reach an engine: in-process (`LocalOrthrus`, one shared `EngineClient`) or over
HTTP (`RemoteOrthrus`, the official `openai` client against `orthrus-rag serve`). Both speak the OpenAI API's
dicts, and the in-process path calls the server's own `OpenAIService` directly (its chunks as dicts, no HTTP or
SSE text in between), so a component behaves the same either way.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncIterator, Coroutine, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

from orthrus_rag.engine.async_engine import AsyncEngine
from orthrus_rag.engine.clients.protocol import EngineClient
from orthrus_rag.engine.clients.remote import RemoteClient
from orthrus_rag.engine.engine import Engine
from orthrus_rag.entrypoints.openai import generation
from orthrus_rag.entrypoints.openai.errors import OpenAIError
from orthrus_rag.entrypoints.openai.rerank import Rerank, RerankRequest
from orthrus_rag.entrypoints.openai.schemas import ChatCompletionRequest, EmbeddingRequest
from orthrus_rag.entrypoints.openai.service import OpenAIService, vector_of

T = TypeVar("T")


class OrthrusAPIError(RuntimeError):
    """An in-process request the server would have answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


# ---- in-process ------------------------------------------------------------------------------------------------
class LocalOrthrus:
    """One `AsyncEngine` on a private event-loop thread, shared by every component built on the same engine
    (`LocalOrthrus.of(engine)`), so their embeddings and generations meet in the same steps. Calls from any
    thread or event loop hop onto that loop."""

    _shared: "weakref.WeakKeyDictionary[Engine, LocalOrthrus]" = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, engine: Engine | EngineClient, served_model_name: str | None = None,
                 max_in_flight: int = 1024) -> None:
        self.client: EngineClient = (AsyncEngine(engine, max_in_flight=max_in_flight) if isinstance(engine, Engine)
                                     else engine)
        self.service = OpenAIService(self.client, served_model_name)
        self.generation_model = self.service.models.generation
        self.embedding_models = list(self.service.models.embedding)
        self.reranking = Rerank(self.service)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="orthrus-langchain-loop", daemon=True)
        self._thread.start()

    @classmethod
    def of(cls, engine: "Engine | EngineClient | LocalOrthrus") -> "LocalOrthrus":
        """The one LocalOrthrus of `engine` (made on first use)."""
        if isinstance(engine, LocalOrthrus):
            return engine
        key = engine.engine if isinstance(engine, AsyncEngine) else engine
        with cls._lock:
            local = cls._shared.get(key)
            if local is None:
                local = cls._shared[key] = cls(engine)
            return local

    # ---- running on the engine's loop -----------------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the engine's loop and wait (not from that loop itself)."""
        return _unwrap(lambda: self.submit(coro).result())

    async def acall(self, coro: Coroutine[Any, Any, T]) -> T:
        if asyncio.get_running_loop() is self.loop:
            return await coro
        future = self.submit(coro)
        try:
            return await _aunwrap(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            future.cancel()  # NOTE: cancels the task on the engine's loop too, which aborts its requests
            raise

    def close(self) -> None:
        """Close the client and its loop (a sync Engine stays usable)."""
        if self.loop.is_closed():
            return
        self.call(self.client.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    # ---- the OpenAI API ----------------------------------------------------------------------------------------
    async def _embed(self, texts: list[str], model: str, input_type: str | None, priority: int) -> list[list[float]]:
        body = await self.service.embeddings(EmbeddingRequest(model=model, input=texts, input_type=input_type,
                                                              priority=priority))
        return [item["embedding"] for item in body["data"]]

    def embed(self, texts: list[str], model: str, input_type: str | None = None,
              priority: int = 0) -> list[list[float]]:
        return self.call(self._embed(texts, model, input_type, priority))

    async def aembed(self, texts: list[str], model: str, input_type: str | None = None,
                     priority: int = 0) -> list[list[float]]:
        return await self.acall(self._embed(texts, model, input_type, priority))

    async def _rerank(self, query: str, documents: list[str], model: str | None,
                      top_n: int | None) -> list[dict[str, Any]]:
        body = await self.reranking.rerank(RerankRequest(model=model, query=query, documents=documents, top_n=top_n,
                                                         return_documents=False))
        return body["results"]

    def rerank(self, query: str, documents: list[str], model: str | None = None,
               top_n: int | None = None) -> list[dict[str, Any]]:
        """/v1/rerank's `results` ({"index", "relevance_score"}, best first)."""
        return self.call(self._rerank(query, documents, model, top_n))

    async def arerank(self, query: str, documents: list[str], model: str | None = None,
                      top_n: int | None = None) -> list[dict[str, Any]]:
        return await self.acall(self._rerank(query, documents, model, top_n))

    def chat(self, payload: dict[str, Any]) -> dict[str, Any]:
        return self.call(generation.chat(self.service, ChatCompletionRequest.model_validate(payload)))

    async def achat(self, payload: dict[str, Any]) -> dict[str, Any]:
        return await self.acall(generation.chat(self.service, ChatCompletionRequest.model_validate(payload)))

    async def _events(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The chunks the HTTP route would send, as the service's dicts (on the engine's loop)."""
        chunks = await generation.chat_stream(self.service, ChatCompletionRequest.model_validate(payload))
        async for body in chunks:
            yield body

    def chat_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        gen = self._events(payload)
        try:
            while (item := self.call(_next(gen))) is not _END:
                yield item
        finally:  # NOTE: a consumer that stops early aborts the request on the engine's loop
            self.submit(_close(gen)).result(30)

    async def achat_stream(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        gen = self._events(payload)
        try:
            while (item := await self.acall(_next(gen))) is not _END:
                yield item
        finally:
            await self.acall(_close(gen))

    async def agenerate(self, prompt: str, params: Any) -> Any:
        """A plain generation (Iter-RetGen's `generate`), on the engine's loop."""
        return await self.acall(self.client.generate(prompt, params))


_END = object()


async def _next(gen: AsyncIterator[Any]) -> Any:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return _END


async def _close(gen: Any) -> None:
    await gen.aclose()


def _unwrap(fn: Any) -> Any:
    try:
        return fn()
    except OpenAIError as exc:
        raise OrthrusAPIError(exc.status, exc.message) from None


async def _aunwrap(awaitable: Any) -> Any:
    try:
        return await awaitable
    except OpenAIError as exc:
        raise OrthrusAPIError(exc.status, exc.message) from None


# ---- over HTTP ---------------------------------------------------------------------------------------------
class RemoteOrthrus:
    """`orthrus-rag serve` at `base_url` (e.g. http://127.0.0.1:8000/v1) through the official openai client: the
    chat dicts here, generation and the connections through the project's `RemoteClient`."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = None,
                 max_retries: int = 2) -> None:
        self.remote = RemoteClient(base_url, api_key, timeout, max_retries)
        self.client = self.remote.sync_client
        self._models: list[str] | None = None

    @property
    def aclient(self) -> Any:
        """The async openai client of the running event loop (connections belong to one loop)."""
        return self.remote.async_client()

    @property
    def generation_model(self) -> str:
        return self._model_ids()[0]  # NOTE: the server lists its generation model first

    @property
    def embedding_models(self) -> list[str]:
        return self._model_ids()[1:] or self._model_ids()[:1]

    def _model_ids(self) -> list[str]:
        if self._models is None:
            self._models = [m.id for m in self.client.models.list()]
        return self._models

    def embed(self, texts: list[str], model: str, input_type: str | None = None,
              priority: int = 0) -> list[list[float]]:
        out = self.client.embeddings.create(model=model, input=texts, encoding_format="base64",
                                            extra_body=_extra_fields(input_type, priority))
        return [vector_of(d.embedding).tolist() for d in sorted(out.data, key=lambda d: d.index)]

    async def aembed(self, texts: list[str], model: str, input_type: str | None = None,
                     priority: int = 0) -> list[list[float]]:
        out = await self.aclient.embeddings.create(model=model, input=texts, encoding_format="base64",
                                                   extra_body=_extra_fields(input_type, priority))
        return [vector_of(d.embedding).tolist() for d in sorted(out.data, key=lambda d: d.index)]

    def rerank(self, query: str, documents: list[str], model: str | None = None,
               top_n: int | None = None) -> list[dict[str, Any]]:
        """POST /v1/rerank through the openai client's own connection, key and retries."""
        return self.client.post("/rerank", body=_rerank_body(query, documents, model, top_n), cast_to=object)["results"]

    async def arerank(self, query: str, documents: list[str], model: str | None = None,
                      top_n: int | None = None) -> list[dict[str, Any]]:
        body = _rerank_body(query, documents, model, top_n)
        return (await self.aclient.post("/rerank", body=body, cast_to=object))["results"]

    def chat(self, payload: dict[str, Any]) -> dict[str, Any]:
        return self.client.chat.completions.create(**payload).model_dump()

    async def achat(self, payload: dict[str, Any]) -> dict[str, Any]:
        return (await self.aclient.chat.completions.create(**payload)).model_dump()

    def chat_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self.client.chat.completions.create(**payload, stream=True) as stream:
            for chunk in stream:
                yield chunk.model_dump()

    async def achat_stream(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        stream = await self.aclient.chat.completions.create(**payload, stream=True)
        async with stream:
            async for chunk in stream:
                yield chunk.model_dump()

    async def agenerate(self, prompt: str, params: Any) -> Any:
        """A plain generation through /v1/completions, shaped like the engine's output (`.text`)."""
        return await self.remote.generate(prompt, params)


def make_transport(engine: Any = None, base_url: str | None = None, api_key: str | None = None,
                   timeout: float | None = None, max_retries: int = 2) -> LocalOrthrus | RemoteOrthrus:
    if (engine is None) == (base_url is None):
        raise ValueError("give either engine= (in-process) or base_url= (a running `orthrus-rag serve`)")
    if engine is not None:
        return LocalOrthrus.of(engine)
    return RemoteOrthrus(base_url, api_key, timeout, max_retries)


def _rerank_body(query: str, documents: list[str], model: str | None, top_n: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {"query": query, "documents": documents, "return_documents": False}
    if model is not None:
        body["model"] = model
    if top_n is not None:
        body["top_n"] = top_n
    return body


def _extra_fields(input_type: str | None, priority: int) -> dict[str, Any] | None:
    """The server's fields beyond OpenAI's, where set: `input_type` (an embedding adapter's query / document prefix)
    and `priority` (above 0: bulk work)."""
    extra = {"input_type": input_type} if input_type is not None else {}
    if priority:
        extra["priority"] = priority
    return extra or None
