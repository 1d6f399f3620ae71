// GoogleTest of the keepkv family: the device-free pieces (cosine with zero norms, the match decision, the log-domain
// ZIP coefficients and their guard, the fused decoding step's log-add-exp and packing map) against hand computations,
// the ATen grouping of merge sets the CUDA path uses, and both CPU kernels through the dispatcher.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <tuple>
#include <vector>

#include "cpu/vec.h"
#include "kernels/keepkv.h"
#include "kvcomp/keepkv.h"

namespace {

namespace k = kvcomp::kernels;
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(KeepKVKernels, CosineOfZeroKeysIsZero) {
  EXPECT_EQ(k::cosine_similarity(0.0f, 0.0f, 4.0f), 0.0f);
  EXPECT_EQ(k::cosine_similarity(0.0f, 9.0f, 0.0f), 0.0f);
  EXPECT_FLOAT_EQ(k::cosine_similarity(6.0f, 4.0f, 9.0f), 1.0f);   // (2,0)·(3,0)
  EXPECT_FLOAT_EQ(k::cosine_similarity(-3.0f, 2.0f, 4.5f), -1.0f);  // (1,1)·(-1.5,-1.5)
  EXPECT_FLOAT_EQ(k::cosine_similarity(1.0f, 2.0f, 2.0f), 0.5f);
  EXPECT_EQ(k::inverse_norm(0.0f), 0.0f);
  EXPECT_FLOAT_EQ(k::inverse_norm(16.0f), 0.25f);
}

TEST(KeepKVKernels, ANonFiniteKeyHasNoCosineEvenWithAZeroKey) {
  // (NaN, 1)·(0, 0) = NaN and (inf, 0)·(0, 0) = NaN: no similarity, as the GEMM path's normalised rows give it.
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isnan(k::cosine_similarity(kNan * 0.0f, kNan, 0.0f)));
  EXPECT_TRUE(std::isnan(k::cosine_similarity(inf * 0.0f, 0.0f, inf)));
  EXPECT_TRUE(std::isnan(k::cosine_similarity(inf, inf, 4.0f)));  // (inf, 0)·(2, 0): inf / inf
}

TEST(KeepKVKernels, CosinesAreClampedAndRoundedTo2PowMinus16) {
  EXPECT_EQ(k::rounded_cosine(1.0000001f), 1.0f);  // float32 rounding above 1: clamped
  EXPECT_EQ(k::rounded_cosine(0.99999994f), 1.0f);  // just below 1: rounds to exactly 1 (merges at threshold 1.0)
  EXPECT_EQ(k::rounded_cosine(-1.5f), -1.0f);
  EXPECT_EQ(k::rounded_cosine(0.5f + 0x1p-18f), 0.5f);  // within half a step: the same value, so it ties
  EXPECT_EQ(k::rounded_cosine(0.5f + 0x1p-16f), 0.5f + 0x1p-16f);  // a whole step: ordered
  EXPECT_TRUE(std::isnan(k::rounded_cosine(kNan)));
  EXPECT_EQ(k::cosine_similarity(4.0f, 2.0f, 8.0f), 1.0f);  // (1,1)·(2,2) = 4 / (sqrt 2 · sqrt 8)
}

TEST(KeepKVKernels, KeyRescaleIsAPowerOfTwoBringingTheMaximumBelowOne) {
  for (const float max_abs : {3e38f, 2e19f, 1.0f, 0.75f, 1e-20f, 1e-40f}) {
    const float scaled = max_abs * k::key_rescale(max_abs);
    EXPECT_GE(scaled, max_abs < 1e-38f ? 1e-10f : 0.5f) << max_abs;
    EXPECT_LT(scaled, max_abs > 1e38f ? 4.0f : 1.0f) << max_abs;
    int exponent = 0;
    EXPECT_EQ(std::frexp(k::key_rescale(max_abs), &exponent), 0.5f) << max_abs;  // a power of two: exact scaling
  }
  EXPECT_EQ(k::key_rescale(0.0f), 1.0f);
  EXPECT_EQ(k::key_rescale(kInf), 1.0f);
  EXPECT_TRUE(k::norm_sq_is_safe(1.0f));
  EXPECT_FALSE(k::norm_sq_is_safe(kInf));
  EXPECT_FALSE(k::norm_sq_is_safe(1e-35f));
}

