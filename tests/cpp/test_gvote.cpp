// GoogleTest of the gvote family: the device-free pieces (nucleus count of a sorted row, rotate_half's index mapping,
// the top-k selection order with its ties and NaN) against hand computations, and the registered CPU kernels through
// the dispatcher.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/gvote.h"

namespace {

namespace g = kvcomp::kernels::gvote;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(NucleusMass, NaNAndNegativesCountAsZero) {
  EXPECT_EQ(g::nucleus_mass(0.25f), 0.25f);
  EXPECT_EQ(g::nucleus_mass(kNaN), 0.0f);
  EXPECT_EQ(g::nucleus_mass(-kNaN), 0.0f);
  EXPECT_EQ(g::nucleus_mass(-1.0f), 0.0f);
  EXPECT_FALSE(std::signbit(g::nucleus_mass(-0.0f)));
  EXPECT_EQ(g::nucleus_mass(kInf), kInf);
}

TEST(NucleusCount, SmallSortedRows) {
  const std::vector<float> row = {0.5f, 0.3f, 0.1f, 0.1f, 0.0f};
  // The float masses sum to slightly more than 1 (0.1f > 0.1), so p = 0.5 would need a second slot: use p off the
  // boundaries.
  EXPECT_EQ(g::nucleus_count_sorted(row.data(), 5, 0.45), 1);
  EXPECT_EQ(g::nucleus_count_sorted(row.data(), 5, 0.5), 2);
  EXPECT_EQ(g::nucleus_count_sorted(row.data(), 5, 0.6), 2);
  EXPECT_EQ(g::nucleus_count_sorted(row.data(), 5, 0.85), 3);
  EXPECT_EQ(g::nucleus_count_sorted(row.data(), 5, 0.95), 4);
  EXPECT_EQ(g::nucleus_count_sorted(row.data(), 5, 1.0), 4);  // the support, never the zero
  EXPECT_EQ(g::nucleus_count_sorted(row.data(), 1, 0.3), 1);
  EXPECT_EQ(g::nucleus_count_sorted(row.data(), 0, 0.5), 0);
}

// The CUDA kernels count in pieces and apply nucleus_from_counts: on the same double running sums it gives
// nucleus_count_sorted's answer.
TEST(NucleusCount, FromCountsAgreesWithTheSortedRowRule) {
  std::mt19937 generator(11);
  std::exponential_distribution<float> mass(1.0f);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<float> row(1 + trial % 40);
    for (float& m : row) m = trial % 7 == 0 ? 0.0f : std::floor(mass(generator) * 4.0f) / 4.0f;  // ties and zeros
    std::sort(row.begin(), row.end(), std::greater<float>());
    double total = 0.0;
    for (const float m : row) total += m;
    for (const double p : {0.1, 0.5, 0.9, 0.99, 1.0}) {
      int64_t below = 0, positive = 0;
      double running = 0.0;
      for (const float m : row) {
        running += m;
        if (m > 0.0f) {
          ++positive;
          below += running < p * total;
        }
      }
      const int64_t len = static_cast<int64_t>(row.size());
      EXPECT_EQ(g::nucleus_from_counts(below, positive, p), g::nucleus_count_sorted(row.data(), len, p))
          << "trial " << trial << " p " << p;
    }
  }
}

