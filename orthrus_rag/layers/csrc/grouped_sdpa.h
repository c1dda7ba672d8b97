// One SDPA group of attention/grouped.py's plan, from the C++ layer loop (layer_loop.h): the same torch ops in the
// same order as grouped._attend and its scatter in grouped.forward, so the output is the Python loop's, bit for bit.
// These are the groups the C++ kernels do not take: chunks where the prefill kernel does not run (bf16 without
// AVX512-BF16; bf16 on AMX after a long prefix where the kernel's AMX body cannot run) and decodes without the decode
// kernel.
#pragma once
#include <torch/extension.h>

namespace sdpa_detail {
constexpr int64_t kTensors = 4;  // per group: q_rows, key_slots, valid, out_rows; then one mask per mask window
constexpr int64_t kInts = 5;     // per group: sequences, n_max, width (keys), causal, q_all (its rows: all, in order)

// q [T, H, D]; caches [slots, KVH, D]; g: the group's tensors (kTensors, then its masks); n: its ints; mask: the
// layer's mask (undefined or zero elements: none). Writes the group's rows of out [T, H, D].
inline void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor* g,
                   const int64_t* n, const at::Tensor& mask, double scale, const at::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  const int64_t size = n[0], n_max = n[1], width = n[2];
  const bool causal = n[3] != 0, q_all = n[4] != 0;
  const at::Tensor &q_rows = g[0], &key_slots = g[1], &valid = g[2], &out_rows = g[3];
  auto queries = q_all ? q : q.index_select(0, q_rows);
  auto keys = k_cache.index_select(0, key_slots).view({size, width, KVH, D}).transpose(1, 2);
  auto values = v_cache.index_select(0, key_slots).view({size, width, KVH, D}).transpose(1, 2);
  const std::optional<at::Tensor> m = mask.defined() && mask.numel() > 0 ? std::optional<at::Tensor>(mask)
                                                                         : std::nullopt;
  at::Tensor o;
  if (n_max == 1) {  // a decode: the query heads of one KV head attend as rows of one [H/KVH, L] problem
    o = at::scaled_dot_product_attention(queries.view({size, KVH, H / KVH, D}), keys, values, m, 0.0, false, scale)
            .reshape({size, H, D});
  } else {
    o = at::scaled_dot_product_attention(queries.view({size, n_max, H, D}).transpose(1, 2), keys, values, m, 0.0,
                                         causal, scale, H != KVH)
            .transpose(1, 2)
            .reshape({size * n_max, H, D});
  }
  if (valid.numel() == 0) {
    out.index_copy_(0, q_rows, o);
  } else {
    out.index_copy_(0, out_rows, o.index_select(0, valid));
  }
}
}  // namespace sdpa_detail
