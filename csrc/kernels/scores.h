// Device-free math of the score update (kvcomp::update_scores), used by the CPU loop, the CUDA kernel and GoogleTest.
#pragma once

#include <cstdint>

#include "common.h"

namespace kvcomp::kernels {

// New score of one cache slot of one (batch, kv-head). The q queries are folded oldest first (Horner's rule), so the
// query j contributes with weight decay^(q-1-j), exactly as q single-token updates in a row would:
//   score <- decay^q * old_score + input_scale * sum_j decay^(q-1-j) * sum_g attn[g, j, slot].
// The group sum covers ZSMerge (sum over heads) and, with input_scale = 1/G, WeightedKV's and KeepKV's head mean.
template <typename scalar_t>
KVCOMP_HOST_DEVICE inline float fold_attention_into_score(
    float old_score,               // 0 for the q newly appended slots
    const scalar_t* attn_group,    // [G, q, total_len] of this (batch, kv-head)
    int64_t group_size, int64_t num_queries, int64_t total_len, int64_t slot,
    float decay, float decay_pow_queries, float input_scale) {
  float folded = 0.0f;
  for (int64_t query = 0; query < num_queries; ++query) {
    float group_sum = 0.0f;
    for (int64_t head = 0; head < group_size; ++head) {
      group_sum += static_cast<float>(attn_group[(head * num_queries + query) * total_len + slot]);
    }
    folded = folded * decay + group_sum;
  }
  return decay_pow_queries * old_score + input_scale * folded;
}

}  // namespace kvcomp::kernels
