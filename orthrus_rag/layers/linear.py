"""Linear layers' GEMM kernel on CPU: torch's dense matmul (MKL for fp32, oneDNN for bf16) or a oneDNN-packed copy
of the weight (fp32 or bf16, the model's dtype).

Which is faster depends on the CPU, so the engine measures at load time (`choose_kernel`) rather than assuming:
on an AMD EPYC MKL's sgemm reached ~205-225 GFLOP/s on 2 threads against oneDNN's ~400-475 on the
model's shapes; on a Xeon (Emerald Rapids, 2 threads) MKL is as fast for 32-256 rows and 1.5-3x faster for one
row (a decode step at batch 1), because oneDNN's public path converts each activation to its layout and back.
The packed copy is oneDNN's own blocked layout, multiplied by through `mkldnn._linear_pointwise` (dense input
against the packed weight, what inductor emits), so no activation is converted.

`pack_linears` keeps a oneDNN copy of each Linear's weight (the dense Parameters stay, so state_dict, weight
tying and adapters see no change) and routes the forward through it: a second copy of the linear weights in
memory, acceptable for the small models the CPU path runs.

A step of a few rows (a decode at small batch) reads every weight once and does little else, so its time is the
weights' bytes over the memory bandwidth. In bf16 on a CPU with AVX512-BF16 the extension's few-row product
(csrc/gemv_bf16.h) streams the dense weight at the core's read bandwidth, where oneDNN's packed product read it
at 0.6-0.8 of that on an AMX Xeon. `use_gemv` routes inputs of up to `_gemv_rows` rows through it, on the dense
weight (no copy); `choose_gemv_rows` times it against what those rows would run otherwise, once per machine.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from orthrus_rag import machine
from orthrus_rag.layers.cpu_extension import kernels

logger = logging.getLogger(__name__)
KERNELS = ("auto", "dense", "onednn")

GEMV_MAX_ROWS = 4  # csrc/gemv_bf16.h kMaxRows
GEMV_BUCKETS = (1, 2, 4)
# bytes of weights each shape's timing cycles through: more than a last-level cache holds, so the products read
# memory as a model's layers do (a single small weight stays in cache and times another kernel's best case)
GEMV_TIMED_BYTES = 96 << 20
GEMV_MAX_COPIES = 2048  # and no more weights than this (a tiny model's shapes: Python's overhead would time alone)


PACKABLE = (torch.float32, torch.bfloat16)


def onednn_available(dtype: torch.dtype, device: str | torch.device) -> bool:
    """oneDNN packing applies on CPU to fp32 and bf16 weights (bf16's dense matmul is oneDNN too, but it reorders
    the weight at every call: ~5-10% of a small GEMM, measured on an EPYC core). bf16 only where torch's oneDNN
    runs it (`machine.onednn_bf16_supported`: not on AVX2-only CPUs, whose bf16 linears stay dense)."""
    if torch.device(device).type != "cpu" or dtype not in PACKABLE or _POINTWISE is None:
        return False
    return dtype != torch.bfloat16 or machine.onednn_bf16_supported()


def check_packable(dtype: torch.dtype) -> None:
    """Raise the one-line error for a oneDNN copy in `dtype` that this CPU cannot run (torch's own is raised from
    inside the reorder, and names no fallback)."""
    if dtype == torch.bfloat16 and not machine.onednn_bf16_supported():
        raise ValueError(f"oneDNN's packed bf16 linears need the CPU flags {machine.ONEDNN_BF16_FLAGS}, which "
                         f"this CPU ({machine.cpu_model()}) lacks: use model.kernel_overrides={{linears: dense}} (or "
                         "auto) for bf16, or dtype=float32")


def _pointwise_op():  # -> torch.ops.mkldnn._linear_pointwise or None
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    return op if op is not None and torch.backends.mkldnn.is_available() else None


_POINTWISE = _pointwise_op()
# oneDNN's own blocked layout for a linear weight (what inductor packs with): read at 24-31 GB/s by a one-row
# product on an EPYC core against 15-17 GB/s for a plain `to_mkldnn` copy or the dense weight (30 layers of
# SmolLM2, bf16 and fp32: docs/design/cpu-kernels.md); the pointwise op reads it
_REORDER = torch.ops.mkldnn._reorder_linear_weight if _POINTWISE is not None else None


def onednn_linear(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    w, b = packed
    return _POINTWISE(x, w, b, "none", [], "")


def blocked_packing() -> bool:
    """Whether this torch packs weights in oneDNN's blocked layout and multiplies by them (`pack_weight`)."""
    return _POINTWISE is not None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] (contiguous) in oneDNN's blocked layout, as `onednn_linear` multiplies by it."""
    if _REORDER is None:
        raise RuntimeError("this torch has no oneDNN (mkldnn._reorder_linear_weight / _linear_pointwise)")
    check_packable(weight.dtype)
    return _REORDER(weight)


