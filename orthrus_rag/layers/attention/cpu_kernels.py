"""A C++ decode-attention kernel for the CPU: each cached key and value is read once, straight from the paged
cache.

On long contexts a decode step is memory-bound: gathering every sequence's K/V into a padded tensor (one copy
read and written) and then running SDPA over it (a second read) moved ~3x the bytes attention needs. Measured
with SmolLM2 on 2 Xeon cores, 40 sequences of ~1,000 tokens: a decode step took 695 ms, 69% of it in the gather
(`index_select`) and 17% in SDPA, 10% in the GEMMs. vLLM's CPU backend reads the paged cache in its own C++
kernel; so does this one.

The kernel takes the step's key slots per sequence (planned once per step, shared by every layer) and, per
sequence in parallel, scores every query head against each key row (all KV heads of a slot are one contiguous
read, the rows ahead prefetched), applies a softmax and sums the values: fp32 arithmetic over an fp32 or bf16
cache, one pass over K, one over V. Reading rows whole and prefetched cut a decode step's attention from 14.2 to
4.4 ms (32 sequences, 30 layers, one EPYC core, bf16): the cache is cold at every layer, and a per-head loop was
bound by the latency of its strided gathers.

Where the compiler targets AVX512-BF16, bf16 caches with head sizes of 64, 128 or 256 and at most 8 query heads
per KV head take a second path: scores 16 keys at a time by `vdpbf16ps` on the cached bf16 rows,
reduced by one transpose-and-add, and P @ V with each query head's accumulators in registers. The first path
reduced every (key, head) product on its own and kept its sums in memory, which made it compute-bound, not
memory-bound: ~110 ns a key with the cache warm (SmolLM2's 9/3 heads), against ~25. On 30 layers of cold caches
(32 sequences, blocks of 16 slots) it is 1.5x faster at 64 keys a sequence and 1.2x at 1,000, where the cold
reads dominate both. It is part of the engine's one CPU extension
(layers/cpu_extension.py); where that cannot be built, the grouped backend keeps its SDPA path.
"""

from __future__ import annotations

import torch

from orthrus_rag.layers.cpu_extension import kernels


def decode_kernel_available() -> bool:
    return kernels() is not None


def decode_bf16_body(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether bf16 decodes of these heads take the kernel's AVX512-BF16 path here (the build's own rule)."""
    return kernels() is not None and bool(kernels().decode_attention_bf16_body(num_heads, num_kv_heads, head_dim))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_slots: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, window: int | None, generic: bool = False) -> torch.Tensor:
    """q [B, H, D] against each sequence's keys `key_slots[b, :seq_lens[b]]` in the paged caches; [B, H, D].
    `generic`: the first path even where the AVX512-BF16 one would run (its tests and benchmark compare them)."""
    return kernels().decode_attention(q, k_cache, v_cache, key_slots, seq_lens, scale, -1 if window is None else window,
                                      generic)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """`k_cache.index_copy_(0, slot_mapping, k)` and the same for v, in one call: on the CPU where the kernels are
    built and each row's heads are contiguous (views of the fused projection's output are), else the torch ops."""
    # NOTE: the device first: a CUDA fallback to this backend must not build the CPU extension
    if (k_cache.device.type == "cpu" and k.dtype == k_cache.dtype and k.stride(-1) == 1 and k.stride(1) == k.shape[2]
            and v.stride(-1) == 1 and v.stride(1) == v.shape[2] and kernels() is not None):
        kernels().write_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)
