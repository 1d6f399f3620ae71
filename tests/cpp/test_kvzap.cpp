// GoogleTest of the kvzap family: the device-free pieces (exact GELU, the decision window, the keep rule with its
// NaN and boundary cases, a paged row's decoding pass) against hand computations, and the registered CPU kernels
// through the dispatcher.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "kernels/kvzap.h"

namespace {

namespace z = kvcomp::kernels::kvzap;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(KVzapGelu, KnownValues) {
  // Φ(1) = 0.8413447460685429, so GELU(1) = Φ(1) and GELU(-1) = -(1 - Φ(1)).
  EXPECT_FLOAT_EQ(z::gelu(1.0f), 0.84134474606854293f);
  EXPECT_FLOAT_EQ(z::gelu(-1.0f), -0.15865525393145707f);
  EXPECT_FLOAT_EQ(z::gelu(2.0f), 2.0f * 0.97724986805182079f);
  EXPECT_EQ(z::gelu(0.0f), 0.0f);
  EXPECT_FLOAT_EQ(z::gelu(10.0f), 10.0f);  // Φ ≈ 1
  EXPECT_NEAR(z::gelu(-10.0f), 0.0f, 1e-20f);  // Φ ≈ 0
  EXPECT_TRUE(std::isnan(z::gelu(kNaN)));
}

TEST(KVzapGelu, IsTheErfFormNotTheTanhApproximation) {
  for (float x = -5.0f; x <= 5.0f; x += 0.25f) {
    const double exact = 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    EXPECT_NEAR(z::gelu(x), exact, 1e-6) << x;
  }
  // The tanh approximation differs by ~1e-4 around |x| = 2; the exact form does not.
  const float x = 2.0f;
  const double tanh_form = 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
  EXPECT_GT(std::abs(z::gelu(x) - tanh_form), 1e-5);
}

TEST(KVzapDecisionRange, SlidesWithTheWindow) {
  auto range = z::decision_range(0, 300, 128);  // prefill of 300 tokens: 0..171 leave the window
  EXPECT_EQ(range.begin, 0);
  EXPECT_EQ(range.end, 172);
  range = z::decision_range(300, 301, 128);  // one decoding step: position 172 leaves
  EXPECT_EQ(range.begin, 172);
  EXPECT_EQ(range.end, 173);
  range = z::decision_range(0, 100, 128);  // short prompt: nothing leaves
  EXPECT_EQ(range.begin, 0);
  EXPECT_EQ(range.end, 0);
  range = z::decision_range(120, 140, 128);  // the window fills up mid-pass
  EXPECT_EQ(range.begin, 0);
  EXPECT_EQ(range.end, 12);
  range = z::decision_range(5, 9, 0);  // no window: every new token is decided at once
  EXPECT_EQ(range.begin, 5);
  EXPECT_EQ(range.end, 9);
}

TEST(KVzapKeepRule, EvictsOnlyDecidedTokensBelowTheThreshold) {
  const z::DecisionRange range{10, 20};
  EXPECT_TRUE(z::evicted_now(-5.0f, 10, range, -4.0f));
  EXPECT_TRUE(z::evicted_now(-5.0f, 19, range, -4.0f));
  EXPECT_FALSE(z::evicted_now(-5.0f, 9, range, -4.0f));  // decided earlier
  EXPECT_FALSE(z::evicted_now(-5.0f, 20, range, -4.0f));  // still in the window
  EXPECT_FALSE(z::evicted_now(-4.0f, 15, range, -4.0f));  // score == τ is kept
  EXPECT_FALSE(z::evicted_now(kNaN, 15, range, -4.0f));  // NaN is kept (kvpress's `scores < threshold`)
  EXPECT_TRUE(z::evicted_now(-kInf, 15, range, -4.0f));
  EXPECT_FALSE(z::evicted_now(-1e30f, 15, range, -kInf));  // τ = -inf keeps everything
  EXPECT_TRUE(z::evicted_now(1e30f, 15, range, kInf));  // τ = +inf evicts every decided token
}

TEST(KVzapKeepRule, LogWeightsAndHeldSlots) {
  const z::DecisionRange range{0, 5};
  EXPECT_EQ(z::thresholded_log_weight(0.0f, -9.0f, 3, range, -4.0f), -kInf);
  EXPECT_EQ(z::thresholded_log_weight(0.0f, -1.0f, 3, range, -4.0f), 0.0f);
  EXPECT_EQ(z::thresholded_log_weight(-kInf, 9.0f, 3, range, -4.0f), -kInf);  // an eviction stands
  EXPECT_EQ(z::thresholded_log_weight(0.7f, -9.0f, 8, range, -4.0f), 0.7f);  // window: untouched
  EXPECT_TRUE(z::is_held(0.0f));
  EXPECT_TRUE(z::is_held(-1e30f));
  EXPECT_FALSE(z::is_held(-kInf));
}

// A row of 7 slots in blocks of 2: slot t lives in block table[t / 2] = {3, 0, 2, 1}, pool index 2 * block + t % 2.
struct PagedRowFixture {
  int64_t table[4] = {3, 0, 2, 1};
  float log_weights[8] = {};
  float scores[8] = {};
  int64_t positions[8] = {};
  z::PagedRow row{table, 2, 7};
  int64_t pool(int64_t slot) const { return row.pool_slot(slot); }
};

TEST(KVzapPagedStep, PoolSlotsFollowTheBlockTable) {
  PagedRowFixture f;
  const int64_t expected[7] = {6, 7, 0, 1, 4, 5, 2};
  for (int64_t slot = 0; slot < 7; ++slot) EXPECT_EQ(f.pool(slot), expected[slot]) << slot;
}

TEST(KVzapPagedStep, WritesTheNewTokenAndDecidesTheOneLeavingTheWindow) {
  // Window 3: before the step the row held positions 0, 2, 5 (decided earlier, 1, 3, 4 evicted) then 6, 7, 8 (the
  // window); the new token 9 makes 6 leave it. Its slot is 7 - 3 - 1 = 3.
  PagedRowFixture f;
  const int64_t held_positions[6] = {0, 2, 5, 6, 7, 8};
  const float held_scores[6] = {1.0f, 1.0f, 1.0f, -9.0f, 1.0f, 1.0f};
  for (int64_t slot = 0; slot < 6; ++slot) {
    f.positions[f.pool(slot)] = held_positions[slot];
    f.scores[f.pool(slot)] = held_scores[slot];
  }
  const float new_score = 0.5f;
  EXPECT_EQ(z::paged_step_row(f.log_weights, f.scores, f.positions, f.row, &new_score, 1, 9, 3, -4.0f), 0);
  EXPECT_EQ(f.positions[f.pool(6)], 9);
  EXPECT_EQ(f.scores[f.pool(6)], 0.5f);
  EXPECT_EQ(f.log_weights[f.pool(3)], -kInf);  // score -9 < τ = -4
  for (int64_t slot : {0, 1, 2, 4, 5, 6}) EXPECT_EQ(f.log_weights[f.pool(slot)], 0.0f) << slot;
  // Another step: 7 (score 1) leaves the window and is held; the row is one slot longer.
  f.row.length = 8;
  const float next_score = -9.0f;
  EXPECT_EQ(z::paged_step_row(f.log_weights, f.scores, f.positions, f.row, &next_score, 1, 10, 3, -4.0f), 1);
  EXPECT_EQ(f.log_weights[f.pool(4)], 0.0f);
  EXPECT_EQ(f.positions[f.pool(7)], 10);
}

TEST(KVzapPagedStep, LeavesARowWhoseSlotsAreNotWhereDecodingPutsThemUntouched) {
  PagedRowFixture f;
  const int64_t held_positions[6] = {0, 2, 5, 7, 6, 8};  // 6 and 7 swapped: not the row decoding made
  for (int64_t slot = 0; slot < 6; ++slot) {
    f.positions[f.pool(slot)] = held_positions[slot];
    f.scores[f.pool(slot)] = -9.0f;
  }
  const float new_score = -9.0f;
  EXPECT_EQ(z::paged_step_row(f.log_weights, f.scores, f.positions, f.row, &new_score, 1, 9, 3, -4.0f), -1);
  for (float log_weight : f.log_weights) EXPECT_EQ(log_weight, 0.0f);
  EXPECT_EQ(f.positions[f.pool(6)], 9);  // the new token is written all the same
  // A row shorter than the window and the tokens leaving it (its first tokens were padding) is left alone too.
  f.row.length = 3;
  EXPECT_EQ(z::paged_step_row(f.log_weights, f.scores, f.positions, f.row, &new_score, 1, 9, 3, -4.0f), -1);
}

TEST(KVzapPagedStep, NothingIsDecidedBeforeTheWindowFills) {
  PagedRowFixture f;
  f.row.length = 2;
  const float new_scores[2] = {-9.0f, -9.0f};
  EXPECT_EQ(z::paged_step_row(f.log_weights, f.scores, f.positions, f.row, new_scores, 2, 0, 3, -4.0f), 0);
  EXPECT_EQ(f.positions[f.pool(1)], 1);
  for (float log_weight : f.log_weights) EXPECT_EQ(log_weight, 0.0f);
}

TEST(KVzapPagedStep, WithoutAWindowTheNewTokensAreDecidedAtOnce) {
  // Window 0: the two new tokens (positions 4, 5) are the tokens leaving the window, in the slots just written.
  PagedRowFixture f;
  f.row.length = 6;
  for (int64_t slot = 0; slot < 4; ++slot) f.positions[f.pool(slot)] = slot;
  const float new_scores[2] = {-9.0f, 9.0f};
  EXPECT_EQ(z::paged_step_row(f.log_weights, f.scores, f.positions, f.row, new_scores, 2, 4, 0, -4.0f), 1);
  EXPECT_EQ(f.log_weights[f.pool(4)], -kInf);
  EXPECT_EQ(f.log_weights[f.pool(5)], 0.0f);
}

TEST(KVzapPagedStep, FirstSlotTouchedIsTheFirstDecidedOrElseTheFirstNewToken) {
  // The fixtures above: window 3, one new token 9 over 7 slots decides slot 7 - 3 - 1 = 3.
  EXPECT_EQ(z::first_slot_touched(7, 1, 9, 3), 3);
  // Nothing decided before the window fills: only the two new tokens' slots.
  EXPECT_EQ(z::first_slot_touched(2, 2, 0, 3), 0);
  EXPECT_EQ(z::first_slot_touched(5, 2, 0, 3), 3);
  // Window 0: the new tokens are the ones decided.
  EXPECT_EQ(z::first_slot_touched(6, 2, 4, 0), 4);
  // A row too short to hold the tokens leaving the window (padding before it): only the new token is written.
  EXPECT_EQ(z::first_slot_touched(3, 1, 9, 3), 2);
}

// first_slot_touched bounds the block-table entries the CUDA step checks before it runs: it must be the lowest slot
// paged_step_row touches. Those slots, listed here from the keep rule itself: the q new tokens' (length - q ..
// length - 1), and, where the D tokens that leave the window in this pass fit in the row (length - window - D >= 0),
// theirs (length - window - D .. length - window - 1). Position p leaves the window in the pass before -> before + q
// iff before <= p + window < before + q.
TEST(KVzapPagedStep, FirstSlotTouchedIsTheLowestSlotTheStepTouches) {
  for (int64_t window = 0; window <= 5; ++window) {
    for (int64_t q = 1; q <= 3; ++q) {
      for (int64_t before = 0; before <= 10; ++before) {
        int64_t leaving = 0;
        for (int64_t p = 0; p < before + q; ++p) leaving += before <= p + window && p + window < before + q;
        for (int64_t length = q; length <= 12; ++length) {
          int64_t lowest = length - q;
          if (leaving > 0 && length - window - leaving >= 0) lowest = std::min(lowest, length - window - leaving);
          EXPECT_EQ(z::first_slot_touched(length, q, before, window), lowest)
              << "length " << length << " q " << q << " before " << before << " window " << window;
        }
      }
    }
  }
  // The first slot itself decided: window 3, token 0 leaves at the pass 3 -> 4 from slot 4 - 3 - 1 = 0.
  EXPECT_EQ(z::first_slot_touched(4, 1, 3, 3), 0);
}

TEST(KVzapDecodeStep, GrowsEachRowAndDecidesTheTokenLeavingTheWindow) {
  // Two rows of T = 3 state slots (positions 4, 6, 7: 5 evicted earlier and compacted away) and q = 2 new tokens
  // 8, 9 with window 2: the pass 8 -> 10 decides positions 6 and 7. Row 0 scores 6 below τ, row 1 scores 7 below it.
  const float log_weights[2][5] = {{0, 0, 0, 0, 0}, {-kInf, 0, 0, 0, 0}};
  const float scores[2][3] = {{1, -9, 1}, {1, 1, -9}};
  const int64_t positions[2][3] = {{4, 6, 7}, {4, 6, 7}};
  const float new_scores[2][2] = {{-9, 2}, {3, -9}};  // in the window: kept whatever their scores
  float log_weights_out[2][5], scores_out[2][5];
  int64_t positions_out[2][5];
  const z::GrowingRows rows{&log_weights[0][0], &scores[0][0],      &positions[0][0],     &new_scores[0][0], 2,
                            &log_weights_out[0][0], &scores_out[0][0], &positions_out[0][0], 3, 2, 8};
  const z::DecisionRange range = z::decision_range(8, 10, 2);
  const bool expected_held[2][5] = {{true, false, true, true, true}, {false, true, false, true, true}};
  const float expected_scores[2][5] = {{1, -9, 1, -9, 2}, {1, 1, -9, 3, -9}};
  for (int64_t row = 0; row < 2; ++row) {
    for (int64_t t = 0; t < 5; ++t) {
      EXPECT_EQ(z::grow_and_decide_slot(rows, row, t, range, -4.0f), expected_held[row][t]) << row << " " << t;
      EXPECT_EQ(positions_out[row][t], t < 3 ? positions[row][t] : 8 + (t - 3));
      EXPECT_EQ(scores_out[row][t], expected_scores[row][t]);
      EXPECT_EQ(log_weights_out[row][t], expected_held[row][t] ? 0.0f : -kInf);
    }
  }
}
TEST(KVzapDecodeStep, NewScoresMayAliasTheirSlotsOfTheOutput) {
  // The CUDA surrogate writes the new tokens' scores into scores_out first: new_scores = scores_out + T, stride T + q.
  const float log_weights[3] = {0, 0, 0};
  const float scores[2] = {-9, 1};
  const int64_t positions[2] = {0, 1};
  float log_weights_out[3], scores_out[3] = {0, 0, -7};
  int64_t positions_out[3];
  const z::GrowingRows rows{log_weights, scores, positions, scores_out + 2, 3, log_weights_out, scores_out,
                            positions_out, 2, 1, 2};
  const z::DecisionRange range = z::decision_range(2, 3, 0);  // window 0: the new token is decided at once
  EXPECT_TRUE(z::grow_and_decide_slot(rows, 0, 0, range, -4.0f));  // position 0 was decided before this pass
  EXPECT_TRUE(z::grow_and_decide_slot(rows, 0, 1, range, -4.0f));
  EXPECT_FALSE(z::grow_and_decide_slot(rows, 0, 2, range, -4.0f));
  EXPECT_EQ(scores_out[2], -7.0f);
  EXPECT_EQ(positions_out[2], 2);
}
TEST(KVzapOps, ThresholdThroughTheDispatcher) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvcomp::kvzap_threshold", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                        const at::Tensor&, double, int64_t, int64_t,
                                                                        int64_t)>();
  const at::Tensor log_weights = at::zeros({1, 2, 4});
  const at::Tensor scores = at::tensor({-5.0f, -3.0f, -5.0f, -5.0f, -3.0f, -5.0f, -3.0f, -5.0f}).view({1, 2, 4});
  const at::Tensor positions = at::arange(4, at::kLong).view({1, 1, 4}).expand({1, 2, 4});
  const auto [out, held] = op.call(log_weights, scores, positions, -4.0, 1, 0, 4);  // positions 0..2 decided
  EXPECT_EQ(held[0][0].item<int64_t>(), 2);  // evicts 0 and 2
  EXPECT_EQ(held[0][1].item<int64_t>(), 3);  // evicts 1
  EXPECT_EQ(out[0][0][0].item<float>(), -kInf);
  EXPECT_EQ(out[0][0][3].item<float>(), 0.0f);  // the window
  EXPECT_EQ(out[0][1][1].item<float>(), -kInf);
}

