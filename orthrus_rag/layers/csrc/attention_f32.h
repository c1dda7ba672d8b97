// The fp32 body of the chunked-prefill and encoder attention kernels (prefill_attention.h calls it for fp32
// tensors; the notes: layers/attention/cpu_prefill.py). Any x86-64 CPU: GCC vector extensions one register wide
// (8 floats with AVX2, 16 with AVX-512), so one source serves both and an AVX2-only CPU, which runs every model in
// fp32, gets a kernel where it had torch's SDPA.
#pragma once
#include "attention_layout.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace attention_f32 {
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
// query rows per block (rows of one KV head: (token, head-in-group), token-major): RB x 2 accumulators, two operands
// and a broadcast fill 15 of AVX2's 16 registers
#if defined(__AVX512F__)
constexpr int64_t RB = 8;
#else
constexpr int64_t RB = 6;
#endif
constexpr int64_t KB = 2 * kLanes;  // keys per score block
constexpr int64_t DC = 2 * kLanes;  // head dims per P @ V pass
typedef float FV __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IV __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline FV load(const float* p) {
  FV v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, FV v) { std::memcpy(p, &v, sizeof v); }
inline FV splat(float x) { return FV{} + x; }

// e^x for x <= 0 (softmax arguments), Cephes' polynomial (the bf16 bodies take 2^x instead: prefill_bf16.h): 2^n * p(r),
// r = x - n ln2. glibc's vector expf takes a scalar path for underflowing lanes, which softmax has many of.
inline FV exp_neg(FV x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  // NOTE: x <= 0, so truncating t - 0.5 toward zero rounds t to the nearest integer; n >= -126 (x >= -87)
  const IV n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, IV);
  const FV nf = __builtin_convertvector(n, FV);
  FV r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  FV p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + (r + 1.f);
  const IV bits = (n + 127) << 23;  // 2^n as a float's exponent field
  FV scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// The packed keys' buffer, kept per calling thread and grown as needed: a fresh one per call costs its page faults
