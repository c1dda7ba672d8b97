"""Paged attention over one flat token batch: a backend-neutral step description (`AttentionMetadata`) and
backends that compute it. A backend is a module-like object with `plan(meta, windows)` (once per step: index
tensors and masks every layer reuses) and `forward(q, k, v, k_cache, v_cache, meta, scale, window)` (per layer).

- `grouped`: padded groups of similar sequences, one SDPA each (CPU; any device, any dtype: the fallback).
- `varlen`: flash varlen attention on CUDA (orthrus_rag.layers.attention.varlen), where its kernel takes the
  model's dtype, head size and windows.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from orthrus_rag.layers.attention import grouped, varlen
from orthrus_rag.layers.context import AttentionMetadata, build_metadata, key_slots

logger = logging.getLogger(__name__)
BACKENDS = ("auto", "grouped", "varlen")

__all__ = ["AttentionMetadata", "BACKENDS", "build_metadata", "key_slots", "select_backend"]


def select_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                   head_dim: int = 64) -> ModuleType:
    """The attention backend for a model in `dtype` with `head_dim` on `device` (sliding windows never decide
    it: both backends take any).

    `auto` takes varlen flash attention where its kernel supports the case (varlen.unsupported) and grouped SDPA,
    which runs everywhere, otherwise: fp32 on CUDA therefore runs, just without flash. An explicit `varlen` that
    cannot run is a ValueError at start-up, not a failed first step."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKENDS)}")
    if name == "grouped":
        return grouped
    why_not = varlen.unsupported(device, dtype, head_dim)
    if why_not is None:
        return varlen
    if name == "varlen":
        raise ValueError(f"attention backend 'varlen' cannot run here: {why_not}; use 'auto' or 'grouped'")
    if device.type == "cuda":  # NOTE: on CPU grouped is simply the backend; on CUDA it is a slower fallback
        logger.info("attention: grouped SDPA on %s (%s)", device, why_not)
    return grouped
