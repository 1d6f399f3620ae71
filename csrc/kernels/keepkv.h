// Device-free math of the keepkv family (kvcomp::keepkv_match, kvcomp::keepkv_zip_merge), used by the CPU loops, the
// CUDA kernels and GoogleTest.
//
// KeepKV (methods.md): electoral votes p enter attention as the bias ln p. An evicted slot e merges into the retained
// slot c of highest key cosine similarity (if >= threshold); each retained slot c then stands for the set
// S = {c} ∪ {e : target(e) = c} and becomes, in the log domain (ℓ = ln s, m = max ℓ over S, w_i = p_i exp(ℓ_i - m)):
//   k_r = (Σ w k) · (m + ln(Σ w / Σ p)) / (Σ w ℓ)     ZIP key (paper eq. 7): q·k_r·scale = ln(Σ p s / Σ p) for the
//                                                      query q with ℓ_i = q·k_i·scale, so p_r s_r = Σ p s (theorem 3)
//   k_r = (Σ w k) / (Σ w)                              convex key (the authors' released code; the guard's fallback)
//   v_r = (Σ w v) / (Σ w),  p_r = Σ p.
#pragma once

#include <cmath>
#include <cstdint>

#include "common.h"
#include "gvote.h"    // ascending_logit_order
#include "zsmerge.h"  // SlotChoice, MergesFirst, KeepBetter, kNoSlot

