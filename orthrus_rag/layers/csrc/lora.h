// The CPU LoRA kernel (its wrapper and notes: layers/lora_fused.py). It reads elementwise.h's load / store forms of
// fp32 and bf16 and, in its AVX512-BF16 path, decode_attention.h's lane masks; the layer loop calls it.
#pragma once
#include "elementwise.h"
#include "decode_attention.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace lora_detail {
// One targeted part of a projection: B transposed [rank, out] in fp32 (so a row of the update is `rank` saxpys
// over contiguous memory), or for bf16 rows B in bf16 pairs [rank / 2, out, 2] (`pairs`: vdpbf16ps's operand
// layout); the part's first output column and its first row of the stacked A.
struct Part {
  const void* b;
  bool pairs;
  int64_t rank, out, out_start, col_start;
};

constexpr int64_t kRows = 4;   // rows a pass reads each A and B row for (their loads shared by four rows)
// One register of floats (GCC / clang vector extensions): 16 lanes with AVX-512, 8 with AVX2. The accumulators
// below stay in registers (10-20% over the plain loops at 32-256 rows); 16-lane values on AVX2 (two registers each)
// made expand's 16 accumulators and operands overflow its 16 registers: the fp32 kernel ran 0.4x torch's ops.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
constexpr int64_t kCols = 2 * kLanes;  // output columns a pass keeps in registers, per row
typedef float V16 __attribute__((vector_size(kLanes * sizeof(float))));
inline V16 load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline float lane_sum(V16 v) {
  float s = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

#if defined(__AVX512BF16__)
// expand's bf16-pairs form: y[row] += h[row][part] B^T with h rounded to bf16 (as torch's bf16 product holds it)
// and 32 products an instruction, the sums in fp32, each output rounded once.
inline void expand_pairs(uint16_t* y, int64_t ys, const int64_t* rows, int64_t first, int64_t m, int64_t R,
                         const Part& p, const float* h) {
  const uint32_t* b = static_cast<const uint32_t*>(p.b);  // [rank / 2, out] bf16 pairs
  const int64_t half = p.rank / 2;
  uint32_t hp[kRows][64];  // the block's h pairs of this part (rank <= 128)
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < half; ++c)
      hp[r][c] = static_cast<uint32_t>(elementwise::BF16::store(h[r * R + p.col_start + 2 * c])) |
                 (static_cast<uint32_t>(elementwise::BF16::store(h[r * R + p.col_start + 2 * c + 1])) << 16);
  for (int64_t j0 = 0; j0 < p.out; j0 += kCols) {
    const int64_t w = std::min(kCols, p.out - j0);
    // NOTE: decode_fast::first (decode_attention.h): the first m of 16 lanes
    const __mmask16 m0 = decode_fast::first(w), m1 = decode_fast::first(std::max<int64_t>(w - 16, 0));
    __m512 lo[kRows], hi[kRows];
    for (int64_t r = 0; r < kRows; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < half; ++c) {
      const uint32_t* bc = b + c * p.out + j0;
      const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, bc);
      const __m512bh b1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, bc + 16);
#pragma GCC unroll 4
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512bh hv = (__m512bh)_mm512_set1_epi32(static_cast<int>(hp[r][c]));
        lo[r] = _mm512_dpbf16_ps(lo[r], b0, hv);
        hi[r] = _mm512_dpbf16_ps(hi[r], b1, hv);
      }
    }
    for (int64_t r = 0; r < m; ++r) {
      float acc[kCols];
      _mm512_storeu_ps(acc, lo[r]);
      _mm512_storeu_ps(acc + 16, hi[r]);
      uint16_t* yo = y + rows[first + r] * ys + p.out_start + j0;
#pragma omp simd
      for (int64_t j = 0; j < w; ++j) yo[j] = elementwise::BF16::store(elementwise::BF16::load(yo[j]) + acc[j]);
    }
  }
}

// h[r][c] = scale * x[row r] . A[c] for the block's rows (a missing fourth row repeats a real one: computed, never
// stored), bf16 pairs by vdpbf16ps into fp32 sums; `in` a multiple of 32.
inline void shrink_bf16(const uint16_t* x, int64_t xs, const int64_t* rows, int64_t first, int64_t m,
                        const uint16_t* a, int64_t R, int64_t in, float scale, float* h) {
  const uint16_t* xr[kRows];
  for (int64_t r = 0; r < kRows; ++r) xr[r] = x + rows[first + std::min(r, m - 1)] * xs;
  for (int64_t c = 0; c < R; ++c) {
    const uint16_t* ac = a + c * in;
    __m512 s[kRows] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k < in; k += 32) {
      const __m512bh av = (__m512bh)_mm512_loadu_si512(ac + k);
#pragma GCC unroll 4
      for (int64_t r = 0; r < kRows; ++r) s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)_mm512_loadu_si512(xr[r] + k), av);
    }
    for (int64_t r = 0; r < kRows; ++r) h[r * R + c] = _mm512_reduce_add_ps(s[r]) * scale;
  }
}
#endif

