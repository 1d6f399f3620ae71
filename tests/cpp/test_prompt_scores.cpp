// GoogleTest of the prompt_scores family's device-free math: query weights, the bound on the older queries' weights
// against the geometric series summed by hand, the float32-resolution test behind the skip, and the log-sum-exp of a
// row from its softmax statistics.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/prompt_scores.h"

namespace {

using kvcomp::kernels::older_queries_negligible;
using kvcomp::kernels::older_queries_weight_bound;
using kvcomp::kernels::query_weight;
using kvcomp::kernels::row_log_sum_exp;
using kvcomp::kernels::SoftmaxPartial;

TEST(QueryWeight, IsInputScaleTimesDecayToTheAge) {
  EXPECT_FLOAT_EQ(query_weight(0.98, 1.0, 0), 1.0f);
  EXPECT_FLOAT_EQ(query_weight(0.98, 1.0, 10), static_cast<float>(std::pow(0.98, 10)));
  EXPECT_FLOAT_EQ(query_weight(0.9, 0.1 / 3, 2), static_cast<float>(0.1 / 3 * 0.81));
  EXPECT_EQ(query_weight(1.0, 0.25, 100000), 0.25f);  // plain sums never fade
}

TEST(OlderQueriesWeightBound, BoundsTheGeometricTail) {
  for (double decay : {0.5, 0.9, 0.98}) {
    for (int64_t age : {0, 1, 64, 500}) {
      double tail = 0.0;  // Σ_{k = age}^{age + 20000} decay^k, summed by hand
      for (int64_t k = age; k < age + 20000; ++k) tail += 0.3 * std::pow(decay, static_cast<double>(k));
      const double bound = older_queries_weight_bound(decay, 0.3, age);
      EXPECT_GE(bound, tail);
      EXPECT_NEAR(bound, tail, 1e-12 + 1e-9 * tail);
    }
  }
  EXPECT_EQ(older_queries_weight_bound(1.0, 0.3, 5), INFINITY);
}

TEST(OlderQueriesNegligible, BelowHalfAnUlpOfTheSmallestScore) {
  const float score = 0.75f;
  const int64_t group = 4;
  // G · bound just below 2^-26 · score: the skipped mass is below a quarter of an ulp, so the float32 sum cannot move.
  const double bound = std::ldexp(static_cast<double>(score), -26) / group * 0.99;
  ASSERT_TRUE(older_queries_negligible(group, bound, score));
  EXPECT_EQ(score + static_cast<float>(group * bound), score);
  EXPECT_FALSE(older_queries_negligible(group, bound * 1.02, score));
  EXPECT_FALSE(older_queries_negligible(group, 0.0, 0.0f));  // a zero score never skips
  EXPECT_FALSE(older_queries_negligible(group, INFINITY, score));
}

TEST(RowLogSumExp, FromSoftmaxStatistics) {
  EXPECT_FLOAT_EQ(row_log_sum_exp(SoftmaxPartial{2.0f, 3.0f}), 2.0f + std::log(3.0f));
  EXPECT_EQ(row_log_sum_exp(SoftmaxPartial{}), -INFINITY);  // nothing to attend to
}

}  // namespace
