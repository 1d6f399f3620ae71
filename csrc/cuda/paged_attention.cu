// CUDA kernels of the paged_attention family: decode attention over a paged cache, keys, values and log-weights
// read through a block table per (batch, kv head).
//
// Three passes, each reading what it needs once, so that K and V are each read from memory exactly once:
//   paged_logits_kernel, one block per (batch, kv head, slot span of kSpanSlots, tile of kTileRows query rows): the
//     tile's queries sit in shared memory; each warp takes a slot, reads its key once (lanes split d) and writes the
//     logit of every row of the tile into the probabilities buffer (masked slots get -inf without reading the key).
//   paged_softmax_kernel, one block per query row: max and sum over the head's slots (CUB block reductions with the
//     device-free helpers of kernels/attention.h), probabilities in place, zeros beyond the head's length.
//   paged_values_kernel, one block per (batch, kv head, slot span, row tile), threads over d: Σ p_s v_s of the span
//     for every row of the tile into a float32 workspace, each value row read once; paged_sum_spans_kernel adds the
//     spans (the probabilities are already normalised: a plain sum, no rescaling) and rounds to the query dtype.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "kernels/attention.h"
#include "kvcomp/paged_attention.h"

namespace kvcomp {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTileRows = 8;       // query rows that share each key and value load
constexpr int64_t kSpanSlots = 256;  // slots per block of the logits and values passes

struct PagedParams {
  int64_t kv_heads, num_queries, rows, head_dim, block_size, max_blocks, max_len, num_spans, num_tiles;
  float scale;
};

using kernels::pool_slot;

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    paged_logits_kernel(const scalar_t* __restrict__ query,  // [B * H, rows, d]
                        const scalar_t* __restrict__ key_blocks,  // [N * S, d]
                        const float* __restrict__ log_weight_blocks,  // [N * S]
                        const int64_t* __restrict__ block_tables,  // [B * H, max_blocks]
                        const int64_t* __restrict__ lengths,  // [B * H]
                        float* __restrict__ logits,  // [B * H, rows, max_len]
                        const PagedParams p) {
  extern __shared__ float s_query[];  // [kTileRows, d], times the scale
  const int64_t pair = blockIdx.x, span = blockIdx.y, tile = blockIdx.z;
  const int64_t length = lengths[pair];
  const int64_t slot_begin = span * kSpanSlots;
  if (slot_begin >= length) return;  // beyond the head: the softmax pass writes its zeros
  const int64_t slot_end = min(length, slot_begin + kSpanSlots);
  const int64_t row0 = tile * kTileRows, d = p.head_dim;
  const int tile_rows = static_cast<int>(min(static_cast<int64_t>(kTileRows), p.rows - row0));
  for (int64_t i = threadIdx.x; i < tile_rows * d; i += kThreads) {
    s_query[i] = static_cast<float>(query[(pair * p.rows + row0) * d + i]) * p.scale;
  }
  __syncthreads();

  int64_t count[kTileRows];
  int64_t max_count = 0;
#pragma unroll
  for (int r = 0; r < kTileRows; ++r) {
    count[r] = r < tile_rows ? kernels::causal_slot_count((row0 + r) % p.num_queries, p.num_queries, length) : 0;
    max_count = max(max_count, count[r]);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t* table = block_tables + pair * p.max_blocks;
  for (int64_t slot = slot_begin + warp; slot < slot_end; slot += kWarps) {
    const int64_t index = pool_slot(table, slot, p.block_size);
    const float log_weight = log_weight_blocks[index];
    float dots[kTileRows] = {};
    if (kernels::slot_attended(slot, max_count, log_weight)) {
      const scalar_t* key = key_blocks + index * d;
      for (int64_t e = lane; e < d; e += 32) {
        const float k = static_cast<float>(key[e]);
#pragma unroll
        for (int r = 0; r < kTileRows; ++r) {
          if (r < tile_rows) dots[r] += s_query[r * d + e] * k;
        }
      }
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
        for (int offset = 16; offset > 0; offset /= 2) dots[r] += __shfl_xor_sync(0xffffffffu, dots[r], offset);
      }
    }
    if (lane < tile_rows) {
      float dot = 0.0f;
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) dot = r == lane ? dots[r] : dot;
      logits[((pair * p.rows) + row0 + lane) * p.max_len + slot] =
          kernels::slot_attended(slot, count[lane], log_weight) ? dot + log_weight : -INFINITY;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    paged_softmax_kernel(float* __restrict__ probs,  // [B * H, rows, max_len]: logits in, probabilities out
                         const int64_t* __restrict__ lengths,  // [B * H]
                         const PagedParams p) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ float s_max, s_inverse;
  const int64_t row = blockIdx.x;  // pair * rows + r
  const int64_t length = lengths[row / p.rows];
  float* pr = probs + row * p.max_len;

  float max = -INFINITY;
  for (int64_t s = threadIdx.x; s < length; s += kThreads) max = fmaxf(max, pr[s]);
  max = Reduce(temp).Reduce(max, [](float a, float b) { return fmaxf(a, b); });
  if (threadIdx.x == 0) s_max = max;
  __syncthreads();
  max = s_max;
  float sum = 0.0f;
  for (int64_t s = threadIdx.x; s < length; s += kThreads) {
    const float e = kernels::shifted_exp(pr[s], max);
    pr[s] = e;
    sum += e;
  }
  sum = Reduce(temp).Sum(sum);
  if (threadIdx.x == 0) s_inverse = kernels::inverse_sum(sum);
  __syncthreads();
  const float inverse = s_inverse;
  for (int64_t s = threadIdx.x; s < p.max_len; s += kThreads) pr[s] = s < length ? pr[s] * inverse : 0.0f;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    paged_values_kernel(const float* __restrict__ probs,  // [B * H, rows, max_len]
                        const scalar_t* __restrict__ value_blocks,  // [N * S, d]
                        const int64_t* __restrict__ block_tables,  // [B * H, max_blocks]
                        const int64_t* __restrict__ lengths,  // [B * H]
                        float* __restrict__ partial_out,  // [spans, B * H, rows, d]
                        const PagedParams p) {
  const int64_t pair = blockIdx.x, span = blockIdx.y, tile = blockIdx.z;
  const int64_t length = lengths[pair], d = p.head_dim;
  const int64_t row0 = tile * kTileRows;
  const int tile_rows = static_cast<int>(min(static_cast<int64_t>(kTileRows), p.rows - row0));
  const int64_t slot_begin = span * kSpanSlots, slot_end = min(length, slot_begin + kSpanSlots);
  const int64_t* table = block_tables + pair * p.max_blocks;
  const float* pr = probs + (pair * p.rows + row0) * p.max_len;
  for (int64_t e = threadIdx.x; e < d; e += blockDim.x) {
    float acc[kTileRows] = {};
    for (int64_t slot = slot_begin; slot < slot_end; ++slot) {
      float weight[kTileRows];
      bool any = false;
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
        weight[r] = r < tile_rows ? pr[r * p.max_len + slot] : 0.0f;
        any = any || weight[r] != 0.0f;
      }
      if (!any) continue;  // never read a value no row attends (it may be garbage, even NaN)
      const float v = static_cast<float>(value_blocks[pool_slot(table, slot, p.block_size) * d + e]);
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
        if (weight[r] != 0.0f) acc[r] += weight[r] * v;
      }
    }
    for (int r = 0; r < tile_rows; ++r) {
      partial_out[((span * gridDim.x + pair) * p.rows + row0 + r) * d + e] = acc[r];
    }
  }
}

template <typename scalar_t>
__global__ void paged_sum_spans_kernel(const float* __restrict__ partial_out,  // [spans, B * H * rows * d]
                                       scalar_t* __restrict__ out,  // [B * H * rows * d]
                                       int64_t numel, int64_t spans) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= numel) return;
  float sum = 0.0f;
  for (int64_t s = 0; s < spans; ++s) sum += partial_out[s * numel + i];
  out[i] = static_cast<scalar_t>(sum);
}

