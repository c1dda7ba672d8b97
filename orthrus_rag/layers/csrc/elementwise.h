// The fused CPU elementwise kernels (its wrapper and notes: layers/cpu_elementwise.py).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>

namespace elementwise {
// Element access by storage type: fp32 as is, bf16 as its bits. The bit forms (a shift, round-to-nearest-even by
// an add) vectorise; at::BFloat16's conversions carry a NaN branch that keeps these loops scalar (~8x slower).
struct F32 {
  using S = float;
  static inline float load(float x) { return x; }
  static inline float store(float x) { return x; }
};
struct BF16 {
  using S = uint16_t;
  static inline float load(uint16_t x) {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static inline uint16_t store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};
// a value as the eager op would hold it: rounded to the tensor's dtype (no-op in fp32)
template <typename K> inline float held(float x) { return K::load(K::store(x)); }

// rows per task: small steps (a decode's few rows) stay on one thread
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

template <typename K, typename T = typename K::S>
void add_rms_norm(const T* x, int64_t x_stride, T* res, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* rr = res + r * n;
      T* o = out + r * n;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < n; ++d) {
        const T sum = K::store(K::load(rr[d]) + K::load(xr[d]));
        rr[d] = sum;
        ss += K::load(sum) * K::load(sum);
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
      for (int64_t d = 0; d < n; ++d) o[d] = K::store(held<K>(K::load(rr[d]) * inv) * K::load(w[d]));
    }
  });
}

// x [T, H, D] (rows and heads strided, dims contiguous) in place: x * cos + roll(x, D/2) * signed_sin
template <typename K, typename T = typename K::S>
void rotary(T* x, int64_t rows, int64_t heads, int64_t dim, int64_t s_row, int64_t s_head, const T* cos,
            const T* ssin) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * dim;
      const T* s = ssin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * s_row + h * s_head;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = K::load(v[d]), b = K::load(v[d + half]);
          v[d] = K::store(held<K>(a * K::load(c[d])) + held<K>(b * K::load(s[d])));
          v[d + half] = K::store(held<K>(b * K::load(c[d + half])) + held<K>(a * K::load(s[d + half])));
        }
      }
    }
  });
}

// out's rows `os` apart (the column-split loop writes each thread's columns of the step's [T, I] in place)
template <typename K, typename T = typename K::S>
void silu_mul(const T* gate, int64_t gs, const T* up, int64_t us, T* out, int64_t os, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate + r * gs;
      const T* u = up + r * us;
      T* o = out + r * os;
#pragma omp simd
      for (int64_t d = 0; d < n; ++d) {
        const float a = K::load(g[d]);
        // NOTE: exp's argument capped: fast-math's reciprocal of an infinite 1 + e^-a would be NaN, not 0
        o[d] = K::store(held<K>(a / (1.f + std::exp(std::min(-a, 88.f)))) * K::load(u[d]));
      }
    }
  });
}

inline void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() >= 2 && t.stride(-1) == 1, what, ": rows with contiguous last dimension");
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16, what,
              ": float32 or bfloat16");
}
inline uint16_t* bits(const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }
}  // namespace elementwise

// residual += x (in place); returns rmsnorm(residual) * weight. x, residual [T, N]; weight [N]; one dtype.
using elementwise::bits;

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  elementwise::check_rows(x, "add_rms_norm");
  TORCH_CHECK(residual.is_contiguous() && weight.is_contiguous() && x.dim() == 2 && residual.sizes() == x.sizes() &&
              weight.size(0) == x.size(1) && residual.scalar_type() == x.scalar_type() &&
              weight.scalar_type() == x.scalar_type(), "add_rms_norm: shapes or dtypes");
  auto out = torch::empty_like(residual);
  if (x.scalar_type() == torch::kFloat)
    elementwise::add_rms_norm<elementwise::F32>(x.data_ptr<float>(), x.stride(0), residual.data_ptr<float>(),
                                     weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1), eps);
  else
    elementwise::add_rms_norm<elementwise::BF16>(bits(x), x.stride(0), bits(residual), bits(weight), bits(out),
                                                 x.size(0), x.size(1), eps);
  return out;
}

// x [T, H, D] rotated in place by cos / signed sin [T, D] (the model's dtype); returns x.
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor ssin) {
  elementwise::check_rows(x, "rotary");
  TORCH_CHECK(x.dim() == 3 && cos.is_contiguous() && ssin.is_contiguous() && cos.size(0) == x.size(0) &&
              cos.size(1) == x.size(2) && x.size(2) % 2 == 0 && cos.scalar_type() == x.scalar_type() &&
              ssin.scalar_type() == x.scalar_type() && ssin.sizes() == cos.sizes(), "rotary: shapes or dtypes");
  if (x.scalar_type() == torch::kFloat)
    elementwise::rotary<elementwise::F32>(x.data_ptr<float>(), x.size(0), x.size(1), x.size(2), x.stride(0),
                                          x.stride(1), cos.data_ptr<float>(), ssin.data_ptr<float>());
  else
    elementwise::rotary<elementwise::BF16>(bits(x), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1),
                                           bits(cos), bits(ssin));
  return x;
}

// silu(gate) * up; gate, up [T, I] (rows strided); returns [T, I].
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  elementwise::check_rows(gate, "silu_mul");
  elementwise::check_rows(up, "silu_mul");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
              "silu_mul: shapes or dtypes");
  auto out = torch::empty(gate.sizes(), gate.options());
  if (gate.scalar_type() == torch::kFloat)
    elementwise::silu_mul<elementwise::F32>(gate.data_ptr<float>(), gate.stride(0), up.data_ptr<float>(), up.stride(0),
                                 out.data_ptr<float>(), gate.size(1), gate.size(0), gate.size(1));
  else
    elementwise::silu_mul<elementwise::BF16>(bits(gate), gate.stride(0), bits(up), up.stride(0), bits(out),
                                             gate.size(1), gate.size(0), gate.size(1));
  return out;
}
