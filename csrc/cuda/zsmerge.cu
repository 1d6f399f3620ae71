// CUDA kernels of the zsmerge family.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>
#include <tuple>

#include "kernels/zsmerge.h"
#include "kvcomp/dispatch.h"
#include "kvcomp/zsmerge.h"

namespace kvcomp {
namespace {

constexpr int kPrefillThreads = 128;
constexpr int kDecodeThreads = 256;
constexpr int kWarpSize = 32;

struct NanPropagatingMax {
  __device__ float operator()(float a, float b) const { return kernels::nan_propagating_max(a, b); }
};

// ---------------------------------------------------------------------------------------------------------------
// zsmerge_prefill: one block per output slot of one (batch, kv-head). Its threads stride over d (each source row is
// read coalesced) and over the group's members for the score maximum.
template <typename scalar_t>
__global__ void __launch_bounds__(kPrefillThreads)
    zsmerge_prefill_kernel(const scalar_t* __restrict__ keys,    // [B, H, T, d]
                           const scalar_t* __restrict__ values,  // [B, H, T, d]
                           const float* __restrict__ scores,     // [B, H, T]
                           const int64_t* __restrict__ order,    // [B, H, T] source positions, see zsmerge.h
                           scalar_t* __restrict__ out_keys,      // [B, H, M, d]
                           scalar_t* __restrict__ out_values,    // [B, H, M, d]
                           float* __restrict__ out_scores,       // [B, H, M]
                           float* __restrict__ out_counts,       // [B, H, M]
                           int64_t tokens, int64_t head_dim, int64_t slots, int64_t residual,
                           int64_t residual_tokens) {
  using BlockReduce = cub::BlockReduce<float, kPrefillThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  const int64_t task = blockIdx.x;  // row * slots + slot
  const int64_t row = task / slots, slot = task % slots;
  const int64_t* sources;
  int64_t count;
  if (slot < residual) {
    const kernels::GroupBounds group = kernels::residual_group_bounds(residual_tokens, residual, slot);
    sources = order + row * tokens + group.begin;
    count = group.end - group.begin;
  } else {
    sources = order + row * tokens + residual_tokens + (slot - residual);
    count = 1;
  }
  const scalar_t* row_keys = keys + row * tokens * head_dim;
  const scalar_t* row_values = values + row * tokens * head_dim;
  for (int64_t c = threadIdx.x; c < head_dim; c += blockDim.x) {
    if (count == 1) {  // a plain copy, bit for bit
      out_keys[task * head_dim + c] = row_keys[sources[0] * head_dim + c];
      out_values[task * head_dim + c] = row_values[sources[0] * head_dim + c];
    } else {
      float key_sum = 0.0f, value_sum = 0.0f;
#pragma unroll 4
      for (int64_t k = 0; k < count; ++k) {  // independent loads: unrolled, several rows are in flight at once
        const int64_t source = sources[k];
        key_sum += static_cast<float>(row_keys[source * head_dim + c]);
        value_sum += static_cast<float>(row_values[source * head_dim + c]);
      }
      out_keys[task * head_dim + c] = static_cast<scalar_t>(key_sum / static_cast<float>(count));
      out_values[task * head_dim + c] = static_cast<scalar_t>(value_sum / static_cast<float>(count));
    }
  }
  float score = -kernels::infinity();
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
    score = kernels::nan_propagating_max(score, scores[row * tokens + sources[k]]);
  }
  score = BlockReduce(reduce_storage).Reduce(score, NanPropagatingMax{});
  if (threadIdx.x == 0) {
    out_scores[task] = score;
    out_counts[task] = static_cast<float>(count);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> zsmerge_prefill_cuda(const at::Tensor& keys,
                                                                                const at::Tensor& values,
                                                                                const at::Tensor& scores,
                                                                                int64_t recent, int64_t context,
                                                                                int64_t residual) {
  const ZSMergePrefillShape shape = check_zsmerge_prefill(keys, values, scores, recent, context, residual);
  const c10::cuda::OptionalCUDAGuard device_guard(keys.device());
  const at::Tensor keys_c = keys.contiguous();
  const at::Tensor values_c = values.contiguous();
  const at::Tensor scores_c = scores.contiguous();
  const at::Tensor order = zsmerge_prefill_source_order(scores_c, recent, context);  // stays on the GPU
  const int64_t slots = shape.budget.total();
  at::Tensor out_keys = at::empty({shape.batch, shape.kv_heads, slots, shape.head_dim}, keys.options());
  at::Tensor out_values = at::empty_like(out_keys);
  at::Tensor out_scores = at::empty({shape.batch, shape.kv_heads, slots}, scores.options());
  at::Tensor out_counts = at::empty_like(out_scores);
  const int64_t tasks = shape.batch * shape.kv_heads * slots;
  if (tasks == 0) return {out_keys, out_values, out_scores, out_counts};
  TORCH_CHECK(tasks <= INT32_MAX, "kvcomp::zsmerge_prefill: expected at most 2^31 - 1 output slots in all, got ",
              tasks);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  KVCOMP_DISPATCH_CACHE_TYPES(keys.scalar_type(), "kvcomp::zsmerge_prefill", [&] {
    zsmerge_prefill_kernel<scalar_t><<<static_cast<unsigned>(tasks), kPrefillThreads, 0, stream>>>(
        keys_c.const_data_ptr<scalar_t>(), values_c.const_data_ptr<scalar_t>(), scores_c.const_data_ptr<float>(),
        order.const_data_ptr<int64_t>(), out_keys.mutable_data_ptr<scalar_t>(),
        out_values.mutable_data_ptr<scalar_t>(), out_scores.mutable_data_ptr<float>(),
        out_counts.mutable_data_ptr<float>(), shape.num_tokens, shape.head_dim, slots, residual,
        shape.residual_tokens);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out_keys, out_values, out_scores, out_counts};
}

// ---------------------------------------------------------------------------------------------------------------
// zsmerge_decode_step: one block per (batch, kv-head) runs its q steps in order. Per step: a block-wide argmin over
// the context scores (CUB BlockReduce), a block-wide argmax over the residual slots of k_i* . k_j (one warp per
// residual slot, lanes over d, then CUB), then the d-wide merge and moves by the block's threads.
//
// Each thread touches the same elements c = threadIdx.x + k * blockDim.x of every row in the merge and both moves,
// so those three need no barrier between them; scores and counts are written by thread 0 only.
template <typename scalar_t>
__global__ void __launch_bounds__(kDecodeThreads)
    zsmerge_decode_step_kernel(scalar_t* __restrict__ keys,    // [B, H, M + q, d], rows at key_rows
                               scalar_t* __restrict__ values,  // [B, H, M + q, d], rows at value_rows
                               float* __restrict__ scores,     // [B, H, M + q], rows at score_rows
                               float* __restrict__ counts,     // [B, H, M + q], rows at count_rows
                               kernels::RowStrides key_rows, kernels::RowStrides value_rows,
                               kernels::RowStrides score_rows, kernels::RowStrides count_rows, int64_t head_dim, int64_t num_new, int64_t residual, int64_t context,
                               int64_t recent, int64_t ring_position, bool paper_order) {
  using BlockReduce = cub::BlockReduce<kernels::SlotChoice, kDecodeThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  // One variable each, so that the merge target is never written while a thread may still read the evicted slot.
  __shared__ int64_t evicted_slot, merge_target;
  const int64_t slots = residual + context + recent;
  const int64_t row = blockIdx.x;
  scalar_t* row_keys = keys + key_rows.offset(row);
  scalar_t* row_values = values + value_rows.offset(row);
  float* row_scores = scores + score_rows.offset(row);
  float* row_counts = counts + count_rows.offset(row);
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize, warp = tid / kWarpSize, warps = kDecodeThreads / kWarpSize;

  for (int64_t step = 0; step < num_new; ++step) {
    // i* = argmin of the context scores (in the paper's order, of those and the token leaving the recent window).
    const int64_t r = kernels::oldest_recent_slot(residual, context, recent, ring_position, step);
    kernels::SlotChoice local = kernels::EvictsFirst::none();
    for (int64_t slot = residual + tid; slot < residual + context; slot += kDecodeThreads) {
      const kernels::SlotChoice candidate{row_scores[slot], slot};
      if (kernels::EvictsFirst{}(candidate, local)) local = candidate;
    }
    const kernels::SlotChoice evicted =
        BlockReduce(reduce_storage).Reduce(local, kernels::KeepBetter<kernels::EvictsFirst>{});
    if (tid == 0) evicted_slot = kernels::evicted_slot(evicted, {row_scores[r], r}, paper_order).slot;
    __syncthreads();
    const int64_t i = evicted_slot;
    const scalar_t* key_i = row_keys + i * head_dim;

    if (residual > 0) {
      // j* = argmax over the residual slots of k_i* . k_j, float32 accumulation.
      kernels::SlotChoice best = kernels::MergesFirst::none();
      for (int64_t j = warp; j < residual; j += warps) {  // warp-uniform loop: every lane takes part in the shuffles
        const scalar_t* key_j = row_keys + j * head_dim;
        float partial = 0.0f;
        for (int64_t c = lane; c < head_dim; c += kWarpSize) {
          partial += static_cast<float>(key_i[c]) * static_cast<float>(key_j[c]);
        }
        for (int offset = kWarpSize / 2; offset > 0; offset /= 2) partial += __shfl_xor_sync(0xffffffffu, partial, offset);
        const kernels::SlotChoice candidate{partial, j};
        if (kernels::MergesFirst{}(candidate, best)) best = candidate;
      }
      // The previous use of reduce_storage ended at the barrier above.
      const kernels::SlotChoice target =
          BlockReduce(reduce_storage).Reduce(best, kernels::KeepBetter<kernels::MergesFirst>{});
      if (tid == 0) merge_target = target.slot;
      __syncthreads();
      const int64_t j = merge_target;
      const float w_i = row_counts[i], w_j = row_counts[j];
      scalar_t* key_j = row_keys + j * head_dim;
      scalar_t* value_j = row_values + j * head_dim;
      const scalar_t* value_i = row_values + i * head_dim;
      for (int64_t c = tid; c < head_dim; c += kDecodeThreads) {
        key_j[c] = static_cast<scalar_t>(
            kernels::merge_weighted(static_cast<float>(key_i[c]), w_i, static_cast<float>(key_j[c]), w_j));
        value_j[c] = static_cast<scalar_t>(
            kernels::merge_weighted(static_cast<float>(value_i[c]), w_i, static_cast<float>(value_j[c]), w_j));
      }
      __syncthreads();  // every thread has read w_j before thread 0 updates it
      if (tid == 0) {
        row_counts[j] = w_i + w_j;
        row_scores[j] = kernels::nan_propagating_max(row_scores[i], row_scores[j]);
      }
    }

    // The oldest recent token moves into slot i* (a copy onto itself when it was evicted), the new token into its
    // ring slot.
    const int64_t fresh = slots + step;
    for (int64_t c = tid; c < head_dim; c += kDecodeThreads) {
      row_keys[i * head_dim + c] = row_keys[r * head_dim + c];
      row_values[i * head_dim + c] = row_values[r * head_dim + c];
      row_keys[r * head_dim + c] = row_keys[fresh * head_dim + c];
      row_values[r * head_dim + c] = row_values[fresh * head_dim + c];
    }
    if (tid == 0) {
      row_scores[i] = row_scores[r];
      row_counts[i] = row_counts[r];
      row_scores[r] = row_scores[fresh];
      row_counts[r] = row_counts[fresh];
    }
    __syncthreads();  // the next step reads what this one wrote
  }
}

void zsmerge_decode_step_cuda(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& scores,
                              const at::Tensor& counts, int64_t ring_position, int64_t recent, int64_t context,
                              int64_t residual, bool paper_order) {
  const ZSMergeDecodeShape shape =
      check_zsmerge_decode_step(keys, values, scores, counts, ring_position, recent, context, residual);
  const c10::cuda::OptionalCUDAGuard device_guard(keys.device());
  const int64_t rows = shape.batch * shape.kv_heads;
  if (rows == 0) return;
  TORCH_CHECK(rows <= INT32_MAX, "kvcomp::zsmerge_decode_step: expected at most 2^31 - 1 (batch, kv-head) rows, got ",
              rows);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  KVCOMP_DISPATCH_CACHE_TYPES(keys.scalar_type(), "kvcomp::zsmerge_decode_step", [&] {
    zsmerge_decode_step_kernel<scalar_t><<<static_cast<unsigned>(rows), kDecodeThreads, 0, stream>>>(
        keys.mutable_data_ptr<scalar_t>(), values.mutable_data_ptr<scalar_t>(), scores.mutable_data_ptr<float>(),
        counts.mutable_data_ptr<float>(), row_strides(keys), row_strides(values), row_strides(scores),
        row_strides(counts), shape.head_dim, shape.num_new, residual, context, recent, ring_position,
        paper_order);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CUDA, m) {
  m.impl("zsmerge_prefill", &zsmerge_prefill_cuda);
  m.impl("zsmerge_decode_step", &zsmerge_decode_step_cuda);
}

}  // namespace kvcomp