// y[row] += h[row] B^T for the block's m rows (h [kRows, R], scaled), part by part: 32 columns of four rows at a
// time, the sums in fp32, each output rounded once.
template <typename K, typename T = typename K::S>
void expand(T* y, int64_t ys, const int64_t* rows, int64_t first, int64_t m, int64_t R, const std::vector<Part>& parts,
            const float* h) {
  for (const Part& p : parts) {
#if defined(__AVX512BF16__)
    if (p.pairs) {
      expand_pairs(reinterpret_cast<uint16_t*>(y), ys, rows, first, m, R, p, h);
      continue;
    }
#endif
    const float* bt = static_cast<const float*>(p.b);
    for (int64_t j0 = 0; j0 < p.out; j0 += kCols) {
      const int64_t w = std::min(kCols, p.out - j0);
      float acc[kRows][kCols];
      if (w == kCols) {
        V16 lo[kRows] = {}, hi[kRows] = {};
        for (int64_t c = 0; c < p.rank; ++c) {
          const float* b = bt + c * p.out + j0;
          const V16 b0 = load16(b), b1 = load16(b + kLanes);
          for (int64_t r = 0; r < kRows; ++r) {
            const float hc = h[r * R + p.col_start + c];
            lo[r] += hc * b0;
            hi[r] += hc * b1;
          }
        }
        for (int64_t r = 0; r < kRows; ++r) {
          std::memcpy(acc[r], &lo[r], sizeof(V16));
          std::memcpy(acc[r] + kLanes, &hi[r], sizeof(V16));
        }
      } else {
        for (int64_t r = 0; r < kRows; ++r) std::fill(acc[r], acc[r] + w, 0.f);
        for (int64_t c = 0; c < p.rank; ++c) {
          const float* b = bt + c * p.out + j0;
          for (int64_t r = 0; r < kRows; ++r) {
            const float hc = h[r * R + p.col_start + c];
            for (int64_t j = 0; j < w; ++j) acc[r][j] += hc * b[j];
          }
        }
      }
      for (int64_t r = 0; r < m; ++r) {
        T* yo = y + rows[first + r] * ys + p.out_start + j0;
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) yo[j] = K::store(K::load(yo[j]) + acc[r][j]);
      }
    }
  }
}


// y[row, part] += (scale * x[row] A^T)[part's columns] B_part^T for each row: every sum in fp32, the output
// rounded once. A [R, in] and the parts' B are fp32 (exact copies of the model dtype's factors: no conversion in
// the inner loops); `a16`, A in bf16 for bf16 rows (else null), takes the AVX512-BF16 products where the CPU has
// them. Rows are distinct (one task writes each), so blocks of rows run in parallel.
// NOTE: out of line, so that Python's lora_add and the layer loop run the very same code (-ffast-math may contract
// an inlined copy otherwise)
template <typename K, typename T = typename K::S>
__attribute__((noinline)) void add_rows(const T* x, int64_t xs, T* y, int64_t ys, const int64_t* rows, int64_t n,
                                        const float* a, const uint16_t* a16, int64_t R, int64_t in,
                                        const std::vector<Part>& parts, float scale) {
  int64_t work = R * in;
  for (const Part& p : parts) work += p.rank * p.out;
  const int64_t blocks = (n + kRows - 1) / kRows;
  const int64_t body = in / kLanes * kLanes;
  // NOTE: ~2^18 multiply-adds a task: a decode step's few rows stay on the calling thread (a wake-up costs more)
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(work * kRows, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> xb(kRows * in), h(kRows * R);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t first = blk * kRows, m = std::min(kRows, n - first);
#if defined(__AVX512BF16__)
      if (a16 != nullptr) {  // bf16 rows and factors: 32 products an instruction (vdpbf16ps), fp32 sums
        shrink_bf16(reinterpret_cast<const uint16_t*>(x), xs, rows, first, m, a16, R, in, scale, h.data());
        expand<K>(y, ys, rows, first, m, R, parts, h.data());
        continue;
      }
#endif
      // the block's input rows in fp32 (a missing fourth row repeats a real one: computed, never written)
      for (int64_t r = 0; r < kRows; ++r) {
        const T* xr = x + rows[first + std::min(r, m - 1)] * xs;
        float* xf = xb.data() + r * in;
#pragma omp simd
        for (int64_t k = 0; k < in; ++k) xf[k] = K::load(xr[k]);
      }
      const float* xr[kRows] = {xb.data(), xb.data() + in, xb.data() + 2 * in, xb.data() + 3 * in};
      for (int64_t c = 0; c < R; ++c) {  // h = x A^T: four rows against each row of A
        const float* ac = a + c * in;
        V16 s[kRows] = {};
        for (int64_t k = 0; k < body; k += kLanes) {
          const V16 av = load16(ac + k);
          for (int64_t r = 0; r < kRows; ++r) s[r] += load16(xr[r] + k) * av;
        }
        for (int64_t r = 0; r < kRows; ++r) {
          float t = lane_sum(s[r]);
          for (int64_t k = body; k < in; ++k) t += xr[r][k] * ac[k];
          h[r * R + c] = t * scale;
        }
      }
      expand<K>(y, ys, rows, first, m, R, parts, h.data());
    }
  });
}

