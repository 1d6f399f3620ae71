// Validation and output shapes of the attention family (merge_count_bias, decode_attention), called first by the CPU
// and the CUDA kernels alike.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>

#include "kvcomp/checks.h"
#include "kvcomp/dispatch.h"

namespace kvcomp {

inline void check_merge_count_bias(const at::Tensor& counts, double alpha) {
  constexpr const char* op = "kvcomp::merge_count_bias";
  check_dim(op, "counts", counts, 3, "(B, H, T)");
  check_dtype(op, "counts", counts, at::kFloat);
  check_finite_positive(op, "alpha", alpha, /*zero_allowed=*/true);
}

struct DecodeAttentionShape {
  int64_t batch, query_heads, kv_heads, group_size, num_queries, total_len, head_dim;
  // Query rows that share one kv head: query head h * G + g, query j is row g * q + j of kv head h.
  int64_t rows() const { return group_size * num_queries; }
};

// The query heads of `query` (B, Hq, q, d) per kv head of `kv_name` (G = Hq / H, checked to be whole), with d >= 1.
inline int64_t check_query_group(const char* op, const at::Tensor& query, int64_t kv_heads, const char* kv_name) {
  const int64_t query_heads = query.size(1);
  TORCH_CHECK(kv_heads > 0 && query_heads > 0 && query_heads % kv_heads == 0, op, ": expected the ", query_heads,
              " query heads of query to be a positive multiple of the ", kv_heads, " kv heads of ", kv_name);
  TORCH_CHECK(query.size(3) > 0, op, ": expected a head dim d >= 1, got query of shape ", query.sizes());
  return query_heads / kv_heads;
}

inline DecodeAttentionShape check_decode_attention(const at::Tensor& query, const at::Tensor& keys,
                                                   const at::Tensor& values, const at::Tensor& log_weights,
                                                   double scale) {
  constexpr const char* op = "kvcomp::decode_attention";
  check_dim(op, "query", query, 4, "(B, Hq, q, d)");
  check_dim(op, "keys", keys, 4, "(B, H, T, d)");
  check_dim(op, "values", values, 4, "(B, H, T, d)");
  check_dim(op, "log_weights", log_weights, 3, "(B, H, T)");
  check_floating(op, "query", query);
  check_dtype(op, "keys", keys, query.scalar_type());
  check_dtype(op, "values", values, query.scalar_type());
  check_dtype(op, "log_weights", log_weights, at::kFloat);
  check_same_device(op, "keys", keys, "query", query);
  check_same_device(op, "values", values, "query", query);
  check_same_device(op, "log_weights", log_weights, "query", query);
  check_finite_positive(op, "scale", scale);

  DecodeAttentionShape shape{query.size(0), query.size(1), keys.size(1), 0,
                             query.size(2), keys.size(2),  query.size(3)};
  check_size(op, "keys", keys, 0, shape.batch, "batch of query");
  shape.group_size = check_query_group(op, query, shape.kv_heads, "keys");
  check_size(op, "keys", keys, 3, shape.head_dim, "head dim d of query");
  for (int64_t dim = 0; dim < 4; ++dim) check_size(op, "values", values, dim, keys.size(dim), "the size of keys");
  check_size(op, "log_weights", log_weights, 0, shape.batch, "batch of keys");
  check_size(op, "log_weights", log_weights, 1, shape.kv_heads, "kv heads of keys");
  check_size(op, "log_weights", log_weights, 2, shape.total_len, "cache length T of keys");
  TORCH_CHECK(shape.num_queries >= 1 && shape.num_queries <= shape.total_len, op,
              ": expected 1 <= q <= T (the q queries are the last q of the T cached slots), got q = query.size(2) = ",
              shape.num_queries, " and T = keys.size(2) = ", shape.total_len);
  return shape;
}

}  // namespace kvcomp
