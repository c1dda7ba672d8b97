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

  // The next projection's entries: f(slot, tensors, starts, parts, scale) for each.
  template <typename F> void next(F&& f) {
    TORCH_CHECK(i < ints.size(), "layer_loop: adapter arguments");
    const int64_t entries = ints[i++];
    for (int64_t e = 0; e < entries; ++e) {
      TORCH_CHECK(i + 2 <= ints.size(), "layer_loop: adapter arguments");
      const int64_t slot = ints[i], parts = ints[i + 1];
      TORCH_CHECK(parts >= 0 && i + 2 + 2 * parts <= ints.size() && t + 2 + parts <= w.size() && s < scales.size(),
                  "layer_loop: adapter arguments");
      const int64_t* starts = ints.data() + i + 2;
      const at::Tensor* tensors = w.data() + t;
      const double scale = scales[s];
      i += 2 + 2 * parts;
      t += 2 + parts;
      ++s;
      f(slot, tensors, starts, parts, scale);
    }
  }
  void add(const at::Tensor& x, const at::Tensor& y) {
    if (ints.empty()) return;  // NOTE: no adapter rows in this step (or no adapters)
    next([&](int64_t slot, const at::Tensor* tensors, const int64_t* starts, int64_t parts, double scale) {
      for (size_t k = 0; k < slots.size(); ++k) {
        if (slots[k] == slot) {  // NOTE: slots' rows are disjoint: the order they are added in changes nothing
          lora_detail::apply(x, y, rows[k], tensors[0], tensors[1], tensors + 2, starts, starts + parts, parts,
                             scale);
          break;
        }
      }
    });
  }
  bool consumed() const { return i == ints.size() && t == w.size() && s == scales.size(); }
};

inline const std::vector<int64_t> kNoInts;
inline const std::vector<double> kNoScales;
inline const std::vector<at::Tensor> kNoTensors;
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

// The loop's arguments that hold for every step of one model (cpu_layer_loop.py's LayerLoop builds them once, and
// again on its `refresh`), checked once here. Per layer: kWeights tensors (dense weights) in `weights`, two eps
// (post-attention, next norm) and a window (-1: none); `packed_weights`: the four projections' packed weights per
// layer (or none), which a step of at least `packed_from` rows multiplies by instead, as linear.linear does. The
// adapters (loop_detail::Adapters) in `adapter_tensors`, `adapter_ints` and `adapter_scales` (all empty: none).
// The column-split form's parts (layer_split.h) for the threads they were cut for, set apart (`set_split`): the
// thread count may change between steps; a step reads the parts that were set when it began.
struct LoopModel {
  std::vector<at::Tensor> weights;
  std::vector<double> eps;
  std::vector<int64_t> windows;
  int64_t heads, kv_heads, head_dim, intermediate;
  double scale;
  std::vector<at::Tensor> packed_weights;
  int64_t packed_from;
  // steps of at most this many rows multiply the dense bf16 weights by the few-row product (gemv_bf16.h); 0: never
  int64_t gemv_rows;
  std::vector<at::Tensor> adapter_tensors;
  std::vector<int64_t> adapter_ints;
  std::vector<double> adapter_scales;
  // quantized weights (layers/quantized.py): the four projections' per layer and their scales, or none; each
  // step multiplies by them (quant_group 0: int8, else int4 in groups of quant_group)
  std::vector<at::Tensor> quant_weights, quant_scales;
  int64_t quant_group;
  int64_t quant_dense_from;  // int8: steps of at least this many rows widen the weight (0: never; packed_product.h)
  std::shared_ptr<const split_detail::Parts> split;  // null: no column-split form

