// CPU kernels of the kvzap family: the surrogate (ATen GEMMs; bias + GELU and bias + float32 as vectorised passes
// over the GEMM outputs, parallel over rows), the keep rule (one pass per (batch, head) row: decision and count), its
// decoding pass on a rectangular cache (the surrogate, then one pass per row that grows the state and decides) and on
// a paged cache (one serial pass over the rows).
#include <ATen/Parallel.h>
#include "cpu/vec.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>

#include "kernels/kvzap.h"
#include "kvcomp/dispatch.h"
#include "kvcomp/kvzap.h"

namespace kvcomp {
namespace {

namespace z = kernels::kvzap;
using cpu::FloatVec;
using cpu::load_as_float;
using cpu::store_from_float;

inline FloatVec gelu_lanes(const FloatVec& x) { return z::gelu_from_erf(x, (x * FloatVec(z::kInvSqrt2)).erf()); }

// pre (N, Dh') in place: GELU(pre + bias).
void bias_gelu_cpu_(at::Tensor& pre, const at::Tensor& bias) {
  const int64_t rows = pre.size(0), cols = pre.size(1);
  if (rows == 0 || cols == 0) return;
  const at::Tensor bias_f = bias.to(at::kFloat).contiguous();
  const float* bias_ptr = bias_f.const_data_ptr<float>();
  KVCOMP_DISPATCH_CACHE_TYPES(pre.scalar_type(), "kvcomp::kvzap_score", [&] {
    scalar_t* pre_ptr = pre.mutable_data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 16384 / cols);
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        scalar_t* values = pre_ptr + row * cols;
        for (int64_t col = 0; col < cols; col += FloatVec::size()) {
          const int64_t count = std::min<int64_t>(FloatVec::size(), cols - col);
          const FloatVec x = load_as_float(values + col, count) + FloatVec::loadu(bias_ptr + col, count);
          store_from_float(gelu_lanes(x), values + col, count);
        }
      }
    });
  });
}

// product (B, H, T) in the hidden dtype -> float32 product + bias[h] (in place when already float32).
at::Tensor bias_to_float_cpu(const at::Tensor& product, const at::Tensor& bias) {
  const int64_t heads = product.size(1), len = product.size(2), rows = product.size(0) * heads;
  at::Tensor out = product.scalar_type() == at::kFloat ? product : at::empty(product.sizes(), product.options().dtype(at::kFloat));
  if (rows == 0 || len == 0) return out;
  const at::Tensor bias_f = bias.to(at::kFloat).contiguous();
  const float* bias_ptr = bias_f.const_data_ptr<float>();
  float* out_ptr = out.mutable_data_ptr<float>();
  KVCOMP_DISPATCH_CACHE_TYPES(product.scalar_type(), "kvcomp::kvzap_score", [&] {
    const scalar_t* in_ptr = product.const_data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const FloatVec bias_v(bias_ptr[row % heads]);
        for (int64_t t = 0; t < len; t += FloatVec::size()) {
          const int64_t count = std::min<int64_t>(FloatVec::size(), len - t);
          (load_as_float(in_ptr + row * len + t, count) + bias_v).store(out_ptr + row * len + t, count);
        }
      }
    });
  });
  return out;
}

// held[row] = how many of the row's `len` slots decide_slot(row, t) reports held, parallel over the rows.
template <typename DecideSlot>
void count_held_per_row(int64_t* held, int64_t rows, int64_t len, const DecideSlot& decide_slot) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      int64_t count = 0;
      for (int64_t t = 0; t < len; ++t) count += decide_slot(row, t);
      held[row] = count;
    }
  });
}

at::Tensor kvzap_score_cpu(const at::Tensor& hidden, const at::Tensor& weight1, const at::Tensor& bias1,
                           const c10::optional<at::Tensor>& weight2, const c10::optional<at::Tensor>& bias2) {
  const KVzapScoreShape shape = check_kvzap_score(hidden, weight1, bias1, weight2, bias2);
  return run_kvzap_surrogate(hidden, weight1, bias1, weight2, bias2, shape, bias_gelu_cpu_, bias_to_float_cpu);
}

