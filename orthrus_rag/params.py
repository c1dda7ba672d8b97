"""Per-request parameters: how to sample a generation, how to pool an embedding; and where each runs.

Where an embedding runs (the separate encoder, or the decoder backbone with a LoRA adapter or none) and which
adapter a generation runs under are decided here, by `route_embedding` and `generation_slot`, the one owner of
those rules; `EmbeddingSpace` carries what a client's embeddings are and which adapters it serves, so the engine,
the `Embedder` and the server all route through the same functions. An adapter's kind ("generate", "embed" or
"both") says which requests may name it; embedding adapters loaded as `model.embedding_adapters` are "embed",
and the first of them is the default embedding."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

POOLING_TYPES = ("mean", "weighted_mean", "cls", "first", "last", "all")
INPUT_TYPES = ("query", "document")  # what an embedding input is, for models that format the two differently
MAX_LOGPROBS = 20  # top tokens per position (OpenAI's chat limit)
MAX_HOLD_KV_S = 600.0  # the longest a finished generation's KV is held for its continuation


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a generation may say, enforced token by token in the sampler (vLLM's
    `StructuredOutputsParams`). Exactly one of:

    `json`: a JSON schema (dict, or its JSON text) the output must validate against;
    `json_object`: any JSON object;
    `regex`: a regular expression the whole output must match (Rust `regex` syntax, as llguidance reads it);
    `choice`: one of these strings, exactly;
    `grammar`: a Lark grammar (llguidance's dialect).

    `whitespace_flexible`: JSON may put any whitespace between tokens; off (the default) it is written compactly
    (`{"a": 1, "b": [2, 3]}`): a small model given free whitespace can fill its whole budget with it.
    `close_on_length` (on by default): as the token budget (`max_tokens`, or the model's length) runs out, the
    output is closed (open string, objects and arrays closed, missing required keys written minimally) so that it
    still parses; `finish_reason` stays "length". Off: the output is cut wherever the budget ends
    (orthrus_rag/structured/budget.py).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False
    close_on_length: bool = True

    def __post_init__(self) -> None:
        for name in ("whitespace_flexible", "close_on_length"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be true or false, got {getattr(self, name)!r}")
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(self.json).__name__}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice) \
                    or not self.choice:
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def as_request(self) -> dict[str, Any]:
        """The constraint as vLLM's `structured_outputs` request field (what the server reads back)."""
        value: Any = getattr(self, self.kind)
        body = {self.kind: list(value) if self.kind == "choice" else value}
        if self.whitespace_flexible:
            body["whitespace_flexible"] = True
        if not self.close_on_length:
            body["close_on_length"] = False
        return body

    @property
    def key(self) -> str:
        """What identifies the compiled grammar (the compiler's cache key; `close_on_length` does not change it)."""
        value: Any = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.whitespace_flexible], sort_keys=True)


