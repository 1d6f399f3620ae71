// CUDA kernels of the gvote family. Nothing here waits on the host: budgets stay on the device from nucleus_budget
// to gvote_union_mask.
//   nucleus_budget: masses (NaN / negatives -> 0) -> CUB segmented radix sort, descending, one segment per row ->
//     the count of prefixes below p * total (float64 running sums) and of positive masses: one block per row (two
//     BlockScans: the total, then the counts) when the rows fill the device, else blocks (row, piece)
//     (kernels::launch::row_pieces): the pieces' sums, then each piece counts its prefixes after the sums of the
//     pieces before it and adds its counts to the row's (integers) -> kernels::gvote::nucleus_from_counts.
//   averaged_rope: the float64 means of cos / sin (ATen, shared with the CPU), then one thread per output element.
//   gvote_union_mask: per chunk of rows (kvcomp::for_each_logit_chunk: float32 GEMM by cuBLAS), the k-th smallest
//     selection key of each row by a radix select (one byte per pass, slot bytes that are zero for every slot
//     skipped, kernels/radix_select.h): one block per row when the rows fill the device, else split over the slots
//     (kernels::launch::row_pieces): per pass, blocks (row, piece) write their piece's histogram and one block per row
//     adds them up and picks the digit (integer counts: the same result whatever the order). Then one thread per
//     (kv head, slot) ORs its rows into the mask.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cuda/block_select.cuh"
#include "kernels/gvote.h"
#include "kernels/launch.h"
#include "kernels/radix_select.h"
#include "kvcomp/dispatch.h"
#include "kvcomp/gvote.h"

