// What the two bf16 bodies of the chunked-prefill attention kernel share (prefill_attention.h: AVX512-BF16 register
// blocks; prefill_amx.h: AMX tiles): K and V repacked in the bf16 pairs layout both instructions read, the work
// items, each block row's key range, and the softmax of one row of scores. Built where the compiler targets
// AVX512-BF16 (every AMX CPU has it).
#pragma once
#include "attention_layout.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace prefill_bf16 {

// 2^x in the lanes of k (the others 0), for softmax arguments (x <= 0 in the lanes that count): 2^n * p(f), n = x
// rounded, f = x - n in [-1/2, 1/2], p a degree-5 fit of 2^f (relative error ~2e-7 in fp32, about fp32's rounding;
// P is rounded to bf16 after); scalef takes 2^n to denormals and 0 below 2^-126. Eight operations a vector against
// Cephes' e^x's fourteen: softmax's exponentials are most of the kernel's vector work after a long prefix (the
// products run on AMX there).
inline __m512 exp2_masked(__mmask16 k, __m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3400432653725147e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.676037356257439e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550327152013779e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402210682630539e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471824645996e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_maskz_scalef_ps(k, p, n);
}

// the lanes of a vector at j that come before index j + left
inline __mmask16 tail(int64_t left) {
  return left >= 16 ? 0xffff : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
}

// The operands of one call, read from the kernel's tensors: q [T, H, D] (rows strided), keys/values [slots, KVH, D],
// out [T, H, D] contiguous, bf16. Sequence s: rows q_start[s] .. + q_len[s] at positions ctx[s] .., keys at slots
// key_slots[s, 0 .. ctx + q_len) (slots null: the sequence's own rows, q_start[s] + j).
struct Operands {
  int64_t H, D, KVH, G, S, q_row, W, window;
  bool causal;
  const int64_t *qs, *ql, *cl, *slots;
  const uint16_t *qp, *kp, *vp;
  uint16_t* op;
};

inline Operands operands(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& q_start,
                         const torch::Tensor& q_len, const torch::Tensor& ctx_len, const int64_t* slots, int64_t W,
                         int64_t window, bool causal, const torch::Tensor& v_cache, torch::Tensor& out) {
  Operands o;
  o.H = q.size(1), o.D = q.size(2), o.KVH = k_cache.size(1), o.S = q_start.size(0), o.q_row = q.stride(0);
  TORCH_CHECK(o.D % 32 == 0 && o.H % o.KVH == 0 && k_cache.size(2) == o.D, "prefill_attention: head shapes");
  o.G = o.H / o.KVH, o.W = W, o.window = window, o.causal = causal, o.slots = slots;
  o.qs = q_start.data_ptr<int64_t>(), o.ql = q_len.data_ptr<int64_t>(), o.cl = ctx_len.data_ptr<int64_t>();
  o.qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  o.kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  o.vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  o.op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  return o;
}

// K of each (sequence, KV head) as [D/2][Lp] pairs of dims, V as [Lp/2][D] pairs of keys: the layout of
// vdpbf16ps's second operand (pack_kv). The AMX body orders the same pairs as whole tiles (prefill_amx.h's
// pack_tiles). Keys are padded to a multiple of the body's key block with zeros.
struct PackedKV {
  KeyLayout layout;
  std::unique_ptr<uint32_t[]> k, v;
  const uint32_t* keys(int64_t s, int64_t h, int64_t D) const {
    return k.get() + layout.pack_at[s] / 2 + h * layout.padded[s] * D / 2;
  }
  const uint32_t* values(int64_t s, int64_t h, int64_t D) const {
    return v.get() + layout.pack_at[s] / 2 + h * layout.padded[s] * D / 2;
  }
};

