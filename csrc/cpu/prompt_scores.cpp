// CPU kernels of the prompt_scores family: the log-sum-exp of every prompt query row, then the weighted column sums of
// the normalised probabilities, without materialising more than one tile of logits per thread and without P·V.
//
// Both passes compute a tile of logits the same way: the key tile transposed into floats (d x kKeyTile), the query
// tile's G x tq rows as floats times the scale, and a register-blocked product (4 rows x 2 vectors of keys per block,
// so each key vector load feeds 4 FMAs). Pass 1 runs one task per (batch, kv-head, query tile) over its key tiles;
// pass 2 one task per (batch, kv-head, key tile) over the query tiles, newest first, so each score is written by one
// task in a fixed order: the result is deterministic whatever the thread count, with no atomics and no reduction
// across tasks.
#include <ATen/Parallel.h>
#include "cpu/vec.h"
#include <ATen/cpu/vec/functional.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/prompt_scores.h"
#include "kvcomp/prompt_scores.h"

namespace kvcomp {
namespace {

using cpu::FloatVec;
constexpr int64_t kLanes = FloatVec::size();
constexpr int64_t kKeyTile = 128;   // keys per tile: a multiple of the 2 vectors a product block covers
constexpr int64_t kQueryTile = 64;  // queries per tile; a tile holds the G x kQueryTile rows of one kv head
constexpr int64_t kRowBlock = 4;    // query rows of a product block
static_assert(kKeyTile % (2 * kLanes) == 0);

struct PromptLayout {
  PromptScoresShape shape;
  int64_t query_strides[3];  // batch, head, query (unit stride over d)
  int64_t key_strides[3];    // batch, head, slot (unit stride over d)
  float scale;

  int64_t query_tiles() const { return (shape.num_queries + kQueryTile - 1) / kQueryTile; }
  int64_t key_tiles() const { return (shape.total_len + kKeyTile - 1) / kKeyTile; }
  // Prompt position of query j (0-based among the q): the causal limit of its rows.
  int64_t position(int64_t query) const { return shape.total_len - shape.num_queries + query; }
};

// One thread's tiles: its whole workspace, independent of T.
struct TileScratch {
  std::vector<float> queries;  // [rows_pad, d]: scale * q, zero rows up to a multiple of kRowBlock
  std::vector<float> keys_t;   // [d, kKeyTile]: k transposed, zero columns past the tile's end
  std::vector<float> bias;     // [kKeyTile]: b, -inf past the tile's end
  std::vector<float> logits;   // [rows_pad, kKeyTile]

  TileScratch(const PromptScoresShape& shape)
      : queries(max_rows(shape) * shape.head_dim), keys_t(shape.head_dim * kKeyTile), bias(kKeyTile),
        logits(max_rows(shape) * kKeyTile) {}

