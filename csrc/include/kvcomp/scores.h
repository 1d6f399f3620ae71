// Validation and output shape of the scores family, called first by the CPU and the CUDA kernel alike.
#pragma once

#include <ATen/core/Tensor.h>

#include "kvcomp/checks.h"

namespace kvcomp {

struct ScoreUpdateShape {
  int64_t batch, kv_heads, group_size, num_queries, old_len, total_len;
};

inline ScoreUpdateShape check_update_scores(const at::Tensor& scores, const at::Tensor& attn, double decay,
                                            double input_scale) {
  constexpr const char* op = "kvcomp::update_scores";
  check_dim(op, "scores", scores, 3, "(B, H, T_old)");
  check_dim(op, "attn", attn, 4, "(B, Hq, q, T_old + q)");
  check_dtype(op, "scores", scores, at::kFloat);
  check_floating(op, "attn", attn);
  check_same_device(op, "attn", attn, "scores", scores);
  check_range(op, "decay", decay, 0.0, 1.0);
  check_finite(op, "input_scale", input_scale);

  ScoreUpdateShape shape{scores.size(0), scores.size(1), 0, attn.size(2), scores.size(2), attn.size(3)};
  check_size(op, "attn", attn, 0, shape.batch, "batch of scores");
  TORCH_CHECK(shape.kv_heads > 0 && attn.size(1) % shape.kv_heads == 0, op, ": expected the ", attn.size(1),
              " query heads of attn to be a multiple of the ", shape.kv_heads, " kv heads of scores");
  shape.group_size = attn.size(1) / shape.kv_heads;
  check_size(op, "attn", attn, 3, shape.old_len + shape.num_queries, "T_old + q: old slots plus the new queries");
  return shape;
}

}  // namespace kvcomp
