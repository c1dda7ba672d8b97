// The CPU decode-attention kernel (its wrapper and notes: layers/attention/cpu_kernels.py).
#pragma once
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

// Each of `rows` rows of n scores (contiguous) becomes its softmax, in place.
static inline void softmax_rows(float* s, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sg = s + r * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < n; ++p) m = std::max(m, sg[p]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < n; ++p) { sg[p] = std::exp(sg[p] - m); total += sg[p]; }
    const float inv = 1.f / total;
    for (int64_t p = 0; p < n; ++p) sg[p] *= inv;
  }
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
      softmax_rows(scores.data(), H, n);
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

#if defined(__AVX512BF16__)
#include <immintrin.h>
// The bf16 path in AVX512-BF16, for head sizes of 64 / 128 / 256 and up to 8 query heads per KV head (the others
// take `attend`): per (sequence, KV head), the scores 16 keys at a time with `vdpbf16ps` over the bf16 rows as they
// lie in the cache, reduced by one transpose-and-add; then P @ V with every query head's accumulators in registers.
// `attend` reduced each (key, head) dot product on its own and kept its accumulators in memory: ~110 ns a key for
// SmolLM2's 9/3 heads with the cache warm, against ~25 here, and a step's 30 layers of cold 32 x 64 keys 1.5x
// faster (layers/attention/cpu_kernels.py).
namespace decode_fast {
constexpr int64_t kKeys = 16;  // keys per score block: one vector of scores
constexpr int64_t kAheadKeys = 8;  // rows prefetched ahead of the block being read (measured best of 8 to 64)

inline void fetch(const uint16_t* base, const int64_t* rows, int64_t from, int64_t to, int64_t R) {
  for (int64_t p = from; p < to; ++p) prefetch_row(base + rows[p] * R, R * 2);
}

// r[j] = the sum of a[j]'s 16 lanes, j = 0..15: a transpose-and-add of 45 instructions, not 16 reductions of ~8
inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // c[i]'s 128-bit lane L: the lane-L sums of a[4i .. 4i + 3]
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __mmask16 first(int64_t m) { return m >= 16 ? 0xffff : static_cast<__mmask16>((1u << m) - 1); }

// scores[p] = scale * q . k_p over the n keys at `rows` (bf16, head dim 32 * NC, at offset `off` of a cache row of
// R elements); `ahead`: this pass is the first over the rows, so it prefetches them.
template <int NC>
void scores_of(const uint16_t* q, const uint16_t* kp, const int64_t* rows, int64_t n, int64_t R, int64_t off,
               float scale, float* scores, bool ahead) {
  __m512i qv[NC];
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_si512(q + 32 * c);
  for (int64_t p0 = 0; p0 < n; p0 += kKeys) {
    const int64_t m = std::min<int64_t>(kKeys, n - p0);
    if (ahead) fetch(kp, rows, std::min(n, p0 + kAheadKeys), std::min(n, p0 + kAheadKeys + kKeys), R);
    __m512 acc[kKeys];
#pragma GCC unroll 16
    for (int j = 0; j < kKeys; ++j) {
      // NOTE: past the last key, the block's first key again: computed, never stored
      const uint16_t* k = kp + rows[p0 + (j < m ? j : 0)] * R + off;
      __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(k + 32 * c), (__m512bh)qv[c]);
      acc[j] = a;
    }
    _mm512_mask_storeu_ps(scores + p0, first(m), _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
  }
}

inline __m512 widen(__m256i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)); }

// out[g][0 .. 64) = sum_p w[g][p] v_p[off .. off + 64) for G query heads (w: G rows of n weights; out rows
// out_stride apart), rounded to bf16 once; the accumulators are locals, in registers up to G = 6 (G x 4 + 5
// vectors of 32; 7 and 8 spill a few).
template <int G>
void values_of(const float* w, int64_t n, const uint16_t* vp, const int64_t* rows, int64_t R, int64_t off,
               uint16_t* out, int64_t out_stride, bool ahead) {
  __m512 acc[G][4];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < n; ++p) {
    if (ahead && p % kKeys == 0) fetch(vp, rows, std::min(n, p + kAheadKeys), std::min(n, p + kAheadKeys + kKeys), R);
    const uint16_t* v = vp + rows[p] * R + off;
    const __m512i lo = _mm512_loadu_si512(v), hi = _mm512_loadu_si512(v + 32);
    const __m512 vf[4] = {widen(_mm512_castsi512_si256(lo)), widen(_mm512_extracti64x4_epi64(lo, 1)),
                          widen(_mm512_castsi512_si256(hi)), widen(_mm512_extracti64x4_epi64(hi, 1))};
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512 wg = _mm512_set1_ps(w[g * n + p]);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_fmadd_ps(wg, vf[i], acc[g][i]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * out_stride + 16 * i),
                          (__m256i)_mm512_cvtneps_pbh(acc[g][i]));
}

