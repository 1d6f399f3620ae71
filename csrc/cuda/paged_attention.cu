// CUDA kernel of the paged_attention family: decode attention over a paged cache, keys, values and log-weights read
// through a block table per (batch, kv head). The same split-K kernels as decode_attention (decode_attention.cuh),
// with each chunk's slots resolved to their pool slots once, in shared memory: the loops over K and V, their 16-byte
// loads and their loads in flight are decode_attention's, and a head shorter than the longest reads nothing past its
// length.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "cuda/decode_attention.cuh"
#include "kvcomp/paged_attention.h"

namespace kvcomp {
namespace {

// The tables' contents checked on the device, where the caller gave max_len and nothing is read on the host: each
// length in [0, max_len], each block a (b, h) uses in [0, num_blocks). One block of threads per (b, h). A bad entry
// stops the stream with a device-side assert (as PyTorch's index kernels do) before the attention kernels queued
// after this one read through it. Apart, so that the attention kernels keep their registers.
__global__ void assert_block_tables_kernel(const int64_t* __restrict__ block_tables,
                                           const int64_t* __restrict__ lengths, int64_t max_blocks,
                                           int64_t block_size, int64_t num_blocks, int64_t max_len) {
  const int64_t pair = blockIdx.x, length = lengths[pair];
  const bool length_in_range = length >= 0 && length <= max_len;
  if (threadIdx.x == 0) {  // one message per bad length
    CUDA_KERNEL_ASSERT_PRINTF(length_in_range,
                              "kvcomp::paged_decode_attention: expected every length in [0, max_len = %lld], got "
                              "lengths[%lld] (b * H + h) = %lld",
                              static_cast<long long>(max_len), static_cast<long long>(pair),
                              static_cast<long long>(length));
  }
  if (!length_in_range) return;  // (the other threads) its entries would run past the table's row
  const int64_t used = (length + block_size - 1) / block_size;  // <= max_blocks: max_len is checked on the host
  for (int64_t entry = threadIdx.x; entry < used; entry += blockDim.x) {
    const int64_t block = block_tables[pair * max_blocks + entry];
    CUDA_KERNEL_ASSERT_PRINTF(block >= 0 && block < num_blocks,
                              "kvcomp::paged_decode_attention: block table index out of range: block_tables[%lld, "
                              "%lld] (b * H + h, entry) = %lld is used but not in [0, %lld)",
                              static_cast<long long>(pair), static_cast<long long>(entry),
                              static_cast<long long>(block), static_cast<long long>(num_blocks));
  }
}

std::tuple<at::Tensor, at::Tensor> paged_decode_attention_cuda(const at::Tensor& query, const at::Tensor& key_blocks,
                                                               const at::Tensor& value_blocks,
                                                               const at::Tensor& log_weight_blocks,
                                                               const at::Tensor& block_tables,
                                                               const at::Tensor& lengths, double scale,
                                                               bool return_probs, std::optional<int64_t> max_len) {
  const c10::cuda::OptionalCUDAGuard device_guard(query.device());
  const PagedAttentionShape shape = check_paged_decode_attention(query, key_blocks, value_blocks, log_weight_blocks,
                                                                 block_tables, lengths, scale, max_len);
  at::Tensor out = at::empty(query.sizes(), query.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor probs = at::empty({shape.batch, shape.query_heads, shape.num_queries, return_probs ? shape.max_len : 0},
                               query.options().dtype(at::kFloat));
  const int64_t pairs = shape.batch * shape.kv_heads;
  if (pairs == 0 || shape.max_len == 0) {
    out.zero_();
    return {out, probs};
  }
  const at::Tensor query_c = query.contiguous(), keys_c = key_blocks.contiguous();
  const at::Tensor values_c = value_blocks.contiguous(), log_weights_c = log_weight_blocks.contiguous();
  const at::Tensor tables_c = block_tables.contiguous(), lengths_c = lengths.contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (max_len) {  // the host read nothing: check the contents on the device
    assert_block_tables_kernel<<<grid_dim("kvcomp::paged_decode_attention", "(batch, kv head) pairs", pairs), 128, 0,
                                 stream>>>(
        tables_c.const_data_ptr<int64_t>(), lengths_c.const_data_ptr<int64_t>(), shape.max_blocks, shape.block_size,
        shape.num_blocks, shape.max_len);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  const gpu::DecodeParams params{shape.kv_heads, shape.num_queries, shape.max_len, shape.head_dim, shape.rows(),
                                 static_cast<float>(scale)};
  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::paged_decode_attention", [&] {
    // Pools [N * S, d]: a slot index is a pool slot, whatever the batch and head.
    gpu::CacheView<scalar_t> cache{keys_c.const_data_ptr<scalar_t>(), values_c.const_data_ptr<scalar_t>(),
                                   log_weights_c.const_data_ptr<float>(),
                                   {0, 0, shape.head_dim},
                                   {0, 0, shape.head_dim},
                                   {0, 1},
                                   tables_c.const_data_ptr<int64_t>(),
                                   lengths_c.const_data_ptr<int64_t>(),
                                   shape.block_size,
                                   shape.max_blocks};
    gpu::split_decode_attention<scalar_t>("kvcomp::paged_decode_attention", params, pairs,
                                          query_c.const_data_ptr<scalar_t>(), cache, out.mutable_data_ptr<scalar_t>(),
                                          return_probs ? probs.mutable_data_ptr<float>() : nullptr,
                                          probs.options());
  });
  return {out, probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CUDA, m) { m.impl("paged_decode_attention", &paged_decode_attention_cuda); }

}  // namespace kvcomp
