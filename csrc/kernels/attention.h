// Device-free math of the attention family (kvcomp::merge_count_bias, kvcomp::decode_attention), used by the CPU
// loops, the CUDA kernels and GoogleTest.
//
// decode_attention splits the T slots of one (batch, kv-head) into chunks (flash-decoding). Each chunk keeps, for every
// query row, a SoftmaxPartial: its largest logit m_c and sum_c = Σ_s exp(logit_s - m_c), plus the partial output
// Σ_s exp(logit_s - m_c) v_s. Partials are combined in the log domain, so exp never sees a large argument, and a row
// whose allowed slots are all -inf ends with max = -inf, sum = 0: probabilities and output 0, never NaN.
#pragma once

#include <cmath>
#include <cstdint>

#include "common.h"

namespace kvcomp::kernels {

// Log-weight of a slot that stands for `count` tokens (merge count w, or KeepKV's electoral votes p):
// alpha * ln(w) for w > 0 (0 whatever w when alpha = 0: pure eviction), -inf for w = 0 (an evicted or padding slot),
// NaN for w < 0 or NaN (not checked: that would need a device sync).
KVCOMP_HOST_DEVICE inline float merge_count_bias(float count, float alpha) {
  if (count == 0.0f) return -INFINITY;
  if (count > 0.0f && alpha == 0.0f) return 0.0f;
  return alpha * ::logf(count);
}

// Causal limit: the q queries are the newest q tokens, the last q of the T slots, so query j (0-based) sits at slot
// T - q + j and attends to the slots [0, T - q + j] only. Returns that count of slots.
KVCOMP_HOST_DEVICE inline int64_t causal_slot_count(int64_t query, int64_t num_queries, int64_t total_len) {
  return total_len - num_queries + query + 1;
}

// Whether a slot takes part in the softmax of a query that sees slot_count slots. A -inf slot (evicted, padding) is
// skipped outright, so whatever its key and value hold, even NaN, it contributes exactly nothing.
KVCOMP_HOST_DEVICE inline bool slot_attended(int64_t slot, int64_t slot_count, float log_weight) {
  return slot < slot_count && log_weight != -INFINITY;
}

// exp(logit - max) where max is the largest logit of a set that logit belongs to; 0 when the whole set is -inf
// (exp(-inf - -inf) would be NaN).
KVCOMP_HOST_DEVICE inline float shifted_exp(float logit, float max) {
  return max == -INFINITY ? 0.0f : ::expf(logit - max);
}

// Softmax statistics of a set of logits: max and sum of exp(logit - max). The empty or all -inf set is {-inf, 0}.
struct SoftmaxPartial {
  float max = -INFINITY;
  float sum = 0.0f;
};

// The online-softmax update step: statistics of the union of two disjoint sets, each sum rescaled to the new max.
KVCOMP_HOST_DEVICE inline SoftmaxPartial combine(SoftmaxPartial a, SoftmaxPartial b) {
  const float max = ::fmaxf(a.max, b.max);
  return {max, a.sum * shifted_exp(a.max, max) + b.sum * shifted_exp(b.max, max)};
}

// 1 / sum of a row's softmax, or 0 for a row with nothing to attend to (sum 0): its probabilities and its output are
// then exactly 0. A NaN sum stays NaN.
KVCOMP_HOST_DEVICE inline float inverse_sum(float sum) { return sum == 0.0f ? 0.0f : 1.0f / sum; }

// Factor that turns a chunk's exp(logit - chunk.max) into the final probability exp(logit - total.max) / total.sum.
KVCOMP_HOST_DEVICE inline float chunk_normaliser(float chunk_max, SoftmaxPartial total) {
  return shifted_exp(chunk_max, total.max) * inverse_sum(total.sum);
}

// The slot chunks of CPU decode attention (rectangular and paged): chunk c of a (batch, kv head) holds its slots
// [c * len, (c + 1) * len). len is a multiple of `align` (a paged cache's block size, so no chunk splits a block),
// chunks hold at least kMinChunkSlots slots where there are that many (shorter ones would cost more to combine than
// they spread), and their count is chunks_per_pair's: fixed by the shape, whatever the thread count.
constexpr int64_t kMinChunkSlots = 1024;

struct SlotChunks {
  int64_t len, count;
};

inline SlotChunks decode_slot_chunks(int64_t pairs, int64_t max_len, int64_t align) {
  const int64_t wanted = chunks_per_pair(pairs, max_len / kMinChunkSlots);
  const int64_t len = std::max<int64_t>(align, (max_len + wanted * align - 1) / (wanted * align) * align);
  return {len, std::max<int64_t>(1, (max_len + len - 1) / len)};
}

}  // namespace kvcomp::kernels
