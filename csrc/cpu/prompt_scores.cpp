// CPU kernels of the prompt_scores family: the log-sum-exp of every prompt query row, then the weighted column sums of
// the normalised probabilities, without materialising more than one tile of logits per thread and without P·V.
//
// Both passes compute logits the same way: the key tile transposed into floats (d x kKeyTile), the query tile's
// G x tq rows read in place (float inputs) or converted to floats, and a register-blocked product (4 rows x 4 vectors
// of keys per block, so each key vector load feeds 4 FMAs and each broadcast 4), times the scale. Pass 1 runs one
// task per (batch, kv-head, query tile) over its key tiles and keeps a tile of logits per row for its max and sum;
// pass 2 one task per (batch, kv-head, key tile) over the query tiles, newest first, and turns each product block
// into weighted probabilities while it is in registers (no logits buffer), skipping the blocks the causal mask hides
// entirely. So each score is written by one task in a fixed order: the result is deterministic whatever the thread
// count, with no atomics and no reduction across tasks.
//
// Both passes use at::vec's exp_u20 (fast_exp: at most 20 ulp, about 2.4e-6 relative, against exp's 1 ulp), as
// ATen's own CPU flash attention does: a score sums non-negative terms, so its relative error stays at that level,
// far below the float64 reference tests' rtol 5e-5.
#include <ATen/Parallel.h>
#include "cpu/vec.h"
#include <ATen/cpu/vec/functional.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels/prompt_scores.h"
#include "kvcomp/prompt_scores.h"

namespace kvcomp {
namespace {

using cpu::FloatVec;
constexpr int64_t kLanes = FloatVec::size();
constexpr int64_t kKeyTile = 128;   // keys per tile: a multiple of the kBlockVectors a product block covers
constexpr int64_t kQueryTile = 64;  // queries per tile; a tile holds the G x kQueryTile rows of one kv head
constexpr int64_t kRowBlock = 4;    // query rows of a product block
// Key vectors of a product block: 4 x 4 accumulators, 4 key loads and 4 broadcasts per 16 FMAs.
constexpr int64_t kBlockVectors = 4;
constexpr int64_t kBlockKeys = kBlockVectors * kLanes;
static_assert(kKeyTile % kBlockKeys == 0);

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
  std::vector<float> queries;          // [rows, d]: q converted to floats (inputs other than float)
  std::vector<float> zero_row;         // [d]: the rows that pad a tile to a multiple of kRowBlock
  std::vector<const float*> rows;      // [rows_pad]: each row of the query tile, as floats
  std::vector<float> keys_t;           // [d, kKeyTile]: k transposed, zero columns past the tile's end
  std::vector<float> bias;             // [kKeyTile]: b, -inf past the tile's end
  bool bias_finite = true;             // no -inf among the tile's own slots
  std::vector<float> logits;           // [rows_pad, kKeyTile] (pass 1)

  TileScratch(const PromptScoresShape& shape)
      : queries(max_rows(shape) * shape.head_dim), zero_row(shape.head_dim, 0.0f), rows(max_rows(shape)),
        keys_t(shape.head_dim * kKeyTile), bias(kKeyTile), logits(max_rows(shape) * kKeyTile) {}

