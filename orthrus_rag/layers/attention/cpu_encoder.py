"""Bidirectional attention for an encoder's packed batch on the CPU: every row attends to all the rows of its own
sequence, sequences back to back, no padding and no mask.

The encoder (models/bert.py) ran one torch SDPA call per sequence per layer. On MiniLM's shapes (12 heads of 32,
passages of ~100 tokens) the CPU flash kernel reached ~40 GFLOP/s in bf16 or fp32 whether called per sequence or
batched, so attention was ~29% of a corpus build's encoder time (3.0 of 10.5 s for 1,000 passages, bf16, 2 EPYC
cores). This runs the chunked-prefill kernel's AVX512-BF16 body (attention/cpu_prefill.py: `vdpbf16ps` blocks,
fp32 scores and softmax, P rounded to bf16 before P @ V) with every key of a sequence visible, one call per layer
for the whole batch: 40 sequences of 1-256 tokens, 12 heads of 32, in 11.9 ms against SDPA's 23.2 (~113 GFLOP/s;
with heads of 32 the softmax is a larger share than at 64), and attention fell from 3.0 to 1.1 s of those 1,000
passages. In fp32 (every model on an AVX2-only CPU) it runs the kernel's fp32 body (csrc/attention_f32.h); for
head sizes that are not a multiple of 32, or bf16 without AVX512-BF16, the encoder keeps SDPA; so does bf16 on an
AMX CPU where the kernel's AMX body cannot run (torch's SDPA on AMX tiles ran 1.2-2.5x the AVX512-BF16 body on
MiniLM's shapes; the AMX body runs 1.2-1.9x SDPA there: `prefill_kernel_available`, docs/benchmarks/per-core.md).
"""

from __future__ import annotations

import torch

from orthrus_rag.layers.attention.cpu_prefill import prefill_kernel_runs
from orthrus_rag.layers.cpu_extension import kernels


def encoder_kernel_available(q: torch.Tensor) -> bool:
    """Whether q [T, H, D] (and k, v like it) can run on the kernel here (it has no backward: a forward that
    records gradients keeps SDPA). Whether the engine asks for it is the plan's `encoder_attention` (on an AMX CPU
    without the kernel's AMX body, `auto` keeps SDPA: `prefill_kernel_available`)."""
    return (q.device.type == "cpu" and not (q.requires_grad and torch.is_grad_enabled())
            and prefill_kernel_runs(q.dtype, q.shape[-1]))


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """q, k, v [T, H, D] fp32 or bf16; sequence s is rows q_start[s] .. + q_len[s] (int64, CPU). Returns [T, H, D]."""
    if q.stride(-1) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    kernels().encoder_attention(q, k.contiguous(), v.contiguous(), q_start, q_len, scale, out)
    return out
