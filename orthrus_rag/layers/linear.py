"""Linear layers on oneDNN for fp32 on CPU.

torch's dense fp32 matmul goes to MKL's sgemm, which on AMD CPUs (this project's 2-core EPYC) runs about half as
fast as oneDNN on the same shapes (measured 205-225 vs 400-475 GFLOP/s for 128-512 x 576 x 1536 on 2 threads);
vLLM's CPU backend uses oneDNN too. `pack_linears` keeps a oneDNN copy of each Linear's weight (the dense
Parameters stay, so state_dict, weight tying and adapters see no change) and routes the forward through it.
The cost is a second copy of the linear weights in memory, acceptable for the small models the CPU path runs.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def onednn_available(dtype: torch.dtype, device: str | torch.device) -> bool:
    """oneDNN packing applies to fp32 on CPU (bf16 already takes oneDNN in torch's own matmul)."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module`'s affine map, on its oneDNN copy when it has one."""
    packed = getattr(module, "_onednn", None)
    if packed is None or x.dtype != torch.float32 or x.device.type != "cpu":
        return F.linear(x, module.weight, module.bias)
    w, b = packed
    return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), w, b).to_dense()


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward uses the oneDNN copy; it takes over the base layer's Parameters."""

    def __init__(self, base: nn.Linear) -> None:
        nn.Module.__init__(self)  # NOTE: skip nn.Linear.__init__, which would allocate a fresh weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self, x)


def pack_module(module: nn.Linear) -> None:
    """(Re)build `module`'s oneDNN copy from its current dense weight and bias."""
    with torch.no_grad():
        w = module.weight.detach().contiguous().to_mkldnn()
        bias = module.bias.detach() if module.bias is not None else torch.zeros(module.out_features)
        # NOTE: a plain attribute, not a buffer: it must not reach state_dict or `.to()`
        module._onednn = (w, bias.contiguous().to_mkldnn())  # type: ignore[assignment]


def pack_linears(model: nn.Module) -> int:
    """Give every nn.Linear of `model` a oneDNN copy; plain ones become PackedLinear (subclasses such as
    LoRALinear call `linear` themselves). Returns how many were packed."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if type(child) is nn.Linear:
                child = PackedLinear(child)
                setattr(parent, name, child)
            pack_module(child)
            count += 1
    logger.info("packed %d linear layers for oneDNN", count)
    return count