  static int64_t max_rows(const PromptScoresShape& shape) {
    return (shape.group_size * kQueryTile + kRowBlock - 1) / kRowBlock * kRowBlock;
  }
};

// Rows g * tq + t of the query tile [query_begin, query_begin + tq) of kv head `head` as float pointers in
// scratch.rows (in place for float inputs, converted otherwise), then zero rows up to a multiple of kRowBlock.
template <typename scalar_t>
int64_t load_query_tile(const PromptLayout& layout, const scalar_t* query, int64_t batch, int64_t head,
                        int64_t query_begin, int64_t tq, TileScratch& scratch) {
  const PromptScoresShape& shape = layout.shape;
  const int64_t d = shape.head_dim, rows = shape.group_size * tq;
  const int64_t rows_pad = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  for (int64_t g = 0; g < shape.group_size; ++g) {
    const scalar_t* src = query + batch * layout.query_strides[0] + (head * shape.group_size + g) * layout.query_strides[1];
    for (int64_t t = 0; t < tq; ++t) {
      const scalar_t* row = src + (query_begin + t) * layout.query_strides[2];
      if constexpr (std::is_same_v<scalar_t, float>) {
        scratch.rows[g * tq + t] = row;
      } else {
        float* dst = scratch.queries.data() + (g * tq + t) * d;
        for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<float>(row[e]);
        scratch.rows[g * tq + t] = dst;
      }
    }
  }
  std::fill(scratch.rows.begin() + rows, scratch.rows.begin() + rows_pad, scratch.zero_row.data());
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
  scratch.bias_finite = std::none_of(scratch.bias.begin(), scratch.bias.begin() + len,
                                     [](float b) { return b == -INFINITY; });
}

using ProductBlock = FloatVec[kRowBlock][kBlockVectors];

// A vector loaded into a register that the compiler must keep: GCC otherwise folds the load into each FMA that uses it,
// so a product block issues a load per FMA (20 loads per 16 FMAs instead of 8) and runs at half speed, bound by the
// load ports (measured: prompt_scores at T = 8k, 0.62 s -> 0.31 s).
inline FloatVec load_to_register(const float* address) {
  const FloatVec lanes = FloatVec::loadu(address);
#if defined(__GNUC__) && defined(CPU_CAPABILITY_AVX512)
  __m512 raw = lanes;
  asm volatile("" : "+v"(raw));
  return FloatVec(raw);
#elif defined(__GNUC__) && defined(CPU_CAPABILITY_AVX2)
  __m256 raw = lanes;
  asm volatile("" : "+x"(raw));
  return FloatVec(raw);
#else
  return lanes;
#endif
}

// block[rr][v] = scale * Σ_e rows[rr][e] · columns[e * column_stride + c + v * kLanes + lane], e < inner: kRowBlock
// rows against kBlockVectors vectors of columns. Logits: query rows against the transposed key tile (inner = d,
// column_stride = kKeyTile); P·V: probability rows against a value tile (inner = its keys, column_stride = padded d).
inline void product_block(const float* const* rows, const float* columns, int64_t inner, int64_t column_stride,
                          int64_t c, float scale, ProductBlock& block) {
  // Accumulated in a local array, which the compiler keeps in registers: `block` may alias the query rows (both are
  // floats to it), so accumulating there would store every accumulator at every step.
  ProductBlock acc;
  for (auto& row : acc) {
    for (auto& lanes : row) lanes = FloatVec(0.0f);
  }
  const float* row_ptrs[kRowBlock];
  std::copy(rows, rows + kRowBlock, row_ptrs);
  for (int64_t e = 0; e < inner; ++e) {
    FloatVec k[kBlockVectors];
    for (int64_t v = 0; v < kBlockVectors; ++v) k[v] = load_to_register(columns + e * column_stride + c + v * kLanes);
    for (int64_t rr = 0; rr < kRowBlock; ++rr) {
      const FloatVec qe(row_ptrs[rr][e]);
      for (int64_t v = 0; v < kBlockVectors; ++v) acc[rr][v] = at::vec::fmadd(qe, k[v], acc[rr][v]);
    }
  }
  const FloatVec scale_v(scale);
  for (int64_t rr = 0; rr < kRowBlock; ++rr) {
    for (int64_t v = 0; v < kBlockVectors; ++v) block[rr][v] = acc[rr][v] * scale_v;
  }
}

// logits[r][c] = scale * rows[r] · keys_t[:, c] for rows_pad rows and the first `columns` (rounded up to kBlockKeys)
// keys.
void tile_logits(const float* const* rows, int64_t rows_pad, const float* keys_t, int64_t head_dim, int64_t columns,
                 float scale, float* logits) {
  for (int64_t r = 0; r < rows_pad; r += kRowBlock) {
    for (int64_t c = 0; c < columns; c += kBlockKeys) {
      ProductBlock block;
      product_block(rows + r, keys_t, head_dim, kKeyTile, c, scale, block);
      for (int64_t rr = 0; rr < kRowBlock; ++rr) {
        for (int64_t v = 0; v < kBlockVectors; ++v) block[rr][v].store(logits + (r + rr) * kKeyTile + c + v * kLanes);
      }
    }
  }
}

// The masked logits of one row in lanes [c, c + kLanes) of a tile: scale q·k + b, -inf on -inf slots (whatever their
// key holds; bias_finite: the tile has none), past the tile and past the row's causal limit (`visible` slots).
inline FloatVec masked_logits(FloatVec product, const float* bias, bool bias_finite, int64_t c, int64_t visible) {
  const FloatVec b = FloatVec::loadu(bias + c);
  const FloatVec minus_inf(-INFINITY);
  FloatVec logit = product + b;
  if (!bias_finite) logit = FloatVec::blendv(logit, minus_inf, b == minus_inf);
  if (c + kLanes > visible) {
    const FloatVec slot = FloatVec::arange(static_cast<float>(c), 1.0f);
    logit = FloatVec::blendv(logit, minus_inf, slot >= FloatVec(static_cast<float>(visible)));
  }
  return logit;
}

// exp by at::vec's exp_u20, whose clamping would turn a NaN logit into a finite value: NaN stays NaN, as with exp.
inline FloatVec fast_exp(const FloatVec& x) { return FloatVec::blendv(x.exp_u20(), x, x != x); }

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
  const int64_t rows_pad = load_query_tile(layout, query, batch, head, query_begin, tq, scratch);
  const scalar_t* pair_keys = keys + batch * layout.key_strides[0] + head * layout.key_strides[1];
  const float* pair_bias = log_weights + pair * shape.total_len;
  std::fill(rows_stats.begin(), rows_stats.begin() + rows, kernels::SoftmaxPartial{});

