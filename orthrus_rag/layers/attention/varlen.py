"""Flash varlen attention on CUDA (`torch.nn.attention.varlen.varlen_attn`): one kernel per layer for the whole
step, cost Σ over sequences of (new tokens x keys).

It takes (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, enable_gqa) in torch 2.13,
the oldest torch the project supports. This backend gathers each sequence's keys from the paged cache into one
packed [Σ keys, KVH, D] tensor (one `index_select` per tensor, indices planned once per step) and passes
cumulative key lengths. Causal masking is flash attention's bottom-right aligned one
(`window_size=(-1, 0)`): query j of a sequence with n new and L keys sees keys up to L - n + j, which is what a
chunk after a cached prefix needs. A sliding window W is `window_size=(W - 1, 0)`.

What the kernel takes (`unsupported` says why not, and the backend choice falls back to grouped SDPA): CUDA,
fp16 / bf16 only (flash attention has no fp32 kernel), and a head size that is a multiple of 8 up to 256.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from orthrus_rag.layers.context import AttentionMetadata, key_slots


@lru_cache(maxsize=1)
def _varlen_attn():  # -> the function, or None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why this backend cannot run a model in `dtype` with `head_dim` on `device`, or None when it can."""
    if device.type != "cuda":
        return f"varlen flash attention runs on CUDA only, not on {device}"
    if _varlen_attn() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if dtype not in DTYPES:
        return f"flash attention takes float16 / bfloat16, not {dtype}"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"flash attention takes head sizes that are multiples of 8 up to {MAX_HEAD_DIM}, not {head_dim}"
    return None


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
    return _varlen_attn()(q, keys, values, meta.query_start_loc, p.cu_seq_k, p.max_q, p.max_k, scale=scale,
                          window_size=window_size(window), enable_gqa=q.shape[1] != keys.shape[1])
