"""Full (not low-rank) parameter deltas of an adapter, applied to its rows only: norm weights and embedding rows.

A fully fine-tuned embedding model differs from its base in every parameter. The Linear weights' differences
compress well into LoRA factors (layers/lora.py); a norm's weight vector or the token-embedding table do not, so
adapter extraction keeps them whole, in the adapter folder's `full_deltas.safetensors` next to PEFT's
`adapter_model.safetensors` (PEFT itself ignores that file). Keys are module names of the model plus
`.weight` ("model.norm.weight", "model.embed_tokens.weight"); each tensor is tuned minus base.

Rows of the flat batch that `ForwardContext.lora_rows` gives slot ``s`` see `weight + delta_s`; all other rows
see the base module bit for bit, so generation rows sharing the step are untouched.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call

from orthrus_rag.layers.context import get_forward_context
from orthrus_rag.layers.wrapping import wrap_once

logger = logging.getLogger(__name__)

FULL_DELTAS_FILE = "full_deltas.safetensors"


def load_full_deltas(path: Path) -> dict[str, torch.Tensor]:
    """{module name: delta of its weight} from an adapter folder; empty when it has no such file."""
    file = path / FULL_DELTAS_FILE
    if not file.is_file():
        return {}
    from safetensors.torch import load_file

    deltas = {}
    for key, tensor in load_file(str(file)).items():
        if not key.endswith(".weight"):
            raise ValueError(f"{file}: unsupported full delta {key!r} (only '<module>.weight')")
        deltas[key[: -len(".weight")]] = tensor
    return deltas


class RowDeltaModule(nn.Module):
    """Wraps a module whose only parameter is `weight` (an RMSNorm, an Embedding) and, per adapter slot, runs it
    with `weight + delta` on that slot's rows. Rows index dim 0, the engine's flat token dimension (a per-head
    q/k norm sees [T, heads, head_dim])."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        names = [n for n, _ in base.named_parameters(recurse=False)]
        if names != ["weight"]:
            raise ValueError(f"full deltas apply to modules with one `weight` parameter, not {type(base).__name__} "
                             f"with {names}")
        self.base = base
        self.deltas: dict[int, torch.Tensor] = {}

    @property
    def weight(self) -> nn.Parameter:  # NOTE: weight tying (lm_head = embed_tokens) keeps finding the table
        return self.base.weight

    def add_delta(self, slot: int, delta: torch.Tensor) -> None:
        assert delta.shape == self.base.weight.shape  # checked by attach_full_deltas
        self.deltas[slot] = delta.to(dtype=self.base.weight.dtype, device=self.base.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        lora_rows = get_forward_context().lora_rows
        if not lora_rows or not self.deltas:
            return y
        for slot, rows in lora_rows:
            delta = self.deltas.get(slot)
            if delta is None or rows.numel() == 0:
                continue
            rows = rows.to(x.device)
            weight = self.base.weight + delta
            y.index_copy_(0, rows, functional_call(self.base, {"weight": weight}, (x.index_select(0, rows),)))
        return y


def check_full_deltas(model: nn.Module, deltas: dict[str, torch.Tensor], adapter: str) -> None:
    """Refuse deltas for modules the model lacks or that they do not fit (before anything is changed)."""
    modules = dict(model.named_modules())
    for name, delta in deltas.items():
        target = modules.get(name)
        if target is None:
            raise ValueError(f"adapter {adapter!r} has a full delta for {name!r}, which is not in the model")
        base = target.base if isinstance(target, RowDeltaModule) else target
        weight = getattr(base, "weight", None)
        if weight is None or weight.shape != delta.shape:
            raise ValueError(f"adapter {adapter!r}: full delta {tuple(delta.shape)} does not fit {name!r}")
        if isinstance(base, nn.Linear):
            raise ValueError(f"adapter {adapter!r}: {name!r} is a Linear; its delta belongs in the LoRA factors")


def attach_full_deltas(model: nn.Module, slot: int, deltas: dict[str, torch.Tensor], adapter: str) -> None:
    """Wrap each named module in a RowDeltaModule (once) and give it `slot`'s delta."""
    check_full_deltas(model, deltas, adapter)
    modules = dict(model.named_modules())
    for name, delta in deltas.items():
        wrap_once(model, modules, name, RowDeltaModule).add_delta(slot, delta)
    if deltas:
        logger.info("adapter %r: full deltas on %d modules", adapter, len(deltas))
