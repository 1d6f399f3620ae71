// Validation and output shapes of the keepkv family, called first by the CPU and the CUDA kernels alike, plus the
// ATen pieces the CUDA path builds on the device (the partition of a row into evicted and retained slots, the
// members of each merge set). Device-free math: kernels/keepkv.h.
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <utility>

#include "kvcomp/checks.h"

namespace kvcomp {

struct KeepKVShape {
  int64_t batch, kv_heads, slots, head_dim;
  int64_t rows() const { return batch * kv_heads; }
};

inline void check_keepkv_keys(const char* op, const at::Tensor& keys) {
  check_dim(op, "keys", keys, 4, "(B, H, T, d)");
  check_floating(op, "keys", keys);
}

// values (B, H, T, d) beside keys: same dtype, device and shape.
inline void check_keepkv_values(const char* op, const at::Tensor& values, const at::Tensor& keys) {
  check_dim(op, "values", values, 4, "(B, H, T, d)");
  TORCH_CHECK(values.scalar_type() == keys.scalar_type(), op, ": expected values of the dtype of keys (",
              keys.scalar_type(), "), got ", values.scalar_type());
  check_same_device(op, "values", values, "keys", keys);
  TORCH_CHECK(values.sizes() == keys.sizes(), op, ": expected values of the shape of keys (", keys.sizes(),
              "), got ", values.sizes());
}

// A (B, H, T) per-slot tensor beside keys (B, H, T, d).
inline void check_keepkv_per_slot(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype,
                                  const at::Tensor& keys) {
  check_dim(op, name, t, 3, "(B, H, T)");
  check_dtype(op, name, t, dtype);
  check_same_device(op, name, t, "keys", keys);
  check_size(op, name, t, 0, keys.size(0), "batch of keys");
  check_size(op, name, t, 1, keys.size(1), "kv heads of keys");
  check_size(op, name, t, 2, keys.size(2), "slots of keys");
}

inline KeepKVShape check_keepkv_match(const at::Tensor& keys, const at::Tensor& keep, double threshold,
                                      std::optional<int64_t> max_evicted = std::nullopt) {
  constexpr const char* op = "kvcomp::keepkv_match";
  check_keepkv_keys(op, keys);
  check_keepkv_per_slot(op, "keep", keep, at::kBool, keys);
  check_range(op, "threshold", threshold, -1.0, 1.0);  // NaN fails the range test too
  TORCH_CHECK(!max_evicted.has_value() || *max_evicted >= 0, op, ": expected max_evicted >= 0, got ", *max_evicted);
  return {keys.size(0), keys.size(1), keys.size(2), keys.size(3)};
}

inline KeepKVShape check_keepkv_zip_merge(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& votes,
                                          const at::Tensor& log_scores, const at::Tensor& targets) {
  constexpr const char* op = "kvcomp::keepkv_zip_merge";
  check_keepkv_keys(op, keys);
  check_keepkv_values(op, values, keys);
  check_keepkv_per_slot(op, "votes", votes, at::kFloat, keys);
  check_keepkv_per_slot(op, "log_scores", log_scores, at::kFloat, keys);
  check_keepkv_per_slot(op, "targets", targets, at::kLong, keys);
  return {keys.size(0), keys.size(1), keys.size(2), keys.size(3)};
}

struct KeepKVStepShape {
  KeepKVShape cache;
  int64_t group, queries, kept;  // query heads per kv head, new tokens q, slots after the step min(T, budget)
};

inline KeepKVStepShape check_keepkv_decode_step(const at::Tensor& keys, const at::Tensor& values,
                                                const at::Tensor& queries, const at::Tensor& probabilities,
                                                const at::Tensor& log_weights, const at::Tensor& log_ema,
                                                const at::Tensor& age, const at::Tensor& votes, double scale,
                                                double ema_decay, int64_t budget, int64_t sinks, int64_t recent,
                                                double threshold) {
  constexpr const char* op = "kvcomp::keepkv_decode_step";
  check_keepkv_keys(op, keys);
  check_keepkv_values(op, values, keys);
  check_contiguous_rows(op, "keys", keys);
  check_contiguous_rows(op, "values", values);
  check_inplace_arguments(op, {{"keys", &keys}, {"values", &values}});
  check_dim(op, "queries", queries, 4, "(B, Hq, q, d)");
  TORCH_CHECK(queries.scalar_type() == keys.scalar_type(), op, ": expected queries of the dtype of keys (",
              keys.scalar_type(), "), got ", queries.scalar_type());
  check_same_device(op, "queries", queries, "keys", keys);
  check_size(op, "queries", queries, 0, keys.size(0), "batch of keys");
  check_size(op, "queries", queries, 3, keys.size(3), "head dim of keys");
  const int64_t kv_heads = keys.size(1), query_heads = queries.size(1), new_tokens = queries.size(2);
  TORCH_CHECK(kv_heads > 0 && query_heads > 0 && query_heads % kv_heads == 0, op, ": expected the ", query_heads,
              " query heads of queries to be a positive multiple of the ", kv_heads, " kv heads of keys");
  TORCH_CHECK(new_tokens >= 1 && new_tokens <= keys.size(2), op, ": expected queries.size(2) = q new tokens in [1, T",
              " = ", keys.size(2), "], got ", new_tokens);
  check_dim(op, "probabilities", probabilities, 4, "(B, Hq, q, T)");
  check_dtype(op, "probabilities", probabilities, at::kFloat);
  check_same_device(op, "probabilities", probabilities, "keys", keys);
  check_size(op, "probabilities", probabilities, 0, keys.size(0), "batch of keys");
  check_size(op, "probabilities", probabilities, 1, query_heads, "query heads of queries");
  check_size(op, "probabilities", probabilities, 2, new_tokens, "new tokens of queries");
  check_size(op, "probabilities", probabilities, 3, keys.size(2), "slots of keys");
  check_keepkv_per_slot(op, "log_weights", log_weights, at::kFloat, keys);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"log_ema", log_ema}, {"age", age},
                                {"votes", votes}}) {
    check_dim(op, name, t, 3, "(B, H, T - q)");
    check_dtype(op, name, t, at::kFloat);
    check_same_device(op, name, t, "keys", keys);
    check_size(op, name, t, 0, keys.size(0), "batch of keys");
    check_size(op, name, t, 1, kv_heads, "kv heads of keys");
    check_size(op, name, t, 2, keys.size(2) - new_tokens, "the slots before the q new tokens, T - q");
  }
  check_finite(op, "scale", scale);
  TORCH_CHECK(ema_decay > 0.0 && ema_decay < 1.0, op, ": expected ema_decay in (0, 1), got ", Exact{ema_decay});
  check_at_least(op, "sinks", sinks, 0);
  check_at_least(op, "recent", recent, 1);
  TORCH_CHECK(budget > checked_sum(op, {{"sinks", sinks}, {"recent", recent}}), op,
              ": expected budget > sinks + recent (a heavy hitter to evict), got budget = ", budget, ", sinks = ",
              sinks, ", recent = ", recent);
  check_range(op, "threshold", threshold, -1.0, 1.0);
  check_inputs_apart(op, {{"keys", &keys}, {"values", &values}},
                     {{"queries", &queries}, {"probabilities", &probabilities}, {"log_weights", &log_weights},
                      {"log_ema", &log_ema}, {"age", &age}, {"votes", &votes}});
  return {{keys.size(0), kv_heads, keys.size(2), keys.size(3)}, query_heads / kv_heads, new_tokens,
          std::min(keys.size(2), budget)};
}

