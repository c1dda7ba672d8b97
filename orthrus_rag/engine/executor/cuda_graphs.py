"""CUDA graphs for decode-only steps: one replay instead of ~40 kernel launches per layer.

A decode step is small on a GPU (64 rows of an 8B model: ~3 ms of HBM time) and eager PyTorch spends longer
launching its kernels than running them (GPU.md: 27.6 ms of host time against 9.0 ms of GPU time per step).
vLLM and nano-vllm capture the decode forward once per batch-size bucket and replay it; so does this module.

A graph needs static shapes, so a step is padded to a bucket: the batch to the next of `BATCH_BUCKETS` and every
sequence's keys to a power-of-two width. Inputs are copied into the graph's static buffers (token ids,
positions, the slot each new K/V goes to, each sequence's key slots and its mask); padding rows write their K/V
to scratch rows and attend to one key, so they never produce NaNs. Attention inside a graph is the grouped
backend's decode path (layers/attention/grouped.py) over those buffers; its cost grows with the padded width,
which is at most 2x the longest sequence. Graphs are captured on first use of a (batch, width) bucket and kept,
at most `max_graphs` of them (they share one memory pool).

On a CPU (tests) the same buffers run eagerly (`capture=False`): everything but capture and replay is checked
there.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from orthrus_rag.layers.attention import AttentionMetadata, grouped, key_slots
from orthrus_rag.layers.attention.grouped import Group, GroupedPlan
from orthrus_rag.layers.context import ForwardContext, forward_context

logger = logging.getLogger(__name__)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MIN_WIDTH = 64


def _bucket(n: int) -> int:
    return next(b for b in BATCH_BUCKETS if b >= n)


def _width(n: int) -> int:
    return max(MIN_WIDTH, 1 << (n - 1).bit_length())


@dataclass
class _Graph:
    batch: int
    width: int
    ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    slots: torch.Tensor  # [B] where each row's K/V go
    keys: torch.Tensor  # [B * W] key slots
    masks: dict[int | None, torch.Tensor]  # window -> [B, 1, 1, W] bool
    meta: AttentionMetadata
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    hidden: torch.Tensor | None = None  # the captured output buffer


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list, windows: set[int | None], num_slots: int,
                 max_batch: int, max_width: int, device: torch.device, capture: bool = True,
                 max_graphs: int = 64) -> None:
        self.model, self.kv_caches, self.windows = model, kv_caches, windows
        self.num_slots, self.device, self.capture = num_slots, device, capture
        self.max_batch = max(b for b in BATCH_BUCKETS if b <= max(max_batch, 1))
        self.max_width = max_width
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple[int, int], _Graph] = OrderedDict()
        self.pool: Any = None
        # NOTE: one side stream for every warm-up and capture: captures that share a pool should use the same
        # stream (torch.cuda.graph's docs), and torch keeps a cuBLAS workspace per stream for the life of the
        # process (tens of MiB on Hopper), so a stream per capture would hold one per bucket
        self.stream: Any = None
        self.num_steps = 0  # decode steps run through a bucket (replayed, or eagerly without capture)

    def eligible(self, meta: AttentionMetadata, has_lora_rows: bool) -> bool:
        """One new token per sequence (decodes; a 1-token final embedding chunk rides along), no adapter rows,
        small enough for a bucket. Decided from host-side lists: no device sync."""
        return (not has_lora_rows and 0 < meta.num_seqs <= self.max_batch and meta.max_query_len == 1
                and meta.max_seq_len <= self.max_width)

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [num_seqs, hidden] of a decode step."""
        key = (_bucket(meta.num_seqs), min(_width(meta.max_seq_len), _width(self.max_width)))
        g = self.graphs.get(key)
        if g is None:
            g = self._new(*key)
        self.graphs.move_to_end(key)
        self._load(g, input_ids, meta)
        self.num_steps += 1
        if g.graph is not None:
            g.graph.replay()
            hidden = g.hidden
        else:
            hidden = self._forward(g)
        return hidden[:meta.num_seqs]

    # ---- buffers ---------------------------------------------------------------------------------------------
    def _new(self, batch: int, width: int) -> _Graph:
        dev = self.device
        slots = self.num_slots + torch.arange(batch, device=dev)  # scratch rows until loaded
        keys = torch.zeros(batch * width, dtype=torch.long, device=dev)
        masks = {w: torch.zeros((batch, 1, 1, width), dtype=torch.bool, device=dev) for w in self.windows}
        for m in masks.values():
            m[:, :, :, 0] = True
        group = Group(seqs=list(range(batch)), q_rows=torch.arange(batch, device=dev), key_slots=keys, n_max=1,
                      width=width, out_rows=None, valid=None, masks=dict(masks))
        meta = AttentionMetadata(query_lens=[1] * batch, context_lens=[0] * batch,
                                 query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
                                 seq_lens=torch.ones(batch, dtype=torch.int32, device=dev),
                                 block_tables=torch.zeros((batch, 1), dtype=torch.int32, device=dev),
                                 slot_mapping=slots, positions=torch.zeros(batch, dtype=torch.long, device=dev),
                                 block_size=1, plan=GroupedPlan([group], identity=True))
        g = _Graph(batch, width, torch.zeros(batch, dtype=torch.long, device=dev), meta.positions, slots, keys,
                   masks, meta)
        if self.capture:
            self._capture(g)
        if len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        self.graphs[(batch, width)] = g
        return g

    def _load(self, g: _Graph, input_ids: torch.Tensor, meta: AttentionMetadata) -> None:
        n, dev = meta.num_seqs, self.device
        g.ids[:n].copy_(input_ids)
        g.ids[n:].zero_()
        g.positions[:n].copy_(meta.positions)
        g.positions[n:].zero_()
        g.slots[:n].copy_(meta.slot_mapping)
        g.slots[n:].copy_(self.num_slots + torch.arange(n, g.batch, device=dev))
        keys = g.keys.view(g.batch, g.width)
        keys[:n].copy_(key_slots(meta, list(range(n)), g.width))
        keys[n:].zero_()
        k_pos = torch.arange(g.width, device=dev)[None, :]
        q_pos = meta.positions[:, None]
        for window, mask in g.masks.items():
            ok = k_pos <= q_pos
            if window is not None:
                ok &= k_pos > q_pos - window
            mask[:n, 0, 0].copy_(ok)
            mask[n:, 0, 0].copy_(k_pos == 0)

    def _forward(self, g: _Graph) -> torch.Tensor:
        ctx = ForwardContext(attn=g.meta, attn_backend=grouped, kv_caches=self.kv_caches)
        with forward_context(ctx):
            return self.model(g.ids, g.positions)

    def _capture(self, g: _Graph) -> None:
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=self.device)
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph: lazy initialisations must not be captured
                self._forward(g)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.pool, stream=stream):
            g.hidden = self._forward(g)
        self.pool = g.graph.pool()
        logger.info("captured a decode CUDA graph for batch %d, width %d", g.batch, g.width)
