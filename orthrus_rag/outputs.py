"""What the engine hands back: for each request (`EngineOutput` is any of them), and for each step (`StepStats`, what
its step observers get: how the token budget was split between the kinds of work, and what ran)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None

    @property
    def queueing_time(self) -> float | None:
        """Arrival to first scheduled step."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class TokenLogprob:
    """A sampled token's log-probability under the model's raw distribution (before temperature, top-k, top-p,
    as OpenAI reports it), and the `top` most likely tokens at that position (id, log-probability), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # 1 + how many tokens were likelier (prompt log-probabilities report it)


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", "abort"; None while streaming
    metrics: RequestMetrics | None = None
    finished: bool = True  # False: a streaming snapshot (token_ids and text so far)
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry when SamplingParams.logprobs is set
    # one per prompt token when SamplingParams.prompt_logprobs is set; the first is None (nothing precedes it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (vLLM's field): the rest were computed


@dataclass
class HandoffOutput:
    """A generating request whose prompt is done, ready to continue on another engine (engine/handoff.py).

    `kv` is (K, V), each [num_layers, num_tokens, num_kv_heads, head_dim] on the CPU, for the request's computed
    tokens (the prompt; the last output token is not computed yet). `finished` is True because the engine that
    returned it is done with it (its blocks are free); the request itself is not finished.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_text: str
    kv: tuple[torch.Tensor, torch.Tensor]
    sampling_params: Any  # SamplingParams
    generator_state: torch.Tensor | None = None  # torch.Generator.get_state() of a seeded request
    metrics: RequestMetrics | None = None
    finished: bool = True
    output_logprobs: list = field(default_factory=list)  # TokenLogprob per output token, if asked for

    @property
    def num_computed_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) - 1


@dataclass
class EmbeddingOutput:
    request_id: str
    prompt_token_ids: list[int]
    # float32 [d] ([n, d] for pooling="all" without a head; a scored pair's: [1], its relevance)
    embedding: torch.Tensor
    finish_reason: str | None = "stop"  # "error" when pooling failed (e.g. a caller's head raised)
    metrics: RequestMetrics | None = None
    finished: bool = True
    error: str | None = None


@dataclass
class ScoreOutput:
    """A scored (query, document) pair (`AsyncEngine.score_pairs`): its relevance in [0, 1] and its length in the
    reranker's tokens (what a server bills as usage)."""

    request_id: str
    score: float
    num_tokens: int
    metrics: RequestMetrics | None = None


def error_output(kind: str, request_id: str, message: str) -> GenerationOutput | EmbeddingOutput:
    """The final output of a request that failed as a whole (its step raised): finish_reason "error"."""
    if kind != "generate":  # an embedding, or a scored pair (pooled as one)
        return EmbeddingOutput(request_id, [], torch.empty(0), "error", error=message)
    return GenerationOutput(request_id, [], [], message, "error")


# what an engine step hands back: a generation (final, or a streaming snapshot), an embedding, or a handoff
EngineOutput = GenerationOutput | EmbeddingOutput | HandoffOutput


@dataclass
class StepStats:
    step: int
    num_embed_tokens: int  # decoder-backbone embedding chunks
    num_prefill_tokens: int  # generation prompt chunks (incl. recompute after preemption)
    num_decode_tokens: int
    num_encoder_tokens: int  # whole sequences on the separate encoder
    num_requests: int
    num_waiting: int
    num_running: int
    num_preempted: int
    kv_blocks_used: int
    step_time: float = 0.0
    # what the runner executed (the fields above are the scheduler's plan): rows of each kind in its decoder
    # forwards, and rows of the separate encoder's forward
    num_decoder_forwards: int = 0
    num_forward_embed_rows: int = 0
    num_forward_generate_rows: int = 0
    num_forward_encoder_rows: int = 0
    num_sampled_rows: int = 0  # generation rows the sampler drew a token for
    num_constrained_rows: int = 0  # of those, rows masked by a structured-output grammar first
    num_adapter_generate_rows: int = 0  # forward rows under a LoRA adapter, by kind
    num_adapter_embed_rows: int = 0
    num_adapters: int = 0  # distinct adapters with rows in the forward
    # prompt tokens this step's admissions found in the prefix cache (net of preempted ones' returned hits)
    num_prefix_hit_tokens: int = 0
    # latency targets (scheduler.slo): the kinds at risk when the step was shared, whether a target's time bound
    # cut the step below its token budget, how many decodes yielded to embeddings, and each sampled token's gap
    # since its request's previous token
    embed_at_risk: bool = False
    generate_at_risk: bool = False
    time_capped: bool = False
    num_yielded_decodes: int = 0  # decodes that sat out the step for an embedding at risk (slo.yield_decodes)
    decode_gaps: list[float] = field(default_factory=list)
    predicted_step_time: float | None = None  # the step-cost model's seconds for it as planned (None: no model)

    @property
    def is_mixed(self) -> bool:
        """The step's one decoder forward carried embedding and generation rows together (or the encoder ran
        beside a forward that carried generation rows): counted from what ran, not from the plan."""
        if self.num_forward_generate_rows == 0:
            return False
        same_forward = self.num_decoder_forwards == 1 and self.num_forward_embed_rows > 0
        return same_forward or self.num_forward_encoder_rows > 0

    @property
    def ran_as_scheduled(self) -> bool:
        """Every planned token ran, in one decoder forward (if any) and the encoder's."""
        planned = self.num_embed_tokens + self.num_prefill_tokens + self.num_decode_tokens
        return (self.num_decoder_forwards == int(planned > 0) and self.num_forward_embed_rows == self.num_embed_tokens
                and self.num_forward_generate_rows == self.num_prefill_tokens + self.num_decode_tokens
                and self.num_forward_encoder_rows == self.num_encoder_tokens)

    def record_execution(self, executed: Any) -> None:
        """Copy what the runner executed (its RunnerOutput's row counts)."""
        self.num_decoder_forwards = executed.num_decoder_forwards
        self.num_forward_embed_rows = executed.num_embed_rows
        self.num_forward_generate_rows = executed.num_generate_rows
        self.num_forward_encoder_rows = executed.num_encoder_rows
        self.num_sampled_rows = executed.num_sampled_rows
        self.num_constrained_rows = executed.num_constrained_rows
        self.num_adapter_generate_rows = executed.num_adapter_generate_rows
        self.num_adapter_embed_rows = executed.num_adapter_embed_rows
        self.num_adapters = executed.num_adapters