  const int64_t key_end = layout.position(query_begin + tq - 1) + 1;  // the newest row's causal limit
  for (int64_t key_begin = 0; key_begin < key_end; key_begin += kKeyTile) {
    const int64_t len = std::min(kKeyTile, key_end - key_begin);
    load_key_tile(layout, pair_keys, pair_bias, key_begin, len, scratch);
    tile_logits(scratch.rows.data(), rows_pad, scratch.keys_t.data(), d, len, layout.scale, scratch.logits.data());
    const float* bias = scratch.bias.data();
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t visible = visible_slots(layout.position(query_begin + row % tq), key_begin, len);
      if (visible == 0) continue;
      const float* logits_row = scratch.logits.data() + row * kKeyTile;
      const auto logits_at = [&](int64_t c) {
        return masked_logits(FloatVec::loadu(logits_row + c), bias, scratch.bias_finite, c, visible);
      };
      FloatVec max_v(-INFINITY);
      for (int64_t c = 0; c < visible; c += kLanes) max_v = at::vec::maximum(max_v, logits_at(c));
      kernels::SoftmaxPartial tile{at::vec::vec_reduce_all<float>(
                                       [](const FloatVec& a, const FloatVec& b) { return at::vec::maximum(a, b); },
                                       max_v),
                                   0.0f};
      if (tile.max == -INFINITY) continue;
      FloatVec sum_v(0.0f);
      const FloatVec max_b(tile.max);
      for (int64_t c = 0; c < visible; c += kLanes) sum_v = sum_v + fast_exp(logits_at(c) - max_b);
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

at::Tensor prompt_log_sum_exp_cpu(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& log_weights,
                                  double scale) {
  const PromptScoresShape shape = check_prompt_log_sum_exp(query, keys, log_weights, scale);
  at::Tensor lse = at::empty({shape.batch, shape.query_heads, shape.num_queries}, query.options().dtype(at::kFloat));
  const at::Tensor query_c = with_unit_stride_last(query), keys_c = with_unit_stride_last(keys);
  const at::Tensor log_weights_c = log_weights.contiguous();
  const PromptLayout layout = make_layout(shape, query_c, keys_c, scale);
  const int64_t query_tiles = layout.query_tiles();
  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::prompt_log_sum_exp", [&] {
    at::parallel_for(0, shape.batch * shape.kv_heads * query_tiles, 1, [&](int64_t begin, int64_t end) {
      TileScratch scratch(shape);
      std::vector<kernels::SoftmaxPartial> rows_stats(TileScratch::max_rows(shape));
      for (int64_t task = begin; task < end; ++task) {
        log_sum_exp_task(layout, query_c.const_data_ptr<scalar_t>(), keys_c.const_data_ptr<scalar_t>(),
                         log_weights_c.const_data_ptr<float>(), task / query_tiles,
                         kernels::folded_tile(task % query_tiles, query_tiles), scratch,
                         rows_stats, lse.mutable_data_ptr<float>());
      }
    });
  });
  return lse;
}

// ---------------------------------------------------------------------------------------------------------------
// Pass 2: prompt_scores

// The key tile of a key-tile task (pass 2, prompt_log_unnormalised_scores): tile `key_tile` of pair (batch, kv-head),
// loaded into scratch.
struct KeyTile {
  int64_t batch, head, begin, len;
};

template <typename scalar_t>
KeyTile load_task_key_tile(const PromptLayout& layout, const scalar_t* keys, const float* log_weights, int64_t pair,
                           int64_t key_tile, TileScratch& scratch) {
  const PromptScoresShape& shape = layout.shape;
  const int64_t begin = key_tile * kKeyTile;
  const KeyTile tile{pair / shape.kv_heads, pair % shape.kv_heads, begin, std::min(kKeyTile, shape.total_len - begin)};
  load_key_tile(layout, keys + tile.batch * layout.key_strides[0] + tile.head * layout.key_strides[1],
                log_weights + pair * shape.total_len, tile.begin, tile.len, scratch);
  return tile;
}

// The common loop of a key-tile task (pass 2, prompt_log_unnormalised_scores): the query tiles that see the key tile
// [key_begin, key_begin + len) of (batch, kv-head), newest first, each loaded into scratch; set_rows(query_begin, tq,
// rows, rows_pad) fills `visible` (slots of the key tile each row sees, 0 for a row that adds nothing) and the rows'
// other inputs; add_block(r, c, block) takes every product block of rows r..r+3 and columns c.. that a row sees; then
// older_negligible(query_tile, query_begin) may end the walk.
template <typename scalar_t, typename SetRows, typename AddBlock, typename OlderNegligible>
void walk_query_tiles(const PromptLayout& layout, const scalar_t* query, int64_t batch, int64_t head,
                      int64_t key_begin, TileScratch& scratch, const std::vector<int64_t>& visible, SetRows&& set_rows,
                      AddBlock&& add_block, OlderNegligible&& older_negligible) {
  const PromptScoresShape& shape = layout.shape;
  // Query tiles whose newest row sees the tile's first key, newest first.
  const int64_t first_seeing = std::max<int64_t>(0, key_begin - layout.position(0));
  for (int64_t query_tile = layout.query_tiles() - 1; query_tile >= first_seeing / kQueryTile; --query_tile) {
    const int64_t query_begin = query_tile * kQueryTile;
    const int64_t tq = std::min(kQueryTile, shape.num_queries - query_begin);
    const int64_t rows_pad = load_query_tile(layout, query, batch, head, query_begin, tq, scratch);
    set_rows(query_begin, tq, shape.group_size * tq, rows_pad);
    for (int64_t r = 0; r < rows_pad; r += kRowBlock) {
      const int64_t block_visible = *std::max_element(visible.begin() + r, visible.begin() + r + kRowBlock);
      for (int64_t c = 0; c < block_visible; c += kBlockKeys) {
        ProductBlock block;
        product_block(scratch.rows.data() + r, scratch.keys_t.data(), shape.head_dim, kKeyTile, c, layout.scale,
                      block);
        add_block(r, c, block);
      }
    }
    if (older_negligible(query_tile, query_begin)) break;
  }
}

struct ScoreWeights {
  double decay, input_scale;
};

// The per-row inputs of pass 2 for one query tile: rows past the tile (padding to kRowBlock) get weight 0.
struct TileRows {
  std::vector<float> lse, weight;
  std::vector<int64_t> visible;  // slots of the key tile the row sees

  explicit TileRows(int64_t max_rows) : lse(max_rows), weight(max_rows), visible(max_rows) {}
};

