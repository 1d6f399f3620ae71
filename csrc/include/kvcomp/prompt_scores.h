// Validation and output shapes of the prompt_scores family (prompt_log_sum_exp, prompt_scores,
// prompt_attention_with_scores, prompt_log_unnormalised_scores), called first by the CPU and the CUDA kernels alike.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <string>

#include "kvcomp/attention.h"
#include "kvcomp/checks.h"

namespace kvcomp {

// Query j of the q (0-based) is the prompt token T - q + j; its weight is input_scale * decay^(q - 1 - j).
struct PromptScoresShape {
  int64_t batch, query_heads, kv_heads, group_size, num_queries, total_len, head_dim;
};

// The checks both ops of the family share: query over the last q of the T prompt tokens, keys and log-weights.
inline PromptScoresShape check_prompt_attention(const char* op, const at::Tensor& query, const at::Tensor& keys,
                                                const at::Tensor& log_weights, double scale) {
  check_dim(op, "query", query, 4, "(B, Hq, q, d)");
  check_dim(op, "keys", keys, 4, "(B, H, T, d)");
  check_dim(op, "log_weights", log_weights, 3, "(B, H, T)");
  check_floating(op, "query", query);
  check_dtype(op, "keys", keys, query.scalar_type());
  check_dtype(op, "log_weights", log_weights, at::kFloat);
  check_same_device(op, "keys", keys, "query", query);
  check_same_device(op, "log_weights", log_weights, "query", query);
  check_finite_positive(op, "scale", scale);

  PromptScoresShape shape{query.size(0), query.size(1), keys.size(1), 0, query.size(2), keys.size(2), query.size(3)};
  check_size(op, "keys", keys, 0, shape.batch, "batch of query");
  shape.group_size = check_query_group(op, query, shape.kv_heads, "keys");
  check_size(op, "keys", keys, 3, shape.head_dim, "head dim d of query");
  check_size(op, "log_weights", log_weights, 0, shape.batch, "batch of keys");
  check_size(op, "log_weights", log_weights, 1, shape.kv_heads, "kv heads of keys");
  check_size(op, "log_weights", log_weights, 2, shape.total_len, "prompt length T of keys");
  TORCH_CHECK(shape.total_len >= 1, op, ": expected a prompt of T >= 1 tokens, got keys of shape ", keys.sizes());
  TORCH_CHECK(shape.num_queries >= 1 && shape.num_queries <= shape.total_len, op,
              ": expected 1 <= q <= T (the q queries are the last q of the T prompt tokens), got q = query.size(2) = ",
              shape.num_queries, " and T = keys.size(2) = ", shape.total_len);
  return shape;
}

// A tensor whose `dims` sizes are the first `dims` of `like`'s (named like_name), of the given dtype, on like's
// device.
inline void check_shaped_like(const char* op, const char* name, const at::Tensor& t, const char* shape,
                              at::ScalarType dtype, const char* like_name, const at::Tensor& like, int64_t dims) {
  check_dim(op, name, t, dims, shape);
  check_dtype(op, name, t, dtype);
  check_same_device(op, name, t, like_name, like);
  const std::string meaning = std::string("the size of ") + like_name;
  for (int64_t dim = 0; dim < dims; ++dim) check_size(op, name, t, dim, like.size(dim), meaning.c_str());
}

// The query weights input_scale * decay^age of the scores.
inline void check_prompt_score_weights(const char* op, double decay, double input_scale) {
  TORCH_CHECK(decay > 0.0 && decay <= 1.0, op, ": expected decay in (0, 1], got ", Exact{decay});
  check_finite_positive(op, "input_scale", input_scale, /*zero_allowed=*/true);
}

inline PromptScoresShape check_prompt_log_sum_exp(const at::Tensor& query, const at::Tensor& keys,
                                                  const at::Tensor& log_weights, double scale) {
  return check_prompt_attention("kvcomp::prompt_log_sum_exp", query, keys, log_weights, scale);
}

inline PromptScoresShape check_prompt_scores(const at::Tensor& query, const at::Tensor& keys,
                                             const at::Tensor& log_weights, const at::Tensor& log_sum_exp,
                                             double scale, double decay, double input_scale) {
  constexpr const char* op = "kvcomp::prompt_scores";
  const PromptScoresShape shape = check_prompt_attention(op, query, keys, log_weights, scale);
  check_shaped_like(op, "log_sum_exp", log_sum_exp, "(B, Hq, q)", at::kFloat, "query", query, query.dim() - 1);
  check_prompt_score_weights(op, decay, input_scale);
  return shape;
}

inline PromptScoresShape check_prompt_attention_with_scores(const at::Tensor& query, const at::Tensor& keys,
                                                             const at::Tensor& values, const at::Tensor& log_weights,
                                                             double scale, double decay, double input_scale) {
  constexpr const char* op = "kvcomp::prompt_attention_with_scores";
  const PromptScoresShape shape = check_prompt_attention(op, query, keys, log_weights, scale);
  check_shaped_like(op, "values", values, "(B, H, T, d)", query.scalar_type(), "keys", keys, keys.dim());
  check_prompt_score_weights(op, decay, input_scale);
  return shape;
}

// The weights input_scale * decay^age of the unnormalised scores, taken in the log domain: decay in (0, 1) (an EMA)
// and input_scale > 0 (ln 0 would weigh every query out).
inline PromptScoresShape check_prompt_log_unnormalised_scores(const at::Tensor& query, const at::Tensor& keys,
                                                              const at::Tensor& log_weights, double scale,
                                                              double decay, double input_scale) {
  constexpr const char* op = "kvcomp::prompt_log_unnormalised_scores";
  const PromptScoresShape shape = check_prompt_attention(op, query, keys, log_weights, scale);
  TORCH_CHECK(decay > 0.0 && decay < 1.0, op, ": expected decay in (0, 1), got ", Exact{decay});
  check_finite_positive(op, "input_scale", input_scale);
  return shape;
}

}  // namespace kvcomp
