"""Per-step forward context: what every layer of one forward pass needs besides its input.

The runner builds it once per step; attention layers read the attention metadata, the backend that computes
it and their layer's KV cache, and LoRA layers read which token rows belong to which adapter. A thread-local slot (as nano-vllm's global context) keeps layer signatures
plain.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardContext:
    attn: Any = None  # orthrus_rag.layers.attention.AttentionMetadata, with its backend's plan
    attn_backend: Any = None  # the module computing it (orthrus_rag.layers.attention: grouped, varlen, ...)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (K, V) per layer
    # (adapter slot >= 1, row indices of the flat batch that use it); rows of slot 0 use the base weights
    lora_rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # the same rows as one list, with each row's slot: what the stacked LoRA product reads (None: build it)
    lora_flat: tuple[torch.Tensor, torch.Tensor] | None = None
    # the stacked product's [rows, sum r] masks, per set of adapters a module carries (built once per step)
    lora_masks: dict[tuple, torch.Tensor] = field(default_factory=dict)


_LOCAL = threading.local()  # per thread: engine loops in different threads never see each other's step


def get_forward_context() -> ForwardContext:
    ctx = getattr(_LOCAL, "ctx", None)
    return ctx if ctx is not None else ForwardContext()


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    previous, _LOCAL.ctx = getattr(_LOCAL, "ctx", None), ctx
    try:
        yield ctx
    finally:
        _LOCAL.ctx = previous
