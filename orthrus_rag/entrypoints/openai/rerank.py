"""Reranking over HTTP, in the shapes rerank clients send: `POST /rerank`, `/v1/rerank` and `/v2/rerank` (vLLM's,
Jina's and Cohere's: `query`, `documents`, `top_n`, `return_documents`; `results` of `index` and `relevance_score`,
best first) and `POST /score`, `/v1/score` (vLLM's: `text_1` against `text_2`, one score per pair, in order). The
pairs are scoring requests of the same engine (engine/rerankers.py), in the steps that serve chat and embeddings.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from orthrus_rag.engine.rerankers import is_backbone
from orthrus_rag.entrypoints.openai.errors import OpenAIError, bad_request
from orthrus_rag.entrypoints.openai.schemas import MAX_TEXT_CHARS, _Strict
from orthrus_rag.entrypoints.openai.service import Disconnected, OpenAIService
from orthrus_rag.outputs import ScoreOutput
from orthrus_rag.params import MAX_RERANK_DOCUMENTS, RerankParams, is_bulk


class DocumentText(_Strict):
    text: str


class RerankRequest(_Strict):
    model: str | None = None  # a loaded reranker's name; None: the default
    query: str
    documents: list[str | DocumentText]
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True  # vLLM and Jina return them; Cohere's v1 asks
    instruction: str | None = None  # an LLM reranker's task line (the engine's default when None)
    priority: int = 0


class ScoreRequest(_Strict):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = None
    priority: int = 0


class Rerank:
    """The two routes' semantics over the service's client (its `reranker_names` and `score_pairs`)."""

    def __init__(self, service: OpenAIService) -> None:
        self.service = service
        client = service.client
        self.names: list[str] = list(getattr(client, "reranker_names", []))
        self.score_pairs = getattr(client, "score_pairs", None)

    def params(self, model: str | None, instruction: str | None, priority: int) -> RerankParams:
        if self.score_pairs is None:
            raise OpenAIError(404, f"{getattr(self.service.client, 'name', 'this deployment')} cannot score pairs "
                              "(serve reranks with deploy=engine or ray)", param="model", code="model_not_found")
        if not self.names:
            raise OpenAIError(404, "this server loads no reranker (serve with model.rerankers=[...])", param="model",
                              code="model_not_found")
        if model is not None and model not in self.names:
            raise OpenAIError(404, f"the reranker {model!r} does not exist; served: {', '.join(self.names)}",
                              param="model", code="model_not_found")
        name = model or self.names[0]
        if instruction is not None and not is_backbone(name):  # NOTE: here, whatever process would score it
            raise bad_request(f"reranker {name!r} is a cross-encoder: it takes no instruction", "instruction")
        try:
            return RerankParams(reranker=model, instruction=instruction, priority=priority)
        except ValueError as exc:
            raise bad_request(str(exc), "instruction") from None

    async def scored(self, pairs: list[tuple[str, str]], params: RerankParams,
                     disconnected: Disconnected | None) -> list[ScoreOutput]:
        self.service.reserve(len(pairs), bulk=is_bulk(params))
        outs = await self.service.guard(self.score_pairs(pairs, params), disconnected)
        if self.service.metrics is not None:
            for out in outs:
                self.service.metrics.observe_request("score", out.metrics, out.num_tokens)
        return outs

    async def rerank(self, req: RerankRequest, disconnected: Disconnected | None = None) -> dict[str, Any]:
        params = self.params(req.model, req.instruction, req.priority)
        _check_text(req.query, "query")
        docs = [d if isinstance(d, str) else d.text for d in req.documents]
        _check_count(len(docs), "documents")
        for i, doc in enumerate(docs):
            _check_text(doc, f"documents[{i}]")
        outs = await self.scored([(req.query, d) for d in docs], params, disconnected)
        order = sorted(range(len(docs)), key=lambda i: -outs[i].score)[:req.top_n]
        results = [{"index": i, "relevance_score": outs[i].score,
                    **({"document": {"text": docs[i]}} if req.return_documents else {})} for i in order]
        tokens = sum(o.num_tokens for o in outs)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": params.reranker or self.names[0], "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "meta": {"billed_units": {"search_units": 1}}}

    async def score(self, req: ScoreRequest, disconnected: Disconnected | None = None) -> dict[str, Any]:
        params = self.params(req.model, req.instruction, req.priority)
        firsts = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
        seconds = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
        if len(firsts) == 1:  # NOTE: vLLM's rule: one text_1 against every text_2, else pairs in order
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise bad_request(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}; give one text_1, or as "
                              "many as text_2", "text_1")
        _check_count(len(seconds), "text_2")
        for name, texts in (("text_1", firsts), ("text_2", seconds)):
            for i, text in enumerate(texts):
                _check_text(text, f"{name}[{i}]")
        outs = await self.scored(list(zip(firsts, seconds)), params, disconnected)
        tokens = sum(o.num_tokens for o in outs)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": params.reranker or self.names[0],
                "data": [{"index": i, "object": "score", "score": o.score} for i, o in enumerate(outs)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _check_count(n: int, param: str) -> None:
    if n == 0:
        raise bad_request(f"{param} is empty", param)
    if n > MAX_RERANK_DOCUMENTS:
        raise bad_request(f"{param} has {n} texts; at most {MAX_RERANK_DOCUMENTS} per request", param)


def _check_text(text: str, param: str) -> None:
    if not text.strip():
        raise bad_request(f"{param} is empty", param)
    if len(text) > MAX_TEXT_CHARS:
        raise bad_request(f"{param} has {len(text)} characters, more than any model here takes", param)


def add_rerank_routes(app: FastAPI, rerank: Rerank, v1: list, ignoring: Any) -> None:
    """`/rerank`, `/v1/rerank`, `/v2/rerank`, `/score` and `/v1/score`, behind the same key check as /v1/*."""
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        @app.post(path, dependencies=v1)
        async def rerank_route(body: RerankRequest, request: Request) -> JSONResponse:
            return JSONResponse(await rerank.rerank(body, request.is_disconnected), headers=ignoring(body))

    for path in ("/score", "/v1/score"):
        @app.post(path, dependencies=v1)
        async def score_route(body: ScoreRequest, request: Request) -> JSONResponse:
            return JSONResponse(await rerank.score(body, request.is_disconnected), headers=ignoring(body))
