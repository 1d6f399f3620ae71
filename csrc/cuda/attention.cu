// CUDA kernels of the attention family: merge-count log-weights, and decode attention over a cache whose slots carry
// log-weights (the split-K kernels of decode_attention.cuh over a rectangular [B, H, T, d] view).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "cuda/decode_attention.cuh"
#include "kernels/attention.h"
#include "kvcomp/attention.h"

namespace kvcomp {
namespace {

constexpr int kBiasThreads = 256;

// ---------------------------------------------------------------------------------------------------------------
// merge_count_bias: one thread per count.

__global__ void merge_count_bias_kernel(const float* __restrict__ counts,  // [B * H * T]
                                        float* __restrict__ out,  // [B * H * T]
                                        int64_t numel, float alpha) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < numel) out[i] = kernels::merge_count_bias(counts[i], alpha);
}

at::Tensor merge_count_bias_cuda(const at::Tensor& counts, double alpha) {
  check_merge_count_bias(counts, alpha);
  const c10::cuda::OptionalCUDAGuard device_guard(counts.device());
  const at::Tensor counts_c = counts.contiguous();
  at::Tensor out = at::empty(counts.sizes(), counts.options());
  const int64_t numel = counts.numel();
  if (numel == 0) return out;
  const unsigned blocks = grid_dim("kvcomp::merge_count_bias", "counts", (numel + kBiasThreads - 1) / kBiasThreads);
  merge_count_bias_kernel<<<blocks, kBiasThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      counts_c.const_data_ptr<float>(), out.mutable_data_ptr<float>(), numel, static_cast<float>(alpha));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor> decode_attention_cuda(const at::Tensor& query, const at::Tensor& keys,
                                                         const at::Tensor& values, const at::Tensor& log_weights,
                                                         double scale) {
  const DecodeAttentionShape shape = check_decode_attention(query, keys, values, log_weights, scale);
  const c10::cuda::OptionalCUDAGuard device_guard(query.device());
  at::Tensor out = at::empty(query.sizes(), query.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor probs = at::empty({shape.batch, shape.query_heads, shape.num_queries, shape.total_len},
                               query.options().dtype(at::kFloat));
  const int64_t pairs = shape.batch * shape.kv_heads;
  if (pairs == 0) return {out, probs};

  // Any strides over (B, H, T) as long as d is contiguous (a view of a preallocated cache is not copied).
  const at::Tensor keys_c = keys.stride(3) == 1 ? keys : keys.contiguous();
  const at::Tensor values_c = values.stride(3) == 1 ? values : values.contiguous();
  const at::Tensor log_weights_c = log_weights.contiguous();
  const at::Tensor query_c = query.contiguous();

  const gpu::DecodeParams params{shape.kv_heads, shape.num_queries, shape.total_len, shape.head_dim, shape.rows(),
                                 static_cast<float>(scale)};
  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::decode_attention", [&] {
    gpu::CacheView<scalar_t> cache{keys_c.const_data_ptr<scalar_t>(), values_c.const_data_ptr<scalar_t>(),
                                   log_weights_c.const_data_ptr<float>()};
    for (int i = 0; i < 3; ++i) {
      cache.key_strides[i] = keys_c.stride(i);
      cache.value_strides[i] = values_c.stride(i);
    }
    cache.log_weight_strides[0] = shape.total_len;
    cache.log_weight_strides[1] = 1;
    gpu::split_decode_attention<scalar_t>("kvcomp::decode_attention", params, pairs, query_c.const_data_ptr<scalar_t>(),
                                          cache, out.mutable_data_ptr<scalar_t>(), probs.mutable_data_ptr<float>(),
                                          probs.options());
  });
  return {out, probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CUDA, m) {
  m.impl("merge_count_bias", &merge_count_bias_cuda);
  m.impl("decode_attention", &decode_attention_cuda);
}

}  // namespace kvcomp
