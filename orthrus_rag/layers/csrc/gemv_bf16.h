// The bf16 product of a few rows by a dense weight (its wrapper and notes: layers/linear.py, `gemv_rows`): what a
// decode step at small batch multiplies by, in AVX512-BF16, the weight streamed once for every row of the step. The
// layer loop (layer_loop.h) and linear.linear call it.
//
// Why not oneDNN: a step of one to four rows reads each weight once and does little arithmetic on it, so its time
// is the weight's bytes over the memory bandwidth. oneDNN's packed product read SmolLM2's weights at 6-8 GB/s on
// one core of an AMX Xeon, this loop at 9-10 GB/s (the core's plain streaming read: ~10 GB/s). Two weight rows a
// pass with a software prefetch 4 KiB ahead was the best of the forms timed over the model's shapes (one to four
// rows a pass, prefetch off to 4 KiB; docs/design/cpu-kernels.md), over more weights than the last-level cache
// holds.
#pragma once
#include "elementwise.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace gemv_detail {
constexpr int64_t kMaxRows = 4;        // input rows one call takes (each a set of accumulators in registers)
constexpr int64_t kWeightRows = 2;     // weight rows a pass reads
constexpr int64_t kPrefetch = 4096;    // bytes ahead of each weight row's read the next lines are asked for
constexpr int64_t kGrain = 256;        // weight rows per thread's share at least (a share reads >= 256 KiB)

#if defined(__AVX512BF16__)
// y[t][n .. n + R) = x[t] . W[n + r] for T input rows; K a multiple of 32 (the caller pads nothing: `tail` masks
// the last 32 lanes' loads where K is not).
template <int64_t T, int64_t R>
inline void block(const uint16_t* x, int64_t K, const uint16_t* w, float (*acc_out)[R], __mmask32 tail) {
  __m512 acc[T][R];
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  const int64_t full = K & ~int64_t{31};
  for (int64_t k = 0; k < full; k += 32) {
    __m512bh wv[R];
    for (int64_t r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + kPrefetch, _MM_HINT_T0);
      wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k);
    }
    for (int64_t t = 0; t < T; ++t) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + t * K + k);
      for (int64_t r = 0; r < R; ++r) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], xv, wv[r]);
    }
  }
  if (full < K) {  // NOTE: zeroed lanes add nothing (0 x 0)
    __m512bh wv[R];
    for (int64_t r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(tail, w + r * K + full);
    for (int64_t t = 0; t < T; ++t) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + t * K + full);
      for (int64_t r = 0; r < R; ++r) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], xv, wv[r]);
    }
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < R; ++r) acc_out[t][r] = _mm512_reduce_add_ps(acc[t][r]);
}

// Weight rows [begin, end) for all T input rows: y [T, N] bf16, the bias (or null) added in fp32 before the one
// rounding.
template <int64_t T>
void rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t N, int64_t K,
          int64_t begin, int64_t end) {
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (K & 31)) - 1);
  auto store = [&](int64_t n, const float* col, int64_t R) {
    for (int64_t r = 0; r < R; ++r) {
      const float b = bias ? elementwise::BF16::load(bias[n + r]) : 0.f;
      for (int64_t t = 0; t < T; ++t) y[t * N + n + r] = elementwise::BF16::store(col[t * R + r] + b);
    }
  };
  int64_t n = begin;
  for (; n + kWeightRows <= end; n += kWeightRows) {
    float out[T][kWeightRows];
    block<T, kWeightRows>(x, K, w + n * K, out, tail);
    store(n, &out[0][0], kWeightRows);
  }
  for (; n < end; ++n) {
    float out[T][1];
    block<T, 1>(x, K, w + n * K, out, tail);
    store(n, &out[0][0], 1);
  }
}
#endif

// Whether this build has the AVX512-BF16 body (else `product` refuses and callers keep oneDNN or dense weights).
inline bool runs() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x [T, K] (T <= kMaxRows) times w [N, K]^T plus b (zero elements: none), all bf16: [T, N] bf16.
inline at::Tensor product(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& b) {
  const at::Tensor x = x_in.contiguous();  // NOTE: a few rows: a copy where the caller's is a view costs nothing
  TORCH_CHECK(runs(), "gemv_bf16: this build has no AVX512-BF16 body");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "gemv_bf16: x [T <= ", kMaxRows, ", K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  w.is_contiguous(), "gemv_bf16: contiguous bf16 x and w");
  TORCH_CHECK(b.numel() == 0 || (b.numel() == w.size(0) && b.scalar_type() == at::kBFloat16 && b.is_contiguous()),
              "gemv_bf16: the bias is [N] bf16");
  const int64_t T = x.size(0), N = w.size(0), K = w.size(1);
  auto y = at::empty({T, N}, x.options());
#if defined(__AVX512BF16__)
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
  const auto* bp = b.numel() ? static_cast<const uint16_t*>(b.data_ptr()) : nullptr;
  auto* yp = static_cast<uint16_t*>(y.data_ptr());
  // NOTE: shares of whole weight-row pairs, so a pass never straddles two threads
  at::parallel_for(0, (N + kWeightRows - 1) / kWeightRows, kGrain / kWeightRows, [&](int64_t lo, int64_t hi) {
    const int64_t begin = lo * kWeightRows, end = std::min(N, hi * kWeightRows);
    switch (T) {
      case 1: rows<1>(xp, wp, bp, yp, N, K, begin, end); break;
      case 2: rows<2>(xp, wp, bp, yp, N, K, begin, end); break;
      case 3: rows<3>(xp, wp, bp, yp, N, K, begin, end); break;
      default: rows<4>(xp, wp, bp, yp, N, K, begin, end); break;
    }
  });
#endif
  return y;
}
}  // namespace gemv_detail

inline at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return gemv_detail::product(x, w, b);
}
inline bool gemv_bf16_runs() { return gemv_detail::runs(); }