TEST(NucleusCount, RelativeToTheRowSumAndDegenerateRows) {
  const std::vector<float> scaled = {5.0f, 3.0f, 1.0f, 1.0f};  // the row above times 10
  EXPECT_EQ(g::nucleus_count_sorted(scaled.data(), 4, 0.6), 2);
  EXPECT_EQ(g::nucleus_count_sorted(scaled.data(), 4, 0.85), 3);
  const std::vector<float> zeros = {0.0f, 0.0f, 0.0f};
  EXPECT_EQ(g::nucleus_count_sorted(zeros.data(), 3, 0.9), 1);
  const std::vector<float> infinite = {kInf, 1.0f, 0.5f};
  EXPECT_EQ(g::nucleus_count_sorted(infinite.data(), 3, 0.9), 1);
  EXPECT_EQ(g::nucleus_count_sorted(infinite.data(), 3, 1.0), 3);
  // A tail too small to change the double sum: p = 1 still keeps it (exact support), p < 1 does not need it.
  const std::vector<float> tail = {1.0f, 1e-30f, 1e-30f};
  EXPECT_EQ(g::nucleus_count_sorted(tail.data(), 3, 1.0), 3);
  EXPECT_EQ(g::nucleus_count_sorted(tail.data(), 3, 0.999999), 1);
}

TEST(NucleusCount, MonotoneInP) {
  std::vector<float> row(200);
  for (size_t i = 0; i < row.size(); ++i) row[i] = std::exp(-0.05f * static_cast<float>(i));
  int64_t previous = 1;
  for (int step = 1; step <= 100; ++step) {
    const int64_t count = g::nucleus_count_sorted(row.data(), 200, step / 100.0);
    EXPECT_GE(count, previous) << step;
    previous = count;
  }
  EXPECT_EQ(previous, 200);
}

TEST(RotateHalf, IndexMappingIsTransformers) {
  // rotate_half([x0, x1, x2, x3, x4, x5]) = [-x3, -x4, -x5, x0, x1, x2]
  const int64_t dim = 6;
  const std::vector<int64_t> sources = {3, 4, 5, 0, 1, 2};
  const std::vector<float> signs = {-1.0f, -1.0f, -1.0f, 1.0f, 1.0f, 1.0f};
  for (int64_t c = 0; c < dim; ++c) {
    const auto source = g::rotate_half_source(c, dim);
    EXPECT_EQ(source.index, sources[c]) << c;
    EXPECT_EQ(source.sign, signs[c]) << c;
  }
  // Applied twice it is -identity.
  for (int64_t c = 0; c < 64; ++c) {
    const auto once = g::rotate_half_source(c, 64);
    const auto twice = g::rotate_half_source(once.index, 64);
    EXPECT_EQ(twice.index, c);
    EXPECT_EQ(once.sign * twice.sign, -1.0f);
  }
}

TEST(AveragedRope, OneChannelByHand) {
  // cos = 1, sin = 0 is the identity; cos = 0, sin = 1 is rotate_half.
  EXPECT_EQ(g::averaged_rope_channel(2.0f, 5.0f, -1.0f, 1.0f, 0.0f), 2.0f);
  EXPECT_EQ(g::averaged_rope_channel(2.0f, 5.0f, -1.0f, 0.0f, 1.0f), -5.0f);
  EXPECT_FLOAT_EQ(g::averaged_rope_channel(2.0f, 5.0f, 1.0f, 0.5f, 0.25f), 1.0f + 1.25f);
}

TEST(SelectionKey, LargerLogitFirstTiesToLowerSlotNaNLast) {
  const std::vector<float> descending = {kInf, 3e38f, 2.0f, 1e-40f, 0.0f, -1e-40f, -1.0f, -3e38f, -kInf, kNaN};
  for (size_t i = 0; i + 1 < descending.size(); ++i)
    EXPECT_LT(g::selection_key(descending[i], 7), g::selection_key(descending[i + 1], 0))
        << descending[i] << " before " << descending[i + 1];
  EXPECT_LT(g::selection_key(1.5f, 3), g::selection_key(1.5f, 4));  // ties: the lower slot first
  EXPECT_LT(g::selection_key(-0.0f, 2), g::selection_key(0.0f, 5));  // -0 ties with +0
  EXPECT_LT(g::selection_key(0.0f, 2), g::selection_key(-0.0f, 5));
  EXPECT_EQ(g::selection_key(kNaN, 1), g::selection_key(-kNaN, 1));  // any NaN is the same lowest logit
  EXPECT_EQ(g::selection_key(2.0f, 123456) & 0xffffffffu, 123456u);  // the slot reads back
}

