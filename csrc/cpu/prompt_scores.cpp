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

// block[rr][v] = scale * rows[rr] · keys_t[:, c + v * kLanes + lane]: kRowBlock rows against kBlockVectors vectors of
// keys.
inline void product_block(const float* const* rows, const float* keys_t, int64_t head_dim, int64_t c, float scale,
                          ProductBlock& block) {
  // Accumulated in a local array, which the compiler keeps in registers: `block` may alias the query rows (both are
  // floats to it), so accumulating there would store every accumulator at every step.
  ProductBlock acc;
  for (auto& row : acc) {
    for (auto& lanes : row) lanes = FloatVec(0.0f);
  }
  const float* row_ptrs[kRowBlock];
  std::copy(rows, rows + kRowBlock, row_ptrs);
  for (int64_t e = 0; e < head_dim; ++e) {
    FloatVec k[kBlockVectors];
    for (int64_t v = 0; v < kBlockVectors; ++v) k[v] = load_to_register(keys_t + e * kKeyTile + c + v * kLanes);
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
      product_block(rows + r, keys_t, head_dim, c, scale, block);
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
    const int64_t rows_pad = load_query_tile(layout, query, batch, head, query_begin, tq, scratch);
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
    for (int64_t r = 0; r < rows_pad; r += kRowBlock) {
      const int64_t block_visible =
          *std::max_element(tile_rows.visible.begin() + r, tile_rows.visible.begin() + r + kRowBlock);
      for (int64_t c = 0; c < block_visible; c += kBlockKeys) {
        ProductBlock block;
        product_block(scratch.rows.data() + r, scratch.keys_t.data(), d, c, layout.scale, block);
        for (int64_t rr = 0; rr < kRowBlock; ++rr) {
          const int64_t visible = tile_rows.visible[r + rr];
          const FloatVec lse_b(tile_rows.lse[r + rr]), weight_b(tile_rows.weight[r + rr]);
          for (int64_t v = 0; v < kBlockVectors && c + v * kLanes < visible; ++v) {
            const int64_t lane0 = c + v * kLanes;
            const FloatVec p =
                fast_exp(masked_logits(block[rr][v], bias, scratch.bias_finite, lane0, visible) - lse_b);
            acc[lane0 / kLanes] = at::vec::fmadd(weight_b, p, acc[lane0 / kLanes]);
          }
        }
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
      TileRows tile_rows(TileScratch::max_rows(shape));
      for (int64_t task = begin; task < end; ++task) {
        scores_task(layout, query_c.const_data_ptr<scalar_t>(), keys_c.const_data_ptr<scalar_t>(),
                    log_weights_c.const_data_ptr<float>(), lse_c.const_data_ptr<float>(), weights, task / key_tiles,
                    task % key_tiles, scratch, tile_rows, scores.mutable_data_ptr<float>());
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
