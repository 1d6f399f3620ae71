// GoogleTest of the prompt_scores family's device-free math: query weights, the bound on the older queries' weights
// against the geometric series summed by hand, the float32-resolution test behind the skip, and the log-sum-exp of a
// row from its softmax statistics; the log-domain query weights and the online log-sum-exp of
// prompt_log_unnormalised_scores.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/prompt_scores.h"

namespace {

using kvcomp::kernels::add_log_term;
using kvcomp::kernels::older_queries_negligible;
using kvcomp::kernels::older_queries_weight_bound;
using kvcomp::kernels::query_log_weight;
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

TEST(QueryLogWeight, IsTheLogOfTheWeightAndStaysFinite) {
  EXPECT_FLOAT_EQ(query_log_weight(std::log(0.9), std::log(0.1 / 3), 2), static_cast<float>(std::log(0.1 / 3 * 0.81)));
  EXPECT_FLOAT_EQ(query_log_weight(std::log(0.5), 0.0, 0), 0.0f);
  // 0.5^1000 underflows float32 (and its weight would be 0); its log does not.
  EXPECT_EQ(query_weight(0.5, 1.0, 1000), 0.0f);
  EXPECT_FLOAT_EQ(query_log_weight(std::log(0.5), 0.0, 1000), static_cast<float>(1000 * std::log(0.5)));
}

TEST(AddLogTerm, IsAnOnlineLogSumExp) {
  // Terms far past exp's float32 range, in any order: the running max keeps every exp's argument <= 0.
  const float terms[] = {500.0f, -3.0f, 501.5f, -INFINITY, 499.0f};
  SoftmaxPartial column;
  double max = -INFINITY;
  for (float x : terms) {
    column = add_log_term(column, x);
    max = std::fmax(max, x);
  }
  double sum = 0.0;  // log Σ exp(x), summed by hand about the largest term
  for (float x : terms) sum += std::exp(static_cast<double>(x) - max);
  EXPECT_NEAR(row_log_sum_exp(column), max + std::log(sum), 1e-4);
  EXPECT_EQ(row_log_sum_exp(add_log_term(SoftmaxPartial{}, -INFINITY)), -INFINITY);  // a slot no query sees
}

}  // namespace
