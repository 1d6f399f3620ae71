// Validation and output shapes of the gvote family, called first by the CPU and the CUDA kernels alike, and the
// chunked logits driver of gvote_union_mask they share (plain ATen ops, device-agnostic).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/stack.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvcomp/checks.h"

namespace kvcomp {

struct NucleusBudgetShape {
  int64_t batch, query_heads, len;
  int64_t rows() const { return batch * query_heads; }
};

inline NucleusBudgetShape check_nucleus_budget(const at::Tensor& probs, double p) {
  constexpr const char* op = "kvcomp::nucleus_budget";
  check_dim(op, "probs", probs, 3, "(B, Hq, T)");
  check_dtype(op, "probs", probs, at::kFloat);
  TORCH_CHECK(p > 0.0 && p <= 1.0, op, ": expected p in (0, 1], got p = ", Exact{p});
  return {probs.size(0), probs.size(1), probs.size(2)};
}

struct AveragedRopeShape {
  int64_t rows, dim, positions;  // rows = B * Hq * S
};

inline AveragedRopeShape check_averaged_rope(const at::Tensor& queries, const at::Tensor& cos, const at::Tensor& sin) {
  constexpr const char* op = "kvcomp::averaged_rope";
  check_dim(op, "queries", queries, 4, "(B, Hq, S, d)");
  check_dim(op, "cos", cos, 2, "(n_f, d)");
  check_dim(op, "sin", sin, 2, "(n_f, d)");
  check_floating(op, "queries", queries);
  check_floating(op, "cos", cos);
  check_floating(op, "sin", sin);
  check_same_device(op, "cos", cos, "queries", queries);
  check_same_device(op, "sin", sin, "queries", queries);
  const int64_t dim = queries.size(3);
  TORCH_CHECK(dim % 2 == 0, op, ": expected an even head dim d (rotate_half splits it in halves), got queries of shape ",
              queries.sizes());
  check_size(op, "cos", cos, 1, dim, "head dim of queries");
  check_size(op, "sin", sin, 0, cos.size(0), "positions of cos");
  check_size(op, "sin", sin, 1, dim, "head dim of queries");
  TORCH_CHECK(cos.size(0) >= 1, op, ": expected at least one future position, got cos of shape ", cos.sizes());
  return {queries.size(0) * queries.size(1) * queries.size(2), dim, cos.size(0)};
}

// mean_f cos and mean_f sin of the n_f future positions as a (2, d) float32 tensor on the device of cos: accumulated
// in float64 (CPU and CUDA round the same double means to float), then rounded once.
inline at::Tensor averaged_rope_tables(const at::Tensor& cos, const at::Tensor& sin) {
  return at::stack({cos.to(at::kDouble).mean(0), sin.to(at::kDouble).mean(0)}).to(at::kFloat).contiguous();
}

struct GVoteUnionShape {
  int64_t batch, kv_heads, len, dim, query_heads, samples;
  int64_t group() const { return query_heads / kv_heads; }
  int64_t rows_per_kv_head() const { return group() * samples; }  // (query head of the group, sample) rows
  int64_t kv_rows() const { return batch * kv_heads; }
};

inline GVoteUnionShape check_gvote_union_mask(const at::Tensor& keys, const at::Tensor& queries,
                                              const at::Tensor& budgets, int64_t sinks, double scale,
                                              int64_t chunk_size) {
  constexpr const char* op = "kvcomp::gvote_union_mask";
  check_dim(op, "keys", keys, 4, "(B, H, T, d)");
  check_dim(op, "queries", queries, 4, "(B, Hq, S, d)");
  check_dim(op, "budgets", budgets, 2, "(B, Hq)");
  check_floating(op, "keys", keys);
  TORCH_CHECK(queries.scalar_type() == keys.scalar_type(), op, ": expected queries of the dtype of keys (",
              keys.scalar_type(), "), got ", queries.scalar_type());
  check_dtype(op, "budgets", budgets, at::kLong);
  check_same_device(op, "queries", queries, "keys", keys);
  check_same_device(op, "budgets", budgets, "keys", keys);
  GVoteUnionShape shape{keys.size(0),    keys.size(1),    keys.size(2),
                        keys.size(3),    queries.size(1), queries.size(2)};
  check_size(op, "queries", queries, 0, shape.batch, "batch of keys");
  check_size(op, "queries", queries, 3, shape.dim, "head dim of keys");
  TORCH_CHECK(shape.kv_heads >= 1 && shape.query_heads % shape.kv_heads == 0, op,
              ": expected the query heads of queries (", shape.query_heads, ") to be a multiple of the kv heads of keys (",
              shape.kv_heads, ")");
  check_size(op, "budgets", budgets, 0, shape.batch, "batch of keys");
  check_size(op, "budgets", budgets, 1, shape.query_heads, "query heads of queries");
  // Slots are indexed with 32 bits in the selection key.
  TORCH_CHECK(shape.len <= std::numeric_limits<int32_t>::max(), op, ": expected at most 2^31 - 1 slots, got T = ",
              shape.len);
  TORCH_CHECK(sinks >= 0, op, ": expected sinks >= 0, got sinks = ", sinks);
  TORCH_CHECK(is_finite_float32(scale) && scale > 0.0, op, ": expected a finite float32 scale > 0, got scale = ",
              Exact{scale});
  TORCH_CHECK(chunk_size >= 1, op, ": expected chunk_size >= 1, got chunk_size = ", chunk_size);
  return shape;
}

// The float32 logits q.k (unscaled) of every (batch, query head, sample) row against the keys of its kv head, at most
// chunk_size rows at a time: fn(logits, first_row) gets a contiguous (n, T) float32 tensor for the flattened rows
// [first_row, first_row + n) of (B, Hq, S) (row r belongs to query head r / S and kv row r / (G * S)). The rows of a
// kv head are contiguous (query head h * G + g reads kv head h), so a chunk is either several whole kv heads (one
// bmm) or a slice of one (one mm). Extra memory: the n x T logits, plus, for float16 / bfloat16 caches, the float32
// copy of the keys (T x d per kv head of the chunk) and of the chunk's queries: logits are always float32, never
// rounded to the cache dtype, so that selections do not tie where the float32 reference does not (on CUDA, unless
// torch's float32 matmul settings allow TF32, which the bmm / mm follow: see ops.gvote_union_mask).
template <typename Fn>
void for_each_logit_chunk(const at::Tensor& keys, const at::Tensor& queries, const GVoteUnionShape& shape,
                          int64_t chunk_size, Fn&& fn) {
  const int64_t per_head = shape.rows_per_kv_head();
  if (per_head == 0 || shape.len == 0 || shape.kv_rows() == 0) return;
  // Queries are small: reshape (copying if need be). Keys are the cache: never copied whole; non-contiguous keys (a
  // (B, T, H, d) storage, say) are read one kv head at a time, in place for float32.
  const at::Tensor query_rows = queries.reshape({shape.kv_rows(), per_head, shape.dim});
  if (chunk_size >= per_head && keys.is_contiguous()) {
    const at::Tensor keys_rows = keys.view({shape.kv_rows(), shape.len, shape.dim});
    const int64_t heads = chunk_size / per_head;
    for (int64_t head = 0; head < shape.kv_rows(); head += heads) {
      const int64_t n = std::min(heads, shape.kv_rows() - head);
      const at::Tensor k = keys_rows.narrow(0, head, n).to(at::kFloat);
      const at::Tensor q = query_rows.narrow(0, head, n).to(at::kFloat);
      fn(at::bmm(q, k.transpose(1, 2)).view({n * per_head, shape.len}), head * per_head);
    }
    return;
  }
  for (int64_t head = 0; head < shape.kv_rows(); ++head) {
    const at::Tensor k = keys.select(0, head / shape.kv_heads).select(0, head % shape.kv_heads).to(at::kFloat);
    for (int64_t row = 0; row < per_head; row += chunk_size) {
      const int64_t n = std::min(chunk_size, per_head - row);
      const at::Tensor q = query_rows.select(0, head).narrow(0, row, n).to(at::kFloat);
      fn(at::mm(q, k.t()), head * per_head + row);
    }
  }
}

}  // namespace kvcomp