@dataclass
class SamplingParams:
    """How a generation request samples its tokens (vLLM semantics)."""

    max_tokens: int = 16
    # at least this many tokens before EOS, a stop token id or a stop string may end the output (vLLM's field):
    # those tokens are masked out of sampling until then, and stop strings are not looked for
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    priority: int = 0  # lower runs sooner (vLLM's convention); < 0 latency-critical, > 0 bulk: PoolingParams.priority
    # None: no log-probabilities; k >= 0: each sampled token's log-probability and the k best at its position,
    # taken by the sampler in the step that samples the token
    logprobs: int | None = None
    # None: none; k >= 0: each prompt token's log-probability given the tokens before it (the first has none), its
    # rank, and the k best at its position, from the prefill steps' own rows (vLLM's field; a perplexity is
    # exp(-mean)). Such a request computes its whole prompt: no prefix-cache hit skips part of it
    prompt_logprobs: int | None = None
    # a constraint on the output, applied as a token mask before sampling (orthrus_rag/structured/)
    structured_outputs: StructuredOutputsParams | None = None
    # a loaded LoRA adapter that generates (`model.adapters`), applied to this request's rows in every step, prompt
    # chunks and decodes alike; None: the base model
    adapter: str | None = None
    # seconds the engine keeps this generation's KV after it finishes, for `continue_` (a search round's results
    # or a chat's next turn appended); 0: not continuable. Bounded: at most MAX_HOLD_KV_S, and released earlier
    # when running requests need the blocks (engine/continuation.py)
    hold_kv_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        # NOTE: NaN passes every comparison below (NaN < 0 is False): refuse it first, before it reaches a step
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature}")
        if not math.isfinite(self.top_p):
            raise ValueError(f"top_p must be a finite number, got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (isinstance(self.hold_kv_s, (int, float)) and 0 <= self.hold_kv_s <= MAX_HOLD_KV_S):
            raise ValueError(f"hold_kv_s must be between 0 and {MAX_HOLD_KV_S} seconds, got {self.hold_kv_s!r}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS} (top tokens per position), "
                             f"got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS} (top tokens per position), "
                             f"got {self.prompt_logprobs}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise TypeError("structured_outputs must be a StructuredOutputsParams, got "
                                f"{type(self.structured_outputs).__name__}")
            if self.ignore_eos:
                # NOTE: the grammar ends an output by allowing only EOS; ignoring it would run past the grammar
                raise ValueError("ignore_eos cannot be combined with structured_outputs")
            if self.min_tokens:
                # NOTE: a grammar that is complete allows only EOS, which min_tokens would mask out
                raise ValueError("min_tokens cannot be combined with structured_outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def held_token_ids(self, eos_token_ids: Collection[int]) -> list[int]:
        """The tokens kept out of sampling while fewer than `min_tokens` are out: every token that would stop the
        output (EOS unless `ignore_eos`, and the stop token ids)."""
        return sorted(set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids)))


@dataclass
class PoolingParams:
    """How an embedding request pools its hidden states.

    `pooling`: mean | weighted_mean | cls | first | last | all.
    `weights`: caller-given per-token weights for `weighted_mean` (default: SGPT position weights t = 1..n).
    `head`: deterministic function applied to the pooled result at the end, before normalisation (the [n, d]
    hidden states for `all`, the [d] vector otherwise; e.g. a reranker's scoring head on the [CLS] or last row).
    `instruction`: text prefixed to the input (query instructions, e.g. e5's "query: ").
    `append_eos`: append the tokenizer's EOS before pooling (e5-mistral style `last` pooling); default: only
    for `last`.
    `end_token`: the token appended instead of the tokenizer's EOS (e.g. Qwen3-Embedding's "<|endoftext|>", whose
    tokenizer's EOS is "<|im_end|>"); not appended twice when the input already ends with it.
    `adapter`: name of a loaded LoRA adapter; None picks the engine's default embedding adapter (or the separate
    encoder); "" (`engine.routing.NO_ADAPTER`) the bare decoder backbone.
    `truncate`: cut an input longer than the model's maximum (as sentence-transformers does) instead of
    refusing it.
    `priority`: lower runs sooner (vLLM's convention). Below 0 marks latency-critical work, such as the query
    embedding a multi-hop chain waits on: the `orthrus` policy serves it before splitting the rest of a step.
    Above 0 marks bulk work, such as documents ingested while serving: under every policy it runs only on the
    budget (and sequence slots) that the other work leaves, so it never delays them; while they saturate every
    step, it waits.
    `input_type`: "query" or "document" (Cohere's and Voyage's name): an embedding adapter whose card names a
    prefix for that kind of input (`orthrus_embedding.json`, as the shipped `smollm2_embed`) gets it from the
    engine, unless `instruction` is given; other models ignore it.
    """

    pooling: str = "mean"
    normalize: bool = True
    weights: Sequence[float] | None = None
    head: Callable[[torch.Tensor], torch.Tensor] | None = None
    instruction: str | None = None
    append_eos: bool | None = None
    end_token: str | None = None
    adapter: str | None = None
    truncate: bool = False
    priority: int = 0
    input_type: str | None = None

    def __post_init__(self) -> None:
        if self.input_type is not None and self.input_type not in INPUT_TYPES:
            raise ValueError(f"unknown input_type {self.input_type!r}; expected one of {', '.join(INPUT_TYPES)}")
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"unknown pooling type {self.pooling!r}; expected one of {', '.join(POOLING_TYPES)}")
        if self.weights is not None and self.pooling != "weighted_mean":
            raise ValueError("weights are only used with pooling='weighted_mean'")
        if self.weights is not None:
            bad = [w for w in self.weights if not math.isfinite(float(w))]
            if bad:
                raise ValueError(f"pooling weights must be finite numbers, got {bad[:3]}")
        if self.end_token is not None and not self.wants_eos:
            raise ValueError("end_token is the token appended for last pooling; it needs append_eos "
                             "(the default for pooling='last')")

    @property
    def wants_eos(self) -> bool:
        return self.append_eos if self.append_eos is not None else self.pooling == "last"

