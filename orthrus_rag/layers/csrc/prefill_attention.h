// The CPU chunked-prefill attention kernel (its wrapper and notes: layers/attention/cpu_prefill.py): a bf16 body
// in AVX512-BF16 here, one on AMX tiles in prefill_amx.h (what they share: prefill_bf16.h), and an fp32 one for any
// x86-64 CPU in attention_f32.h.
#pragma once
#include "attention_f32.h"
#include "prefill_bf16.h"
#include "prefill_amx.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace prefill_dispatch {
inline std::atomic<bool> use_amx{true};
}  // namespace prefill_dispatch

// bf16 takes the AMX body wherever it runs (prefill_attention_amx_runs); off, the AVX512-BF16 body runs there too
// (its tests and benchmarks on an AMX CPU). Returns the setting it replaces.
inline bool prefill_attention_use_amx(bool on) { return prefill_dispatch::use_amx.exchange(on); }

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

// The AVX512-BF16 body: blocks of RB rows, scores in register blocks of RB x KB, P @ V in RB x 64 dims.
void attend_rows(const prefill_bf16::Operands& o, double scale) {
  using namespace prefill_bf16;
  const int64_t D = o.D;
  const PackedKV packed = pack_kv(o, KB);
  const int64_t Lmax = packed.layout.max_padded;
  const std::vector<int64_t> order = work_items(o, RB);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, static_cast<int64_t>(order.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sbuf(RB * Lmax);
    std::vector<uint32_t> pbuf(RB * Lmax / 2);
    for (int64_t it = begin; it < end; ++it) {
      const Block<RB, KB> b(o, packed, order[it]);
      const int64_t Lp = packed.layout.padded[b.s];
      const uint32_t* kd = packed.keys(b.s, b.h, D);
      const uint32_t* vd = packed.values(b.s, b.h, D);
      const uint32_t* qrow[RB];
      for (int64_t r = 0; r < RB; ++r) qrow[r] = reinterpret_cast<const uint32_t*>(b.qrow[r]);
      for (int64_t jb = b.jlo; jb < b.jhi; jb += KB) {
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
      b.softmax(sbuf.data(), reinterpret_cast<uint16_t*>(pbuf.data()), Lmax, sc, inv);
      const uint32_t* prow[RB];
      for (int64_t r = 0; r < RB; ++r) prow[r] = pbuf.data() + r * Lmax / 2;
      const int nv = D % 64 == 0 ? 4 : 2;
      for (int64_t dc = 0; dc < D; dc += nv * 16) {
        float obuf[RB * 64];
        if (nv == 4) pv_block<4>(prow, vd, D, b.jlo / 2, b.jhi / 2, dc, obuf);
        else pv_block<2>(prow, vd, D, b.jlo / 2, b.jhi / 2, dc, obuf);
        b.write(o, dc, obuf, nv, inv);
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
  const prefill_bf16::Operands o =
      prefill_bf16::operands(q, k, q_start, q_len, ctx_len, slots, W, window, causal, v, out);
#if ORTHRUS_PREFILL_AMX
  if (prefill_dispatch::use_amx && prefill_amx::usable()) {
    prefill_amx::attend_rows(o, scale);
    return;
  }
#endif
  attend_rows(o, scale);
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
