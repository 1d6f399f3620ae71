// CUDA kernels of the kvzap family.
//   kvzap_score: cuBLAS GEMMs through ATen (kvcomp::run_kvzap_surrogate); bias + GELU in place on the first GEMM's
//     output and bias + float32 on the last one, one thread per element (grid-stride).
//   kvzap_threshold: blocks (row, piece) over the (batch, head) rows, several per row so that batch 1 fills the
//     device too (kernels::launch::blocks_per_row): each thread decides its slots, CUB BlockReduce counts the held
//     ones, and one atomicAdd per block adds them to the row's count (integers: the order does not matter). Nothing
//     waits on the host.
//   kvzap_paged_step: one thread per (batch, head) row (a decoding pass decides about one slot per row); the block
//     tables' check before it is the one host sync.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>

#include <algorithm>
#include <cstdint>

#include "kernels/kvzap.h"
#include "kernels/launch.h"
#include "kvcomp/dispatch.h"
#include "kvcomp/kvzap.h"

namespace kvcomp {
namespace {

namespace z = kernels::kvzap;

constexpr int kThreads = 256;

constexpr int64_t kMinSlotsPerBlock = 1024;  // kvzap_threshold: 4 slots per thread at least

inline unsigned grid_for(int64_t total) {
  return static_cast<unsigned>(kernels::launch::grid_stride_blocks(total, kThreads, 65535));
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    bias_gelu_kernel(scalar_t* __restrict__ pre,  // [N, Dh'], in place
                     const float* __restrict__ bias,  // [Dh']
                     int64_t total, int64_t cols) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    pre[i] = static_cast<scalar_t>(z::gelu(static_cast<float>(pre[i]) + bias[i % cols]));
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    bias_to_float_kernel(const scalar_t* __restrict__ product,  // [B, H, T]
                         const float* __restrict__ bias,  // [H]
                         float* __restrict__ out,  // [B, H, T]
                         int64_t total, int64_t heads, int64_t len) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = static_cast<float>(product[i]) + bias[(i / len) % heads];
}

void bias_gelu_cuda_(at::Tensor& pre, const at::Tensor& bias) {
  const int64_t total = pre.numel();
  if (total == 0) return;
  const at::Tensor bias_f = bias.to(at::kFloat).contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  KVCOMP_DISPATCH_CACHE_TYPES(pre.scalar_type(), "kvcomp::kvzap_score", [&] {
    bias_gelu_kernel<scalar_t><<<grid_for(total), kThreads, 0, stream>>>(
        pre.mutable_data_ptr<scalar_t>(), bias_f.const_data_ptr<float>(), total, pre.size(1));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor bias_to_float_cuda(const at::Tensor& product, const at::Tensor& bias) {
  at::Tensor out = product.scalar_type() == at::kFloat ? product : at::empty(product.sizes(), product.options().dtype(at::kFloat));
  const int64_t total = product.numel();
  if (total == 0) return out;
  const at::Tensor bias_f = bias.to(at::kFloat).contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  KVCOMP_DISPATCH_CACHE_TYPES(product.scalar_type(), "kvcomp::kvzap_score", [&] {
    bias_to_float_kernel<scalar_t><<<grid_for(total), kThreads, 0, stream>>>(
        product.const_data_ptr<scalar_t>(), bias_f.const_data_ptr<float>(), out.mutable_data_ptr<float>(), total,
        product.size(1), product.size(2));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor kvzap_score_cuda(const at::Tensor& hidden, const at::Tensor& weight1, const at::Tensor& bias1,
                            const c10::optional<at::Tensor>& weight2, const c10::optional<at::Tensor>& bias2) {
  const KVzapScoreShape shape = check_kvzap_score(hidden, weight1, bias1, weight2, bias2);
  const c10::cuda::OptionalCUDAGuard device_guard(hidden.device());
  return run_kvzap_surrogate(hidden, weight1, bias1, weight2, bias2, shape, bias_gelu_cuda_, bias_to_float_cuda);
}

__global__ void __launch_bounds__(kThreads)
    kvzap_threshold_kernel(const float* __restrict__ log_weights,  // [B, H, T]
                           const float* __restrict__ scores,  // [B, H, T]
                           const int64_t* __restrict__ positions,  // [B, H, T]
                           float* __restrict__ out,  // [B, H, T]
                           unsigned long long* __restrict__ held,  // [B, H], zeroed
                           int64_t len, int64_t piece_len, z::DecisionRange range, float threshold) {
  using BlockReduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * len;
  const int64_t end = min(len, (blockIdx.y + 1) * piece_len);
  unsigned long long count = 0;
  for (int64_t t = blockIdx.y * piece_len + threadIdx.x; t < end; t += kThreads) {
    const float value = z::thresholded_log_weight(log_weights[base + t], scores[base + t], positions[base + t], range,
                                                  threshold);
    out[base + t] = value;
    count += z::is_held(value);
  }
  count = BlockReduce(reduce_storage).Sum(count);
  if (threadIdx.x == 0 && count > 0) atomicAdd(held + blockIdx.x, count);
}

std::tuple<at::Tensor, at::Tensor> kvzap_threshold_cuda(const at::Tensor& log_weights, const at::Tensor& scores,
                                                        const at::Tensor& positions, double threshold, int64_t window,
                                                        int64_t tokens_before, int64_t tokens_after) {
  const KVzapThresholdShape shape =
      check_kvzap_threshold(log_weights, scores, positions, threshold, window, tokens_before, tokens_after);
  const c10::cuda::OptionalCUDAGuard device_guard(log_weights.device());
  const at::Tensor log_weights_c = log_weights.contiguous(), scores_c = scores.contiguous();
  const at::Tensor positions_c = positions.contiguous();
  at::Tensor out = at::empty_like(log_weights_c);
  at::Tensor held = at::zeros({shape.batch, shape.heads}, log_weights.options().dtype(at::kLong));
  if (shape.rows() == 0 || shape.len == 0) return {out, held};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t pieces = kernels::launch::blocks_per_row(shape.rows(), shape.len, sms, kMinSlotsPerBlock);
  const dim3 grid(grid_dim("kvcomp::kvzap_threshold", "rows", shape.rows(), kernels::launch::kMaxGridX),
                  static_cast<unsigned>(pieces));
  static_assert(sizeof(unsigned long long) == sizeof(int64_t), "held counts are added as 64-bit unsigned");
  kvzap_threshold_kernel<<<grid, kThreads, 0, stream>>>(
      log_weights_c.const_data_ptr<float>(), scores_c.const_data_ptr<float>(), positions_c.const_data_ptr<int64_t>(),
      out.mutable_data_ptr<float>(), reinterpret_cast<unsigned long long*>(held.mutable_data_ptr<int64_t>()),
      shape.len, kernels::launch::ceil_div(shape.len, pieces), z::decision_range(tokens_before, tokens_after, window),
      static_cast<float>(threshold));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, held};
}

__global__ void __launch_bounds__(kThreads)
    kvzap_paged_step_kernel(float* __restrict__ log_weights,  // [N * S]
                            float* __restrict__ scores,  // [N * S]
                            int64_t* __restrict__ positions,  // [N * S]
                            const int64_t* __restrict__ block_tables,  // [B * H, max_blocks]
                            const int64_t* __restrict__ lengths,  // [B * H]
                            const float* __restrict__ new_scores,  // [B * H, q]
                            int64_t* __restrict__ held,  // [B * H]
                            int64_t rows, int64_t max_blocks, int64_t block_size, int64_t new_tokens,
                            int64_t tokens_before, int64_t window, float threshold) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (row >= rows) return;
  const z::PagedRow paged{block_tables + row * max_blocks, block_size, lengths[row]};
  held[row] = z::paged_step_row(log_weights, scores, positions, paged, new_scores + row * new_tokens, new_tokens,
                                tokens_before, window, threshold);
}

at::Tensor kvzap_paged_step_cuda(at::Tensor& log_weight_blocks, at::Tensor& score_blocks, at::Tensor& position_blocks,
                                 const at::Tensor& block_tables, const at::Tensor& lengths,
                                 const at::Tensor& new_scores, double threshold, int64_t window,
                                 int64_t tokens_before) {
  const KVzapPagedStepShape shape = check_kvzap_paged_step(log_weight_blocks, score_blocks, position_blocks,
                                                           block_tables, lengths, new_scores, threshold, window,
                                                           tokens_before);
  const c10::cuda::OptionalCUDAGuard device_guard(log_weight_blocks.device());
  at::Tensor held = at::empty({shape.batch, shape.heads}, lengths.options());
  if (shape.rows() == 0) return held;
  const at::Tensor tables_c = block_tables.contiguous(), lengths_c = lengths.contiguous();
  const at::Tensor new_scores_c = new_scores.contiguous();
  const unsigned blocks = grid_dim("kvcomp::kvzap_paged_step", "rows",
                                  kernels::launch::ceil_div(shape.rows(), kThreads), kernels::launch::kMaxGridX);
  kvzap_paged_step_kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      log_weight_blocks.mutable_data_ptr<float>(), score_blocks.mutable_data_ptr<float>(),
      position_blocks.mutable_data_ptr<int64_t>(), tables_c.const_data_ptr<int64_t>(),
      lengths_c.const_data_ptr<int64_t>(), new_scores_c.const_data_ptr<float>(), held.mutable_data_ptr<int64_t>(),
      shape.rows(), shape.max_blocks, shape.block_size, shape.new_tokens, tokens_before, window,
      static_cast<float>(threshold));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return held;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CUDA, m) {
  m.impl("kvzap_score", &kvzap_score_cuda);
  m.impl("kvzap_threshold", &kvzap_threshold_cuda);
  m.impl("kvzap_paged_step", &kvzap_paged_step_cuda);
}

}  // namespace kvcomp