// keepkv_decode_step's inputs as both kernels read them (queries and probabilities contiguous; the per-slot tensors
// read row by row where they lie, as a paged cache's view over its pools) and its outputs, allocated: log_ema, age,
// votes, log_weights (B, H, M) and dropped (B, H), float32.
struct KeepKVStepTensors {
  at::Tensor queries, probabilities, log_weights, log_ema, age, votes;
  at::Tensor out_log_ema, out_age, out_votes, out_log_weights, out_dropped;

  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> outputs() const {
    return {out_log_ema, out_age, out_votes, out_log_weights, out_dropped};
  }
};

inline KeepKVStepTensors keepkv_step_tensors(const KeepKVStepShape& shape, const at::Tensor& queries,
                                             const at::Tensor& probabilities, const at::Tensor& log_weights,
                                             const at::Tensor& log_ema, const at::Tensor& age,
                                             const at::Tensor& votes) {
  const int64_t batch = shape.cache.batch, kv_heads = shape.cache.kv_heads, kept = shape.kept;
  const auto per_slot = log_ema.options();
  return {queries.contiguous(), probabilities.contiguous(), with_contiguous_rows(log_weights),
          with_contiguous_rows(log_ema), with_contiguous_rows(age), with_contiguous_rows(votes),
          at::empty({batch, kv_heads, kept}, per_slot), at::empty({batch, kv_heads, kept}, per_slot),
          at::empty({batch, kv_heads, kept}, per_slot), at::empty({batch, kv_heads, kept}, per_slot),
          at::empty({batch, kv_heads}, per_slot)};
}