// key_scale is what the CPU loops and the CUDA direct path multiply a key by: 1 unless its squares left the safe
// range, and then a power of two that makes the cosine of huge or tiny keys that of the same keys at unit scale.
TEST(KeepKVKernels, KeyScaleRescalesOnlyUnsafeKeysAndKeepsTheirCosines) {
  EXPECT_EQ(k::key_scale(4.0f, 2.0f), 1.0f);
  EXPECT_EQ(k::key_scale(kInf, 3e19f), k::key_rescale(3e19f));  // squares overflowed
  EXPECT_EQ(k::key_scale(0.0f, 1e-25f), k::key_rescale(1e-25f));  // squares underflowed to 0
  EXPECT_EQ(k::key_scale(0.0f, 0.0f), 1.0f);  // a zero key stays zero
  EXPECT_EQ(k::key_scale(kNan, 4.0f), 0.125f);  // NaN squares are not safe either: scaled as usual, cosine stays NaN
  EXPECT_EQ(k::max_magnitude(2.0f, -3.0f), 3.0f);
  EXPECT_EQ(k::max_magnitude(2.0f, kNan), 2.0f);  // NaN skipped, as std::max(current, |x|) on the CPU
  // (3, 4) and (4, 3) at 1e30: their float32 squares overflow; after key_scale the cosine is 24/25 as at unit scale.
  const std::vector<std::vector<float>> keys = {{3e30f, 4e30f}, {4e30f, 3e30f}};
  std::vector<float> scales, norms;
  for (const auto& key : keys) {
    float norm_sq = 0.0f, max_abs = 0.0f;
    for (const float x : key) {
      norm_sq += x * x;
      max_abs = k::max_magnitude(max_abs, x);
    }
    EXPECT_EQ(norm_sq, kInf);
    scales.push_back(k::key_scale(norm_sq, max_abs));
    float rescaled = 0.0f;
    for (const float x : key) rescaled += (x * scales.back()) * (x * scales.back());
    EXPECT_TRUE(k::norm_sq_is_safe(rescaled));
    norms.push_back(rescaled);
  }
  float dot = 0.0f;
  for (int c = 0; c < 2; ++c) dot += (keys[0][c] * scales[0]) * (keys[1][c] * scales[1]);
  EXPECT_EQ(k::cosine_similarity(dot, norms[0], norms[1]), k::rounded_cosine(24.0f / 25.0f));
}

// The CUDA direct path's split reduction: the maximum of packed candidates, in any order, is the candidate the
// MergesFirst reduction picks (ties to the lower slot, NaN last, -0 == +0), and it unpacks to the same target.
TEST(KeepKVKernels, PackedCandidatesReduceByMaximumAsMergesFirst) {
  const std::vector<float> values = {-1.0f, -0.5f, -0.0f, 0.0f, 0x1p-16f, 0.5f, 0.5f + 0x1p-16f, 1.0f, kNan};
  std::mt19937 generator(3);
  std::uniform_int_distribution<size_t> pick(0, values.size() - 1);
  std::uniform_int_distribution<int64_t> slot(0, 40000);
  for (int trial = 0; trial < 2000; ++trial) {
    const int count = 1 + trial % 12;
    k::SlotChoice best = k::MergesFirst::none();
    uint64_t packed_max = 0;
    for (int i = 0; i < count; ++i) {
      const k::SlotChoice candidate{values[pick(generator)], trial % 3 == 0 ? int64_t{i} : slot(generator)};
      best = k::KeepBetter<k::MergesFirst>{}(best, candidate);
      packed_max = std::max(packed_max, k::pack_candidate(candidate));
    }
    const k::SlotChoice unpacked = k::unpack_candidate(packed_max);
    EXPECT_EQ(unpacked.slot, best.slot);
    EXPECT_TRUE(unpacked.value == best.value || (std::isnan(unpacked.value) && std::isnan(best.value)));
    for (const float threshold : {-1.0f, 0.0f, 0.5f, 1.0f}) {
      EXPECT_EQ(k::match_target(unpacked, threshold), k::match_target(best, threshold));
    }
  }
  EXPECT_EQ(k::pack_candidate(k::MergesFirst::none()), 0u);
  EXPECT_EQ(k::unpack_candidate(0).slot, k::kNoSlot);
  EXPECT_GT(k::pack_candidate({kNan, 2147483646}), 0u);  // the worst real candidate still beats none
  EXPECT_EQ(k::unpack_candidate(k::pack_candidate({-0.75f, 12})).value, -0.75f);
}