  static int64_t max_rows(const PromptScoresShape& shape) {
    return (shape.group_size * kQueryTile + kRowBlock - 1) / kRowBlock * kRowBlock;
  }
};

// Rows g * tq + t of the query tile [query_begin, query_begin + tq) of kv head `head`, as scale * q in floats.
template <typename scalar_t>
int64_t load_query_tile(const PromptLayout& layout, const scalar_t* query, int64_t batch, int64_t head,
                        int64_t query_begin, int64_t tq, float* out) {
  const PromptScoresShape& shape = layout.shape;
  const int64_t d = shape.head_dim, rows = shape.group_size * tq;
  const int64_t rows_pad = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  for (int64_t g = 0; g < shape.group_size; ++g) {
    const scalar_t* src = query + batch * layout.query_strides[0] + (head * shape.group_size + g) * layout.query_strides[1];
    for (int64_t t = 0; t < tq; ++t) {
      const scalar_t* row = src + (query_begin + t) * layout.query_strides[2];
      float* dst = out + (g * tq + t) * d;
      for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<float>(row[e]) * layout.scale;
    }
  }
  std::fill(out + rows * d, out + rows_pad * d, 0.0f);
  return rows_pad;
}

// The key tile [key_begin, key_begin + len) of one (batch, kv-head), transposed to floats, and its log-weights.
template <typename scalar_t>
void load_key_tile(const PromptLayout& layout, const scalar_t* keys, const float* log_weights, int64_t key_begin,
                   int64_t len, TileScratch& scratch) {
  const int64_t d = layout.shape.head_dim;
  float* keys_t = scratch.keys_t.data();
  for (int64_t i = 0; i < len; ++i) {
    const scalar_t* key = keys + (key_begin + i) * layout.key_strides[2];
    for (int64_t e = 0; e < d; ++e) keys_t[e * kKeyTile + i] = static_cast<float>(key[e]);
  }
  for (int64_t e = 0; e < d; ++e) std::fill(keys_t + e * kKeyTile + len, keys_t + (e + 1) * kKeyTile, 0.0f);
  std::copy(log_weights + key_begin, log_weights + key_begin + len, scratch.bias.begin());
  std::fill(scratch.bias.begin() + len, scratch.bias.end(), -INFINITY);
}

// logits[r][c] = queries[r] · keys_t[:, c] for rows_pad rows and the first `columns` (rounded up to 2 vectors) keys.
void tile_logits(const float* queries, int64_t rows_pad, const float* keys_t, int64_t head_dim, int64_t columns,
                 float* logits) {
  for (int64_t r = 0; r < rows_pad; r += kRowBlock) {
    const float* q = queries + r * head_dim;
    for (int64_t c = 0; c < columns; c += 2 * kLanes) {
      FloatVec acc[kRowBlock][2];
      for (int64_t rr = 0; rr < kRowBlock; ++rr) acc[rr][0] = acc[rr][1] = FloatVec(0.0f);
      for (int64_t e = 0; e < head_dim; ++e) {
        const FloatVec k0 = FloatVec::loadu(keys_t + e * kKeyTile + c);
        const FloatVec k1 = FloatVec::loadu(keys_t + e * kKeyTile + c + kLanes);
        for (int64_t rr = 0; rr < kRowBlock; ++rr) {
          const FloatVec qe(q[rr * head_dim + e]);
          acc[rr][0] = at::vec::fmadd(qe, k0, acc[rr][0]);
          acc[rr][1] = at::vec::fmadd(qe, k1, acc[rr][1]);
        }
      }
      for (int64_t rr = 0; rr < kRowBlock; ++rr) {
        acc[rr][0].store(logits + (r + rr) * kKeyTile + c);
        acc[rr][1].store(logits + (r + rr) * kKeyTile + c + kLanes);
      }
    }
  }
}

// The masked logits of one row in lanes [c, c + kLanes) of a tile: q·k + b, -inf on -inf slots (whatever their key
// holds), past the tile and past the row's causal limit (`visible` slots of the tile).
inline FloatVec masked_logits(const float* logits_row, const float* bias, int64_t c, int64_t visible) {
  const FloatVec b = FloatVec::loadu(bias + c);
  const FloatVec minus_inf(-INFINITY);
  FloatVec logit = FloatVec::blendv(FloatVec::loadu(logits_row + c) + b, minus_inf, b == minus_inf);
  if (c + kLanes > visible) {
    const FloatVec slot = FloatVec::arange(static_cast<float>(c), 1.0f);
    logit = FloatVec::blendv(logit, minus_inf, slot >= FloatVec(static_cast<float>(visible)));
  }
  return logit;
}

// Slots of a key tile of length len starting at key_begin that a row at prompt position `position` sees.
inline int64_t visible_slots(int64_t position, int64_t key_begin, int64_t len) {
  return std::clamp<int64_t>(position - key_begin + 1, 0, len);
}

// ---------------------------------------------------------------------------------------------------------------
// Pass 1: prompt_log_sum_exp

template <typename scalar_t>
void log_sum_exp_task(const PromptLayout& layout, const scalar_t* query, const scalar_t* keys, const float* log_weights,
                      int64_t pair, int64_t query_tile, TileScratch& scratch,
                      std::vector<kernels::SoftmaxPartial>& rows_stats, float* lse) {
  const PromptScoresShape& shape = layout.shape;
  const int64_t batch = pair / shape.kv_heads, head = pair % shape.kv_heads, d = shape.head_dim;
  const int64_t query_begin = query_tile * kQueryTile;
  const int64_t tq = std::min(kQueryTile, shape.num_queries - query_begin);
  const int64_t rows = shape.group_size * tq;
  const int64_t rows_pad = load_query_tile(layout, query, batch, head, query_begin, tq, scratch.queries.data());
  const scalar_t* pair_keys = keys + batch * layout.key_strides[0] + head * layout.key_strides[1];
  const float* pair_bias = log_weights + pair * shape.total_len;
  std::fill(rows_stats.begin(), rows_stats.begin() + rows, kernels::SoftmaxPartial{});

  const int64_t key_end = layout.position(query_begin + tq - 1) + 1;  // the newest row's causal limit
  for (int64_t key_begin = 0; key_begin < key_end; key_begin += kKeyTile) {
    const int64_t len = std::min(kKeyTile, key_end - key_begin);
    load_key_tile(layout, pair_keys, pair_bias, key_begin, len, scratch);
    tile_logits(scratch.queries.data(), rows_pad, scratch.keys_t.data(), d, len, scratch.logits.data());
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t visible = visible_slots(layout.position(query_begin + row % tq), key_begin, len);
      if (visible == 0) continue;
      const float* logits_row = scratch.logits.data() + row * kKeyTile;
      FloatVec max_v(-INFINITY);
      for (int64_t c = 0; c < visible; c += kLanes) {
        max_v = at::vec::maximum(max_v, masked_logits(logits_row, scratch.bias.data(), c, visible));
      }
      kernels::SoftmaxPartial tile{at::vec::vec_reduce_all<float>(
                                       [](const FloatVec& a, const FloatVec& b) { return at::vec::maximum(a, b); },
                                       max_v),
                                   0.0f};
      if (tile.max == -INFINITY) continue;
      FloatVec sum_v(0.0f);
      const FloatVec max_b(tile.max);
      for (int64_t c = 0; c < visible; c += kLanes) {
        sum_v = sum_v + (masked_logits(logits_row, scratch.bias.data(), c, visible) - max_b).exp();
      }
      tile.sum = at::vec::vec_reduce_all<float>([](const FloatVec& a, const FloatVec& b) { return a + b; }, sum_v);
      rows_stats[row] = kernels::combine(rows_stats[row], tile);
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t g = row / tq, t = row % tq;
    lse[((batch * shape.query_heads + head * shape.group_size + g) * shape.num_queries) + query_begin + t] =
        kernels::row_log_sum_exp(rows_stats[row]);
  }
}

PromptLayout make_layout(const PromptScoresShape& shape, const at::Tensor& query, const at::Tensor& keys,
                         double scale) {
  return {shape,
          {query.stride(0), query.stride(1), query.stride(2)},
          {keys.stride(0), keys.stride(1), keys.stride(2)},
          static_cast<float>(scale)};
}

// Any strides over (B, H, T) are read in place; d must be contiguous, otherwise the tensor is copied.
at::Tensor unit_stride_last(const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); }

at::Tensor prompt_log_sum_exp_cpu(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& log_weights,
                                  double scale) {
  const PromptScoresShape shape = check_prompt_log_sum_exp(query, keys, log_weights, scale);
  at::Tensor lse = at::empty({shape.batch, shape.query_heads, shape.num_queries}, query.options().dtype(at::kFloat));
  const at::Tensor query_c = unit_stride_last(query), keys_c = unit_stride_last(keys);
  const at::Tensor log_weights_c = log_weights.contiguous();
  const PromptLayout layout = make_layout(shape, query_c, keys_c, scale);
  const int64_t query_tiles = layout.query_tiles();
  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::prompt_log_sum_exp", [&] {
    at::parallel_for(0, shape.batch * shape.kv_heads * query_tiles, 1, [&](int64_t begin, int64_t end) {
      TileScratch scratch(shape);
      std::vector<kernels::SoftmaxPartial> rows_stats(TileScratch::max_rows(shape));
      for (int64_t task = begin; task < end; ++task) {
        log_sum_exp_task(layout, query_c.const_data_ptr<scalar_t>(), keys_c.const_data_ptr<scalar_t>(),
                         log_weights_c.const_data_ptr<float>(), task / query_tiles, task % query_tiles, scratch,
                         rows_stats, lse.mutable_data_ptr<float>());
      }
    });
  });
  return lse;
}