unsigned blocks_for(int64_t count, int64_t per_block) {
  return static_cast<unsigned>((count + per_block - 1) / per_block);
}

std::tuple<at::Tensor, at::Tensor> paged_decode_attention_cuda(const at::Tensor& query, const at::Tensor& key_blocks,
                                                               const at::Tensor& value_blocks,
                                                               const at::Tensor& log_weight_blocks,
                                                               const at::Tensor& block_tables,
                                                               const at::Tensor& lengths, double scale,
                                                               bool return_probs) {
  const c10::cuda::OptionalCUDAGuard device_guard(query.device());
  const PagedAttentionShape shape = check_paged_decode_attention(query, key_blocks, value_blocks, log_weight_blocks,
                                                                 block_tables, lengths, scale);
  at::Tensor out = at::empty(query.sizes(), query.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t pairs = shape.batch * shape.kv_heads, rows = shape.rows();
  // The probabilities are computed in place whether or not they are returned.
  at::Tensor probs = at::empty({shape.batch, shape.query_heads, shape.num_queries, shape.max_len},
                               query.options().dtype(at::kFloat));
  const auto returned = [&] { return return_probs ? probs : probs.narrow(3, 0, 0); };
  if (pairs == 0 || shape.max_len == 0) {
    out.zero_();
    return {out, returned()};
  }
  const PagedParams params{shape.kv_heads, shape.num_queries, rows, shape.head_dim, shape.block_size,
                           shape.max_blocks, shape.max_len, (shape.max_len + kSpanSlots - 1) / kSpanSlots,
                           (rows + kTileRows - 1) / kTileRows, static_cast<float>(scale)};
  TORCH_CHECK(params.num_spans <= 65535 && params.num_tiles <= 65535, "kvcomp::paged_decode_attention: ",
              params.num_spans, " slot spans or ", params.num_tiles, " row tiles exceed the grid");
  const at::Tensor query_c = query.contiguous(), keys_c = key_blocks.contiguous();
  const at::Tensor values_c = value_blocks.contiguous(), log_weights_c = log_weight_blocks.contiguous();
  const at::Tensor tables_c = block_tables.contiguous(), lengths_c = lengths.contiguous();
  at::Tensor partial_out = at::empty({params.num_spans, pairs * rows * shape.head_dim}, probs.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(pairs), static_cast<unsigned>(params.num_spans),
                  static_cast<unsigned>(params.num_tiles));
  const size_t query_smem = kTileRows * shape.head_dim * sizeof(float);
  TORCH_CHECK(query_smem <= 48 * 1024, "kvcomp::paged_decode_attention: head dim ", shape.head_dim,
              " needs more shared memory than a block gets by default");

  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::paged_decode_attention", [&] {
    paged_logits_kernel<scalar_t><<<grid, kThreads, query_smem, stream>>>(
        query_c.const_data_ptr<scalar_t>(), keys_c.const_data_ptr<scalar_t>(), log_weights_c.const_data_ptr<float>(),
        tables_c.const_data_ptr<int64_t>(), lengths_c.const_data_ptr<int64_t>(), probs.mutable_data_ptr<float>(),
        params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    paged_softmax_kernel<<<static_cast<unsigned>(pairs * rows), kThreads, 0, stream>>>(
        probs.mutable_data_ptr<float>(), lengths_c.const_data_ptr<int64_t>(), params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int value_threads = static_cast<int>(std::min<int64_t>(kThreads, (shape.head_dim + 31) / 32 * 32));
    paged_values_kernel<scalar_t><<<grid, value_threads, 0, stream>>>(
        probs.const_data_ptr<float>(), values_c.const_data_ptr<scalar_t>(), tables_c.const_data_ptr<int64_t>(),
        lengths_c.const_data_ptr<int64_t>(), partial_out.mutable_data_ptr<float>(), params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t numel = pairs * rows * shape.head_dim;
    paged_sum_spans_kernel<scalar_t><<<blocks_for(numel, kThreads), kThreads, 0, stream>>>(
        partial_out.const_data_ptr<float>(), out.mutable_data_ptr<scalar_t>(), numel, params.num_spans);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, returned()};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CUDA, m) { m.impl("paged_decode_attention", &paged_decode_attention_cuda); }

}  // namespace kvcomp