  LoopModel(std::vector<at::Tensor> weights_, std::vector<double> eps_, std::vector<int64_t> windows_, int64_t heads_,
            int64_t kv_heads_, int64_t head_dim_, int64_t intermediate_, double scale_,
            std::vector<at::Tensor> packed_weights_, int64_t packed_from_, int64_t gemv_rows_,
            std::vector<at::Tensor> adapter_tensors_,
            std::vector<int64_t> adapter_ints_, std::vector<double> adapter_scales_,
            std::vector<at::Tensor> quant_weights_, std::vector<at::Tensor> quant_scales_, int64_t quant_group_,
            int64_t quant_dense_from_ = 0)
      : weights(std::move(weights_)), eps(std::move(eps_)), windows(std::move(windows_)), heads(heads_),
        kv_heads(kv_heads_), head_dim(head_dim_), intermediate(intermediate_), scale(scale_),
        packed_weights(std::move(packed_weights_)), packed_from(packed_from_), gemv_rows(gemv_rows_),
        adapter_tensors(std::move(adapter_tensors_)), adapter_ints(std::move(adapter_ints_)),
        adapter_scales(std::move(adapter_scales_)), quant_weights(std::move(quant_weights_)),
        quant_scales(std::move(quant_scales_)), quant_group(quant_group_),
        quant_dense_from(quant_dense_from_) {
    using loop_detail::kWeights;
    const int64_t L = layers();
    TORCH_CHECK(L > 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 && intermediate > 0,
                "layer_loop: model shape");
    TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * kWeights && static_cast<int64_t>(eps.size()) == 2 * L,
                "layer_loop: ", kWeights, " weights and two eps per layer");
    TORCH_CHECK(packed_weights.empty() || static_cast<int64_t>(packed_weights.size()) == 4 * L,
                "layer_loop: packed weights");
    TORCH_CHECK(gemv_rows == 0 || (gemv_rows <= gemv_detail::kMaxRows && gemv_detail::runs() &&
                                   weights[loop_detail::kQkvW].scalar_type() == at::kBFloat16),
                "layer_loop: the few-row product takes bf16 weights and at most ", gemv_detail::kMaxRows, " rows");
    TORCH_CHECK(quant_weights.size() == quant_scales.size() &&
                    (quant_weights.empty() || (static_cast<int64_t>(quant_weights.size()) == 4 * L &&
                                               packed_weights.empty() && quant_group >= 0)),
                "layer_loop: quantized weights (four per layer with their scales, and no packed weights)");
    if (!adapter_ints.empty()) {  // NOTE: walked once as every step with adapter rows reads them
      loop_detail::Adapters walk{adapter_tensors, adapter_ints, adapter_scales, loop_detail::kNoInts,
                                 loop_detail::kNoTensors};
      for (int64_t k = 0; k < 4 * L; ++k) walk.next([](int64_t, const at::Tensor*, const int64_t*, int64_t, double) {});
      TORCH_CHECK(walk.consumed(), "layer_loop: adapter arguments left over");
    } else {
      TORCH_CHECK(adapter_tensors.empty() && adapter_scales.empty(), "layer_loop: adapter arguments");
    }
  }
  int64_t layers() const { return static_cast<int64_t>(windows.size()); }
  int64_t hidden() const { return weights[loop_detail::kPostNorm].numel(); }

  // The column-split form's parts (cpu_layer_split.py's SplitParts: `parts` per layer, per thread; `cols` per
  // thread), checked against the model's shapes; both empty: none.
  void set_split(std::vector<at::Tensor> parts, std::vector<int64_t> cols) {
    if (parts.empty() && cols.empty()) {
      split.reset();
      return;
    }
    auto next = std::make_shared<split_detail::Parts>(split_detail::Parts{std::move(parts), std::move(cols)});
    split_detail::check(*next, layers(), (heads + 2 * kv_heads) * head_dim, hidden(), intermediate, head_dim);
    split = std::move(next);
  }
};

// One step's arguments: the attention plan (attention/grouped.py's kernel_plan): the step's slot_mapping, the chunks
// of the prefill kernel (none, or q_start, q_len, ctx_len, key_slots) and the decode-kernel groups (kGroup tensors
// each; q_all[g]: the group is every row in order, so its queries are q itself; identity: the plan's one such group
// and no chunks, so its output is the layer's); sdpa / sdpa_ints: the plan's groups on torch's SDPA (grouped_sdpa.h;
// one mask per entry of mask_windows, -1: the unwindowed one). The step's adapter slots and each one's rows (none:
// the step has no adapter rows). split: the step takes the column-split form (the model's parts; no adapter rows).
struct LoopStep {
  at::Tensor slot_mapping;
  std::vector<at::Tensor> chunks, groups;
  std::vector<int64_t> q_all;
  bool identity = false;
  std::vector<at::Tensor> sdpa;
  std::vector<int64_t> sdpa_ints, mask_windows;
  std::vector<int64_t> lora_slots;
  std::vector<at::Tensor> lora_rows;
  bool split = false;
};

