"""Paged attention over one flat token batch (CPU backend: packed SDPA with a block-diagonal causal mask).

Two groups per step, because their shapes differ:
- packed: sequences with several new tokens (prompt chunks, embedding chunks). Keys are the cached tokens
  gathered from the paged cache plus this step's new tokens; one SDPA call over the packed rows with a
  block-diagonal causal mask. New keys come straight from this step's K, so an embedding's final chunk needs
  no cache writes at all.
- decode: sequences with one new token. Padded [B, L] gather from the cache and one batched SDPA; packing
  these into the block-diagonal mask would cost T x (sum of all context lengths).
Masks depend only on the batch, so the runner builds them once per step and every layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PackedGroup:
    rows: torch.Tensor  # [Tq] rows of the flat batch
    cached_slots: torch.Tensor  # [Kc] cache slots of earlier tokens, keys ordered [cached..., new...]
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> [Tq, Kc + Tq] bool


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [B]
    slots: torch.Tensor  # [B, L] cache slots of every token incl. the new one (padding: slot 0, masked)
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> [B, 1, 1, L] bool


@dataclass
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [T] where each new token's K/V go; -1: not written
    packed: PackedGroup | None = None
    decode: DecodeGroup | None = None
    # rows whose K/V are written and their slots, derived once per step (not once per layer)
    write_rows: torch.Tensor | None = field(init=False, default=None)
    write_slots: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        rows = (self.slot_mapping >= 0).nonzero().flatten()
        if rows.numel() < self.slot_mapping.numel():
            self.write_rows, self.write_slots = rows, self.slot_mapping.index_select(0, rows)
        else:  # every row writes: plain copies, no gather
            self.write_slots = self.slot_mapping


def _window_ok(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor | None:
    return None if window is None else k_pos > q_pos - window


def build_packed_group(rows: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor, cached_slots: torch.Tensor,
                       k_seq_cached: torch.Tensor, k_pos_cached: torch.Tensor,
                       windows: set[int | None]) -> PackedGroup:
    k_seq = torch.cat([k_seq_cached, q_seq])
    k_pos = torch.cat([k_pos_cached, q_pos])
    base = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    masks: dict[int | None, torch.Tensor] = {}
    for window in windows:
        ok = _window_ok(q_pos[:, None], k_pos[None, :], window)
        masks[window] = base if ok is None else base & ok
    return PackedGroup(rows=rows, cached_slots=cached_slots, masks=masks)


def build_decode_group(rows: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                       windows: set[int | None]) -> DecodeGroup:
    k_pos = torch.arange(slots.shape[1], device=slots.device)[None, :]
    q_pos = (seq_lens - 1)[:, None]
    base = k_pos <= q_pos
    masks: dict[int | None, torch.Tensor] = {}
    for window in windows:
        ok = _window_ok(q_pos, k_pos, window)
        masks[window] = (base if ok is None else base & ok)[:, None, None, :]
    return DecodeGroup(rows=rows, slots=slots, masks=masks)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] for this step's tokens; caches [num_slots, KVH, D]. Returns [T, H, D]."""
    if meta.write_rows is None:
        k_cache.index_copy_(0, meta.write_slots, k)
        v_cache.index_copy_(0, meta.write_slots, v)
    elif meta.write_rows.numel():
        k_cache.index_copy_(0, meta.write_slots, k.index_select(0, meta.write_rows))
        v_cache.index_copy_(0, meta.write_slots, v.index_select(0, meta.write_rows))
    out = torch.empty_like(q)
    if meta.packed is not None:
        g = meta.packed
        q_p = q.index_select(0, g.rows)
        k_p = torch.cat([k_cache.index_select(0, g.cached_slots), k.index_select(0, g.rows)])
        v_p = torch.cat([v_cache.index_select(0, g.cached_slots), v.index_select(0, g.rows)])
        o = F.scaled_dot_product_attention(q_p.transpose(0, 1)[None], k_p.transpose(0, 1)[None],
                                           v_p.transpose(0, 1)[None], attn_mask=g.masks[window], scale=scale,
                                           enable_gqa=True)
        out.index_copy_(0, g.rows, o[0].transpose(0, 1))
    if meta.decode is not None:
        g = meta.decode
        q_d = q.index_select(0, g.rows)[:, :, None, :]  # [B, H, 1, D]
        k_d = k_cache[g.slots].transpose(1, 2)  # [B, KVH, L, D]
        v_d = v_cache[g.slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(q_d, k_d, v_d, attn_mask=g.masks[window], scale=scale, enable_gqa=True)
        out.index_copy_(0, g.rows, o[:, :, 0, :])
    return out
