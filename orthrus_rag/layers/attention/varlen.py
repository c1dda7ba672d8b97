"""Flash varlen attention on CUDA (`torch.nn.attention.varlen.varlen_attn`): one kernel per layer for the whole
step, cost Σ over sequences of (new tokens x keys).

torch exposes it from 2.10 on; its arguments grew: 2.11 takes (query, key, value, cu_seq_q, cu_seq_k, max_q,
max_k, *, scale, window_size), 2.13 adds `enable_gqa`, `seqused_k` and `block_table`. This backend gathers each
sequence's keys from the paged cache into one packed [Σ keys, KVH, D] tensor (one `index_select` per tensor,
indices planned once per step) and passes cumulative key lengths, which every version takes; KV heads are
expanded where `enable_gqa` is missing. Causal masking is flash attention's bottom-right aligned one
(`window_size=(-1, 0)`): query j of a sequence with n new and L keys sees keys up to L - n + j, which is what a
chunk after a cached prefix needs. A sliding window W is `window_size=(W - 1, 0)`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache

import torch

from orthrus_rag.layers.attention.metadata import AttentionMetadata, key_slots


@lru_cache(maxsize=1)
def _varlen_attn():  # -> the function, or None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def available() -> bool:
    return _varlen_attn() is not None and torch.cuda.is_available()


@lru_cache(maxsize=1)
def takes_gqa() -> bool:
    fn = _varlen_attn()
    return fn is not None and "enable_gqa" in inspect.signature(fn).parameters


@dataclass
class VarlenPlan:
    key_slots: torch.Tensor  # [Σ keys] cache slots, sequence after sequence
    cu_seq_k: torch.Tensor  # [S + 1] int32
    max_q: int
    max_k: int


def plan(meta: AttentionMetadata, windows: set[int | None]) -> VarlenPlan:
    seqs = list(range(meta.num_seqs))
    width = meta.max_seq_len
    slots = key_slots(meta, seqs, width)  # [S, width], padded past each sequence's end
    valid = torch.arange(width, device=slots.device)[None, :] < meta.seq_lens[:, None]
    cu_seq_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=slots.device)
    cu_seq_k[1:] = torch.cumsum(meta.seq_lens, 0)
    return VarlenPlan(slots[valid], cu_seq_k, meta.max_query_len, width)


def window_size(window: int | None) -> tuple[int, int]:
    """flash attention's (left, right): causal, and at most `window` keys back including the query's own."""
    return (-1, 0) if window is None else (window - 1, 0)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    p: VarlenPlan = meta.plan
    keys, values = k_cache.index_select(0, p.key_slots), v_cache.index_select(0, p.key_slots)
    extra = {}
    if q.shape[1] != keys.shape[1]:
        if takes_gqa():
            extra["enable_gqa"] = True
        else:  # torch 2.11: expand KV heads to the query heads (HF's repeat_kv order)
            reps = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(reps, dim=1), values.repeat_interleave(reps, dim=1)
    return _varlen_attn()(q, keys, values, meta.query_start_loc, p.cu_seq_k, p.max_q, p.max_k, scale=scale,
                          window_size=window_size(window), **extra)
