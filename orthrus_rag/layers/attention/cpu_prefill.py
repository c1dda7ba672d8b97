"""Chunked-prefill attention for the CPU, in bf16 on AVX512-BF16 or AMX and in fp32 on any x86-64 CPU: a chunk's queries
against its sequence's keys, read from the paged cache, with fp32 scores and softmax.

torch's CPU flash SDPA reached ~43 GFLOP/s in bf16 on an EPYC core (1.8 ms a layer for SmolLM2's 256 x 256 x 9
heads; 29% of a 256-token prefill step), and a matmul-based attention could not keep fp32 scores (torch's CPU
`bmm` has no bf16-in / fp32-out form; MKL's `gemm_bf16bf16f32` runs an AVX2 path on AMD, ~100 GFLOP/s). This
kernel is `vdpbf16ps` register blocks, 4 query rows x 32 keys for the scores and 4 rows x 64 head dims for the
values, over K and V repacked per (sequence, KV head) into the instruction's pairs layout (K as [D/2, L] pairs of
dims, V as [L/2, D] pairs of keys): one pass over the cache, no gathered [S, KVH, L, D] copy. Key blocks past
every row's causal limit are skipped, so a causal prefill does about half the products. Masked keys weigh 0, the
exponential is a vector polynomial (glibc's vector expf takes a scalar path for underflowing lanes: 20% of the
time), and P is rounded to bf16 before P @ V, as flash attention does. Measured on one EPYC core against SDPA bf16
(same error to an fp32 reference): 256 x 256 keys 0.46 against 1.94 ms, 512 x 512 1.3 against 7.5 ms, 64 new
over 512 keys 0.43 against 1.03 ms.

The bf16 body is built only where the compiler targets AVX512-BF16 (`prefill_attention_supported`). The fp32 body
(csrc/attention_f32.h) has the same layout and work items in GCC vector extensions one register wide (8 floats on
AVX2, 16 on AVX-512), with P kept in fp32: an AVX2-only CPU runs every model in fp32, and there SDPA was 5.5% of a
backbone embedding step and 15% of MiniLM's encoder forward (AMD EPYC, AVX2 only: docs/design/cpu-kernels.md). With a
head size that is not a multiple of 32, or in another dtype, the grouped backend keeps SDPA.

Where the CPU has AMX, bf16 runs a third body (csrc/prefill_amx.h): blocks of 16 query rows, Q @ K^T and P @ V as
AMX tile products over K and V repacked as whole tiles (each one contiguous KiB), the same fp32 softmax between
them with a cheaper exponential (2^x, a degree-5 fit: fp32's rounding). There the products take 35-40% of the
time after a long prefix and the softmax ~50%. On an AMX Xeon core it ran 1.5x torch's flash SDPA (which packs
its own blocks for AMX through oneDNN's brgemm) on a 256-token chunk after 2,048 cached keys, 2.0x on a
256-token prefill, 1.7-4.4x the AVX512-BF16 body (docs/benchmarks/per-core.md). `amx_body` says whether it runs
here: the build targets AMX-BF16 (a compiler that knows AMX) and Linux granted the process the tile state
(`arch_prctl`, which oneDNN requests too).

Without that body (a compiler without AMX-BF16, or the OS refused the tile state), bf16 on AMX keeps SDPA, which runs
on AMX tiles there and ran 1.7-2.9x the AVX512-BF16 body (measured on an Intel Xeon with AMX, one core:
docs/design/cpu-kernels.md). `prefill_kernel_runs` says whether the
kernel can run here (its tests and benchmark); `prefill_kernel_available`, whether the engine takes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import torch

from orthrus_rag import machine
from orthrus_rag.layers.cpu_extension import kernels


@lru_cache(maxsize=1)
def _built() -> bool:
    mod = kernels()
    return mod is not None and bool(mod.prefill_attention_supported())


def prefill_kernel_runs(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether chunks of a model in `dtype` with `head_dim` can run on the kernel on this machine: fp32 wherever the
    extension builds, bf16 where it has AVX512-BF16."""
    if head_dim % 32 != 0:
        return False
    if dtype == torch.float32:
        return kernels() is not None
    return dtype == torch.bfloat16 and _built()


@lru_cache(maxsize=1)
def amx_body() -> bool:
    """Whether the kernel's bf16 runs on AMX tiles here (see the module)."""
    return _built() and bool(kernels().prefill_attention_amx_runs())


def sdpa_runs_on_amx(dtype: torch.dtype) -> bool:
    """bf16 on a CPU with AMX where the kernel's AMX body does not run: torch's SDPA runs on AMX tiles, faster than
    the AVX512-BF16 body (see the module)."""
    return dtype == torch.bfloat16 and "amx_bf16" in machine.cpu_flags() and not amx_body()


@contextmanager
def avx512_bf16_body() -> Iterator[None]:
    """bf16 on the AVX512-BF16 body inside the block even where the AMX body runs (tests and benchmarks compare the
    two on an AMX CPU)."""
    was = kernels().prefill_attention_use_amx(False)
    try:
        yield
    finally:
        kernels().prefill_attention_use_amx(was)


def prefill_kernel_available(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the engine attends chunks (and a separate encoder's batches) of `dtype` and `head_dim` on the kernel
    here: where it runs, except bf16 on AMX without the AMX body."""
    return prefill_kernel_runs(dtype, head_dim) and not sdpa_runs_on_amx(dtype)


@dataclass
class Chunks:
    """The sequences of a step whose chunks the kernel attends, planned once per step (int64, CPU)."""
    q_start: torch.Tensor  # [S] first row of each chunk in the flat batch
    q_len: torch.Tensor  # [S] new tokens
    ctx_len: torch.Tensor  # [S] cached tokens before the chunk
    key_slots: torch.Tensor  # [S, W] cache slots of every key, position by position


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunks: Chunks,
                      scale: float, window: int | None, out: torch.Tensor) -> None:
    """Write the attention of the chunks' rows of q [T, H, D] into those rows of `out` [T, H, D] (fp32 or bf16)."""
    if q.stride(-1) != 1 or q.stride(1) != q.shape[2]:  # NOTE: strided rows are read as they are
        q = q.contiguous()
    kernels().prefill_attention(q, k_cache, v_cache, chunks.q_start, chunks.q_len, chunks.ctx_len,
                                chunks.key_slots, scale, -1 if window is None else window, out)
