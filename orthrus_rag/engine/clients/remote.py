"""`RemoteClient`: an `EngineClient` over HTTP, for a running `orthrus-rag serve` (through the official `openai`
client), so a pipeline, an `EngineEmbedder` or the benchmark's Iter-RetGen run against a server the same way they
run in process.

The OpenAI API carries less than an engine request: generations come back as text (with token ids only for a
generation that holds its KV for a continuation), and an embedding takes the server's pooling for the model it
names. So `PoolingParams` here choose the model (the
adapter's name, else the server's default embedding model) and may add an `instruction` (prefixed here, as the
engine would); any other pooling setting is refused rather than silently ignored.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import weakref
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import fields
from typing import Any

import numpy as np
import torch

from orthrus_rag.engine.clients.protocol import InFlight
from orthrus_rag.outputs import EmbeddingOutput, GenerationOutput
from orthrus_rag.params import EmbeddingSpace, PoolingParams, RerankParams, SamplingParams

# PoolingParams fields a request may set over HTTP: the rest are the server's (its model's pooling)
_REMOTE_POOLING = {"adapter", "instruction", "truncate", "priority", "input_type"}


_EXTRA_DEFAULTS: dict[str, Any] = {"top_k": 0, "min_tokens": 0, "ignore_eos": False, "stop_token_ids": [],
                                   "include_stop_str_in_output": False, "priority": 0, "hold_kv_s": 0.0}
MAX_HELD = 4096  # generations `continue_` can still name (their token ids; oldest forgotten first)
MAX_HELD_TOKENS = 8 << 20  # their token ids in all (4 bytes each)


class RemoteClient:
    """`base_url`: the server's OpenAI base URL (ending in /v1). `max_in_flight` bounds what this client sends at
    once (the server's own limit answers 429 beyond it; the openai client retries those `max_retries` times)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = None,
                 max_retries: int = 2, max_in_flight: int = 64, tokenizer: Any = None) -> None:
        import openai

        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.name, self.tokenizer, self.max_in_flight = f"remote {base_url}", tokenizer, max_in_flight
        self._kwargs: dict[str, Any] = {"base_url": base_url, "api_key": api_key or "none", "max_retries": max_retries}
        if timeout is not None:
            self._kwargs["timeout"] = timeout
        self.sync_client = openai.OpenAI(**self._kwargs)  # the blocking calls (and LangChain's RemoteOrthrus)
        # NOTE: an async client's connections belong to one event loop; each loop gets its own
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()
        self._space: EmbeddingSpace | None = None
        self._rerankers: list[str] | None = None
        self._counted = InFlight()
        self._ids = itertools.count()
        # request id -> (prompt + output token ids, params) of generations that held their KV on the server
        self._held: OrderedDict[str, tuple[array, SamplingParams]] = OrderedDict()
        self._held_tokens = 0

    # ---- what the server serves ---------------------------------------------------------------------------------
    @property
    def embedding_space(self) -> EmbeddingSpace:
        """From GET /v1/models: the generation model first, then the adapters (cards with a `parent`, by name, with
        their `kinds`) and the separate embedding model, if any."""
        if self._space is None:
            cards = list(self.sync_client.models.list())
            if not cards:
                raise RuntimeError(f"{self.name} serves no model")
            generation = cards[0].id
            extra = {c.id: (getattr(c, "kinds", None), getattr(c, "parent", None)) for c in cards}
            prefixes = {c.id: p for c in cards if (p := getattr(c, "input_prefixes", None))}
            adapters = [c.id for c in cards[1:] if extra[c.id][1]]
            encoder = next((c.id for c in cards[1:] if c.id not in adapters), None)
            kinds = {}
            for name in adapters:
                can = set(extra[name][0] or ["embed"])
                kinds[name] = "both" if can == {"generate", "embed"} else next(iter(can))
            self._space = EmbeddingSpace(generation, encoder, tuple(adapters),
                                         {a: i for i, a in enumerate(adapters, start=1)}, adapter_kinds=kinds,
                                         adapter_prefixes=prefixes)
        return self._space

    @property
    def num_in_flight(self) -> int:
        return self._counted.count

    def observe_steps(self, observer: Callable[[Any], None]) -> None:
        return None  # NOTE: the steps run on the server (its /metrics shows them)

    # ---- generation ---------------------------------------------------------------------------------------------
    def _completion_args(self, prompt: str | Sequence[int], params: SamplingParams | None) -> dict[str, Any]:
        p = params or SamplingParams()
        if not isinstance(prompt, str):
            prompt = list(prompt)
        if p.adapter is not None:
            self.embedding_space.generation_slot(p.adapter)  # NOTE: an unknown adapter fails here, named
        args = {"model": p.adapter or self.embedding_space.model, "prompt": prompt, "max_tokens": p.max_tokens,
                "temperature": p.temperature, "top_p": p.top_p, "stop": list(p.stop) or None}
        if p.seed is not None:
            args["seed"] = p.seed
        # vLLM's extra sampling fields, sent only where they differ from the server's defaults
        extra: dict[str, Any] = {name: getattr(p, name) for name, default in _EXTRA_DEFAULTS.items()
                                 if getattr(p, name) != default}
        if p.structured_outputs is not None:
            extra["structured_outputs"] = p.structured_outputs.as_request()
        if p.hold_kv_s:  # NOTE: a continuation re-sends the token ids, which the server's held blocks are named by
            extra["return_token_ids"] = True
        if extra:
            args["extra_body"] = extra
        return args

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> GenerationOutput:
        with self._counted(1):
            out = await self.async_client().completions.create(**self._completion_args(prompt, params))
        choice = out.choices[0]
        details = getattr(out.usage, "prompt_tokens_details", None) if out.usage is not None else None
        result = GenerationOutput(request_id or out.id, list(getattr(choice, "prompt_token_ids", None) or []),
                                  list(getattr(choice, "token_ids", None) or []), choice.text, choice.finish_reason,
                                  num_cached_tokens=int(getattr(details, "cached_tokens", 0) or 0))
        self._forget(result.request_id)  # NOTE: a later round under the id replaces (or ends) what was held
        if params is not None and params.hold_kv_s and result.prompt_token_ids:
            ids = array("i", result.prompt_token_ids + result.token_ids)
            self._held[result.request_id] = (ids, params)
            self._held_tokens += len(ids)
            while self._held and (len(self._held) > MAX_HELD or self._held_tokens > MAX_HELD_TOKENS):
                _, (old, _) = self._held.popitem(last=False)
                self._held_tokens -= len(old)
        return result

    def _forget(self, request_id: str) -> None:
        old = self._held.pop(request_id, None)
        if old is not None:
            self._held_tokens -= len(old[0])

    async def release(self, request_id: str) -> bool:
        """Forget a generation nobody will continue (its hold on the server ends at its deadline)."""
        found = request_id in self._held
        self._forget(request_id)
        return found

    @property
    def can_continue(self) -> bool:
        """Text is appended as token ids, so continuing needs the model's tokenizer (`tokenizer=`)."""
        return self.tokenizer is not None

    async def continue_(self, request_id: str, appended: str | Sequence[int] = (),
                        params: SamplingParams | None = None) -> GenerationOutput:
        """Continue a generation of this client that set `hold_kv_s` (Engine.continue_'s semantics): its prompt and
        output token ids and `appended` are sent as one prompt, whose prefix the server's held blocks serve."""
        held = self._held.get(request_id)
        if held is None:
            raise ValueError(f"no finished generation {request_id!r} to continue: it is unknown to this client, did "
                             f"not set SamplingParams.hold_kv_s, or is older than the last {MAX_HELD}")
        if isinstance(appended, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.name} appends text as token ids: give RemoteClient a tokenizer= to continue "
                                 "with text")
            extra = self.tokenizer(appended, add_special_tokens=False)["input_ids"] if appended else []
        else:
            extra = list(appended)
        return await self.generate(held[0].tolist() + extra, params or held[1], request_id)

    async def generate_stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                              request_id: str | None = None) -> AsyncIterator[GenerationOutput]:
        """Cumulative snapshots from the server's stream; leaving early closes it (the server aborts)."""
        text, rid = "", request_id or f"remote-{next(self._ids)}"
        with self._counted(1):
            stream = await self.async_client().completions.create(**self._completion_args(prompt, params), stream=True)
            async with stream:
                async for chunk in stream:
                    for choice in chunk.choices:
                        text += choice.text or ""
                        done = choice.finish_reason is not None
                        yield GenerationOutput(rid, [], [], text, choice.finish_reason, finished=done)

    # ---- embeddings ---------------------------------------------------------------------------------------------
    def _embedding_args(self, texts: Sequence[str | Sequence[int]], params: PoolingParams | None) -> dict[str, Any]:
        space = self.embedding_space
        if params is not None:
            given = {f.name for f in fields(PoolingParams) if getattr(params, f.name) != f.default}
            refused = sorted(given - _REMOTE_POOLING)
            if refused:
                raise ValueError(f"{self.name} pools with its model's own settings; {', '.join(refused)} cannot "
                                 "be set over the OpenAI API (choose the model by its adapter name instead)")
        route = space.route(params)
        model = route.adapter or (space.embedding_model if route.on_encoder else space.model)
        if params is not None:  # NOTE: the adapter's prefix for the input type (its card, read from the server's)
            params = space.formatted(params)
        prefix = (params.instruction if params is not None else None) or ""
        inputs = [prefix + t if isinstance(t, str) else list(t) for t in texts]
        if prefix and any(not isinstance(t, str) for t in texts):
            raise ValueError("an instruction prefixes text; token-id inputs cannot take one here")
        args: dict[str, Any] = {"model": model, "input": inputs, "encoding_format": "base64"}
        # NOTE: the server's (and vLLM's) field: bulk work above 0, and a pipeline's queries (-1) latency-critical
        # there as they are in-process
        if params is not None and params.priority:
            args["extra_body"] = {"priority": params.priority}
        return args

    async def embed(self, text: str | Sequence[int], params: PoolingParams | None = None,
                    request_id: str | None = None) -> EmbeddingOutput:
        return (await self.embed_many([text], params))[0]

    async def embed_many(self, texts: Sequence[str | Sequence[int]],
                         params: PoolingParams | None = None) -> list[EmbeddingOutput]:
        args = self._embedding_args(texts, params)  # NOTE: one HTTP request: the server embeds them together
        with self._counted(len(texts)):
            out = await self.async_client().embeddings.create(**args)
        return _embeddings(out)

    def embed_sync(self, texts: Sequence[str | Sequence[int]],
                   params: PoolingParams | None = None) -> list[EmbeddingOutput]:
        return _embeddings(self.sync_client.embeddings.create(**self._embedding_args(texts, params)))

    # ---- reranking -----------------------------------------------------------------------------------------------
    @property
    def reranker_names(self) -> list[str]:
        """The server's rerankers (GET /v1/models: the cards a score request may name), its default first."""
        if self._rerankers is None:
            self._rerankers = [c.id for c in self.sync_client.models.list() if "score" in (getattr(c, "kinds", None)
                                                                                            or [])]
        return self._rerankers

    async def score(self, query: str, documents: Sequence[str], params: RerankParams | None = None) -> list[float]:
        """Each document's relevance to `query`, in the documents' order: one POST /v1/rerank, so the server scores
        them together (in the steps that serve its chat and embeddings)."""
        if isinstance(documents, str):
            raise TypeError("documents must be a list of strings, not one string")
        body = _rerank_body(query, list(documents), params)
        with self._counted(len(documents)):
            out = await self.async_client().post("/rerank", body=body, cast_to=object)
        scores = [float("nan")] * len(documents)
        for item in out["results"]:
            scores[item["index"]] = float(item["relevance_score"])
        return scores

    async def abort(self, request_id: str) -> bool:
        return False  # NOTE: over HTTP a request stops when its caller stops awaiting it (the server aborts it)

    async def aclose(self) -> None:
        current = asyncio.get_running_loop()
        for loop, client in list(self._async.items()):
            if loop is current:  # NOTE: another loop's connections cannot be closed from here (it may be gone)
                await client.close()
        self._async.clear()
        self.sync_client.close()

    # ---- helpers ------------------------------------------------------------------------------------------------
    def async_client(self) -> Any:
        """The async openai client of the running event loop."""
        import openai

        loop = asyncio.get_running_loop()
        client = self._async.get(loop)
        if client is None:
            client = self._async[loop] = openai.AsyncOpenAI(**self._kwargs)
        return client



def _rerank_body(query: str, documents: list[str], params: RerankParams | None) -> dict[str, Any]:
    """/v1/rerank's body for `params` (the server truncates a pair that does not fit, as Cohere's API does)."""
    params = params or RerankParams()
    if not params.truncate:
        raise ValueError("a served reranker cuts a pair that does not fit; truncate=False cannot be asked over HTTP")
    body: dict[str, Any] = {"query": query, "documents": documents, "return_documents": False}
    for key, value in (("model", params.reranker), ("instruction", params.instruction),
                       ("priority", params.priority or None)):
        if value is not None:
            body[key] = value
    return body


def _embeddings(out: Any) -> list[EmbeddingOutput]:
    items = sorted(out.data, key=lambda d: d.index)
    return [EmbeddingOutput(f"{out.model}-{d.index}", [], _vector(d.embedding)) for d in items]


def _vector(data: str | list[float]) -> torch.Tensor:
    """An embedding item in either encoding (base64 little-endian float32, or a list)."""
    if isinstance(data, str):
        return torch.from_numpy(np.frombuffer(base64.b64decode(data), dtype="<f4").astype(np.float32))
    return torch.tensor(data, dtype=torch.float32)