namespace kvcomp {
namespace {

namespace g = kernels::gvote;
namespace rs = kernels::radix_select;

constexpr int kThreads = 256;
constexpr int64_t kMinSlotsPerPiece = 4096;  // split select: a piece's histogram (1 KiB) is small beside its logits
constexpr int64_t kMinMassesPerPiece = 4096;  // split nucleus count: 16 masses per thread at least

// ---------------------------------------------------------------------------------------------------------------
// nucleus_budget

__global__ void __launch_bounds__(kThreads)
    nucleus_masses_kernel(const float* __restrict__ probs,  // [B * Hq * T]
                          float* __restrict__ masses,  // [B * Hq * T]
                          int64_t total) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    masses[i] = g::nucleus_mass(probs[i]);
}

__global__ void __launch_bounds__(kThreads)
    nucleus_count_kernel(const float* __restrict__ sorted,  // [B * Hq, T], each row descending
                         int64_t* __restrict__ budgets,  // [B * Hq]
                         int64_t len, double p) {
  using BlockScan = cub::BlockScan<double, kThreads>;
  using CountScan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ typename CountScan::TempStorage count_storage;
  const float* row = sorted + static_cast<int64_t>(blockIdx.x) * len;
  // Pass 0: the total (float64 running sum of the descending row, tile by tile); pass 1: how many prefixes stay
  // below p * total, and the support (p = 1 is the support exactly, see kernels::gvote::nucleus_count_sorted).
  double total = 0.0;
  int64_t below = 0, positive = 0;
  for (int pass = 0; pass < 2; ++pass) {
    const double target = p * total;
    double carry = 0.0;
    for (int64_t tile = 0; tile < len; tile += kThreads) {
      const int64_t slot = tile + threadIdx.x;
      const float mass = slot < len ? row[slot] : 0.0f;
      double prefix, tile_sum;
      BlockScan(scan_storage).InclusiveSum(static_cast<double>(mass), prefix, tile_sum);
      if (pass == 1 && mass > 0.0f) {
        ++positive;
        if (carry + prefix < target) ++below;
      }
      carry += tile_sum;
      __syncthreads();  // scan_storage is reused by the next tile
    }
    total = carry;
  }
  int64_t ignored, below_all, positive_all;
  CountScan(count_storage).ExclusiveSum(below, ignored, below_all);
  __syncthreads();
  CountScan(count_storage).ExclusiveSum(positive, ignored, positive_all);
  if (threadIdx.x == 0) budgets[blockIdx.x] = g::nucleus_from_counts(below_all, positive_all, p);  // T > 0 here
}

// Split nucleus count, 1: block (row, piece) sums its piece of the sorted row in float64.
__global__ void __launch_bounds__(kThreads)
    nucleus_piece_sums_kernel(const float* __restrict__ sorted,  // [B * Hq, T], each row descending
                              double* __restrict__ piece_sums,  // [B * Hq, gridDim.y]
                              int64_t len, int64_t piece_len) {
  using BlockReduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  const float* row = sorted + static_cast<int64_t>(blockIdx.x) * len;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * piece_len;
  const int64_t end = begin + piece_len < len ? begin + piece_len : len;
  double local = 0.0;
  for (int64_t slot = begin + threadIdx.x; slot < end; slot += kThreads) local += static_cast<double>(row[slot]);
  const double sum = BlockReduce(reduce_storage).Sum(local);
  if (threadIdx.x == 0) piece_sums[static_cast<int64_t>(blockIdx.x) * gridDim.y + blockIdx.y] = sum;
}

// Split nucleus count, 2: block (row, piece) takes the total and the sum of the pieces before its own (every block
// of the row adds the same piece sums in the same order, so they agree on the total), counts its positive masses and
// those whose running sum stays below p * total, and adds both to the row's counts.
__global__ void __launch_bounds__(kThreads)
    nucleus_piece_counts_kernel(const float* __restrict__ sorted,  // [B * Hq, T], each row descending
                                const double* __restrict__ piece_sums,  // [B * Hq, gridDim.y]
                                unsigned long long* __restrict__ counts,  // [B * Hq, 2]: below, positive; zeroed
                                int64_t len, int64_t piece_len, double p) {
  using BlockScan = cub::BlockScan<double, kThreads>;
  using CountReduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ typename CountReduce::TempStorage count_storage;
  const int64_t row = blockIdx.x, pieces = gridDim.y;
  double carry = 0.0, total = 0.0;
  for (int64_t piece = 0; piece < pieces; ++piece) {
    if (piece == blockIdx.y) carry = total;
    total += piece_sums[row * pieces + piece];
  }
  const double target = p * total;
  const float* masses = sorted + row * len;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * piece_len;
  const int64_t end = begin + piece_len < len ? begin + piece_len : len;
  unsigned long long below = 0, positive = 0;
  for (int64_t tile = begin; tile < end; tile += kThreads) {  // block-uniform
    const int64_t slot = tile + threadIdx.x;
    const float mass = slot < end ? masses[slot] : 0.0f;
    double prefix, tile_sum;
    BlockScan(scan_storage).InclusiveSum(static_cast<double>(mass), prefix, tile_sum);
    if (mass > 0.0f) {
      ++positive;
      if (carry + prefix < target) ++below;
    }
    carry += tile_sum;
    __syncthreads();  // scan_storage is reused by the next tile
  }
  below = CountReduce(count_storage).Sum(below);
  __syncthreads();  // count_storage is reused
  positive = CountReduce(count_storage).Sum(positive);
  if (threadIdx.x == 0) {
    atomicAdd(counts + 2 * row, below);
    atomicAdd(counts + 2 * row + 1, positive);
  }
}

// Split nucleus count, 3: the budget of each row from its counts.
__global__ void __launch_bounds__(kThreads)
    nucleus_budget_from_counts_kernel(const unsigned long long* __restrict__ counts,  // [B * Hq, 2]
                                      int64_t* __restrict__ budgets,  // [B * Hq]
                                      int64_t rows, double p) {
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < rows;
       row += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    budgets[row] = g::nucleus_from_counts(static_cast<int64_t>(counts[2 * row]),
                                          static_cast<int64_t>(counts[2 * row + 1]), p);
  }
}

