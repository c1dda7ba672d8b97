"""The decoder's layer loop as one C++ call per step on the CPU, where the Python loop's own cost showed.

Profiled at batch 1 (SmolLM2 in bf16 on one EPYC core, py-spy), a 17 ms decode step spent 11.5 ms in the GEMMs
and most of the rest in Python between them: 30 layers of module calls, `project` / `split` / `view`, the
attention backend's dispatch and ten kernel calls through pybind or torch's op packets, ~100-130 us a layer.
vLLM-CPU pays none of it (torch.compile turns its layers into one graph). This loop calls the same kernels in
the same order from C++ (csrc/layer_loop.h): the GEMMs through the dispatcher's `mkldnn::_linear_pointwise`
(what linear.onednn_linear calls) or `at::linear`, attention through the C++ decode and prefill kernels, the
fused elementwise ops; so its output is the Python loop's, bit for bit.

It runs a step only when the Python loop would do nothing else: the model's plain Llama layers on the fused
kernels (`CausalLM.use_cpu_kernels`, fused Q/K/V and gate/up, no per-head norms), adapter rows only where every
adapted projection adds them through the LoRA kernel (layers/lora_fused.py, which the loop calls with the Python
layers' arguments; the plan's `lora=torch` / `per_slot` / `stacked` keep the Python loop; full-delta norms keep
it too, since the fused norms are off there), no autograd, and the grouped attention backend's plan
(`grouped.kernel_plan`: its groups on the C++ kernels, and those on torch's SDPA through the same torch ops from
C++, e.g. bf16 chunks on a CPU without AVX512-BF16); any other step takes the Python loop. The plan's
`layers=fused` (`+model.kernel_overrides.layers=fused`) turns it off.

Its arguments, in two named structures (csrc/layer_loop.h): the model's (`LayerLoopModel`: weights, eps, windows,
shape, packed or quantized weights, adapters, the column split's parts), built when the loop is made and on `refresh()`, and a
step's (`LayerLoopStep`: the attention plan, adapter rows, whether to split), built per step: a step converts its
plan and caches for C++, not the model's weights.

At two or more threads, steps of many rows without adapter rows take its column-split form (cpu_layer_split.py):
each thread on its own output columns of every product. That form equals this loop to the dtype's rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from orthrus_rag.layers import linear
from orthrus_rag.layers.context import get_forward_context
from orthrus_rag.layers.cpu_extension import kernels
from orthrus_rag.layers.cpu_layer_split import SPLIT_FROM, SplitParts
from orthrus_rag.layers.lora_fused import LoRAGroup
from orthrus_rag.layers.quantized import INT8_DENSE_FROM

_NO_BIAS = torch.empty(0)  # csrc/layer_loop.h reads a zero-element bias as "none"
_NO_ADAPTERS: tuple[list, list, list] = ([], [], [])


def _groups(layer: nn.Module) -> list[LoRAGroup | None]:
    """A layer's adapted projections in the C++ loop's order (Q/K/V, O, gate/up, down), as its modules add them."""
    att, mlp = layer.self_attn, layer.mlp
    out: list[LoRAGroup | None] = []
    for owner, fused, single in ((att, "qkv", att.o_proj), (mlp, "gate_up", mlp.down_proj)):
        out.append(owner.fusions[fused].lora_group(owner))
        out.append(single.lora_group() if hasattr(single, "lora_group") else None)  # NOTE: a LoRALinear
    return out


def _encode(groups: list[LoRAGroup | None], dtype: torch.dtype) -> tuple[tuple[list, list, list], bool]:
    """The adapters as csrc/layer_loop.h's `Adapters` reads them, and whether the loop may take adapter rows."""
    ints: list[int] = []
    tensors: list[torch.Tensor] = []
    scales: list[float] = []
    ok = True
    for group in groups:
        if group is None:
            ints.append(0)
            continue
        ok = ok and group.usable and group.dtype == dtype
        ints.append(len(group.entries))
        for slot, e in sorted(group.entries.items()):
            ints += [slot, len(e.bts), *e.out_starts, *e.col_starts]
            tensors += [e.a, e.a16, *e.bts]
            scales.append(e.scaling)
    return ((tensors, ints, scales) if tensors else _NO_ADAPTERS), ok