TEST(KeepKVKernels, MatchTargetAppliesTheThreshold) {
  EXPECT_EQ(k::match_target({0.8f, 5}, 0.8f), 5);  // >= threshold
  EXPECT_EQ(k::match_target({0.79f, 5}, 0.8f), k::kKeepKVEvictedNoMerge);
  EXPECT_EQ(k::match_target({kNan, 5}, -1.0f), k::kKeepKVEvictedNoMerge);
  EXPECT_EQ(k::match_target(k::MergesFirst::none(), -1.0f), k::kKeepKVEvictedNoMerge);  // nothing retained
  EXPECT_EQ(k::match_target({-1.0f, 0}, -1.0f), 0);
}

// Sums of a set given as (p, ℓ) pairs, the two passes of the kernels.
std::pair<float, k::ZipSums> sums_of(const std::vector<std::pair<float, float>>& set) {
  float max_log = -kInf;
  for (const auto& [p, l] : set) max_log = k::zip_max_log(max_log, p, l);
  k::ZipSums sums;
  for (const auto& [p, l] : set) sums.add(p, l, max_log);
  return {max_log, sums};
}

TEST(KeepKVKernels, ZipKeyScaleMatchesTheUnshiftedFormula) {
  // p = (1, 2), ℓ = (1, 2): Σ p s = e + 2e^2, Σ p = 3, Σ p s ℓ = e + 4e^2.
  // Unshifted: k_r = (Σ p s k) · ln((e + 2e^2)/3) / (e + 4e^2); shifted by m = 2 the scale on Σ w k (w = p s / e^2)
  // is ln((e + 2e^2)/3) / ((e + 4e^2)/e^2).
  const auto [m, sums] = sums_of({{1.0f, 1.0f}, {2.0f, 2.0f}});
  EXPECT_EQ(m, 2.0f);
  const double e = std::exp(1.0), e2 = std::exp(2.0);
  EXPECT_NEAR(sums.weight, (e + 2 * e2) / e2, 1e-6);
  EXPECT_NEAR(sums.votes, 3.0, 1e-7);
  EXPECT_NEAR(sums.weighted_log, (e + 4 * e2) / e2, 1e-6);
  const auto c = k::zip_coefficients(m, sums, /*convex=*/false);
  ASSERT_TRUE(c.merged && c.zip_used);
  EXPECT_NEAR(c.key_scale, std::log((e + 2 * e2) / 3) / ((e + 4 * e2) / e2), 1e-6);
  EXPECT_NEAR(c.value_scale, e2 / (e + 2 * e2), 1e-6);
  // Theorem 3 in one dimension: keys k_i = ℓ_i (q = 1, scale 1) -> q·k_r = ln(Σ p s / Σ p).
  const float key = c.key_scale * static_cast<float>((1.0 * 1 * e + 2.0 * 2 * e2) / e2);
  EXPECT_NEAR(key, std::log((e + 2 * e2) / 3), 1e-6);
  const auto convex = k::zip_coefficients(m, sums, /*convex=*/true);
  EXPECT_TRUE(convex.merged && !convex.zip_used);
  EXPECT_FLOAT_EQ(convex.key_scale, convex.value_scale);
}

TEST(KeepKVKernels, ZipIsShiftInvariant) {
  // Adding a constant to every ℓ must not overflow: ℓ = 1000 + (0, 1).
  const auto [m, sums] = sums_of({{1.0f, 1000.0f}, {1.0f, 1001.0f}});
  const auto c = k::zip_coefficients(m, sums, false);
  ASSERT_TRUE(c.merged && c.zip_used);
  const double numerator = 1001.0 + std::log((std::exp(-1.0) + 1.0) / 2.0);
  EXPECT_NEAR(c.key_scale, numerator / (std::exp(-1.0) * 1000.0 + 1001.0), 1e-6);
}