template <int G>
void values(const float* w, int64_t n, const uint16_t* vp, const int64_t* rows, int64_t R, int64_t off, int64_t D,
            uint16_t* out) {
  for (int64_t dc = 0; dc < D; dc += 64) values_of<G>(w, n, vp, rows, R, off + dc, out + dc, D, off == 0 && dc == 0);
}

// One sequence: q [H, D] (bf16, head-major), its n keys at `rows`; out [H, D].
template <int NC>
void attend_one(const uint16_t* q, const uint16_t* kp, const uint16_t* vp, const int64_t* rows, int64_t n,
                int64_t H, int64_t KVH, float scale, std::vector<float>& scores, uint16_t* out) {
  const int64_t D = 32 * NC, G = H / KVH, R = KVH * D;
  scores.resize(H * n);
  float* s = scores.data();
  fetch(kp, rows, 0, std::min(n, kAheadKeys), R);
  for (int64_t h = 0; h < KVH; ++h)
    for (int64_t g = 0; g < G; ++g)
      scores_of<NC>(q + (h * G + g) * D, kp, rows, n, R, h * D, scale, s + (h * G + g) * n, h == 0 && g == 0);
  fetch(vp, rows, 0, std::min(n, kAheadKeys), R);
  softmax_rows(s, H, n);
  for (int64_t h = 0; h < KVH; ++h) {
    const float* w = s + h * G * n;
    uint16_t* o = out + h * G * D;
    switch (G) {
      case 1: values<1>(w, n, vp, rows, R, h * D, D, o); break;
      case 2: values<2>(w, n, vp, rows, R, h * D, D, o); break;
      case 3: values<3>(w, n, vp, rows, R, h * D, D, o); break;
      case 4: values<4>(w, n, vp, rows, R, h * D, D, o); break;
      case 5: values<5>(w, n, vp, rows, R, h * D, D, o); break;
      case 6: values<6>(w, n, vp, rows, R, h * D, D, o); break;
      case 7: values<7>(w, n, vp, rows, R, h * D, D, o); break;
      default: values<8>(w, n, vp, rows, R, h * D, D, o); break;
    }
  }
}

bool covers(int64_t H, int64_t KVH, int64_t D) {
  return (D == 64 || D == 128 || D == 256) && H % KVH == 0 && H / KVH >= 1 && H / KVH <= 8;
}

void attend(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const torch::Tensor& key_slots, const torch::Tensor& seq_lens, double scale, int64_t window,
            torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), q_row = q.stride(0), KVH = k_cache.size(1);
  const int64_t W = key_slots.size(1);
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t* slots = key_slots.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = std::min<int64_t>(lens[b], W);
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t* rows = slots + b * W + start;
      const uint16_t* qb = qp + b * q_row;
      uint16_t* ob = op + b * H * D;
      if (D == 64) attend_one<2>(qb, kp, vp, rows, len - start, H, KVH, sc, scores, ob);
      else if (D == 128) attend_one<4>(qb, kp, vp, rows, len - start, H, KVH, sc, scores, ob);
      else attend_one<8>(qb, kp, vp, rows, len - start, H, KVH, sc, scores, ob);
    }
  });
}
}  // namespace decode_fast
#endif

// Whether bf16 decodes with H query heads, KVH KV heads and head size D take the AVX512-BF16 path in this build
// (the execution plan names the body: engine/executor/plan.py).
bool decode_attention_bf16_body(int64_t H, int64_t KVH, int64_t D) {
#if defined(__AVX512BF16__)
  return decode_fast::covers(H, KVH, D);
#else
  (void)H, (void)KVH, (void)D;
  return false;
#endif
}

// q [B, H, D] (rows may be strided); returns [B, H, D] in q's dtype, computed in the caches'. `generic`: the first
// path even where the AVX512-BF16 one covers the shapes (for its tests and benchmark).
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor key_slots, torch::Tensor seq_lens, double scale, int64_t window,
                               bool generic) {
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
  if (kind == torch::kFloat) {
    attend<float>(q, k_cache, v_cache, key_slots, seq_lens, scale, window, out);
  } else {
#if defined(__AVX512BF16__)
    if (!generic && decode_fast::covers(q.size(1), k_cache.size(1), q.size(2)))
      decode_fast::attend(q, k_cache, v_cache, key_slots, seq_lens, scale, window, out);
    else
#endif
      attend<at::BFloat16>(q, k_cache, v_cache, key_slots, seq_lens, scale, window, out);
  }
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
