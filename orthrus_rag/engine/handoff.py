"""Prefill/decode disaggregation: a generating request handed from one engine to another with its KV cache.

An engine asked to hand a request off (`Engine.add_generate(..., handoff=True)`) stops it once its prompt is
computed and its first token sampled, and returns a `HandoffOutput`; another engine on the same model takes it
over with `Engine.add_prefilled(handoff)` and keeps decoding from that KV, without recomputing the prompt.
"""

from __future__ import annotations

import torch

from orthrus_rag.outputs import HandoffOutput

__all__ = ["HandoffOutput", "restore_generator"]


def restore_generator(state: torch.Tensor | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator continuing exactly where the handing-off engine's left off (None for unseeded requests)."""
    if state is None:
        return None
    generator = torch.Generator(device=device)
    generator.set_state(state)
    return generator