// ---------------------------------------------------------------------------------------------------------------
// Pass 2: prompt_scores

struct ScoreWeights {
  double decay, input_scale;
};

template <typename scalar_t>
void scores_task(const PromptLayout& layout, const scalar_t* query, const scalar_t* keys, const float* log_weights,
                 const float* lse, ScoreWeights weights, int64_t pair, int64_t key_tile, TileScratch& scratch,
                 std::vector<float>& row_lse, std::vector<float>& row_weight, float* scores) {
  const PromptScoresShape& shape = layout.shape;
  const int64_t batch = pair / shape.kv_heads, head = pair % shape.kv_heads, d = shape.head_dim;
  const int64_t key_begin = key_tile * kKeyTile, len = std::min(kKeyTile, shape.total_len - key_begin);
  load_key_tile(layout, keys + batch * layout.key_strides[0] + head * layout.key_strides[1],
                log_weights + pair * shape.total_len, key_begin, len, scratch);
  const float* bias = scratch.bias.data();

  FloatVec acc[kKeyTile / kLanes];
  for (auto& a : acc) a = FloatVec(0.0f);
  // Query tiles whose newest row sees the tile's first key, newest first.
  const int64_t first_seeing = std::max<int64_t>(0, key_begin - layout.position(0));
  for (int64_t query_tile = layout.query_tiles() - 1; query_tile >= first_seeing / kQueryTile; --query_tile) {
    const int64_t query_begin = query_tile * kQueryTile;
    const int64_t tq = std::min(kQueryTile, shape.num_queries - query_begin);
    const int64_t rows = shape.group_size * tq;
    const int64_t rows_pad = load_query_tile(layout, query, batch, head, query_begin, tq, scratch.queries.data());
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t g = row / tq, t = row % tq;
      const float row_lse_value =
          lse[(batch * shape.query_heads + head * shape.group_size + g) * shape.num_queries + query_begin + t];
      // A row with nothing to attend to (lse -inf) has probabilities 0: weight 0, and lse 0 so that exp sees -inf.
      row_lse[row] = row_lse_value == -INFINITY ? 0.0f : row_lse_value;
      row_weight[row] = row_lse_value == -INFINITY
                            ? 0.0f
                            : kernels::query_weight(weights.decay, weights.input_scale,
                                                    shape.num_queries - 1 - (query_begin + t));
    }
    tile_logits(scratch.queries.data(), rows_pad, scratch.keys_t.data(), d, len, scratch.logits.data());
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t visible = visible_slots(layout.position(query_begin + row % tq), key_begin, len);
      if (visible == 0 || row_weight[row] == 0.0f) continue;
      const float* logits_row = scratch.logits.data() + row * kKeyTile;
      const FloatVec lse_b(row_lse[row]), weight_b(row_weight[row]);
      for (int64_t c = 0; c < visible; c += kLanes) {
        const FloatVec p = (masked_logits(logits_row, bias, c, visible) - lse_b).exp();
        acc[c / kLanes] = at::vec::fmadd(weight_b, p, acc[c / kLanes]);
      }
    }
    // Every older query together adds at most G · weight_bound to a score (kernels::older_queries_negligible).
    if (query_tile > 0) {
      const double bound = kernels::older_queries_weight_bound(weights.decay, weights.input_scale,
                                                               shape.num_queries - query_begin);
      if (bound < INFINITY) {
        // Smallest partial score over the tile's attended slots (-inf slots and slots past the tile stay 0).
        const FloatVec minus_inf(-INFINITY), plus_inf(INFINITY);
        FloatVec min_v(INFINITY);
        for (int64_t c = 0; c < len; c += kLanes) {
          const FloatVec unattended = FloatVec::loadu(bias + c) == minus_inf;
          min_v = at::vec::minimum(min_v, FloatVec::blendv(acc[c / kLanes], plus_inf, unattended));
        }
        const float min_score = at::vec::vec_reduce_all<float>(
            [](const FloatVec& a, const FloatVec& b) { return at::vec::minimum(a, b); }, min_v);
        if (kernels::older_queries_negligible(shape.group_size, bound, min_score)) break;
      }
    }
  }
  float* out = scores + pair * shape.total_len + key_begin;
  for (int64_t c = 0; c < len; c += kLanes) acc[c / kLanes].store(out + c, std::min(kLanes, len - c));
}