def _affine(module: nn.Linear) -> list[torch.Tensor]:
    """The dense weight and the bias of `module`, as the C++ loop takes them (a packed copy's bias is the same)."""
    return [module.weight, _NO_BIAS if module.bias is None else module.bias]


class LayerLoop:
    """The C++ layer loop of one DecoderModel whose layers it covers (`CausalLM.use_cpu_layer_loop` checks).

    Its model arguments (csrc/layer_loop.h's LoopModel: weights, packed copies, adapters) are gathered when it is
    made and again on `refresh()`, which whoever packs the model's projections anew, attaches adapters or changes
    LoRA settings after the loop exists calls (`CausalLM.kernel_inputs_changed`); a step builds only its own
    arguments (LoopStep). The column-split parts follow the thread count and `split`, checked at each step."""

    def __init__(self, model: nn.Module) -> None:  # NOTE: a models/llama.py DecoderModel
        self.model = model
        # the column-split form (cpu_layer_split.py) for steps of at least split_from rows; `split_steps` counts them
        self.split, self.split_from, self.split_steps = True, SPLIT_FROM, 0
        # NOTE: the packed weights' op as the C++ names its signature (a torch without it: dense weights only)
        self._kernels = kernels()
        self._pointwise = bool(self._kernels.layer_loop_pointwise())
        self.refresh()

    def refresh(self) -> None:
        """Gather the model's arguments again, between steps: after its projections were packed anew, or its
        adapters or LoRA settings changed (`lora.attach_adapters`, `set_lora_kernel`, `use_cpu_lora_kernel`)."""
        model = self.model
        self._args = None  # NOTE: a LayerLoopModel; None: weights the loop cannot read (every step: Python)
        self._dtype, self._adapters_ok = None, True
        self._parts: SplitParts | None = None
        self._parts_for: int | None = None  # the threads (0: the split off) the parts were made for; None: not yet
        mods = [m for layer in model.layers for m in (layer.self_attn.fusions["qkv"].carrier, layer.self_attn.o_proj,
                                                      layer.mlp.fusions["gate_up"].carrier, layer.mlp.down_proj)]
        quants = [getattr(m, "_quant", None) for m in mods]
        # NOTE: quantized weights (layers/quantized.py): all four projections of every layer in one format, or the
        # Python loop
        self.quantized = all(q is not None for q in quants) and len({(q.kind, q.group) for q in quants}) == 1
        self.quant_kind = quants[0].kind if self.quantized else None
        if any(q is not None for q in quants) and not self.quantized:
            return
        packed = [getattr(m, "_onednn", None) is not None for m in mods]
        froms = {linear.packed_from(m) for m in mods}
        # NOTE: all packed from one row count (and torch has the pointwise op) or all dense: pack_linears packs
        # every one of the layers or none, from one threshold
        self.packed = all(packed) and len(froms) == 1 and linear._POINTWISE is not None and self._pointwise
        # the packed weights, taken by steps of at least `packed_from` rows as linear.linear takes them
        self.packed_from = froms.pop() if self.packed else 0
        if any(packed) and not self.packed:
            return
        # steps of at most this many rows through the few-row bf16 product (linear.use_gemv gives all four of every
        # layer one count); 0: none
        rows = {linear.gemv_rows(m) for m in mods}
        self.gemv_rows = rows.pop() if len(rows) == 1 and not self.quantized else 0
        weights: list[torch.Tensor] = []
        eps: list[float] = []
        nexts = [*(lr.input_layernorm for lr in model.layers[1:]), model.norm]
        for layer, next_norm in zip(model.layers, nexts):
            att, mlp, post = layer.self_attn, layer.mlp, layer.post_attention_layernorm
            weights += [*_affine(att.fusions["qkv"].carrier), *_affine(att.o_proj), post.weight,
                        *_affine(mlp.fusions["gate_up"].carrier), *_affine(mlp.down_proj), next_norm.weight]
            eps += [post.eps, next_norm.eps]
        first = model.layers[0].self_attn
        self._dtype = weights[0].dtype
        (lora_w, lora_ints, lora_scales), self._adapters_ok = _encode(
            [g for layer in model.layers for g in _groups(layer)], self._dtype)
        self._args = self._kernels.LayerLoopModel(
            weights=weights, eps=eps,
            windows=[-1 if lr.self_attn.window is None else lr.self_attn.window for lr in model.layers],
            heads=first.num_heads, kv_heads=first.num_kv_heads, head_dim=first.head_dim,
            intermediate=model.layers[0].mlp.fusions["gate_up"].sizes[0], scale=first.scale,
            packed_weights=[m._onednn[0] for m in mods] if self.packed else [], packed_from=self.packed_from,
            gemv_rows=self.gemv_rows, adapter_tensors=lora_w, adapter_ints=lora_ints, adapter_scales=lora_scales,
            quant_weights=[q.weight for q in quants] if self.quantized else [],
            quant_scales=[q.scales for q in quants] if self.quantized else [],
            quant_group=quants[0].group if self.quantized else 0,
            quant_dense_from=INT8_DENSE_FROM if self.quantized and self.quant_kind == "int8" else 0)

    def _split_parts(self) -> SplitParts | None:
        """The column-split parts for this step's thread count, made anew where it (or the switch) changed."""
        want = torch.get_num_threads() if self.split else 0
        if want != self._parts_for and self._args is not None:
            # NOTE: the parts are packed like the whole weights, so only where those are (a second copy of the layers)
            self._set_parts(SplitParts(self.model, want) if want > 1 and self.packed and linear.blocked_packing()
                            else None)
            self._parts_for = want
        return self._parts

    def _set_parts(self, parts: SplitParts | None) -> None:
        """Give the C++ model arguments `parts` (checked there against the model's shapes) or none."""
        self._args.set_split(parts.tensors if parts else [], parts.cols if parts else [])
        self._parts = parts

    def describe(self, attn_backend: object) -> str | None:
        """What the loop takes of a step with `attn_backend`, for the execution plan (engine/executor/plan.py): None
        where no step can take it (a backend without a kernel plan, or weights it cannot read), else its form."""
        if getattr(attn_backend, "kernel_plan", None) is None or self._args is None:
            return None
        out = "C++ layer loop" + (f", {self.quant_kind} weights" if self.quantized else "")
        if self._split_parts() is not None:
            out += f", column split from {max(self.split_from, self.packed_from)} rows"
        if not self._adapters_ok:
            out += "; steps with adapter rows in the Python loop"
        return out

    def __call__(self, h: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor | None:
        """Every layer on `h` (the first layer's normed input) and `residual` (updated in place), as
        DecoderModel's fused loop; None where this step must take the Python loop."""
        ctx = get_forward_context()
        # NOTE: outside a runner step (no metadata) the Python loop says so itself
        if ctx.attn is None or torch.is_grad_enabled() or h.device.type != "cpu":
            return None
        kernel_plan = getattr(ctx.attn_backend, "kernel_plan", None)
        plan = kernel_plan(ctx.attn) if kernel_plan is not None else None
        args = self._args
        if plan is None or args is None or (ctx.lora_rows and not self._adapters_ok):
            return None
        if (self._dtype != h.dtype or len(ctx.kv_caches) != args.layers or ctx.kv_caches[0][0].dtype != h.dtype):
            return None  # NOTE: the Python loop copes (write_kv casts nothing in C++, it checks)
        slot_mapping, chunks, groups, q_all, identity, sdpa, sdpa_ints, mask_windows = plan
        lora_rows = ctx.lora_rows
        parts = self._split_parts()
        split = (parts is not None and not lora_rows and h.shape[0] >= max(self.split_from, self.packed_from))
        self.split_steps += split
        step = self._kernels.LayerLoopStep(
            slot_mapping=slot_mapping, chunks=chunks, groups=groups, q_all=q_all, identity=identity, sdpa=sdpa,
            sdpa_ints=sdpa_ints, mask_windows=mask_windows, lora_slots=[s for s, _ in lora_rows],
            lora_rows=[r for _, r in lora_rows], split=split)
        return self._kernels.layer_loop(args, h, residual, cos, sin, [c for kv in ctx.kv_caches for c in kv], step)