// The checks and the dispatch of lora_add, also called by the layer loop with its own arguments.
inline void apply(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& rows, const torch::Tensor& a,
                  const torch::Tensor& a16, const torch::Tensor* bts, const int64_t* out_starts,
                  const int64_t* col_starts, int64_t n_parts, double scale) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.stride(1) == 1 && y.stride(1) == 1 && x.size(0) == y.size(0),
              "lora_add: x [T, in] and y [T, out], each with a contiguous last dimension");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() &&
              (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "lora_add: x and y of one dtype, float32 or bfloat16");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.size(1) == x.size(1) && a.scalar_type() == torch::kFloat,
              "lora_add: A [R, in], contiguous float32");
  TORCH_CHECK(a16.numel() == 0 || (a16.is_contiguous() && a16.sizes() == a.sizes() &&
                                    a16.scalar_type() == torch::kBFloat16),
              "lora_add: A in bf16 of A's shape, or empty");
  TORCH_CHECK(rows.dim() == 1 && rows.is_contiguous() && rows.scalar_type() == torch::kLong,
              "lora_add: rows, a 1-d int64 tensor");
  const int64_t T = x.size(0), R = a.size(0), n = rows.numel();
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < T, "lora_add: row ", r[i], " outside [0, ", T, ")");
  std::vector<Part> parts;
  for (int64_t p = 0; p < n_parts; ++p) {
    const torch::Tensor& bt = bts[p];
    // fp32 [r, out], or bf16 pairs [r / 2, out, 2] (bf16 rows, a build with AVX512-BF16: lora_bf16_pairs)
    const bool pairs = bt.dim() == 3;
    TORCH_CHECK(bt.is_contiguous() && (pairs ? bt.size(2) == 2 && bt.scalar_type() == torch::kBFloat16 &&
                                                   x.scalar_type() == torch::kBFloat16 && bt.size(0) <= 64
                                             : bt.dim() == 2 && bt.scalar_type() == torch::kFloat),
                "lora_add: part ", p, ": B transposed, fp32 [r, out] or bf16 pairs [r / 2, out, 2]");
    const int64_t rank = pairs ? 2 * bt.size(0) : bt.size(0);
    TORCH_CHECK(col_starts[p] >= 0 && col_starts[p] + rank <= R && out_starts[p] >= 0 &&
                out_starts[p] + bt.size(1) <= y.size(1), "lora_add: part ", p, " does not fit A or y");
#if !defined(__AVX512BF16__)
    TORCH_CHECK(!pairs, "lora_add: bf16 pairs need AVX512-BF16 (lora_bf16_pairs() says whether this build has it)");
#endif
    parts.push_back({bt.data_ptr(), pairs, rank, bt.size(1), out_starts[p], col_starts[p]});
  }
  if (n == 0) return;
  if (x.scalar_type() == torch::kFloat) {
    add_rows<elementwise::F32>(x.data_ptr<float>(), x.stride(0), y.data_ptr<float>(), y.stride(0), r, n,
                               a.data_ptr<float>(), nullptr, R, x.size(1), parts, static_cast<float>(scale));
  } else {
    // NOTE: the vdpbf16ps path reads 32 elements a step; other widths (none of the supported models') sum in fp32
    const uint16_t* a_bits = a16.numel() && x.size(1) % 32 == 0 ? elementwise::bits(a16) : nullptr;
    add_rows<elementwise::BF16>(elementwise::bits(x), x.stride(0), elementwise::bits(y), y.stride(0), r, n,
                                a.data_ptr<float>(), a_bits, R, x.size(1), parts, static_cast<float>(scale));
  }
}
}  // namespace lora_detail

// Whether this build takes B in bf16 pairs (compiled for a CPU with AVX512-BF16).
bool lora_bf16_pairs() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// One adapter's update on `rows` of one projection, in place: y[rows] += scale * (x[rows] A^T) B^T, part by part.
// x [T, in]; y [T, out] (a fused projection's whole output, rows strided), fp32 or bf16; A [R, in]: the stacked A
// of the parts this adapter targets, in fp32, and in bf16 for a bf16 model (or empty); per part: B transposed
// [r, out_part] in fp32, its first column in y and its first row in A.
void lora_add(torch::Tensor x, torch::Tensor y, torch::Tensor rows, torch::Tensor a, torch::Tensor a16,
              std::vector<torch::Tensor> bts, std::vector<int64_t> out_starts, std::vector<int64_t> col_starts,
              double scale) {
  TORCH_CHECK(out_starts.size() == bts.size() && col_starts.size() == bts.size(), "lora_add: one start per part");
  lora_detail::apply(x, y, rows, a, a16, bts.data(), out_starts.data(), col_starts.data(),
                     static_cast<int64_t>(bts.size()), scale);
}
