"""Several PEFT LoRA adapters on one shared backbone, applied per token row inside a single forward.

Rows of the flat batch listed in ``ForwardContext.lora_rows`` under slot ``s`` get ``x @ A_s.T @ B_s.T * scale_s``
added to the base projection; every other row sees the base weights only. Only plain LoRA on ``nn.Linear`` is
supported; anything else in the adapter config is refused rather than silently ignored.

Two ways to add the updates of a step with several adapters through torch (the plan's `lora` part: `torch`,
`per_slot`, `stacked`):
- `per_slot`: for each adapter, gather its rows, two small products, scatter-add (S adapters: 3S ops a module);
- `stacked` (the S-LoRA / Punica idea, as dense products): every adapter's A stacked into one [sum r, in] and B
  into one [out, sum r]; all adapter rows go through both products at once, and a [rows, sum r] mask keeps each
  row's own adapter's columns (scaled). More arithmetic (each row meets every adapter's rank) for a constant
  number of ops, which wins once the per-op overhead of many adapters dominates.
`auto` takes `stacked` from `STACKED_FROM_ADAPTERS` adapters in a step (measured: docs/benchmarks/features.md,
scripts/bench_lora.py). On the CPU the plan's `lora=cpp` (its default where the extension built) adds the
updates through a C++ kernel instead, one call per projection and adapter (layers/lora_fused.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from orthrus_rag.layers.context import get_forward_context
from orthrus_rag.layers.wrapping import wrap_once
from orthrus_rag.layers.linear import gemv_rows, linear, packed_from
from orthrus_rag.layers.lora_fused import LoRAGroup, cached_group, forget_groups
from orthrus_rag.layers.row_deltas import attach_full_deltas, check_full_deltas, load_full_deltas

logger = logging.getLogger(__name__)
# how a LoRALinear adds several adapters' rows through torch: "auto" (per adapter below STACKED_FROM_ADAPTERS
# adapters in the step, else stacked), "per_slot" or "stacked"
LORA_KERNELS = ("auto", "per_slot", "stacked")
# `auto`: adapters with rows in a step from which the stacked product is used; tuned on one machine and kept for
# all: an AMD EPYC with AVX512-BF16, one thread, bf16 SmolLM2 (docs/benchmarks/features.md, adapters)
STACKED_FROM_ADAPTERS = 4

# "base_model.model.<module>.lora_A[.default].weight" -> (<module>, "A")
_KEY_RE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    # module name -> (A [r, in], B [out, r])
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # module name -> tuned minus base weight, for norms and embedding rows (layers/row_deltas.py)
    full_deltas: dict[str, torch.Tensor] = field(default_factory=dict)


def _check_config(cfg: dict, path: Path) -> None:
    """Refuse adapter features this layer does not implement (they would change the output silently)."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r} is not supported, only LORA")
    refused = {
        "use_dora": "DoRA (use_dora)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
        "modules_to_save": "modules_to_save (fully trained extra modules)",
        # NOTE: patterns give per-module rank/alpha, hence per-module scaling, which this format does not carry
        "rank_pattern": "rank_pattern",
        "alpha_pattern": "alpha_pattern",
        "lora_bias": "lora_bias",
        "layer_replication": "layer_replication",
        "trainable_token_indices": "trainable_token_indices",
        "use_qalora": "QA-LoRA (use_qalora)",
        "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    }
    for key, what in refused.items():
        if cfg.get(key):
            raise ValueError(f"{path}: {what} is not supported by orthrus_rag LoRA (got {key}={cfg[key]!r})")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias={cfg['bias']!r} is not supported, only 'none'")


def _load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if (path / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(path / "adapter_model.safetensors"))
    if (path / "adapter_model.bin").is_file():
        return torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"{path}: neither adapter_model.safetensors nor adapter_model.bin found")


