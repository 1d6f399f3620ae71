// Device-free math of the kvzap family (kvcomp::kvzap_score, kvzap_threshold), used by the CPU loops, the CUDA
// kernels and GoogleTest.
#pragma once

#include <cmath>
#include <cstdint>

#include "common.h"

namespace kvcomp::kernels::kvzap {

// ---------------------------------------------------------------------------------------------------------------
// kvzap_score: the surrogate's elementwise parts around the two GEMMs.

constexpr float kInvSqrt2 = 0.70710678118654752440f;

// Exact GELU (nn.GELU's default, approximate='none') given erf(x / sqrt 2): 0.5 * x * (1 + erf(x / sqrt 2)), in
// torch's order of operations. Acc is a float (CUDA, GoogleTest) or a SIMD vector of floats (CPU), whose erf the
// caller computes (at::vec has its own).
template <typename Acc>
KVCOMP_HOST_DEVICE inline Acc gelu_from_erf(Acc x, Acc erf_of_scaled_x) {
  return Acc(0.5f) * x * (Acc(1.0f) + erf_of_scaled_x);
}

KVCOMP_HOST_DEVICE inline float gelu(float x) { return gelu_from_erf(x, erff(x * kInvSqrt2)); }

// ---------------------------------------------------------------------------------------------------------------
// kvzap_threshold: the DMS-style keep rule of KVzap. A token is decided once, when it leaves the sliding window of
// the last `window` tokens; it is evicted then iff its score < threshold (NaN is never below: kept, as kvpress's
// DMSPress does). A pass that takes the cache from `before` to `after` tokens decides the absolute positions
// [max(0, before - window), max(0, after - window)).

struct DecisionRange {
  int64_t begin, end;
};

KVCOMP_HOST_DEVICE inline DecisionRange decision_range(int64_t tokens_before, int64_t tokens_after, int64_t window) {
  const int64_t begin = tokens_before - window, end = tokens_after - window;
  return {begin > 0 ? begin : 0, end > 0 ? end : 0};
}

KVCOMP_HOST_DEVICE inline bool evicted_now(float score, int64_t position, DecisionRange range, float threshold) {
  return position >= range.begin && position < range.end && score < threshold;
}

KVCOMP_HOST_DEVICE inline float evicted_log_weight() { return bits_float(0xff800000u); }  // -inf

// The slot's log-weight after this pass: -inf if it is evicted now, unchanged otherwise (slots evicted earlier, and
// padding, are already -inf).
KVCOMP_HOST_DEVICE inline float thresholded_log_weight(float log_weight, float score, int64_t position,
                                                       DecisionRange range, float threshold) {
  return evicted_now(score, position, range, threshold) ? evicted_log_weight() : log_weight;
}

// A slot counts as held (in the per-row counts the press compacts with) unless its log-weight is -inf.
KVCOMP_HOST_DEVICE inline bool is_held(float log_weight) { return log_weight != evicted_log_weight(); }

}  // namespace kvcomp::kernels::kvzap
