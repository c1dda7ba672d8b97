"""A decoder layer's elementwise work as fused C++ kernels on the CPU: residual add + RMSNorm, rotary, SiLU-and-mul.

In eager torch a layer's elementwise work is ~25 small ops (the bf16 RMSNorm alone is a cast, the norm, a cast
back and the weight; rotary is a roll, four multiplies and adds per tensor). At decode sizes each costs its
dispatch, not its arithmetic: ~5 us on an EPYC core, ~4 ms of a 16 ms batch-1 step over SmolLM2's 30 layers.
These kernels do each group in one pass and one call. torch.compile'd versions of the same (dynamic token
counts) made a bf16 decode step slower on an AMD EPYC core (docs/design/cpu-kernels.md), so the CPU has these
instead.

Each keeps the rounding of the eager ops it replaces: in bf16 the residual sum is rounded before it is normed,
the normalised value before the weight multiplies it, and each product of rotary and of SiLU-and-mul before the
next op, as transformers' bf16 modules round. Sums and transcendentals run in fp32. Part of the engine's one
CPU extension (layers/cpu_extension.py); where it cannot be built the layers keep their torch ops.
"""

from __future__ import annotations

import torch

from orthrus_rag.layers.cpu_extension import kernels

DTYPES = (torch.float32, torch.bfloat16)


def available(dtype: torch.dtype) -> bool:
    return dtype in DTYPES and kernels() is not None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`residual += x` in place; returns `rms_norm(residual) * weight` (x, residual [T, N])."""
    return kernels().add_rms_norm(x, residual, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` in place on x [T, heads, D] (models/llama.py); returns x."""
    return kernels().rotary(x, cos, signed_sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return kernels().silu_mul(gate, up)
