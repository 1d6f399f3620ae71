// Validation and output shapes of the kvzap family, called first by the CPU and the CUDA kernels alike, and the
// surrogate driver they share: the GEMMs are ATen's (MKL / oneDNN on CPU, cuBLAS on CUDA), the elementwise passes
// around them (bias + GELU after the first GEMM, bias + float32 after the last) are each device's own kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "kernels/kvzap.h"
#include "kvcomp/block_tables.h"
#include "kvcomp/checks.h"

namespace kvcomp {

struct KVzapScoreShape {
  int64_t batch, len, input_dim, hidden_dim, heads;  // hidden_dim = 0 for the linear surrogate
  bool mlp() const { return hidden_dim > 0; }
};

// `op` names the caller in the errors: kvzap_decode_step checks its surrogate arguments here too.
inline KVzapScoreShape check_kvzap_score(const at::Tensor& hidden, const at::Tensor& weight1, const at::Tensor& bias1,
                                         const c10::optional<at::Tensor>& weight2,
                                         const c10::optional<at::Tensor>& bias2,
                                         const char* op = "kvcomp::kvzap_score") {
  check_dim(op, "hidden", hidden, 3, "(B, T, Dh)");
  check_floating(op, "hidden", hidden);
  const bool mlp = weight2.has_value();
  TORCH_CHECK(mlp == bias2.has_value(), op, ": expected weight2 and bias2 both given (MLP surrogate) or both None "
              "(linear surrogate), got weight2 ", mlp ? "given" : "None", " and bias2 ",
              bias2.has_value() ? "given" : "None");
  check_dim(op, "weight1", weight1, 2, mlp ? "(Dh', Dh)" : "(H, Dh)");
  check_dim(op, "bias1", bias1, 1, mlp ? "(Dh')" : "(H)");
  const auto same_dtype = [&](const char* name, const at::Tensor& t) {
    TORCH_CHECK(t.scalar_type() == hidden.scalar_type(), op, ": expected ", name, " of the dtype of hidden (",
                hidden.scalar_type(), "), got ", t.scalar_type());
    check_same_device(op, name, t, "hidden", hidden);
  };
  same_dtype("weight1", weight1);
  same_dtype("bias1", bias1);
  KVzapScoreShape shape{hidden.size(0), hidden.size(1), hidden.size(2), 0, weight1.size(0)};
  check_size(op, "weight1", weight1, 1, shape.input_dim, "hidden size Dh of hidden");
  check_size(op, "bias1", bias1, 0, weight1.size(0), "output size of weight1");
  if (mlp) {
    const at::Tensor& w2 = *weight2;
    const at::Tensor& b2 = *bias2;
    check_dim(op, "weight2", w2, 2, "(H, Dh')");
    check_dim(op, "bias2", b2, 1, "(H)");
    same_dtype("weight2", w2);
    same_dtype("bias2", b2);
    shape.hidden_dim = weight1.size(0);
    shape.heads = w2.size(0);
    check_size(op, "weight2", w2, 1, shape.hidden_dim, "output size of weight1");
    check_size(op, "bias2", b2, 0, shape.heads, "output size of weight2");
    TORCH_CHECK(shape.hidden_dim >= 1, op, ": expected a hidden layer of at least one unit, got weight1 of shape ",
                weight1.sizes());
  }
  TORCH_CHECK(shape.heads >= 1, op, ": expected at least one output head, got ", mlp ? "weight2" : "weight1",
              " of shape ", (mlp ? *weight2 : weight1).sizes());
  return shape;
}

// The surrogate on hidden (B, T, Dh) -> (B, H, T) float32:
//   bias_gelu_(pre, bias): pre (N, Dh') contiguous, in place: GELU(pre + bias), rounded to pre's dtype;
//   bias_to_float(product, bias): product (B, H, T) contiguous, in hidden's dtype -> float32 product + bias[h]
//     (may reuse product's storage when it is already float32).
// The last GEMM computes W·xᵀ per batch row, so its output is already (B, H, T): no transpose pass.
template <typename BiasGelu, typename BiasToFloat>
at::Tensor run_kvzap_surrogate(const at::Tensor& hidden, const at::Tensor& weight1, const at::Tensor& bias1,
                               const c10::optional<at::Tensor>& weight2, const c10::optional<at::Tensor>& bias2,
                               const KVzapScoreShape& shape, BiasGelu&& bias_gelu_, BiasToFloat&& bias_to_float) {
  at::Tensor input = hidden;  // (B, T, D_in)
  if (shape.mlp()) {
    at::Tensor pre = at::mm(hidden.reshape({shape.batch * shape.len, shape.input_dim}), weight1.t());
    bias_gelu_(pre, bias1.contiguous());
    input = pre.view({shape.batch, shape.len, shape.hidden_dim});
  }
  const at::Tensor& weight = shape.mlp() ? *weight2 : weight1;
  const at::Tensor& bias = shape.mlp() ? *bias2 : bias1;
  at::Tensor product = shape.batch == 1 ? at::mm(weight, input.select(0, 0).t()).unsqueeze(0)
                                        : at::matmul(weight, input.transpose(1, 2));
  return bias_to_float(product.contiguous(), bias.contiguous());
}

// The per-slot state a keep-rule pass reads: log-weights and scores float32, positions int64, each 3-d, all on the
// device of `device_name`. A decoding step's log-weights also hold its new tokens (log_weights_layout says so).
inline void check_slot_state(const char* op, const at::Tensor& log_weights, const char* log_weights_layout,
                             const at::Tensor& scores, const at::Tensor& positions, const char* state_layout,
                             const char* device_name, const at::Tensor& device_of) {
  check_dim(op, "log_weights", log_weights, 3, log_weights_layout);
  check_dim(op, "scores", scores, 3, state_layout);
  check_dim(op, "positions", positions, 3, state_layout);
  check_dtype(op, "log_weights", log_weights, at::kFloat);
  check_dtype(op, "scores", scores, at::kFloat);
  check_dtype(op, "positions", positions, at::kLong);
  check_same_device(op, "log_weights", log_weights, device_name, device_of);
  check_same_device(op, "scores", scores, device_name, device_of);
  check_same_device(op, "positions", positions, device_name, device_of);
}

// The keep rule's scalars: τ not NaN (±inf allowed), window and tokens_before >= 0.
inline void check_keep_rule(const char* op, double threshold, int64_t window, int64_t tokens_before) {
  TORCH_CHECK(!std::isnan(threshold), op, ": expected a threshold that is not NaN, got threshold = ", Exact{threshold});
  check_at_least(op, "window", window, 0);
  check_at_least(op, "tokens_before", tokens_before, 0);
}

struct KVzapThresholdShape {
  int64_t batch, heads, len;
  int64_t rows() const { return batch * heads; }
};

inline KVzapThresholdShape check_kvzap_threshold(const at::Tensor& log_weights, const at::Tensor& scores,
                                                 const at::Tensor& positions, double threshold, int64_t window,
                                                 int64_t tokens_before, int64_t tokens_after) {
  constexpr const char* op = "kvcomp::kvzap_threshold";
  check_slot_state(op, log_weights, "(B, H, T)", scores, positions, "(B, H, T)", "log_weights", log_weights);
  const KVzapThresholdShape shape{log_weights.size(0), log_weights.size(1), log_weights.size(2)};
  for (int64_t dim = 0; dim < 3; ++dim) {
    check_size(op, "scores", scores, dim, log_weights.size(dim), "shape of log_weights");
    check_size(op, "positions", positions, dim, log_weights.size(dim), "shape of log_weights");
  }
  check_keep_rule(op, threshold, window, tokens_before);
  TORCH_CHECK(tokens_after >= tokens_before, op, ": expected tokens_after >= tokens_before (", tokens_before,
              "), got tokens_after = ", tokens_after);
  return shape;
}

struct KVzapDecodeStepShape {
  KVzapScoreShape surrogate;  // its len is q, the pass's new tokens
  int64_t slots_before;       // T: the slots whose scores and positions the state holds
  int64_t rows() const { return surrogate.batch * surrogate.heads; }
  int64_t new_tokens() const { return surrogate.len; }
  int64_t slots_after() const { return slots_before + surrogate.len; }
};

inline KVzapDecodeStepShape check_kvzap_decode_step(const at::Tensor& hidden, const at::Tensor& weight1,
                                                    const at::Tensor& bias1, const c10::optional<at::Tensor>& weight2,
                                                    const c10::optional<at::Tensor>& bias2,
                                                    const at::Tensor& log_weights, const at::Tensor& scores,
                                                    const at::Tensor& positions, double threshold, int64_t window,
                                                    int64_t tokens_before) {
  constexpr const char* op = "kvcomp::kvzap_decode_step";
  const KVzapScoreShape surrogate = check_kvzap_score(hidden, weight1, bias1, weight2, bias2, op);
  check_slot_state(op, log_weights, "(B, H, T + q)", scores, positions, "(B, H, T)", "hidden", hidden);
  check_size(op, "log_weights", log_weights, 0, surrogate.batch, "batch size B of hidden");
  check_size(op, "log_weights", log_weights, 1, surrogate.heads, "output heads H of the surrogate");
  TORCH_CHECK(log_weights.size(2) >= surrogate.len, op, ": expected log_weights with a slot for each of the q = ",
              surrogate.len, " new tokens, got log_weights of shape ", log_weights.sizes());
  const KVzapDecodeStepShape shape{surrogate, log_weights.size(2) - surrogate.len};
  for (int64_t dim = 0; dim < 2; ++dim) {
    check_size(op, "scores", scores, dim, log_weights.size(dim), "shape of log_weights");
    check_size(op, "positions", positions, dim, log_weights.size(dim), "shape of log_weights");
  }
  check_size(op, "scores", scores, 2, shape.slots_before, "slots of log_weights before the q new tokens");
  check_size(op, "positions", positions, 2, shape.slots_before, "slots of log_weights before the q new tokens");
  check_keep_rule(op, threshold, window, tokens_before);
  checked_sum(op, {{"tokens_before", tokens_before}, {"q", surrogate.len}});
  return shape;
}

// kvzap_decode_step's state read contiguous and its grown state allocated, for the CPU and the CUDA kernel alike;
// each device allocates the held counts its own way (the CUDA blocks add into zeros).
struct KVzapDecodeStepTensors {
  at::Tensor log_weights, scores, positions;              // inputs: (B, H, T + q), (B, H, T), (B, H, T)
  at::Tensor log_weights_out, scores_out, positions_out;  // (B, H, T + q)

