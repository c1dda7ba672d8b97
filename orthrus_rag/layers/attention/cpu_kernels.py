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
bound by the latency of its strided gathers. It is compiled on first use with torch's C++ extension
loader (needs a C++ compiler and ninja) into torch's extension cache, one build per CPU model; if that fails,
the grouped backend keeps its SDPA path.
"""

from __future__ import annotations

import logging
import threading
from functools import lru_cache
from typing import Any

import torch

from orthrus_rag.machine import machine_key

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>
// NOTE: built with -ffast-math so that the exp loop vectorises (libmvec); scores are finite by construction

// K/V elements as fp32: the cache is float32 or bfloat16 (the model's dtype); scores and sums are fp32 either way
static inline float as_float(float x) { return x; }
static inline float as_float(at::BFloat16 x) { return static_cast<float>(x); }

// The cache row of one slot is [KVH, D] contiguous; decodes read it cold (a whole model's weights stream through the
// caches between two layers' reads), so the loop is per sequence over whole rows (one contiguous read for every
// head) with the rows a few positions ahead prefetched: latency-bound gathers otherwise cost ~4x the compute.
constexpr int64_t kAhead = 8;

template <typename T>
static inline void prefetch_row(const T* row, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}

// q [B, H, D] fp32; caches [slots, KVH, D]; key_slots [B, W] (int64); seq_lens [B] (int64); out [B, H, D] fp32.
template <typename T>
static void attend(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& key_slots, const torch::Tensor& seq_lens, double scale, int64_t window,
                   torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), G = H / KVH, W = key_slots.size(1), R = KVH * D;
  const int64_t row_bytes = R * static_cast<int64_t>(sizeof(T));
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* slots = key_slots.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(H * D);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = std::min<int64_t>(lens[b], W);
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      scores.assign(H * n, 0.f);
      const float* qb = qp + b * H * D;
      const int64_t* sb = slots + b * W + first;
      for (int64_t p = 0; p < std::min(n, kAhead); ++p) prefetch_row(kp + sb[p] * R, row_bytes);
      for (int64_t p = 0; p < n; ++p) {
        if (p + kAhead < n) prefetch_row(kp + sb[p + kAhead] * R, row_bytes);
        const T* row = kp + sb[p] * R;
        for (int64_t h = 0; h < KVH; ++h) {
          const T* k = row + h * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qb + (h * G + g) * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * as_float(k[d]);
            scores[(h * G + g) * n + p] = s * sc;
          }
        }
      }
      for (int64_t hg = 0; hg < H; ++hg) {
        float* sg = scores.data() + hg * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < n; ++p) m = std::max(m, sg[p]);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t p = 0; p < n; ++p) { sg[p] = std::exp(sg[p] - m); total += sg[p]; }
        const float inv = 1.f / total;
        for (int64_t p = 0; p < n; ++p) sg[p] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < std::min(n, kAhead); ++p) prefetch_row(vp + sb[p] * R, row_bytes);
      for (int64_t p = 0; p < n; ++p) {
        if (p + kAhead < n) prefetch_row(vp + sb[p + kAhead] * R, row_bytes);
        const T* row = vp + sb[p] * R;
        for (int64_t h = 0; h < KVH; ++h) {
          const T* v = row + h * D;
          for (int64_t g = 0; g < G; ++g) {
            const float w = scores[(h * G + g) * n + p];
            float* a = acc.data() + (h * G + g) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += w * as_float(v[d]);
          }
        }
      }
      std::copy(acc.begin(), acc.end(), op + b * H * D);
    }
  });
}

// q [B, H, D] in the model's dtype; returns [B, H, D] in it.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor key_slots, torch::Tensor seq_lens, double scale, int64_t window) {
  const auto kind = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == kind && (kind == torch::kFloat || kind == torch::kBFloat16),
              "decode_attention: float32 or bfloat16 caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && key_slots.is_contiguous() &&
              seq_lens.is_contiguous(), "decode_attention: contiguous caches and indices");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0 && k_cache.size(2) == q.size(2), "decode_attention: head shapes");
  auto qf = q.to(torch::kFloat).contiguous();
  auto out = torch::empty_like(qf);
  if (kind == torch::kFloat) attend<float>(qf, k_cache, v_cache, key_slots, seq_lens, scale, window, out);
  else attend<at::BFloat16>(qf, k_cache, v_cache, key_slots, seq_lens, scale, window, out);
  return out.to(q.scalar_type());
}
"""

_LOCK = threading.Lock()
# a build takes ~30-60 s; a lock file older than this was left by a build that was killed (torch's loader would
# wait on it forever: its lock is a bare O_EXCL file that names no owner)
STALE_LOCK_S = 600.0


def _build_name() -> str:
    """One build per CPU model and torch version: `-march=native` code must not run on another CPU."""
    return f"orthrus_decode_attention_{machine_key(_SOURCE)}"


@lru_cache(maxsize=1)
def _module() -> Any:  # the compiled extension, or None where it cannot be built
    from torch.utils import cpp_extension

    with _LOCK:
        try:
            _clear_stale_lock(cpp_extension, _build_name())
            # NOTE: torch's loader reuses a build it finds; only the first use on a machine compiles
            logger.info("loading the CPU decode-attention kernel (compiled on first use per machine: ~30-60 s)")
            return cpp_extension.load_inline(
                name=_build_name(), cpp_sources=[_SOURCE], functions=["decode_attention"],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], extra_ldflags=["-fopenmp"],
                verbose=False)
        except Exception as exc:  # NOTE: no compiler, no ninja, an unusual platform: SDPA still works
            logger.warning("CPU decode-attention kernel unavailable (%s: %s); using SDPA", type(exc).__name__, exc)
            return None


def _clear_stale_lock(cpp_extension: Any, name: str, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove the build folder's lock file if it is older than `max_age_s`; True if one was removed."""
    import os
    import time

    folder = cpp_extension._get_build_directory(name, False)  # NOTE: private, but the one place torch puts it
    lock = os.path.join(folder, "lock")
    try:
        age = time.time() - os.stat(lock).st_mtime
    except FileNotFoundError:
        return False
    if age <= max_age_s:
        return False  # another process may be building right now: wait for it, as torch does
    logger.warning("removing a stale build lock %s (%.0f s old: a killed build left it)", lock, age)
    try:
        os.remove(lock)
    except FileNotFoundError:  # NOTE: another process removed it first
        pass
    return True


def decode_kernel_available() -> bool:
    return _module() is not None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_slots: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """q [B, H, D] against each sequence's keys `key_slots[b, :seq_lens[b]]` in the paged caches; [B, H, D]."""
    return _module().decode_attention(q, k_cache, v_cache, key_slots, seq_lens, scale, -1 if window is None else window)
