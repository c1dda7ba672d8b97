"""`OpenAIService`: the OpenAI API's semantics over one `EngineClient`, shared by every endpoint and caller.

The HTTP routes (api.py) and the in-process LangChain components both call it, so there is one owner of what
`n`, `stop`, `seed`, `max_tokens`, the chat template, `encoding_format` and the 400-or-429 admission rule
(`reserve`) mean. It runs on the event loop the client is bound to; every failure is an `OpenAIError` with the status and message a caller sees."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from orthrus_rag.engine.clients.protocol import (
    BulkQuota,
    EngineClient,
    EngineQueueFull,
    EngineShutdown,
    EngineUnavailable,
    RequestAborted,
    execution_plan,
)
from orthrus_rag.entrypoints.openai.errors import OpenAIError, bad_request
from orthrus_rag.entrypoints.openai.metrics import ServerMetrics
from orthrus_rag.entrypoints.openai.schemas import MAX_INPUTS, MAX_TEXT_CHARS, EmbeddingRequest, ModelCard, ModelList
from orthrus_rag.outputs import GenerationOutput
from orthrus_rag.params import EmbeddingSpace, PoolingParams, SamplingParams, StructuredOutputsParams, is_bulk

T = TypeVar("T")
RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.25  # how often a waiting request asks whether its client is still there
Disconnected = Callable[[], Awaitable[bool]]  # whether the client went away (e.g. Starlette's request.is_disconnected)


@dataclass
class ServedModels:
    """The names callers use: the base generation model and the generation adapters (name -> SamplingParams.adapter),
    and the embedding models (name -> PoolingParams.adapter). An adapter is addressed by its name, as vLLM's
    `--lora-modules name=path`."""

    generation: str
    embedding: dict[str, str | None] = field(default_factory=dict)  # name -> PoolingParams.adapter
    generators: dict[str, str | None] = field(default_factory=dict)  # name -> SamplingParams.adapter
    rerankers: list[str] = field(default_factory=list)  # what /rerank and /score name (RerankParams.reranker)

    @classmethod
    def of(cls, space: EmbeddingSpace, served_model_name: str | None = None,
           rerankers: Sequence[str] = ()) -> "ServedModels":
        gen = served_model_name or space.model
        emb: dict[str, str | None] = {}
        if space.has_encoder:
            emb[space.embedding_model] = None
        else:
            emb[gen] = None  # the backbone with its default adapter (if any)
        for name in space.embedding_adapters():  # each loaded adapter by its name
            emb.setdefault(name, name)
        generators: dict[str, str | None] = {gen: None}
        for name in space.generation_adapters():
            generators.setdefault(name, name)
        return cls(gen, emb, generators, list(rerankers))

    def kinds(self, name: str) -> list[str]:
        return [k for k, names in (("generate", self.generators), ("embed", self.embedding),
                                   ("score", self.rerankers)) if name in names]

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys([self.generation, *self.generators, *self.embedding, *self.rerankers]))


class OpenAIService:
    def __init__(self, client: EngineClient, served_model_name: str | None = None,
                 default_max_tokens: int = 512, metrics: ServerMetrics | None = None) -> None:
        self.client = client
        self.tokenizer = client.tokenizer
        self.space = client.embedding_space
        self.models = ServedModels.of(self.space, served_model_name, getattr(client, "reranker_names", ()))
        self.default_max_tokens = default_max_tokens
        self.metrics = metrics
        self.created = int(time.time())

    # ---- models -------------------------------------------------------------------------------------------
    def list_models(self) -> ModelList:
        return ModelList(data=[self._card(n) for n in self.models.names])

    def model_card(self, model: str) -> ModelCard:
        """`GET /v1/models/{model}`: its card, or a 404 naming the served ones."""
        if model not in self.models.names:
            raise _unknown_model(model, self.models.names)
        return self._card(model)

    def _card(self, name: str) -> ModelCard:
        adapter = self.models.generators.get(name) or self.models.embedding.get(name)
        plan = execution_plan(self.client) if name == self.models.generation else None
        return ModelCard(id=name, created=self.created, kinds=self.models.kinds(name),
                         parent=self.space.model if adapter else None, input_prefixes=self._prefixes(name),
                         plan=plan.to_json() if plan is not None else None)

    def _prefixes(self, name: str) -> dict[str, str]:
        """The prefixes an embedding for `name` gets by input type: its adapter's card (the base model's name
        embeds under the default adapter when there is no encoder)."""
        if name not in self.models.embedding:
            return {}
        adapter = self.models.embedding[name]
        route = self.space.route(self.space.default_pooling() if adapter is None else PoolingParams(adapter=adapter))
        return {} if route.on_encoder else dict(self.space.adapter_prefixes.get(route.adapter or "", {}))

    def generation_adapter(self, model: str) -> str | None:
        """The adapter a completion or chat for `model` runs under (None: the base model), or a 404 naming the
        models that generate."""
        if model not in self.models.generators:
            raise _unknown_model(model, list(self.models.generators))
        return self.models.generators[model]

    # ---- embeddings -----------------------------------------------------------------------------------------
    async def embeddings(self, req: EmbeddingRequest, disconnected: Disconnected | None = None) -> dict[str, Any]:
        if req.model not in self.models.embedding:
            raise _unknown_model(req.model, list(self.models.embedding))
        inputs = _as_inputs(req.input, "input")
        adapter = self.models.embedding[req.model]
        params = self.space.default_pooling() if adapter is None else PoolingParams(adapter=adapter)
        # NOTE: the engine prefixes an adapter's inputs by their type
        params = replace(params, input_type=req.input_type, priority=req.priority)
        width = self.space.dimension(self.space.route(params))
        if req.dimensions is not None and width is not None and req.dimensions != width:
            raise bad_request(f"dimensions={req.dimensions} is not supported: {req.model} gives {width}-dimensional "
                              "vectors", "dimensions")
        self.reserve(len(inputs), bulk=is_bulk(params))
        outs = await self.guard(self.client.embed_many(inputs, params), disconnected)
        data, tokens = [], 0
        for i, out in enumerate(outs):
            vector = out.embedding.detach().float().cpu().numpy().astype("<f4")
            value: Any = base64.b64encode(vector.tobytes()).decode() if req.encoding_format == "base64" \
                else vector.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
            tokens += len(out.prompt_token_ids)
            if self.metrics is not None:
                self.metrics.observe_request("embed", out.metrics, len(out.prompt_token_ids))
        return {"object": "list", "data": data, "model": req.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    # ---- generation -----------------------------------------------------------------------------------------
    def require_chat_template(self, param: str = "messages") -> None:
        """A 400 (naming `param`) when the model has no chat template to render messages with."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(f"{self.models.generation} has no chat template; use /v1/completions", param)

    def chat_tokens(self, messages: list[dict[str, str]], param: str = "messages") -> list[int]:
        """`messages` ({"role", "content"}) through the model's chat template, generation prompt added, as token
        ids: what chat completions and responses send the engine."""
        self.require_chat_template(param)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def sampling_params(self, max_tokens: int | None, temperature: float | None, top_p: float | None,
                        stop: list[str], seed: int | None, index: int, logprobs: int | None = None,
                        structured: StructuredOutputsParams | None = None, adapter: str | None = None,
                        **extra: Any) -> SamplingParams:
        """OpenAI defaults: temperature 1, top_p 1; `n` samples differ by seed (seed + index when one is given);
        `logprobs`: the top tokens to report per position (None: no log-probabilities); `structured`: the output
        constraint (entrypoints/openai/generation.py); `extra`: vLLM's extra sampling fields
        (`_Sampling.engine_sampling`)."""
        try:
            return SamplingParams(max_tokens=max_tokens or self.default_max_tokens,
                                  temperature=1.0 if temperature is None else temperature,
                                  top_p=1.0 if top_p is None else top_p, stop=stop,
                                  seed=None if seed is None else (seed + index) % (2**63), logprobs=logprobs,
                                  structured_outputs=structured, adapter=adapter, **extra)
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    async def generate_many(self, prompt: str | list[int], params: Sequence[SamplingParams],
                            disconnected: Disconnected | None = None) -> list[GenerationOutput]:
        """One prompt, one request per params (n samples), submitted together."""
        self.reserve(len(params))

        async def _all() -> list[GenerationOutput]:
            tasks = [asyncio.ensure_future(self.client.generate(prompt, p)) for p in params]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for t in tasks:  # NOTE: cancelling an awaiter aborts its engine request (blocks freed)
                    t.cancel()
                raise

        outs = await self.guard(_all(), disconnected)
        for out in outs:
            self.observe_generation(out)
        return outs

    async def stream_many(self, prompt: str | list[int], params: Sequence[SamplingParams],
                          ) -> AsyncIterator[tuple[int, GenerationOutput]]:
        """(choice index, snapshot) from `len(params)` streams merged as they come; leaving early aborts all."""
        self.reserve(len(params))
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def _pump(i: int, p: SamplingParams) -> None:
            try:
                async for snap in self.client.generate_stream(prompt, p):
                    await queue.put((i, snap))
            except BaseException as exc:  # noqa: BLE001 (handed to the consumer)
                await queue.put((i, exc))
                if isinstance(exc, asyncio.CancelledError):
                    raise

        tasks = [asyncio.ensure_future(_pump(i, p)) for i, p in enumerate(params)]
        try:
            done = 0
            while done < len(tasks):
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise self._map_error(item)
                if item.finished:
                    done += 1
                    self.observe_generation(item)
                yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def observe_generation(self, out: GenerationOutput) -> None:
        if self.metrics is not None:
            self.metrics.observe_request("generate", out.metrics, len(out.prompt_token_ids), len(out.token_ids))

    # ---- failures -------------------------------------------------------------------------------------------
    def reserve(self, n: int, bulk: bool = False) -> None:
        """Room for `n` more requests under the client's in-flight limit, or an error (nothing is submitted then):
        a 400 naming the limit when `n` alone passes it (waiting cannot help), else a retryable 429. `bulk`
        (priority > 0): the client's bulk limit, where it keeps one apart (`BulkQuota`: AsyncEngine)."""
        limit, pending, what = self.client.max_in_flight, self.client.num_in_flight, "requests"
        if bulk and isinstance(self.client, BulkQuota):
            limit, pending, what = self.client.max_bulk_in_flight, self.client.num_bulk_in_flight, "bulk requests"
        if n > limit:
            raise bad_request(f"this request needs {n} engine {what} (one per input, prompt and choice); the "
                              f"server takes at most {limit} at a time (deploy.max_in_flight): split it")
        if pending + n > limit:
            raise _queue_full(f"the server is busy ({pending} {what} pending, the limit is {limit}); retry later")

    async def guard(self, coro: Awaitable[T], disconnected: Disconnected | None = None) -> T:
        """Await `coro`, mapping engine failures to OpenAIError; with `disconnected`, polled while it runs, cancel it
        (and so abort its engine requests) if the client goes away first."""
        try:
            return await (coro if disconnected is None else _until_disconnect(coro, disconnected))
        except (ValueError, TypeError, EngineQueueFull, EngineShutdown, EngineUnavailable, RequestAborted,
                RuntimeError) as exc:
            raise self._map_error(exc) from None

    def _map_error(self, exc: BaseException) -> BaseException:
        if isinstance(exc, OpenAIError | asyncio.CancelledError):
            return exc
        if isinstance(exc, (ValueError, TypeError)):
            return bad_request(str(exc))
        if isinstance(exc, EngineQueueFull):
            return _queue_full(str(exc))
        if isinstance(exc, EngineUnavailable):
            return OpenAIError(503, str(exc), "server_error", code="replica_unavailable",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        if isinstance(exc, EngineShutdown):
            return OpenAIError(503, str(exc), "server_error", code="shutting_down")
        if isinstance(exc, RequestAborted):
            return OpenAIError(499, str(exc), "invalid_request_error", code="aborted")
        return OpenAIError(500, f"the engine failed this request: {exc}", "server_error")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _unknown_model(model: str, known: list[str]) -> OpenAIError:
    return OpenAIError(404, f"the model {model!r} does not exist; served: {', '.join(known)}",
                       param="model", code="model_not_found")


def _as_inputs(value: Any, param: str) -> list[str | list[int]]:
    """A str, a list of str, a list of token ids or a list of those, as a list of inputs (each checked)."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif value and all(isinstance(v, int) for v in value):
        items = [list(value)]
    else:
        items = list(value)
    if not items:
        raise bad_request(f"{param} is empty", param)
    if len(items) > MAX_INPUTS:
        raise bad_request(f"{param} has {len(items)} items; at most {MAX_INPUTS} per request", param)
    for i, item in enumerate(items):
        if isinstance(item, str) and len(item) > MAX_TEXT_CHARS:
            raise bad_request(f"{param}[{i}] has {len(item)} characters, more than any model here takes", param)
        if not isinstance(item, str) and not item:
            raise bad_request(f"{param}[{i}] is empty", param)
    return items


def as_prompts(value: Any) -> list[str | list[int]]:
    return _as_inputs(value, "prompt")


def vector_of(data: Any) -> np.ndarray:
    """An embedding item's vector from either encoding (for clients of this module)."""
    if isinstance(data, str):
        return np.frombuffer(base64.b64decode(data), dtype="<f4")
    return np.asarray(data, dtype=np.float32)


def _queue_full(message: str) -> OpenAIError:
    """The retryable 429: more requests than the client admits at once (here, or its own EngineQueueFull)."""
    return OpenAIError(429, message, "rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})


async def _until_disconnect(coro: Awaitable[T], disconnected: Disconnected) -> T:
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await disconnected():
                task.cancel()
                raise OpenAIError(499, "the client closed the connection", code="client_closed")
    finally:
        if not task.done():
            task.cancel()