template <typename scalar_t>
void scores_task(const PromptLayout& layout, const scalar_t* query, const scalar_t* keys, const float* log_weights,
                 const float* lse, ScoreWeights weights, int64_t pair, int64_t key_tile, TileScratch& scratch,
                 TileRows& tile_rows, float* scores) {
  const PromptScoresShape& shape = layout.shape;
  const KeyTile tile = load_task_key_tile(layout, keys, log_weights, pair, key_tile, scratch);
  const int64_t batch = tile.batch, head = tile.head, key_begin = tile.begin, len = tile.len;
  const float* bias = scratch.bias.data();

  FloatVec acc[kKeyTile / kLanes];
  for (auto& a : acc) a = FloatVec(0.0f);
  const auto set_rows = [&](int64_t query_begin, int64_t tq, int64_t rows, int64_t rows_pad) {
    for (int64_t row = 0; row < rows_pad; ++row) {
      const int64_t g = row / tq, t = row % tq;
      const float row_lse_value = row < rows ? lse[(batch * shape.query_heads + head * shape.group_size + g) *
                                                       shape.num_queries + query_begin + t]
                                             : -INFINITY;
      // A row with nothing to attend to (lse -inf) has probabilities 0: weight 0, and lse 0 so that exp sees -inf.
      tile_rows.lse[row] = row_lse_value == -INFINITY ? 0.0f : row_lse_value;
      tile_rows.weight[row] = row_lse_value == -INFINITY
                                  ? 0.0f
                                  : kernels::query_weight(weights.decay, weights.input_scale,
                                                          shape.num_queries - 1 - (query_begin + t));
      tile_rows.visible[row] =
          tile_rows.weight[row] == 0.0f ? 0 : visible_slots(layout.position(query_begin + t), key_begin, len);
    }
  };
  const auto add_block = [&](int64_t r, int64_t c, const ProductBlock& block) {
    for (int64_t rr = 0; rr < kRowBlock; ++rr) {
      const int64_t visible = tile_rows.visible[r + rr];
      const FloatVec lse_b(tile_rows.lse[r + rr]), weight_b(tile_rows.weight[r + rr]);
      for (int64_t v = 0; v < kBlockVectors && c + v * kLanes < visible; ++v) {
        const int64_t lane0 = c + v * kLanes;
        const FloatVec p = fast_exp(masked_logits(block[rr][v], bias, scratch.bias_finite, lane0, visible) - lse_b);
        acc[lane0 / kLanes] = at::vec::fmadd(weight_b, p, acc[lane0 / kLanes]);
      }
    }
  };
  // Every older query together adds at most G · weight_bound to a score (kernels::older_queries_negligible).
  const auto older_negligible = [&](int64_t query_tile, int64_t query_begin) {
    if (query_tile == 0) return false;
    const double bound = kernels::older_queries_weight_bound(weights.decay, weights.input_scale,
                                                             shape.num_queries - query_begin);
    if (bound == INFINITY) return false;
    // Smallest partial score over the tile's attended slots (-inf slots and slots past the tile stay 0).
    const FloatVec minus_inf(-INFINITY), plus_inf(INFINITY);
    FloatVec min_v(INFINITY);
    for (int64_t c = 0; c < len; c += kLanes) {
      const FloatVec unattended = FloatVec::loadu(bias + c) == minus_inf;
      min_v = at::vec::minimum(min_v, FloatVec::blendv(acc[c / kLanes], plus_inf, unattended));
    }
    const float min_score = at::vec::vec_reduce_all<float>(
        [](const FloatVec& a, const FloatVec& b) { return at::vec::minimum(a, b); }, min_v);
    return kernels::older_queries_negligible(shape.group_size, bound, min_score);
  };
  walk_query_tiles(layout, query, batch, head, key_begin, scratch, tile_rows.visible, set_rows, add_block,
                   older_negligible);
  float* out = scores + pair * shape.total_len + key_begin;
  for (int64_t c = 0; c < len; c += kLanes) acc[c / kLanes].store(out + c, std::min(kLanes, len - c));
}

at::Tensor prompt_scores_cpu(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& log_weights,
                             const at::Tensor& log_sum_exp, double scale, double decay, double input_scale) {
  const PromptScoresShape shape =
      check_prompt_scores(query, keys, log_weights, log_sum_exp, scale, decay, input_scale);
  at::Tensor scores = at::empty({shape.batch, shape.kv_heads, shape.total_len}, query.options().dtype(at::kFloat));
  const at::Tensor query_c = with_unit_stride_last(query), keys_c = with_unit_stride_last(keys);
  const at::Tensor log_weights_c = log_weights.contiguous(), lse_c = log_sum_exp.contiguous();
  const PromptLayout layout = make_layout(shape, query_c, keys_c, scale);
  const int64_t key_tiles = layout.key_tiles();
  const ScoreWeights weights{decay, input_scale};
  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::prompt_scores", [&] {
    at::parallel_for(0, shape.batch * shape.kv_heads * key_tiles, 1, [&](int64_t begin, int64_t end) {
      TileScratch scratch(shape);
      TileRows tile_rows(TileScratch::max_rows(shape));
      for (int64_t task = begin; task < end; ++task) {
        scores_task(layout, query_c.const_data_ptr<scalar_t>(), keys_c.const_data_ptr<scalar_t>(),
                    log_weights_c.const_data_ptr<float>(), lse_c.const_data_ptr<float>(), weights, task / key_tiles,
                    kernels::folded_tile(task % key_tiles, key_tiles), scratch, tile_rows,
                    scores.mutable_data_ptr<float>());
      }
    });
  });
  return scores;
}

// ---------------------------------------------------------------------------------------------------------------
// prompt_log_unnormalised_scores: ln Σ_j w_j Σ_g exp(scale q·k + b) per slot (KeepKV's EMA from its recent window).
//
// One task per (batch, kv-head, key tile), query tiles newest first, as prompt_scores' pass 2, but with no row
// normaliser: each column keeps an online log-sum-exp of x = scale q·k + b + ln w_j. A product block's 4 rows update it
// at once: the block's column max raises the running max, the sum is rescaled to it (one exp) and the 4 terms added
// (4 exps), so exp never sees a positive argument and no logits buffer is kept.

