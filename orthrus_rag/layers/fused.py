"""Projections that read the same input, run as one GEMM: Q/K/V, and gate/up of the MLP.

Checkpoints, PEFT adapters and state_dict keep naming the separate layers (`q_proj`, `k_proj`, ...), so those
stay registered modules; `fuse` concatenates their weights into one matrix held by an unregistered carrier Linear
and re-points each layer's Parameters at views of it (no second copy). The forward computes all parts with one
GEMM and splits the output; parts wrapped by a LoRA adapter add their low-rank update to their own slice, so
adapter rows still apply per projection (on the CPU, the parts' updates in one kernel call: layers/lora_fused.py).

Fuse after the model is on its device and dtype (`.to()` would copy the parts apart again) and after loading
weights; loading into a fused model still works, since the parts are views.
"""

from __future__ import annotations

import torch
from torch import nn

from orthrus_rag.layers.context import get_forward_context
from orthrus_rag.layers.linear import linear
from orthrus_rag.layers.lora_fused import LoRAGroup, cached_group


class Fusion:
    """The concatenated weight of `names` (Linear children of one module, same in_features)."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]) -> None:
        parts = [getattr(owner, name) for name in names]
        if len({p.in_features for p in parts}) != 1:
            raise ValueError(f"cannot fuse {names}: different in_features")
        has_bias = [p.bias is not None for p in parts]
        if any(has_bias) and not all(has_bias):
            raise ValueError(f"cannot fuse {names}: some have a bias and some do not")
        self.names = names
        self.sizes = [p.out_features for p in parts]
        with torch.no_grad():
            weight = torch.cat([p.weight for p in parts])
            bias = torch.cat([p.bias for p in parts]) if all(has_bias) else None
        self.carrier = nn.Linear(parts[0].in_features, sum(self.sizes), bias=bias is not None,
                                 device="meta")
        self.carrier.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            self.carrier.bias = nn.Parameter(bias, requires_grad=False)
        start = 0
        for part, size in zip(parts, self.sizes):  # the parts become views of the fused matrix
            part.weight = nn.Parameter(weight[start:start + size], requires_grad=False)
            if bias is not None:
                part.bias = nn.Parameter(bias[start:start + size], requires_grad=False)
            part._fused = True  # type: ignore[assignment]  # pack_linears packs the carrier instead
            start += size

    def lora_group(self, owner: nn.Module) -> LoRAGroup | None:
        """The parts' adapters as the CPU kernel takes them, one call for them all (lora_fused.py; the C++ layer
        loop reads it too)."""
        # NOTE: the children straight from _modules: nn.Module.__getattr__'s fallback costs ~1 us a name per layer
        return cached_group(self, [owner._modules[name] for name in self.names], self.sizes)

    def __call__(self, owner: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
        """The parts' outputs (views of one [T, Σ out] result), LoRA updates added per part."""
        y = linear(self.carrier, x)
        lora_rows = get_forward_context().lora_rows
        if lora_rows:
            group = self.lora_group(owner)
            if group is not None and group.applies(x):  # the C++ kernel: every part's update in one call
                group.add(x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1]), lora_rows)
                lora_rows = []
        outs = list(y.split(self.sizes, dim=-1))
        if not lora_rows:
            return outs
        for i, name in enumerate(self.names):
            add_lora = getattr(owner._modules[name], "add_lora", None)
            if add_lora is not None:
                outs[i] = add_lora(x, outs[i])
        return outs


def project(owner: nn.Module, key: str, names: tuple[str, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of `owner`'s Linear children `names` on `x`: one GEMM when `fuse` ran, else one each."""
    fusion = getattr(owner, "fusions", {}).get(key)
    if fusion is not None:
        return fusion(owner, x)
    return [getattr(owner, name)(x) for name in names]


def fuse(owner: nn.Module, key: str, names: tuple[str, ...]) -> None:
    fusions = owner.__dict__.setdefault("fusions", {})  # NOTE: plain attribute: never in state_dict or .to()
    fusions[key] = Fusion(owner, names)