// The fast path of models/llama.py's DecoderModel.forward (its fused branch: DecoderLayer.forward_fused per layer),
// every layer in one call: the same kernels in the same order as the Python layers call them, so the result is
// bit for bit theirs. model: the model's arguments (LoopModel); h: the first layer's normed input [T, N]; residual
// [T, N], the running sum (updated in place); cos / signed sin [T, D]; caches: each layer's key and value caches;
// step: the step's plan (LoopStep). Without `step.split` the loop is the whole-weight form above; with it, the
// column-split form (layer_split.h). Returns the last norm's output [T, N].
torch::Tensor layer_loop(const LoopModel& model, torch::Tensor h, torch::Tensor residual, torch::Tensor cos,
                         torch::Tensor ssin, std::vector<torch::Tensor> caches, const LoopStep& step) {
  using namespace loop_detail;
  // NOTE: the parts set when the step began (taken with the GIL held: set_split replaces them under it)
  const std::shared_ptr<const split_detail::Parts> split_parts = step.split ? model.split : nullptr;
  // NOTE: a whole forward: other Python threads (the server's event loop) run meanwhile, as they did beside the
  // Python loop's torch ops; the arguments are C++ values by now, and an exception re-takes the GIL on its way out
  pybind11::gil_scoped_release no_gil;
  const auto& weights = model.weights;
  const auto& eps = model.eps;
  const auto& packed_w = model.packed_weights;
  const auto& chunks = step.chunks;
  const auto& groups = step.groups;
  const auto& q_all = step.q_all;
  const auto& sdpa = step.sdpa;
  const auto& sdpa_ints = step.sdpa_ints;
  const auto& mask_windows = step.mask_windows;
  const bool identity = step.identity;
  const double scale = model.scale;
  const int64_t L = model.layers();
  const int64_t n_sdpa = static_cast<int64_t>(sdpa_ints.size()) / sdpa_detail::kInts;
  const int64_t per_sdpa = sdpa_detail::kTensors + static_cast<int64_t>(mask_windows.size());
  TORCH_CHECK(static_cast<int64_t>(caches.size()) == 2 * L && (chunks.empty() || chunks.size() == 4) &&
              static_cast<int64_t>(groups.size()) % kGroup == 0 && groups.size() / kGroup == q_all.size() &&
              !(chunks.empty() && q_all.empty() && n_sdpa == 0) &&
              static_cast<int64_t>(sdpa_ints.size()) == n_sdpa * sdpa_detail::kInts &&
              static_cast<int64_t>(sdpa.size()) == n_sdpa * per_sdpa && (n_sdpa == 0 || !mask_windows.empty()),
              "layer_loop: argument counts");
  const int64_t H = model.heads, KVH = model.kv_heads, D = model.head_dim, I = model.intermediate, T = h.size(0);
  TORCH_CHECK(!identity || (chunks.empty() && n_sdpa == 0 && q_all.size() == 1 && q_all[0] != 0),
              "layer_loop: identity plan");
  TORCH_CHECK(step.lora_slots.size() == step.lora_rows.size(), "layer_loop: one rows tensor per adapter slot");
  const bool use_packed = !packed_w.empty() && T >= model.packed_from;
  const bool quant = !model.quant_weights.empty();
  const bool gemv = !quant && T <= model.gemv_rows;
  // the model's adapters where the step has adapter rows
  const bool adapter_rows = !step.lora_slots.empty();
  Adapters adapters{adapter_rows ? model.adapter_tensors : kNoTensors, adapter_rows ? model.adapter_ints : kNoInts,
                    adapter_rows ? model.adapter_scales : kNoScales, step.lora_slots, step.lora_rows};
  // the column-split form (layer_split.h) where the step asks for it: a step without adapter rows
  const bool split = step.split;
  const bool bf16 = h.scalar_type() == torch::kBFloat16;
  split_detail::Buffers buffers;
  at::Tensor qkv_buffer;
  if (split) {
    TORCH_CHECK(split_parts != nullptr, "layer_loop: a column-split step without the model's column-split parts");
    TORCH_CHECK(!adapter_rows, "layer_loop: the column-split form takes no adapter rows");
    TORCH_CHECK(use_packed, "layer_loop: the column-split form takes steps of packed weights");
    // NOTE: the split form's kernels take raw pointers: what the whole form's kernel wrappers check, checked here
    TORCH_CHECK(h.is_contiguous() && residual.is_contiguous() && cos.is_contiguous() && ssin.is_contiguous() &&
                (bf16 || h.scalar_type() == torch::kFloat) && residual.sizes() == h.sizes() &&
                h.size(1) == model.hidden() && cos.size(0) == T && cos.size(1) == D && ssin.sizes() == cos.sizes(),
                "layer_loop: column-split inputs");
    for (const auto& t : {residual, cos, ssin})
      TORCH_CHECK(t.scalar_type() == h.scalar_type(), "layer_loop: column-split inputs in one dtype");
    for (int64_t l = 0; l < L; ++l)
      for (const int64_t j : {kPostNorm, kNextNorm}) {
        const auto& nw = weights[l * kWeights + j];
        TORCH_CHECK(nw.is_contiguous() && nw.numel() == h.size(1) && nw.scalar_type() == h.scalar_type(),
                    "layer_loop: norm weights");
      }
    qkv_buffer = torch::empty({T, (H + 2 * KVH) * D}, h.options());
    buffers = {torch::empty({T, h.size(1)}, h.options()), torch::empty({T, h.size(1)}, h.options()),
               torch::empty({T, I}, h.options()), torch::empty({T, h.size(1)}, h.options())};
  }
  auto qkv_phase = [&](int64_t layer, const torch::Tensor& input) {
    return (bf16 ? split_detail::qkv<elementwise::BF16> : split_detail::qkv<elementwise::F32>)(
        *split_parts, layer, input, qkv_buffer, cos, ssin, (H + KVH) * D, D);
  };
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = weights.data() + l * kWeights;
    const torch::Tensor* pw = use_packed ? packed_w.data() + 4 * l : nullptr;
    // the layer's j-th projection (Q/K/V, O, gate/up, down) of x: its quantized weight where the model has them
    auto product = [&](const torch::Tensor& x, int64_t j, int64_t dense, int64_t b) {
      if (quant) return quantized(x, model.quant_weights[4 * l + j], model.quant_scales[4 * l + j], model.quant_group,
                                  w[b], model.quant_dense_from);
      return project(x, w[dense], pw ? pw + j : nullptr, w[b], gemv);
    };
    const torch::Tensor& kc = caches[2 * l];
    const torch::Tensor& vc = caches[2 * l + 1];
    const int64_t window = model.windows[l];
    torch::Tensor qkv;
    if (split) {
      qkv = qkv_buffer;
      // NOTE: the first layer's Q/K/V in a region of its own; each later one's ends the layer before's region
      if (l == 0) split_detail::run(split_parts->count(), {qkv_phase(l, h)});
    } else {
      qkv = product(h, 0, kQkvW, kQkvB);
      adapters.add(h, qkv);
    }
    auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
    auto k = qkv.narrow(1, H * D, KVH * D).view({T, KVH, D});
    auto v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D});
    if (!split) {  // NOTE: the split form rotated each part's Q and K heads as it wrote them
      rotary(q, cos, ssin);
      rotary(k, cos, ssin);
    }
    write_kv(k, v, kc, vc, step.slot_mapping);
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
          *split_parts, l, o_in, residual, w[kPostNorm], eps[2 * l], w[kNextNorm], eps[2 * l + 1], buffers, next,
          l + 1 < L ? qkv_phase(l + 1, next) : std::function<void(int64_t)>());
      h = next;
      continue;
    }
    auto attn = product(o_in, 1, kOW, kOB);
    adapters.add(o_in, attn);
    h = add_rms_norm(attn, residual, w[kPostNorm], eps[2 * l]);
    auto gate_up = product(h, 2, kGateUpW, kGateUpB);
    adapters.add(h, gate_up);
    auto act = silu_mul(gate_up.narrow(1, 0, I), gate_up.narrow(1, I, I));
    auto down = product(act, 3, kDownW, kDownB);
    adapters.add(act, down);
    h = add_rms_norm(down, residual, w[kNextNorm], eps[2 * l + 1]);
  }
  TORCH_CHECK(adapters.consumed(), "layer_loop: adapter arguments left over");
  return h;
}
