// CPU kernels of the zsmerge family.
//
// GCC 12 flags -Wmaybe-uninitialized inside _mm512_cvtph_ps (its pass-through operand is undefined by design)
// wherever c10::Half's AVX-512 float conversion gets inlined into a loop; a false positive in the intrinsic header.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <ATen/Parallel.h>
#include "cpu/vec.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "kernels/zsmerge.h"
#include "kvcomp/dispatch.h"
#include "kvcomp/zsmerge.h"

namespace kvcomp {
namespace {

using cpu::FloatVec;
using cpu::grain_for;
using cpu::load_as_float;
using cpu::store_from_float;

// ---------------------------------------------------------------------------------------------------------------
// zsmerge_prefill

// The source order of one (batch, kv-head), the same as zsmerge_prefill_source_order (kvcomp/zsmerge.h) computes
// with ATen ops on CUDA: [residual tokens ascending | context top-`context` ascending | recent]. Here a per-row
// nth_element under the same strict total order (score descending, NaN below every number, -0.0 == +0.0, ties to
// the lower position) and one linear pass, inside the op's parallel_for: no ATen launches per prefill.
void select_prefill_sources(const float* scores,  // [T]
                            int64_t tokens, int64_t recent, int64_t context,
                            std::vector<int64_t>& candidates,  // scratch
                            std::vector<char>& in_context,     // scratch
                            int64_t* order) {                  // [T]
  const int64_t num_candidates = tokens - recent;
  candidates.resize(num_candidates);
  for (int64_t position = 0; position < num_candidates; ++position) candidates[position] = position;
  const auto ranks_higher = [scores](int64_t a, int64_t b) {
    const bool nan_a = kernels::is_nan(scores[a]), nan_b = kernels::is_nan(scores[b]);
    if (nan_a != nan_b) return nan_b;
    if (!nan_a && scores[a] != scores[b]) return scores[a] > scores[b];
    return a < b;
  };
  std::nth_element(candidates.begin(), candidates.begin() + (context - 1), candidates.end(), ranks_higher);
  in_context.assign(num_candidates, 0);
  for (int64_t k = 0; k < context; ++k) in_context[candidates[k]] = 1;
  int64_t next_residual = 0, next_context = num_candidates - context;
  for (int64_t position = 0; position < num_candidates; ++position) {
    order[in_context[position] ? next_context++ : next_residual++] = position;
  }
  for (int64_t position = num_candidates; position < tokens; ++position) order[position] = position;
}

// One output slot of one (batch, kv-head): the float32 mean of `count` source rows (count = 1: a plain copy).
template <typename scalar_t>
void mean_of_rows(const scalar_t* rows,            // [T, d]
                  const int64_t* sources, int64_t count, int64_t head_dim,
                  float* accumulator,              // [d] scratch
                  scalar_t* out) {                 // [d]
  if (count == 1) {
    std::memcpy(out, rows + sources[0] * head_dim, head_dim * sizeof(scalar_t));
    return;
  }
  std::fill(accumulator, accumulator + head_dim, 0.0f);
  for (int64_t k = 0; k < count; ++k) {  // one contiguous source row at a time
    const scalar_t* row = rows + sources[k] * head_dim;
    for (int64_t c = 0; c < head_dim; c += FloatVec::size()) {
      const int64_t lanes = std::min<int64_t>(FloatVec::size(), head_dim - c);
      (FloatVec::loadu(accumulator + c, lanes) + load_as_float(row + c, lanes)).store(accumulator + c, lanes);
    }
  }
  const FloatVec size(static_cast<float>(count));
  for (int64_t c = 0; c < head_dim; c += FloatVec::size()) {
    const int64_t lanes = std::min<int64_t>(FloatVec::size(), head_dim - c);
    store_from_float(FloatVec::loadu(accumulator + c, lanes) / size, out + c, lanes);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> zsmerge_prefill_cpu(const at::Tensor& keys,
                                                                               const at::Tensor& values,
                                                                               const at::Tensor& scores,
                                                                               int64_t recent, int64_t context,
                                                                               int64_t residual) {
  const ZSMergePrefillShape shape = check_zsmerge_prefill(keys, values, scores, recent, context, residual);
  const at::Tensor keys_c = keys.contiguous();
  const at::Tensor values_c = values.contiguous();
  const at::Tensor scores_c = scores.contiguous();
  at::Tensor order = at::empty({shape.batch, shape.kv_heads, shape.num_tokens}, scores.options().dtype(at::kLong));
  {
    const float* scores_ptr = scores_c.const_data_ptr<float>();
    int64_t* order_ptr = order.mutable_data_ptr<int64_t>();
    const int64_t tokens = shape.num_tokens;
    at::parallel_for(0, shape.batch * shape.kv_heads, grain_for(16 * tokens), [&](int64_t begin, int64_t end) {
      std::vector<int64_t> candidates;
      std::vector<char> in_context;
      for (int64_t row = begin; row < end; ++row) {
        select_prefill_sources(scores_ptr + row * tokens, tokens, recent, context, candidates, in_context,
                               order_ptr + row * tokens);
      }
    });
  }
  const int64_t slots = shape.budget.total();
  at::Tensor out_keys = at::empty({shape.batch, shape.kv_heads, slots, shape.head_dim}, keys.options());
  at::Tensor out_values = at::empty_like(out_keys);
  at::Tensor out_scores = at::empty({shape.batch, shape.kv_heads, slots}, scores.options());
  at::Tensor out_counts = at::empty_like(out_scores);

  KVCOMP_DISPATCH_CACHE_TYPES(keys.scalar_type(), "kvcomp::zsmerge_prefill", [&] {
    const scalar_t* keys_ptr = keys_c.const_data_ptr<scalar_t>();
    const scalar_t* values_ptr = values_c.const_data_ptr<scalar_t>();
    const float* scores_ptr = scores_c.const_data_ptr<float>();
    const int64_t* order_ptr = order.const_data_ptr<int64_t>();
    scalar_t* out_keys_ptr = out_keys.mutable_data_ptr<scalar_t>();
    scalar_t* out_values_ptr = out_values.mutable_data_ptr<scalar_t>();
    float* out_scores_ptr = out_scores.mutable_data_ptr<float>();
    float* out_counts_ptr = out_counts.mutable_data_ptr<float>();
    const int64_t tokens = shape.num_tokens, head_dim = shape.head_dim, n = shape.residual_tokens;
    // A task is one output slot of one (batch, kv-head); residual slots read n / residual rows, the others one.
    const int64_t average_rows = (tokens + slots - 1) / slots;
    at::parallel_for(0, shape.batch * shape.kv_heads * slots, grain_for(2 * average_rows * head_dim),
                     [&](int64_t begin, int64_t end) {
      std::vector<float> accumulator(head_dim);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t row = task / slots, slot = task % slots;
        const int64_t* row_order = order_ptr + row * tokens;
        const float* row_scores = scores_ptr + row * tokens;
        const int64_t* sources;
        int64_t count;
        if (slot < residual) {
          const kernels::GroupBounds group = kernels::residual_group_bounds(n, residual, slot);
          sources = row_order + group.begin;
          count = group.end - group.begin;
        } else {
          sources = row_order + n + (slot - residual);
          count = 1;
        }
        float score = row_scores[sources[0]];
        for (int64_t k = 1; k < count; ++k) score = kernels::nan_propagating_max(score, row_scores[sources[k]]);
        const int64_t in_offset = row * tokens * head_dim, out_offset = task * head_dim;
        mean_of_rows(keys_ptr + in_offset, sources, count, head_dim, accumulator.data(), out_keys_ptr + out_offset);
        mean_of_rows(values_ptr + in_offset, sources, count, head_dim, accumulator.data(),
                     out_values_ptr + out_offset);
        out_scores_ptr[task] = score;
        out_counts_ptr[task] = static_cast<float>(count);
      }
    });
  });
  return {out_keys, out_values, out_scores, out_counts};
}

// ---------------------------------------------------------------------------------------------------------------
// zsmerge_decode_step

template <typename scalar_t>
float dot_as_float(const scalar_t* a, const scalar_t* b, int64_t head_dim) {
  FloatVec sum(0.0f);
  for (int64_t c = 0; c < head_dim; c += FloatVec::size()) {
    const int64_t lanes = std::min<int64_t>(FloatVec::size(), head_dim - c);
    sum = at::vec::fmadd(load_as_float(a + c, lanes), load_as_float(b + c, lanes), sum);
  }
  float lanes[FloatVec::size()];
  sum.store(lanes);
  float total = 0.0f;
  for (const float lane : lanes) total += lane;
  return total;
}

// i* = argmin over scores[begin, end) under kernels::EvictsFirst (NaN as +inf, the first slot on ties): a SIMD
// minimum of the keys, then the first slot holding it.
int64_t argmin_for_eviction(const float* scores, int64_t begin, int64_t end) {
  const FloatVec infinity(kernels::infinity());
  FloatVec lowest = infinity;
  int64_t slot = begin;
  for (; slot + FloatVec::size() <= end; slot += FloatVec::size()) {
    const FloatVec x = FloatVec::loadu(scores + slot);
    lowest = at::vec::minimum(lowest, FloatVec::blendv(x, infinity, x.isnan()));
  }
  float lanes[FloatVec::size()];
  lowest.store(lanes);
  float minimum = kernels::infinity();
  for (const float lane : lanes) minimum = std::min(minimum, lane);
  for (; slot < end; ++slot) minimum = std::min(minimum, kernels::EvictsFirst::key(scores[slot]));
  for (slot = begin; slot < end; ++slot) {
    if (kernels::EvictsFirst::key(scores[slot]) == minimum) return slot;
  }
  return begin;  // not reached: some slot holds the minimum
}

// row_j <- (w_i row_i + w_j row_j) / (w_i + w_j), float32 math.
template <typename scalar_t>
void merge_row(const scalar_t* row_i, float w_i, scalar_t* row_j, float w_j, int64_t head_dim) {
  const FloatVec weight_i(w_i), weight_j(w_j);
  for (int64_t c = 0; c < head_dim; c += FloatVec::size()) {
    const int64_t lanes = std::min<int64_t>(FloatVec::size(), head_dim - c);
    store_from_float(kernels::merge_weighted(load_as_float(row_i + c, lanes), weight_i, load_as_float(row_j + c, lanes),
                                             weight_j),
                     row_j + c, lanes);
  }
}

// All q steps of one (batch, kv-head), in the authors' or the paper's order (see the schema comment in
// registration.cpp).
template <typename scalar_t>
void decode_one_head(scalar_t* keys, scalar_t* values,  // [M + q, d]
                     float* scores, float* counts,        // [M + q]
                     const ZSMergeDecodeShape& shape, int64_t ring_position, bool paper_order) {
  const ZSMergeBudget& b = shape.budget;
  const int64_t head_dim = shape.head_dim, slots = b.total();
  const size_t row_bytes = head_dim * sizeof(scalar_t);
  for (int64_t step = 0; step < shape.num_new; ++step) {
    const int64_t r = kernels::oldest_recent_slot(b.residual, b.context, b.recent, ring_position, step);
    const int64_t lowest = argmin_for_eviction(scores, b.residual, b.residual + b.context);
    const int64_t i = kernels::evicted_slot({scores[lowest], lowest}, {scores[r], r}, paper_order).slot;
    scalar_t* key_i = keys + i * head_dim;
    scalar_t* value_i = values + i * head_dim;
    if (b.residual > 0) {
      kernels::SlotChoice target{dot_as_float(key_i, keys, head_dim), 0};
      for (int64_t slot = 1; slot < b.residual; ++slot) {
        const kernels::SlotChoice candidate{dot_as_float(key_i, keys + slot * head_dim, head_dim), slot};
        if (kernels::MergesFirst{}(candidate, target)) target = candidate;
      }
      const int64_t j = target.slot;
      merge_row(key_i, counts[i], keys + j * head_dim, counts[j], head_dim);
      merge_row(value_i, counts[i], values + j * head_dim, counts[j], head_dim);
      counts[j] += counts[i];
      scores[j] = kernels::nan_propagating_max(scores[i], scores[j]);
    }
    const int64_t fresh = slots + step;
    if (i != r) {  // the leaving token stays, in the context slot i* freed
      std::memcpy(key_i, keys + r * head_dim, row_bytes);
      std::memcpy(value_i, values + r * head_dim, row_bytes);
      scores[i] = scores[r];
      counts[i] = counts[r];
    }
    std::memcpy(keys + r * head_dim, keys + fresh * head_dim, row_bytes);
    std::memcpy(values + r * head_dim, values + fresh * head_dim, row_bytes);
    scores[r] = scores[fresh];
    counts[r] = counts[fresh];
  }
}

void zsmerge_decode_step_cpu(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& scores,
                             const at::Tensor& counts, int64_t ring_position, int64_t recent, int64_t context,
                             int64_t residual, bool paper_order) {
  const ZSMergeDecodeShape shape =
      check_zsmerge_decode_step(keys, values, scores, counts, ring_position, recent, context, residual);
  KVCOMP_DISPATCH_CACHE_TYPES(keys.scalar_type(), "kvcomp::zsmerge_decode_step", [&] {
    scalar_t* keys_ptr = keys.mutable_data_ptr<scalar_t>();
    scalar_t* values_ptr = values.mutable_data_ptr<scalar_t>();
    float* scores_ptr = scores.mutable_data_ptr<float>();
    float* counts_ptr = counts.mutable_data_ptr<float>();
    const kernels::RowStrides key_rows = row_strides(keys), value_rows = row_strides(values);
    const kernels::RowStrides score_rows = row_strides(scores), count_rows = row_strides(counts);
    const int64_t head_dim = shape.head_dim;
    const int64_t work_per_head = shape.num_new * (shape.budget.context + (shape.budget.residual + 6) * head_dim);
    // A task is one (batch, kv-head): its q steps depend on each other, the heads do not.
    at::parallel_for(0, shape.batch * shape.kv_heads, grain_for(work_per_head), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        decode_one_head(keys_ptr + key_rows.offset(row), values_ptr + value_rows.offset(row),
                        scores_ptr + score_rows.offset(row), counts_ptr + count_rows.offset(row), shape, ring_position,
                        paper_order);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CPU, m) {
  m.impl("zsmerge_prefill", &zsmerge_prefill_cpu);
  m.impl("zsmerge_decode_step", &zsmerge_decode_step_cpu);
}

}  // namespace kvcomp