at::Tensor nucleus_budget_cuda(const at::Tensor& probs, double p) {
  const NucleusBudgetShape shape = check_nucleus_budget(probs, p);
  const c10::cuda::OptionalCUDAGuard device_guard(probs.device());
  const at::Tensor probs_c = probs.contiguous();
  at::Tensor budgets = at::empty({shape.batch, shape.query_heads}, probs_c.options().dtype(at::kLong));
  if (shape.rows() == 0) return budgets;
  if (shape.len == 0) return budgets.zero_();
  const int64_t total = shape.rows() * shape.len;
  TORCH_CHECK(total <= std::numeric_limits<int32_t>::max(), "kvcomp::nucleus_budget: expected at most 2^31 - 1 ",
              "probabilities on CUDA (one segmented sort), got probs of shape ", probs.sizes());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  at::Tensor masses = at::empty_like(probs_c);
  at::Tensor sorted = at::empty_like(probs_c);
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((total + kThreads - 1) / kThreads, 1 << 16));
  nucleus_masses_kernel<<<blocks, kThreads, 0, stream>>>(probs_c.const_data_ptr<float>(),
                                                         masses.mutable_data_ptr<float>(), total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const at::Tensor offsets = at::arange(0, total + 1, shape.len, probs_c.options().dtype(at::kInt));
  const int* begin_offsets = offsets.const_data_ptr<int>();
  const int num_items = static_cast<int>(total), num_segments = static_cast<int>(shape.rows());
  size_t temp_bytes = 0;
  C10_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortKeysDescending(
      nullptr, temp_bytes, masses.const_data_ptr<float>(), sorted.mutable_data_ptr<float>(), num_items, num_segments,
      begin_offsets, begin_offsets + 1, 0, 32, stream));
  const at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes)}, probs_c.options().dtype(at::kByte));
  C10_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortKeysDescending(
      temp.mutable_data_ptr(), temp_bytes, masses.const_data_ptr<float>(), sorted.mutable_data_ptr<float>(),
      num_items, num_segments, begin_offsets, begin_offsets + 1, 0, 32, stream));

  const unsigned row_blocks = grid_dim("kvcomp::nucleus_budget", "rows", shape.rows());
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const kernels::launch::RowPieces pieces =
      kernels::launch::row_pieces(shape.rows(), shape.len, sms, kMinMassesPerPiece);
  if (pieces.count == 1) {
    nucleus_count_kernel<<<row_blocks, kThreads, 0, stream>>>(sorted.const_data_ptr<float>(),
                                                              budgets.mutable_data_ptr<int64_t>(), shape.len, p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return budgets;
  }
  const at::Tensor piece_sums = at::empty({shape.rows(), pieces.count}, probs_c.options().dtype(at::kDouble));
  const at::Tensor counts = at::zeros({shape.rows(), 2}, probs_c.options().dtype(at::kLong));
  static_assert(sizeof(unsigned long long) == sizeof(int64_t), "counts are added as 64-bit unsigned");
  unsigned long long* counts_ptr = reinterpret_cast<unsigned long long*>(counts.mutable_data_ptr<int64_t>());
  const dim3 grid(row_blocks, static_cast<unsigned>(pieces.count));
  nucleus_piece_sums_kernel<<<grid, kThreads, 0, stream>>>(sorted.const_data_ptr<float>(),
                                                           piece_sums.mutable_data_ptr<double>(), shape.len,
                                                           pieces.length);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  nucleus_piece_counts_kernel<<<grid, kThreads, 0, stream>>>(sorted.const_data_ptr<float>(),
                                                             piece_sums.const_data_ptr<double>(), counts_ptr,
                                                             shape.len, pieces.length, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  nucleus_budget_from_counts_kernel<<<static_cast<unsigned>(kernels::launch::grid_stride_blocks(
                                          shape.rows(), kThreads, 65535)),
                                      kThreads, 0, stream>>>(counts_ptr, budgets.mutable_data_ptr<int64_t>(),
                                                             shape.rows(), p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return budgets;
}

// ---------------------------------------------------------------------------------------------------------------
// averaged_rope

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    averaged_rope_kernel(const scalar_t* __restrict__ queries,  // [B * Hq * S, d]
                         const float* __restrict__ tables,  // [2, d]: mean cos, mean sin
                         scalar_t* __restrict__ out,  // [B * Hq * S, d]
                         int64_t dim, int64_t total) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t channel = i % dim;
    const int64_t row_start = i - channel;
    const g::RotateHalfSource source = g::rotate_half_source(channel, dim);
    out[i] = static_cast<scalar_t>(g::averaged_rope_channel(static_cast<float>(queries[i]),
                                                            static_cast<float>(queries[row_start + source.index]),
                                                            source.sign, tables[channel], tables[dim + channel]));
  }
}

