// The packed-key layout both prefill attention bodies share (prefill_attention.h in bf16, attention_f32.h in fp32):
// each (sequence, KV head) gets its keys padded to a whole number of score blocks, back to back.
#pragma once
#include <torch/extension.h>
#include <algorithm>
#include <vector>

struct KeyLayout {
  std::vector<int64_t> pack_at;  // [S + 1] first element of each sequence's KVH blocks of padded[s] x D
  std::vector<int64_t> padded;   // [S] keys rounded up to a multiple of the score block
  int64_t max_padded = 0;
};

// Sequence s has ctx[s] + q_len[s] keys; `slots` (or null) holds W slots a sequence, so no sequence may need more.
inline KeyLayout key_layout(int64_t S, const int64_t* ctx, const int64_t* q_len, const int64_t* slots, int64_t W,
                            int64_t KVH, int64_t D, int64_t block) {
  KeyLayout out{std::vector<int64_t>(S + 1, 0), std::vector<int64_t>(S), 0};
  for (int64_t s = 0; s < S; ++s) {
    const int64_t L = ctx[s] + q_len[s];
    TORCH_CHECK(slots == nullptr || L <= W, "prefill_attention: key_slots narrower than a sequence");
    out.padded[s] = (L + block - 1) / block * block;
    out.max_padded = std::max(out.max_padded, out.padded[s]);
    out.pack_at[s + 1] = out.pack_at[s] + KVH * out.padded[s] * D;
  }
  return out;
}
