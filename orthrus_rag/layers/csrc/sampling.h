// The CPU sampler's draw (its wrapper and notes: layers/sampler.py, `inverse_cdf`).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace sampling {
// Block sums first, then a walk over them and one block's elements: a row is read about once (its chosen block
// twice), and every sum is in double, so a token's share of [0, total) is its weight to ~1e-16 of the total,
// whatever the vocabulary's size.
constexpr int64_t kBlock = 256;

// The token whose cumulative interval holds u * total (u in [0, 1)), over n tokens whose weights `fill(lo, len,
// w)` writes block by block (the same values both times it is asked); only tokens of positive weight can be
// drawn; -1 when the row has no positive mass (all masked, or NaN).
template <typename Fill>
int64_t draw(int64_t n, double u, std::vector<double>& sums, Fill fill) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  float w[kBlock];
  double total = 0.0;
  int64_t last = -1;  // the last block with positive mass: where a target rounded up to `total` lands
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kBlock, len = std::min(n, lo + kBlock) - lo;
    fill(lo, len, w);
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < len; ++j) s += static_cast<double>(w[j]);
    sums[b] = s;
    total += s;
    if (s > 0.0) last = b;
  }
  if (last < 0 || !(total > 0.0)) return -1;
  const double target = u * total;
  double acc = 0.0;
  for (int64_t b = 0; b <= last; ++b) {
    if (!(sums[b] > 0.0)) continue;
    if (acc + sums[b] > target || b == last) {
      const int64_t lo = b * kBlock, len = std::min(n, lo + kBlock) - lo;
      fill(lo, len, w);
      int64_t pick = -1;
      for (int64_t j = 0; j < len; ++j) {
        if (!(w[j] > 0.f)) continue;
        pick = lo + j;
        acc += static_cast<double>(w[j]);
        if (acc > target) return lo + j;
      }
      return pick;  // the element-wise sum came out a hair under the block sum: the block's last drawable token
    }
    acc += sums[b];
  }
  return -1;
}

// softmax(x * inv_t)'s weights without writing the probabilities: exp((x - max) * inv_t). Masked logits (-inf,
// or below kMasked) weigh exactly 0. The build has -ffast-math (no infinities assumed), so -inf is only ever
// compared, never computed with; the exp's argument is clamped at -80 (e^-80 ~ 1.8e-35 stands for anything
// smaller), which also keeps libmvec's expf off its slow path for tiny values.
constexpr float kMasked = -1e30f;

inline void weights(const float* x, int64_t n, float mx, float inv_t, float* w) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const bool live = x[j] > kMasked;
    const float e = std::exp(live ? std::max((x[j] - mx) * inv_t, -80.f) : -80.f);
    w[j] = live ? e : 0.f;
  }
}

int64_t draw_logits_row(const float* x, int64_t n, float inv_t, double u, std::vector<double>& sums) {
  float mx = kMasked;
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, x[j]);
  if (!(mx > kMasked)) return -1;
  return draw(n, u, sums, [&](int64_t lo, int64_t len, float* w) { weights(x + lo, len, mx, inv_t, w); });
}

int64_t draw_probs_row(const float* p, int64_t n, double u, std::vector<double>& sums) {
  return draw(n, u, sums, [&](int64_t lo, int64_t len, float* w) { std::memcpy(w, p + lo, len * sizeof(float)); });
}

// One draw per row of x [rows, n] (contiguous fp32 on the CPU) at u [rows] (fp64): row(r, x_r, n, u_r, sums).
template <typename Row>
torch::Tensor each_row(const char* what, const torch::Tensor& x, const torch::Tensor& u, Row row) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous(), what,
              ": a contiguous fp32 CPU tensor [rows, vocab]");
  TORCH_CHECK(u.device().is_cpu() && u.scalar_type() == torch::kDouble && u.dim() == 1 && u.size(0) == x.size(0),
              what, ": u must be fp64 [rows] on the CPU");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  const auto uc = u.contiguous();
  const double* ud = uc.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<double> sums((n + kBlock - 1) / kBlock);
    for (int64_t r = begin; r < end; ++r) o[r] = row(r, xp + r * n, n, ud[r], sums);
  });
  return out;
}

// torch.argmax of one row: the first index of the largest value, a NaN counting as the largest (the first NaN's).
// The build has -ffast-math, which assumes no NaNs, so they are found by their bits, never by a float compare:
// the max runs over order-preserving integer keys of the floats (a NaN's key above every number's).
inline int32_t order_key(uint32_t bits) {
  if ((bits & 0x7fffffffu) > 0x7f800000u) return INT32_MAX;  // NaN
  return static_cast<int32_t>(bits ^ ((bits >> 31) * 0x7fffffffu));  // negatives: the lower the float, the lower
}

typedef uint32_t __attribute__((may_alias)) float_bits;  // a float's bits, read in place without aliasing UB

int64_t argmax_row(const float* x, int64_t n) {
  const float_bits* bits = reinterpret_cast<const float_bits*>(x);
  int32_t best = INT32_MIN;
#pragma omp simd reduction(max : best)
  for (int64_t j = 0; j < n; ++j) best = std::max(best, order_key(bits[j]));
  if (best == INT32_MAX) {
    for (int64_t j = 0; j < n; ++j)
      if ((bits[j] & 0x7fffffffu) > 0x7f800000u) return j;
  }
  // the first element equal to the max as a float (compared by bits, so that -0.0 and +0.0 tie, as in torch)
  const uint32_t b = static_cast<uint32_t>(best);
  const uint32_t mb = b ^ ((b >> 31) * 0x7fffffffu);  // order_key's inverse
  const bool zero = (mb & 0x7fffffffu) == 0;
  for (int64_t j = 0; j < n; ++j)
    if (bits[j] == mb || (zero && (bits[j] & 0x7fffffffu) == 0)) return j;
  return 0;  // unreachable: the max is one of the row's values
}
}  // namespace sampling

// x [rows, vocab] (contiguous fp32 on the CPU) -> torch.argmax(x, dim=-1), bit for bit
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous() &&
              x.size(1) > 0, "argmax_rows: a contiguous fp32 CPU tensor [rows, vocab > 0]");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = sampling::argmax_row(xp + r * n, n);
  });
  return out;
}

// probs [rows, vocab] (non-negative, any scale) -> one token id per row
torch::Tensor sample_probs(const torch::Tensor& probs, const torch::Tensor& u) {
  return sampling::each_row("sample_probs", probs, u,
                            [](int64_t, const float* p, int64_t n, double ur, std::vector<double>& sums) {
                              return sampling::draw_probs_row(p, n, ur, sums);
                            });
}

// logits [rows, vocab] (-inf where masked), inv_t [rows] fp32 -> one token id per row of softmax(logits * inv_t)
torch::Tensor sample_logits(const torch::Tensor& logits, const torch::Tensor& inv_t, const torch::Tensor& u) {
  TORCH_CHECK(inv_t.scalar_type() == torch::kFloat && inv_t.numel() == logits.size(0) && inv_t.is_contiguous(),
              "sample_logits: inv_t must be fp32 [rows]");
  const float* t = inv_t.data_ptr<float>();
  return sampling::each_row("sample_logits", logits, u,
                            [t](int64_t r, const float* x, int64_t n, double ur, std::vector<double>& sums) {
                              return sampling::draw_logits_row(x, n, t[r], ur, sums);
                            });
}
