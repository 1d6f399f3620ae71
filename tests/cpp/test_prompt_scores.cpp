// GoogleTest of the prompt_scores family's device-free math: query weights, the bound on the older queries' weights
// against the geometric series summed by hand, the float32-resolution test behind the skip, and the log-sum-exp of a
// row from its softmax statistics; the log-domain query weights and the online log-sum-exp of
// prompt_log_unnormalised_scores; the chunks per pair of the CPU ops (common.h); the chunks of query tiles of
// prompt_attention_with_scores, against the causal work counted key by key.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/prompt_scores.h"

namespace {

using kvcomp::kernels::add_log_term;
using kvcomp::kernels::folded_tile;
using kvcomp::kernels::older_queries_negligible;
using kvcomp::kernels::older_queries_weight_bound;
using kvcomp::kernels::query_tile_work;
using kvcomp::kernels::query_log_weight;
using kvcomp::kernels::query_weight;
using kvcomp::kernels::score_chunk_bounds;
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

TEST(AddLogTerm, ANaNTermMakesTheColumnNaNWhereverItComes) {
  // log Σ exp over terms one of which is NaN is NaN, as the CPU op and the float64 reference give.
  const float finite[] = {-INFINITY, 2.0f, -1.0f};
  for (int nan_at = 0; nan_at <= 3; ++nan_at) {
    SoftmaxPartial column;
    for (int i = 0; i <= 3; ++i) {
      column = add_log_term(column, i == nan_at ? NAN : finite[i < nan_at ? i : i - 1]);
    }
    EXPECT_TRUE(std::isnan(row_log_sum_exp(column))) << "NaN as term " << nan_at;
  }
}

TEST(FoldedTile, VisitsEveryTileOnceLightAndHeavySideBySide) {
  for (int64_t n = 1; n <= 9; ++n) {
    std::vector<int64_t> seen;
    for (int64_t i = 0; i < n; ++i) seen.push_back(folded_tile(i, n));
    std::vector<int64_t> sorted = seen;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(sorted[i], i) << "n = " << n;
    for (int64_t i = 0; i + 1 < n; i += 2) EXPECT_EQ(seen[i] + seen[i + 1], n - 1) << "n = " << n;
  }
}

TEST(FoldedTile, TwoThreadsOverThreePairsShareTheWork) {
  // SmolLM2's 3 kv heads, 48 key tiles of work 48 - k (a key tile is seen by the queries after it), split in two
  // contiguous ranges of tasks as at::parallel_for does: in index order the first thread got 1.75 pairs' work of 3.
  const int64_t pairs = 3, tiles = 48;
  double first = 0, all = 0;
  for (int64_t task = 0; task < pairs * tiles; ++task) {
    const double work = static_cast<double>(tiles - folded_tile(task % tiles, tiles));
    all += work;
    if (task < pairs * tiles / 2) first += work;
  }
  EXPECT_NEAR(first / all, 0.5, 0.01);
}

// The CPU ops' chunks per (batch, kv head) pair: the fewest that give kCpuTasksTarget tasks over all the pairs, at most
// kMaxPairChunks and the op's own bound, never none. Counted up one chunk at a time.
TEST(ChunksPerPair, FewestChunksThatReachTheTaskTargetWithinTheBounds) {
  using kvcomp::kernels::chunks_per_pair;
  using kvcomp::kernels::kCpuTasksTarget;
  using kvcomp::kernels::kMaxPairChunks;
  for (int64_t pairs = 1; pairs <= 2 * kCpuTasksTarget + 3; ++pairs) {
    int64_t fewest = 1;
    while (pairs * fewest < kCpuTasksTarget) ++fewest;
    for (const int64_t most : {int64_t{0}, int64_t{1}, int64_t{3}, kMaxPairChunks, int64_t{1000}}) {
      const int64_t expected = std::max<int64_t>(1, std::min({fewest, kMaxPairChunks, most}));
      EXPECT_EQ(chunks_per_pair(pairs, most), expected) << pairs << " pairs, at most " << most;
    }
  }
}

// Counted key by key: the keys seen by the queries of tiles [first, last) of the q newest of T tokens.
int64_t causal_work(int64_t first, int64_t last, int64_t tile_queries, int64_t q, int64_t total) {
  int64_t seen = 0;
  for (int64_t j = first * tile_queries; j < std::min(last * tile_queries, q); ++j) seen += total - q + j + 1;
  return seen;
}

TEST(ScoreChunkBounds, ChunksHoldEqualCausalWork) {
  struct Case { int64_t chunks, tile_queries, q, total; };
  for (const Case c : {Case{16, 64, 3072, 3072}, Case{4, 64, 3072, 3072}, Case{5, 64, 300, 300},
                       Case{11, 64, 8192, 8192}, Case{16, 64, 1000, 5000}, Case{3, 64, 130, 300},
                       Case{1, 64, 37, 37}}) {
    const std::vector<int64_t> bounds = score_chunk_bounds(c.chunks, c.tile_queries, c.q, c.total);
    const int64_t tiles = (c.q + c.tile_queries - 1) / c.tile_queries;
    ASSERT_EQ(static_cast<int64_t>(bounds.size()), c.chunks + 1);
    EXPECT_EQ(bounds.front(), 0);
    EXPECT_EQ(bounds.back(), tiles);
    EXPECT_TRUE(std::is_sorted(bounds.begin(), bounds.end()));
    const int64_t total = causal_work(0, tiles, c.tile_queries, c.q, c.total);
    int64_t heaviest_tile = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      // The last query's keys for every query of the tile: an upper bound of the tile's work.
      EXPECT_GE(query_tile_work(t, c.tile_queries, c.q, c.total), causal_work(t, t + 1, c.tile_queries, c.q, c.total));
      heaviest_tile = std::max(heaviest_tile, query_tile_work(t, c.tile_queries, c.q, c.total));
    }
    for (int64_t k = 0; k < c.chunks; ++k) {
      // At most an equal share plus one tile each.
      EXPECT_LE(causal_work(bounds[k], bounds[k + 1], c.tile_queries, c.q, c.total) * c.chunks,
                total + heaviest_tile * c.chunks)
          << "chunk " << k << " of " << c.chunks << ", q = " << c.q << ", T = " << c.total;
    }
  }
}

TEST(ScoreChunkBounds, TwoThreadsTakingHalfTheChunksEachShareTheWork) {
  // at::parallel_for hands each thread a contiguous range of tasks (chunk-major): at 2 threads, the first and the
  // second half of the chunks. Equal tile counts gave the second half 3/4 of the work on a full prompt.
  const int64_t q = 3072, chunks = 16;
  const std::vector<int64_t> bounds = score_chunk_bounds(chunks, 64, q, q);
  const double first = static_cast<double>(causal_work(0, bounds[chunks / 2], 64, q, q));
  const double second = static_cast<double>(causal_work(bounds[chunks / 2], bounds[chunks], 64, q, q));
  EXPECT_NEAR(first / (first + second), 0.5, 0.02);
}

}  // namespace