namespace kvcomp::kernels {

// keepkv_match's target codes besides a slot index t >= 0 (merge into retained slot t).
constexpr int64_t kKeepKVRetained = -1;        // the slot itself is retained
constexpr int64_t kKeepKVEvictedNoMerge = -2;  // evicted, no retained slot similar enough (or none retained)

// The guard of the ZIP key: it is used only when |Σ w ℓ| > kZipGuardRelativeEps · Σ w · max|ℓ| (the denominator is
// not a cancellation-dominated near-zero: float32 rounding of Σ w ℓ is ~n·6e-8 of Σ w·max|ℓ|, so this keeps the
// key's scale accurate to ~n·6e-5) and the key's growth over the convex key is within kZipMaxKeyGrowth (below), which
// implies that m + ln(Σ w / Σ p) has the sign of Σ w ℓ (or is 0: a zero key, exact by the theorem). Otherwise the
// convex key is used.
constexpr float kZipGuardRelativeEps = 1e-3f;

// The ZIP key is the convex key times growth = Σ w · (m + ln(Σ w / Σ p)) / Σ w ℓ: exact for the query that produced
// ℓ, but every other query's logit on the merged slot is scaled by about that factor, and repeated merges compound it.
// A denominator that is small next to the numerator (the "near zero" of methods.md) is therefore measured by growth,
// and the guard also falls back to the convex key outside [1 / kZipMaxKeyGrowth, kZipMaxKeyGrowth]. Streaming
// perplexity, SmolLM2, Austen, 1024 tokens, m = 256, recent 0.8 m (full cache 21.48, convex key 22.19): unbounded
// 47.22, bound 4: 22.90, bound 2: 22.54, bound 1.25: 22.13. 2 keeps eq. 7 on the merges it conditions well.
constexpr float kZipMaxKeyGrowth = 2.0f;

KVCOMP_HOST_DEVICE inline bool is_finite(float x) { return !is_nan(x) && x != infinity() && x != -infinity(); }

// 1 / ||k|| from ||k||^2, 0 for a zero key (so its cosine with anything is 0). Used to normalise keys for the GEMM.
KVCOMP_HOST_DEVICE inline float inverse_norm(float norm_sq) { return norm_sq > 0.0f ? 1.0f / sqrtf(norm_sq) : 0.0f; }

// Squared norms in this range were summed without overflow or harmful underflow: every square is at most 2^100
// (d of them cannot reach FLT_MAX ~ 2^128) and a key whose squares sum to >= 2^-100 loses only terms below
// 2^-126, relatively under float32 rounding. Outside it, keys are rescaled by key_rescale first.
KVCOMP_HOST_DEVICE inline bool norm_sq_is_safe(float norm_sq) {
  return norm_sq >= 0x1p-100f && norm_sq <= 0x1p100f;
}

// A power of two 2^-e that brings a key's largest |component| into [0.5, 1) (clamped to the normal range): scaling
// by it is exact and leaves the cosine unchanged, and the squares of the scaled key neither overflow nor underflow.
// 1 for a zero, NaN or infinite maximum (nothing a scale can fix).
KVCOMP_HOST_DEVICE inline float key_rescale(float max_abs) {
  if (!(max_abs > 0.0f) || !is_finite(max_abs)) return 1.0f;
  int exponent = 0;
  frexpf(max_abs, &exponent);
  exponent = exponent > 126 ? 126 : (exponent < -126 ? -126 : exponent);
  return ldexpf(1.0f, -exponent);
}

// The factor a key is multiplied by before its cosines, from ||k||^2 and max |component| as first summed: 1 when
// the squares were in the safe range, else key_rescale. The CPU loops and the CUDA direct path both call it, so
// they rescale the same keys by the same powers of two.
KVCOMP_HOST_DEVICE inline float key_scale(float norm_sq, float max_abs) {
  return norm_sq_is_safe(norm_sq) ? 1.0f : key_rescale(max_abs);
}

// Running max |x| over a key's components; a NaN component is skipped (the key's norm is NaN anyway).
KVCOMP_HOST_DEVICE inline float max_magnitude(float current, float x) {
  const float magnitude = fabsf(x);
  return magnitude > current ? magnitude : current;
}

// Cosines are compared at a resolution of 2^-16: clamped to [-1, 1], then rounded to the nearest multiple of 2^-16.
// Float32 rounding moves a cosine of d-dimensional keys by about sqrt(d)·2^-24 (at most d·2^-24), differently on
// the direct and the GEMM path (and on CUDA); the grid absorbs that wherever it matters by construction: a key
// identical to a retained one has similarity exactly 1 (it merges at threshold 1.0), and retained keys along one
// direction tie exactly (the lower slot wins), on every path. A cosine within that rounding of a grid midpoint can
// still land one step (2^-16) apart on two paths, and so merge on one and not the other when the threshold or a
// second-best cosine is that step away: paths agree exactly except on such near-ties.
constexpr float kCosineResolution = 0x1p-16f;

KVCOMP_HOST_DEVICE inline float rounded_cosine(float cosine) {
  if (is_nan(cosine)) return cosine;
  const float clamped = cosine > 1.0f ? 1.0f : (cosine < -1.0f ? -1.0f : cosine);
  return rintf(clamped / kCosineResolution) * kCosineResolution;
}

// cos(a, b) from a·b, ||a||^2 and ||b||^2 in float32, rounded by rounded_cosine; 0 when either key is zero and the
// other finite, NaN (never a target) when a·b is: a key with a NaN or infinite component is matched with nothing, zero
// keys included, as the GEMM path's normalised rows give it (its NaN would otherwise enter the merged key).
KVCOMP_HOST_DEVICE inline float cosine_similarity(float dot, float norm_sq_a, float norm_sq_b) {
  if (is_nan(dot)) return dot;
  if (norm_sq_a == 0.0f || norm_sq_b == 0.0f) return 0.0f;
  return rounded_cosine(dot / (sqrtf(norm_sq_a) * sqrtf(norm_sq_b)));
}

// The target of an evicted slot from the best retained candidate under MergesFirst (NaN as -inf, ties to the lower
// slot): its slot if the similarity is >= threshold, else kKeepKVEvictedNoMerge (also when nothing is retained or
// the best similarity is NaN).
KVCOMP_HOST_DEVICE inline int64_t match_target(const SlotChoice& best, float threshold) {
  return (best.slot != kNoSlot && best.value >= threshold) ? best.slot : kKeepKVEvictedNoMerge;
}

// keepkv_match's CUDA direct path splits the retained slots over several blocks per evicted slot, which combine their
// best candidates by a 64-bit atomicMax (the maximum of integers: the same whatever the order). A candidate is
// packed into a word that is larger iff it merges first under MergesFirst: the similarity's order
// (gvote::ascending_logit_order: NaN lowest, i.e. MergesFirst's -inf, since a rounded cosine is never -inf itself),
// then the lower slot. 0 is no candidate (MergesFirst::none()). Slots must be < 2^32 - 1.
KVCOMP_HOST_DEVICE inline uint64_t pack_candidate(const SlotChoice& candidate) {
  if (candidate.slot == kNoSlot) return 0;
  return (static_cast<uint64_t>(gvote::ascending_logit_order(candidate.value)) << 32) |
         (0xffffffffu - static_cast<uint32_t>(candidate.slot));
}

// The candidate back (-0 reads as +0, any NaN as a NaN): the same target under match_target.
KVCOMP_HOST_DEVICE inline SlotChoice unpack_candidate(uint64_t packed) {
  if (packed == 0) return MergesFirst::none();
  const uint32_t order = static_cast<uint32_t>(packed >> 32);
  const uint32_t bits = (order & 0x80000000u) ? (order & 0x7fffffffu) : ~order;  // order 0 (NaN) -> 0xffffffff, a NaN
  return {bits_float(bits), static_cast<int64_t>(0xffffffffu - static_cast<uint32_t>(packed))};
}

// Whether a member of a set carries weight: p > 0 and ℓ > -inf (NaN votes or log-scores count as w = 0).
KVCOMP_HOST_DEVICE inline bool zip_contributes(float vote, float log_score) {
  return vote > 0.0f && log_score > -infinity();
}

// w_i = p_i exp(ℓ_i - m), 0 for a member that does not contribute.
KVCOMP_HOST_DEVICE inline float zip_weight(float vote, float log_score, float max_log) {
  return zip_contributes(vote, log_score) ? vote * expf(log_score - max_log) : 0.0f;
}

// The sums of one set S, accumulated in float32 over its members after the first pass found max_log.
struct ZipSums {
  float weight = 0.0f;        // Σ w
  float votes = 0.0f;         // Σ p (all members)
  float weighted_log = 0.0f;  // Σ w ℓ (members with w > 0)
  float max_abs_log = 0.0f;   // max |ℓ| over members with w > 0

