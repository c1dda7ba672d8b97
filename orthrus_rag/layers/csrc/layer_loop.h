// The decoder's layer loop on the CPU (its wrapper and notes: layers/cpu_layer_loop.py). It calls the other kernels
// of the extension: decode and prefill attention, write_kv, the fused elementwise ops, the LoRA kernel.
#pragma once
#include "decode_attention.h"
#include "prefill_attention.h"
#include "elementwise.h"
#include "lora.h"
#include "grouped_sdpa.h"
#include "packed_product.h"
#include "layer_split.h"
#include <algorithm>

namespace loop_detail {
constexpr int64_t kWeights = 10;  // per layer, in this order:
enum { kQkvW, kQkvB, kOW, kOB, kPostNorm, kGateUpW, kGateUpB, kDownW, kDownB, kNextNorm };
constexpr int64_t kGroup = 3;  // per decode group: q_rows, key_slots [G, W], lengths [G]

// The adapters of each projection as cpu_layer_loop.py encodes them, read in order: per layer, per projection
// (Q/K/V, O, gate/up, down), an entry count, then per entry its slot, its part count and the parts' output and A
// offsets (ints); its A in fp32 and in bf16 (or empty) and each part's B operand (tensors); its scaling. Each
// entry whose slot has rows in the step adds its update through the kernel Python's layers call (csrc/lora.h).
struct Adapters {
  const std::vector<at::Tensor>& w;
  const std::vector<int64_t>& ints;
  const std::vector<double>& scales;
  const std::vector<int64_t>& slots;  // the step's adapter slots, and each one's rows
  const std::vector<at::Tensor>& rows;
  size_t i = 0, t = 0, s = 0;

  void add(const at::Tensor& x, const at::Tensor& y) {
    if (ints.empty()) return;  // NOTE: no adapter rows in this step (or no adapters)
    const int64_t entries = ints.at(i++);
    for (int64_t e = 0; e < entries; ++e) {
      const int64_t slot = ints.at(i), parts = ints.at(i + 1);
      TORCH_CHECK(i + 2 + 2 * parts <= ints.size() && t + 2 + parts <= w.size() && s < scales.size(),
                  "layer_loop: adapter arguments");
      const int64_t* starts = ints.data() + i + 2;
      const at::Tensor* tensors = w.data() + t;
      const double scale = scales[s];
      i += 2 + 2 * parts;
      t += 2 + parts;
      ++s;
      for (size_t k = 0; k < slots.size(); ++k) {
        if (slots[k] == slot) {  // NOTE: slots' rows are disjoint: the order they are added in changes nothing
          lora_detail::apply(x, y, rows[k], tensors[0], tensors[1], tensors + 2, starts, starts + parts, parts,
                             scale);
          break;
        }
      }
    }
  }
  bool consumed() const { return i == ints.size() && t == w.size() && s == scales.size(); }
};
}  // namespace loop_detail

