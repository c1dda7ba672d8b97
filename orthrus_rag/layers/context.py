"""Per-step forward context: what every layer of one forward pass needs besides its input.

The runner builds it once per step (`ForwardContext`); attention layers read the attention metadata
(`AttentionMetadata`, below), the backend that computes it and their layer's KV cache, and LoRA layers read which
token rows belong to which adapter. A thread-local slot (as nano-vllm's global context) keeps layer signatures
plain.

The attention metadata: what one step's attention needs, whatever the backend computes it with.
A step is a flat batch of T token rows from S sequences; sequence i owns rows
`query_start_loc[i] : query_start_loc[i + 1]` (its `query_lens[i]` new tokens, at positions
`context_lens[i] ...`) and attends causally to its `seq_lens[i] = context_lens[i] + query_lens[i]` keys: the
cached ones, found through its block table, and the new ones. These are the inputs of varlen flash attention
(cumulative sequence lengths, block tables, `seqused_k`), so one description serves the CPU backend and the
CUDA one alike.

Every row's K/V is written to `slot_mapping[row]` before attention reads it. Rows whose K/V the cache does not
keep (an embedding's final chunk is never attended to again) get a *scratch* slot past the paged region
(`num_slots + row`): the write is a plain scatter of all T rows, and every key a sequence reads comes from one
place, the cache.
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
    attn: AttentionMetadata | None = None  # with its backend's plan
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


# ---- the attention metadata ---------------------------------------------------------------------------------
@dataclass
class AttentionMetadata:
    query_lens: list[int]  # new tokens per sequence (host copy: backends plan with it)
    context_lens: list[int]  # tokens already cached per sequence before this step (host copy)
    query_start_loc: torch.Tensor  # [S + 1] int32 on the device: cu_seqlens_q
    seq_lens: torch.Tensor  # [S] int32 on the device: keys per sequence (seqused_k)
    block_tables: torch.Tensor  # [S, max_blocks] int32 on the device, padded with block 0
    slot_mapping: torch.Tensor  # [T] int64 on the device: where each row's K/V is written (scratch: not kept)
    positions: torch.Tensor  # [T] int64 on the device: each row's position in its sequence (rotary input)
    block_size: int
    plan: Any = field(default=None)  # the backend's per-step precomputation (index tensors, masks)
    # CPU: decodes through the C++ kernel (attention/cpu_kernels.py); the runner sets it only where that is built
    decode_kernel: bool = False
    prefill_kernel: bool = False  # CPU, bf16: chunks through the C++ kernel (attention/cpu_prefill.py)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return max((c + n for c, n in zip(self.context_lens, self.query_lens)), default=0)


def build_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                   keeps_kv: list[bool], block_size: int, num_slots: int, device: torch.device) -> AttentionMetadata:
    """The metadata of one step from per-sequence host lists (sequences in flat-batch order).

    `keeps_kv[i]`: whether sequence i's new K/V go to its blocks (else to scratch slots). Built with a handful of
    tensor ops for the whole step, not per sequence: contexts can be thousands of tokens long.
    """
    num_seqs = len(query_lens)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    width = max((len(t) for t in block_tables), default=0) or 1
    # NOTE: one tensor from padded lists: a tensor per sequence cost ~3 us each (a decode step of 32 sequences)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32).reshape(num_seqs, width)
    num_tokens = starts[-1]
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(query_lens, dtype=torch.long),
                                         output_size=num_tokens)
    row = torch.arange(num_tokens)
    pos = row - torch.tensor(starts[:-1], dtype=torch.long)[seq_of_row] + torch.tensor(context_lens,
                                                                                      dtype=torch.long)[seq_of_row]
    block_idx = (pos // block_size).clamp(max=width - 1)
    paged = tables.long()[seq_of_row, block_idx] * block_size + pos % block_size
    keeps = torch.tensor(keeps_kv, dtype=torch.bool)[seq_of_row]
    slot_mapping = torch.where(keeps, paged, num_slots + row)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    return AttentionMetadata(
        query_lens=list(query_lens), context_lens=list(context_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), slot_mapping=slot_mapping.to(device), positions=pos.to(device),
        block_size=block_size)


def key_slots(meta: AttentionMetadata, seqs: list[int], width: int) -> torch.Tensor:
    """[len(seqs), width] cache slots of every key of the given sequences, position by position: cached keys
    through the block table, new keys where this step wrote them. Positions past a sequence's end hold some
    valid slot (callers mask them)."""
    dev = meta.slot_mapping.device
    idx = torch.tensor(seqs, dtype=torch.long, device=dev)
    ctx = torch.tensor([meta.context_lens[i] for i in seqs], dtype=torch.long, device=dev)[:, None]
    start = meta.query_start_loc.index_select(0, idx).long()[:, None]
    pos = torch.arange(width, device=dev)[None, :]
    tables = meta.block_tables.index_select(0, idx).long()
    block_idx = (pos // meta.block_size).clamp(max=tables.shape[1] - 1).expand(len(seqs), -1)
    cached = tables.gather(1, block_idx) * meta.block_size + pos % meta.block_size
    rows = (start + pos - ctx).clamp(0, meta.num_tokens - 1)
    return torch.where(pos < ctx, cached, meta.slot_mapping[rows])
