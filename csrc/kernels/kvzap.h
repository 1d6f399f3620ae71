// Device-free math of the kvzap family (kvcomp::kvzap_score, kvzap_threshold, kvzap_decode_step, kvzap_paged_step),
// used by the CPU
// loops, the CUDA kernels and GoogleTest.
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

// ---------------------------------------------------------------------------------------------------------------
// kvzap_decode_step: a decoding pass on a rectangular cache. Each (batch, kv head) row grows from the T slots whose
// scores and positions the state holds by the pass's q new tokens (their scores from the surrogate, their positions
// tokens_before .. tokens_before + q - 1), and the keep rule runs over the grown row, as kvzap_threshold over the
// concatenation would.

struct GrowingRows {
  const float* log_weights;  // [rows, T + q]: the new tokens' last, as the attention read them
  const float* scores;       // [rows, T], the state's
  const int64_t* positions;  // [rows, T], the state's
  const float* new_scores;   // row r's q new scores from r * new_scores_stride
  int64_t new_scores_stride;
  float* log_weights_out;    // [rows, T + q]
  float* scores_out;         // [rows, T + q]
  int64_t* positions_out;    // [rows, T + q]
  int64_t slots_before, new_tokens, tokens_before;
  KVCOMP_HOST_DEVICE int64_t slots_after() const { return slots_before + new_tokens; }
};

// Writes slot t of row `row` of the grown state and returns whether it is held. new_scores may alias scores_out's new
// slots (the CUDA surrogate writes there first, with new_scores_stride = T + q): slot t reads and writes only its own.
KVCOMP_HOST_DEVICE inline bool grow_and_decide_slot(const GrowingRows& rows, int64_t row, int64_t t,
                                                    DecisionRange range, float threshold) {
  const int64_t slot = row * rows.slots_after() + t;
  const bool in_state = t < rows.slots_before;
  const float score = in_state ? rows.scores[row * rows.slots_before + t]
                               : rows.new_scores[row * rows.new_scores_stride + (t - rows.slots_before)];
  const int64_t position = in_state ? rows.positions[row * rows.slots_before + t]
                                    : rows.tokens_before + (t - rows.slots_before);
  rows.scores_out[slot] = score;
  rows.positions_out[slot] = position;
  rows.log_weights_out[slot] = thresholded_log_weight(rows.log_weights[slot], score, position, range, threshold);
  return is_held(rows.log_weights_out[slot]);
}

// ---------------------------------------------------------------------------------------------------------------
// kvzap_paged_step: one decoding pass of one (batch, kv head) row of a paged cache, in its per-slot pools (N, S) read
// through the row's block table. Every token is decided when it leaves the window, so after a pass that took the
// cache from `before` to `before + q` tokens each row ends with its undecided tokens in position order: the D tokens
// decided now, then the window. They are the row's slots length - window - D .. length - window - 1 exactly when the
// positions stored there say so; a row where they do not (its first tokens padding, a cache cut back) is left to
// kvzap_threshold over its whole view.

struct PagedRow {
  const int64_t* table;  // the row's block table
  int64_t block_size, length;
  // Index into the pools viewed as (N * S) of the row's slot `slot` (0 <= slot < length).
  KVCOMP_HOST_DEVICE int64_t pool_slot(int64_t slot) const { return kernels::pool_slot(table, slot, block_size); }
};

// The first of the row's slots paged_step_row touches (it touches every slot from there to the row's last): the q new
// tokens', and the D leaving the window's from length - window - D on. Requires length >= q.
KVCOMP_HOST_DEVICE inline int64_t first_slot_touched(int64_t length, int64_t new_tokens, int64_t tokens_before,
                                                     int64_t window) {
  const DecisionRange range = decision_range(tokens_before, tokens_before + new_tokens, window);
  const int64_t deciding = length - window - (range.end - range.begin);  // <= length - q whenever a token is decided
  return range.end > range.begin && deciding >= 0 ? deciding : length - new_tokens;
}

// Writes the q new tokens' positions and scores into their slots (the row's last q), then, if the slots of the D
// tokens leaving the window hold them in order, applies the keep rule to those slots. Returns how many of them are
// held, or -1 (log-weights untouched) when they are not where the rule expects them. Requires length >= q.
KVCOMP_HOST_DEVICE inline int64_t paged_step_row(float* log_weights, float* scores, int64_t* positions, PagedRow row,
                                                 const float* new_scores, int64_t new_tokens, int64_t tokens_before,
                                                 int64_t window, float threshold) {
  for (int64_t i = 0; i < new_tokens; ++i) {
    const int64_t slot = row.pool_slot(row.length - new_tokens + i);
    positions[slot] = tokens_before + i;
    scores[slot] = new_scores[i];
  }
  const DecisionRange range = decision_range(tokens_before, tokens_before + new_tokens, window);
  const int64_t decided = range.end - range.begin, first_slot = row.length - window - decided;
  if (decided == 0) return 0;
  if (first_slot < 0) return -1;
  for (int64_t j = 0; j < decided; ++j) {
    if (positions[row.pool_slot(first_slot + j)] != range.begin + j) return -1;
  }
  int64_t held = 0;
  for (int64_t j = 0; j < decided; ++j) {
    const int64_t slot = row.pool_slot(first_slot + j);
    log_weights[slot] = thresholded_log_weight(log_weights[slot], scores[slot], range.begin + j, range, threshold);
    held += is_held(log_weights[slot]);
  }
  return held;
}

}  // namespace kvcomp::kernels::kvzap