at::Tensor prompt_scores_cpu(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& log_weights,
                             const at::Tensor& log_sum_exp, double scale, double decay, double input_scale) {
  const PromptScoresShape shape =
      check_prompt_scores(query, keys, log_weights, log_sum_exp, scale, decay, input_scale);
  at::Tensor scores = at::empty({shape.batch, shape.kv_heads, shape.total_len}, query.options().dtype(at::kFloat));
  const at::Tensor query_c = unit_stride_last(query), keys_c = unit_stride_last(keys);
  const at::Tensor log_weights_c = log_weights.contiguous(), lse_c = log_sum_exp.contiguous();
  const PromptLayout layout = make_layout(shape, query_c, keys_c, scale);
  const int64_t key_tiles = layout.key_tiles();
  const ScoreWeights weights{decay, input_scale};
  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::prompt_scores", [&] {
    at::parallel_for(0, shape.batch * shape.kv_heads * key_tiles, 1, [&](int64_t begin, int64_t end) {
      TileScratch scratch(shape);
      std::vector<float> row_lse(TileScratch::max_rows(shape)), row_weight(TileScratch::max_rows(shape));
      for (int64_t task = begin; task < end; ++task) {
        scores_task(layout, query_c.const_data_ptr<scalar_t>(), keys_c.const_data_ptr<scalar_t>(),
                    log_weights_c.const_data_ptr<float>(), lse_c.const_data_ptr<float>(), weights, task / key_tiles,
                    task % key_tiles, scratch, row_lse, row_weight, scores.mutable_data_ptr<float>());
      }
    });
  });
  return scores;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CPU, m) {
  m.impl("prompt_log_sum_exp", &prompt_log_sum_exp_cpu);
  m.impl("prompt_scores", &prompt_scores_cpu);
}

}  // namespace kvcomp
