"""Prefill/decode disaggregation: a generating request handed from one engine to another with its KV cache.

An engine asked to hand a request off (`Engine.add_generate(..., handoff=True)`) stops it once its prompt is
computed and its first token sampled, and returns a `HandoffOutput`; another engine on the same model takes it
over with `Engine.add_prefilled(handoff)` and keeps decoding from that KV, without recomputing the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from orthrus_rag.outputs import RequestMetrics
from orthrus_rag.params import SamplingParams


@dataclass
class HandoffOutput:
    """A generating request whose prompt is done, ready to continue on another engine.

    `kv` is (K, V), each [num_layers, num_tokens, num_kv_heads, head_dim] on the CPU, for the request's computed
    tokens (the prompt; the last output token is not computed yet). `finished` is True because the engine that
    returned it is done with it (its blocks are free); the request itself is not finished.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_text: str
    kv: tuple[torch.Tensor, torch.Tensor]
    sampling_params: SamplingParams
    generator_state: torch.Tensor | None = None  # torch.Generator.get_state() of a seeded request
    metrics: RequestMetrics | None = None
    finished: bool = True
    output_logprobs: list = field(default_factory=list)  # TokenLogprob per output token, if asked for

    @property
    def num_computed_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) - 1


def restore_generator(state: torch.Tensor | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator continuing exactly where the handing-off engine's left off (None for unseeded requests)."""
    if state is None:
        return None
    generator = torch.Generator(device=device)
    generator.set_state(state)
    return generator