TEST(KeepKVKernels, GuardFallsBackOnANearZeroDenominator) {
  // p = (e^2, 1), ℓ = (-1, 1): p s = (e, e), Σ w ℓ = 0.
  const auto [m, sums] = sums_of({{std::exp(2.0f), -1.0f}, {1.0f, 1.0f}});
  EXPECT_NEAR(sums.weighted_log, 0.0f, 1e-6);
  const auto c = k::zip_coefficients(m, sums, false);
  EXPECT_TRUE(c.merged);
  EXPECT_FALSE(c.zip_used);
  EXPECT_FLOAT_EQ(c.key_scale, 1.0f / sums.weight);
  k::ZipSums tiny = sums;  // numerators giving the convex key's scale (growth 1), so only the band decides
  tiny.weighted_log = 0.5e-3f * tiny.weight * tiny.max_abs_log;  // inside the guard band
  EXPECT_FALSE(k::zip_guard_passes(tiny.weighted_log / tiny.weight, tiny));
  tiny.weighted_log = 2e-3f * tiny.weight * tiny.max_abs_log;  // outside
  EXPECT_TRUE(k::zip_guard_passes(tiny.weighted_log / tiny.weight, tiny));
}

// Σ w = 1, Σ p = 2, Σ w ℓ = 0.5, max |ℓ| = 1: outside the near-zero band, so only the numerator decides.
k::ZipSums well_conditioned_sums() {
  k::ZipSums sums;
  sums.weight = 1.0f;
  sums.votes = 2.0f;
  sums.weighted_log = 0.5f;
  sums.max_abs_log = 1.0f;
  return sums;
}

TEST(KeepKVKernels, GuardFallsBackOnASignMismatch) {
  k::ZipSums sums = well_conditioned_sums();
  EXPECT_TRUE(k::zip_guard_passes(0.3f, sums));
  EXPECT_FALSE(k::zip_guard_passes(-0.3f, sums));
  EXPECT_TRUE(k::zip_guard_passes(0.0f, sums));  // a zero key: exact by the theorem
  EXPECT_FALSE(k::zip_guard_passes(kNan, sums));
  EXPECT_FALSE(k::zip_guard_passes(kInf, sums));
  sums.weighted_log = -0.5f;
  EXPECT_TRUE(k::zip_guard_passes(-0.3f, sums));
  EXPECT_FALSE(k::zip_guard_passes(0.3f, sums));
}

TEST(KeepKVKernels, GuardFallsBackWhenTheZipKeyGrowsBeyondTheBound) {
  // growth = Σ w · numerator / Σ w ℓ = numerator / 0.5 here: the ZIP key is used for growth in [1/2, 2] only.
  const k::ZipSums sums = well_conditioned_sums();
  EXPECT_EQ(k::kZipMaxKeyGrowth, 2.0f);
  EXPECT_TRUE(k::zip_guard_passes(1.0f, sums));     // growth 2
  EXPECT_FALSE(k::zip_guard_passes(1.01f, sums));   // 2.02
  EXPECT_TRUE(k::zip_guard_passes(0.25f, sums));    // 1/2
  EXPECT_FALSE(k::zip_guard_passes(0.24f, sums));   // 0.48
  // The coefficients then carry the convex key.
  const auto c = k::zip_coefficients(1.01f - std::log(0.5f), sums, false);
  EXPECT_TRUE(c.merged);
  EXPECT_FALSE(c.zip_used);
  EXPECT_FLOAT_EQ(c.key_scale, 1.0f);
}

TEST(KeepKVKernels, ZeroWeightSetsKeepTheSlot) {
  const auto [m, sums] = sums_of({{0.0f, 1.0f}, {2.0f, -kInf}, {kNan, 3.0f}, {1.0f, kNan}});
  EXPECT_EQ(m, -kInf);
  EXPECT_EQ(sums.weight, 0.0f);
  EXPECT_FALSE(k::zip_coefficients(m, sums, false).merged);
  EXPECT_FALSE(k::zip_coefficients(m, sums, true).merged);
  // +inf log-score: Σ w is NaN -> unchanged, no NaN key
  const auto [m2, sums2] = sums_of({{1.0f, kInf}, {1.0f, 0.0f}});
  EXPECT_FALSE(k::zip_coefficients(m2, sums2, false).merged);
}

