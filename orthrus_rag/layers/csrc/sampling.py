"""C++ source of the CPU sampler's draw (its wrapper and notes: layers/sampler.py, `inverse_cdf`)."""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace sampling {
// Block sums first, then a walk over them and one block's elements: a row is read about once, and every sum is
// in double, so a token's share of [0, total) is its probability to ~1e-16, whatever the vocabulary's size.
constexpr int64_t kBlock = 256;

// The token whose cumulative interval holds u * total (u in [0, 1)); only tokens of positive probability can be
// drawn; -1 when the row has no positive mass (all masked, or NaN).
int64_t draw_row(const float* p, int64_t n, double u, std::vector<double>& sums) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  double total = 0.0;
  int64_t last = -1;  // the last block with positive mass: where a target rounded up to `total` lands
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t j = lo; j < hi; ++j) s += static_cast<double>(p[j]);
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
      const int64_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
      int64_t pick = -1;
      for (int64_t j = lo; j < hi; ++j) {
        if (!(p[j] > 0.f)) continue;
        pick = j;
        acc += static_cast<double>(p[j]);
        if (acc > target) return j;
      }
      return pick;  // the element-wise sum came out a hair under the block sum: the block's last drawable token
    }
    acc += sums[b];
  }
  return -1;
}

// softmax(x * inv_t) drawn at u without writing the probabilities: a max pass, a pass of exps into block sums,
// then the chosen block's exps again by the same vector loop (so its elements add up to its sum as the first pass
// saw it). Masked logits (-inf, or below kMasked) weigh exactly 0. The build has -ffast-math (no infinities
// assumed), so -inf is only ever compared, never computed with; the exp's argument is clamped at -80 (e^-80 ~
// 1.8e-35 stands for anything smaller), which also keeps libmvec's expf off its slow path for tiny values.
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
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  float w[kBlock];
  double total = 0.0;
  int64_t last = -1;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kBlock, len = std::min(n, lo + kBlock) - lo;
    weights(x + lo, len, mx, inv_t, w);
    double s = 0.0;
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
      weights(x + lo, len, mx, inv_t, w);
      int64_t pick = -1;
      for (int64_t j = 0; j < len; ++j) {
        if (!(w[j] > 0.f)) continue;
        pick = lo + j;
        acc += static_cast<double>(w[j]);
        if (acc > target) return lo + j;
      }
      return pick;  // the target sat in the rounding of the last block's sum: its last drawable token
    }
    acc += sums[b];
  }
  return -1;
}

torch::Tensor sample_logits(const torch::Tensor& logits, const torch::Tensor& inv_t, const torch::Tensor& u) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat && logits.dim() == 2 &&
              logits.is_contiguous(), "sample_logits: logits must be a contiguous fp32 CPU tensor [rows, vocab]");
  TORCH_CHECK(inv_t.scalar_type() == torch::kFloat && inv_t.numel() == logits.size(0) && inv_t.is_contiguous(),
              "sample_logits: inv_t must be fp32 [rows]");
  TORCH_CHECK(u.device().is_cpu() && u.scalar_type() == torch::kDouble && u.dim() == 1 &&
              u.size(0) == logits.size(0), "sample_logits: u must be fp64 [rows] on the CPU");
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  const float* x = logits.data_ptr<float>();
  const float* t = inv_t.data_ptr<float>();
  const auto uc = u.contiguous();
  const double* ud = uc.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<double> sums((n + kBlock - 1) / kBlock);
    for (int64_t r = begin; r < end; ++r) o[r] = draw_logits_row(x + r * n, n, t[r], ud[r], sums);
  });
  return out;
}

torch::Tensor sample_probs(const torch::Tensor& probs, const torch::Tensor& u) {
  TORCH_CHECK(probs.device().is_cpu() && probs.scalar_type() == torch::kFloat && probs.dim() == 2 &&
              probs.is_contiguous(), "sample_probs: probs must be a contiguous fp32 CPU tensor [rows, vocab]");
  TORCH_CHECK(u.device().is_cpu() && u.scalar_type() == torch::kDouble && u.dim() == 1 &&
              u.size(0) == probs.size(0), "sample_probs: u must be fp64 [rows] on the CPU");
  const int64_t rows = probs.size(0), n = probs.size(1);
  auto out = torch::empty({rows}, probs.options().dtype(torch::kLong));
  const float* p = probs.data_ptr<float>();
  const auto uc = u.contiguous();
  const double* ud = uc.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<double> sums((n + kBlock - 1) / kBlock);
    for (int64_t r = begin; r < end; ++r) o[r] = draw_row(p + r * n, n, ud[r], sums);
  });
  return out;
}
}  // namespace sampling

torch::Tensor sample_probs(const torch::Tensor& probs, const torch::Tensor& u) {
  return sampling::sample_probs(probs, u);
}
torch::Tensor sample_logits(const torch::Tensor& logits, const torch::Tensor& inv_t, const torch::Tensor& u) {
  return sampling::sample_logits(logits, inv_t, u);
}
"""