// Room for the operands' K and V, keys padded to a multiple of `block` (not yet written)
inline PackedKV packed_room(const Operands& o, int64_t block) {
  // NOTE: pack_at counts bf16 elements (halved for the uint32 pairs)
  PackedKV p{key_layout(o.S, o.cl, o.ql, o.slots, o.W, o.KVH, o.D, block), nullptr, nullptr};
  p.k.reset(new uint32_t[p.layout.pack_at[o.S] / 2 + 1]);
  p.v.reset(new uint32_t[p.layout.pack_at[o.S] / 2 + 1]);
  return p;
}

// The slot of sequence s's key j
inline int64_t key_slot(const Operands& o, int64_t s, int64_t j) {
  return o.slots != nullptr ? o.slots[s * o.W + j] : o.qs[s] + j;
}

inline PackedKV pack_kv(const Operands& o, int64_t block) {
  PackedKV p = packed_room(o, block);
  const size_t n = p.layout.pack_at[o.S] / 2 + 1;
  std::memset(p.k.get(), 0, n * sizeof(uint32_t));  // NOTE: zeroed: padding keys
  std::memset(p.v.get(), 0, n * sizeof(uint32_t));
  const int64_t D = o.D;
  at::parallel_for(0, o.S * o.KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / o.KVH, h = item % o.KVH, L = o.cl[s] + o.ql[s], Lp = p.layout.padded[s];
      uint32_t* kd = const_cast<uint32_t*>(p.keys(s, h, D));
      uint32_t* vd = const_cast<uint32_t*>(p.values(s, h, D));
      for (int64_t j = 0; j < L; ++j) {
        const int64_t slot = key_slot(o, s, j);
        const uint32_t* krow = reinterpret_cast<const uint32_t*>(o.kp + (slot * o.KVH + h) * D);
        for (int64_t q = 0; q < D / 2; ++q) kd[q * Lp + j] = krow[q];
        const uint16_t* vrow = o.vp + (slot * o.KVH + h) * D;
        uint16_t* vdst = reinterpret_cast<uint16_t*>(vd + (j / 2) * D) + (j & 1);
        for (int64_t d = 0; d < D; ++d) vdst[2 * d] = vrow[d];
      }
    }
  });
  return p;
}

// Work items: (sequence, KV head, block of `rows` query rows) as (s * KVH + h) << 32 | first row, zig-zagged so that
// contiguous halves cost alike (causal).
inline std::vector<int64_t> work_items(const Operands& o, int64_t rows) {
  std::vector<int64_t> items;
  for (int64_t s = 0; s < o.S; ++s)
    for (int64_t h = 0; h < o.KVH; ++h)
      for (int64_t r0 = 0; r0 < o.ql[s] * o.G; r0 += rows) items.push_back((s * o.KVH + h) << 32 | r0);
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < items.size(); ++i) order[i] = items[i % 2 == 0 ? i / 2 : items.size() - 1 - i / 2];
  return order;
}

// Softmax of one row's scores sr[jlo, jhi) (keys [a, b) seen, the rest weigh 0) scaled by `scale`, written as bf16
// into pr[jlo, jhi) (P is read in whole blocks of keys); returns 1 / the sum of its weights (of their fp32 values,
// before the rounding to bf16, as flash attention sums them).
inline float softmax_row(const float* sr, uint16_t* pr, int64_t a, int64_t b, int64_t jlo, int64_t jhi, float scale) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::max());
  for (int64_t j = a; j < b; j += 16) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail(b - j), sr + j));
  // e^(scale (x - max)) = 2^(x c - max c), c = scale log2(e)
  const float c = scale * 1.4426950408889634f;
  const __m512 vc = _mm512_set1_ps(c), vmc = _mm512_set1_ps(_mm512_reduce_max_ps(vmax) * c);
  // NOTE: whole vectors from a's, so the masked keys around [a, b) are written as zeros in the same stores
  const int64_t a16 = jlo + (a - jlo) / 16 * 16;
  for (int64_t j = jlo; j < a16; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), _mm256_setzero_si256());
  __m512 vsum = _mm512_setzero_ps();
  auto one = [&](int64_t j, __mmask16 k) {
    const __m512 e = exp2_masked(k, _mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, sr + j), vc, vmc));
    vsum = _mm512_add_ps(vsum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
  };
  int64_t j = a16;
  for (; j < jhi && (j < a || j + 16 > b); j += 16) one(j, static_cast<__mmask16>(tail(b - j) & ~tail(a - j)));
  for (; j + 16 <= b; j += 16) one(j, 0xffff);  // NOTE: whole vectors need no mask
  for (; j < jhi; j += 16) one(j, static_cast<__mmask16>(tail(b - j) & ~tail(a - j)));
  return 1.f / _mm512_reduce_add_ps(vsum);
}