TEST(KeepKVKernels, LogAddExpOfOnePair) {
  EXPECT_NEAR(k::log_add_exp(std::log(2.0f), std::log(3.0f)), std::log(5.0f), 1e-6f);
  EXPECT_EQ(k::log_add_exp(1.5f, -kInf), 1.5f);  // ln(e^x + 0) = x exactly
  EXPECT_EQ(k::log_add_exp(-kInf, 1.5f), 1.5f);
  EXPECT_EQ(k::log_add_exp(-kInf, -kInf), -kInf);  // a slot no query sees stays unseen
  EXPECT_EQ(k::log_add_exp(kInf, 0.0f), kInf);
  EXPECT_TRUE(std::isnan(k::log_add_exp(kInf, kInf)));
  EXPECT_TRUE(std::isnan(k::log_add_exp(kNan, -kInf)));
  EXPECT_TRUE(std::isnan(k::log_add_exp(0.0f, kNan)));
  EXPECT_NEAR(k::log_add_exp(-100.0f, 0.0f), 0.0f, 1e-6f);  // no underflow of the smaller term's share to NaN
}

TEST(KeepKVKernels, LogOneMinusExpIsAccurateAtBothEnds) {
  // ln(1 - e^x) in double as the reference: near 0 the naive float form loses every digit (1 - e^x cancels), far
  // below it e^x underflows its share; the bias correction ln(1 - β^age) meets both (age 1 and age 10^4).
  for (const double x : {-1e-7, -1e-3, -0.5, -0.69314718, -0.7, -2.0, -20.0, -80.0}) {
    const double exact = std::log(-std::expm1(x));
    EXPECT_NEAR(k::log_one_minus_exp(static_cast<float>(x)), exact, 2e-6 * std::max(1.0, std::abs(exact))) << x;
  }
  EXPECT_EQ(k::log_one_minus_exp(0.0f), -kInf);  // age 0: nothing averaged yet
  EXPECT_EQ(k::log_one_minus_exp(-kInf), 0.0f);  // β^age underflowed: no correction
  EXPECT_TRUE(std::isnan(k::log_one_minus_exp(kNan)));
}

TEST(KeepKVKernels, EvictionKeyRanksProtectedLastAndMergedAwayFirst) {
  EXPECT_EQ(k::keepkv_eviction_key(-3.0f, 2.0f, false), -3.0f);
  EXPECT_EQ(k::keepkv_eviction_key(-3.0f, 2.0f, true), kInf);   // a sink or a recent slot
  EXPECT_EQ(k::keepkv_eviction_key(kNan, 1.0f, true), kInf);
  EXPECT_EQ(k::keepkv_eviction_key(5.0f, 0.0f, false), -kInf);  // no votes left: merged into another slot
  EXPECT_EQ(k::keepkv_eviction_key(kNan, 1.0f, false), -kInf);  // a NaN score never outranks a real one
  EXPECT_EQ(k::keepkv_eviction_key(-kInf, 1.0f, false), -kInf);
}

TEST(KeepKVKernels, ZipWeightIsTheVoteTimesTheShiftedScore) {
  EXPECT_FLOAT_EQ(k::zip_weight(3.0f, std::log(2.0f), std::log(4.0f)), 1.5f);  // 3 · 2/4
  EXPECT_FLOAT_EQ(k::zip_weight(1.0f, 7.0f, 7.0f), 1.0f);
  EXPECT_EQ(k::zip_weight(0.0f, 1.0f, 1.0f), 0.0f);    // no votes
  EXPECT_EQ(k::zip_weight(-1.0f, 1.0f, 1.0f), 0.0f);
  EXPECT_EQ(k::zip_weight(2.0f, -kInf, 1.0f), 0.0f);   // never attended
  EXPECT_EQ(k::zip_weight(kNan, 1.0f, 1.0f), 0.0f);
  EXPECT_EQ(k::zip_weight(1.0f, kNan, 1.0f), 0.0f);
  EXPECT_EQ(k::zip_weight(1.0f, -200.0f, 0.0f), 0.0f);  // underflows to 0, not NaN
}