def load_peft_adapter(path: str | os.PathLike, name: str | None = None) -> LoRAAdapter:
    """Read a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors/.bin) onto the CPU."""
    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        raise ValueError(f"{path}: not a PEFT adapter folder (adapter_config.json missing)")
    cfg = json.loads((path / "adapter_config.json").read_text())
    _check_config(cfg, path)
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank

    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _load_state_dict(path).items():
        m = _KEY_RE.match(key)
        if m is None:
            raise ValueError(f"{path}: unsupported adapter tensor {key!r} (only lora_A/lora_B of Linear layers)")
        halves.setdefault(m["module"], {})[m["ab"]] = tensor
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: module {module!r} has lora_{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{path}: {module!r} has A {tuple(a.shape)}, B {tuple(b.shape)}; expected rank {rank}")
        weights[module] = (a, b)
    if not weights:
        raise ValueError(f"{path}: adapter holds no LoRA weights")
    adapter = LoRAAdapter(name=name or path.name, rank=rank, scaling=scaling, weights=weights,
                          full_deltas=load_full_deltas(path))
    logger.info("loaded LoRA adapter %r: r=%d scaling=%.4g, %d modules", adapter.name, rank, scaling, len(weights))
    return adapter


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` that adds, per adapter slot, a low-rank update to the rows the forward context assigns it.

    It takes over the base layer's own weight/bias Parameters, so state_dict keys, weight tying and
    ``isinstance(m, nn.Linear)`` stay as before; the adapter tensors are non-persistent buffers.
    """

    def __init__(self, base: nn.Linear) -> None:
        nn.Module.__init__(self)  # NOTE: skip nn.Linear.__init__, which would allocate a fresh weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        if getattr(base, "_onednn", None) is not None:  # keep a packed base's oneDNN copy (layers/linear.py)
            self._onednn, self._onednn_from = base._onednn, packed_from(base)
        if getattr(base, "_quant", None) is not None:  # and a quantized base's weight (layers/quantized.py)
            self._quant = base._quant
        if gemv_rows(base):  # and the rows its few-row product takes (layers/linear.py)
            self._gemv_rows = gemv_rows(base)
        if getattr(base, "_fused", False):  # computed through a fused projection (layers/fused.py)
            self._fused = True
        self.scalings: dict[int, float] = {}
        self.kernel = "auto"  # set_lora_kernel
        self.cpu_kernel = False  # use_cpu_lora_kernel: `auto` on the CPU takes the C++ kernel
        self._stack: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple] | None = None

    def add_adapter(self, slot: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        assert a.shape[1] == self.in_features and b.shape[0] == self.out_features  # checked by attach_adapters
        like = dict(dtype=self.weight.dtype, device=self.weight.device)
        self.register_buffer(f"lora_A_{slot}", a.to(**like).contiguous(), persistent=False)
        self.register_buffer(f"lora_B_{slot}", b.to(**like).contiguous(), persistent=False)
        self.scalings[slot] = scaling
        self._stack = None
        self.__dict__.pop("_lora_group", None)  # NOTE: attach_adapters forgets the fused projections' groups

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
        """(A [sum r, in], B [out, sum r], each column's slot [sum r], each column's scaling [sum r], a key of the
        slots, ranks and scalings: modules with equal keys share a step's mask); built once."""
        if self._stack is None or self._stack[0].device != self.weight.device:
            slots = sorted(self.scalings)
            a = torch.cat([getattr(self, f"lora_A_{s}") for s in slots])
            b = torch.cat([getattr(self, f"lora_B_{s}") for s in slots], dim=1).contiguous()
            ranks = [getattr(self, f"lora_A_{s}").shape[0] for s in slots]
            col_slot = torch.repeat_interleave(torch.tensor(slots), torch.tensor(ranks)).to(a.device)
            col_scale = torch.repeat_interleave(torch.tensor([self.scalings[s] for s in slots]),
                                                torch.tensor(ranks)).to(a.device, a.dtype)
            key = tuple((s, r, self.scalings[s]) for s, r in zip(slots, ranks)) + (str(a.dtype),)
            self._stack = (a, b, col_slot, col_scale, key)
        return self._stack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_lora(x, linear(self, x))

    def lora_group(self) -> LoRAGroup | None:
        """This layer's adapters as the CPU kernel takes them (lora_fused.py; the C++ layer loop reads it too)."""
        return cached_group(self, [self], [self.out_features])

    def add_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (this layer's base output on `x`, possibly a slice of a fused projection's) plus each adapter's
        update on the rows the forward context assigns it."""
        lora_rows = get_forward_context().lora_rows
        if not lora_rows or not self.scalings:
            return y
        # rows index the flattened leading dims, so [B, S, in] and the engine's [T, in] are treated alike
        x2, y2 = x.reshape(-1, self.in_features), y.reshape(-1, self.out_features)
        group = self.lora_group()
        if group is not None and group.applies(x2):
            group.add(x2, y2, lora_rows)
            return y2.view(y.shape)
        if self.kernel == "stacked" or (self.kernel == "auto" and len(lora_rows) >= STACKED_FROM_ADAPTERS):
            return self._add_stacked(x2, y2, lora_rows).view(y.shape)
        for slot, rows in lora_rows:
            scaling = self.scalings.get(slot)
            if scaling is None or rows.numel() == 0:
                continue  # this adapter does not target this module / has no rows this step
            rows = rows.to(x.device)
            a, b = getattr(self, f"lora_A_{slot}"), getattr(self, f"lora_B_{slot}")
            delta = (x2.index_select(0, rows) @ a.T) @ b.T
            y2.index_add_(0, rows, delta, alpha=scaling)
        return y2.view(y.shape)

    def _add_stacked(self, x2: torch.Tensor, y2: torch.Tensor, lora_rows: list[tuple[int, torch.Tensor]],
                     ) -> torch.Tensor:
        ctx = get_forward_context()
        flat = ctx.lora_flat if ctx.lora_flat is not None else flat_lora_rows(lora_rows)
        rows = flat[0].to(x2.device)
        a, b, col_slot, col_scale, key = self._stacked()
        mask = ctx.lora_masks.get(key)
        if mask is None:
            # NOTE: a row of an adapter this module lacks matches no column: its mask row is zero, its update too
            mask = (flat[1].to(x2.device)[:, None] == col_slot[None, :]).to(a.dtype) * col_scale
            ctx.lora_masks[key] = mask
        h = (x2.index_select(0, rows) @ a.T) * mask
        y2.index_add_(0, rows, h @ b.T)
        return y2


def flat_lora_rows(lora_rows: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every adapter row of a step in one index tensor, and each row's slot (the stacked product's inputs)."""
    rows = torch.cat([r for _, r in lora_rows])
    slots = torch.cat([torch.full((r.numel(),), s, dtype=torch.long, device=r.device) for s, r in lora_rows])
    return rows, slots


def _set_on_lora_layers(model: nn.Module, name: str, value: object) -> int:
    """Set `name` on every LoRA layer of `model`, and on the model for the wrappers attach_adapters makes later;
    cached kernel operands are rebuilt. Returns how many layers."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for module in layers:
        setattr(module, name, value)
    setattr(model, f"_lora_{name}", value)
    adapters_changed(model)
    return len(layers)


def adapters_changed(model: nn.Module) -> None:
    """After `model`'s adapters or LoRA settings changed: cached kernel operands are rebuilt (the LoRA groups; and
    the model's own, e.g. the C++ layer loop's arguments, through its `kernel_inputs_changed`)."""
    forget_groups(model)
    refresh = getattr(model, "kernel_inputs_changed", None)
    if refresh is not None:
        refresh()


def set_lora_kernel(model: nn.Module, kernel: str) -> None:
    """Choose how every LoRA layer of `model` adds several adapters' updates (see the module's docstring)."""
    if kernel not in LORA_KERNELS:
        raise ValueError(f"unknown lora_kernel {kernel!r}; expected {', '.join(LORA_KERNELS)}")
    _set_on_lora_layers(model, "kernel", kernel)


def use_cpu_lora_kernel(model: nn.Module, enabled: bool = True) -> int:
    """Let `model`'s LoRA layers whose kernel is `auto` add their updates through the C++ kernel (the plan's
    `lora=cpp`, layers/lora_fused.py), or (`enabled=False`) through torch's ops again; callers check the extension built for
    the model's dtype. Returns how many layers."""
    return _set_on_lora_layers(model, "cpu_kernel", enabled)


def attach_adapters(model: nn.Module, adapters: list[LoRAAdapter]) -> dict[str, int]:
    """Wrap every targeted Linear of ``model`` in a LoRALinear and give each adapter the next free slot.

    Slots count from 1 per model and persist across calls; returns {adapter name: slot} for all attached ones.
    All names are checked before anything is changed, so a bad adapter leaves the model untouched.
    """
    slots: dict[str, int] = getattr(model, "_lora_slots", {})
    modules = dict(model.named_modules())
    seen = set(slots)
    for adapter in adapters:
        if adapter.name in seen:
            raise ValueError(f"LoRA adapter name {adapter.name!r} is already attached")
        seen.add(adapter.name)
        for module_name in adapter.weights:
            target = modules.get(module_name)
            if target is None:
                raise ValueError(f"adapter {adapter.name!r} targets {module_name!r}, which is not in the model")
            if not isinstance(target, nn.Linear):
                raise ValueError(f"adapter {adapter.name!r} targets {module_name!r}, a "
                                 f"{type(target).__name__}; only nn.Linear is supported")
            a, b = adapter.weights[module_name]
            if a.shape[1] != target.in_features or b.shape[0] != target.out_features:
                raise ValueError(f"adapter {adapter.name!r}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                                 f"{module_name!r} ({target.in_features} -> {target.out_features})")
        check_full_deltas(model, adapter.full_deltas, adapter.name)

    next_slot = max(slots.values(), default=0) + 1
    # NOTE: wrappers made now take the settings that set_lora_kernel / use_cpu_lora_kernel gave the model's others
    cpu_kernel, kernel = getattr(model, "_lora_cpu_kernel", False), getattr(model, "_lora_kernel", "auto")
    for slot, adapter in enumerate(adapters, start=next_slot):
        for module_name, (a, b) in adapter.weights.items():
            fresh = not isinstance(modules.get(module_name), LoRALinear)
            wrapped = wrap_once(model, modules, module_name, LoRALinear)
            if fresh:
                wrapped.cpu_kernel, wrapped.kernel = cpu_kernel, kernel
            wrapped.add_adapter(slot, a, b, adapter.scaling)
        attach_full_deltas(model, slot, adapter.full_deltas, adapter.name)
        slots[adapter.name] = slot
        logger.info("attached LoRA adapter %r as slot %d (%d modules)", adapter.name, slot, len(adapter.weights))
    model._lora_slots = slots  # type: ignore[assignment]  # NOTE: lets a later call continue the numbering
    adapters_changed(model)
    return dict(slots)
