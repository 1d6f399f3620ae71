// CUDA kernels of the keepkv family.
//
// keepkv_match: the evicted slots of each row are listed by one ATen sort (kvcomp/keepkv.h). Up to kDirectMaxEvicted
// evicted slots per row (a decoding step): blocks (row, y, piece) take the evicted ranks y, y + gridDim.y, ... and
// compute the cosines with the retained slots of their piece of the row directly, warps over the slots, lanes over
// d; the pieces (kernels::launch::row_pieces, so that batch 1 fills the device) combine their best candidates by a
// 64-bit atomicMax of kernels::pack_candidate (a maximum of integers: the same whatever the order), and a last
// kernel turns the best candidate of each evicted slot into its target. More (prefill): normalised keys, at::matmul of
// chunks of evicted rows against the retained rows, then a fused masked argmax kernel. Both argmaxes use
// kernels::MergesFirst (NaN as -inf, ties to the lower slot). The GEMM follows torch's float32 matmul settings (TF32
// only if the caller allowed it). The path and the GEMM's shapes come from the largest evicted count, read back once
// (one host sync) unless the caller gives that bound (max_evicted, e.g. a decoding step's new tokens): then nothing
// waits on the host and the call can be captured in a CUDA graph.
//
// keepkv_zip_merge: the targets are validated on the device and checked once (one host sync; an invalid target
// raises the CPU kernel's error) unless the caller vouches for them (check_targets = false: targets straight from
// keepkv_match; any invalid one then merges nowhere), the members of each set are grouped by an ATen sort, then one
// block per (row, slot) merges a retained slot with its members (block reductions for m and the sums, threads
// over d).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include "cuda/shared_memory.cuh"
#include "kernels/keepkv.h"
#include "kernels/launch.h"
#include "kvcomp/dispatch.h"
#include "kvcomp/keepkv.h"

