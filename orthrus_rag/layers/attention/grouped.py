"""Grouped SDPA: attention whose cost is the sum over groups of (sequences x new tokens x keys), in torch ops.

The portable backend (CPU; also correct on any device). Sequences of similar shape are padded into a group and
one `scaled_dot_product_attention` call runs per group: queries [G, H, n_max, D] against that group's keys
[G, KVH, L_max, D], gathered from the cache with one `index_select` per tensor. A step of many short sequences
forms one group; one long prompt chunk with a cached prefix gets its own group instead of widening everyone's
keys (the earlier packed path ran one [T x all keys] SDPA with a block-diagonal mask, measured ~7x slower on
8 chunks of 32 tokens over 512 cached keys each). Groups, index tensors and masks are planned once per step and
reused by every layer.

On a CPU where the C++ prefill kernel pays (fp32 anywhere; bf16 with AVX512-BF16, on AMX through its AMX body:
`prefill_kernel_available`) every chunk (more than one new token) goes instead to it (attention/cpu_prefill.py),
one call per layer for all of them, unpadded. Decodes on the C++ decode kernel
(attention/cpu_kernels.py) form one group in flat-batch order, split only where one long sequence would make
the group's [sequences x longest] slot table many times the keys read.

Decode groups (one new token per sequence) fold the query heads that share a KV head into the query-length
axis ([G, KVH, H/KVH, D]), so each cached key is read once per KV head rather than once per query head
(1.3-1.4x faster than `enable_gqa` on SmolLM2's 9/3 heads, measured on one core of an Intel Xeon (Emerald Rapids)).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from orthrus_rag.layers.attention.cpu_kernels import decode_attention, write_kv
from orthrus_rag.layers.attention.cpu_prefill import Chunks, prefill_attention
from orthrus_rag.layers.context import AttentionMetadata, key_slots

_NONE = torch.empty(0, dtype=torch.long)  # csrc/grouped_sdpa.h reads a zero-element tensor as "none"

# Cost of one group's attention in one layer, in microseconds, for planning. Tuned on one machine and kept for all:
# one core of an Intel Xeon (Emerald Rapids), fp32, SmolLM2's shapes, torch's SDPA: call overhead incl. gathers ~40 us;
# gathering + reading one key of K and V ~0.15 us; one (query, key) pair over all heads ~0.025 us. Only the ratios
# matter: they decide when padding a sequence into a group costs more than a call of its own.
_CALL_US, _KEY_US, _PAIR_US = 40.0, 0.15, 0.025


# a decode-kernel group's slot table may hold up to twice the keys it reads, plus this many slots, before the
# group is split (building the table is a few tensor passes over it: ~0.1 ms for 100k slots on one core)
_SLOT_SLACK = 16384


def _cost(g: int, n: int, width: int) -> float:
    return _CALL_US + g * width * _KEY_US + g * n * width * _PAIR_US


@dataclass
class Group:
    seqs: list[int]  # sequence indices
    q_rows: torch.Tensor  # [G * n_max] flat-batch rows, padded by repeating a sequence's last row
    key_slots: torch.Tensor  # [G * L_max] cache slots
    n_max: int
    width: int  # L_max
    out_rows: torch.Tensor | None  # rows of the flat batch the valid outputs go to (None: q_rows, no padding)
    valid: torch.Tensor | None  # positions of valid outputs in the padded [G * n_max] layout
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)  # window -> mask or None
    causal: bool = False  # no cached keys and equal lengths: SDPA's own causal mask, no mask tensor
    lengths: torch.Tensor | None = None  # decode groups on the C++ kernel: keys per sequence (int64)
    q_all: bool = False  # q_rows is every row in order: the queries are q itself, no gather


@dataclass
class GroupedPlan:
    groups: list[Group]
    identity: bool  # one unpadded group whose rows are 0..T-1 in order: no output scatter
    chunks: Chunks | None = None  # sequences of more than one new token, on the C++ prefill kernel


def plan_groups(query_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Split sequences into groups whose padding costs less than separate calls (greedy over sequences sorted
    by shape; decodes and chunks never share a group: their kernels differ). For SDPA's groups, and for the
    decode kernel's where its one group's slot table would be mostly padding."""
    order = sorted(range(len(query_lens)), key=lambda i: (query_lens[i] > 1, query_lens[i], seq_lens[i]))
    groups: list[list[int]] = []
    n_max = width = 0
    for i in order:
        n, w = query_lens[i], seq_lens[i]
        if groups and (n > 1) == (query_lens[groups[-1][0]] > 1):
            g = len(groups[-1])
            merged = _cost(g + 1, max(n_max, n), max(width, w))
            if merged <= _cost(g, n_max, width) + _cost(1, n, w):
                groups[-1].append(i)
                n_max, width = max(n_max, n), max(width, w)
                continue
        groups.append([i])
        n_max, width = n, w
    return groups