// The packing of a row after a step: the retained slots in order from 0, each moved down (never up), as a stable
// partition of the slots into retained and evicted would place them.
TEST(KeepKVKernels, PackedPositionsArePartitionOrder) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t slots = 1 + static_cast<int64_t>(rng() % 40);
    const int count = static_cast<int>(std::min<int64_t>(slots, rng() % 9));
    std::vector<int64_t> all(slots);
    for (int64_t t = 0; t < slots; ++t) all[t] = t;
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int64_t> evicted(all.begin(), all.begin() + count);
    std::sort(evicted.begin(), evicted.end());
    const k::EvictedSlots slots_out{evicted.data(), count};
    int64_t next = 0;
    for (int64_t t = 0; t < slots; ++t) {
      const bool is_evicted = std::binary_search(evicted.begin(), evicted.end(), t);
      ASSERT_EQ(slots_out.contains(t), is_evicted);
      if (is_evicted) continue;
      ASSERT_EQ(slots_out.packed_position(t), next++) << "slot " << t;
      ASSERT_LE(slots_out.packed_position(t), t);
    }
    ASSERT_EQ(next, slots - count);
  }
}

TEST(KeepKVSets, MembersAreGroupedByTarget) {
  // Two rows of T = 5: row 0 merges 1 and 3 into 0, row 1 merges 4 into 2, 0 is evicted without merge.
  const auto targets = at::tensor({-1, 0, -1, 0, -2, -2, -1, -1, -1, 2}, at::kLong).view({2, 5});
  const auto sets = kvcomp::keepkv_members(targets);
  ASSERT_EQ(sets.offsets.numel(), 2 * 6 + 1);
  const auto off = sets.offsets.contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  const int64_t* m = sets.members.contiguous().data_ptr<int64_t>();
  EXPECT_EQ(o[1] - o[0], 2);  // (row 0, slot 0): members 1, 3
  EXPECT_EQ(m[o[0]], 1);
  EXPECT_EQ(m[o[0] + 1], 3);
  EXPECT_EQ(o[6 + 2 + 1] - o[6 + 2], 1);  // (row 1, slot 2): member 5 + 4 = 9
  EXPECT_EQ(m[o[6 + 2]], 9);
  EXPECT_EQ(o[6 + 1] - o[6 + 0], 0);
}

// The decoding step's slot of largest probability (its log-normaliser recovery): the first largest, as
// std::max_element, whatever the length against the vector width, with ties and -inf rows; NaN counts as -inf, as
// k::MergesFirst orders the CUDA kernels' reduction (a NaN at slot 0 once took the row).
TEST(KeepKVKernels, FirstArgmaxIsTheFirstLargest) {
  std::mt19937 generator(3);
  std::uniform_int_distribution<int> level(0, 3);  // few distinct values: many ties
  for (int64_t count = 1; count <= 70; ++count) {
    std::vector<float> values(count);
    for (int trial = 0; trial < 20; ++trial) {
      for (float& v : values) v = static_cast<float>(level(generator)) - 4.0f;
      EXPECT_EQ(kvcomp::cpu::first_argmax(values.data(), count),
                std::max_element(values.begin(), values.end()) - values.begin()) << "count " << count;
      values[trial % count] = kNan;  // NaN anywhere: the first largest of the others, under MergesFirst too
      k::SlotChoice best = k::MergesFirst::none();
      for (int64_t t = 0; t < count; ++t) {
        const k::SlotChoice candidate{values[t], t};
        if (k::MergesFirst{}(candidate, best)) best = candidate;
      }
      EXPECT_EQ(kvcomp::cpu::first_argmax(values.data(), count), best.slot) << "count " << count;
    }
  }
  const std::vector<float> none(19, -kInf);
  EXPECT_EQ(kvcomp::cpu::first_argmax(none.data(), 19), 0);
  const std::vector<float> with_nan = {kNan, 0.1f, kNan, 0.7f, 0.7f, 0.2f};
  EXPECT_EQ(kvcomp::cpu::first_argmax(with_nan.data(), 6), 3);
  const std::vector<float> nan_then_minus_inf = {kNan, -kInf, kNan};
  EXPECT_EQ(kvcomp::cpu::first_argmax(nan_then_minus_inf.data(), 3), 0);  // all -inf: the first
  const std::vector<float> all_nan(21, kNan);
  EXPECT_EQ(kvcomp::cpu::first_argmax(all_nan.data(), 21), 0);
}