MAX_RERANK_DOCUMENTS = 1000  # documents one rerank call scores (Cohere's limit)


@dataclass(frozen=True)
class RerankParams:
    """How a (query, document) pair is scored (engine/rerankers.py).

    `reranker`: a loaded reranker's name (`model.rerankers`); None: the first one loaded.
    `instruction`: an LLM reranker's task line (Qwen3-Reranker's `<Instruct>`); None: its default. A cross-encoder
    has none, and refuses one.
    `truncate`: cut the document so the pair fits the reranker's maximum length (sentence-transformers and Cohere
    do); False: a pair that does not fit is refused.
    `priority`: as `PoolingParams.priority` (below 0 latency-critical, above 0 bulk).
    """

    reranker: str | None = None
    instruction: str | None = None
    truncate: bool = True
    priority: int = 0

    def __post_init__(self) -> None:
        if self.instruction is not None and not self.instruction.strip():
            raise ValueError("a rerank instruction must not be empty; leave it out for the reranker's default")


NO_ADAPTER = ""  # `PoolingParams.adapter` naming the bare backbone (e.g. to score tokens), past any encoder


@dataclass(frozen=True)
class EmbeddingRoute:
    on_encoder: bool
    adapter: str | None = None  # a loaded LoRA adapter's name (backbone only)
    slot: int = 0  # the adapter's slot in the backbone; 0: no adapter

    @property
    def name(self) -> str:
        """"encoder", "decoder" or "decoder+<adapter>"."""
        if self.on_encoder:
            return "encoder"
        return f"decoder+{self.adapter}" if self.adapter else "decoder"


def pairs_of(query: str, documents: Sequence[str]) -> list[tuple[str, str]]:
    """A rerank call's (query, document) pairs; one string as `documents` would be read letter by letter."""
    if isinstance(documents, str):
        raise TypeError("documents must be a list of strings, not one string")
    return [(query, doc) for doc in documents]


def is_bulk(params: SamplingParams | PoolingParams | None) -> bool:
    """Whether a request of `params` is bulk work (priority above 0, e.g. a corpus ingest): what the scheduler runs
    only on the budget other work leaves, and what a front end counts against its bulk in-flight limit."""
    return getattr(params, "priority", 0) > 0


def _can(kinds: Mapping[str, str], name: str, kind: str) -> bool:
    return kinds.get(name, "embed") in (kind, "both")  # NOTE: a slot without a kind is an embedding adapter


def route_embedding(params: PoolingParams | None, has_encoder: bool, adapter_slots: Mapping[str, int],
                    adapter_kinds: Mapping[str, str] | None = None) -> EmbeddingRoute:
    """The encoder when there is one and `params` name no adapter; else the backbone with the named adapter, or
    the first embedding-only one (the default embedding adapter), or none. An unknown adapter, or one that only
    generates, is a ValueError."""
    kinds = adapter_kinds or {}
    adapter = params.adapter if params is not None else None
    if adapter == NO_ADAPTER:
        return EmbeddingRoute(on_encoder=False)
    if has_encoder and adapter is None:
        return EmbeddingRoute(on_encoder=True)
    name = adapter or next((n for n in adapter_slots if kinds.get(n, "embed") == "embed"), None)
    if name is None:
        return EmbeddingRoute(on_encoder=False)
    if name not in adapter_slots:
        raise ValueError(f"unknown adapter {name!r}; loaded: {sorted(adapter_slots) or 'none'}")
    if not _can(kinds, name, "embed"):
        embedders = sorted(n for n in adapter_slots if _can(kinds, n, "embed"))
        raise ValueError(f"adapter {name!r} generates only; embedding adapters: {embedders or 'none'}")
    return EmbeddingRoute(on_encoder=False, adapter=name, slot=adapter_slots[name])