// Whether this torch has the op with the signature above (else the loop takes only dense weights).
bool layer_loop_pointwise() {
  try {
    loop_detail::pointwise();
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// The fast path of models/llama.py's DecoderModel.forward (its fused branch: DecoderLayer.forward_fused per layer),
// every layer in one call: the same kernels in the same order as the Python layers call them, so the result is
// bit for bit theirs. h: the first layer's normed input [T, N]; residual [T, N], the running sum (updated in
// place); cos / signed sin [T, D]. Per layer: kWeights tensors (dense weights), two caches, eps (post-attention,
// next norm) and a window (-1: none); packed_w: the four projections' packed weights per layer (or none), which a
// step of at least packed_from rows multiplies by instead, as linear.linear does. The attention plan
// (attention/grouped.py's kernel_plan): the step's slot_mapping, the chunks of the prefill kernel (none, or q_start,
// q_len, ctx_len, key_slots) and the decode-kernel groups (kGroup tensors each; q_all[g]: the group is every row in
// order, so its queries are q itself; identity: the plan's one such group and no chunks, so its output is the layer's).
// sdpa / sdpa_ints: the plan's groups on torch's SDPA (grouped_sdpa.h; one mask per entry of mask_windows, -1: the
// unwindowed one). shape: heads, KV heads, head dim, intermediate size. The adapters (Adapters above: empty where the step has no
// adapter rows). split_w / split_cols: the column-split form's parts (layer_split.h), or empty: the loop as above.
// Returns the last norm's output [T, N].
torch::Tensor layer_loop(torch::Tensor h, torch::Tensor residual, torch::Tensor cos, torch::Tensor ssin,
                         std::vector<torch::Tensor> weights, std::vector<torch::Tensor> caches, std::vector<double> eps,
                         std::vector<int64_t> windows, std::vector<int64_t> shape,
                         std::vector<torch::Tensor> packed_w, int64_t packed_from, double scale,
                         torch::Tensor slot_mapping, std::vector<torch::Tensor> chunks,
                         std::vector<torch::Tensor> groups, std::vector<int64_t> q_all, bool identity,
                         std::vector<torch::Tensor> lora_w, std::vector<int64_t> lora_ints,
                         std::vector<double> lora_scales, std::vector<int64_t> lora_slots,
                         std::vector<torch::Tensor> lora_rows, std::vector<torch::Tensor> split_w,
                         std::vector<int64_t> split_cols, std::vector<torch::Tensor> sdpa,
                         std::vector<int64_t> sdpa_ints, std::vector<int64_t> mask_windows) {
  using namespace loop_detail;
  // NOTE: a whole forward: other Python threads (the server's event loop) run meanwhile, as they did beside the
  // Python loop's torch ops; the arguments are C++ values by now, and an exception re-takes the GIL on its way out
  pybind11::gil_scoped_release no_gil;
  const int64_t L = static_cast<int64_t>(windows.size());
  const int64_t n_sdpa = static_cast<int64_t>(sdpa_ints.size()) / sdpa_detail::kInts;
  const int64_t per_sdpa = sdpa_detail::kTensors + static_cast<int64_t>(mask_windows.size());
  TORCH_CHECK(shape.size() == 4 && static_cast<int64_t>(weights.size()) == L * kWeights &&
              static_cast<int64_t>(caches.size()) == 2 * L && static_cast<int64_t>(eps.size()) == 2 * L &&
              (chunks.empty() || chunks.size() == 4) && static_cast<int64_t>(groups.size()) % kGroup == 0 &&
              groups.size() / kGroup == q_all.size() && !(chunks.empty() && q_all.empty() && n_sdpa == 0) &&
              static_cast<int64_t>(sdpa_ints.size()) == n_sdpa * sdpa_detail::kInts &&
              static_cast<int64_t>(sdpa.size()) == n_sdpa * per_sdpa && (n_sdpa == 0 || !mask_windows.empty()),
              "layer_loop: argument counts");
  const int64_t H = shape[0], KVH = shape[1], D = shape[2], I = shape[3], T = h.size(0);
  TORCH_CHECK(!identity || (chunks.empty() && n_sdpa == 0 && q_all.size() == 1 && q_all[0] != 0),
              "layer_loop: identity plan");
  TORCH_CHECK(lora_slots.size() == lora_rows.size(), "layer_loop: one rows tensor per adapter slot");
  TORCH_CHECK(packed_w.empty() || static_cast<int64_t>(packed_w.size()) == 4 * L, "layer_loop: packed weights");
  const bool use_packed = !packed_w.empty() && T >= packed_from;
  Adapters adapters{lora_w, lora_ints, lora_scales, lora_slots, lora_rows};
  // the column-split form (layer_split.h) where Python passes its parts: a step without adapter rows
  const split_detail::Parts parts{split_w, split_cols};
  const bool split = !split_cols.empty();
  const bool bf16 = h.scalar_type() == torch::kBFloat16;
  split_detail::Buffers buffers;
  at::Tensor qkv_buffer;
  if (split) {
    TORCH_CHECK(lora_ints.empty(), "layer_loop: the column-split form takes no adapter rows");
    // NOTE: the split form's kernels take raw pointers: what the whole form's kernel wrappers check, checked here
    TORCH_CHECK(h.is_contiguous() && residual.is_contiguous() && cos.is_contiguous() && ssin.is_contiguous() &&
                (bf16 || h.scalar_type() == torch::kFloat) && residual.sizes() == h.sizes() &&
                cos.size(0) == T && cos.size(1) == D && ssin.sizes() == cos.sizes(), "layer_loop: column-split inputs");
    for (const auto& t : {residual, cos, ssin})
      TORCH_CHECK(t.scalar_type() == h.scalar_type(), "layer_loop: column-split inputs in one dtype");
    for (int64_t l = 0; l < L; ++l)
      for (const int64_t j : {kPostNorm, kNextNorm}) {
        const auto& nw = weights[l * kWeights + j];
        TORCH_CHECK(nw.is_contiguous() && nw.numel() == h.size(1) && nw.scalar_type() == h.scalar_type(),
                    "layer_loop: norm weights");
      }
    split_detail::check(parts, L, (H + 2 * KVH) * D, h.size(1), I, D);
    qkv_buffer = torch::empty({T, (H + 2 * KVH) * D}, h.options());
    buffers = {torch::empty({T, h.size(1)}, h.options()), torch::empty({T, h.size(1)}, h.options()),
               torch::empty({T, I}, h.options()), torch::empty({T, h.size(1)}, h.options())};
  }
  auto qkv_phase = [&](int64_t layer, const torch::Tensor& input) {
    return (bf16 ? split_detail::qkv<elementwise::BF16> : split_detail::qkv<elementwise::F32>)(
        parts, layer, input, qkv_buffer, cos, ssin, (H + KVH) * D, D);
  };
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = weights.data() + l * kWeights;
    const torch::Tensor* pw = use_packed ? packed_w.data() + 4 * l : nullptr;
    const torch::Tensor& kc = caches[2 * l];
    const torch::Tensor& vc = caches[2 * l + 1];
    const int64_t window = windows[l];
    torch::Tensor qkv;
    if (split) {
      qkv = qkv_buffer;
      // NOTE: the first layer's Q/K/V in a region of its own; each later one's ends the layer before's region
      if (l == 0) split_detail::run(parts.count(), {qkv_phase(l, h)});
    } else {
      qkv = project(h, w[kQkvW], pw, w[kQkvB]);
      adapters.add(h, qkv);
    }
    auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
    auto k = qkv.narrow(1, H * D, KVH * D).view({T, KVH, D});
    auto v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D});
    if (!split) {  // NOTE: the split form rotated each part's Q and K heads as it wrote them
      rotary(q, cos, ssin);
      rotary(k, cos, ssin);
    }
    write_kv(k, v, kc, vc, slot_mapping);
    torch::Tensor o;
    if (identity) {
      o = decode_attention(q, kc, vc, groups[1], groups[2], scale, window, false);
    } else {
      o = torch::empty({T, H, D}, q.options());
      if (!chunks.empty()) {
        // NOTE: the kernel reads strided rows as they come (attention/cpu_prefill.py)
        prefill_attention(q, kc, vc, chunks[0], chunks[1], chunks[2], chunks[3], scale, window, o);
      }
      for (size_t g = 0; g < q_all.size(); ++g) {
        const torch::Tensor& rows = groups[g * kGroup];
        auto queries = q_all[g] ? q : q.index_select(0, rows);
        o.index_copy_(0, rows, decode_attention(queries, kc, vc, groups[g * kGroup + 1], groups[g * kGroup + 2],
                                                scale, window, false));
      }
      if (n_sdpa > 0) {
        // the layer's mask among each group's: its window's, else the unwindowed one (as grouped._attend picks)
        const auto at_window = std::find(mask_windows.begin(), mask_windows.end(), window);
        const auto unwindowed = std::find(mask_windows.begin(), mask_windows.end(), -1);
        TORCH_CHECK(at_window != mask_windows.end() || unwindowed != mask_windows.end(),
                    "layer_loop: no mask for a layer's window");
        const int64_t m = (at_window != mask_windows.end() ? at_window : unwindowed) - mask_windows.begin();
        for (int64_t g = 0; g < n_sdpa; ++g) {
          const torch::Tensor* t = sdpa.data() + g * per_sdpa;
          sdpa_detail::attend(q, kc, vc, t, sdpa_ints.data() + g * sdpa_detail::kInts,
                              t[sdpa_detail::kTensors + m], scale, o);
        }
      }
    }
    auto o_in = o.view({T, H * D});
    if (split) {
      auto next = torch::empty_like(residual);
      (bf16 ? split_detail::mlp<elementwise::BF16> : split_detail::mlp<elementwise::F32>)(
          parts, l, o_in, residual, w[kPostNorm], eps[2 * l], w[kNextNorm], eps[2 * l + 1], buffers, next,
          l + 1 < L ? qkv_phase(l + 1, next) : std::function<void(int64_t)>());
      h = next;
      continue;
    }
    auto attn = project(o_in, w[kOW], pw ? pw + 1 : nullptr, w[kOB]);
    adapters.add(o_in, attn);
    h = add_rms_norm(attn, residual, w[kPostNorm], eps[2 * l]);
    auto gate_up = project(h, w[kGateUpW], pw ? pw + 2 : nullptr, w[kGateUpB]);
    adapters.add(h, gate_up);
    auto act = silu_mul(gate_up.narrow(1, 0, I), gate_up.narrow(1, I, I));
    auto down = project(act, w[kDownW], pw ? pw + 3 : nullptr, w[kDownB]);
    adapters.add(act, down);
    h = add_rms_norm(down, residual, w[kNextNorm], eps[2 * l + 1]);
  }
  TORCH_CHECK(adapters.consumed(), "layer_loop: adapter arguments left over");
  return h;
}
