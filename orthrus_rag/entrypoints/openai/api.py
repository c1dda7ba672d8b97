"""The FastAPI app: OpenAI-compatible routes over one `OpenAIService` (so one EngineClient), `/health` and
`/metrics`. Routes are thin: parse (pydantic), call the service, shape the HTTP answer."""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from orthrus_rag.engine.clients.protocol import EngineClient
from orthrus_rag.entrypoints.openai import generation, responses
from orthrus_rag.entrypoints.openai.documents import Documents, add_document_routes
from orthrus_rag.entrypoints.openai.errors import OpenAIError, error_response, install_error_handlers
from orthrus_rag.entrypoints.openai.metrics import ServerMetrics
from orthrus_rag.entrypoints.openai.rerank import Rerank, add_rerank_routes
from orthrus_rag.entrypoints.openai.schemas import (ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ModelCard,
                                         ModelList)
from orthrus_rag.entrypoints.openai.responses import Responses, ResponsesRequest
from orthrus_rag.entrypoints.openai.service import OpenAIService
from orthrus_rag.entrypoints.openai.vector_stores import VectorStores, add_vector_store_routes
from orthrus_rag.retrievers.live_index import LiveIndex

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 16 << 20  # a body past this is refused (413) before it is parsed


def build_app(client: EngineClient, served_model_name: str | None = None, api_key: str | None = None,
              default_max_tokens: int = 512, index: LiveIndex | None = None) -> FastAPI:
    """An app serving `client` (an `AsyncEngine` in `orthrus-rag serve`). With `api_key`, /v1/* answers 401
    unless `Authorization: Bearer <api_key>`. The app closes the client when it stops (an AsyncEngine's caller
    keeps the sync Engine). `index`: what /v1/search searches and /v1/documents adds to (documents.py)."""
    engine = getattr(client, "engine", None)  # in-process: the KV gauges read its block manager
    metrics = ServerMetrics(client, pending=lambda: client.num_in_flight,
                            block_manager=getattr(engine, "block_manager", None))
    service = OpenAIService(client, served_model_name, default_max_tokens, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            yield
        finally:
            metrics.close()
            await client.aclose()

    app = FastAPI(title="orthrus-rag", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible embeddings and generations served by one co-scheduled engine")
    app.state.service, app.state.metrics = service, metrics
    install_error_handlers(app)
    app.add_middleware(_BodyLimit)
    app.add_middleware(_CountRequests, metrics=metrics)  # NOTE: outermost, so 413s and 400s are counted too
    v1 = [Depends(_authorizer(api_key))]
    documents = Documents(index, service)
    stores = VectorStores(documents)
    app.state.vector_stores = stores
    _add_routes(app, service, metrics, v1, Responses(service, stores))
    add_rerank_routes(app, Rerank(service), v1, _IgnoredFields())
    add_document_routes(app, documents, v1)
    add_vector_store_routes(app, stores, v1)
    return app


def _add_routes(app: FastAPI, service: OpenAIService, metrics: ServerMetrics, v1: list, answers: Responses) -> None:
    # NOTE: a client over replicas in other processes (entrypoints/ray/) adds theirs: `health()` reports replicas up
    # and expected, `metrics_text(own)` merges every replica's figures into the server's own
    @app.get("/health")
    async def health() -> dict[str, Any]:
        report = getattr(service.client, "health", None)
        return {"status": "ok", **(await report() if report is not None else {})}

    @app.get("/metrics")
    async def prometheus() -> Response:
        text = metrics.render()
        merge = getattr(service.client, "metrics_text", None)
        if merge is not None:
            text = (await merge(text.decode())).encode()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=v1, response_model=ModelList)
    async def models() -> ModelList:
        return service.list_models()

    @app.get("/v1/models/{model_id:path}", dependencies=v1, response_model=ModelCard)
    async def model(model_id: str) -> ModelCard:
        return service.model_card(model_id)

    ignoring = _IgnoredFields()

    @app.post("/v1/embeddings", dependencies=v1)
    async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
        return JSONResponse(await service.embeddings(body, request.is_disconnected), headers=ignoring(body))

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if body.stream:
            return _sse(generation.sse_events(await generation.completions_stream(service, body)), ignoring(body))
        return JSONResponse(await generation.completions(service, body, request.is_disconnected),
                            headers=ignoring(body))

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        if body.stream:
            return _sse(generation.sse_events(await generation.chat_stream(service, body)), ignoring(body))
        return JSONResponse(await generation.chat(service, body, request.is_disconnected), headers=ignoring(body))

    @app.post("/v1/responses", dependencies=v1)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        if body.stream:
            return _sse(responses.sse_events(await answers.stream(body)), ignoring(body))
        return JSONResponse(await answers.create(body, request.is_disconnected), headers=ignoring(body))


class _IgnoredFields:
    """Fields of a request body that no schema knows are let through (newer clients keep working) but never in
    silence: the answer names them in an `X-Ignored-Fields` header, and the log names each field once (not once a
    request: a client sending one under load would flood it)."""

    HEADER = "X-Ignored-Fields"

    def __init__(self) -> None:
        self.logged: set[str] = set()

    def __call__(self, body: Any) -> dict[str, str]:
        names = body.ignored()
        if not names:
            return {}
        new = [n for n in names if n not in self.logged]
        if new:
            self.logged.update(new)
            logger.warning("request fields this server does not know, ignored: %s", ", ".join(new))
        # NOTE: header values are latin-1; a client's odd field name is escaped rather than failing the answer
        return {self.HEADER: ", ".join(names).encode("ascii", "backslashreplace").decode()}


def _authorizer(api_key: str | None):
    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise OpenAIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                              code="invalid_api_key")
    return authorize


def _sse(events: Any, headers: dict[str, str] | None = None) -> StreamingResponse:
    # NOTE: Starlette cancels the body iterator when the client disconnects; the engine request is then aborted
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                             **(headers or {})})


ENDPOINT_KINDS = {"/v1/embeddings": "embeddings", "/v1/completions": "completions", "/v1/chat/completions": "chat",
                  "/v1/responses": "responses"}


class _CountRequests:
    """Count every answer of the generating and embedding endpoints by status (`ok`, or the status code), the
    ones refused before a route runs (invalid JSON, a schema violation, a body too large, a missing key)
    included. Plain ASGI: it reads the status from the response's start message and passes everything on."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        kind = ENDPOINT_KINDS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if kind is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                # NOTE: counted before the status goes out, so a client that has its answer sees it counted
                started = True
                code = message["status"]
                self.metrics.requests.labels(kind, "ok" if code == 200 else str(code)).inc()
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if not started:
                self.metrics.requests.labels(kind, "error").inc()


class _BodyLimit:
    """Refuse (413) a request whose declared body is larger than `max_bytes`, before anything reads it. Plain ASGI,
    so streaming responses and disconnect notices pass through untouched."""

    def __init__(self, app: Any, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            size = dict(scope.get("headers", ())).get(b"content-length", b"")
            if size.isdigit() and int(size) > self.max_bytes:
                response = error_response(413, f"the request body has {int(size)} bytes; at most {self.max_bytes}")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