TEST(KeepKVSets, PartitionPutsEvictedFirstInOrder) {
  const auto keep = at::tensor({1, 0, 1, 0, 0}).ne(0).view({1, 5});
  const auto evicted = kvcomp::keepkv_partition(keep, true).contiguous();
  const auto retained = kvcomp::keepkv_partition(keep, false).contiguous();
  EXPECT_EQ(std::vector<int64_t>(evicted.data_ptr<int64_t>(), evicted.data_ptr<int64_t>() + 5),
            (std::vector<int64_t>{1, 3, 4, 0, 2}));
  EXPECT_EQ(std::vector<int64_t>(retained.data_ptr<int64_t>(), retained.data_ptr<int64_t>() + 5),
            (std::vector<int64_t>{0, 2, 1, 3, 4}));
}

// ----------------------------------------------------------------------------------------------------------------
// Through the dispatcher

TEST(KeepKVOps, CpuKernelsAreRegistered) {
  for (const char* name : {"kvcomp::keepkv_match", "kvcomp::keepkv_zip_merge"}) {
    const auto op = c10::Dispatcher::singleton().findOp({name, ""});
    ASSERT_TRUE(op.has_value()) << name;
    EXPECT_TRUE(op->hasKernelForDispatchKey(c10::DispatchKey::CPU)) << name;
  }
}

TEST(KeepKVOps, MatchAndMergeByHand) {
  using MatchFn = at::Tensor(const at::Tensor&, const at::Tensor&, double, std::optional<int64_t>);
  using MergeFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                  const at::Tensor&, const at::Tensor&,
                                                                  const at::Tensor&, bool, bool);
  const auto match = c10::Dispatcher::singleton().findSchemaOrThrow("kvcomp::keepkv_match", "").typed<MatchFn>();
  const auto merge = c10::Dispatcher::singleton().findSchemaOrThrow("kvcomp::keepkv_zip_merge", "").typed<MergeFn>();
  // d = 2: slots 0 (1, 0) and 1 (0, 1) retained; 2 (2, 0.1) evicted -> 0; 3 (-1, -1) evicted, best cos 0 < 0.5 -> -2.
  const auto keys = at::tensor({1.f, 0.f, 0.f, 1.f, 2.f, 0.1f, -1.f, -1.f}).view({1, 1, 4, 2});
  const auto keep = at::tensor({1, 1, 0, 0}).ne(0).view({1, 1, 4});
  const auto targets = match.call(keys, keep, 0.5, std::nullopt);
  const std::vector<int64_t> expected{-1, -1, 0, -2};
  for (int64_t t = 0; t < 4; ++t) EXPECT_EQ(targets[0][0][t].item<int64_t>(), expected[t]) << "slot " << t;
  // ℓ = q·k with q = (1, 0): ℓ_0 = 1, ℓ_2 = 2; votes 1 and 3.
  const auto votes = at::tensor({1.f, 1.f, 3.f, 1.f}).view({1, 1, 4});
  const auto logs = at::tensor({1.f, 0.f, 2.f, -1.f}).view({1, 1, 4});
  const auto [out_k, out_v, out_p] = merge.call(keys, keys * 10, votes, logs, targets, false, true);
  EXPECT_FLOAT_EQ(out_p[0][0][0].item<float>(), 4.0f);
  // q·k_r = ln((e + 3 e^2) / 4)
  const double e = std::exp(1.0), e2 = std::exp(2.0);
  EXPECT_NEAR(out_k[0][0][0][0].item<float>(), std::log((e + 3 * e2) / 4), 1e-5);
  EXPECT_NEAR(out_v[0][0][0][0].item<float>(), 10 * (e * 1 + 3 * e2 * 2) / (e + 3 * e2), 1e-4);
  EXPECT_TRUE(at::equal(out_k.narrow(2, 1, 3), keys.narrow(2, 1, 3)));
  const auto bad = targets.clone();
  bad[0][0][3] = 1;
  bad[0][0][2] = 3;  // targets an evicted slot
  EXPECT_THROW(merge.call(keys, keys, votes, logs, bad, false, true), c10::Error);
}

}  // namespace
