// The layer loop's column-split form (layer_loop.h calls it; why, and which steps take it: layers/cpu_layer_split.py).
// Each of the step's P threads owns fixed output columns of every product: its own packed part of each weight,
// multiplied by oneDNN on that thread alone, and the fused kernels on the columns it wrote (rotary, SiLU-and-mul);
// only the two norms of a layer, which read whole rows, split by rows. One parallel region runs a layer from its O
// product to the next layer's Q/K/V; write_kv and attention run between two regions as the whole form runs them.
// Element for element the kernels are the loop's; the products differ from a whole weight's only where oneDNN
// blocks a part's reduction otherwise (a last-bit difference, at some shapes).
#pragma once
#include "elementwise.h"
#include "packed_product.h"
#include <ATen/ThreadLocalState.h>
#include <omp.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <functional>
#include <type_traits>

namespace split_detail {
// per layer, per part: the Q/K/V, O, gate|up and down products' packed weights, each followed by its bias
constexpr int64_t kPartTensors = 8;
// per part: the first column and the width of its Q/K/V, O, intermediate (gate and up alike) and down columns
constexpr int64_t kPartInts = 8;
enum { kQkv = 0, kO = 2, kInter = 4, kDown = 6 };

template <typename K> typename K::S* ptr(const at::Tensor& t) {
  if constexpr (std::is_same_v<K, elementwise::F32>) return t.data_ptr<float>();
  else return elementwise::bits(t);
}

// The parts as cpu_layer_split.py gathers them: w[(layer * P + p) * kPartTensors + j], cols[p * kPartInts + k]. The
// loop's model arguments hold them (layer_loop.h's LoopModel::set_split, which checks them against the model).
struct Parts {
  std::vector<at::Tensor> w;
  std::vector<int64_t> cols;
  int64_t count() const { return static_cast<int64_t>(cols.size()) / kPartInts; }
  const at::Tensor* of(int64_t layer, int64_t p) const { return w.data() + (layer * count() + p) * kPartTensors; }
  int64_t start(int64_t p, int64_t k) const { return cols[p * kPartInts + k]; }
  int64_t width(int64_t p, int64_t k) const { return cols[p * kPartInts + k + 1]; }
};

// Runs each phase on every part, phase after phase, in ONE parallel region of `parts` threads with a barrier
// between phases: the team's thread t always takes part t (and t + team, ... where the runtime gives fewer threads),
// so each core keeps its weight parts and the columns it wrote in its own cache. Nested parallelism is off inside, so
// oneDNN and the kernels' at::parallel_for run on the calling thread. An exception skips the rest (every thread
// still meets every barrier) and is rethrown here.
inline void run(int64_t parts, const std::vector<std::function<void(int64_t)>>& phases) {
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  const at::ThreadLocalState state;  // inference mode and the dispatcher's other thread-local state, on every thread
#pragma omp parallel num_threads(parts)
  {
    const at::ThreadLocalStateGuard guard(state);
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    for (size_t i = 0; i < phases.size(); ++i) {
      if (i > 0) {
#pragma omp barrier
      }
      if (failed.load(std::memory_order_relaxed)) continue;
      try {
        for (int64_t p = t; p < parts; p += team) phases[i](p);
      } catch (...) {
#pragma omp critical(orthrus_layer_split_error)
        {
          if (!error) error = std::current_exception();
        }
        failed = true;
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

// src [T, n] (contiguous) into columns [c0, c0 + n) of dst [T, N]: oneDNN's op writes no strided output
template <typename K> void put(const at::Tensor& src, const at::Tensor& dst, int64_t c0) {
  using T = typename K::S;
  const int64_t rows = src.size(0), n = src.size(1), N = dst.size(1);
  const T* s = ptr<K>(src);
  T* d = ptr<K>(dst) + c0;
  for (int64_t r = 0; r < rows; ++r) std::memcpy(d + r * N, s + r * n, n * sizeof(T));
}

// The phase that writes one layer's Q/K/V into qkv [T, (H + 2 KVH) D], its first `rotated` columns (the Q and K
// heads) rotated by cos / signed sin [T, D]: a part's product, rotary on it, then its columns of qkv.
template <typename K>
std::function<void(int64_t)> qkv(const Parts& parts, int64_t layer, const at::Tensor& h, const at::Tensor& out,
                                 const at::Tensor& cos, const at::Tensor& ssin, int64_t rotated, int64_t dim) {
  // NOTE: the tensors by value: the phase may run after the caller's references are gone (it ends a later region)
  return [&parts, layer, h, out, cos, ssin, rotated, dim](int64_t p) {
    const at::Tensor* w = parts.of(layer, p);
    const int64_t c0 = parts.start(p, kQkv), n = parts.width(p, kQkv);
    const at::Tensor y = loop_detail::packed(h, w[0], w[1]);
    const int64_t turn = std::clamp<int64_t>(rotated - c0, 0, n);  // its columns among the Q and K heads
    if (turn > 0) elementwise::rotary<K>(ptr<K>(y), h.size(0), turn / dim, dim, n, dim, ptr<K>(cos), ptr<K>(ssin));
    put<K>(y, out, c0);
  };
}

// The step's [T, *] buffers of a layer's second half (one set for every layer of the step).
struct Buffers {
  at::Tensor attn, normed, act, down;
};

// A layer after attention: O, residual add + norm, gate/up with SiLU-and-mul, down, residual add + the next norm
// into `out` [T, N], the next layer's normed input; then `then` (the next layer's Q/K/V phase, or none) in the same
// parallel region. o_in [T, H D]; residual [T, N] (updated in place).
template <typename K>
void mlp(const Parts& parts, int64_t layer, const at::Tensor& o_in, const at::Tensor& residual,
         const at::Tensor& post_norm, double post_eps, const at::Tensor& next_norm, double next_eps, const Buffers& b,
         const at::Tensor& out, const std::function<void(int64_t)>& then) {
  const int64_t rows = o_in.size(0), N = residual.size(1), I = b.act.size(1), P = parts.count();
  auto norm = [&](const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& dst, int64_t p) {
    const int64_t r0 = p * rows / P, r1 = (p + 1) * rows / P;
    if (r1 > r0)
      elementwise::add_rms_norm<K>(ptr<K>(x) + r0 * N, N, ptr<K>(residual) + r0 * N, ptr<K>(w), ptr<K>(dst) + r0 * N,
                                   r1 - r0, N, static_cast<float>(eps));
  };
  std::vector<std::function<void(int64_t)>> phases{
      [&](int64_t p) { put<K>(loop_detail::packed(o_in, parts.of(layer, p)[2], parts.of(layer, p)[3]), b.attn,
                              parts.start(p, kO)); },
      [&](int64_t p) { norm(b.attn, post_norm, post_eps, b.normed, p); },
      [&](int64_t p) {
        const at::Tensor y = loop_detail::packed(b.normed, parts.of(layer, p)[4], parts.of(layer, p)[5]);
        const int64_t m = parts.width(p, kInter);  // y: [T, 2m], this part's gate columns then its up columns
        elementwise::silu_mul<K>(ptr<K>(y), 2 * m, ptr<K>(y) + m, 2 * m, ptr<K>(b.act) + parts.start(p, kInter), I,
                                 rows, m);
      },
      [&](int64_t p) { put<K>(loop_detail::packed(b.act, parts.of(layer, p)[6], parts.of(layer, p)[7]), b.down,
                              parts.start(p, kDown)); },
      [&](int64_t p) { norm(b.down, next_norm, next_eps, out, p); },
  };
  if (then) phases.push_back(then);
  run(P, phases);
}

// The parts' shapes against the model's, when the loop's model arguments take them (LoopModel::set_split): wrong
// parts are refused there, before any step's threads run, not mid-region.
inline void check(const Parts& parts, int64_t layers, int64_t qkv_width, int64_t hidden, int64_t inter,
                  int64_t dim) {
  const int64_t P = parts.count();
  TORCH_CHECK(P >= 1 && static_cast<int64_t>(parts.cols.size()) == P * kPartInts &&
              static_cast<int64_t>(parts.w.size()) == layers * P * kPartTensors, "layer_loop: column-split parts");
  const int64_t widths[] = {qkv_width, hidden, inter, hidden};
  for (int64_t k = 0; k < 4; ++k) {
    int64_t next = 0;
    for (int64_t p = 0; p < P; ++p) {
      TORCH_CHECK(parts.start(p, 2 * k) == next && parts.width(p, 2 * k) > 0,
                  "layer_loop: column-split parts must tile each product's columns in order");
      next += parts.width(p, 2 * k);
    }
    TORCH_CHECK(next == widths[k], "layer_loop: column-split parts cover ", next, " of ", widths[k], " columns");
  }
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK(parts.start(p, kQkv) % dim == 0, "layer_loop: Q/K/V parts start at a head");
}
}  // namespace split_detail
