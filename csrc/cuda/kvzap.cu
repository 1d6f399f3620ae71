// CUDA kernels of the kvzap family.
//   kvzap_score: cuBLAS GEMMs through ATen (kvcomp::run_kvzap_surrogate); bias + GELU in place on the first GEMM's
//     output and bias + float32 on the last one, one thread per element (grid-stride).
//   kvzap_threshold: one block per (batch, head) row: each thread decides its slots, CUB BlockReduce counts the held
//     ones. Nothing waits on the host.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>

#include <algorithm>
#include <cstdint>

#include "kernels/kvzap.h"
#include "kvcomp/dispatch.h"
#include "kvcomp/kvzap.h"

namespace kvcomp {
namespace {

namespace z = kernels::kvzap;

constexpr int kThreads = 256;

inline unsigned grid_for(int64_t total) {
  return static_cast<unsigned>(std::min<int64_t>((total + kThreads - 1) / kThreads, 65535));
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
                           int64_t* __restrict__ held,  // [B, H]
                           int64_t len, z::DecisionRange range, float threshold) {
  using BlockReduce = cub::BlockReduce<int64_t, kThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * len;
  int64_t count = 0;
  for (int64_t t = threadIdx.x; t < len; t += kThreads) {
    const float value = z::thresholded_log_weight(log_weights[base + t], scores[base + t], positions[base + t], range,
                                                  threshold);
    out[base + t] = value;
    count += z::is_held(value);
  }
  count = BlockReduce(reduce_storage).Sum(count);
  if (threadIdx.x == 0) held[blockIdx.x] = count;
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
  at::Tensor held = at::empty({shape.batch, shape.heads}, log_weights.options().dtype(at::kLong));
  if (shape.rows() == 0) return {out, held};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  kvzap_threshold_kernel<<<grid_dim("kvcomp::kvzap_threshold", "rows", shape.rows()), kThreads, 0, stream>>>(
      log_weights_c.const_data_ptr<float>(), scores_c.const_data_ptr<float>(), positions_c.const_data_ptr<int64_t>(),
      out.mutable_data_ptr<float>(), held.mutable_data_ptr<int64_t>(), shape.len,
      z::decision_range(tokens_before, tokens_after, window), static_cast<float>(threshold));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, held};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CUDA, m) {
  m.impl("kvzap_score", &kvzap_score_cuda);
  m.impl("kvzap_threshold", &kvzap_threshold_cuda);
}

}  // namespace kvcomp
