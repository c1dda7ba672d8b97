"""A request's state inside the engine: one type for both kinds, no phases (vLLM v1 semantics)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from orthrus_rag.params import PoolingParams, SamplingParams, is_bulk


class RequestKind(enum.Enum):
    EMBED = "embed"
    GENERATE = "generate"
    # a (query, document) pair scored by a reranker: pooled like an embedding, through the reranker's scoring head
    # (engine/rerankers.py), so the scheduler and the runner treat it as one
    SCORE = "score"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)  # identity: requests live in queues that are searched with `in` / `remove`
class Request:
    """Tokens, computed tokens and a block table.

    A step assigns `num_new_tokens` so that `num_computed_tokens` catches up with `num_tokens`; a generating
    request whose prompt is done has exactly one uncomputed token (the last sampled one) each step.
    `on_encoder` marks an embedding request for a separate (bidirectional) encoder: it runs whole, on the encoder
    named `encoder` ("": the embedding model; a cross-encoder reranker's name), each token costing `token_cost`
    of the embedding model's (the step-cost model's encoder unit).
    """

    req_id: str
    kind: RequestKind
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None = None
    pooling_params: PoolingParams | None = None
    adapter_slot: int = 0  # 0: no adapter; i > 0: the i-th loaded LoRA adapter
    on_encoder: bool = False
    encoder: str = ""
    token_cost: float = 1.0
    token_type_ids: list[int] | None = None  # a cross-encoder pair's segments (query 0, document 1)
    keep_kv: bool = False  # a scored pair on the backbone of a prefix cache: all its KV is written and named
    stream: bool = False  # a generating request that reports every new token, not only its end
    handoff: bool = False  # hand it to another engine once its first token is sampled (engine/handoff.py)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Any] = field(default_factory=list)  # TokenLogprob per output token, if asked for
    prompt_logprobs: list[Any] = field(default_factory=list)  # TokenLogprob per prompt token from the second
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at its first admission (vLLM's field)
    # prefix caching (engine/core/block_manager.py): names of the sequence's full blocks so far, and how many of them
    # are registered
    block_names: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    # runtime state owned by the runner (pooler accumulators, RNG); opaque to the scheduler
    pooler_state: Any = None
    rng: Any = None  # a seeded request's torch.Generator (sampling); None: the global RNG
    grammar: Any = None  # a constrained request's matcher (orthrus_rag/structured/); advanced by the runner
    output_text: str = ""
    # timing, filled by the engine
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None  # when the latest output token was sampled (inter-token gaps)
    finished_time: float | None = None

    def __post_init__(self) -> None:
        # NOTE: a plain attribute, not a property: the scheduler asks it thousands of times per step. A scoring
        # request is embedding work: pooled, never sampled
        self.is_embed: bool = self.kind is not RequestKind.GENERATE

    @property
    def priority(self) -> int:
        """Lower runs sooner; below 0: latency-critical; above 0: bulk (params.py)."""
        params = self.pooling_params if self.is_embed else self.sampling_params
        return getattr(params, "priority", 0)

    @property
    def is_bulk(self) -> bool:
        """Background work (priority > 0, e.g. a corpus ingest): it takes only the budget other work leaves."""
        return is_bulk(self.pooling_params if self.is_embed else self.sampling_params)

    @property
    def is_continuable(self) -> bool:
        """A generation that finished by its own rules (not aborted, not failed) and asked for its KV to be held
        for a continuation (`SamplingParams.hold_kv_s`)."""
        return (self.status is RequestStatus.FINISHED and self.finish_reason in ("stop", "length")
                and self.sampling_params is not None and self.sampling_params.hold_kv_s > 0)

    @property
    def encoder_tokens(self) -> float:
        """Its tokens in the encoder unit the step costs are counted in (an encoder request's)."""
        return self.num_tokens * self.token_cost

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to be run through the model before this request can make progress."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole sequence (hot path)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    @property
    def is_decoding(self) -> bool:
        """A generating request with exactly its last sampled token to compute: one token per step.

        NOTE: not `num_computed_tokens >= num_prompt_tokens`: a request recomputing after preemption also has
        earlier output tokens to catch up on, and those go in chunks like a prompt."""
        return (self.kind is RequestKind.GENERATE and self.num_computed_tokens > 0
                and self.num_tokens - self.num_computed_tokens == 1 and bool(self.output_token_ids))

    def needs_kv(self, num_new_tokens: int) -> bool:
        """Whether the tokens of this step must be written to the KV cache.

        An embedding's final chunk is never attended to again, so it writes no KV; an embedding that fits in
        one chunk needs no blocks at all. A scored pair that `keep_kv` writes all of its KV: its blocks stay in the
        prefix cache by name, and a query's other candidates share the judging prompt and the query
        (block_manager.py). Encoder requests have no paged cache.
        """
        if self.on_encoder:
            return False
        if self.is_embed:
            return self.keep_kv or self.num_computed_tokens + num_new_tokens < self.num_tokens
        return True

    @property
    def shares_prefixes(self) -> bool:
        """Whether its computed blocks are named for the prefix cache and its prompt may start from cached ones:
        generations, and the scored pairs that keep their KV."""
        return self.kind is RequestKind.GENERATE or self.keep_kv

    def num_kv_tokens_after(self, num_new_tokens: int) -> int:
        """How many tokens must have KV slots once this step's tokens are written."""
        if not self.needs_kv(num_new_tokens):
            return self.num_computed_tokens
        return self.num_computed_tokens + num_new_tokens

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: forget the cache, keep the tokens (prompt and output so far)."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_registered_blocks = 0
        self.pooler_state = None
        self.status = RequestStatus.WAITING
        self.num_preemptions += 1