// Row r of a block's output: o[0 .. n16 * 16) * inv as bf16 at out row (token, head) of the block's row.
inline void write_row(const Operands& o, int64_t s, int64_t h, int64_t row, int64_t dc, const float* acc, int n16,
                      float inv) {
  const int64_t t = row / o.G, g = row % o.G;
  uint16_t* orow = o.op + ((o.qs[s] + t) * o.H + h * o.G + g) * o.D + dc;
  const __m512 scale_r = _mm512_set1_ps(inv);
  for (int i = 0; i < n16; ++i) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * i), scale_r);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + 16 * i), (__m256i)_mm512_cvtneps_pbh(x));
  }
}

// One work item of a body with blocks of RB rows and score blocks of KB keys: its sequence and KV head, its rows
// (of one KV head: (token, head-in-group), token-major; rows past the sequence's last repeat it), each row's last
// key (`lim`), first key (`lo`) and query, and the keys any row sees, [jlo, jhi) in whole score blocks.
template <int64_t RB, int64_t KB>
struct Block {
  int64_t s, h, r0, rows, jlo, jhi;
  int64_t lim[RB], lo[RB];
  const uint16_t* qrow[RB];

  Block(const Operands& o, const PackedKV& packed, int64_t item) {
    const int64_t sh = item >> 32;
    s = sh / o.KVH, h = sh % o.KVH, r0 = item & 0xffffffff;
    const int64_t n = o.ql[s], c = o.cl[s];
    rows = n * o.G;
    for (int64_t r = 0; r < RB; ++r) {
      const int64_t rr = std::min(r0 + r, rows - 1), t = rr / o.G, g = rr % o.G;
      lim[r] = o.causal ? c + t : c + n - 1;
      lo[r] = o.window > 0 ? std::max<int64_t>(0, lim[r] - o.window + 1) : 0;
      qrow[r] = o.qp + (o.qs[s] + t) * o.q_row + (h * o.G + g) * o.D;
    }
    jhi = std::min(packed.layout.padded[s], (lim[RB - 1] + KB) / KB * KB);  // keys past every row's limit: skipped
    jlo = lo[0] / KB * KB;
  }

  // The softmax of every row's scores (rows of ld floats in sbuf) into P (rows of ld bf16 in pbuf), 1 / each sum
  // into inv.
  void softmax(const float* sbuf, uint16_t* pbuf, int64_t ld, float scale, float* inv) const {
    for (int64_t r = 0; r < RB; ++r)
      inv[r] = softmax_row(sbuf + r * ld, pbuf + r * ld, lo[r], std::min(lim[r] + 1, jhi), jlo, jhi, scale);
  }

  // Dims dc .. dc + n16 * 16 of the block's real rows from acc (RB rows of n16 * 16 floats), scaled by inv.
  void write(const Operands& o, int64_t dc, const float* acc, int n16, const float* inv) const {
    for (int64_t r = 0; r < RB && r0 + r < rows; ++r) write_row(o, s, h, r0 + r, dc, acc + r * n16 * 16, n16, inv[r]);
  }
};

}  // namespace prefill_bf16
#endif
