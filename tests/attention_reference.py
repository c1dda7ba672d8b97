"""Per-sequence SDPA: the reference every attention backend is tested against (slow: a call per sequence). A backend
module in form (`plan`, `forward`), kept with the tests: the engine never runs it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from orthrus_rag.layers.context import AttentionMetadata, key_slots


def plan(meta: AttentionMetadata, windows: set[int | None]) -> None:
    return None


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    start = 0
    for i, (n, c) in enumerate(zip(meta.query_lens, meta.context_lens)):
        slots = key_slots(meta, [i], c + n)[0]
        keys, values = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)  # [KVH, L, D]
        q_pos = torch.arange(c, c + n, device=q.device)[:, None]
        k_pos = torch.arange(c + n, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1), keys, values, attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[start:start + n] = o.transpose(0, 1)
        start += n
    return out
