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
layers' arguments; `lora_kernel=per_slot` / `stacked` keep the Python loop; full-delta norms keep it too, since
the fused norms are off there), no autograd, and the grouped attention backend's plan (`grouped.kernel_plan`:
its groups on the C++ kernels, and those on torch's SDPA through the same torch ops from C++, e.g. bf16 chunks
on a CPU without AVX512-BF16); any other step takes the Python loop. `cpu_layer_loop=false` turns it off.

At two or more threads, steps of many rows without adapter rows take its column-split form (cpu_layer_split.py):
each thread on its own output columns of every product. That form equals this loop to the dtype's rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from orthrus_rag.layers import linear, lora_fused
from orthrus_rag.layers.context import get_forward_context
from orthrus_rag.layers.cpu_extension import kernels
from orthrus_rag.layers.cpu_layer_split import SPLIT_FROM, SplitParts
from orthrus_rag.layers.lora_fused import LoRAGroup

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
    """The C++ layer loop of one DecoderModel whose layers it covers (`CausalLM.use_cpu_layer_loop` checks); its
    arguments are gathered once, and again if packing, adapters or LoRA settings changed."""

    def __init__(self, model: nn.Module) -> None:  # NOTE: a models/llama.py DecoderModel
        self.model = model
        self._weights: list[torch.Tensor] | None = None
        # (linear.GENERATION, lora_fused.GENERATION, threads) the arguments were gathered at
        self._built_for: tuple[int, int, int] | None = None
        self._adapters, self._adapters_ok = _NO_ADAPTERS, True
        # the column-split form (cpu_layer_split.py) for steps of at least split_from rows; `split_steps` counts them
        self.split, self.split_from, self.split_steps = True, SPLIT_FROM, 0
        self._parts: SplitParts | None = None
        # NOTE: the packed weights' op as the C++ names its signature (a torch without it: dense weights only)
        self._pointwise = bool(kernels().layer_loop_pointwise())

    def _gather(self) -> None:
        model = self.model
        mods = [m for layer in model.layers for m in (layer.self_attn.fusions["qkv"].carrier, layer.self_attn.o_proj,
                                                      layer.mlp.fusions["gate_up"].carrier, layer.mlp.down_proj)]
        packed = [getattr(m, "_onednn", None) is not None for m in mods]
        froms = {linear.packed_from(m) for m in mods}
        # NOTE: all packed from one row count (and torch has the pointwise op) or all dense: pack_linears packs
        # every one of the layers or none, from one threshold
        self.packed = all(packed) and len(froms) == 1 and linear._POINTWISE is not None and self._pointwise
        if any(packed) and not self.packed:
            self._weights = None
            return
        # the packed weights, taken by steps of at least `packed_from` rows as linear.linear takes them
        self.packed_w = [m._onednn[0] for m in mods] if self.packed else []
        self.packed_from = froms.pop() if self.packed else 0
        weights: list[torch.Tensor] = []
        self.eps: list[float] = []
        nexts = [*(lr.input_layernorm for lr in model.layers[1:]), model.norm]
        for layer, next_norm in zip(model.layers, nexts):
            att, mlp, post = layer.self_attn, layer.mlp, layer.post_attention_layernorm
            weights += [*_affine(att.fusions["qkv"].carrier), *_affine(att.o_proj), post.weight,
                        *_affine(mlp.fusions["gate_up"].carrier), *_affine(mlp.down_proj), next_norm.weight]
            self.eps += [post.eps, next_norm.eps]
        first = model.layers[0].self_attn
        self.windows = [-1 if lr.self_attn.window is None else lr.self_attn.window for lr in model.layers]
        self.shape = [first.num_heads, first.num_kv_heads, first.head_dim,
                      model.layers[0].mlp.fusions["gate_up"].sizes[0]]
        self.scale = first.scale
        self._weights = weights
        self._adapters, self._adapters_ok = _encode([g for layer in model.layers for g in _groups(layer)],
                                                    weights[0].dtype)
        threads = torch.get_num_threads()
        # NOTE: the parts are packed like the whole weights, so only where those are (a second copy of the layers)
        self._parts = (SplitParts(model, threads) if self.split and self.packed and threads > 1
                       and linear.blocked_packing() else None)

    def _ensure_gathered(self) -> None:
        """The arguments, gathered again if packing, adapters, LoRA settings or (with the split) threads changed."""
        built_for = (linear.GENERATION[0], lora_fused.GENERATION[0], torch.get_num_threads() if self.split else 0)
        if self._built_for != built_for:
            self._gather()
            self._built_for = built_for

    def describe(self, attn_backend: object) -> str | None:
        """What the loop takes of a step with `attn_backend`, for the execution plan (engine/executor/plan.py): None
        where no step can take it (a backend without a kernel plan, or weights it cannot read), else its form."""
        if getattr(attn_backend, "kernel_plan", None) is None:
            return None
        self._ensure_gathered()
        if self._weights is None:
            return None
        out = "C++ layer loop"
        if self._parts is not None:
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
        if plan is None:
            return None
        self._ensure_gathered()
        if ctx.lora_rows and not self._adapters_ok:
            return None
        if (self._weights is None or self._weights[0].dtype != h.dtype or len(ctx.kv_caches) != len(self.windows)
                or ctx.kv_caches[0][0].dtype != h.dtype):
            return None  # NOTE: the Python loop copes (write_kv casts nothing in C++, it checks)
        slot_mapping, chunks, groups, q_all, identity, sdpa, sdpa_ints, mask_windows = plan
        caches = [c for kv in ctx.kv_caches for c in kv]
        lora_w, lora_ints, lora_scales = self._adapters if ctx.lora_rows else _NO_ADAPTERS
        parts = self._parts
        split = (parts is not None and self.split and not ctx.lora_rows
                 and h.shape[0] >= max(self.split_from, self.packed_from))
        self.split_steps += split
        return kernels().layer_loop(h, residual, cos, sin, self._weights, caches, self.eps, self.windows, self.shape,
                                    self.packed_w, self.packed_from, self.scale, slot_mapping, chunks, groups, q_all,
                                    identity, lora_w, lora_ints, lora_scales, [s for s, _ in ctx.lora_rows],
                                    [r for _, r in ctx.lora_rows], parts.tensors if split else [],
                                    parts.cols if split else [], sdpa, sdpa_ints, mask_windows)