// The error for a target that is neither -1, -2 nor a retained slot of its row; the same words on CPU and CUDA.
[[noreturn]] inline void fail_keepkv_target(int64_t slots, int64_t batch_index, int64_t head, int64_t slot,
                                            int64_t target) {
  TORCH_CHECK(false, "kvcomp::keepkv_zip_merge: expected every target to be -1 (retained), -2 (evicted without ",
              "merge) or the index in [0, ", slots, ") of a retained slot (target -1) of the same row, got targets[",
              batch_index, ", ", head, ", ", slot, "] = ", target);
}

// Rows (B * H, T) of slot positions with the evicted slots first (ascending) when evicted_first, else the retained
// slots first (ascending): a stable partition by one sort of unique int64 keys, on the device of keep.
inline at::Tensor keepkv_partition(const at::Tensor& keep_rows, bool evicted_first) {
  const int64_t slots = keep_rows.size(1);
  const at::Tensor positions = at::arange(slots, keep_rows.options().dtype(at::kLong));
  const at::Tensor later = (evicted_first ? keep_rows : keep_rows.logical_not()).to(at::kLong);
  return std::get<1>((later * slots + positions).sort(/*dim=*/1));
}

// The members of every merge set, for targets rows (R, T) already validated: `members` (R * T) holds the flat
// positions row * T + e of the merged evicted slots, grouped by (row, target) in ascending e, and the members of
// (row, c) are members[offsets[row * (T + 1) + c] : offsets[row * (T + 1) + c + 1]]; offsets has R * (T + 1) + 1
// entries (bucket T of each row collects the slots that merge nowhere). Sort + scatter_add + cumsum on the device.
struct KeepKVMembers {
  at::Tensor members, offsets;
};

inline KeepKVMembers keepkv_members(const at::Tensor& target_rows) {
  const int64_t rows = target_rows.size(0), slots = target_rows.size(1);
  const auto long_options = target_rows.options().dtype(at::kLong);
  const at::Tensor row_base = at::arange(rows, long_options).unsqueeze(1) * (slots + 1);
  const at::Tensor bucket = (at::where(target_rows.ge(0), target_rows, slots) + row_base).reshape({-1});
  const at::Tensor members = std::get<1>(bucket.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  const at::Tensor counts = at::zeros({rows * (slots + 1)}, long_options).scatter_add_(0, bucket,
                                                                                       at::ones_like(bucket));
  const at::Tensor offsets = at::cat({at::zeros({1}, long_options), at::cumsum(counts, 0)});
  return {members, offsets};
}

}  // namespace kvcomp
