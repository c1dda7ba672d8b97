// The CPU chunked-prefill attention kernel (its wrapper and notes: layers/attention/cpu_prefill.py): a bf16 body
// in AVX512-BF16 here, and an fp32 one for any x86-64 CPU in attention_f32.h.
#pragma once
#include "attention_f32.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

bool prefill_attention_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
namespace {
constexpr int64_t RB = 4;      // query rows per block (rows of one KV head: (token, head-in-group), token-major)
constexpr int64_t KB = 32;     // keys per score block (two 16-lane vectors)

inline __m512 dot2(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

// e^x for x <= 0 (softmax arguments), ~2 ulp: 2^n * p(r), r = x - n ln2, a degree-6 polynomial (Cephes' expf)
inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail(int64_t left) { return left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1); }

// out[RB][NV*16] = P[RB, keys] V[keys, dc : dc + NV*16]; V packed as pairs of keys per lane. Accumulators are
// locals (registers): an array passed in by reference is spilled every iteration.
template <int NV>
inline void pv_block(const uint32_t* const* prow, const uint32_t* vp, int64_t D, int64_t jp0, int64_t jp1,
                     int64_t dc, float* out) {
  __m512 acc[RB][NV];
#pragma GCC unroll 4
  for (int64_t r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t jp = jp0; jp < jp1; ++jp) {
    __m512i vv[NV];
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) vv[i] = _mm512_loadu_si512(vp + jp * D + dc + 16 * i);
#pragma GCC unroll 4
    for (int64_t r = 0; r < RB; ++r) {
      const __m512i pb = _mm512_set1_epi32(static_cast<int>(prow[r][jp]));
#pragma GCC unroll 4
      for (int i = 0; i < NV; ++i) acc[r][i] = dot2(acc[r][i], pb, vv[i]);
    }
  }
#pragma GCC unroll 4
  for (int64_t r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + (r * NV + i) * 16, acc[r][i]);
}
}  // namespace
#endif

