// CUDA kernels of the scores family.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

#include "kernels/scores.h"
#include "kvcomp/dispatch.h"
#include "kvcomp/scores.h"

namespace kvcomp {
namespace {

constexpr int kScoreThreads = 256;

// One thread per slot; consecutive threads read consecutive slots of each attention row, so every load is coalesced.
template <typename scalar_t>
__global__ void update_scores_kernel(const scalar_t* __restrict__ attn,  // [B, H, G, q, T]
                                     const float* __restrict__ old_scores,  // [B, H, T - q]
                                     float* __restrict__ out,  // [B, H, T]
                                     int64_t group_size, int64_t num_queries, int64_t old_len, int64_t total_len,
                                     int64_t blocks_per_row, float decay, float decay_pow_queries,
                                     float input_scale) {
  const int64_t row = blockIdx.x / blocks_per_row;
  const int64_t slot = (blockIdx.x % blocks_per_row) * blockDim.x + threadIdx.x;
  if (slot >= total_len) return;
  const float old_score = slot < old_len ? old_scores[row * old_len + slot] : 0.0f;
  const scalar_t* attn_group = attn + row * group_size * num_queries * total_len;
  const auto load_attention = [&](int64_t head, int64_t query) {
    return static_cast<float>(attn_group[(head * num_queries + query) * total_len + slot]);
  };
  out[row * total_len + slot] = kernels::fold_attention_into_score(old_score, load_attention, group_size, num_queries,
                                                                   decay, decay_pow_queries, input_scale);
}

at::Tensor update_scores_cuda(const at::Tensor& scores, const at::Tensor& attn, double decay, double input_scale) {
  const ScoreUpdateShape shape = check_update_scores(scores, attn, decay, input_scale);
  const c10::cuda::OptionalCUDAGuard device_guard(scores.device());
  const at::Tensor scores_c = scores.contiguous();
  const at::Tensor attn_c = attn.contiguous();
  at::Tensor out = at::empty({shape.batch, shape.kv_heads, shape.total_len}, scores.options());
  const int64_t rows = shape.batch * shape.kv_heads;
  if (rows == 0 || shape.total_len == 0) return out;
  const int64_t blocks_per_row = (shape.total_len + kScoreThreads - 1) / kScoreThreads;
  const unsigned blocks = grid_dim("kvcomp::update_scores", "score blocks", rows * blocks_per_row);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float decay_f = static_cast<float>(decay);
  const float decay_pow_queries = std::pow(decay_f, static_cast<float>(shape.num_queries));
  KVCOMP_DISPATCH_CACHE_TYPES(attn.scalar_type(), "kvcomp::update_scores", [&] {
    update_scores_kernel<scalar_t><<<blocks, kScoreThreads, 0, stream>>>(
        attn_c.const_data_ptr<scalar_t>(), scores_c.const_data_ptr<float>(), out.mutable_data_ptr<float>(),
        shape.group_size, shape.num_queries, shape.old_len, shape.total_len, blocks_per_row, decay_f, decay_pow_queries,
        static_cast<float>(input_scale));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CUDA, m) { m.impl("update_scores", &update_scores_cuda); }

}  // namespace kvcomp