std::tuple<at::Tensor, at::Tensor> kvzap_threshold_cpu(const at::Tensor& log_weights, const at::Tensor& scores,
                                                       const at::Tensor& positions, double threshold, int64_t window,
                                                       int64_t tokens_before, int64_t tokens_after) {
  const KVzapThresholdShape shape =
      check_kvzap_threshold(log_weights, scores, positions, threshold, window, tokens_before, tokens_after);
  const at::Tensor log_weights_c = log_weights.contiguous(), scores_c = scores.contiguous();
  const at::Tensor positions_c = positions.contiguous();
  at::Tensor out = at::empty_like(log_weights_c);
  at::Tensor held = at::empty({shape.batch, shape.heads}, log_weights.options().dtype(at::kLong));
  if (shape.rows() == 0) return {out, held};
  const float* lw_ptr = log_weights_c.const_data_ptr<float>();
  const float* score_ptr = scores_c.const_data_ptr<float>();
  const int64_t* pos_ptr = positions_c.const_data_ptr<int64_t>();
  float* out_ptr = out.mutable_data_ptr<float>();
  int64_t* held_ptr = held.mutable_data_ptr<int64_t>();
  const z::DecisionRange range = z::decision_range(tokens_before, tokens_after, window);
  const float threshold_f = static_cast<float>(threshold);
  count_held_per_row(held_ptr, shape.rows(), shape.len, [&](int64_t row, int64_t t) {
    const int64_t slot = row * shape.len + t;
    out_ptr[slot] = z::thresholded_log_weight(lw_ptr[slot], score_ptr[slot], pos_ptr[slot], range, threshold_f);
    return z::is_held(out_ptr[slot]);
  });
  return {out, held};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kvzap_decode_step_cpu(
    const at::Tensor& hidden, const at::Tensor& weight1, const at::Tensor& bias1,
    const c10::optional<at::Tensor>& weight2, const c10::optional<at::Tensor>& bias2, const at::Tensor& log_weights,
    const at::Tensor& scores, const at::Tensor& positions, double threshold, int64_t window, int64_t tokens_before) {
  const KVzapDecodeStepShape shape = check_kvzap_decode_step(hidden, weight1, bias1, weight2, bias2, log_weights, scores,
                                                             positions, threshold, window, tokens_before);
  const at::Tensor new_scores =  // (B, H, q), contiguous
      run_kvzap_surrogate(hidden, weight1, bias1, weight2, bias2, shape.surrogate, bias_gelu_cpu_, bias_to_float_cpu);
  KVzapDecodeStepTensors state = kvzap_decode_step_tensors(log_weights, scores, positions);
  at::Tensor held = at::empty({shape.surrogate.batch, shape.surrogate.heads}, positions.options());
  const z::GrowingRows rows = state.rows(shape, new_scores.const_data_ptr<float>(), shape.new_tokens(), tokens_before);
  const z::DecisionRange range = z::decision_range(tokens_before, tokens_before + shape.new_tokens(), window);
  const float threshold_f = static_cast<float>(threshold);
  count_held_per_row(held.mutable_data_ptr<int64_t>(), shape.rows(), shape.slots_after(), [&](int64_t row, int64_t t) {
    return z::grow_and_decide_slot(rows, row, t, range, threshold_f);
  });
  return state.outputs(held);
}

at::Tensor kvzap_paged_step_cpu(at::Tensor& log_weight_blocks, at::Tensor& score_blocks, at::Tensor& position_blocks,
                                const at::Tensor& block_tables, const at::Tensor& lengths, const at::Tensor& new_scores,
                                double threshold, int64_t window, int64_t tokens_before, bool check_tables_on_device) {
  const KVzapPagedStepShape shape = check_kvzap_paged_step(log_weight_blocks, score_blocks, position_blocks,
                                                           block_tables, lengths, new_scores, threshold, window,
                                                           tokens_before, check_tables_on_device);
  at::Tensor held = at::empty({shape.batch, shape.heads}, lengths.options());
  const at::Tensor tables_c = block_tables.contiguous(), lengths_c = lengths.contiguous();
  const at::Tensor new_scores_c = new_scores.contiguous();
  const int64_t* table_ptr = tables_c.const_data_ptr<int64_t>();
  const int64_t* length_ptr = lengths_c.const_data_ptr<int64_t>();
  const float* new_ptr = new_scores_c.const_data_ptr<float>();
  float* lw_ptr = log_weight_blocks.mutable_data_ptr<float>();
  float* score_ptr = score_blocks.mutable_data_ptr<float>();
  int64_t* pos_ptr = position_blocks.mutable_data_ptr<int64_t>();
  int64_t* held_ptr = held.mutable_data_ptr<int64_t>();
  // A decoding pass decides about one slot per row: the rows are too small to share out over threads.
  for (int64_t row = 0; row < shape.rows(); ++row) {
    const z::PagedRow paged{table_ptr + row * shape.max_blocks, shape.block_size, length_ptr[row]};
    held_ptr[row] = z::paged_step_row(lw_ptr, score_ptr, pos_ptr, paged, new_ptr + row * shape.new_tokens,
                                      shape.new_tokens, tokens_before, window, static_cast<float>(threshold));
  }
  return held;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CPU, m) {
  m.impl("kvzap_score", &kvzap_score_cpu);
  m.impl("kvzap_threshold", &kvzap_threshold_cpu);
  m.impl("kvzap_decode_step", &kvzap_decode_step_cpu);
  m.impl("kvzap_paged_step", &kvzap_paged_step_cpu);
}

}  // namespace kvcomp