TEST(KVzapOps, ScoreThroughTheDispatcher) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvcomp::kvzap_score", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  const at::Tensor hidden = at::randn({2, 7, 16});
  const at::Tensor w1 = at::randn({4, 16}), b1 = at::randn({4}), w2 = at::randn({3, 4}), b2 = at::randn({3});
  const at::Tensor expected = at::linear(at::gelu(at::linear(hidden, w1, b1)), w2, b2).transpose(1, 2);
  const at::Tensor got = op.call(hidden, w1, b1, w2, b2);
  ASSERT_EQ(got.sizes(), expected.sizes());
  EXPECT_TRUE(at::allclose(got, expected, 1e-5, 1e-5));
  const at::Tensor linear = op.call(hidden, w1, b1, std::nullopt, std::nullopt);
  EXPECT_TRUE(at::allclose(linear, at::linear(hidden, w1, b1).transpose(1, 2), 1e-5, 1e-5));
}

TEST(KVzapOps, DecodeStepThroughTheDispatcher) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvcomp::kvzap_decode_step", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
              const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
              int64_t)>();
  const at::Tensor hidden = at::randn({2, 1, 16}), w1 = at::randn({3, 16}), b1 = at::randn({3});
  const at::Tensor scores = at::randn({2, 3, 4}), positions = at::arange(4).expand({2, 3, 4}).contiguous();
  const auto [log_weights, grown_scores, grown_positions, held] =
      op.call(hidden, w1, b1, std::nullopt, std::nullopt, at::zeros({2, 3, 5}), scores, positions, 0.0, 4, 4);
  const at::Tensor new_scores = at::linear(hidden, w1, b1).transpose(1, 2);
  EXPECT_TRUE(at::equal(grown_scores.slice(2, 0, 4), scores));
  EXPECT_TRUE(at::allclose(grown_scores.slice(2, 4), new_scores, 1e-5, 1e-5));
  EXPECT_TRUE(at::equal(grown_positions.slice(2, 4), at::full({2, 3, 1}, 4, positions.options())));
  // Window 4, pass 4 -> 5: position 0 leaves the window.
  const at::Tensor evicted = scores.slice(2, 0, 1) < 0;
  EXPECT_TRUE(at::equal(log_weights.slice(2, 0, 1) == -kInf, evicted));
  EXPECT_TRUE(at::equal(held, 5 - evicted.squeeze(2).to(at::kLong)));
}

}  // namespace