def _group(meta: AttentionMetadata, seqs: list[int], windows: set[int | None]) -> Group:
    dev = meta.slot_mapping.device
    q_lens = [meta.query_lens[i] for i in seqs]
    ctx = [meta.context_lens[i] for i in seqs]
    n_max = max(q_lens)
    width = max(c + n for c, n in zip(ctx, q_lens))
    starts = meta.query_start_loc.index_select(0, torch.tensor(seqs, device=dev)).long()[:, None]
    n_t = torch.tensor(q_lens, device=dev)[:, None]
    j = torch.arange(n_max, device=dev)[None, :]
    q_rows = (starts + torch.minimum(j, n_t - 1)).flatten()
    padded = any(n != n_max for n in q_lens)
    valid = (j < n_t).flatten().nonzero().flatten() if padded else None
    out_rows = q_rows.index_select(0, valid) if padded else None
    group = Group(seqs, q_rows, key_slots(meta, seqs, width).flatten(), n_max, width, out_rows, valid)
    group.q_all = not padded and seqs == list(range(meta.num_seqs))
    if n_max == 1 and meta.decode_kernel and q_rows.device.type == "cpu":
        group.lengths = torch.tensor([c + 1 for c in ctx], dtype=torch.long)
        return group  # the kernel reads the paged cache itself: no masks
    if not any(ctx) and not padded and windows == {None}:
        group.causal = n_max > 1  # equal-length chunks with no cached keys (a decode of width 1 needs no mask)
        group.masks[None] = None
        return group
    q_pos = torch.tensor(ctx, device=dev)[:, None] + torch.minimum(j, n_t - 1)  # [G, n_max]
    k_pos = torch.arange(width, device=dev)[None, None, :]
    base = k_pos <= q_pos[:, :, None]  # [G, n_max, L]: causal, and (hence) within the sequence
    all_full = n_max == 1 and all(c + 1 == width for c in ctx)
    for window in windows:
        if window is None:
            group.masks[None] = None if all_full else base[:, None]
        else:
            group.masks[window] = (base & (k_pos > q_pos[:, :, None] - window))[:, None]
    return group


def _chunks(meta: AttentionMetadata, seqs: list[int]) -> Chunks:
    """The kernel's description of sequences `seqs`: no padding and no masks, it reads each one's own keys."""
    width = max(meta.context_lens[i] + meta.query_lens[i] for i in seqs)
    starts = meta.query_start_loc.index_select(0, torch.tensor(seqs)).long()
    return Chunks(starts, torch.tensor([meta.query_lens[i] for i in seqs], dtype=torch.long),
                  torch.tensor([meta.context_lens[i] for i in seqs], dtype=torch.long),
                  key_slots(meta, seqs, width).contiguous())


def plan(meta: AttentionMetadata, windows: set[int | None]) -> GroupedPlan:
    seqs = list(range(meta.num_seqs))
    chunks = None
    if meta.prefill_kernel and meta.slot_mapping.device.type == "cpu":
        chunked = [i for i in seqs if meta.query_lens[i] > 1]
        chunks = _chunks(meta, chunked) if chunked else None
        seqs = [i for i in seqs if meta.query_lens[i] == 1]
    groups = []
    if meta.decode_kernel and meta.slot_mapping.device.type == "cpu":
        # NOTE: the kernel reads each sequence's own keys, so padding costs nothing there: all decodes are one
        # group, in flat-batch order (a decode-only step's queries are then q itself: no gather, no scatter)
        decodes = [i for i in seqs if meta.query_lens[i] == 1]
        widths = [meta.context_lens[i] + 1 for i in decodes]
        if decodes and len(decodes) * max(widths) <= 2 * sum(widths) + _SLOT_SLACK:
            groups = [_group(meta, decodes, windows)]
        elif decodes:  # NOTE: e.g. one 32k-token context beside 100 short ones: the table would be ~50x the keys
            groups = [_group(meta, [decodes[j] for j in members], windows)
                      for members in plan_groups([1] * len(decodes), widths)]
        seqs = [i for i in seqs if meta.query_lens[i] > 1]
    q_lens = [meta.query_lens[i] for i in seqs]
    seq_lens = [meta.context_lens[i] + meta.query_lens[i] for i in seqs]
    groups += [_group(meta, [seqs[j] for j in members], windows) for members in plan_groups(q_lens, seq_lens)]
    identity = (chunks is None and len(groups) == 1 and groups[0].valid is None
                and groups[0].seqs == list(range(meta.num_seqs)))
    return GroupedPlan(groups, identity, chunks)


