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
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include "kernels/keepkv.h"
#include "kernels/launch.h"
#include "kvcomp/dispatch.h"
#include "kvcomp/keepkv.h"

namespace kvcomp {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpSize = 32;
constexpr int64_t kDirectMaxEvicted = 8;
constexpr int64_t kMatchChunkElements = 1 << 26;  // similarities per GEMM chunk (256 MiB of float32)
constexpr int64_t kDirectMinSlotsPerPiece = 512;  // direct path: 64 slots per warp at least

struct MaxOp {
  __device__ float operator()(float a, float b) const { return a > b ? a : b; }
};
struct ZipSumsOp {
  __device__ kernels::ZipSums operator()(const kernels::ZipSums& a, const kernels::ZipSums& b) const {
    return kernels::ZipSums::combine(a, b);
  }
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
    const scalar_t* key_e = row_keys + e * head_dim;
    // Every warp scales the evicted key itself (the same values in every warp): no shared memory, no barrier.
    const float scale_e = warp_key_scale(key_e, head_dim, lane);
    float ignored, norm_sq_e;
    warp_dot_and_norm(key_e, scale_e, key_e, scale_e, head_dim, lane, ignored, norm_sq_e);
    kernels::SlotChoice warp_best = kernels::MergesFirst::none();
    for (int64_t r = piece_begin + warp; r < piece_end; r += warps) {  // warp-uniform: all lanes reach the shuffles
      if (!row_keep[r]) continue;
      const scalar_t* key_r = row_keys + r * head_dim;
      float dot, norm_sq_r;
      warp_dot_and_norm(key_e, scale_e, key_r, 1.0f, head_dim, lane, dot, norm_sq_r);
      if (!kernels::norm_sq_is_safe(norm_sq_r)) {  // rare (|k| beyond 2^50 or below 2^-50): the CPU's second pass
        const float scale_r = warp_key_scale(key_r, head_dim, lane);
        warp_dot_and_norm(key_e, scale_e, key_r, scale_r, head_dim, lane, dot, norm_sq_r);
      }
      const kernels::SlotChoice candidate{kernels::cosine_similarity(dot, norm_sq_e, norm_sq_r), r};
      if (kernels::MergesFirst{}(candidate, warp_best)) warp_best = candidate;
    }
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

at::Tensor keepkv_match_cuda(const at::Tensor& keys, const at::Tensor& keep, double threshold,
                             std::optional<int64_t> max_evicted_bound) {
  const KeepKVShape shape = check_keepkv_match(keys, keep, threshold, max_evicted_bound);
  const c10::cuda::OptionalCUDAGuard device_guard(keys.device());
  const int64_t rows = shape.rows(), slots = shape.slots, head_dim = shape.head_dim;
  const at::Tensor keep_rows = keep.reshape({rows, slots}).contiguous();
  at::Tensor targets = at::where(keep_rows, kernels::kKeepKVRetained, kernels::kKeepKVEvictedNoMerge);
  if (rows == 0 || slots == 0) return targets.view({shape.batch, shape.kv_heads, slots});
  TORCH_CHECK(rows <= INT32_MAX, "kvcomp::keepkv_match: expected at most 2^31 - 1 (batch, kv-head) rows, got ", rows);
  const at::Tensor num_evicted = keep_rows.logical_not().sum(1);  // int64 [R]
  const at::Tensor keys_c = keys.reshape({rows, slots, head_dim}).contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float threshold_f = static_cast<float>(threshold);
  const bool direct_without_sync = max_evicted_bound.has_value() && *max_evicted_bound <= kDirectMaxEvicted;
  int64_t max_evicted = direct_without_sync ? *max_evicted_bound : 0, max_retained = slots;
  if (!direct_without_sync) {
    const at::Tensor extremes = at::stack({num_evicted.max(), num_evicted.min()}).cpu();  // the one host sync
    max_evicted = extremes[0].item<int64_t>();
    max_retained = slots - extremes[1].item<int64_t>();
    if (max_evicted == 0 || max_retained == 0) return targets.view({shape.batch, shape.kv_heads, slots});
  }
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
  // Each key divided by its largest |component| first, so that its float32 squares neither overflow nor underflow.
  const at::Tensor keys_raw = keys_c.to(at::kFloat);
  const at::Tensor keys_f = keys_raw / keys_raw.abs().amax(-1, /*keepdim=*/true).clamp_min(1e-38);
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
  using SumsReduce = cub::BlockReduce<kernels::ZipSums, kThreads>;
  __shared__ union {
    typename MaxReduce::TempStorage max;
    typename SumsReduce::TempStorage sums;
  } storage;
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
  const float block_max = MaxReduce(storage.max).Reduce(local_max, MaxOp{});
  if (threadIdx.x == 0) shared_max = block_max;
  __syncthreads();
  const float max_log = shared_max;
  kernels::ZipSums local;
  for (int64_t k = static_cast<int64_t>(threadIdx.x) - 1; k < count; k += kThreads) {
    const int64_t i = k < 0 ? flat : set[k];
    local.add(votes[i], log_scores[i], max_log);
  }
  const kernels::ZipSums sums = SumsReduce(storage.sums).Reduce(local, ZipSumsOp{});
  if (threadIdx.x == 0) {
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
// keepkv_decode_step: the CPU kernel's steps as device-side ATen calls around keepkv_match / keepkv_zip_merge. Every
// shape follows from the input shapes (T - budget evictions a row), so nothing waits on the device (CUDA graphs).

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
  const double log_decay = std::log(ema_decay);
  const double inf = std::numeric_limits<double>::infinity();
  // ℓ = ln p - b + LSE (B, H, G, q, T), the row's LSE from its slot of largest p.
  const at::Tensor p = probabilities.reshape({batch, kv_heads, group, q, slots});
  const at::Tensor top = p.argmax(-1, /*keepdim=*/true);
  const at::Tensor grouped = queries.to(at::kFloat).reshape({batch, kv_heads, group, q, head_dim});
  const at::Tensor top_keys = keys.to(at::kFloat).unsqueeze(2).expand({batch, kv_heads, group, slots, head_dim})
                                  .gather(3, top.expand({batch, kv_heads, group, q, head_dim}));
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
  const at::Tensor targets = keepkv_match_cuda(keys, keep, threshold, slots - kept);
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
