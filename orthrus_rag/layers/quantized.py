"""Weight-only int8 and int4 linears on the CPU: the weights stored quantized, the activations in the model's dtype.

On a CPU a decode step at small batch is bound by the bytes of weights it reads; int8 halves them against bf16 and
int4 quarters them. The products are torch's own CPU kernels: `_weight_int8pack_mm` (int8, one scale per output
row, symmetric) and `_weight_int4pack_mm_for_cpu` (int4 in groups of `INT4_GROUP` input columns, a scale and a zero
per group: w = (q - 8) * scale + zero, q in 0..15; the weight packed once by `_convert_weight_to_int4pack_for_cpu`).

`quantize_linears` gives each selected Linear a `QuantWeight` and drops its dense weight (a zero-size Parameter of
the same dtype stays, so dtype and device reads, adapters and state_dict names keep working); `linear.linear`
multiplies by it. LoRA adapters stay in the model's dtype on top of the quantized base, as QLoRA does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from orthrus_rag.config.kernels import QUANTIZATIONS
from orthrus_rag.layers.linear import PackedLinear, model_linears

logger = logging.getLogger(__name__)

INT4_GROUP = 32  # the input columns sharing one scale and zero: GGUF's block (Q4_0 / Q4_1), the kernel's smallest
# int8: from this many rows the weight is widened to the activations' dtype and multiplied by the dense product, its
# row scales applied after. torch's int8 kernel takes time in proportion to the rows (it works through the weight
# again for every few rows): on one Xeon core, SmolLM2's shapes in bf16, it was even with the widened product at 16
# rows and 3.4-7.9x slower at 64-256 (gate/up at 256 rows: 12.3 ms against 1.6; the bf16 weight itself 1.0). The
# codes are exact in bf16 and fp32, so only the output's rounding differs (once more, by the scale).
INT8_DENSE_FROM = 16
# NOTE: the int4 kernel's K tiling: 1 is the packing torch's own CPU int4 path (torchao, gpt-fast) uses
_INNER_K_TILES = 1
_aten = torch.ops.aten


@dataclass(frozen=True)
class QuantWeight:
    """One Linear's weight, quantized: `kind` int8 ([out, in] int8 and [out] scales) or int4 (torch's packed
    layout, [in / group, out, 2] scales and zeros); `scales` are in the activations' dtype."""

    kind: str
    weight: torch.Tensor
    scales: torch.Tensor
    in_features: int
    out_features: int
    group: int = 0  # int4's group size; 0 for int8

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] times the weight: [..., out] in x's dtype."""
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        if self.kind == "int8" and rows.shape[0] >= INT8_DENSE_FROM:
            # NOTE: as the C++ layer loop computes it (csrc/packed_product.h `quantized`), op for op
            y = torch.nn.functional.linear(rows, self.weight.to(rows.dtype)).mul_(self.scales)
        elif self.kind == "int8":
            y = _aten._weight_int8pack_mm(rows, self.weight, self.scales)
        else:
            y = _aten._weight_int4pack_mm_for_cpu(rows, self.weight, self.group, self.scales)
        return y.view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scales.numel() * self.scales.element_size()


def check_quantization(kind: str, device: str | torch.device) -> None:
    """Raise the one-line error for a quantization (resolved: not auto) this build cannot run."""
    if kind not in QUANTIZATIONS or kind == "auto":
        raise ValueError(f"model.quantization={kind!r}: expected one of {', '.join(QUANTIZATIONS)}")
    if kind != "none" and torch.device(device).type != "cpu":
        raise ValueError(f"model.quantization={kind} runs on the CPU (torch's weight-only CPU kernels); "
                         f"use quantization=none on {torch.device(device).type}")