// The per-row inputs of one query tile: rows past the tile (padding to kRowBlock) see no slot.
struct WindowRows {
  std::vector<float> log_weight;  // ln w_j of the row's query
  std::vector<int64_t> visible;   // slots of the key tile the row sees

  explicit WindowRows(int64_t max_rows) : log_weight(max_rows), visible(max_rows) {}
};

struct LogScoreWeights {
  double log_decay, log_input_scale;
};

template <typename scalar_t>
void log_unnormalised_scores_task(const PromptLayout& layout, const scalar_t* query, const scalar_t* keys,
                                  const float* log_weights, LogScoreWeights weights, int64_t pair, int64_t key_tile,
                                  TileScratch& scratch, WindowRows& window_rows, float* log_scores) {
  const PromptScoresShape& shape = layout.shape;
  const KeyTile tile = load_task_key_tile(layout, keys, log_weights, pair, key_tile, scratch);
  const int64_t batch = tile.batch, head = tile.head, key_begin = tile.begin, len = tile.len;
  const float* bias = scratch.bias.data();
  const FloatVec minus_inf(-INFINITY), zero(0.0f);

  FloatVec column_max[kKeyTile / kLanes], column_sum[kKeyTile / kLanes];
  for (auto& m : column_max) m = minus_inf;
  for (auto& sum : column_sum) sum = zero;
  const auto set_rows = [&](int64_t query_begin, int64_t tq, int64_t rows, int64_t rows_pad) {
    for (int64_t row = 0; row < rows_pad; ++row) {
      const int64_t t = row % tq;
      window_rows.log_weight[row] = kernels::query_log_weight(weights.log_decay, weights.log_input_scale,
                                                              shape.num_queries - 1 - (query_begin + t));
      window_rows.visible[row] = row < rows ? visible_slots(layout.position(query_begin + t), key_begin, len) : 0;
    }
  };
  const auto add_block = [&](int64_t r, int64_t c, const ProductBlock& block) {
    const int64_t block_visible =
        *std::max_element(window_rows.visible.begin() + r, window_rows.visible.begin() + r + kRowBlock);
    for (int64_t v = 0; v < kBlockVectors && c + v * kLanes < block_visible; ++v) {
      const int64_t lane0 = c + v * kLanes, column = lane0 / kLanes;
      FloatVec terms[kRowBlock];
      FloatVec block_max = minus_inf;
      for (int64_t rr = 0; rr < kRowBlock; ++rr) {
        const int64_t visible = window_rows.visible[r + rr];
        terms[rr] = lane0 < visible ? masked_logits(block[rr][v], bias, scratch.bias_finite, lane0, visible) +
                                          FloatVec(window_rows.log_weight[r + rr])
                                    : minus_inf;
        block_max = at::vec::maximum(block_max, terms[rr]);
      }
      const FloatVec new_max = at::vec::maximum(column_max[column], block_max);
      // Shifted by 0 while the column has seen nothing (exp(-inf - -inf) would be NaN): every term is then -inf.
      const FloatVec shift = FloatVec::blendv(new_max, zero, new_max == minus_inf);
      FloatVec sum = column_sum[column] * fast_exp(column_max[column] - shift);
      for (int64_t rr = 0; rr < kRowBlock; ++rr) sum = sum + fast_exp(terms[rr] - shift);
      column_sum[column] = sum;
      column_max[column] = new_max;
    }
  };
  // No row normaliser bounds an older query's term: every query of the window is read.
  walk_query_tiles(layout, query, batch, head, key_begin, scratch, window_rows.visible, set_rows, add_block,
                   [](int64_t, int64_t) { return false; });
  // ln Σ = max + ln(sum): -inf for a slot no query sees (sum 0, max -inf).
  float* out = log_scores + pair * shape.total_len + key_begin;
  for (int64_t c = 0; c < len; c += kLanes) {
    const FloatVec log_sum = column_max[c / kLanes] + column_sum[c / kLanes].log();
    FloatVec::blendv(log_sum, minus_inf, column_sum[c / kLanes] == zero).store(out + c, std::min(kLanes, len - c));
  }
}

at::Tensor prompt_log_unnormalised_scores_cpu(const at::Tensor& query, const at::Tensor& keys,
                                              const at::Tensor& log_weights, double scale, double decay,
                                              double input_scale) {
  const PromptScoresShape shape =
      check_prompt_log_unnormalised_scores(query, keys, log_weights, scale, decay, input_scale);
  at::Tensor log_scores = at::empty({shape.batch, shape.kv_heads, shape.total_len}, query.options().dtype(at::kFloat));
  const at::Tensor query_c = with_unit_stride_last(query), keys_c = with_unit_stride_last(keys);
  const at::Tensor log_weights_c = log_weights.contiguous();
  const PromptLayout layout = make_layout(shape, query_c, keys_c, scale);
  const int64_t key_tiles = layout.key_tiles();
  const LogScoreWeights weights{std::log(decay), std::log(input_scale)};
  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::prompt_log_unnormalised_scores", [&] {
    at::parallel_for(0, shape.batch * shape.kv_heads * key_tiles, 1, [&](int64_t begin, int64_t end) {
      TileScratch scratch(shape);
      WindowRows window_rows(TileScratch::max_rows(shape));
      for (int64_t task = begin; task < end; ++task) {
        log_unnormalised_scores_task(layout, query_c.const_data_ptr<scalar_t>(), keys_c.const_data_ptr<scalar_t>(),
                                     log_weights_c.const_data_ptr<float>(), weights, task / key_tiles,
                                     kernels::folded_tile(task % key_tiles, key_tiles), scratch, window_rows,
                                     log_scores.mutable_data_ptr<float>());
      }
    });
  });
  return log_scores;
}