at::Tensor averaged_rope_cuda(const at::Tensor& queries, const at::Tensor& cos, const at::Tensor& sin) {
  const AveragedRopeShape shape = check_averaged_rope(queries, cos, sin);
  const c10::cuda::OptionalCUDAGuard device_guard(queries.device());
  const at::Tensor queries_c = queries.contiguous();
  at::Tensor out = at::empty_like(queries_c);
  const int64_t total = shape.rows * shape.dim;
  if (total == 0) return out;
  const at::Tensor tables = averaged_rope_tables(cos, sin);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((total + kThreads - 1) / kThreads, 1 << 16));
  KVCOMP_DISPATCH_CACHE_TYPES(queries.scalar_type(), "kvcomp::averaged_rope", [&] {
    averaged_rope_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        queries_c.const_data_ptr<scalar_t>(), tables.const_data_ptr<float>(), out.mutable_data_ptr<scalar_t>(),
        shape.dim, total);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// gvote_union_mask

struct RowKeys {
  const float* logits;  // [T] of this row, unscaled
  float scale;
  __device__ uint64_t operator()(int64_t slot) const {
    return g::selection_key(logits[slot] * scale, static_cast<uint32_t>(slot));
  }
};

__global__ void __launch_bounds__(kThreads)
    select_threshold_kernel(const float* __restrict__ logits,  // [n, T] unscaled q.k of rows first_row ..
                            const int64_t* __restrict__ budgets,  // [B * Hq]
                            uint64_t* __restrict__ thresholds,  // [n]
                            int64_t first_row, int64_t samples, int64_t len, float scale) {
  __shared__ uint32_t histogram[256];
  __shared__ uint64_t shared_prefix;
  __shared__ uint32_t shared_rank;
  const int64_t row = blockIdx.x;
  const int64_t k = g::clamp_budget(budgets[(first_row + row) / samples], len);
  if (k == 0 || k == len) return;  // the OR kernel reads the budget itself
  const RowKeys key_of{logits + row * len, scale};
  const uint64_t threshold =
      gpu::block_select_key(key_of, 0, len, static_cast<uint32_t>(k - 1), histogram, &shared_prefix, &shared_rank);
  if (threadIdx.x == 0) thresholds[row] = threshold;
}

// Split select, one pass: block (row, piece) counts the keys of its piece that match the row's prefix by their digit
// at `shift`, into its own histogram (so no block waits on another, and nothing is added atomically across blocks).
__global__ void __launch_bounds__(kThreads)
    piece_histogram_kernel(const float* __restrict__ logits,  // [n, T] unscaled q.k of rows first_row ..
                           const int64_t* __restrict__ budgets,  // [B * Hq]
                           const uint64_t* __restrict__ prefixes,  // [n]
                           uint32_t* __restrict__ histograms,  // [n, gridDim.y, 256]
                           int64_t first_row, int64_t samples, int64_t len, int64_t piece_len, float scale,
                           int shift) {
  __shared__ uint32_t histogram[rs::kRadix];
  const int64_t row = blockIdx.x;
  const int64_t k = g::clamp_budget(budgets[(first_row + row) / samples], len);
  if (k == 0 || k == len) return;  // block-uniform; next_digit_kernel skips the row too
  for (int i = threadIdx.x; i < rs::kRadix; i += kThreads) histogram[i] = 0;
  __syncthreads();
  const RowKeys key_of{logits + row * len, scale};
  const uint64_t mask = rs::high_mask(shift), prefix = prefixes[row];
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * piece_len;
  const int64_t end = begin + piece_len < len ? begin + piece_len : len;
  for (int64_t slot = begin + threadIdx.x; slot < end; slot += kThreads) {
    const uint64_t key = key_of(slot);
    if ((key & mask) == prefix) atomicAdd(&histogram[rs::digit_of(key, shift)], 1u);
  }
  __syncthreads();
  uint32_t* out = histograms + (row * gridDim.y + blockIdx.y) * rs::kRadix;
  for (int i = threadIdx.x; i < rs::kRadix; i += kThreads) out[i] = histogram[i];
}

// Split select, the pass's second stage: block `row`, thread = digit, adds the pieces' counts of its digit (in piece
// order), and the digit holding the rank extends the prefix and narrows the rank. The first pass takes rank k - 1.
__global__ void __launch_bounds__(rs::kRadix)
    next_digit_kernel(const uint32_t* __restrict__ histograms,  // [n, pieces, 256]
                      const int64_t* __restrict__ budgets,  // [B * Hq]
                      uint64_t* __restrict__ prefixes,  // [n], zeros before the first pass, the thresholds after the last
                      uint32_t* __restrict__ ranks,  // [n]
                      int64_t first_row, int64_t samples, int64_t len, int64_t pieces, int shift, bool first_pass) {
  using BlockScan = cub::BlockScan<uint32_t, rs::kRadix>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  const int64_t row = blockIdx.x;
  const int64_t k = g::clamp_budget(budgets[(first_row + row) / samples], len);
  if (k == 0 || k == len) return;  // block-uniform
  const uint32_t rank = first_pass ? static_cast<uint32_t>(k - 1) : ranks[row];
  const uint64_t prefix = prefixes[row];
  const uint32_t digit = threadIdx.x;
  uint32_t count = 0;
  for (int64_t piece = 0; piece < pieces; ++piece) count += histograms[(row * pieces + piece) * rs::kRadix + digit];
  uint32_t below;
  BlockScan(scan_storage).ExclusiveSum(count, below);
  __syncthreads();  // every thread has read prefixes[row] and ranks[row] before the one holding the rank writes them
  if (rs::holds_rank(below, count, rank)) {
    prefixes[row] = prefix | (static_cast<uint64_t>(digit) << shift);
    ranks[row] = rank - below;
  }
}

__global__ void __launch_bounds__(kThreads)
    or_into_mask_kernel(const float* __restrict__ logits,  // [n, T]
                        const int64_t* __restrict__ budgets,  // [B * Hq]
                        const uint64_t* __restrict__ thresholds,  // [n]
                        bool* __restrict__ mask,  // [B * H, T]
                        int64_t first_row, int64_t rows, int64_t samples, int64_t per_head, int64_t first_head,
                        int64_t heads, int64_t len, float scale) {
  const int64_t total = heads * len;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t slot = i % len;
    const int64_t head = first_head + i / len;
    // The chunk's rows of this kv head.
    const int64_t head_begin = head * per_head, head_end = head_begin + per_head, chunk_end = first_row + rows;
    const int64_t begin = (head_begin > first_row ? head_begin : first_row) - first_row;
    const int64_t end = (head_end < chunk_end ? head_end : chunk_end) - first_row;
    bool keep = false;
    for (int64_t row = begin; row < end && !keep; ++row) {
      const int64_t k = g::clamp_budget(budgets[(first_row + row) / samples], len);
      if (k == 0) continue;
      keep = k == len || g::selection_key(logits[row * len + slot] * scale, static_cast<uint32_t>(slot)) <=
                             thresholds[row];
    }
    if (keep) mask[head * len + slot] = true;  // never cleared: sinks and earlier chunks stay
  }
}