def kernel_plan(meta: AttentionMetadata) -> tuple:
    """The step's plan as the C++ layer loop takes it (layers/cpu_layer_loop.py, csrc/layer_loop.h): the slot
    mapping, the prefill kernel's chunks ([] or four tensors), each decode-kernel group's rows, [G, W] key slots and
    lengths, whether each is every row in order, the plan's `identity` (a decode-kernel group's only); then the SDPA
    groups (csrc/grouped_sdpa.h): per group its rows, key slots, valid positions and output rows (empty tensors where
    unpadded) and one mask per mask window (an empty tensor: none), its ints (sequences, n_max, width, causal,
    q_all), and the mask windows (-1: none)."""
    p: GroupedPlan = meta.plan
    chunks = [] if p.chunks is None else [p.chunks.q_start, p.chunks.q_len, p.chunks.ctx_len, p.chunks.key_slots]
    kernel = [g for g in p.groups if g.lengths is not None]
    sdpa_groups = [g for g in p.groups if g.lengths is None]
    groups = [t for g in kernel for t in (g.q_rows, g.key_slots.view(len(g.seqs), g.width), g.lengths)]
    windows = sorted({w for g in sdpa_groups for w in g.masks}, key=lambda w: -1 if w is None else w)
    sdpa: list[torch.Tensor] = []
    ints: list[int] = []
    for g in sdpa_groups:
        sdpa += [g.q_rows, g.key_slots, _NONE if g.valid is None else g.valid,
                 _NONE if g.out_rows is None else g.out_rows]
        # NOTE: every SDPA group holds a mask (or None) for each of the plan's windows (grouped._group)
        sdpa += [_NONE if g.masks.get(w) is None else g.masks[w] for w in windows]
        ints += [len(g.seqs), g.n_max, g.width, int(g.causal), int(g.q_all)]
    identity = p.identity and not sdpa_groups
    return (meta.slot_mapping, chunks, groups, [int(g.q_all) for g in kernel], identity, sdpa, ints,
            [-1 if w is None else w for w in windows])


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D]; caches [slots, KVH, D] (scratch rows included). Returns [T, H, D]."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    p: GroupedPlan = meta.plan
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    if p.identity:
        return _attend(p.groups[0], q, k_cache, v_cache, scale, window, num_heads, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    if p.chunks is not None:  # NOTE: writes its rows of out itself
        prefill_attention(q, k_cache, v_cache, p.chunks, scale, window, out)
    for g in p.groups:
        o = _attend(g, q, k_cache, v_cache, scale, window, num_heads, num_kv_heads, head_dim)
        if g.valid is None:
            out.index_copy_(0, g.q_rows, o)
        else:
            out.index_copy_(0, g.out_rows, o.index_select(0, g.valid))
    return out


def _attend(g: Group, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
            window: int | None, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """One group's attention; [G * n_max, H, D] in the padded row layout."""
    size = len(g.seqs)
    queries = q if g.q_all else q.index_select(0, g.q_rows)
    if g.lengths is not None:
        return decode_attention(queries, k_cache, v_cache, g.key_slots.view(size, g.width), g.lengths, scale, window)
    keys = k_cache.index_select(0, g.key_slots).view(size, g.width, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, g.key_slots).view(size, g.width, num_kv_heads, head_dim).transpose(1, 2)
    mask = g.masks[window] if window in g.masks else g.masks[None]
    if g.n_max == 1:  # decode: the query heads of one KV head attend as rows of one [H/KVH, L] problem
        queries = queries.view(size, num_kv_heads, num_heads // num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        return o.reshape(size, num_heads, head_dim)
    queries = queries.view(size, g.n_max, num_heads, head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=g.causal, scale=scale,
                                       enable_gqa=num_heads != num_kv_heads)
    return o.transpose(1, 2).reshape(size * g.n_max, num_heads, head_dim)