// at every layer (a step's K is megabytes).
inline float* key_buffer(int64_t n) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// q [T, H, D] (rows strided), keys/values [slots, KVH, D], out [T, H, D] contiguous: fp32. Per sequence s: rows
// q_start[s] .. + q_len[s] at positions ctx[s] .., keys at slots key_slots[s, 0 .. ctx + q_len) (slots null: the
// sequence's own rows, q_start[s] + j). Causal: a row sees the keys up to its position (and `window` back);
// bidirectional: every key of its sequence. K is transposed per (sequence, KV head) so a block of scores is
// contiguous loads; V is read in place (a row's D floats are contiguous); scores, softmax and P stay fp32.
inline void attend_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor q_start,
                        torch::Tensor q_len, torch::Tensor ctx_len, const int64_t* slots, int64_t W, double scale,
                        int64_t window, bool causal, torch::Tensor out) {
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1), G = H / KVH, S = q_start.size(0);
  const int64_t q_row = q.stride(0);
  TORCH_CHECK(D % DC == 0 && H % KVH == 0 && k_cache.size(2) == D, "prefill_attention: head shapes");
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  const int64_t* cl = ctx_len.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const KeyLayout layout = key_layout(S, cl, ql, slots, W, KVH, D, KB);
  const std::vector<int64_t>& pack_at = layout.pack_at;
  const std::vector<int64_t>& padded = layout.padded;
  const int64_t Lmax = layout.max_padded;
  float* kpack = key_buffer(pack_at[S]);
  auto slot_of = [&](int64_t s, int64_t j) { return slots != nullptr ? slots[s * W + j] : qs[s] + j; };
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / KVH, h = item % KVH, L = cl[s] + ql[s], Lp = padded[s];
      float* kd = kpack + pack_at[s] + h * Lp * D;
      std::vector<const float*> krows(L);
      for (int64_t j = 0; j < L; ++j) krows[j] = kp + (slot_of(s, j) * KVH + h) * D;
      // NOTE: dims outer, keys inner: the stores run contiguous (keys inner wrote one float per line, at a stride
      // of Lp floats: 17% of the kernel's time, store-bound)
      for (int64_t d = 0; d < D; ++d) {
        float* kdd = kd + d * Lp;
        for (int64_t j = 0; j < L; ++j) kdd[j] = krows[j][d];
        for (int64_t j = L; j < Lp; ++j) kdd[j] = 0.f;  // padding keys: scores 0, weight 0
      }
    }
  });
  // work items: (sequence, KV head, block of RB rows), each (sequence, KV head)'s blocks together (its K stays in
  // cache) and zig-zagged among themselves (first, last, second, ...), so contiguous halves cost alike (causal)
  std::vector<int64_t> order;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t blocks = (ql[s] * G + RB - 1) / RB;
      for (int64_t i = 0; i < blocks; ++i)
        order.push_back((s * KVH + h) << 32 | (i % 2 == 0 ? i / 2 : blocks - 1 - i / 2) * RB);
    }
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, static_cast<int64_t>(order.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sbuf(RB * Lmax);
    std::vector<const float*> vrows(Lmax);
    int64_t vrows_of = -1;  // the (sequence, KV head) whose V rows vrows holds
    for (int64_t it = begin; it < end; ++it) {
      const int64_t sh = order[it] >> 32, r0 = order[it] & 0xffffffff, s = sh / KVH, h = sh % KVH;
      const int64_t n = ql[s], c = cl[s], Lp = padded[s], rows = n * G;
      const float* kd = kpack + pack_at[s] + h * Lp * D;
      if (vrows_of != sh) {
        vrows_of = sh;
        for (int64_t j = 0; j < c + n; ++j) vrows[j] = vp + (slot_of(s, j) * KVH + h) * D;
      }
      int64_t lim[RB], lo[RB];
      const float* qrow[RB];
      for (int64_t r = 0; r < RB; ++r) {
        const int64_t rr = std::min(r0 + r, rows - 1), t = rr / G, g = rr % G;
        lim[r] = causal ? c + t : c + n - 1;  // last key this row sees
        lo[r] = window > 0 ? std::max<int64_t>(0, lim[r] - window + 1) : 0;
        qrow[r] = qp + (qs[s] + t) * q_row + (h * G + g) * D;
      }
      const int64_t jhi = std::min(Lp, (lim[RB - 1] + KB) / KB * KB);  // keys past every row's limit: skipped
      const int64_t jlo = lo[0] / KB * KB;
      for (int64_t jb = jlo; jb < jhi; jb += KB) {
        FV acc[RB][2];
        for (int64_t r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = FV{};
        for (int64_t d = 0; d < D; ++d) {
          FV k0 = load(kd + d * Lp + jb), k1 = load(kd + d * Lp + jb + kLanes);
          // NOTE: kept in registers: GCC would fold the loads into every row's FMA, RB x 2 loads where 2 do
          asm("" : "+x"(k0), "+x"(k1));
#pragma GCC unroll 8
          for (int64_t r = 0; r < RB; ++r) {
            const FV qb = splat(qrow[r][d]);
            acc[r][0] += qb * k0;
            acc[r][1] += qb * k1;
          }
        }
        for (int64_t r = 0; r < RB; ++r) {
          store(sbuf.data() + r * Lmax + jb, acc[r][0]);
          store(sbuf.data() + r * Lmax + jb + kLanes, acc[r][1]);
        }
      }
      float inv[RB];
      for (int64_t r = 0; r < RB; ++r) {
        float* sr = sbuf.data() + r * Lmax;
        const int64_t a = lo[r], b = std::min(lim[r] + 1, jhi);
        float m = -std::numeric_limits<float>::max();
        for (int64_t j = a; j < b; ++j) m = std::max(m, sr[j]);
        // NOTE: whole vectors, masked keys included (clamped to e^0, then zeroed)
        for (int64_t j = jlo; j < jhi; j += kLanes) {
          const FV x = (load(sr + j) - m) * sc;
          store(sr + j, exp_neg(x > FV{} ? FV{} : x));
        }
        for (int64_t j = jlo; j < a; ++j) sr[j] = 0.f;
        for (int64_t j = b; j < jhi; ++j) sr[j] = 0.f;
        float sum = 0.f;
        for (int64_t j = a; j < b; ++j) sum += sr[j];
        inv[r] = 1.f / sum;
      }
      // P @ V over the keys any row of the block sees (padding keys have no V row)
      const int64_t jend = std::min(jhi, c + n);
      for (int64_t dc = 0; dc < D; dc += DC) {
        FV o[RB][2];
        for (int64_t r = 0; r < RB; ++r) o[r][0] = o[r][1] = FV{};
        for (int64_t j = jlo; j < jend; ++j) {
          const float* vrow = vrows[j] + dc;
          const FV v0 = load(vrow), v1 = load(vrow + kLanes);
#pragma GCC unroll 8
          for (int64_t r = 0; r < RB; ++r) {
            const FV pb = splat(sbuf[r * Lmax + j]);
            o[r][0] += pb * v0;
            o[r][1] += pb * v1;
          }
        }
        for (int64_t r = 0; r < RB && r0 + r < rows; ++r) {
          const int64_t t = (r0 + r) / G, g = (r0 + r) % G;
          float* orow = op + ((qs[s] + t) * H + h * G + g) * D + dc;
          store(orow, o[r][0] * inv[r]);
          store(orow + kLanes, o[r][1] * inv[r]);
        }
      }
    }
  });
}
}  // namespace attention_f32
