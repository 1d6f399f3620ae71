// Device-free math of the score update (kvcomp::update_scores), used by the CPU loop, the CUDA kernel and GoogleTest.
#pragma once

#include <cstdint>

#include "common.h"

namespace kvcomp::kernels {

// New score of one cache slot (or of a vector of adjacent slots: Acc is float on CUDA and in GoogleTest, a SIMD
// vector of floats on CPU) of one (batch, kv-head). The q queries are folded oldest first (Horner's rule), so query j
// weighs decay^(q-1-j), exactly as q single-token updates in a row would:
//   score <- decay^q * old_score + input_scale * sum_j decay^(q-1-j) * sum_g attn[g, j, slot].
// The group sum covers ZSMerge (sum over heads) and, with input_scale = 1/G, WeightedKV's and KeepKV's head mean.
// load_attention(head, query) returns attn[head, query, slot] of this (batch, kv-head) as an Acc.
template <typename Acc, typename LoadAttention>
KVCOMP_HOST_DEVICE inline Acc fold_attention_into_score(Acc old_score, LoadAttention load_attention, int64_t group_size,
                                                        int64_t num_queries, Acc decay, Acc decay_pow_queries,
                                                        Acc input_scale) {
  Acc folded(0.0f);
  for (int64_t query = 0; query < num_queries; ++query) {
    Acc group_sum(0.0f);
    for (int64_t head = 0; head < group_size; ++head) group_sum = group_sum + load_attention(head, query);
    folded = folded * decay + group_sum;
  }
  return decay_pow_queries * old_score + input_scale * folded;
}

}  // namespace kvcomp::kernels