def packed_from(module: nn.Module) -> int:
    """The row count from which `linear` multiplies by `module`'s oneDNN copy (fewer rows take the dense weight)."""
    return getattr(module, "_onednn_from", 1)


def _packed_for(module: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`module`'s oneDNN copy if `x` is to be multiplied by it (it has one, and `x` has at least `packed_from` rows
    on the CPU in the weight's dtype), else None: the dense weight."""
    packed = getattr(module, "_onednn", None)
    if (packed is None or x.dtype != module.weight.dtype or x.device.type != "cpu"
            or x.numel() < packed_from(module) * x.shape[-1]):
        return None
    return packed


def gemv_rows(module: nn.Module) -> int:
    """Inputs of up to this many rows take `module`'s few-row bf16 product (0: none do)."""
    return getattr(module, "_gemv_rows", 0)


_NO_BIAS = torch.empty(0, dtype=torch.bfloat16)


def _gemv(module: nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """`module`'s affine map of `x` by the few-row bf16 product, or None where `x` is not for it (more rows, another
    dtype or device, or autograd recording: the C++ product has no backward)."""
    rows = gemv_rows(module)
    if (not rows or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.numel() == 0
            or x.numel() > rows * x.shape[-1] or torch.is_grad_enabled()):
        return None
    bias = module.bias if module.bias is not None else _NO_BIAS
    y = kernels().gemv_bf16(x.reshape(-1, x.shape[-1]), module.weight, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module`'s affine map: on its quantized weight where it has one (layers/quantized.py), else by the few-row
    bf16 product where `x` has at most `gemv_rows` rows, else on its oneDNN copy when it has one and `x` has at
    least `packed_from` rows, else on the dense weight."""
    quant = getattr(module, "_quant", None)
    if quant is not None:
        y = quant.matmul(x)
        return y if module.bias is None else y + module.bias
    if (y := _gemv(module, x)) is not None:
        return y
    packed = _packed_for(module, x)
    return F.linear(x, module.weight, module.bias) if packed is None else onednn_linear(x, packed)


def linear_gelu(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The exact (erf) GELU of `module`'s affine map. On its oneDNN copy the GELU runs in the GEMM's epilogue, on the
    output while it is in cache: a separate op reads and writes the whole [rows, out] product once more (MiniLM's
    FFN, 4,096 rows in bf16 on 2 EPYC cores: GELU 1.7 ms fused against 2.2 ms as torch's op, on an 11.6 ms GEMM)."""
    packed = _packed_for(module, x)
    if packed is None:
        return F.gelu(linear(module, x))
    w, b = packed
    return _POINTWISE(x, w, b, "gelu", [], "none")


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward is `linear` (its oneDNN copy or quantized weight, layers/quantized.py); it takes
    over the base layer's Parameters."""

    def __init__(self, base: nn.Linear) -> None:
        nn.Module.__init__(self)  # NOTE: skip nn.Linear.__init__, which would allocate a fresh weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self, x)


def pack_module(module: nn.Linear, from_rows: int | None = None) -> None:
    """(Re)build `module`'s oneDNN copy from its current dense weight and bias; `linear` takes it for inputs of at
    least `from_rows` rows (default: as before, else 1)."""
    check_packable(module.weight.dtype)
    module._onednn_from = from_rows if from_rows is not None else packed_from(module)  # type: ignore[assignment]
    with torch.no_grad():
        weight = module.weight.detach().contiguous()
        bias = module.bias.detach().contiguous() if module.bias is not None else None
        # NOTE: a plain attribute, not a buffer: it must not reach state_dict or `.to()`
        module._onednn = (pack_weight(weight), bias)  # type: ignore[assignment]


def model_linears(model: nn.Module) -> Iterator[tuple[nn.Module, str | None, nn.Linear]]:
    """(parent, attribute, layer) of each Linear `model` multiplies by: the carriers of fused projections
    (attribute None: not a child; the layers computed through them, layers/fused.py, are left out) and the others."""
    for parent in list(model.modules()):
        for fusion in getattr(parent, "fusions", {}).values():
            yield parent, None, fusion.carrier
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and not getattr(child, "_fused", False):
                yield parent, name, child


def _packable(module: nn.Linear, keep: Callable[[nn.Linear], bool]) -> bool:
    """Whether `pack_linears(model, keep)` packs `module`: selected, and not quantized (no dense weight to pack)."""
    return keep(module) and getattr(module, "_quant", None) is None


def linear_shapes(model: nn.Module, keep: Callable[[nn.Linear], bool] = lambda m: True) -> list[tuple[int, int]]:
    """The distinct (in, out) shapes of the Linears that `pack_linears(model, keep)` packs (a quantized model's
    layers have none, so their kernel is not timed)."""
    return sorted({(m.in_features, m.out_features) for _, _, m in model_linears(model) if _packable(m, keep)})


def pack_linears(model: nn.Module, keep: Callable[[nn.Linear], bool] = lambda m: True, from_rows: int = 1) -> int:
    """Give every nn.Linear of `model` that `keep` selects a oneDNN copy, taken from `from_rows` rows up; plain ones
    become PackedLinear (subclasses such as LoRALinear call `linear` themselves). Layers computed through a fused
    projection (layers/fused.py) are left out: the fusion's own weight is packed instead. Returns how many were
    packed."""
    count = 0
    for parent, name, child in model_linears(model):
        if not _packable(child, keep):
            continue
        if name is not None and type(child) is nn.Linear:
            child = PackedLinear(child)
            setattr(parent, name, child)
        pack_module(child, from_rows)
        count += 1
    logger.debug("packed %d linear layers for oneDNN (from %d rows)", count, from_rows)
    refresh = getattr(model, "kernel_inputs_changed", None)  # NOTE: holders of the packed weights gather them anew
    if refresh is not None:
        refresh()
    return count


def gemv_available(dtype: torch.dtype, device: str | torch.device) -> str | None:
    """Why the few-row bf16 product cannot run for `dtype` on `device` (None: it can)."""
    if torch.device(device).type != "cpu":
        return f"it runs on the CPU, not on {device}"
    if dtype != torch.bfloat16:
        return f"it multiplies bf16 weights, not {str(dtype).removeprefix('torch.')}"
    ext = kernels()
    if ext is None:
        return "the C++ CPU extension did not build (see the log for why)"
    if not ext.gemv_bf16_runs():
        return f"it needs avx512_bf16, which this build's CPU target ({machine.march()}) lacks"
    return None


def use_gemv(model: nn.Module, keep: Callable[[nn.Linear], bool] = lambda m: True, rows: int = GEMV_MAX_ROWS) -> int:
    """Route inputs of up to `rows` rows (0: none) of every bf16 Linear of `model` that `keep` selects through the
    few-row product, on its dense weight; plain ones become PackedLinear, as `pack_linears` makes them. Returns
    how many."""
    count = 0
    for parent, name, child in model_linears(model):
        if not _packable(child, keep) or child.weight.dtype != torch.bfloat16 or not child.weight.is_contiguous():
            continue
        if name is not None and type(child) is nn.Linear:
            child = PackedLinear(child)
            setattr(parent, name, child)
        child._gemv_rows = rows  # type: ignore[assignment]
        count += 1
    refresh = getattr(model, "kernel_inputs_changed", None)  # NOTE: the layer loop reads the row count
    if refresh is not None:
        refresh()
    return count


def _time(fn, repeats: int = 3) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):  # NOTE: the fastest of a few: a timing that another process interrupted is dropped
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


ROW_BUCKETS = (1, 4, 16, 64, 256)


@torch.inference_mode()
def choose_kernel(shapes: Iterable[tuple[int, int]], rows: tuple[int, ...] = ROW_BUCKETS,
                  dtype: torch.dtype = torch.float32) -> int | None:
    """The row count from which oneDNN's packed copy runs the given (in, out) weight shapes faster than the dense
    matmul here, or None where it does not pay (a few tens of milliseconds on a small model).

    The two cross over: with AVX2 code on an EPYC core MKL ran one row 1.4x faster than oneDNN (a decode at batch
    1) and oneDNN 4-256 rows 5-20% faster (measured in fp32 on SmolLM2's shapes), so one kernel for every row count
    lost either way. Per row bucket the time ratio is the geometric mean over the shapes; the threshold is the
    bucket from which taking oneDNN gives the lowest summed log-ratio over the buckets, each bucket weighing the
    same: decode steps (a few rows) matter as much as prompt chunks, although they take less time each. oneDNN must
    save 5% over all the buckets to be used at all: its packed copy costs memory."""
    shapes = sorted(set(shapes))
    logs = {m: 0.0 for m in rows}
    for k, n in shapes:
        w, b = (torch.randn(n, k) * 0.02).to(dtype), torch.zeros(n, dtype=dtype)
        layer = nn.Linear(k, n)
        layer.weight.data, layer.bias.data = w, b
        pack_module(layer, 1)
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            logs[m] += math.log(_time(lambda: linear(layer, x)) / _time(lambda: F.linear(x, w, b))) / len(shapes)
    # the saving of taking oneDNN from each bucket up: sum of the log-ratios from there (negative: faster)
    saving = {m: sum(v for r, v in logs.items() if r >= m) for m in rows}
    best = min(rows, key=lambda m: (saving[m], m))
    choice = best if saving[best] < math.log(0.95) * len(rows) else None
    logger.debug("linear kernel (%s, %d shapes): %s; oneDNN's time / dense per rows: %s", str(dtype).removeprefix(
        "torch."), len(shapes), "dense" if choice is None else f"oneDNN from {choice} rows",
        ", ".join(f"{m}: {math.exp(v):.2f}" for m, v in logs.items()))
    return choice


@torch.inference_mode()
def choose_gemv_rows(shapes: Iterable[tuple[int, int]], packed_from_rows: int | None,
                     rows: tuple[int, ...] = GEMV_BUCKETS) -> int:
    """Up to how many rows the few-row bf16 product runs these (in, out) shapes faster than the kernel those rows
    take otherwise (oneDNN's packed copy from `packed_from_rows` rows, else the dense weight): the largest bucket
    of `rows` up to which it saves 5% at every bucket (geometric mean over the shapes), 0 where it does not at one
    row. Timed over GEMV_TIMED_BYTES of weights per shape, as a step reads them: from memory."""
    ext = kernels()
    logs = {m: 0.0 for m in rows}
    shapes = sorted(set(shapes))
    for k, n in shapes:
        # NOTE: views of one tensor: thousands of tiny nn.Linear modules would cost more to make than to time
        copies = min(GEMV_MAX_COPIES, max(1, GEMV_TIMED_BYTES // (2 * k * n)))
        weights = (torch.randn(copies, n, k) * 0.02).to(torch.bfloat16)
        packed = [pack_weight(w) for w in weights] if packed_from_rows is not None else []
        for m in rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            ours = _time(lambda: [ext.gemv_bf16(x, w, _NO_BIAS) for w in weights])
            if packed and m >= packed_from_rows:
                theirs = _time(lambda: [_POINTWISE(x, p, None, "none", [], "") for p in packed])
            else:
                theirs = _time(lambda: [F.linear(x, w) for w in weights])
            logs[m] += math.log(ours / theirs) / len(shapes)
        del weights, packed
    chosen = 0
    for m in rows:
        if logs[m] >= math.log(0.95):
            break
        chosen = m
    logger.debug("few-row bf16 product (%d shapes): up to %d rows; its time / the other kernel's per rows: %s",
                 len(shapes), chosen, ", ".join(f"{m}: {math.exp(v):.2f}" for m, v in logs.items()))
    return chosen