at::Tensor gvote_union_mask_cuda(const at::Tensor& keys, const at::Tensor& queries, const at::Tensor& budgets,
                                 int64_t sinks, double scale, int64_t chunk_size) {
  const GVoteUnionShape shape = check_gvote_union_mask(keys, queries, budgets, sinks, scale, chunk_size);
  const c10::cuda::OptionalCUDAGuard device_guard(keys.device());
  at::Tensor mask = at::zeros({shape.batch, shape.kv_heads, shape.len}, keys.options().dtype(at::kBool));
  const int64_t len = shape.len;
  if (sinks > 0 && len > 0) mask.narrow(2, 0, std::min(sinks, len)).fill_(true);
  const at::Tensor budgets_c = budgets.contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t samples = shape.samples, per_head = shape.rows_per_kv_head();
  const float scale_f = static_cast<float>(scale);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  for_each_logit_chunk(keys, queries, shape, chunk_size, [&](const at::Tensor& logits, int64_t first_row) {
    const int64_t rows = logits.size(0);
    const unsigned row_blocks = grid_dim("kvcomp::gvote_union_mask", "rows", rows);
    const kernels::launch::RowPieces pieces = kernels::launch::row_pieces(rows, len, sms, kMinSlotsPerPiece);
    const at::Tensor thresholds = at::zeros({rows}, budgets_c.options());  // the split select's prefixes start at 0
    uint64_t* thresholds_ptr = reinterpret_cast<uint64_t*>(thresholds.mutable_data_ptr<int64_t>());
    if (pieces.count == 1) {
      select_threshold_kernel<<<row_blocks, kThreads, 0, stream>>>(
          logits.const_data_ptr<float>(), budgets_c.const_data_ptr<int64_t>(), thresholds_ptr, first_row, samples, len,
          scale_f);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      const at::Tensor histograms = at::empty({rows, pieces.count, rs::kRadix}, budgets_c.options().dtype(at::kInt));
      const at::Tensor ranks = at::empty({rows}, budgets_c.options().dtype(at::kInt));
      uint32_t* histograms_ptr = reinterpret_cast<uint32_t*>(histograms.mutable_data_ptr<int32_t>());
      uint32_t* ranks_ptr = reinterpret_cast<uint32_t*>(ranks.mutable_data_ptr<int32_t>());
      bool first_pass = true;
      for (int shift = rs::kFirstShift; shift >= 0; shift -= 8) {
        if (rs::byte_is_zero(shift, len)) continue;
        piece_histogram_kernel<<<dim3(row_blocks, static_cast<unsigned>(pieces.count)), kThreads, 0, stream>>>(
            logits.const_data_ptr<float>(), budgets_c.const_data_ptr<int64_t>(), thresholds_ptr, histograms_ptr,
            first_row, samples, len, pieces.length, scale_f, shift);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        next_digit_kernel<<<row_blocks, rs::kRadix, 0, stream>>>(histograms_ptr, budgets_c.const_data_ptr<int64_t>(),
                                                                thresholds_ptr, ranks_ptr, first_row, samples, len,
                                                                pieces.count, shift, first_pass);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        first_pass = false;
      }
    }
    const int64_t first_head = first_row / per_head;
    const int64_t heads = (first_row + rows - 1) / per_head - first_head + 1;
    const int64_t total = heads * len;
    const auto blocks = static_cast<unsigned>(std::min<int64_t>((total + kThreads - 1) / kThreads, 1 << 16));
    or_into_mask_kernel<<<blocks, kThreads, 0, stream>>>(
        logits.const_data_ptr<float>(), budgets_c.const_data_ptr<int64_t>(),
        thresholds_ptr, mask.mutable_data_ptr<bool>(),
        first_row, rows, samples, per_head, first_head, heads, len, scale_f);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return mask;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CUDA, m) {
  m.impl("nucleus_budget", &nucleus_budget_cuda);
  m.impl("averaged_rope", &averaged_rope_cuda);
  m.impl("gvote_union_mask", &gvote_union_mask_cuda);
}

}  // namespace kvcomp
