"""What the engine hands back for each finished request."""

from __future__ import annotations

from dataclasses import dataclass

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
class EmbeddingOutput:
    request_id: str
    prompt_token_ids: list[int]
    embedding: torch.Tensor  # float32 [d] (or [n, d] for pooling="all" without a head)
    finish_reason: str | None = "stop"  # "error" when pooling failed (e.g. a caller's head raised)
    metrics: RequestMetrics | None = None
    finished: bool = True
    error: str | None = None