#if defined(__AVX512BF16__)
namespace {
// The one body of both kernels. q [T, H, D] (rows strided), keys/values [slots, KVH, D], out [T, H, D]
// contiguous: bf16. Per sequence s: rows q_start[s] .. + q_len[s] at positions ctx[s] .., keys at slots
// key_slots[s, 0 .. ctx + q_len) (slots null: the sequence's own rows, q_start[s] + j). Causal: a row sees the
// keys up to its position (and `window` back); bidirectional: every key of its sequence.
void attend_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor q_start,
                 torch::Tensor q_len, torch::Tensor ctx_len, const int64_t* slots, int64_t W, double scale,
                 int64_t window, bool causal, torch::Tensor out) {
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1), G = H / KVH, S = q_start.size(0);
  const int64_t q_row = q.stride(0);
  TORCH_CHECK(D % 32 == 0 && H % KVH == 0 && k_cache.size(2) == D, "prefill_attention: head shapes");
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  const int64_t* cl = ctx_len.data_ptr<int64_t>();
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // K of each (sequence, KV head) as [D/2][Lp] pairs of dims; V as [Lp/2][D] pairs of keys (dpbf16 operands)
  // NOTE: pack_at counts bf16 elements (halved for the uint32 pairs)
  const KeyLayout layout = key_layout(S, cl, ql, slots, W, KVH, D, KB);
  const std::vector<int64_t>& pack_at = layout.pack_at;
  const std::vector<int64_t>& padded = layout.padded;
  const int64_t Lmax = layout.max_padded;
  std::vector<uint32_t> kpack(pack_at[S] / 2 + 1), vpack(pack_at[S] / 2 + 1);  // NOTE: zeroed: padding keys
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / KVH, h = item % KVH, L = cl[s] + ql[s], Lp = padded[s];
      uint32_t* kd = kpack.data() + pack_at[s] / 2 + h * Lp * D / 2;
      uint32_t* vd = vpack.data() + pack_at[s] / 2 + h * Lp * D / 2;
      for (int64_t j = 0; j < L; ++j) {
        const int64_t slot = slots != nullptr ? slots[s * W + j] : qs[s] + j;
        const uint32_t* krow = reinterpret_cast<const uint32_t*>(kp + (slot * KVH + h) * D);
        for (int64_t p = 0; p < D / 2; ++p) kd[p * Lp + j] = krow[p];
        const uint16_t* vrow = vp + (slot * KVH + h) * D;
        uint16_t* vdst = reinterpret_cast<uint16_t*>(vd + (j / 2) * D) + (j & 1);
        for (int64_t d = 0; d < D; ++d) vdst[2 * d] = vrow[d];
      }
    }
  });
  // work items: (sequence, KV head, block of RB rows), zig-zagged so that contiguous halves cost alike (causal)
  std::vector<int64_t> items;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t r0 = 0; r0 < ql[s] * G; r0 += RB) items.push_back((s * KVH + h) << 32 | r0);
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < items.size(); ++i) order[i] = items[i % 2 == 0 ? i / 2 : items.size() - 1 - i / 2];
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, static_cast<int64_t>(order.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sbuf(RB * Lmax);
    std::vector<uint32_t> pbuf(RB * Lmax / 2);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t sh = order[it] >> 32, r0 = order[it] & 0xffffffff, s = sh / KVH, h = sh % KVH;
      const int64_t n = ql[s], c = cl[s], Lp = padded[s], rows = n * G;
      const uint32_t* kd = kpack.data() + pack_at[s] / 2 + h * Lp * D / 2;
      const uint32_t* vd = vpack.data() + pack_at[s] / 2 + h * Lp * D / 2;
      int64_t lim[RB], lo[RB];
      const uint32_t* qrow[RB];
      for (int64_t r = 0; r < RB; ++r) {
        const int64_t rr = std::min(r0 + r, rows - 1), t = rr / G, g = rr % G;
        lim[r] = causal ? c + t : c + n - 1;  // last key this row sees
        lo[r] = window > 0 ? std::max<int64_t>(0, lim[r] - window + 1) : 0;
        qrow[r] = reinterpret_cast<const uint32_t*>(qp + (qs[s] + t) * q_row + (h * G + g) * D);
      }
      const int64_t jhi = std::min(Lp, (lim[RB - 1] + KB) / KB * KB);  // keys past every row's limit: skipped
      const int64_t jlo = lo[0] / KB * KB;
      for (int64_t jb = jlo; jb < jhi; jb += KB) {
        __m512 acc[RB][2];
        for (int64_t r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t p = 0; p < D / 2; ++p) {
          const __m512i k0 = _mm512_loadu_si512(kd + p * Lp + jb), k1 = _mm512_loadu_si512(kd + p * Lp + jb + 16);
          for (int64_t r = 0; r < RB; ++r) {
            const __m512i qb = _mm512_set1_epi32(static_cast<int>(qrow[r][p]));
            acc[r][0] = dot2(acc[r][0], qb, k0);
            acc[r][1] = dot2(acc[r][1], qb, k1);
          }
        }
        for (int64_t r = 0; r < RB; ++r) {
          _mm512_storeu_ps(sbuf.data() + r * Lmax + jb, acc[r][0]);
          _mm512_storeu_ps(sbuf.data() + r * Lmax + jb + 16, acc[r][1]);
        }
      }
      float inv[RB];
      for (int64_t r = 0; r < RB; ++r) {
        float* sr = sbuf.data() + r * Lmax;
        const int64_t a = lo[r], b = std::min(lim[r] + 1, jhi);
        __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::max());
        for (int64_t j = a; j < b; j += 16)
          vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail(b - j), sr + j));
        const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(vmax)), vsc = _mm512_set1_ps(sc);
        // masked keys weigh 0 (P is read in whole blocks of KB keys)
        for (int64_t j = jlo; j < a; ++j) sr[j] = 0.f;
        for (int64_t j = b; j < jhi; ++j) sr[j] = 0.f;
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t j = a; j < b; j += 16) {
          const __mmask16 k = tail(b - j);
          const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sr + j), vm), vsc);
          const __m512 e = _mm512_maskz_mov_ps(k, exp_neg(x));
          _mm512_mask_storeu_ps(sr + j, k, e);
          vsum = _mm512_add_ps(vsum, e);
        }
        inv[r] = 1.f / _mm512_reduce_add_ps(vsum);
        uint16_t* pr = reinterpret_cast<uint16_t*>(pbuf.data() + r * Lmax / 2);
        for (int64_t j = jlo; j < jhi; j += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sr + j)));
      }
      const uint32_t* prow[RB];
      for (int64_t r = 0; r < RB; ++r) prow[r] = pbuf.data() + r * Lmax / 2;
      const int64_t nv = D % 64 == 0 ? 4 : 2, chunk = nv * 16;
      for (int64_t dc = 0; dc < D; dc += chunk) {
        float obuf[RB * 64];
        if (nv == 4) pv_block<4>(prow, vd, D, jlo / 2, jhi / 2, dc, obuf);
        else pv_block<2>(prow, vd, D, jlo / 2, jhi / 2, dc, obuf);
        for (int64_t r = 0; r < RB && r0 + r < rows; ++r) {
          const int64_t t = (r0 + r) / G, g = (r0 + r) % G;
          uint16_t* orow = op + ((qs[s] + t) * H + h * G + g) * D + dc;
          const __m512 scale_r = _mm512_set1_ps(inv[r]);
          for (int64_t i = 0; i < nv; ++i) {
            const __m512 o = _mm512_mul_ps(_mm512_loadu_ps(obuf + (r * nv + i) * 16), scale_r);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + 16 * i), (__m256i)_mm512_cvtneps_pbh(o));
          }
        }
      }
    }
  });
}

}  // namespace
#endif

