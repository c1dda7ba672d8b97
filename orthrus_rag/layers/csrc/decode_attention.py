"""C++ source of the CPU decode-attention kernel (its wrapper and notes: layers/attention/cpu_kernels.py)."""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
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

// q [B, H, D] (rows strided: a view of the fused projection's output); caches [slots, KVH, D]; key_slots [B, W]
// (int64); seq_lens [B] (int64); out [B, H, D] contiguous. q, the caches and out share T (fp32 or bf16): the
// conversions to and from fp32 happen here, per row, not as separate torch ops (two per layer at decode sizes).
template <typename T>
static void attend(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& key_slots, const torch::Tensor& seq_lens, double scale, int64_t window,
                   torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), q_row = q.stride(0);
  const int64_t KVH = k_cache.size(1), G = H / KVH, W = key_slots.size(1), R = KVH * D;
  const int64_t row_bytes = R * static_cast<int64_t>(sizeof(T));
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* slots = key_slots.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(H * D), qf(H * D);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = std::min<int64_t>(lens[b], W);
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      scores.assign(H * n, 0.f);
      for (int64_t i = 0; i < H * D; ++i) qf[i] = as_float(qp[b * q_row + i]);
      const float* qb = qf.data();
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
      for (int64_t i = 0; i < H * D; ++i) op[b * H * D + i] = static_cast<T>(acc[i]);
    }
  });
}

// q [B, H, D] (rows may be strided); returns [B, H, D] in q's dtype, computed in the caches'.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor key_slots, torch::Tensor seq_lens, double scale, int64_t window) {
  const auto kind = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == kind && (kind == torch::kFloat || kind == torch::kBFloat16),
              "decode_attention: float32 or bfloat16 caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && key_slots.is_contiguous() &&
              seq_lens.is_contiguous(), "decode_attention: contiguous caches and indices");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0 && k_cache.size(2) == q.size(2), "decode_attention: head shapes");
  const auto q_kind = q.scalar_type();
  if (q_kind != kind) q = q.to(kind);
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();  // heads of a row: one contiguous run
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (kind == torch::kFloat) attend<float>(q, k_cache, v_cache, key_slots, seq_lens, scale, window, out);
  else attend<at::BFloat16>(q, k_cache, v_cache, key_slots, seq_lens, scale, window, out);
  return q_kind == kind ? out : out.to(q_kind);
}

// The step's new K and V rows into the paged caches: rows of k / v [T, KVH, D] (rows strided: views of the fused
// projection's output) to cache slots slot_mapping[T]. One call where two index_copy_ ran per layer.
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type() &&
              k.sizes() == v.sizes() && k.dim() == 3 && k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(2) &&
              k_cache.sizes() == v_cache.sizes() && slot_mapping.numel() == k.size(0), "write_kv: shapes or dtypes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slot_mapping.is_contiguous() &&
              slot_mapping.scalar_type() == torch::kLong, "write_kv: contiguous caches, int64 slots");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "write_kv: each row's heads contiguous");
  const int64_t T = k.size(0), R = k.size(1) * k.size(2), bytes = R * k.element_size(), slots = k_cache.size(0);
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sm[t] >= 0 && sm[t] < slots, "write_kv: slot out of range");
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + sm[t] * bytes, kp + t * ks, bytes);
      std::memcpy(vc + sm[t] * bytes, vp + t * vs, bytes);
    }
  });
}
"""
