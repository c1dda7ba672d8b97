"""Paged attention over one flat token batch: a backend-neutral step description (`AttentionMetadata`) and
backends that compute it. A backend is a module-like object with `plan(meta, windows)` (once per step: index
tensors and masks every layer reuses) and `forward(q, k, v, k_cache, v_cache, meta, scale, window)` (per layer).

- `grouped`: padded groups of similar sequences, one SDPA each (CPU; any device).
- `reference`: one SDPA per sequence (tests).
- `varlen`: flash varlen attention on CUDA (orthrus_rag.layers.attention.varlen), where torch has it.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from orthrus_rag.layers.attention import grouped, reference
from orthrus_rag.layers.attention.metadata import AttentionMetadata, build_metadata, key_slots

logger = logging.getLogger(__name__)
BACKENDS = ("auto", "grouped", "reference", "varlen")

__all__ = ["AttentionMetadata", "BACKENDS", "build_metadata", "key_slots", "select_backend"]


def select_backend(name: str, device: torch.device) -> ModuleType:
    """The attention backend for `device`: `auto` picks varlen flash attention on CUDA when torch has it, else
    grouped SDPA."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKENDS)}")
    if name == "reference":
        return reference
    if name in ("auto", "varlen") and device.type == "cuda":
        from orthrus_rag.layers.attention import varlen

        if varlen.available():
            return varlen
        if name == "varlen":
            raise ValueError("attention backend 'varlen' needs torch.nn.attention.varlen (CUDA, torch >= 2.10)")
        logger.warning("torch.nn.attention.varlen is not available; using grouped SDPA on %s", device)
    elif name == "varlen":
        raise ValueError(f"attention backend 'varlen' runs on CUDA only, not on {device}")
    return grouped
