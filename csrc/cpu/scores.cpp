// CPU kernels of the scores family.
#include <ATen/Parallel.h>
#include "cpu/vec.h"
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/scores.h"
#include "kvcomp/dispatch.h"
#include "kvcomp/scores.h"

namespace kvcomp {
namespace {

using cpu::FloatVec;
using cpu::load_as_float;
constexpr int64_t kSlotsPerTask = 4096;

at::Tensor update_scores_cpu(const at::Tensor& scores, const at::Tensor& attn, double decay, double input_scale) {
  const ScoreUpdateShape shape = check_update_scores(scores, attn, decay, input_scale);
  const at::Tensor scores_c = scores.contiguous();
  const at::Tensor attn_c = attn.contiguous();
  at::Tensor out = at::empty({shape.batch, shape.kv_heads, shape.total_len}, scores.options());
  const FloatVec decay_v(static_cast<float>(decay));
  const FloatVec decay_pow_queries_v(std::pow(static_cast<float>(decay), static_cast<float>(shape.num_queries)));
  const FloatVec scale_v(static_cast<float>(input_scale));

  KVCOMP_DISPATCH_CACHE_TYPES(attn.scalar_type(), "kvcomp::update_scores", [&] {
    const scalar_t* attn_ptr = attn_c.const_data_ptr<scalar_t>();
    const float* old_ptr = scores_c.const_data_ptr<float>();
    float* out_ptr = out.mutable_data_ptr<float>();
    const int64_t tasks_per_row = std::max<int64_t>(1, (shape.total_len + kSlotsPerTask - 1) / kSlotsPerTask);
    const int64_t group_stride = shape.group_size * shape.num_queries * shape.total_len;
    // A task is a chunk of adjacent slots of one (batch, kv-head): every load streams along contiguous memory.
    at::parallel_for(0, shape.batch * shape.kv_heads * tasks_per_row, 1, [&](int64_t task_begin, int64_t task_end) {
      for (int64_t task = task_begin; task < task_end; ++task) {
        const int64_t row = task / tasks_per_row;
        const int64_t slot_begin = (task % tasks_per_row) * kSlotsPerTask;
        const int64_t slot_end = std::min(shape.total_len, slot_begin + kSlotsPerTask);
        const scalar_t* attn_group = attn_ptr + row * group_stride;
        const float* old_row = old_ptr + row * shape.old_len;
        float* out_row = out_ptr + row * shape.total_len;
        for (int64_t slot = slot_begin; slot < slot_end; slot += FloatVec::size()) {
          const int64_t count = std::min<int64_t>(FloatVec::size(), slot_end - slot);
          const int64_t old_count = std::clamp<int64_t>(shape.old_len - slot, 0, count);
          const FloatVec old_score = FloatVec::loadu(old_row + slot, old_count);  // new slots start at 0
          const auto load_attention = [&](int64_t head, int64_t query) {
            return load_as_float(attn_group + (head * shape.num_queries + query) * shape.total_len + slot, count);
          };
          kernels::fold_attention_into_score(old_score, load_attention, shape.group_size, shape.num_queries, decay_v,
                                             decay_pow_queries_v, scale_v)
              .store(out_row + slot, count);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CPU, m) { m.impl("update_scores", &update_scores_cpu); }

}  // namespace kvcomp