  KVCOMP_HOST_DEVICE void add(float vote, float log_score, float max_log) {
    votes += vote;
    const float w = zip_weight(vote, log_score, max_log);
    if (w > 0.0f) {
      weight += w;
      weighted_log += w * log_score;
      const float magnitude = fabsf(log_score);
      max_abs_log = magnitude > max_abs_log ? magnitude : max_abs_log;
    }
  }
};

// The merged row is k_r = key_scale · Σ w k and v_r = value_scale · Σ w v.
struct ZipCoefficients {
  float key_scale;
  float value_scale;
  bool merged;    // false: Σ w is 0 (or NaN): the retained slot keeps its key and value
  bool zip_used;  // the ZIP key passed the guard (false for convex=true and for the fallback)
};

KVCOMP_HOST_DEVICE inline bool zip_guard_passes(float numerator, const ZipSums& sums) {
  const float denominator = sums.weighted_log;
  if (!is_finite(numerator) || !is_finite(denominator)) return false;
  if (!(fabsf(denominator) > kZipGuardRelativeEps * sums.weight * sums.max_abs_log)) return false;
  if (numerator == 0.0f) return true;  // a zero key: exact by the theorem
  const float growth = numerator * sums.weight / denominator;
  return growth >= 1.0f / kZipMaxKeyGrowth && growth <= kZipMaxKeyGrowth;  // also false on a sign mismatch
}

KVCOMP_HOST_DEVICE inline ZipCoefficients zip_coefficients(float max_log, const ZipSums& sums, bool convex) {
  if (!(sums.weight > 0.0f) || !is_finite(sums.weight)) return {1.0f, 1.0f, false, false};
  const float value_scale = 1.0f / sums.weight;
  if (!convex) {
    const float numerator = max_log + logf(sums.weight / sums.votes);  // ln(Σ p s / Σ p) - m + m
    if (zip_guard_passes(numerator, sums)) return {numerator / sums.weighted_log, value_scale, true, true};
  }
  return {value_scale, value_scale, true, false};
}

// Running maximum of ℓ over the contributing members (the shift m of the log domain); -inf when none contributes.
KVCOMP_HOST_DEVICE inline float zip_max_log(float current, float vote, float log_score) {
  return (zip_contributes(vote, log_score) && log_score > current) ? log_score : current;
}

// ---------------------------------------------------------------------------------------------------------------
// keepkv_decode_step: the bias correction of the EMA score estimate (eq. 8: ln ŝ = ln S - ln(1 - β^age)) and the
// eviction ranking.

// ln(1 - e^x) for x <= 0, accurate at both ends (-inf at x = 0).
KVCOMP_HOST_DEVICE inline float log_one_minus_exp(float x) {
  return x > -0.69314718f ? logf(-expm1f(x)) : log1pf(-expf(x));
}

// The key a slot is evicted by (lowest first): ln ŝ, NaN as -inf; -inf for a slot without votes (merged away); +inf
// for a sink or a slot of the recent window (never evicted).
KVCOMP_HOST_DEVICE inline float keepkv_eviction_key(float log_estimate, float vote, bool is_protected) {
  if (is_protected) return infinity();
  if (vote <= 0.0f || is_nan(log_estimate)) return -infinity();
  return log_estimate;
}

// ln(e^a + e^b) for one pair, as the CPU kernel's vectorised fold takes it lane by lane: NaN if either is NaN, -inf
// for two -inf, NaN for two +inf (inf - inf); the fused CUDA step folds its queries with it.
KVCOMP_HOST_DEVICE inline float log_add_exp(float a, float b) {
  if (is_nan(a) || is_nan(b)) return a + b;
  const float high = a > b ? a : b, low = a > b ? b : a;
  return high == -infinity() ? high : high + log1pf(expf(low - high));
}

// The slots one decoding step evicts from a row (the fused CUDA step: at most 8, ascending) and where each retained
// slot lands when the row is packed: t minus the evicted slots below it, so the retained slots keep their order and
// no slot moves up (a packing that reads a tile whole before writing it never overwrites a slot it has yet to read).
struct EvictedSlots {
  const int64_t* slots;  // ascending
  int count;

  KVCOMP_HOST_DEVICE bool contains(int64_t t) const {
    for (int k = 0; k < count; ++k) {
      if (slots[k] == t) return true;
    }
    return false;
  }
  KVCOMP_HOST_DEVICE int64_t packed_position(int64_t t) const {
    int64_t below = 0;
    for (int k = 0; k < count; ++k) below += slots[k] < t;
    return t - below;
  }
};

}  // namespace kvcomp::kernels