TEST(SelectionKey, KthSmallestKeyKeepsExactlyK) {
  const std::vector<float> logits = {1.0f, kNaN, 3.0f, 1.0f, -kInf, 3.0f, 0.5f, 1.0f};
  for (int64_t k = 0; k <= 8; ++k) {
    std::vector<uint64_t> keys(8);
    for (uint32_t s = 0; s < 8; ++s) keys[s] = g::selection_key(logits[s], s);
    std::vector<uint64_t> sorted = keys;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int> kept;
    for (uint32_t s = 0; s < 8 && k > 0; ++s)
      if (keys[s] <= sorted[k - 1]) kept.push_back(static_cast<int>(s));
    EXPECT_EQ(static_cast<int64_t>(kept.size()), k);
    // order: 3 (2), 3 (5), 1 (0), 1 (3), 1 (7), 0.5 (6), -inf (4), NaN (1)
    const std::vector<int> order = {2, 5, 0, 3, 7, 6, 4, 1};
    std::vector<int> expected(order.begin(), order.begin() + k);
    std::sort(expected.begin(), expected.end());
    EXPECT_EQ(kept, expected) << k;
  }
  EXPECT_EQ(g::clamp_budget(-3, 10), 0);
  EXPECT_EQ(g::clamp_budget(4, 10), 4);
  EXPECT_EQ(g::clamp_budget(int64_t{1} << 62, 10), 10);
}

// ---------------------------------------------------------------------------------------------------------------
// Through the dispatcher.

TEST(GVoteOps, CpuKernelsAreRegistered) {
  for (const char* name : {"kvcomp::nucleus_budget", "kvcomp::averaged_rope", "kvcomp::gvote_union_mask"}) {
    const auto op = c10::Dispatcher::singleton().findOp({name, ""});
    ASSERT_TRUE(op.has_value()) << name;
    EXPECT_TRUE(op->hasKernelForDispatchKey(c10::DispatchKey::CPU)) << name;
  }
}

TEST(GVoteOps, BudgetThenUnionMaskThroughTheDispatcher) {
  static const auto budget_op = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("kvcomp::nucleus_budget", "")
                                    .typed<at::Tensor(const at::Tensor&, double)>();
  static const auto mask_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvcomp::gvote_union_mask", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double, int64_t)>();
  const at::Tensor probs = at::tensor({0.5f, 0.3f, 0.1f, 0.1f, 0.0f, 0.2f, 0.2f, 0.2f, 0.2f, 0.2f}).view({1, 2, 5});
  const at::Tensor budgets = budget_op.call(probs, 0.55);
  EXPECT_EQ(budgets.scalar_type(), at::kLong);
  EXPECT_EQ(budgets[0][0].item<int64_t>(), 2);
  EXPECT_EQ(budgets[0][1].item<int64_t>(), 3);

  // One kv head, two query heads, one sample each; keys e_t scaled so that logit(t) = q_t.
  const at::Tensor keys = at::eye(5).view({1, 1, 5, 5});
  const at::Tensor queries =
      at::tensor({0.0f, 1.0f, 5.0f, 2.0f, 3.0f, 9.0f, 0.0f, 0.0f, 0.0f, 8.0f}).view({1, 2, 1, 5});
  // head 0 keeps its top 2: slots 2 and 4; head 1 its top 3: slots 0, 4, then the tie at 0 goes to slot 1.
  const at::Tensor mask = mask_op.call(keys, queries, budgets, 0, 1.0, 1);
  const std::vector<bool> expected = {true, true, true, false, true};
  for (int64_t t = 0; t < 5; ++t) EXPECT_EQ(mask[0][0][t].item<bool>(), expected[t]) << t;
  EXPECT_THROW(mask_op.call(keys, queries, budgets, -1, 1.0, 1), c10::Error);
}

}  // namespace
