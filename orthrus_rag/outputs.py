"""What the engine hands back for each request: `EngineOutput` is any of them."""

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
    embedding: torch.Tensor  # float32 [d] (or [n, d] for pooling="all" without a head)
    finish_reason: str | None = "stop"  # "error" when pooling failed (e.g. a caller's head raised)
    metrics: RequestMetrics | None = None
    finished: bool = True
    error: str | None = None


def error_output(kind: str, request_id: str, message: str) -> GenerationOutput | EmbeddingOutput:
    """The final output of a request that failed as a whole (its step raised): finish_reason "error"."""
    if kind == "embed":
        return EmbeddingOutput(request_id, [], torch.empty(0), "error", error=message)
    return GenerationOutput(request_id, [], [], message, "error")


# what an engine step hands back: a generation (final, or a streaming snapshot), an embedding, or a handoff
EngineOutput = GenerationOutput | EmbeddingOutput | HandoffOutput