// ---------------------------------------------------------------------------------------------------------------
// Fused: prompt_attention_with_scores, the prompt's attention output, log-sum-exp and scores from one QKᵀ.
//
// One task per (batch, kv-head, chunk of query tiles). For each query tile (the G x kFusedQueryTile rows of one kv
// head), key tile by key tile: the logits block (the register-blocked product), each row's online max, the block
// turned in place into exp(logit - running max) while it is in cache, and P·V accumulated into the rows' outputs by
// the same product (probability rows against the value tile), rescaled when a row's max grows (flash attention's
// online softmax). The block stays in the workspace with the max it was taken against, so once the row's exact
// log-sum-exp is known a read-only sweep adds w_j · exp(tile max - lse) · block to the column sums: every
// probability is computed once and normalised exactly. The column sums of a pair are split over chunks of query
// tiles of equal causal work (kernels::score_chunk_bounds), each summing into its own partial row, and the partials
// are added in chunk order afterwards: deterministic whatever the thread count.

constexpr int64_t kFusedQueryTile = 64;  // queries per tile (mirrored by ops.prompt_attention_workspace_bytes)

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

struct FusedLayout {
  PromptLayout prompt;  // query and key strides; prompt.shape
  int64_t value_strides[3];
  int64_t output_strides[3];  // batch, query, query head of the (B, q, Hq, d) output
  int64_t padded_head_dim;    // d rounded to kBlockKeys: the value tile's and the output rows' width
  int64_t padded_len;         // T rounded to kKeyTile: a probability row's width

  int64_t query_tiles() const { return (prompt.shape.num_queries + kFusedQueryTile - 1) / kFusedQueryTile; }
  int64_t max_rows() const { return round_up(prompt.shape.group_size * kFusedQueryTile, kRowBlock); }
};

// One thread's workspace: the probability rows of a query tile over all its keys (max_rows x padded_len floats:
// what ops.prompt_attention_workspace_bytes bounds), and per-row tiles of size d or T / kKeyTile.
struct FusedScratch {
  TileScratch tiles;
  std::vector<float> probs;       // [max_rows, padded_len]: exp(logit - tile_max[row][key tile])
  std::vector<float> tile_max;    // [max_rows, key tiles]: the running max each key tile of a row was taken against
  std::vector<float> outputs;     // [max_rows, padded_head_dim]: Σ exp(logit - running max) v, rescaled as it grows
  std::vector<float> values;      // [kKeyTile, padded_head_dim]: the value tile as floats, zero columns past d
  std::vector<kernels::SoftmaxPartial> rows_stats;  // [max_rows]
  std::vector<int64_t> visible;   // [max_rows]: slots of the key tile each row sees (0 for padding rows)
  std::vector<const float*> prob_rows;  // [max_rows]: each row's probabilities of the current key tile

  explicit FusedScratch(const FusedLayout& layout)
      : tiles(layout.prompt.shape), probs(layout.max_rows() * layout.padded_len),
        tile_max(layout.max_rows() * (layout.padded_len / kKeyTile)),
        outputs(layout.max_rows() * layout.padded_head_dim), values(kKeyTile * layout.padded_head_dim, 0.0f),
        rows_stats(layout.max_rows()), visible(layout.max_rows()), prob_rows(layout.max_rows()) {}
};

template <typename scalar_t>
void load_value_tile(const FusedLayout& layout, const scalar_t* values, int64_t key_begin, int64_t len,
                     float* tile) {
  const int64_t d = layout.prompt.shape.head_dim;
  for (int64_t i = 0; i < len; ++i) {
    const scalar_t* value = values + (key_begin + i) * layout.value_strides[2];
    float* dst = tile + i * layout.padded_head_dim;
    for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<float>(value[e]);
  }
}

