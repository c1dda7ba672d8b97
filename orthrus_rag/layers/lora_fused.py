"""LoRA updates on the CPU through one C++ kernel (csrc/lora.h): for one projection and one adapter, both
products and the add over that adapter's rows in one pass.

Why: the torch path (layers/lora.py's `per_slot`) takes two small products, a gather and a scatter-add per adapter
and adapted module, 28 ops a layer for an adapter on all seven projections; in bf16 each of those products
([rows, 576] x [576, 8]) costs ~17-21 us on an EPYC core whatever its size (oneDNN's per-call cost, not the
arithmetic: docs/design/cpu-kernels.md). The kernel takes a fused projection (Q/K/V, gate/up: layers/fused.py) as
one: each row of the input meets every targeted part's A in one pass, and each part's B adds into its own slice of
the fused output. One call per projection and adapter, from Python or from the C++ layer loop
(layers/cpu_layer_loop.py), which calls it with the same arguments, so the two loops give the same bits.

Numerics: `h = scale * x A^T` and `h B^T` summed in fp32 and added to the output with one rounding, where the torch
path rounds h, the update and the sum to the model's dtype; on the AVX512-BF16 path (bf16 models) h is rounded to
bf16 too, for vdpbf16ps. Either way this is the closer of the two to float64 arithmetic (tests/test_lora_fused.py).

Where: the plan's `lora=cpp` (engine/executor/plan.py; its default on a CPU where the extension built), outside
autograd; the other `lora` choices keep torch's ops, as does a CUDA device.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence

import torch
from torch import nn

from orthrus_rag.layers.cpu_extension import kernels


def forget_groups(model: nn.Module) -> None:
    """Drop every cached LoRAGroup of `model` (its LoRA layers' and its fused projections'): the owner of each
    change to adapters or LoRA settings (layers/lora.py) calls it, and the next use builds the groups anew."""
    for module in model.modules():
        module.__dict__.pop("_lora_group", None)
        for fusion in module.__dict__.get("fusions", {}).values():
            fusion.__dict__.pop("_lora_group", None)


@dataclass
class Entry:
    """One adapter on one projection, as the kernel takes it."""

    a: torch.Tensor  # [sum r, in]: A of every part this adapter targets, stacked, in fp32
    a16: torch.Tensor  # the same in bf16 for a bf16 model (the kernel's AVX512-BF16 products), else empty
    bts: list[torch.Tensor]  # per targeted part: B as the kernel reads it (`_b_operand`)
    out_starts: list[int]  # the part's first column in the projection's output
    col_starts: list[int]  # its first row of `a`
    scaling: float


def _bf16(a: torch.Tensor) -> torch.Tensor:
    return a.contiguous() if a.dtype == torch.bfloat16 else torch.empty(0, dtype=torch.bfloat16)


def _b_operand(b: torch.Tensor, pairs: bool) -> torch.Tensor:
    """B [out, r] as the kernel reads it: transposed in fp32 [r, out], or in bf16 pairs [r / 2, out, 2] (pairs of
    consecutive ranks side by side: vdpbf16ps's operand), for even ranks up to the kernel's 128."""
    bt = b.t()
    r = bt.shape[0]
    if pairs and r % 2 == 0 and r <= 128:
        return bt.reshape(r // 2, 2, bt.shape[1]).transpose(1, 2).contiguous()
    return bt.float().contiguous()


class LoRAGroup:
    """The adapters of one projection's LoRA parts (one LoRALinear, or a Fusion's parts, `sizes` their widths)."""

    def __init__(self, parts: Sequence[nn.Module], sizes: Sequence[int]) -> None:
        self.dtype: torch.dtype | None = None  # the model's (and the factors') dtype
        self.entries: dict[int, Entry] = {}
        # NOTE: the kernel replaces the torch path only where every LoRA part asked for it (lora.use_cpu_lora_kernel,
        # which the engine calls once the extension built): only then are its operands made
        lora = [p for p in parts if getattr(p, "scalings", None)]
        self.usable = bool(lora) and all(getattr(p, "cpu_kernel", False) and p.kernel == "auto" for p in lora)
        if not self.usable:
            return
        self.dtype = lora[0].weight.dtype
        pairs = self.dtype == torch.bfloat16 and bool(kernels().lora_bf16_pairs())
        halves: dict[int, list] = {}  # slot -> [As, Bs, out starts, col starts, scaling]
        start = 0
        for part, size in zip(parts, sizes):
            for slot, scaling in sorted(getattr(part, "scalings", {}).items()):
                a, b = getattr(part, f"lora_A_{slot}"), getattr(part, f"lora_B_{slot}")
                e = halves.setdefault(slot, [[], [], [], [], scaling])
                # NOTE: attach_adapters gives every module of one adapter its one scaling
                assert e[4] == scaling, "one adapter, one scaling"
                e[3].append(sum(x.shape[0] for x in e[0]))
                e[0].append(a)
                e[1].append(_b_operand(b, pairs))
                e[2].append(start)
            start += size
        # NOTE: A in fp32 (exact for bf16 factors) for the fp32 sums' path, and as it is in bf16 for vdpbf16ps
        self.entries = {slot: Entry(torch.cat(e[0]).float().contiguous(), _bf16(torch.cat(e[0])), e[1], e[2], e[3],
                                    e[4]) for slot, e in halves.items()}

    def applies(self, x: torch.Tensor) -> bool:
        return self.usable and x.device.type == "cpu" and x.dtype == self.dtype and not torch.is_grad_enabled()

    def add(self, x2: torch.Tensor, y2: torch.Tensor, lora_rows: list[tuple[int, torch.Tensor]]) -> None:
        """y2 [T, out] += each adapter's update on its rows of x2 [T, in], in place. As the runner builds them, each
        slot is listed once and no row twice (the kernel writes rows in parallel; the C++ loop reads a slot once)."""
        k = kernels()
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        for slot, rows in lora_rows:
            e = self.entries.get(slot)
            if e is not None and rows.numel():
                k.lora_add(x2, y2, rows, e.a, e.a16, e.bts, e.out_starts, e.col_starts, e.scaling)


def cached_group(holder: object, parts: Sequence[nn.Module], sizes: Sequence[int]) -> LoRAGroup | None:
    """`holder`'s LoRAGroup of `parts`, built on first use and after a move to another dtype (`forget_groups`
    drops it when adapters or LoRA settings change); None when no part carries an adapter."""
    key = parts[0].weight.dtype
    cached = holder.__dict__.get("_lora_group")
    if cached is None or cached[0] != key:
        group = LoRAGroup(parts, sizes) if any(getattr(p, "scalings", None) for p in parts) else None
        cached = holder.__dict__["_lora_group"] = (key, group)
    return cached[1]
