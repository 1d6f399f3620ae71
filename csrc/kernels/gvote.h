// Device-free math of the gvote family (kvcomp::nucleus_budget, averaged_rope, gvote_union_mask), used by the CPU
// loops, the CUDA kernels and GoogleTest.
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

namespace kvcomp::kernels::gvote {

// ---------------------------------------------------------------------------------------------------------------
// nucleus_budget: the mass a probability contributes. NaN, negative values and -0 count as 0 (so a NaN can neither
// poison the row sum nor be picked ahead of a real probability); +inf stays +inf (it takes the whole mass).
KVCOMP_HOST_DEVICE inline float nucleus_mass(float probability) { return probability > 0.0f ? probability : 0.0f; }

// The nucleus size of a row whose masses are sorted in descending order: the smallest k >= 1 with
// (sum of the first k) >= p * (sum of all), the sums accumulated in double in that (descending) order. p = 1 is the
// whole support (every slot of positive mass), exactly, rather than wherever a rounded running sum first reaches the
// rounded total (a 1e-30 after a 1 would not change a double sum). A row of zeros gives 1; T = 0 gives 0.
inline int64_t nucleus_count_sorted(const float* sorted_descending, int64_t len, double p) {
  if (len == 0) return 0;
  int64_t support = 0;
  double total = 0.0;
  for (int64_t i = 0; i < len; ++i) {
    support += sorted_descending[i] > 0.0f;
    total += static_cast<double>(sorted_descending[i]);
  }
  if (support == 0) return 1;
  if (p >= 1.0) return support;
  const double target = p * total;
  double running = 0.0;
  for (int64_t i = 0; i < support; ++i) {
    running += static_cast<double>(sorted_descending[i]);
    if (running >= target) return i + 1;
  }
  return support;  // unreachable for p < 1 (p * total <= total); no input can give more than the support
}

// The same rule from two counts over a row sorted in descending order, as the CUDA kernels gather them (in pieces):
// `below`, the positive masses whose running sum (in double) stays below p * total, and `positive`, the support. The
// first prefix that reaches p * total closes the nucleus; p >= 1 is the support; a row of zeros gives 1.
KVCOMP_HOST_DEVICE inline int64_t nucleus_from_counts(int64_t below, int64_t positive, double p) {
  if (positive == 0) return 1;
  if (p >= 1.0) return positive;
  return below + 1 < positive ? below + 1 : positive;
}

// ---------------------------------------------------------------------------------------------------------------
// averaged_rope: transformers' rotate_half(x) = cat(-x[d/2:], x[:d/2]), i.e. rotate_half(x)[i] = sign * x[source]
// with (source, sign) = (i + d/2, -1) for i < d/2 and (i - d/2, +1) otherwise.
struct RotateHalfSource {
  int64_t index;
  float sign;
};

KVCOMP_HOST_DEVICE inline RotateHalfSource rotate_half_source(int64_t channel, int64_t dim) {
  const int64_t half = dim / 2;
  return channel < half ? RotateHalfSource{channel + half, -1.0f} : RotateHalfSource{channel - half, 1.0f};
}

// One output channel: q[i] * mean_cos[i] + rotate_half(q)[i] * mean_sin[i], in float32.
KVCOMP_HOST_DEVICE inline float averaged_rope_channel(float q, float q_source, float sign, float mean_cos,
                                                      float mean_sin) {
  return q * mean_cos + (sign * q_source) * mean_sin;
}

// ---------------------------------------------------------------------------------------------------------------
// gvote_union_mask: each sample keeps its top-k keys by logit, ties to the lower slot, NaN below everything (-inf
// included). selection_key orders the slots of a row by that rule as unsigned integers, best first: slot s is among
// the top k iff selection_key(s) <= the k-th smallest selection_key of the row. The key is unique per slot (it holds
// the slot in its low 32 bits), so exactly k slots pass.

// Unsigned integer in the order of the float, -0 == +0, every NaN (either sign, any payload) below -inf.
KVCOMP_HOST_DEVICE inline uint32_t ascending_logit_order(float logit) {
  uint32_t bits = float_bits(logit);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0u;  // NaN: lowest
  if ((bits & 0x7fffffffu) == 0u) bits = 0u;  // -0 reads as +0
  // Negative floats reverse; positive ones go above them. -inf maps to 0x007fffff > 0, so NaN's 0 stays below it.
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Best first: the larger logit gives the smaller key, then the lower slot.
KVCOMP_HOST_DEVICE inline uint64_t selection_key(float logit, uint32_t slot) {
  return (static_cast<uint64_t>(~ascending_logit_order(logit)) << 32) | slot;
}

// The per-row budget after clamping to [0, T] (budgets come from a device tensor and are not checked on the host).
KVCOMP_HOST_DEVICE inline int64_t clamp_budget(int64_t budget, int64_t len) {
  return budget < 0 ? 0 : (budget > len ? len : budget);
}

}  // namespace kvcomp::kernels::gvote
