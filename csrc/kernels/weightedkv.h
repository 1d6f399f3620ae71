// Device-free math of WeightedKV's eviction step (kvcomp::weightedkv_evict), used by the CPU loop, the CUDA kernel and
// GoogleTest.
//
// One step of Algorithm 1 on the cache of one (batch, kv-head): mean = sums / counts; j = argmin mean over the middle
// slots (neither the first `sinks` nor the last `recent`); V[j+1] <- (mean_j V_j + mean_{j+1} V_{j+1}) /
// (mean_j + mean_{j+1}); delete slot j (key, value, sum, count). The survivors' sums and counts never change, so
// neither do their means: applying the step e times evicts exactly the e middle slots with the smallest eviction_key
// (the mean, ties to the lower slot), in that order. Where each one merges is then a local matter, see fold_run.
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

namespace kvcomp::kernels {

// mean = sum / count, correctly rounded on every device (--use_fast_math would otherwise approximate the division and
// could flip an argmin the CPU and the reference agree on).
KVCOMP_HOST_DEVICE inline float mean_score(float sum, float count) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(sum, count);
#else
  return sum / count;
#endif
}

constexpr uint32_t kPositiveInfinityBits = 0x7f800000u;

// NaN (any payload) reads as +inf; -0 reads as +0. Works on the bits, so no compiler flag can optimise it away.
KVCOMP_HOST_DEVICE inline float sanitize_mean(float mean) {
  const uint32_t magnitude = float_bits(mean) & 0x7fffffffu;
  if (magnitude > kPositiveInfinityBits) return bits_float(kPositiveInfinityBits);
  if (magnitude == 0) return 0.0f;
  return mean;
}

// Unsigned integer with the order of the (sanitized) float: a < b as floats <=> order_key(a) < order_key(b), NaN is
// +inf (last: a NaN slot is only evicted when nothing finite is left) and -0 == +0.
KVCOMP_HOST_DEVICE inline uint32_t order_key(float mean) {
  const uint32_t bits = float_bits(sanitize_mean(mean));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The total order of the argmin: mean first, then the lower slot (torch.argmin's first occurrence). Unique per slot,
// and the slot can be read back from the low 32 bits.
KVCOMP_HOST_DEVICE inline uint64_t eviction_key(float mean, uint32_t slot) {
  return (static_cast<uint64_t>(order_key(mean)) << 32) | slot;
}

KVCOMP_HOST_DEVICE inline int64_t key_slot(uint64_t key) { return static_cast<int64_t>(key & 0xffffffffu); }

struct MergeCoefficients {
  float child, parent;
};

// Weights of V[j] (child, evicted) and V[j+1] (parent, survives the step) in the merged value: the convex combination
// mean_j / (mean_j + mean_{j+1}), mean_{j+1} / (mean_j + mean_{j+1}), and its limits where that is 0/0 or inf/inf:
//   - both means 0 (or summing to 0): the plain mean, 1/2 and 1/2 (never NaN from 0/0);
//   - NaN reads as +inf, as in the argmin; one infinite mean: that value alone (the limit of the combination);
//     both infinite: the plain mean.
// The ratio is taken in double, so that two large finite means cannot overflow their sum.
KVCOMP_HOST_DEVICE inline MergeCoefficients merge_coefficients(float mean_child, float mean_parent) {
  const float child = sanitize_mean(mean_child);
  const float parent = sanitize_mean(mean_parent);
  const bool child_inf = (float_bits(child) & 0x7fffffffu) == kPositiveInfinityBits;
  const bool parent_inf = (float_bits(parent) & 0x7fffffffu) == kPositiveInfinityBits;
  if (child_inf && parent_inf) return {0.5f, 0.5f};
  if (child_inf) return {1.0f, 0.0f};
  if (parent_inf) return {0.0f, 1.0f};
  const double total = static_cast<double>(child) + static_cast<double>(parent);
  if (total == 0.0) return {0.5f, 0.5f};
  return {static_cast<float>(child / total), static_cast<float>(parent / total)};
}

// The merged value of one channel (Acc = float) or of adjacent channels (Acc = at::vec::Vectorized<float> on CPU).
template <typename Acc>
KVCOMP_HOST_DEVICE inline Acc weighted_merge(Acc child, Acc parent, Acc coefficient_child, Acc coefficient_parent) {
  return coefficient_child * child + coefficient_parent * parent;
}

// Folds one run of evicted slots [first, terminal) into the surviving slot `terminal` right after it, exactly as the
// greedy steps would: slot j is evicted (in eviction_key order) into its right alive neighbour at that moment, which
// is the nearest slot to its right with a larger key (every smaller key is gone by then, every larger one is still
// there), i.e. its next-greater element; `terminal` (a survivor) is larger than every key of the run. A right-to-left
// monotonic stack visits that forest in post order, so each slot receives its merges in the same order as in the
// greedy steps (nearest child first = smallest key first), and the result is bit-identical to them. O(run) steps,
// no sort. Runs separated by a survivor never interact, so they can be folded independently (one CUDA warp each).
//
// Stack: the caller's storage of the open slots, level 0 being `terminal`:
//   reset(terminal)   start a run: level 0 holds the terminal's value;
//   depth()           number of open evicted slots (levels 1..depth);
//   top_key()         eviction key of the top level (depth() > 0);
//   push(key)         open the slot key_slot(key) with its own value;
//   pop_and_merge()   merge the top level into the level below it and close it.
template <typename Stack, typename KeyOf>
KVCOMP_HOST_DEVICE inline void fold_run(int64_t first, int64_t terminal, Stack& stack, KeyOf key_of) {
  stack.reset(terminal);
  for (int64_t slot = terminal - 1; slot >= first; --slot) {
    const uint64_t key = key_of(slot);
    while (stack.depth() > 0 && stack.top_key() < key) stack.pop_and_merge();
    stack.push(key);
  }
  while (stack.depth() > 0) stack.pop_and_merge();
}

}  // namespace kvcomp::kernels