  // The kernels' view of them, the new tokens' scores of row r at new_scores + r * new_scores_stride.
  kernels::kvzap::GrowingRows rows(const KVzapDecodeStepShape& shape, const float* new_scores, int64_t new_scores_stride,
                                   int64_t tokens_before) {
    return {log_weights.const_data_ptr<float>(),   scores.const_data_ptr<float>(),
            positions.const_data_ptr<int64_t>(),   new_scores,
            new_scores_stride,                     log_weights_out.mutable_data_ptr<float>(),
            scores_out.mutable_data_ptr<float>(),  positions_out.mutable_data_ptr<int64_t>(),
            shape.slots_before,                    shape.new_tokens(),
            tokens_before};
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> outputs(const at::Tensor& held) const {
    return {log_weights_out, scores_out, positions_out, held};
  }
};

inline KVzapDecodeStepTensors kvzap_decode_step_tensors(const at::Tensor& log_weights, const at::Tensor& scores,
                                                        const at::Tensor& positions) {
  KVzapDecodeStepTensors t{log_weights.contiguous(), scores.contiguous(), positions.contiguous(), {}, {}, {}};
  t.log_weights_out = at::empty_like(t.log_weights);
  t.scores_out = at::empty_like(t.log_weights);
  t.positions_out = at::empty(t.log_weights.sizes(), positions.options());
  return t;
}

struct KVzapPagedStepShape {
  int64_t batch, heads, new_tokens, block_size, max_blocks;
  int64_t rows() const { return batch * heads; }
};

// Checks shapes, dtypes, devices and the in-place pools, and the block tables' contents (check_block_table_contents,
// every length in [q, max_blocks * block_size]: the q new tokens are each row's last slots; no block shared, as the op
// writes through the tables): one host sync on a GPU, unless check_tables_on_device leaves the contents to the kernel
// there (lengths and ranges only: tables a PagedKVCache built, whose allocator gives each block one owner).
inline KVzapPagedStepShape check_kvzap_paged_step(const at::Tensor& log_weight_blocks, const at::Tensor& score_blocks,
                                                  const at::Tensor& position_blocks, const at::Tensor& block_tables,
                                                  const at::Tensor& lengths, const at::Tensor& new_scores,
                                                  double threshold, int64_t window, int64_t tokens_before,
                                                  bool check_tables_on_device) {
  constexpr const char* op = "kvcomp::kvzap_paged_step";
  check_dim(op, "log_weight_blocks", log_weight_blocks, 2, "(N, S)");
  check_dim(op, "score_blocks", score_blocks, 2, "(N, S)");
  check_dim(op, "position_blocks", position_blocks, 2, "(N, S)");
  check_dim(op, "block_tables", block_tables, 3, "(B, H, max_blocks)");
  check_dim(op, "lengths", lengths, 2, "(B, H)");
  check_dim(op, "new_scores", new_scores, 3, "(B, H, q)");
  check_dtype(op, "log_weight_blocks", log_weight_blocks, at::kFloat);
  check_dtype(op, "score_blocks", score_blocks, at::kFloat);
  check_dtype(op, "position_blocks", position_blocks, at::kLong);
  check_dtype(op, "block_tables", block_tables, at::kLong);
  check_dtype(op, "lengths", lengths, at::kLong);
  check_dtype(op, "new_scores", new_scores, at::kFloat);
  check_same_device(op, "score_blocks", score_blocks, "log_weight_blocks", log_weight_blocks);
  check_same_device(op, "position_blocks", position_blocks, "log_weight_blocks", log_weight_blocks);
  check_same_device(op, "block_tables", block_tables, "log_weight_blocks", log_weight_blocks);
  check_same_device(op, "lengths", lengths, "log_weight_blocks", log_weight_blocks);
  check_same_device(op, "new_scores", new_scores, "log_weight_blocks", log_weight_blocks);
  const KVzapPagedStepShape shape{block_tables.size(0), block_tables.size(1), new_scores.size(2),
                                  log_weight_blocks.size(1), block_tables.size(2)};
  for (int64_t dim = 0; dim < 2; ++dim) {
    check_size(op, "score_blocks", score_blocks, dim, log_weight_blocks.size(dim), "shape of log_weight_blocks");
    check_size(op, "position_blocks", position_blocks, dim, log_weight_blocks.size(dim), "shape of log_weight_blocks");
    check_size(op, "lengths", lengths, dim, block_tables.size(dim), "(B, H) of block_tables");
    check_size(op, "new_scores", new_scores, dim, block_tables.size(dim), "(B, H) of block_tables");
  }
  TORCH_CHECK(shape.block_size >= 1, op, ": expected a block size (log_weight_blocks.size(1)) >= 1, got ",
              shape.block_size);
  TORCH_CHECK(shape.new_tokens >= 1, op, ": expected at least one new token, got new_scores of shape ",
              new_scores.sizes());
  check_keep_rule(op, threshold, window, tokens_before);
  checked_sum(op, {{"tokens_before", tokens_before}, {"q", shape.new_tokens}});
  check_contiguous(op, "log_weight_blocks", log_weight_blocks);
  check_contiguous(op, "score_blocks", score_blocks);
  check_contiguous(op, "position_blocks", position_blocks);
  check_inplace_arguments(op, {{"log_weight_blocks", &log_weight_blocks}, {"score_blocks", &score_blocks},
                               {"position_blocks", &position_blocks}});
  check_inputs_apart(op, {{"log_weight_blocks", &log_weight_blocks}, {"score_blocks", &score_blocks},
                          {"position_blocks", &position_blocks}},
                     {{"block_tables", &block_tables}, {"lengths", &lengths}, {"new_scores", &new_scores}});
  if (!check_tables_on_device || lengths.is_cpu()) {
    check_block_table_contents(op, block_tables, lengths, log_weight_blocks.size(0), shape.block_size,
                               shape.new_tokens, "the q new tokens to max_blocks * block size",
                               /*exclusive_blocks=*/true);
  }
  return shape;
}

}  // namespace kvcomp
