// Validation, output shapes and the device-agnostic prefill selection of the zsmerge family, called first by the CPU
// and the CUDA kernels alike. The cache layout is described in kernels/zsmerge.h.
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <limits>

#include "kvcomp/checks.h"

namespace kvcomp {

// Slot budget per (batch, kv-head): M = residual + context + recent, summed once without overflow.
struct ZSMergeBudget {
  int64_t residual, context, recent, slots;
  int64_t total() const { return slots; }
};

inline ZSMergeBudget check_zsmerge_budget(const char* op, int64_t recent, int64_t context, int64_t residual) {
  check_at_least(op, "recent", recent, 1);
  check_at_least(op, "context", context, 1);
  check_at_least(op, "residual", residual, 0);
  const int64_t slots = checked_sum(op, {{"recent", recent}, {"context", context}, {"residual", residual}});
  return {residual, context, recent, slots};
}

// keys and values of one shape and dtype, scores float32 (B, H, slots) beside them, all on the device of keys.
inline void check_zsmerge_cache(const char* op, const at::Tensor& keys, const at::Tensor& values,
                                const at::Tensor& scores, const char* keys_layout, const char* scores_layout) {
  check_dim(op, "keys", keys, 4, keys_layout);
  check_dim(op, "values", values, 4, keys_layout);
  check_dim(op, "scores", scores, 3, scores_layout);
  check_floating(op, "keys", keys);
  TORCH_CHECK(values.scalar_type() == keys.scalar_type(), op, ": expected values of the dtype of keys (",
              keys.scalar_type(), "), got ", values.scalar_type());
  check_dtype(op, "scores", scores, at::kFloat);
  check_same_device(op, "values", values, "keys", keys);
  check_same_device(op, "scores", scores, "keys", keys);
  TORCH_CHECK(values.sizes() == keys.sizes(), op, ": expected values of the shape of keys (", keys.sizes(),
              "), got ", values.sizes());
  check_size(op, "scores", scores, 0, keys.size(0), "batch of keys");
  check_size(op, "scores", scores, 1, keys.size(1), "kv heads of keys");
  check_size(op, "scores", scores, 2, keys.size(2), "slots of keys");
}

struct ZSMergePrefillShape {
  int64_t batch, kv_heads, num_tokens, head_dim;
  ZSMergeBudget budget;
  int64_t residual_tokens;  // n = T - recent - context: the tokens averaged into the residual slots (or evicted)
};

inline ZSMergePrefillShape check_zsmerge_prefill(const at::Tensor& keys, const at::Tensor& values,
                                                 const at::Tensor& scores, int64_t recent, int64_t context,
                                                 int64_t residual) {
  constexpr const char* op = "kvcomp::zsmerge_prefill";
  check_zsmerge_cache(op, keys, values, scores, "(B, H, T, d)", "(B, H, T)");
  const ZSMergeBudget budget = check_zsmerge_budget(op, recent, context, residual);
  const int64_t tokens = keys.size(2);
  // T = M lays the tokens out with one per residual slot: Algorithm 1's cache when it first fills up.
  TORCH_CHECK(tokens >= budget.total(), op, ": expected at least as many tokens as slots, T = keys.size(2) >= M = ",
              "recent + context + residual = ", budget.total(), ", got T = ", tokens);
  // The ranking key of zsmerge_prefill_source_order holds a position in its low 32 bits.
  TORCH_CHECK(tokens <= std::numeric_limits<int32_t>::max(), op, ": expected at most 2^31 - 1 tokens, got T = ",
              tokens);
  return {keys.size(0), keys.size(1), tokens, keys.size(3), budget, tokens - recent - context};
}

struct ZSMergeDecodeShape {
  int64_t batch, kv_heads, num_new, head_dim;
  ZSMergeBudget budget;
  int64_t slots() const { return budget.total() + num_new; }  // M + q
};

inline ZSMergeDecodeShape check_zsmerge_decode_step(const at::Tensor& keys, const at::Tensor& values,
                                                    const at::Tensor& scores, const at::Tensor& counts,
                                                    int64_t ring_position, int64_t recent, int64_t context,
                                                    int64_t residual) {
  constexpr const char* op = "kvcomp::zsmerge_decode_step";
  check_zsmerge_cache(op, keys, values, scores, "(B, H, M + q, d)", "(B, H, M + q)");
  check_dim(op, "counts", counts, 3, "(B, H, M + q)");
  check_dtype(op, "counts", counts, at::kFloat);
  check_same_device(op, "counts", counts, "keys", keys);
  TORCH_CHECK(counts.sizes() == scores.sizes(), op, ": expected counts of the shape of scores (", scores.sizes(),
              "), got ", counts.sizes());
  check_contiguous_rows(op, "keys", keys);
  check_contiguous_rows(op, "values", values);
  check_contiguous_rows(op, "scores", scores);
  check_contiguous_rows(op, "counts", counts);
  check_inplace_arguments(op, {{"keys", &keys}, {"values", &values}, {"scores", &scores}, {"counts", &counts}});
  const ZSMergeBudget budget = check_zsmerge_budget(op, recent, context, residual);
  TORCH_CHECK(ring_position >= 0 && ring_position < recent, op, ": expected ring_position in [0, recent) = [0, ",
              recent, "), got ", ring_position);
  TORCH_CHECK(keys.size(2) > budget.total(), op, ": expected keys.size(2) = M + q with q >= 1 new tokens after the M = ",
              "recent + context + residual = ", budget.total(), " slots, got keys of shape ", keys.sizes());
  return {keys.size(0), keys.size(1), keys.size(2) - budget.total(), keys.size(3), budget};
}

// The prefill's choice of tokens, made with ATen ops on the device of the scores (no host round trip; the CUDA
// kernel's selection, while the CPU kernel runs the same order per row in C++, see cpu/zsmerge.cpp): for each
// (batch, kv-head) the token positions in the order the output slots consume them,
//   [ n residual tokens ascending | the context top-`context` ascending | the last `recent` tokens ascending ],
// shape (B, H, T) int64. Residual slot g averages entries residual_group_bounds(n, residual, g) of the first part;
// output slot residual + c copies entry n + c. With residual == 0 the first part is simply skipped (evicted).
//
// Ranking: a unique int64 key per candidate, order-preserving float bits in the high word (NaN below -inf, -0.0 as
// +0.0) and the reversed position in the low word, so topk picks the highest scores with ties to the lower position,
// identically on CPU and CUDA whatever the topk algorithm. Cost: about a dozen elementwise kernels over (B, H, T), one
// topk and one sort of int64 rows of T - recent; O(B H T log T), paid once per prompt.
inline at::Tensor zsmerge_prefill_source_order(const at::Tensor& scores, int64_t recent, int64_t context) {
  const int64_t tokens = scores.size(2);
  const int64_t candidates = tokens - recent;
  const auto long_options = scores.options().dtype(at::kLong);
  const at::Tensor candidate_scores = scores.narrow(2, 0, candidates) + 0.0;  // -0.0 + 0.0 == +0.0
  const at::Tensor bits = candidate_scores.view(at::kInt).to(at::kLong).bitwise_and(0xFFFFFFFFLL);
  constexpr int64_t sign = 1LL << 31;
  // Negative floats order by their complemented bits, non-negative ones above all of them: an unsigned 32-bit rank.
  at::Tensor rank = at::where(bits.ge(sign), 0xFFFFFFFFLL - bits, bits + sign);
  rank.masked_fill_(candidate_scores.isnan(), 0);
  const at::Tensor positions = at::arange(candidates, long_options);
  const at::Tensor key = (rank - sign) * (1LL << 32) + (0xFFFFFFFFLL - positions);
  const at::Tensor top = std::get<1>(key.topk(context, /*dim=*/2, /*largest=*/true, /*sorted=*/false));
  const at::Tensor in_context = at::zeros(key.sizes(), long_options).scatter_(2, top, 1);
  // Residual tokens (key = position) sort before context tokens (key = position + T); keys are unique.
  const at::Tensor source = std::get<1>((positions + in_context * tokens).sort(/*dim=*/2));
  const at::Tensor recent_positions =
      at::arange(candidates, tokens, long_options).expand({scores.size(0), scores.size(1), recent});
  return at::cat({source, recent_positions}, 2).contiguous();
}

}  // namespace kvcomp
