// A measurement, not the engine (scripts/bench_column_split.py runs it): bench_layer_chain.py's chain of SmolLM2's
// 30 layers without attention, in ONE parallel region of two threads. Each thread owns fixed output columns of
// every product (its part of each weight, packed on its own, multiplied by oneDNN on that thread alone) and runs
// rotary and SiLU-and-mul on the columns it wrote; only the two norms split by rows. Products' outputs are copied
// into shared [T, N] buffers (oneDNN's pointwise op cannot write into a strided output), barriers between ops.
// The engine's own pieces (layers/csrc, on the include path): the packed-product op and the bf16 conversions.
#include "layer_loop.h"
#include <omp.h>
#include <chrono>
#include <cmath>
#include <cstring>

static at::Tensor prod(const at::Tensor& x, const at::Tensor& w) {
  return loop_detail::pointwise().call(x, w, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(),
                                       std::nullopt);
}
static inline float ld(uint16_t x) { return elementwise::BF16::load(x); }
static inline uint16_t st(float f) { return elementwise::BF16::store(f); }
static uint16_t* B(const at::Tensor& t) { return elementwise::bits(t); }

// copy src [T, n] (contiguous) into dst columns [c0, c0 + n) of dst [T, N]
static void put(const at::Tensor& src, const at::Tensor& dst, int64_t c0) {
  const int64_t T = src.size(0), n = src.size(1), N = dst.size(1);
  uint16_t* d = B(dst); const uint16_t* s = B(src);
  for (int64_t r = 0; r < T; ++r) std::memcpy(d + r * N + c0, s + r * n, n * 2);
}
// rotary-like pass over columns [c0, c1) (pairs within 64-wide heads) of x [T, N], in place
static void rot(const at::Tensor& x, int64_t c0, int64_t c1, const at::Tensor& cs, const at::Tensor& sn) {
  const int64_t T = x.size(0), N = x.size(1);
  uint16_t* p = B(x); const uint16_t* c = B(cs); const uint16_t* s = B(sn);
  for (int64_t r = 0; r < T; ++r)
    for (int64_t h = c0; h < c1; h += 64) {
      uint16_t* v = p + r * N + h; const uint16_t* cr = c + r * 64; const uint16_t* sr = s + r * 64;
#pragma omp simd
      for (int d = 0; d < 32; ++d) {
        float a = ld(v[d]), b = ld(v[d + 32]);
        v[d] = st(ld(st(a * ld(cr[d]))) + ld(st(b * ld(sr[d]))));
        v[d + 32] = st(ld(st(b * ld(cr[d + 32]))) + ld(st(a * ld(sr[d + 32]))));
      }
    }
}
// rows [r0, r1): res += x; out = rmsnorm(res) * w
static void norm(const at::Tensor& x, const at::Tensor& res, const at::Tensor& w, const at::Tensor& out, int64_t r0,
                 int64_t r1) {
  const int64_t N = x.size(1);
  const uint16_t* xp = B(x); uint16_t* rp = B(res); const uint16_t* wp = B(w); uint16_t* op = B(out);
  for (int64_t r = r0; r < r1; ++r) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < N; ++d) {
      uint16_t s = st(ld(rp[r * N + d]) + ld(xp[r * N + d]));
      rp[r * N + d] = s;
      ss += ld(s) * ld(s);
    }
    const float inv = 1.f / std::sqrt(ss / N + 1e-5f);
#pragma omp simd
    for (int64_t d = 0; d < N; ++d) op[r * N + d] = st(ld(st(ld(rp[r * N + d]) * inv)) * ld(wp[d]));
  }
}
// gate_up [T, 2n] (gate | up, this thread's columns) -> act columns [c0, c0 + n) of act [T, N]
static void silu(const at::Tensor& gu, const at::Tensor& act, int64_t c0) {
  const int64_t T = gu.size(0), n = gu.size(1) / 2, N = act.size(1);
  const uint16_t* g = B(gu); uint16_t* a = B(act);
  for (int64_t r = 0; r < T; ++r) {
    const uint16_t* gr = g + r * 2 * n; uint16_t* ar = a + r * N + c0;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) {
      const float x = ld(gr[d]);
      ar[d] = st(ld(st(x / (1.f + std::exp(std::min(-x, 88.f))))) * ld(gr[n + d]));
    }
  }
}

// w: per layer, per thread t in {0,1}: Q/K/V part [512 | 448, 576], O half [288, 576], gate/up half [1536, 576]
// (gate_t | up_t), down half [288, 1536], at (l * 2 + t) * 4 + j. Returns {ms per pass, ms thread 0 spent in
// products per pass}; `kernels` false leaves out rotary, the norms and SiLU-and-mul.
std::vector<double> colsplit(std::vector<at::Tensor> w, at::Tensor h0, at::Tensor cs, at::Tensor sn, at::Tensor nw,
                             int64_t layers, bool kernels, int64_t reps) {
  pybind11::gil_scoped_release no_gil;
  const int64_t T = h0.size(0);
  auto opt = h0.options();
  at::Tensor qkv = at::empty({T, 960}, opt), attn = at::empty({T, 576}, opt), act = at::empty({T, 1536}, opt),
             down = at::empty({T, 576}, opt), h = h0.clone(), res = h0.clone();
  double prod_ms = 0, total = 0;
  at::ThreadLocalState tls;
  for (int64_t rep = 0; rep < reps + 1; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    double pm = 0;
#pragma omp parallel num_threads(2) reduction(max : pm)
    {
      at::ThreadLocalStateGuard g(tls);
      const int t = omp_get_thread_num();
      const int64_t r0 = t * T / 2, r1 = (t + 1) * T / 2;
      double mine = 0;
      auto P = [&](const at::Tensor& x, const at::Tensor& wt) {
        auto a = std::chrono::steady_clock::now(); auto y = prod(x, wt);
        mine += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count(); return y; };
      for (int64_t l = 0; l < layers; ++l) {
        const at::Tensor* W = w.data() + (l * 2 + t) * 4;
        put(P(h, W[0]), qkv, t * 512);
        if (kernels) rot(qkv, t * 512, t == 0 ? 512 : 768, cs, sn);  // its own columns: q 0-7 | q 8 and the k heads
#pragma omp barrier
        put(P(qkv.narrow(1, 0, 576), W[1]), attn, t * 288);
#pragma omp barrier
        if (kernels) norm(attn, res, nw, h, r0, r1); else if (t == 0) h.copy_(attn);
#pragma omp barrier
        auto gu = P(h, W[2]);
        if (kernels) silu(gu, act, t * 768); else put(gu.narrow(1, 0, 768).contiguous(), act, t * 768);
#pragma omp barrier
        put(P(act, W[3]), down, t * 288);
#pragma omp barrier
        if (kernels) norm(down, res, nw, h, r0, r1); else if (t == 0) h.copy_(down);
#pragma omp barrier
      }
      pm = mine;
    }
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (rep > 0) { total += ms; prod_ms += pm; }
  }
  return {total / reps, prod_ms / reps};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("colsplit", &colsplit); }