namespace kvcomp {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpSize = 32;
constexpr int64_t kDirectMaxEvicted = 8;
constexpr int kPackWordsPerThread = 4;  // keepkv_pack: words of keys and of values a thread holds across its barrier
constexpr int64_t kPackTileWords = kPackWordsPerThread * kThreads;
constexpr int64_t kMatchChunkElements = 1 << 26;  // similarities per GEMM chunk (256 MiB of float32)
constexpr int64_t kDirectMinSlotsPerPiece = 512;  // direct path: 64 slots per warp at least
constexpr int kMatchSlotsInFlight = 4;  // warp_best_retained: slots whose keys a warp loads at once

struct MaxOp {
  __device__ float operator()(float a, float b) const { return a > b ? a : b; }
};

// ---------------------------------------------------------------------------------------------------------------
// keepkv_match, direct path: block (row, y, piece) handles the evicted slots of ranks y, y + gridDim.y, ... of the row
// against the retained slots of [piece * piece_len, (piece + 1) * piece_len).
// Keys whose float32 squares overflow or underflow are rescaled first by the CPU's power of two (kernels::key_scale),
// so the cosines do not depend on the keys' magnitude, as on the CPU.

// Butterfly reductions over a warp: every lane adds (or compares) the same pairs, so all lanes hold the same value
// and a branch on it is warp-uniform.
__device__ float warp_sum(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}
__device__ float warp_max(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x = MaxOp{}(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Σ (scale_a a)(scale_b b) and Σ (scale_b b)^2 over d, lanes over the channels, reduced over the warp.
template <typename scalar_t>
__device__ void warp_dot_and_norm(const scalar_t* a, float scale_a, const scalar_t* b, float scale_b, int64_t head_dim,
                                  int lane, float& dot, float& norm_sq_b) {
  dot = 0.0f;
  norm_sq_b = 0.0f;
  for (int64_t c = lane; c < head_dim; c += kWarpSize) {
    const float x = static_cast<float>(b[c]) * scale_b;
    dot += static_cast<float>(a[c]) * scale_a * x;
    norm_sq_b += x * x;
  }
  dot = warp_sum(dot);
  norm_sq_b = warp_sum(norm_sq_b);
}

// The factor kernels::key_scale gives a key, from its unscaled squares and largest |component|.
template <typename scalar_t>
__device__ float warp_key_scale(const scalar_t* key, int64_t head_dim, int lane) {
  float norm_sq = 0.0f, max_abs = 0.0f;
  for (int64_t c = lane; c < head_dim; c += kWarpSize) {
    const float x = static_cast<float>(key[c]);
    norm_sq += x * x;
    max_abs = kernels::max_magnitude(max_abs, x);
  }
  return kernels::key_scale(warp_sum(norm_sq), warp_max(max_abs));
}

// The best retained slot for evicted key key_e among the slots first, first + stride, ... < end that is_retained
// admits, under MergesFirst, as this warp sees them: every lane returns the same candidate. The loop is warp-uniform
// (all lanes reach the shuffles). Both the direct match and the fused decoding step call it, so they pick the same
// targets. A warp takes kMatchSlotsInFlight slots a pass, channel-major and unrolled over the channels, so that the
// loads of several channels of several keys are in flight together: one slot a pass, channel by channel, waits a
// memory latency per channel of every slot, which the fused step's one block per row pays for its whole row
// (keepkv_decode_step took 134 µs for 4 x 8 rows of 1025 slots on an H200, a few GB/s: to be measured again). Each
// slot's sums are warp_dot_and_norm's, term by term in the same order, so the targets are the same.
template <typename scalar_t, typename IsRetained>
__device__ kernels::SlotChoice warp_best_retained(const scalar_t* row_keys, const scalar_t* key_e, int64_t head_dim,
                                                  int lane, int64_t first, int64_t end, int64_t stride,
                                                  IsRetained is_retained) {
  // Every warp scales the evicted key itself (the same values in every warp): no shared memory, no barrier.
  const float scale_e = warp_key_scale(key_e, head_dim, lane);
  float ignored, norm_sq_e;
  warp_dot_and_norm(key_e, scale_e, key_e, scale_e, head_dim, lane, ignored, norm_sq_e);
  kernels::SlotChoice warp_best = kernels::MergesFirst::none();
  for (int64_t pass = first; pass < end; pass += kMatchSlotsInFlight * stride) {
    float dot[kMatchSlotsInFlight], norm_sq[kMatchSlotsInFlight];
    const scalar_t* keys_read[kMatchSlotsInFlight];
#pragma unroll
    for (int i = 0; i < kMatchSlotsInFlight; ++i) {
      dot[i] = norm_sq[i] = 0.0f;
      // A slot past the end reads the last one again, and is ignored: no branch between the loads, which the
      // scheduler can then issue together.
      keys_read[i] = row_keys + min(pass + i * stride, end - 1) * head_dim;
    }
#pragma unroll 4
    for (int64_t c = lane; c < head_dim; c += kWarpSize) {
#pragma unroll
      for (int i = 0; i < kMatchSlotsInFlight; ++i) {
        const float x = static_cast<float>(keys_read[i][c]);
        dot[i] += static_cast<float>(key_e[c]) * scale_e * x;
        norm_sq[i] += x * x;
      }
    }
#pragma unroll
    for (int i = 0; i < kMatchSlotsInFlight; ++i) {
      dot[i] = warp_sum(dot[i]);
      norm_sq[i] = warp_sum(norm_sq[i]);
    }
#pragma unroll
    for (int i = 0; i < kMatchSlotsInFlight; ++i) {
      const int64_t r = pass + i * stride;
      if (r >= end) break;
      if (!is_retained(r)) continue;
      // keys_read[i], recomputed: keeping that array live to here takes the fused step to 128 registers (sm_90
      // ptxas) from 101-114.
      const scalar_t* key_r = row_keys + r * head_dim;
      if (!kernels::norm_sq_is_safe(norm_sq[i])) {  // rare (|k| beyond 2^50 or below 2^-50): the CPU's second pass
        const float scale_r = warp_key_scale(key_r, head_dim, lane);
        warp_dot_and_norm(key_e, scale_e, key_r, scale_r, head_dim, lane, dot[i], norm_sq[i]);
      }
      const kernels::SlotChoice candidate{kernels::cosine_similarity(dot[i], norm_sq_e, norm_sq[i]), r};
      if (kernels::MergesFirst{}(candidate, warp_best)) warp_best = candidate;
    }
  }
  return warp_best;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    keepkv_match_direct_kernel(const scalar_t* __restrict__ keys,       // [R, T, d]
                               const bool* __restrict__ keep,           // [R, T]
                               const int64_t* __restrict__ evicted,     // [R, T] evicted slots first
                               const int64_t* __restrict__ num_evicted, // [R]
                               unsigned long long* __restrict__ best,   // [R, T] packed candidates, zeroed
                               int64_t slots, int64_t head_dim, int64_t piece_len) {
  using BlockReduce = cub::BlockReduce<kernels::SlotChoice, kThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  const int64_t row = blockIdx.x, evicted_count = num_evicted[row];
  const scalar_t* row_keys = keys + row * slots * head_dim;
  const bool* row_keep = keep + row * slots;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, warps = kThreads / kWarpSize;
  const int64_t piece_begin = static_cast<int64_t>(blockIdx.z) * piece_len;
  const int64_t piece_end = piece_begin + piece_len < slots ? piece_begin + piece_len : slots;
  for (int64_t rank = blockIdx.y; rank < evicted_count; rank += gridDim.y) {  // block-uniform
    const int64_t e = evicted[row * slots + rank];
    const kernels::SlotChoice warp_best =
        warp_best_retained(row_keys, row_keys + e * head_dim, head_dim, lane, piece_begin + warp, piece_end, warps,
                           [&](int64_t r) { return row_keep[r]; });
    const kernels::SlotChoice chosen =
        BlockReduce(reduce_storage).Reduce(warp_best, kernels::KeepBetter<kernels::MergesFirst>{});
    if (threadIdx.x == 0 && chosen.slot != kernels::kNoSlot) {
      atomicMax(best + row * slots + e, static_cast<unsigned long long>(kernels::pack_candidate(chosen)));
    }
    __syncthreads();  // reduce_storage is reused by the next rank
  }
}

// keepkv_match, direct path, last: the target of every evicted slot from its best packed candidate (none: no merge).
__global__ void __launch_bounds__(kThreads)
    keepkv_match_direct_targets_kernel(const bool* __restrict__ keep,             // [R, T]
                                       const unsigned long long* __restrict__ best,  // [R, T]
                                       int64_t* __restrict__ targets,             // [R, T]
                                       int64_t total, float threshold) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (!keep[i]) targets[i] = kernels::match_target(kernels::unpack_candidate(best[i]), threshold);
  }
}

// keepkv_match, GEMM path: block (row, y) takes the rows k = y, y + gridDim.y, ... of the similarity chunk (evicted
// rank begin + k) against the row's retained slots (ranks < T - num_evicted[row]).
__global__ void __launch_bounds__(kThreads)
    keepkv_match_argmax_kernel(const float* __restrict__ similarities,  // [R, C, R_max]
                               const int64_t* __restrict__ evicted,     // [R, T] evicted slots first
                               const int64_t* __restrict__ retained,    // [R, T] retained slots first
                               const int64_t* __restrict__ num_evicted, // [R]
                               int64_t* __restrict__ targets,           // [R, T]
                               int64_t slots, int64_t chunk, int64_t max_retained, int64_t begin, float threshold) {
  using BlockReduce = cub::BlockReduce<kernels::SlotChoice, kThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  const int64_t row = blockIdx.x, evicted_count = num_evicted[row];
  const int64_t retained_count = slots - evicted_count;
  for (int64_t k = blockIdx.y; k < chunk && begin + k < evicted_count; k += gridDim.y) {  // block-uniform
    const float* sim = similarities + (row * chunk + k) * max_retained;
    kernels::SlotChoice best = kernels::MergesFirst::none();
    for (int64_t r = threadIdx.x; r < retained_count; r += kThreads) {
      const kernels::SlotChoice candidate{kernels::rounded_cosine(sim[r]), retained[row * slots + r]};
      if (kernels::MergesFirst{}(candidate, best)) best = candidate;
    }
    const kernels::SlotChoice chosen =
        BlockReduce(reduce_storage).Reduce(best, kernels::KeepBetter<kernels::MergesFirst>{});
    if (threadIdx.x == 0) {
      targets[row * slots + evicted[row * slots + begin + k]] = kernels::match_target(chosen, threshold);
    }
    __syncthreads();  // reduce_storage is reused by the next k
  }
}

namespace {

// keepkv_match's rows ([R, T] keep, their evicted counts and the targets to fill, each slot retained or unmatched),
// given host integers no row exceeds: the most slots a row evicts (a bound: the direct kernel strides over the rest)
// and retains (exact for the GEMM path, which matches against that many retained slots a row).
at::Tensor match_rows(const at::Tensor& keys, const KeepKVShape& shape, const at::Tensor& keep_rows,
                      const at::Tensor& num_evicted, at::Tensor targets, double threshold, int64_t max_evicted,
                      int64_t max_retained) {
  const int64_t rows = shape.rows(), slots = shape.slots, head_dim = shape.head_dim;
  if (rows == 0 || max_evicted == 0 || max_retained == 0) return targets.view({shape.batch, shape.kv_heads, slots});
  const at::Tensor keys_c = keys.reshape({rows, slots, head_dim}).contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float threshold_f = static_cast<float>(threshold);
  const at::Tensor evicted = keepkv_partition(keep_rows, /*evicted_first=*/true);
  if (max_evicted <= kDirectMaxEvicted) {
    // The blocks stride over the evicted ranks, so a row evicting more than the bound is still matched in full.
    TORCH_CHECK(slots < UINT32_MAX, "kvcomp::keepkv_match: expected fewer than 2^32 - 1 slots on CUDA, got ", slots);
    const int64_t ranks = kernels::launch::grid_y(max_evicted);
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const kernels::launch::RowPieces pieces =
        kernels::launch::row_pieces(rows * ranks, slots, sms, kDirectMinSlotsPerPiece);
    const at::Tensor best = at::zeros({rows, slots}, targets.options());
    static_assert(sizeof(unsigned long long) == sizeof(int64_t), "packed candidates are int64 storage");
    unsigned long long* best_ptr = reinterpret_cast<unsigned long long*>(best.mutable_data_ptr<int64_t>());
    const dim3 grid(grid_dim("kvcomp::keepkv_match", "rows", rows), static_cast<unsigned>(ranks),
                    static_cast<unsigned>(pieces.count));
    KVCOMP_DISPATCH_CACHE_TYPES(keys.scalar_type(), "kvcomp::keepkv_match", [&] {
      keepkv_match_direct_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
          keys_c.const_data_ptr<scalar_t>(), keep_rows.const_data_ptr<bool>(), evicted.const_data_ptr<int64_t>(),
          num_evicted.const_data_ptr<int64_t>(), best_ptr, slots, head_dim, pieces.length);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    const int64_t total = rows * slots;
    keepkv_match_direct_targets_kernel<<<static_cast<unsigned>(kernels::launch::grid_stride_blocks(total, kThreads, 65535)),
                                         kThreads, 0, stream>>>(keep_rows.const_data_ptr<bool>(), best_ptr,
                                                                targets.mutable_data_ptr<int64_t>(), total,
                                                                threshold_f);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return targets.view({shape.batch, shape.kv_heads, slots});
  }
  const at::Tensor retained = keepkv_partition(keep_rows, /*evicted_first=*/false);
  // Each key divided by its largest |component| first, so that its float32 squares neither overflow nor underflow
  // (keys of no components, d = 0, are zero keys as they are: amax of nothing is an error).
  const at::Tensor keys_raw = keys_c.to(at::kFloat);
  const at::Tensor keys_f =
      head_dim == 0 ? keys_raw : keys_raw / keys_raw.abs().amax(-1, /*keepdim=*/true).clamp_min(1e-38);
  const at::Tensor norm_sq = (keys_f * keys_f).sum(-1, /*keepdim=*/true);
  const at::Tensor normalised = keys_f * at::where(norm_sq.gt(0), at::rsqrt(norm_sq), 0.0);  // zero keys stay 0
  const auto gather_rows = [&](const at::Tensor& index) {
    return normalised.gather(1, index.unsqueeze(-1).expand({rows, index.size(1), head_dim}));
  };
  const at::Tensor retained_t = gather_rows(retained.narrow(1, 0, max_retained)).transpose(1, 2);  // [R, d, R_max]
  const int64_t chunk = kernels::launch::keepkv_match_chunk(max_evicted, rows, max_retained, kMatchChunkElements);
  for (int64_t begin = 0; begin < max_evicted; begin += chunk) {
    const int64_t count = std::min(chunk, max_evicted - begin);
    const at::Tensor similarities = at::matmul(gather_rows(evicted.narrow(1, begin, count)), retained_t).contiguous();
    const dim3 grid(grid_dim("kvcomp::keepkv_match", "rows", rows),
                    static_cast<unsigned>(kernels::launch::grid_y(count)));
    keepkv_match_argmax_kernel<<<grid, kThreads, 0, stream>>>(
        similarities.const_data_ptr<float>(), evicted.const_data_ptr<int64_t>(), retained.const_data_ptr<int64_t>(),
        num_evicted.const_data_ptr<int64_t>(), targets.mutable_data_ptr<int64_t>(), slots, count, max_retained, begin,
        threshold_f);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return targets.view({shape.batch, shape.kv_heads, slots});
}

// keepkv_match's validated rows: keep as [R, T], the targets each slot starts from, and the evicted count of each row.
struct MatchRows {
  at::Tensor keep, targets, num_evicted;
};

MatchRows match_rows_of(const at::Tensor& keep, const KeepKVShape& shape) {
  const int64_t rows = shape.rows(), slots = shape.slots;
  TORCH_CHECK(rows <= INT32_MAX, "kvcomp::keepkv_match: expected at most 2^31 - 1 (batch, kv-head) rows, got ", rows);
  const at::Tensor keep_rows = keep.reshape({rows, slots}).contiguous();
  return {keep_rows, at::where(keep_rows, kernels::kKeepKVRetained, kernels::kKeepKVEvictedNoMerge),
          keep_rows.logical_not().sum(1)};
}

// keepkv_match where every row evicts exactly `evicted_per_row` slots (a KeepKV step evicts T - M of every row): the
// extents are known on the host, so nothing waits on the device whatever their size.
at::Tensor keepkv_match_evicting_each(const at::Tensor& keys, const at::Tensor& keep, double threshold,
                                     int64_t evicted_per_row) {
  const KeepKVShape shape = check_keepkv_match(keys, keep, threshold, evicted_per_row);
  const MatchRows m = match_rows_of(keep, shape);
  return match_rows(keys, shape, m.keep, m.num_evicted, m.targets, threshold, evicted_per_row,
                    shape.slots - evicted_per_row);
}

}  // namespace

at::Tensor keepkv_match_cuda(const at::Tensor& keys, const at::Tensor& keep, double threshold,
                             std::optional<int64_t> max_evicted_bound) {
  const KeepKVShape shape = check_keepkv_match(keys, keep, threshold, max_evicted_bound);
  const c10::cuda::OptionalCUDAGuard device_guard(keys.device());
  const int64_t rows = shape.rows(), slots = shape.slots;
  const MatchRows m = match_rows_of(keep, shape);
  if (rows == 0 || slots == 0) return m.targets.view({shape.batch, shape.kv_heads, slots});
  if (max_evicted_bound.has_value() && *max_evicted_bound <= kDirectMaxEvicted) {
    // At least one rank of blocks: a bound of 0 that a row exceeds is still matched in full, as any other bound
    // (match_rows reads max_evicted 0 as "nothing evicted" and returns at once).
    return match_rows(keys, shape, m.keep, m.num_evicted, m.targets, threshold,
                      std::max<int64_t>(*max_evicted_bound, 1), slots);
  }
  // A larger bound would not do: the GEMM path needs the most slots a row retains.
  const at::Tensor extremes = at::stack({m.num_evicted.max(), m.num_evicted.min()}).cpu();  // the one host sync
  return match_rows(keys, shape, m.keep, m.num_evicted, m.targets, threshold, extremes[0].item<int64_t>(),
                    slots - extremes[1].item<int64_t>());
}

// ---------------------------------------------------------------------------------------------------------------
// keepkv_zip_merge: block (row, c). Only a retained slot with members does any work; the outputs start as copies.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    keepkv_zip_merge_kernel(const scalar_t* __restrict__ keys,        // [R, T, d]
                            const scalar_t* __restrict__ values,      // [R, T, d]
                            const float* __restrict__ votes,          // [R, T]
                            const float* __restrict__ log_scores,     // [R, T]
                            const int64_t* __restrict__ targets,      // [R, T]
                            const int64_t* __restrict__ members,      // [R * T] flat positions, see keepkv_members
                            const int64_t* __restrict__ offsets,      // [R * (T + 1) + 1]
                            scalar_t* __restrict__ out_keys,          // [R, T, d]
                            scalar_t* __restrict__ out_values,        // [R, T, d]
                            float* __restrict__ out_votes,            // [R, T]
                            int64_t slots, int64_t head_dim, bool convex) {
  using MaxReduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename MaxReduce::TempStorage storage;
  __shared__ float shared_max;
  __shared__ kernels::ZipCoefficients shared_coefficients;
  const int64_t flat = blockIdx.x;  // row * T + c
  const int64_t row = flat / slots, c = flat % slots;
  if (targets[flat] != kernels::kKeepKVRetained) return;
  const int64_t bucket = row * (slots + 1) + c;
  const int64_t first = offsets[bucket], count = offsets[bucket + 1] - first;
  if (count == 0) return;
  const int64_t* set = members + first;  // flat positions of the evicted members
  // Member k = -1 is c itself.
  float local_max = -kernels::infinity();
  for (int64_t k = static_cast<int64_t>(threadIdx.x) - 1; k < count; k += kThreads) {
    const int64_t i = k < 0 ? flat : set[k];
    local_max = kernels::zip_max_log(local_max, votes[i], log_scores[i]);
  }
  const float block_max = MaxReduce(storage).Reduce(local_max, MaxOp{});
  if (threadIdx.x == 0) shared_max = block_max;
  __syncthreads();
  const float max_log = shared_max;
  if (threadIdx.x == 0) {
    // c, then its members in order, one after another, as the CPU op and the fused decoding step add them: the sums
    // round alike on every path, so the ZIP key's guard (zip_guard_passes) decides alike near its thresholds.
    kernels::ZipSums sums;
    sums.add(votes[flat], log_scores[flat], max_log);
    for (int64_t k = 0; k < count; ++k) sums.add(votes[set[k]], log_scores[set[k]], max_log);
    shared_coefficients = kernels::zip_coefficients(max_log, sums, convex);
    out_votes[flat] = sums.votes;
  }
  __syncthreads();
  const kernels::ZipCoefficients coefficients = shared_coefficients;
  if (!coefficients.merged) return;
  for (int64_t d = threadIdx.x; d < head_dim; d += kThreads) {
    float key_acc = 0.0f, value_acc = 0.0f;
    for (int64_t k = -1; k < count; ++k) {
      const int64_t i = k < 0 ? flat : set[k];
      const float w = kernels::zip_weight(votes[i], log_scores[i], max_log);
      if (w > 0.0f) {
        key_acc += w * static_cast<float>(keys[i * head_dim + d]);
        value_acc += w * static_cast<float>(values[i * head_dim + d]);
      }
    }
    out_keys[flat * head_dim + d] = static_cast<scalar_t>(key_acc * coefficients.key_scale);
    out_values[flat * head_dim + d] = static_cast<scalar_t>(value_acc * coefficients.value_scale);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> keepkv_zip_merge_cuda(const at::Tensor& keys, const at::Tensor& values,
                                                                     const at::Tensor& votes,
                                                                     const at::Tensor& log_scores,
                                                                     const at::Tensor& targets, bool convex,
                                                                     bool check_targets) {
  const KeepKVShape shape = check_keepkv_zip_merge(keys, values, votes, log_scores, targets);
  const c10::cuda::OptionalCUDAGuard device_guard(keys.device());
  at::Tensor out_keys = keys.contiguous().clone();
  at::Tensor out_values = values.contiguous().clone();
  at::Tensor out_votes = votes.contiguous().clone();
  const int64_t rows = shape.rows(), slots = shape.slots;
  if (rows == 0 || slots == 0) return {out_keys, out_values, out_votes};
  at::Tensor target_rows = targets.reshape({rows, slots}).contiguous();
  // Validation on the device: a target is -1, -2 or a retained slot of its row.
  const at::Tensor merged = target_rows.ge(0);
  const at::Tensor in_range = merged.logical_and(target_rows.lt(slots));
  const at::Tensor target_kind = target_rows.gather(1, at::where(in_range, target_rows, 0));
  const at::Tensor valid = target_rows.eq(kernels::kKeepKVRetained)
                               .logical_or(target_rows.eq(kernels::kKeepKVEvictedNoMerge))
                               .logical_or(in_range.logical_and(target_kind.eq(kernels::kKeepKVRetained)));
  if (check_targets) {  // read back once
    const at::Tensor invalid = at::nonzero(valid.logical_not().reshape({-1}));
    if (invalid.size(0) > 0) {  // nonzero synchronised already
      const int64_t position = invalid[0][0].item<int64_t>();
      const int64_t row = position / slots, e = position % slots;
      fail_keepkv_target(slots, row / shape.kv_heads, row % shape.kv_heads, e,
                         target_rows.reshape({-1})[position].item<int64_t>());
    }
  } else {  // no host sync: an invalid target merges nowhere, and never indexes out of its row
    target_rows = at::where(valid, target_rows, kernels::kKeepKVEvictedNoMerge);
  }
  const KeepKVMembers sets = keepkv_members(target_rows);
  const int64_t blocks = rows * slots;
  TORCH_CHECK(blocks <= INT32_MAX, "kvcomp::keepkv_zip_merge: expected at most 2^31 - 1 slots in all, got ", blocks);
  const at::Tensor log_c = log_scores.contiguous();
  const at::Tensor keys_c = keys.contiguous(), values_c = values.contiguous(), votes_c = votes.contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  KVCOMP_DISPATCH_CACHE_TYPES(keys.scalar_type(), "kvcomp::keepkv_zip_merge", [&] {
    keepkv_zip_merge_kernel<scalar_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        keys_c.const_data_ptr<scalar_t>(), values_c.const_data_ptr<scalar_t>(), votes_c.const_data_ptr<float>(),
        log_c.const_data_ptr<float>(), target_rows.const_data_ptr<int64_t>(), sets.members.const_data_ptr<int64_t>(),
        sets.offsets.const_data_ptr<int64_t>(), out_keys.mutable_data_ptr<scalar_t>(),
        out_values.mutable_data_ptr<scalar_t>(), out_votes.mutable_data_ptr<float>(), slots, shape.head_dim, convex);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out_keys, out_values, out_votes};
}

// ---------------------------------------------------------------------------------------------------------------
// keepkv_decode_step, fused, for up to kDirectMaxEvicted evictions a row (every decoding step of up to 8 new tokens:
// a step evicts at most q slots): one block per (batch, kv head) row runs the CPU kernel's steps in order, in one
// launch (the ATen composition below took ~80 launches, 0.7 ms a layer on an H100, which made KeepKV decode slower
// than the full cache):
//   1. the LSE of every (query head g, new token j) from its slot of largest probability;
//   2. per slot, the EMA fold, age and votes (straight into the outputs when nothing is evicted, else into scratch
//      rows), ln ŝ and the eviction key;
//   3. the E lowest keys, one block argmin each (kernels::EvictsFirst: the next is the least key after the last);
//   4. each evicted slot's target, by the direct match's warp_best_retained (so the same targets);
//   5. each merged set's ZIP merge into its retained slot (in place), its votes, ŝ and age, as the CPU kernel;
//   6. the per-slot outputs of the retained slots in order; the evicted slots, and a copy of the slots that step 7's
//      tiles read across their edges.
// 7. keepkv_pack (a second launch, blocks (row, tile) over the whole device): the retained keys and values moved down
//    to their packed slots, in place. A block reads all of its tile's sources before it writes, and the sources past
//    its tile's end, which the next tiles overwrite, come from step 6's copy: no block writes what another reads.

struct StepArgs {
  float scale, log_decay, log_fold_weight, log_group, threshold;
  int64_t rows, kv_heads, query_heads, group, new_tokens, slots, kept, head_dim, sinks, recent;
  int64_t slots_per_tile, tiles;  // keepkv_pack's tiles along the kept slots (kernels::launch::slot_tiles)
  bool convex;
};

// std::max(a, b) as the CPU kernel takes it: b only if a < b (a NaN b is skipped, a NaN a stays).
__device__ float std_max(float a, float b) { return a < b ? b : a; }

template <typename scalar_t, typename word_t>
__global__ void __launch_bounds__(kThreads)
    keepkv_decode_step_kernel(scalar_t* __restrict__ keys, kernels::RowStrides key_rows,
                              scalar_t* __restrict__ values, kernels::RowStrides value_rows,
                              const scalar_t* __restrict__ queries,     // (B, Hq, q, d)
                              const float* __restrict__ probabilities,  // (B, Hq, q, T)
                              const float* __restrict__ log_weights, kernels::RowStrides log_weight_rows,
                              const float* __restrict__ log_ema_in, kernels::RowStrides log_ema_rows,
                              const float* __restrict__ age_in, kernels::RowStrides age_rows,
                              const float* __restrict__ votes_in, kernels::RowStrides vote_rows,
                              float* __restrict__ scratch,  // [5, R, T] when slots are evicted
                              float* __restrict__ out_log_ema, float* __restrict__ out_age,
                              float* __restrict__ out_votes, float* __restrict__ out_log_weights,  // [R, kept]
                              float* __restrict__ out_dropped,                                      // [R]
                              int64_t* __restrict__ evicted_out,  // [R, E]: the evicted slots, ascending
                              word_t* __restrict__ edge_keys,     // [R, tiles - 1, E, words a slot]
                              word_t* __restrict__ edge_values,   // [R, tiles - 1, E, words a slot]
                              StepArgs a) {
  using ChoiceReduce = cub::BlockReduce<kernels::SlotChoice, kThreads>;
  using SumReduce = cub::BlockReduce<float, kThreads>;
  __shared__ union {
    typename ChoiceReduce::TempStorage choice;
    typename SumReduce::TempStorage sum;
  } storage;
  __shared__ int64_t chosen_slot;
  __shared__ int64_t evicted_slots[kDirectMaxEvicted], targets[kDirectMaxEvicted];
  __shared__ int64_t set_slot[kDirectMaxEvicted];
  __shared__ float set_votes[kDirectMaxEvicted], set_age[kDirectMaxEvicted], set_log_ema[kDirectMaxEvicted];
  __shared__ int set_count;
  __shared__ float set_max_log;
  __shared__ kernels::ZipCoefficients set_coefficients;
  extern __shared__ float shared[];  // [G q] LSE, [G q] group factors, [q] offsets, [q] fold weights
  const int64_t group = a.group, q = a.new_tokens, slots = a.slots, head_dim = a.head_dim, kept = a.kept;
  float* lse = shared;
  float* factors = lse + group * q;
  float* offsets = factors + group * q;
  float* fold_weights = offsets + q;
  const int64_t row = blockIdx.x, old_slots = slots - q;
  const int tid = threadIdx.x;
  scalar_t* row_keys = keys + key_rows.offset(row);
  scalar_t* row_values = values + value_rows.offset(row);
  const int64_t first_head = row / a.kv_heads * a.query_heads + row % a.kv_heads * group;
  const float* row_p = probabilities + first_head * q * slots;  // (g, j) at (g q + j) T
  const scalar_t* row_q = queries + first_head * q * head_dim;   // (g, j) at (g q + j) d
  const float* row_bias = log_weights + log_weight_rows.offset(row);
  const float* row_log_ema = log_ema_in + log_ema_rows.offset(row);
  const float* row_age = age_in + age_rows.offset(row);
  const float* row_votes = votes_in + vote_rows.offset(row);

  // 1. LSE = q·k·scale + b - ln p at the slot of largest p (the first of equals).
  for (int64_t gj = 0; gj < group * q; ++gj) {
    const float* p = row_p + gj * slots;
    kernels::SlotChoice best = kernels::MergesFirst::none();
    for (int64_t t = tid; t < slots; t += kThreads) {
      const kernels::SlotChoice candidate{p[t], t};
      if (kernels::MergesFirst{}(candidate, best)) best = candidate;
    }
    const kernels::SlotChoice top = ChoiceReduce(storage.choice).Reduce(best, kernels::KeepBetter<kernels::MergesFirst>{});
    if (tid == 0) chosen_slot = top.slot;
    __syncthreads();
    const int64_t s = chosen_slot;
    float partial = 0.0f;
    for (int64_t c = tid; c < head_dim; c += kThreads) {
      partial += static_cast<float>(row_q[gj * head_dim + c]) * static_cast<float>(row_keys[s * head_dim + c]);
    }
    const float dot = SumReduce(storage.sum).Sum(partial);
    if (tid == 0) lse[gj] = dot * a.scale + row_bias[s] - logf(p[s]);
    __syncthreads();
  }
  if (tid == 0) {  // s̄ of query j = (1/G) Σ_g p_g exp(LSE_g - b), its largest LSE factored out
    for (int64_t j = 0; j < q; ++j) {
      float shift = -kernels::infinity();
      for (int64_t g = 0; g < group; ++g) shift = std_max(shift, lse[g * q + j]);
      for (int64_t g = 0; g < group; ++g) factors[g * q + j] = expf(lse[g * q + j] - shift);
      fold_weights[j] = a.log_fold_weight + a.log_decay * static_cast<float>(q - 1 - j);
      offsets[j] = shift - a.log_group + fold_weights[j];
    }
  }
  __syncthreads();

  // 2. Per slot: the EMA fold of the q queries, then S <- β^q S + fold; age and votes; ln ŝ and the eviction key.
  const bool evicting = kept < slots;
  float* scratch_log_ema = scratch + (0 * a.rows + row) * slots;
  float* scratch_age = scratch + (1 * a.rows + row) * slots;
  float* scratch_votes = scratch + (2 * a.rows + row) * slots;
  float* scratch_estimate = scratch + (3 * a.rows + row) * slots;
  float* scratch_key = scratch + (4 * a.rows + row) * slots;
  const float log_decay_q = static_cast<float>(q) * a.log_decay;
  for (int64_t t = tid; t < slots; t += kThreads) {
    float fold = 0.0f;
    for (int64_t j = 0; j < q; ++j) {
      float sum = 0.0f;
      for (int64_t g = 0; g < group; ++g) sum = fmaf(row_p[(g * q + j) * slots + t], factors[g * q + j], sum);
      float log_mean;
      if (sum >= FLT_MIN) {
        log_mean = logf(sum) + offsets[j] - row_bias[t];
      } else {  // every term underflowed (or none: p = 0): the log domain
        float high = -kernels::infinity();
        for (int64_t g = 0; g < group; ++g) {
          const float p = row_p[(g * q + j) * slots + t];
          if (p > 0.0f) high = std_max(high, logf(p) + lse[g * q + j]);
        }
        float total = 0.0f;
        for (int64_t g = 0; g < group; ++g) {
          const float p = row_p[(g * q + j) * slots + t];
          if (p > 0.0f) total += expf(logf(p) + lse[g * q + j] - high);
        }
        log_mean = (high == -kernels::infinity() || high == kernels::infinity())
                       ? high
                       : high + logf(total) - a.log_group - row_bias[t] + fold_weights[j];
      }
      fold = j == 0 ? log_mean : kernels::log_add_exp(fold, log_mean);
    }
    const bool is_old = t < old_slots;
    const float log_ema = is_old ? kernels::log_add_exp(row_log_ema[t] + log_decay_q, fold) : fold;
    const float age = (is_old ? row_age[t] : 0.0f) + static_cast<float>(q < slots - t ? q : slots - t);
    const float vote = is_old ? row_votes[t] : 1.0f;
    if (!evicting) {
      out_log_ema[row * kept + t] = log_ema;
      out_age[row * kept + t] = age;
      out_votes[row * kept + t] = vote;
      out_log_weights[row * kept + t] = logf(vote);
      continue;
    }
    const float estimate = log_ema - kernels::log_one_minus_exp(age * a.log_decay);
    scratch_log_ema[t] = log_ema;
    scratch_age[t] = age;
    scratch_votes[t] = vote;
    scratch_estimate[t] = estimate;
    scratch_key[t] = kernels::keepkv_eviction_key(estimate, vote, t < a.sinks || t >= slots - a.recent);
  }
  if (!evicting) {
    if (tid == 0) out_dropped[row] = 0.0f;
    return;
  }
  __syncthreads();

  // 3. The E = T - M slots of lowest key, ties to the lower slot: the k-th is the least after the (k-1)-th.
  const int evictions = static_cast<int>(slots - kept);
  for (int k = 0; k < evictions; ++k) {
    // Keys are never NaN (keepkv_eviction_key), so EvictsFirst is a strict total order; slot -1 precedes them all.
    const kernels::SlotChoice previous = k == 0 ? kernels::SlotChoice{-kernels::infinity(), -1}
                                                : kernels::SlotChoice{scratch_key[evicted_slots[k - 1]],
                                                                      evicted_slots[k - 1]};
    kernels::SlotChoice best = kernels::EvictsFirst::none();
    for (int64_t t = tid; t < slots; t += kThreads) {
      const kernels::SlotChoice candidate{scratch_key[t], t};
      if (kernels::EvictsFirst{}(previous, candidate) && kernels::EvictsFirst{}(candidate, best)) best = candidate;
    }
    const kernels::SlotChoice chosen = ChoiceReduce(storage.choice).Reduce(best, kernels::KeepBetter<kernels::EvictsFirst>{});
    if (tid == 0) evicted_slots[k] = chosen.slot;
    __syncthreads();
  }
  if (tid == 0) {  // ascending slots: the CPU kernel's order for the dropped votes and the sets' members
    for (int k = 1; k < evictions; ++k) {
      for (int m = k; m > 0 && evicted_slots[m - 1] > evicted_slots[m]; --m) {
        const int64_t swap = evicted_slots[m];
        evicted_slots[m] = evicted_slots[m - 1];
        evicted_slots[m - 1] = swap;
      }
    }
  }
  __syncthreads();
  const kernels::EvictedSlots evicted{evicted_slots, evictions};

  // 4. Each evicted slot's most similar retained slot (warps over the slots, lanes over d).
  const int lane = tid % kWarpSize, warp = tid / kWarpSize, warps = kThreads / kWarpSize;
  for (int k = 0; k < evictions; ++k) {
    const kernels::SlotChoice warp_best =
        warp_best_retained(row_keys, row_keys + evicted_slots[k] * head_dim, head_dim, lane, warp, slots, warps,
                           [&](int64_t r) { return !evicted.contains(r); });
    const kernels::SlotChoice chosen =
        ChoiceReduce(storage.choice).Reduce(warp_best, kernels::KeepBetter<kernels::MergesFirst>{});
    if (tid == 0) targets[k] = kernels::match_target(chosen, a.threshold);
    __syncthreads();
  }

  // 5. The dropped votes; each set {c} ∪ {e : target(e) = c}: ZIP merge into c, Σ p, ŝ = Σ p ŝ / Σ p, the oldest age.
  if (tid == 0) {
    float dropped = 0.0f;
    for (int k = 0; k < evictions; ++k) {
      if (targets[k] == kernels::kKeepKVEvictedNoMerge) dropped += scratch_votes[evicted_slots[k]];
    }
    out_dropped[row] = dropped;
    set_count = 0;
  }
  __syncthreads();
  for (int k = 0; k < evictions; ++k) {  // block-uniform: every thread reads the same shared targets
    const int64_t c = targets[k];
    bool seen = c < 0;
    for (int m = 0; m < k && !seen; ++m) seen = targets[m] == c;
    if (seen) continue;
    if (tid == 0) {
      const auto weighted = [&](int64_t slot) { return scratch_estimate[slot] + logf(scratch_votes[slot]); };
      float max_log = kernels::zip_max_log(-kernels::infinity(), scratch_votes[c], scratch_estimate[c]);
      for (int m = k; m < evictions; ++m) {
        if (targets[m] == c) {
          max_log = kernels::zip_max_log(max_log, scratch_votes[evicted_slots[m]], scratch_estimate[evicted_slots[m]]);
        }
      }
      kernels::ZipSums sums;
      sums.add(scratch_votes[c], scratch_estimate[c], max_log);
      float peak = weighted(c), age = scratch_age[c];
      for (int m = k; m < evictions; ++m) {
        if (targets[m] != c) continue;
        const int64_t e = evicted_slots[m];
        sums.add(scratch_votes[e], scratch_estimate[e], max_log);
        peak = std_max(peak, weighted(e));
        age = std_max(age, scratch_age[e]);
      }
      float log_ema = -kernels::infinity();
      if (sums.votes > 0.0f && peak != -kernels::infinity() && !kernels::is_nan(peak)) {
        float mass = expf(weighted(c) - peak);
        for (int m = k; m < evictions; ++m) {
          if (targets[m] == c) mass += expf(weighted(evicted_slots[m]) - peak);
        }
        log_ema = peak + logf(mass) - logf(sums.votes) + kernels::log_one_minus_exp(age * a.log_decay);
      }
      set_slot[set_count] = c;
      set_votes[set_count] = sums.votes;
      set_age[set_count] = age;
      set_log_ema[set_count] = log_ema;
      ++set_count;
      set_max_log = max_log;
      set_coefficients = kernels::zip_coefficients(max_log, sums, a.convex);
    }
    __syncthreads();
    const kernels::ZipCoefficients coefficients = set_coefficients;
    const float max_log = set_max_log;
    if (coefficients.merged) {
      for (int64_t col = tid; col < head_dim; col += kThreads) {
        float key_acc = 0.0f, value_acc = 0.0f;
        const auto add = [&](int64_t i) {  // c first, then its members in ascending order, as the CPU kernel
          const float w = kernels::zip_weight(scratch_votes[i], scratch_estimate[i], max_log);
          if (w > 0.0f) {
            key_acc = fmaf(static_cast<float>(row_keys[i * head_dim + col]), w, key_acc);
            value_acc = fmaf(static_cast<float>(row_values[i * head_dim + col]), w, value_acc);
          }
        };
        add(c);
        for (int m = k; m < evictions; ++m) {
          if (targets[m] == c) add(evicted_slots[m]);
        }
        row_keys[c * head_dim + col] = static_cast<scalar_t>(key_acc * coefficients.key_scale);
        row_values[c * head_dim + col] = static_cast<scalar_t>(value_acc * coefficients.value_scale);
      }
    }
    __syncthreads();  // the set's shared scalars are reused by the next set; its writes precede the packing
  }

  // 6. The retained slots in order: slot t lands at t - (evicted slots below it).
  for (int64_t t = tid; t < slots; t += kThreads) {
    if (evicted.contains(t)) continue;
    const int64_t r = row * kept + evicted.packed_position(t);
    float vote = scratch_votes[t], age = scratch_age[t];
    float log_ema = vote <= 0.0f ? -kernels::infinity() : scratch_log_ema[t];
    for (int n = 0; n < set_count; ++n) {
      if (set_slot[n] == t) {
        vote = set_votes[n];
        age = set_age[n];
        log_ema = set_log_ema[n];
      }
    }
    out_log_ema[r] = log_ema;
    out_age[r] = age;
    out_votes[r] = vote;
    out_log_weights[r] = logf(vote);
  }
  if (tid < evictions) evicted_out[row * evictions + tid] = evicted_slots[tid];
  // Edge t of the pack: the E slots from the first of tile t + 1, which tile t may read and tile t + 1 overwrites.
  static_assert(sizeof(word_t) % sizeof(scalar_t) == 0, "a word holds whole elements");
  const int64_t words_per_slot = head_dim * static_cast<int64_t>(sizeof(scalar_t)) / sizeof(word_t);
  const int64_t edge_words = evictions * words_per_slot;
  const word_t* key_words = reinterpret_cast<const word_t*>(row_keys);
  const word_t* value_words = reinterpret_cast<const word_t*>(row_values);
  // Tiles that end at or before the first evicted slot move nothing (keepkv_pack_kernel): their edges are not read.
  const int64_t first_edge = evicted_slots[0] / a.slots_per_tile;
  for (int64_t i = first_edge * edge_words + tid; i < (a.tiles - 1) * edge_words; i += kThreads) {
    const int64_t edge = i / edge_words;
    const int64_t word = (edge + 1) * a.slots_per_tile * words_per_slot + i % edge_words;
    if (word >= slots * words_per_slot) continue;  // the row ends before E slots past the edge
    edge_keys[row * (a.tiles - 1) * edge_words + i] = key_words[word];
    edge_values[row * (a.tiles - 1) * edge_words + i] = value_words[word];
  }
}

// Step 7: block (row, tile, part) writes the words of its part of each of its tile's kept slots o after the first
// evicted one: the o-th retained slot's, read from the row or, past the tile's end, from step 6's copy of the edge.
struct PackArgs {
  kernels::RowStrides key_rows, value_rows;  // in words
  int64_t evictions, kept, words_per_slot, slots_per_tile, tiles, words_per_tile;
};

template <typename word_t>
__global__ void __launch_bounds__(kThreads)
    keepkv_pack_kernel(word_t* __restrict__ keys, word_t* __restrict__ values,
                       const int64_t* __restrict__ evicted_in,  // [R, E] ascending
                       const word_t* __restrict__ edge_keys, const word_t* __restrict__ edge_values, PackArgs p) {
  const int64_t row = blockIdx.x / p.tiles, tile = blockIdx.x % p.tiles;
  int64_t evicted[kDirectMaxEvicted];
  for (int k = 0; k < kDirectMaxEvicted; ++k) evicted[k] = k < p.evictions ? evicted_in[row * p.evictions + k] : 0;
  const int64_t tile_first = tile * p.slots_per_tile;
  const int64_t last = min(tile_first + p.slots_per_tile, p.kept);
  const int64_t first = max(tile_first, evicted[0]);  // the kept slots before the first evicted one stay
  if (first >= last) return;  // the whole block returns
  const int64_t word_first = blockIdx.y * p.words_per_tile;
  const int64_t span = min(p.words_per_tile, p.words_per_slot - word_first);
  const int64_t edge_words = p.evictions * p.words_per_slot;
  const int64_t edge = (row * (p.tiles - 1) + tile) * edge_words;  // read only where tile < tiles - 1
  word_t* row_keys = keys + p.key_rows.offset(row);
  word_t* row_values = values + p.value_rows.offset(row);
  const int64_t items = (last - first) * span;  // <= kPackTileWords (slot_tiles)
  word_t key_reads[kPackWordsPerThread], value_reads[kPackWordsPerThread];
#pragma unroll
  for (int i = 0; i < kPackWordsPerThread; ++i) {
    const int64_t item = threadIdx.x + static_cast<int64_t>(i) * kThreads;
    if (item >= items) break;
    const int64_t o = first + item / span, word = word_first + item % span;
    int64_t source = o;  // the o-th retained slot: o plus the evicted slots up to it
    for (int k = 0; k < kDirectMaxEvicted; ++k) source += k < p.evictions && evicted[k] <= source;
    if (source >= last && tile < p.tiles - 1) {
      const int64_t copied = edge + (source - last) * p.words_per_slot + word;
      key_reads[i] = edge_keys[copied];
      value_reads[i] = edge_values[copied];
    } else {
      key_reads[i] = row_keys[source * p.words_per_slot + word];
      value_reads[i] = row_values[source * p.words_per_slot + word];
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kPackWordsPerThread; ++i) {
    const int64_t item = threadIdx.x + static_cast<int64_t>(i) * kThreads;
    if (item >= items) break;
    const int64_t o = first + item / span, word = word_first + item % span;
    row_keys[o * p.words_per_slot + word] = key_reads[i];
    row_values[o * p.words_per_slot + word] = value_reads[i];
  }
}

// The dynamic shared memory of the fused step: the LSE and group factor of every (g, j), an offset and a fold weight
// per new token.
int64_t fused_step_shared_bytes(int64_t group, int64_t new_tokens) {
  return static_cast<int64_t>(sizeof(float)) * (2 * group * new_tokens + 2 * new_tokens);
}

// Whether the fused step's dynamic shared memory fits beside its static arrays (the selection's, ~0.5 KB, the same
// for every instantiation) in the 48 KiB a block gets without opting in: asked of the compiled kernel once.
bool fused_step_fits(int64_t group, int64_t new_tokens) {
  static const auto allowed = static_cast<int64_t>(
      gpu::kSharedBytesWithoutOptIn - gpu::static_shared_bytes(keepkv_decode_step_kernel<float, float>));
  return fused_step_shared_bytes(group, new_tokens) <= allowed;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> keepkv_fused_decode_step(
    at::Tensor& keys, at::Tensor& values, const at::Tensor& queries, const at::Tensor& probabilities,
    const at::Tensor& log_weights, const at::Tensor& log_ema, const at::Tensor& age, const at::Tensor& votes,
    const KeepKVStepShape& shape, double scale, double ema_decay, int64_t sinks, int64_t recent, double threshold,
    bool convex) {
  const int64_t batch = shape.cache.batch, kv_heads = shape.cache.kv_heads, slots = shape.cache.slots;
  const int64_t kept = shape.kept, rows = batch * kv_heads;
  const KeepKVStepTensors t = keepkv_step_tensors(shape, queries, probabilities, log_weights, log_ema, age, votes);
  if (rows == 0) return t.outputs();
  const at::Tensor scratch = at::empty({5, rows, slots}, log_ema.options());  // read and written only when evicting
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool wide = rows_in_16_byte_chunks(keys) && rows_in_16_byte_chunks(values);
  const int64_t evictions = slots - kept;
  KVCOMP_DISPATCH_CACHE_TYPES(keys.scalar_type(), "kvcomp::keepkv_decode_step", [&] {
    const auto launch = [&](auto word_tag) {
      using word_t = decltype(word_tag);
      constexpr int64_t per_word = sizeof(word_t) / sizeof(scalar_t);
      const int64_t words_per_slot = shape.cache.head_dim / per_word;
      const kernels::launch::SlotTiles tiles = kernels::launch::slot_tiles(kept, words_per_slot, kPackTileWords);
      const StepArgs args{static_cast<float>(scale), static_cast<float>(std::log(ema_decay)),
                          static_cast<float>(std::log1p(-ema_decay)), std::log(static_cast<float>(shape.group)),
                          static_cast<float>(threshold), rows, kv_heads, kv_heads * shape.group, shape.group,
                          shape.queries, slots, kept, shape.cache.head_dim, sinks, recent, tiles.slots_per_tile,
                          tiles.tiles, convex};
      const at::Tensor evicted = at::empty({rows, evictions}, log_ema.options().dtype(at::kLong));
      const int64_t edge_elements = rows * (tiles.tiles - 1) * evictions * shape.cache.head_dim;
      const at::Tensor edge_keys = at::empty({evictions > 0 ? edge_elements : 0}, keys.options());
      const at::Tensor edge_values = at::empty({evictions > 0 ? edge_elements : 0}, values.options());
      keepkv_decode_step_kernel<scalar_t, word_t>
          <<<grid_dim("kvcomp::keepkv_decode_step", "(batch, kv head) rows", rows), kThreads,
             fused_step_shared_bytes(shape.group, shape.queries), stream>>>(
              keys.mutable_data_ptr<scalar_t>(), row_strides(keys), values.mutable_data_ptr<scalar_t>(),
              row_strides(values), t.queries.const_data_ptr<scalar_t>(), t.probabilities.const_data_ptr<float>(),
              t.log_weights.const_data_ptr<float>(), row_strides(t.log_weights), t.log_ema.const_data_ptr<float>(),
              row_strides(t.log_ema), t.age.const_data_ptr<float>(), row_strides(t.age),
              t.votes.const_data_ptr<float>(), row_strides(t.votes), scratch.mutable_data_ptr<float>(),
              t.out_log_ema.mutable_data_ptr<float>(), t.out_age.mutable_data_ptr<float>(),
              t.out_votes.mutable_data_ptr<float>(), t.out_log_weights.mutable_data_ptr<float>(),
              t.out_dropped.mutable_data_ptr<float>(), evicted.mutable_data_ptr<int64_t>(),
              reinterpret_cast<word_t*>(edge_keys.mutable_data_ptr<scalar_t>()),
              reinterpret_cast<word_t*>(edge_values.mutable_data_ptr<scalar_t>()), args);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (evictions == 0) return;
      const PackArgs pack{row_strides(keys, per_word), row_strides(values, per_word), evictions, kept, words_per_slot,
                          tiles.slots_per_tile, tiles.tiles, tiles.chunks_per_tile};
      const dim3 grid(grid_dim("kvcomp::keepkv_decode_step", "(row, tile) pairs", rows * tiles.tiles),
                      static_cast<unsigned>(grid_dim("kvcomp::keepkv_decode_step", "parts of a slot", tiles.chunk_tiles,
                                                     kernels::launch::kMaxGridY)));
      keepkv_pack_kernel<word_t><<<grid, kThreads, 0, stream>>>(
          reinterpret_cast<word_t*>(keys.mutable_data_ptr<scalar_t>()),
          reinterpret_cast<word_t*>(values.mutable_data_ptr<scalar_t>()), evicted.const_data_ptr<int64_t>(),
          reinterpret_cast<const word_t*>(edge_keys.const_data_ptr<scalar_t>()),
          reinterpret_cast<const word_t*>(edge_values.const_data_ptr<scalar_t>()), pack);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (wide) {
      launch(uint4{});
    } else {
      launch(scalar_t{});
    }
  });
  return t.outputs();
}

// keepkv_decode_step with more than kDirectMaxEvicted evictions a row (a cache longer than its budget by more than a
// decoding step's tokens), more (query head, new token) pairs than the fused kernel's shared memory holds, or long
// rows too few to fill the device (launch::keepkv_fused_step_pays): the CPU kernel's steps as device-side ATen calls
// around keepkv_match / keepkv_zip_merge.
// Every shape follows from the input shapes (T - budget evictions a row), so nothing waits on the device (CUDA graphs).

at::Tensor log_one_minus_exp(const at::Tensor& x) {  // kernels::log_one_minus_exp
  return at::where(x > -0.69314718, (-x.expm1()).log(), (-x.exp()).log1p());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> keepkv_decode_step_cuda(
    at::Tensor& keys, at::Tensor& values, const at::Tensor& queries, const at::Tensor& probabilities,
    const at::Tensor& log_weights, const at::Tensor& log_ema, const at::Tensor& age, const at::Tensor& votes,
    double scale, double ema_decay, int64_t budget, int64_t sinks, int64_t recent, double threshold, bool convex) {
  const KeepKVStepShape shape = check_keepkv_decode_step(keys, values, queries, probabilities, log_weights, log_ema,
                                                         age, votes, scale, ema_decay, budget, sinks, recent,
                                                         threshold);
  const c10::cuda::CUDAGuard guard(keys.device());
  const int64_t batch = shape.cache.batch, kv_heads = shape.cache.kv_heads, slots = shape.cache.slots;
  const int64_t head_dim = shape.cache.head_dim, group = shape.group, q = shape.queries, kept = shape.kept;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (slots - kept <= kDirectMaxEvicted && fused_step_fits(group, q) &&
      kernels::launch::keepkv_fused_step_pays(batch * kv_heads, slots, sms)) {
    return keepkv_fused_decode_step(keys, values, queries, probabilities, log_weights, log_ema, age, votes, shape,
                                    scale, ema_decay, sinks, recent, threshold, convex);
  }
  const double log_decay = std::log(ema_decay);
  const double inf = std::numeric_limits<double>::infinity();
  // ℓ = ln p - b + LSE (B, H, G, q, T), the row's LSE from its slot of largest p.
  const at::Tensor p = probabilities.reshape({batch, kv_heads, group, q, slots});
  // NaN as -inf (the fused kernel's MergesFirst order): a NaN probability poisons its own slot only.
  const at::Tensor top = p.nan_to_num(-inf).argmax(-1, /*keepdim=*/true);
  const at::Tensor grouped = queries.to(at::kFloat).reshape({batch, kv_heads, group, q, head_dim});
  // The top slots' keys gathered before the conversion: the whole cache in float32 would be twice its bytes again.
  const at::Tensor top_keys = keys.unsqueeze(2).expand({batch, kv_heads, group, slots, head_dim})
                                  .gather(3, top.expand({batch, kv_heads, group, q, head_dim})).to(at::kFloat);
  const at::Tensor bias = log_weights.reshape({batch, kv_heads, 1, 1, slots}).expand_as(p);
  const at::Tensor log_sum_exp = (grouped * top_keys).sum(-1, /*keepdim=*/true) * scale + bias.gather(-1, top) -
                                 p.gather(-1, top).log();
  const at::Tensor logits = at::where(p > 0, p.log() - bias + log_sum_exp, -inf);
  // EMA fold of the q queries in order, each slot's age grown by the queries that see it (min(q, T - t)).
  const at::Tensor log_mean = at::logsumexp(logits, {2}) - std::log(static_cast<double>(group));  // (B, H, q, T)
  const at::Tensor fold_weights = at::arange(q - 1, -1, -1, log_mean.options()) * log_decay + std::log1p(-ema_decay);
  const at::Tensor folded = at::logsumexp(log_mean + fold_weights.unsqueeze(-1), {2});
  const at::Tensor new_log_ema = at::logaddexp(
      at::constant_pad_nd(log_ema, {0, q}, -inf) + static_cast<double>(q) * log_decay, folded);
  const at::Tensor seen = (slots - at::arange(slots, log_ema.options())).clamp_max(static_cast<double>(q));
  const at::Tensor new_age = at::constant_pad_nd(age, {0, q}, 0.0) + seen;
  const at::Tensor new_votes = at::constant_pad_nd(votes, {0, q}, 1.0);
  if (kept == slots) {  // room left: nothing evicted, keys and values stay as they are
    return {new_log_ema, new_age, new_votes, new_votes.log(), at::zeros({batch, kv_heads}, log_ema.options())};
  }
  // Evict the T - M slots of lowest ln ŝ (ties to the lower slot: a stable sort) among neither sinks nor recent.
  const at::Tensor log_estimate = new_log_ema - log_one_minus_exp(new_age * log_decay);
  const at::Tensor positions = at::arange(slots, log_ema.options().dtype(at::kLong));
  const at::Tensor is_protected = (positions < sinks).logical_or(positions >= slots - recent);
  const at::Tensor eviction_key = at::where(log_estimate.isnan().logical_or(new_votes <= 0), -inf, log_estimate)
                                      .masked_fill(is_protected, inf);
  const at::Tensor evicted = std::get<1>(eviction_key.sort(/*stable=*/true, /*dim=*/-1, /*descending=*/false))
                                 .narrow(-1, 0, slots - kept);
  const at::Tensor keep = at::ones({batch, kv_heads, slots}, log_ema.options().dtype(at::kBool)).scatter(-1, evicted,
                                                                                                        false);
  const at::Tensor targets = keepkv_match_evicting_each(keys, keep, threshold, slots - kept);
  const at::Tensor dropped = new_votes.masked_fill(targets != kernels::kKeepKVEvictedNoMerge, 0.0).sum(-1);
  auto [merged_keys, merged_values, merged_votes] =
      keepkv_zip_merge_cuda(keys, values, new_votes, log_estimate, targets, convex, /*check_targets=*/false);
  // A merged set's ŝ is Σ p ŝ / Σ p (log domain, shifted by its largest member), its age the oldest member's.
  const at::Tensor owner = at::where(targets >= 0, targets, positions.expand_as(targets));
  const at::Tensor weighted = log_estimate + new_votes.log();
  at::Tensor peak = at::full_like(weighted, -inf).scatter_reduce(-1, owner, weighted, "amax");
  peak = at::where(peak.isfinite(), peak, 0.0);
  const at::Tensor mass = at::zeros_like(weighted).scatter_add(-1, owner, (weighted - peak.gather(-1, owner)).exp());
  const at::Tensor merged_age = new_age.scatter_reduce(-1, owner, new_age, "amax");
  const at::Tensor merged_log_ema = peak + mass.log() - merged_votes.log() + log_one_minus_exp(merged_age * log_decay);
  const at::Tensor set_sizes = at::zeros_like(weighted).scatter_add(-1, owner, at::ones_like(weighted));
  const at::Tensor out_log_ema = at::where(set_sizes > 1, merged_log_ema, new_log_ema)
                                     .masked_fill(merged_votes <= 0, -inf);
  // Pack the retained slots of every row in order, into the first `kept` slots of keys and values (gathered first:
  // the packing reads slots it also overwrites).
  const at::Tensor order = keepkv_partition(keep.reshape({batch * kv_heads, slots}), /*evicted_first=*/false)
                               .narrow(1, 0, kept).reshape({batch, kv_heads, kept});
  const at::Tensor rows = order.unsqueeze(-1).expand({batch, kv_heads, kept, head_dim});
  const at::Tensor out_votes = merged_votes.gather(-1, order);
  keys.narrow(2, 0, kept).copy_(merged_keys.gather(2, rows));
  values.narrow(2, 0, kept).copy_(merged_values.gather(2, rows));
  return {out_log_ema.gather(-1, order), merged_age.gather(-1, order), out_votes, out_votes.log(), dropped};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CUDA, m) {
  m.impl("keepkv_match", &keepkv_match_cuda);
  m.impl("keepkv_zip_merge", &keepkv_zip_merge_cuda);
  m.impl("keepkv_decode_step", &keepkv_decode_step_cuda);
}

}  // namespace kvcomp
