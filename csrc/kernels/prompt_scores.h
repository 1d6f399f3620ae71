// Device-free math of the prompt_scores family (kvcomp::prompt_log_sum_exp, kvcomp::prompt_scores,
// kvcomp::prompt_log_unnormalised_scores), used by the CPU loops, the CUDA kernels and GoogleTest.
//
// The scores of a prompt's keys from its q newest queries j (prompt token T - q + j), per kv head h:
//   s_i = Σ_j w_j Σ_{g in the group of h} p_{g,j,i},   p_{g,j,i} = exp(scale q_{g,j}·k_i + b_i - lse_{g,j}),
//   w_j = input_scale · decay^(q-1-j),               lse_{g,j} = log Σ_{i' <= T-q+j} exp(scale q_{g,j}·k_i' + b_i').
// Two passes, neither holding more than a tile of logits: the log-sum-exp of every query row (online softmax over key
// tiles, SoftmaxPartial of attention.h), then for every key tile the weighted sums of the normalised probabilities,
// queries from the newest to the oldest. Every term is >= 0, so a key tile's partial sums only grow, and once the
// weights of all older queries together cannot reach half an ulp of its smallest partial score the rest is skipped
// (older_queries_negligible).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "common.h"

namespace kvcomp::kernels {

// log Σ exp(logit) of a row from its softmax statistics; -inf for a row with nothing to attend to (sum 0).
KVCOMP_HOST_DEVICE inline float row_log_sum_exp(SoftmaxPartial row) {
  return row.sum == 0.0f ? -INFINITY : row.max + ::logf(row.sum);
}

// w_j of the query `age` = q - 1 - j steps older than the newest: input_scale · decay^age (ZSMerge λ^(T-1-j) with
// input_scale 1; WeightedKV decay 1, 1/G; KeepKV's EMA of unnormalised scores, decay β, (1-β)/G).
KVCOMP_HOST_DEVICE inline float query_weight(double decay, double input_scale, int64_t age) {
  return static_cast<float>(input_scale * ::pow(decay, static_cast<double>(age)));
}

// An upper bound on the summed weights of every query at least `age` steps old: Σ_{k >= age} input_scale · decay^k =
// input_scale · decay^age / (1 - decay); +inf for decay = 1 (plain sums never fade, nothing is skipped).
KVCOMP_HOST_DEVICE inline double older_queries_weight_bound(double decay, double input_scale, int64_t age) {
  if (decay >= 1.0) return INFINITY;
  return input_scale * ::pow(decay, static_cast<double>(age)) / (1.0 - decay);
}

// Whether the queries bounded by `weight_bound` can be left out of a key tile whose smallest partial score (over its
// attended slots, newer queries only) is min_partial_score. Each query adds at most w_j · G to a score (G
// probabilities <= 1), so together they add at most G · weight_bound. A float32 x in [2^e, 2^(e+1)) has
// ulp(x) = 2^(e-23) > 2^-24 x: a total below 2^-25 x is less than half an ulp of x and cannot change its float32
// rounding. The bound asks for 2^-26, twice that margin, so that the computed partial score may sit below the exact
// one by its own rounding. The skipped queries are therefore provably below float32 resolution (the result is not
// bitwise the unskipped sum, whose order of additions differs anyway). A tile holding a zero score never skips.
KVCOMP_HOST_DEVICE inline bool older_queries_negligible(int64_t group_size, double weight_bound,
                                                        float min_partial_score) {
  return min_partial_score > 0.0f &&
         static_cast<double>(group_size) * weight_bound < ::ldexp(static_cast<double>(min_partial_score), -26);
}

// prompt_log_unnormalised_scores: ln s_i of s_i = Σ_j w_j Σ_g exp(scale q_{g,j}·k_i + b_i), causal, the scores
// without a softmax (KeepKV's EMA over its recent window: decay β, input_scale (1-β)/G). No row normaliser, so no
// bound on a term: each column keeps an online log-sum-exp (running max and the sum rescaled to it, SoftmaxPartial)
// of the terms scale q·k + b + ln w_j, and exp never sees a positive argument whatever the logits.
//
// ln w_j of the query `age` = q - 1 - j steps older than the newest: ln input_scale + age · ln decay (finite for any
// age, where w_j itself would underflow to 0 in float32 past a few hundred steps).
KVCOMP_HOST_DEVICE inline float query_log_weight(double log_decay, double log_input_scale, int64_t age) {
  return static_cast<float>(log_input_scale + static_cast<double>(age) * log_decay);
}

// One term x added to a column's online log-sum-exp. A NaN term makes the sum NaN, in whatever order the terms come:
// combine's fmaxf would drop it while the running max is still -inf, and later finite terms would hide it.
KVCOMP_HOST_DEVICE inline SoftmaxPartial add_log_term(SoftmaxPartial column, float x) {
  if (is_nan(x)) return {column.max, x};
  return combine(column, SoftmaxPartial{x, 1.0f});
}

// The CPU ops run one task per (batch, kv head, tile) and at::parallel_for hands each thread a contiguous range of
// them. A tile's causal work grows with its index (query tiles) or falls with it (key tiles), so the tiles of a
// pair are taken in the order 0, n-1, 1, n-2, ...: a light and a heavy tile side by side, and every thread's range
// holds about the same work. The i-th tile of n in that order:
inline int64_t folded_tile(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

// prompt_attention_with_scores (CPU) splits the column sums of each (batch, kv head) over chunks of consecutive query
// tiles (chunks_per_pair of them, at most one per tile), each summing into its own partial row; the partials are added
// in chunk order afterwards. A query tile reads every key up to its last query's position, so the newest tiles cost
// the most, and at::parallel_for hands each thread a contiguous range of tasks (chunk-major): chunks of equal tile
// counts would give the threads that take the newest chunks most of the work. Chunks hold equal causal work instead
// (query_tile_work, score_chunk_bounds below).

// Causal work of query tile `tile` (tiles of tile_queries of the q = num_queries newest of T = total_len prompt
// tokens): its queries times the keys its last query sees.
inline int64_t query_tile_work(int64_t tile, int64_t tile_queries, int64_t num_queries, int64_t total_len) {
  const int64_t begin = tile * tile_queries, end = std::min(begin + tile_queries, num_queries);
  return (end - begin) * (total_len - num_queries + end);
}

// The chunks + 1 bounds in query tiles: chunk c holds tiles [bounds[c], bounds[c + 1]), starting at the first tile
// whose predecessors hold at least c / chunks of the pair's work. A chunk holds at most 1 / chunks of it plus one tile; a chunk
// may be empty when one tile outweighs that share.
inline std::vector<int64_t> score_chunk_bounds(int64_t chunks, int64_t tile_queries, int64_t num_queries,
                                               int64_t total_len) {
  const int64_t tiles = (num_queries + tile_queries - 1) / tile_queries;
  std::vector<int64_t> before(tiles + 1, 0);  // work of the tiles before each tile
  for (int64_t t = 0; t < tiles; ++t) {
    before[t + 1] = before[t] + query_tile_work(t, tile_queries, num_queries, total_len);
  }
  std::vector<int64_t> bounds(chunks + 1, tiles);
  for (int64_t c = 0, t = 0; c < chunks; ++c) {
    while (t < tiles && before[t] * chunks < c * before[tiles]) ++t;
    bounds[c] = t;
  }
  return bounds;
}

}  // namespace kvcomp::kernels
