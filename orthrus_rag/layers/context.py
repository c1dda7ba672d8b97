"""Per-step forward context: what every layer of one forward pass needs besides its input.

The runner builds it once per step; attention layers read the attention metadata and LoRA layers read which
token rows belong to which adapter. A module-level slot (as in nano-vllm) keeps layer signatures plain.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardContext:
    attn: Any = None  # orthrus_rag.layers.attention.AttentionMetadata
    # (adapter slot >= 1, row indices of the flat batch that use it); rows of slot 0 use the base weights
    lora_rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    return _CONTEXT if _CONTEXT is not None else ForwardContext()


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = previous
