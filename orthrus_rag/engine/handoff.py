"""Prefill/decode disaggregation: a generating request handed from one engine to another with its KV cache.

An engine asked to hand a request off (`Engine.add_generate(..., handoff=True)`) stops it once its prompt is
computed and its first token sampled, and returns a `HandoffOutput`; another engine on the same model takes it
over with `Engine.add_prefilled(handoff)` and keeps decoding from that KV, without recomputing the prompt.
"""

from __future__ import annotations

import logging
import time

import torch

from orthrus_rag.engine.core.request import Request, RequestKind
from orthrus_rag.outputs import HandoffOutput, RequestMetrics

__all__ = ["HandoffOutput", "Handoffs", "restore_generator"]

logger = logging.getLogger(__name__)


def restore_generator(state: torch.Tensor | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator continuing exactly where the handing-off engine's left off (None for unseeded requests)."""
    if state is None:
        return None
    generator = torch.Generator(device=device)
    generator.set_state(state)
    return generator


class Handoffs:
    """Mixed into `Engine` (engine.py): both ends of a handoff, on its `inputs`, `scheduler`, `runner`, `_matcher`
    and `_add`. The engine's step calls `_hand_off` for a request marked `handoff` once its first token is in."""

    def add_prefilled(self, handoff: HandoffOutput, request_id: str | None = None) -> str:
        """Continue a generation another engine on the same model prefilled: its KV goes into this engine's
        cache and it decodes from the next step on. Without free blocks now it is queued for recompute instead
        (same tokens, just slower)."""
        prompt = self.inputs.prompt(handoff.prompt_token_ids)
        if not handoff.output_token_ids:
            raise ValueError("a handed-off request needs its first sampled token")
        req = Request(request_id or handoff.request_id, RequestKind.GENERATE, prompt,
                      sampling_params=handoff.sampling_params, output_token_ids=list(handoff.output_token_ids),
                      output_text=handoff.output_text, output_logprobs=list(handoff.output_logprobs),
                      rng=restore_generator(handoff.generator_state, self.config.model.device),
                      grammar=self._matcher(handoff.sampling_params, len(prompt), handoff.output_token_ids),
                      adapter_slot=self.embedding_space.generation_slot(handoff.sampling_params.adapter))
        if handoff.metrics is not None:
            req.arrival_time = handoff.metrics.arrival_time
            req.first_scheduled_time = handoff.metrics.first_scheduled_time
            req.first_token_time = handoff.metrics.first_token_time
        if req.req_id in self.scheduler.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        req.num_computed_tokens = handoff.num_computed_tokens
        if not self.scheduler.reserve_blocks(req):
            logger.debug("no free KV blocks for handed-off request %s; queueing it for recompute", req.req_id)
            req.num_computed_tokens = 0
            return self._add(req)
        try:
            self.runner.write_kv(req, *handoff.kv)
        except ValueError:
            self.scheduler.remove(req)
            raise
        self.scheduler.add_running(req)
        return req.req_id

    def _hand_off(self, req: Request) -> HandoffOutput:
        """Stop `req` after its first token: copy its KV out, free its blocks, return what another engine needs."""
        kv = self.runner.read_kv(req)
        self.scheduler.release(req, time.monotonic())
        assert req.sampling_params is not None
        return HandoffOutput(
            req.req_id, req.prompt_token_ids, list(req.output_token_ids), req.output_text, kv, req.sampling_params,
            req.rng.get_state() if req.rng is not None else None,
            RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time, None),
            output_logprobs=list(req.output_logprobs))
