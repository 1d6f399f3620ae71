// CPU kernels of the scores family.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "kernels/scores.h"
#include "kvcomp/scores.h"

namespace kvcomp {
namespace {

at::Tensor update_scores_cpu(const at::Tensor& scores, const at::Tensor& attn, double decay, double input_scale) {
  const ScoreUpdateShape shape = check_update_scores(scores, attn, decay, input_scale);
  const at::Tensor scores_c = scores.contiguous();
  const at::Tensor attn_c = attn.contiguous();
  at::Tensor out = at::empty({shape.batch, shape.kv_heads, shape.total_len}, scores.options());
  const float decay_f = static_cast<float>(decay);
  const float decay_pow_queries = std::pow(decay_f, static_cast<float>(shape.num_queries));
  const float scale_f = static_cast<float>(input_scale);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, attn.scalar_type(), "kvcomp::update_scores", [&] {
    const scalar_t* attn_ptr = attn_c.const_data_ptr<scalar_t>();
    const float* old_ptr = scores_c.const_data_ptr<float>();
    float* out_ptr = out.mutable_data_ptr<float>();
    const int64_t rows = shape.batch * shape.kv_heads;
    const int64_t group_stride = shape.group_size * shape.num_queries * shape.total_len;
    // One task per (batch, kv-head) row keeps every thread streaming along contiguous slots.
    at::parallel_for(0, rows, 1, [&](int64_t row_begin, int64_t row_end) {
      for (int64_t row = row_begin; row < row_end; ++row) {
        const scalar_t* attn_group = attn_ptr + row * group_stride;
        const float* old_row = old_ptr + row * shape.old_len;
        float* out_row = out_ptr + row * shape.total_len;
        for (int64_t slot = 0; slot < shape.total_len; ++slot) {
          const float old_score = slot < shape.old_len ? old_row[slot] : 0.0f;
          out_row[slot] = kernels::fold_attention_into_score(old_score, attn_group, shape.group_size,
                                                             shape.num_queries, shape.total_len, slot, decay_f,
                                                             decay_pow_queries, scale_f);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CPU, m) { m.impl("update_scores", &update_scores_cpu); }

}  // namespace kvcomp