namespace {
// Both kernels' operands: one dtype, fp32 (any CPU) or bf16 (where built with AVX512-BF16); q's rows may be
// strided (a view of the fused Q/K/V output), each row's heads one contiguous run; keys, values and out contiguous.
void check_operands(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                    const char* what) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt && out.scalar_type() == dt, what,
              ": q, k, v and out of one dtype");
  TORCH_CHECK(dt == torch::kFloat || (dt == torch::kBFloat16 && prefill_attention_supported()), what,
              ": float32 tensors (or bfloat16 on a CPU with AVX512-BF16), not ", dt);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.is_contiguous() && v.is_contiguous() &&
              out.is_contiguous(), what, ": contiguous tensors");
}

// The body for the operands' dtype (checked by check_operands).
void attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor q_start, torch::Tensor q_len,
            torch::Tensor ctx_len, const int64_t* slots, int64_t W, double scale, int64_t window, bool causal,
            torch::Tensor out) {
  if (q.scalar_type() == torch::kFloat) {
    attention_f32::attend_rows(q, k, v, q_start, q_len, ctx_len, slots, W, scale, window, causal, out);
    return;
  }
#if defined(__AVX512BF16__)
  attend_rows(q, k, v, q_start, q_len, ctx_len, slots, W, scale, window, causal, out);
#endif
}
}  // namespace

// Chunked prefill over the paged cache: q [T, H, D] (rows strided), caches [slots, KVH, D], out [T, H, D]
// contiguous, fp32 or bf16; causal within each sequence, keys key_slots[s, 0 .. ctx_len[s] + q_len[s]).
void prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor q_start,
                       torch::Tensor q_len, torch::Tensor ctx_len, torch::Tensor key_slots, double scale,
                       int64_t window, torch::Tensor out) {
  check_operands(q, k_cache, v_cache, out, "prefill_attention");
  TORCH_CHECK(key_slots.is_contiguous(), "prefill_attention: contiguous tensors");
  attend(q, k_cache, v_cache, q_start, q_len, ctx_len, key_slots.data_ptr<int64_t>(), key_slots.size(1), scale,
         window, true, out);
}

// An encoder's attention over a packed batch (attention/cpu_encoder.py): q, k, v [T, H, D] fp32 or bf16 (q's rows
// may be strided, k and v contiguous), sequences back to back from row q_start[s] for q_len[s] rows; every row attends
// to all the rows of its own sequence. Writes out [T, H, D].
void encoder_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor q_start, torch::Tensor q_len,
                       double scale, torch::Tensor out) {
  check_operands(q, k, v, out, "encoder_attention");
  TORCH_CHECK(q_start.is_contiguous() && q_len.is_contiguous(), "encoder_attention: contiguous tensors");
  TORCH_CHECK(k.size(0) == q.size(0) && v.sizes() == k.sizes(), "encoder_attention: q, k and v rows differ");
  TORCH_CHECK(q_start.scalar_type() == torch::kLong && q_len.scalar_type() == torch::kLong &&
              q_len.size(0) == q_start.size(0), "encoder_attention: q_start and q_len: int64, one per sequence");
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  for (int64_t s = 0; s < q_start.size(0); ++s)
    TORCH_CHECK(qs[s] >= 0 && ql[s] >= 0 && qs[s] + ql[s] <= q.size(0), "encoder_attention: sequence ", s,
                " (rows ", qs[s], " + ", ql[s], ") is outside the batch's ", q.size(0), " rows");
  attend(q, k, v, q_start, q_len, torch::zeros_like(q_len), nullptr, 0, scale, -1, false, out);
}