def generation_slot(adapter: str | None, adapter_slots: Mapping[str, int],
                    adapter_kinds: Mapping[str, str] | None = None) -> int:
    """The slot a generation runs under: 0 (the base model) for None; an unknown adapter, or one that only
    embeds, is a ValueError naming the generation adapters."""
    if adapter is None:
        return 0
    kinds = adapter_kinds or {}
    generators = sorted(n for n in adapter_slots if _can(kinds, n, "generate"))
    if adapter not in adapter_slots:
        raise ValueError(f"unknown adapter {adapter!r}; generation adapters: {generators or 'none'}")
    if not _can(kinds, adapter, "generate"):
        raise ValueError(f"adapter {adapter!r} embeds only; generation adapters: {generators or 'none'}")
    return adapter_slots[adapter]


@dataclass(frozen=True)
class EmbeddingSpace:
    """Who computes a client's embeddings and with what: part of an index's identity.

    `kind` is "engine" for this project's engine in any deployment (its vectors are the same in-process or in a
    worker) or a peer's name. `adapter_slots` names the loaded LoRA adapters in load order (slots from 1);
    `encoder_pooling` is the separate encoder's own pooling ({} when embeddings come from the backbone)."""

    model: str
    embedding_model: str | None = None
    adapters: tuple[str, ...] = ()  # the adapter folders as configured (what the identity records)
    adapter_slots: Mapping[str, int] = field(default_factory=dict)
    encoder_pooling: Mapping[str, Any] = field(default_factory=dict)
    kind: str = "engine"
    hidden_size: int | None = None  # the backbone's width, where known without asking (in-process)
    encoder_hidden_size: int | None = None
    adapter_kinds: Mapping[str, str] = field(default_factory=dict)  # name -> generate | embed | both
    # name -> {"query": prefix, "document": prefix}: an embedding adapter's card (embedding_formats.py)
    adapter_prefixes: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    @property
    def has_encoder(self) -> bool:
        return self.embedding_model is not None

    def route(self, params: PoolingParams | None) -> EmbeddingRoute:
        """Where `params` embed: `route_embedding` (above) is the one owner of that rule."""
        return route_embedding(params, self.has_encoder, self.adapter_slots, self.adapter_kinds)

    def formatted(self, params: PoolingParams, route: EmbeddingRoute | None = None) -> PoolingParams:
        """`params` with the prefix that its adapter's card names for its `input_type` (the engine applies it, so
        callers pass the bare query or document); unchanged with an `instruction` given, no input type, or no
        card. Idempotent: the filled-in prefix is an instruction. `route`: `params`' route, when known already."""
        if params.input_type is None or params.instruction is not None:
            return params
        route = route or self.route(params)
        prefix = None if route.on_encoder else self.adapter_prefixes.get(route.adapter or "", {}).get(params.input_type)
        return replace(params, instruction=prefix) if prefix else params

    def embedding_adapters(self) -> list[str]:
        """The loaded adapters an embedding may name, in load order."""
        return [n for n in self.adapter_slots if _can(self.adapter_kinds, n, "embed")]

    def generation_adapters(self) -> list[str]:
        """The loaded adapters a generation may name, in load order."""
        return [n for n in self.adapter_slots if _can(self.adapter_kinds, n, "generate")]

    def generation_slot(self, adapter: str | None) -> int:
        return generation_slot(adapter, self.adapter_slots, self.adapter_kinds)

    def dimension(self, route: EmbeddingRoute) -> int | None:
        """The width of the states `route` pools (None where unknown here: ask the client with one text)."""
        return self.encoder_hidden_size if route.on_encoder else self.hidden_size

    def default_pooling(self) -> PoolingParams:
        """The pooling of an embedding submitted without params: the encoder's own, else mean + L2."""
        return PoolingParams(**dict(self.encoder_pooling)) if self.has_encoder else PoolingParams()