def _int8_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: the codes [out, in] and the scales [out] (max |w| / 127 over the row)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def _int4_parts(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group` input columns: the codes [out, in] (0..15, q = round((w - min) /
    scale), scale = (max - min) / 15), and per group [out, in / group] the scales and the zeros as torch's kernel
    reads them (w = (q - 8) * scale + zero, so zero = min + 8 * scale)."""
    out_features, in_features = weight.shape
    if in_features % group:
        raise ValueError(f"int4 quantization needs in_features ({in_features}) to be a multiple of {group}")
    w = weight.detach().float().reshape(out_features, in_features // group, group)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
    return codes.reshape(out_features, in_features), scales, low + 8 * scales


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype | None = None) -> QuantWeight:
    q, scales = _int8_parts(weight)
    return QuantWeight("int8", q.contiguous(), scales.to(dtype or weight.dtype), weight.shape[1], weight.shape[0])


def quantize_int4(weight: torch.Tensor, dtype: torch.dtype | None = None, group: int = INT4_GROUP) -> QuantWeight:
    codes, scales, zeros = _int4_parts(weight, group)
    return int4_from_codes(codes, scales, zeros, dtype or weight.dtype, group)


def dequantized(weight: torch.Tensor, kind: str, group: int = INT4_GROUP) -> torch.Tensor:
    """The fp32 weight [out, in] that `kind`'s quantization of `weight` stands for, from its codes and scales (no
    kernel): what the quantized product multiplies by, for references and tests."""
    if kind == "int8":
        q, scales = _int8_parts(weight)
        return q.float() * scales[:, None]
    codes, scales, zeros = _int4_parts(weight, group)
    return (codes.float() - 8) * scales.repeat_interleave(group, 1) + zeros.repeat_interleave(group, 1)


def int4_from_codes(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype,
                    group: int) -> QuantWeight:
    """An int4 weight from its codes [out, in] (0..15), and per group [out, in / group] its scales and zeros (w =
    (q - 8) * scale + zero): what a quantized checkpoint's blocks map to."""
    out_features, in_features = codes.shape
    packed = _aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), _INNER_K_TILES)
    scales_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return QuantWeight("int4", packed, scales_zeros, in_features, out_features, group)


QUANTIZERS: dict[str, Callable[..., QuantWeight]] = {"int8": quantize_int8, "int4": quantize_int4}
# rows quantized at a time by `quantize_rows`: a multiple of the int4 packing's 64-row blocks, so packed chunks
# concatenated equal the whole matrix packed at once
ROW_CHUNK = 4096


def quantize_rows(read: Callable[[int, int], torch.Tensor], rows: int, kind: str, dtype: torch.dtype) -> QuantWeight:
    """`kind`'s weight of a [rows, in] matrix read `ROW_CHUNK` rows at a time (`read(start, stop)`), so that the
    whole matrix is never held in fp32 (a 128k-token embedding table is 2 GB in fp32). Both quantizations are per
    row (int4's groups lie along a row), so the result equals quantizing the whole."""
    parts = [QUANTIZERS[kind](read(start, min(start + ROW_CHUNK, rows)), dtype) for start in range(0, rows, ROW_CHUNK)]
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return QuantWeight(kind, torch.cat([q.weight for q in parts]),
                       torch.cat([q.scales for q in parts], dim=0 if kind == "int8" else 1),
                       first.in_features, rows, first.group)


def _drop_dense(module: nn.Linear) -> None:
    """Free `module`'s dense weight: a zero-size Parameter of its dtype and device stays in its place."""
    module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)


def quantize_linears(model: nn.Module, kind: str, keep: Callable[[nn.Linear], bool] = lambda m: True,
                     weight_of: Callable[[nn.Linear], torch.Tensor | QuantWeight | None] | None = None,
                     quiet: bool = False) -> int:
    """Quantize every Linear of `model` that `keep` selects (fused projections through their carrier, whose parts'
    views are dropped too) to `kind`; plain ones become `linear.PackedLinear`, whose forward is `linear.linear`.
    `weight_of(layer)`: the weight to quantize where it is not the layer's own (the checkpoint's values, before
    their copy in the model's dtype), or its quantized weight already made; the scales are in the layer's dtype
    either way. Returns how many were
    quantized; `quiet` logs the count at DEBUG (a loader quantizing layer by layer)."""
    if kind == "none":
        return 0
    quantize = QUANTIZERS[kind]
    count = before = after = 0
    for parent, name, child in model_linears(model):
        if not keep(child) or getattr(child, "_quant", None) is not None:
            continue
        if name is not None and type(child) is nn.Linear:
            child = PackedLinear(child)
            setattr(parent, name, child)
        before += child.weight.numel() * child.weight.element_size()
        source = weight_of(child) if weight_of is not None else None
        with torch.no_grad():
            child._quant = source if isinstance(source, QuantWeight) else quantize(  # type: ignore[assignment]
                child.weight if source is None else source, child.weight.dtype)
        after += child._quant.nbytes
        vars(child).pop("_onednn", None)  # NOTE: a packed copy of the dense weight would be stale now
        _drop_dense(child)
        if name is None:  # a fusion's carrier: its parts' weights are views of the dense weight
            for fusion in getattr(parent, "fusions", {}).values():
                if fusion.carrier is child:
                    for part in fusion.names:
                        _drop_dense(getattr(parent, part))
        count += 1
    logger.log(logging.DEBUG if quiet else logging.INFO, "quantized %d linear layers to %s: %.0f MB -> %.0f MB",
               count, kind, before / 1e6, after / 1e6)
    refresh = getattr(model, "kernel_inputs_changed", None)
    if refresh is not None:
        refresh()
    return count
