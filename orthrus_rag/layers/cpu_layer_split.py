"""The C++ layer loop's column-split form: each of a step's threads on its own output columns of every product.

Why (docs/design/cpu-kernels.md): at two threads SmolLM2's 30-layer chain of products and fused kernels cost ~12 ms
more per 256-row step than its ops timed alone. oneDNN splits each product between the threads its own way and the
fused kernels split by rows, so every op reads what the other core wrote. Here each thread owns fixed output columns
of every product: a packed part of each weight (Q/K/V at head boundaries, O and down by columns, gate/up as the
thread's gate columns beside its up columns), multiplied by oneDNN on that thread alone, and runs rotary and
SiLU-and-mul on the columns it wrote; only a layer's two norms, which read whole rows, split by rows. One parallel
region runs a layer from its O product to the next layer's Q/K/V, with barriers between its ops (csrc/layer_split.h);
attention runs between regions as the loop runs it. On an Intel Xeon with AMX (two cores) the chain alone ran
1.16-1.21x faster at 64-512 rows; `scripts/profiling.py layer-split` times whole steps with and without it.

Which steps take it: those of at least `split_from` rows (packed weights only, the ones the loop multiplies by from
`packed_from` rows) without adapter rows (those keep the loop's whole-weight form, whose LoRA kernel adds to the
whole products), when torch runs more than one thread. The parts are a second packed copy of the layers' weights,
made from the dense weights when a step first runs at a thread count (the loop checks the count at each step). A
part's product can differ from the whole weight's in the last bit where oneDNN blocks the part's reduction otherwise
(bf16 at some shapes), so this form equals the Python loop to the dtype's rounding, not bit for bit.
`model.kernel_overrides={layers: loop}` turns it off.
"""

from __future__ import annotations

import torch
from torch import nn

from orthrus_rag.layers import linear

# rows from which a step takes the column split. Below it a step streams the layers' weights from memory more
# than it computes, and both threads' parts contend for it: at 64-128 rows the split was 0.90-0.96x the whole form,
# at 256 1.05-1.08x, at 512 1.06-1.13x. Measured on an Intel Xeon with AMX (2 cores under KVM: avx512_bf16,
# amx_bf16/tile, 2 MiB L2 per core) at 2 threads, SmolLM2 in bf16 (the engine's `auto` dtype there) on packed oneDNN
# weights, torch 2.13.0+cpu, whole steps of 32-token chunks (`scripts/profiling.py layer-split`); recorded in
# docs/design/cpu-kernels.md ("Constants tuned on a given CPU", "The column split"). Another CPU (other cache sizes
# or core counts) or fp32 may move it.
SPLIT_FROM = 256
# a part's columns: a multiple of this where the width allows (oneDNN's blocked layout packs 16-64 columns a block)
ALIGN = 32


def even_parts(total: int, parts: int, align: int) -> list[int]:
    """`total` columns as `parts` widths, as even as multiples of `align` allow (the last takes any remainder)."""
    units, rest = divmod(total, align)
    if units < parts:  # too narrow to align: as even as single columns allow
        units, rest, align = total, 0, 1
    base, extra = divmod(units, parts)
    widths = [(base + (p < extra)) * align for p in range(parts)]
    widths[-1] += rest
    return widths


def _starts(widths: list[int]) -> list[int]:
    return [sum(widths[:p]) for p in range(len(widths))]


class SplitParts:
    """The packed weight parts of one DecoderModel's layers for `threads` threads, as csrc/layer_split.h reads them:
    `tensors` per layer, per thread: Q/K/V, O, gate|up and down, each a packed part and its bias (or an empty
    tensor); `cols` per thread: the first column and the width of its Q/K/V, O, intermediate and down columns."""

    def __init__(self, model: nn.Module, threads: int) -> None:  # NOTE: a models/llama.py DecoderModel
        first = model.layers[0]
        att, inter = first.self_attn, first.mlp.fusions["gate_up"].sizes[0]
        hidden, dim = first.self_attn.o_proj.out_features, att.head_dim
        heads = att.num_heads + 2 * att.num_kv_heads
        qkv = [h * dim for h in even_parts(heads, threads, 1)]  # NOTE: at head boundaries (rotary's unit)
        o, mid, down = (even_parts(n, threads, ALIGN) for n in (hidden, inter, hidden))
        self.threads = threads
        self.cols = [c for p in range(threads)
                     for c in (_starts(qkv)[p], qkv[p], _starts(o)[p], o[p], _starts(mid)[p], mid[p],
                               _starts(down)[p], down[p])]
        self.tensors: list[torch.Tensor] = []
        with torch.no_grad():
            for layer in model.layers:
                projections = (layer.self_attn.fusions["qkv"].carrier, layer.self_attn.o_proj,
                               layer.mlp.fusions["gate_up"].carrier, layer.mlp.down_proj)
                for p in range(threads):
                    rows = (_range(qkv, p), _range(o, p), [*_range(mid, p), *(r + inter for r in _range(mid, p))],
                            _range(down, p))
                    for module, keep in zip(projections, rows):
                        self.tensors += _part(module, keep)


def _range(widths: list[int], p: int) -> range:
    start = sum(widths[:p])
    return range(start, start + widths[p])


def _part(module: nn.Linear, rows) -> list[torch.Tensor]:
    """The packed copy of `module`'s weight rows `rows` (its output columns) and that part of its bias."""
    index = torch.as_tensor(list(rows))
    weight = module.weight.detach().index_select(0, index).contiguous()
    bias = torch.empty(0, dtype=weight.dtype) if module.bias is None else module.bias.detach()[index].contiguous()
    return [linear.pack_weight(weight), bias]