// The logits of every row of the query tile against one key tile into probs (columns [key_begin, key_begin +
// kKeyTile)), then in place exp(logit - the row's new running max); the rows' statistics and outputs rescaled.
void fused_key_tile_softmax(const FusedLayout& layout, int64_t rows_pad, int64_t key_tile, int64_t len,
                            FusedScratch& scratch) {
  const int64_t d = layout.prompt.shape.head_dim, stride = layout.padded_len, key_tiles = stride / kKeyTile;
  float* block = scratch.probs.data() + key_tile * kKeyTile;
  const float* bias = scratch.tiles.bias.data();
  const int64_t columns = round_up(len, kBlockKeys);
  for (int64_t r = 0; r < rows_pad; r += kRowBlock) {
    const int64_t block_visible = *std::max_element(scratch.visible.begin() + r, scratch.visible.begin() + r + kRowBlock);
    for (int64_t c = 0; c < columns; c += kBlockKeys) {
      ProductBlock product;
      if (c < block_visible) {
        product_block(scratch.tiles.rows.data() + r, scratch.tiles.keys_t.data(), d, kKeyTile, c, layout.prompt.scale,
                      product);
      }
      for (int64_t rr = 0; rr < kRowBlock; ++rr) {
        for (int64_t v = 0; v < kBlockVectors; ++v) {
          const int64_t lane0 = c + v * kLanes, visible = scratch.visible[r + rr];
          const FloatVec logit = lane0 < visible
                                     ? masked_logits(product[rr][v], bias, scratch.tiles.bias_finite, lane0, visible)
                                     : FloatVec(-INFINITY);
          logit.store(block + (r + rr) * stride + lane0);
        }
      }
    }
  }
  for (int64_t row = 0; row < rows_pad; ++row) {
    float* logits = block + row * stride;
    kernels::SoftmaxPartial& stats = scratch.rows_stats[row];
    FloatVec max_v(-INFINITY);
    for (int64_t c = 0; c < scratch.visible[row]; c += kLanes) max_v = at::vec::maximum(max_v, FloatVec::loadu(logits + c));
    const float tile_max = at::vec::vec_reduce_all<float>(
        [](const FloatVec& a, const FloatVec& b) { return at::vec::maximum(a, b); }, max_v);
    // A NaN logit makes the row's statistics, output and scores NaN (std::max would drop it).
    const float running_max = std::isnan(tile_max) ? tile_max : std::max(stats.max, tile_max);
    scratch.tile_max[row * key_tiles + key_tile] = running_max;
    if (running_max == -INFINITY) {  // nothing seen yet: probabilities 0
      std::fill(logits, logits + columns, 0.0f);
      continue;
    }
    const FloatVec max_b(running_max);
    FloatVec sum_v(0.0f);
    for (int64_t c = 0; c < columns; c += kLanes) {
      const FloatVec p = fast_exp(FloatVec::loadu(logits + c) - max_b);
      p.store(logits + c);
      sum_v = sum_v + p;
    }
    const float rescale = kernels::shifted_exp(stats.max, running_max);
    if (rescale != 1.0f) {
      float* output = scratch.outputs.data() + row * layout.padded_head_dim;
      at::vec::map([rescale](FloatVec x) { return x * FloatVec(rescale); }, output, output, layout.padded_head_dim);
    }
    stats = {running_max,
             stats.sum * rescale +
                 at::vec::vec_reduce_all<float>([](const FloatVec& a, const FloatVec& b) { return a + b; }, sum_v)};
  }
}

// outputs[row] += probs[row, key tile] · values (the value tile), len keys.
void fused_key_tile_values(const FusedLayout& layout, int64_t rows_pad, int64_t key_tile, int64_t len,
                           FusedScratch& scratch) {
  const int64_t width = layout.padded_head_dim;
  for (int64_t row = 0; row < rows_pad; ++row) {
    scratch.prob_rows[row] = scratch.probs.data() + row * layout.padded_len + key_tile * kKeyTile;
  }
  for (int64_t r = 0; r < rows_pad; r += kRowBlock) {
    for (int64_t c = 0; c < width; c += kBlockKeys) {
      ProductBlock product;
      product_block(scratch.prob_rows.data() + r, scratch.values.data(), len, width, c, 1.0f, product);
      for (int64_t rr = 0; rr < kRowBlock; ++rr) {
        float* output = scratch.outputs.data() + (r + rr) * width + c;
        for (int64_t v = 0; v < kBlockVectors; ++v) {
          (FloatVec::loadu(output + v * kLanes) + product[rr][v]).store(output + v * kLanes);
        }
      }
    }
  }
}

