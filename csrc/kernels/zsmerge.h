// Device-free math of the zsmerge family (kvcomp::zsmerge_prefill, kvcomp::zsmerge_decode_step), used by the CPU
// loops, the CUDA kernels and GoogleTest.
//
// Cache layout of one (batch, kv-head), M = residual + context + recent slots:
//   [0, residual)                       residual merge slots (group means / merged tokens, count = tokens merged)
//   [residual, residual + context)      context slots, the top-score tokens
//   [residual + context, M)             the recent ring; ring_position is the offset of its oldest token
#pragma once

#include <cstdint>

#include "common.h"

namespace kvcomp::kernels {

// The largest slot index: no slot.
constexpr int64_t kNoSlot = INT64_MAX;

// The tokens [begin, end) (ranks among the n residual tokens, in position order) that residual slot `group` averages
// at prefill: n tokens split into `groups` contiguous groups, the first n % groups of them one token longer.
struct GroupBounds {
  int64_t begin, end;
};

KVCOMP_HOST_DEVICE inline GroupBounds residual_group_bounds(int64_t num_tokens, int64_t groups, int64_t group) {
  const int64_t base = num_tokens / groups;
  const int64_t longer = num_tokens % groups;
  const int64_t begin = group * base + (group < longer ? group : longer);
  return {begin, begin + base + (group < longer ? 1 : 0)};
}

// torch.maximum semantics: a NaN on either side gives NaN (a merged slot's score s_j <- max(s_i, s_j); group max).
KVCOMP_HOST_DEVICE inline float nan_propagating_max(float a, float b) { return (is_nan(a) || a > b) ? a : b; }

// The merge of slot i into slot j, one element of a key or value row (Acc: float, or a SIMD vector of floats):
//   x_j <- (w_i x_i + w_j x_j) / (w_i + w_j)          (ZSMerge eq. 7 for a merged slot of weight w_i)
template <typename Acc>
KVCOMP_HOST_DEVICE inline Acc merge_weighted(Acc x_i, Acc w_i, Acc x_j, Acc w_j) {
  return (w_i * x_i + w_j * x_j) / (w_i + w_j);
}

// A candidate slot of a selection and the value it is ranked by.
struct SlotChoice {
  float value;
  int64_t slot;
};

// Eviction order of the context region (argmin of the score): NaN counts as +inf, ties go to the lower slot.
// Strict and total, so any reduction order (SIMD lanes, CUB trees) picks the same slot.
struct EvictsFirst {
  KVCOMP_HOST_DEVICE static float key(float score) {
    return is_nan(score) ? infinity() : score;
  }
  KVCOMP_HOST_DEVICE bool operator()(const SlotChoice& a, const SlotChoice& b) const {
    const float ka = key(a.value), kb = key(b.value);
    return ka < kb || (ka == kb && a.slot < b.slot);
  }
  // The identity of the reduction: loses to every real slot, even an all-NaN one.
  KVCOMP_HOST_DEVICE static SlotChoice none() {
    return {infinity(), kNoSlot};
  }
};

// Merge-target order of the residual slots (argmax of k_i . k_j, eq. 6): NaN counts as -inf, ties go to the lower slot.
struct MergesFirst {
  KVCOMP_HOST_DEVICE static float key(float similarity) {
    return is_nan(similarity) ? -infinity() : similarity;
  }
  KVCOMP_HOST_DEVICE bool operator()(const SlotChoice& a, const SlotChoice& b) const {
    const float ka = key(a.value), kb = key(b.value);
    return ka > kb || (ka == kb && a.slot < b.slot);
  }
  KVCOMP_HOST_DEVICE static SlotChoice none() {
    return {-infinity(), kNoSlot};
  }
};

// Binary reduction keeping the better of two candidates under Order (a CUB reduction operator as well).
template <typename Order>
struct KeepBetter {
  KVCOMP_HOST_DEVICE SlotChoice operator()(const SlotChoice& a, const SlotChoice& b) const {
    return Order{}(b, a) ? b : a;
  }
};

// The slot of the oldest recent token when the new token `step` (0-based within the call) arrives.
KVCOMP_HOST_DEVICE inline int64_t oldest_recent_slot(int64_t residual, int64_t context, int64_t recent,
                                                     int64_t ring_position, int64_t step) {
  return residual + context + (ring_position + step) % recent;
}

// The slot a decoding step evicts, given the context's argmin (`context_lowest`) and the token leaving the recent
// window (`leaving`). The authors' code (`paper_order` false) evicts from the context as it stands; the paper's
// Algorithm 1 lets the leaving token join the context first, so it is evicted itself when its score is the lowest
// (ties go to the context token, the lower slot).
KVCOMP_HOST_DEVICE inline SlotChoice evicted_slot(SlotChoice context_lowest, SlotChoice leaving, bool paper_order) {
  return paper_order ? KeepBetter<EvictsFirst>{}(context_lowest, leaving) : context_lowest;
}

}  // namespace kvcomp::kernels