template <typename scalar_t>
void fused_query_tile(const FusedLayout& layout, const scalar_t* query, const scalar_t* keys, const scalar_t* values,
                      const float* log_weights, ScoreWeights weights, int64_t pair, int64_t query_tile,
                      FusedScratch& scratch, scalar_t* output, float* lse, float* partial_scores) {
  const PromptScoresShape& shape = layout.prompt.shape;
  const int64_t batch = pair / shape.kv_heads, head = pair % shape.kv_heads, d = shape.head_dim;
  const int64_t query_begin = query_tile * kFusedQueryTile;
  const int64_t tq = std::min(kFusedQueryTile, shape.num_queries - query_begin);
  const int64_t rows = shape.group_size * tq;
  const int64_t rows_pad = load_query_tile(layout.prompt, query, batch, head, query_begin, tq, scratch.tiles);
  const scalar_t* pair_keys = keys + batch * layout.prompt.key_strides[0] + head * layout.prompt.key_strides[1];
  const scalar_t* pair_values = values + batch * layout.value_strides[0] + head * layout.value_strides[1];
  const float* pair_bias = log_weights + pair * shape.total_len;
  std::fill(scratch.rows_stats.begin(), scratch.rows_stats.begin() + rows_pad, kernels::SoftmaxPartial{});
  std::fill(scratch.outputs.begin(), scratch.outputs.begin() + rows_pad * layout.padded_head_dim, 0.0f);

  const int64_t key_end = layout.prompt.position(query_begin + tq - 1) + 1;  // the newest row's causal limit
  const int64_t key_tiles = (key_end + kKeyTile - 1) / kKeyTile, all_key_tiles = layout.padded_len / kKeyTile;
  for (int64_t key_tile = 0; key_tile < key_tiles; ++key_tile) {
    const int64_t key_begin = key_tile * kKeyTile, len = std::min(kKeyTile, key_end - key_begin);
    load_key_tile(layout.prompt, pair_keys, pair_bias, key_begin, len, scratch.tiles);
    load_value_tile(layout, pair_values, key_begin, len, scratch.values.data());
    for (int64_t row = 0; row < rows_pad; ++row) {
      scratch.visible[row] =
          row < rows ? visible_slots(layout.prompt.position(query_begin + row % tq), key_begin, len) : 0;
    }
    fused_key_tile_softmax(layout, rows_pad, key_tile, len, scratch);
    fused_key_tile_values(layout, rows_pad, key_tile, len, scratch);
  }

  for (int64_t row = 0; row < rows; ++row) {
    const int64_t g = row / tq, t = row % tq, query_head = head * shape.group_size + g;
    const kernels::SoftmaxPartial stats = scratch.rows_stats[row];
    const float row_lse = kernels::row_log_sum_exp(stats);
    lse[(batch * shape.query_heads + query_head) * shape.num_queries + query_begin + t] = row_lse;
    const float inverse = kernels::inverse_sum(stats.sum);
    const float* accumulated = scratch.outputs.data() + row * layout.padded_head_dim;
    scalar_t* out = output + batch * layout.output_strides[0] + (query_begin + t) * layout.output_strides[1] +
                    query_head * layout.output_strides[2];
    for (int64_t e = 0; e < d; ++e) out[e] = static_cast<scalar_t>(accumulated[e] * inverse);

    // A zero weight (an empty row, input_scale 0, or decay^age below float range) adds nothing: skipped exactly.
    const float weight = row_lse == -INFINITY ? 0.0f
                                              : kernels::query_weight(weights.decay, weights.input_scale,
                                                                      shape.num_queries - 1 - (query_begin + t));
    if (weight == 0.0f) continue;
    const float* probs = scratch.probs.data() + row * layout.padded_len;
    const int64_t visible_end = layout.prompt.position(query_begin + t) + 1;
    for (int64_t key_tile = 0; key_tile * kKeyTile < visible_end; ++key_tile) {
      const float tile_max = scratch.tile_max[row * all_key_tiles + key_tile];
      const FloatVec coefficient(weight * kernels::chunk_normaliser(tile_max, stats));
      const int64_t begin = key_tile * kKeyTile, end = std::min(begin + kKeyTile, visible_end);
      // Lanes past the row's causal limit are left alone: a NaN row holds NaN there too.
      for (int64_t c = begin; c < end; c += kLanes) {
        const int64_t lanes = std::min(kLanes, end - c);
        at::vec::fmadd(coefficient, FloatVec::loadu(probs + c, lanes), FloatVec::loadu(partial_scores + c, lanes))
            .store(partial_scores + c, lanes);
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> prompt_attention_with_scores_cpu(
    const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& log_weights,
    double scale, double decay, double input_scale) {
  const PromptScoresShape shape =
      check_prompt_attention_with_scores(query, keys, values, log_weights, scale, decay, input_scale);
  const at::Tensor query_c = with_unit_stride_last(query), keys_c = with_unit_stride_last(keys);
  const at::Tensor values_c = with_unit_stride_last(values), log_weights_c = log_weights.contiguous();
  at::Tensor output = at::empty({shape.batch, shape.num_queries, shape.query_heads, shape.head_dim}, query.options());
  at::Tensor lse = at::empty({shape.batch, shape.query_heads, shape.num_queries}, query.options().dtype(at::kFloat));
  const FusedLayout layout{make_layout(shape, query_c, keys_c, scale),
                           {values_c.stride(0), values_c.stride(1), values_c.stride(2)},
                           {output.stride(0), output.stride(1), output.stride(2)},
                           round_up(shape.head_dim, kBlockKeys),
                           round_up(shape.total_len, kKeyTile)};
  const int64_t pairs = shape.batch * shape.kv_heads, query_tiles = layout.query_tiles();
  const int64_t chunks = kernels::chunks_per_pair(pairs, query_tiles);
  const std::vector<int64_t> chunk_bounds =
      kernels::score_chunk_bounds(chunks, kFusedQueryTile, shape.num_queries, shape.total_len);
  // Partial column sums [chunk, pair, padded_len]; the lanes past T of the last key tile only ever add 0.
  at::Tensor partial_scores = at::zeros({chunks, pairs, layout.padded_len}, query.options().dtype(at::kFloat));
  const ScoreWeights weights{decay, input_scale};
  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::prompt_attention_with_scores", [&] {
    at::parallel_for(0, chunks * pairs, 1, [&](int64_t begin, int64_t end) {
      FusedScratch scratch(layout);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t chunk = task / pairs, pair = task % pairs;
        for (int64_t query_tile = chunk_bounds[chunk]; query_tile < chunk_bounds[chunk + 1]; ++query_tile) {
          fused_query_tile(layout, query_c.const_data_ptr<scalar_t>(), keys_c.const_data_ptr<scalar_t>(),
                           values_c.const_data_ptr<scalar_t>(), log_weights_c.const_data_ptr<float>(), weights, pair,
                           query_tile, scratch, output.mutable_data_ptr<scalar_t>(), lse.mutable_data_ptr<float>(),
                           partial_scores.mutable_data_ptr<float>() + (chunk * pairs + pair) * layout.padded_len);
        }
      }
    });
  });
  // The chunks' partial sums added in chunk order (a fixed order, not at::sum's, which may split by thread count).
  at::Tensor scores = at::empty({shape.batch, shape.kv_heads, shape.total_len}, query.options().dtype(at::kFloat));
  const float* partial = partial_scores.const_data_ptr<float>();
  float* out = scores.mutable_data_ptr<float>();
  for (int64_t pair = 0; pair < pairs; ++pair) {
    for (int64_t i = 0; i < shape.total_len; ++i) {
      float sum = 0.0f;
      for (int64_t chunk = 0; chunk < chunks; ++chunk) sum += partial[(chunk * pairs + pair) * layout.padded_len + i];
      out[pair * shape.total_len + i] = sum;
    }
  }
  return {output, lse, scores};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CPU, m) {
  m.impl("prompt_log_sum_exp", &prompt_log_sum_exp_cpu);
  m.impl("prompt_scores", &prompt_scores_cpu);
  m.impl("prompt_attention_with_scores", &prompt_attention_with_scores_cpu);
  m.impl("prompt_log_unnormalised_scores", &prompt_log_unnormalised_scores_cpu);
}

}  // namespace kvcomp
