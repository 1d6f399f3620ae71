// The split-K decode attention kernels of decode_attention.cuh (CacheView, split_decode_attention).
//
// Memory-bound, as FlashInfer's and FlashAttention's split-KV decode: K and V must be read once, with several loads
// in flight per thread, and there must be enough blocks to fill the GPU even at batch 1. The T slots of each (batch,
// kv-head) are split into chunks of C slots (kernels::launch::decode_split):
//   attend_chunk_kernel, one block per (batch, kv-head, tile of query rows, chunk): stages where the chunk's key and
//     value rows are in the cache (CacheView), the tile's queries (all G * q rows of the group when G * q <= 8) and
//     the chunk's log-weights in shared memory, asks for the attended slots' value rows in L2, reads the chunk's keys
//     once (kInFlight slots per thread group issued before the first use) to get every row's logits, writes
//     exp(logit - chunk max) into probs, reads the chunk's values once the same way to accumulate
//     Σ exp(logit - chunk max) v into a float32 workspace, and stores the chunk's (max, sum of exp).
//   combine_chunks_kernel, one block per (query row, piece of the slots): reduces the row's chunk statistics (CUB
//     block reduction with the online-softmax step kernels::combine), rescales its piece of probs by
//     f_c = exp(m_c - M) / S, and piece 0 writes out = Σ_c f_c partial_c. No atomics: the result does not depend on
//     scheduling.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cub/block/block_reduce.cuh>

#include <cstdint>

#include "cuda/decode_attention.cuh"
#include "kernels/attention.h"
#include "kernels/launch.h"
#include "kvcomp/checks.h"

namespace kvcomp::gpu {
namespace {

constexpr int kDecodeThreads = 256;  // threads of both decode kernels
constexpr int kDecodeWarps = kDecodeThreads / 32;

// kVec adjacent cache values as floats; kVec > 1 is one 16-byte load (the caller checked the alignment).
template <typename scalar_t, int kVec>
struct alignas(sizeof(scalar_t) * kVec) Pack {
  scalar_t v[kVec];
};

template <typename scalar_t, int kVec>
__device__ __forceinline__ void load_floats(const scalar_t* __restrict__ src, float (&dst)[kVec]) {
  const Pack<scalar_t, kVec> pack = *reinterpret_cast<const Pack<scalar_t, kVec>*>(src);
#pragma unroll
  for (int i = 0; i < kVec; ++i) dst[i] = static_cast<float>(pack.v[i]);
}

// A hint that `address` will be read soon: its line is fetched into L2 now, without waiting for it.
__device__ __forceinline__ void prefetch_l2(const void* address) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(address));
}

// Blocks per multiprocessor the launch bounds ask for: 3 where the query pieces and the accumulators (kRows * kVec
// floats each) fit 85 registers, else 2 (128 registers).
template <int kRows, int kVec>
constexpr int min_blocks() {
  return kRows * kVec <= 16 ? 3 : 2;
}

// Slots a thread group loads before it uses the first: keys and values of kInFlight slots are in flight at once.
// Four where ~40 registers of addressing and loop state, the kRows * kVec query pieces or accumulators and four
// kVec-wide loads fit the register budget, else two (ptxas spilled four at kRows = 2, kVec = 8 under 3 blocks).
// 2-4 loads of 16 bytes per thread over 512-768 threads keep 16-48 KiB per multiprocessor in flight, above what
// HBM3's latency-bandwidth product asks (~15 KiB).
template <int kRows, int kVec>
constexpr int in_flight() {
  return 40 + kRows * kVec + 4 * kVec <= 65536 / (kDecodeThreads * min_blocks<kRows, kVec>()) ? 4 : 2;
}

// One block per (batch, kv-head, row tile, chunk): see the file comment. Shared memory:
//   s_key_offset, s_value_offset [C]  int64: where each slot's key and value rows start, from the head's first
//   s_query  [kRows, d]       tile queries times the scale, float
//   s_probs  [kRows, C]       logits, then exp(logit - chunk max)
//   s_bias   [C]              the chunk's log-weights
//   s_reduce [kDecodeThreads * kVec] per-slot-group partial outputs of one row, summed over the groups
template <typename scalar_t, int kVec, int kRows>
__global__ void __launch_bounds__(kDecodeThreads, min_blocks<kRows, kVec>())
    attend_chunk_kernel(const scalar_t* __restrict__ query,  // [B * H, rows, d]
                        const CacheView<scalar_t> cache,
                        float* __restrict__ probs,  // [B * H, rows, T]: exp(logit - chunk max) on return; or null
                        float* __restrict__ partial_out,  // [B * H, rows, chunks, d]
                        float2* __restrict__ partial_stats,  // [B * H, rows, chunks]: (chunk max, Σ exp)
                        const DecodeParams p) {
  constexpr int kInFlight = in_flight<kRows, kVec>();
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t d = p.head_dim, C = p.chunk_len;
  int64_t* s_key_offset = reinterpret_cast<int64_t*>(smem);
  int64_t* s_value_offset = s_key_offset + C;
  float* s_query = reinterpret_cast<float*>(s_value_offset + C);
  float* s_probs = s_query + kRows * d;
  float* s_bias = s_probs + kRows * C;
  float* s_reduce = s_bias + C;

  const int64_t chunk = blockIdx.x % p.num_chunks;
  const int64_t tile = (blockIdx.x / p.num_chunks) % p.num_tiles;
  const int64_t pair = blockIdx.x / (p.num_chunks * p.num_tiles);
  const int64_t batch = pair / p.kv_heads, head = pair % p.kv_heads;
  const int64_t row0 = tile * kRows;
  const int tile_rows = static_cast<int>(min(static_cast<int64_t>(kRows), p.rows - row0));
  const int64_t length = cache.length(pair, p.total_len);
  const int64_t slot_begin = chunk * C;
  const int64_t len = max(min(length, slot_begin + C) - slot_begin, int64_t{0});  // this head's slots of the chunk
  const int64_t width = min(p.total_len, slot_begin + C) - slot_begin;          // the chunk's columns of probs

  const int tid = threadIdx.x;
  const int lane = tid % p.lanes;   // which kVec-wide pieces of d this thread reads
  const int group = tid / p.lanes;  // which slot of the current step it handles
  const int groups = kDecodeThreads / p.lanes;
  const int64_t lane_stride = static_cast<int64_t>(p.lanes) * kVec;

  const scalar_t* __restrict__ key_head = cache.keys + batch * cache.key_strides[0] + head * cache.key_strides[1];
  const scalar_t* __restrict__ value_head =
      cache.values + batch * cache.value_strides[0] + head * cache.value_strides[1];

  __shared__ int64_t s_count[kRows];  // causal limit of each row of the tile
  for (int64_t i = tid; i < tile_rows * d; i += kDecodeThreads) {
    s_query[i] = static_cast<float>(query[(pair * p.rows + row0) * d + i]) * p.scale;
  }
  // Each slot's rows in the cache (a block-table lookup where paged) and its log-weight, resolved once into shared
  // memory: every lane of a group uses them, in each of the steps below.
  for (int64_t i = tid; i < len; i += kDecodeThreads) {
    const int64_t index = cache.slot_index(pair, slot_begin + i);
    s_key_offset[i] = index * cache.key_strides[2];
    s_value_offset[i] = index * cache.value_strides[2];
    s_bias[i] = cache.log_weights[pair * cache.log_weight_strides[0] + index * cache.log_weight_strides[1]];
  }
  if (tid < tile_rows) {
    s_count[tid] = kernels::causal_slot_count((row0 + tid) % p.num_queries, p.num_queries, length);
  }
  __syncthreads();

  // This lane's first kVec-wide piece of every query row, in registers (the one piece for d <= lanes * kVec, as in
  // every usual head dim); further pieces are read from shared memory.
  const int64_t e_first = lane * kVec;
  float q_first[kRows][kVec];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) q_first[r][i] = r < tile_rows && e_first < d ? s_query[r * d + e_first + i] : 0.0f;
  }
  // Rows are pulled apart by the transpose reduction below: at its end this lane holds `held` row sums, rows
  // row_base .. row_base + held - 1; with lanes > kRows several lanes hold the same row and only `writer` stores it.
  int row_base = 0, held = kRows;
  for (int offset = p.lanes / 2, half = kRows / 2; offset > 0 && half > 0; offset /= 2, half /= 2) {
    if (lane & offset) row_base += half;
    held = half;
  }
  const bool writer = p.lanes <= kRows || (lane & (p.lanes / kRows - 1)) == 0;
  // Causal limits of the tile's rows: every row sees the slots below the smallest, none those from the largest on,
  // so the per-row limit (an integer division) is only evaluated for the few slots in between.
  // Both are kept relative to the chunk (int, C <= 256).
  int min_local = static_cast<int>(len), max_local = 0;
  for (int r = 0; r < tile_rows; ++r) {
    const int64_t local_count = min(max(s_count[r] - slot_begin, int64_t{0}), len);
    min_local = min(min_local, static_cast<int>(local_count));
    max_local = max(max_local, static_cast<int>(local_count));
  }

  // 0. Step 3 reads the values of the attended slots after the softmax: asking for them now, one L2 prefetch per
  //    32-byte sector, keeps HBM busy through steps 1 and 2 (and the chunk's values fit L2 many times over).
  {
    constexpr int kSector = 32 / sizeof(scalar_t);
    const int sectors = static_cast<int>((d + kSector - 1) / kSector);
    for (int i = tid; i < static_cast<int>(len) * sectors; i += kDecodeThreads) {  // len <= C <= 256
      const int local = i / sectors;
      if (kernels::slot_attended(local, max_local, s_bias[local])) {
        prefetch_l2(value_head + s_value_offset[local] + (i - local * sectors) * kSector);
      }
    }
  }

  // 1. Logits: the `lanes` threads of a group read one key (coalesced) and reduce its dot products with shuffles.
  //    Each step a group takes kInFlight slots, groups apart, and issues all their loads before the first use.
  //    The loop bound is uniform over the block so that every lane of a warp reaches the shuffles.
  for (int64_t base = 0; base < len; base += static_cast<int64_t>(groups) * kInFlight) {
    float k[kInFlight][kVec];
    bool read[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t local = base + u * groups + group;
      // Masked and evicted slots: the key is never read (some row of the tile must attend the slot).
      read[u] = local < len && e_first < d && kernels::slot_attended(local, max_local, s_bias[local]);
#pragma unroll
      for (int i = 0; i < kVec; ++i) k[u][i] = 0.0f;
      if (read[u]) load_floats<scalar_t, kVec>(key_head + s_key_offset[local] + e_first, k[u]);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t local = base + u * groups + group;
      float dots[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) dots[r] = 0.0f;
      if (read[u]) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
#pragma unroll
          for (int i = 0; i < kVec; ++i) dots[r] = fmaf(q_first[r][i], k[u][i], dots[r]);
        }
        const scalar_t* key = key_head + s_key_offset[local];
        for (int64_t e = e_first + lane_stride; e < d; e += lane_stride) {  // head dims beyond lanes * kVec
          float piece[kVec];
          load_floats<scalar_t, kVec>(key + e, piece);
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            if (r < tile_rows) {
#pragma unroll
              for (int i = 0; i < kVec; ++i) dots[r] = fmaf(s_query[r * d + e + i], piece[i], dots[r]);
            }
          }
        }
      }
      // Transpose reduction over the group's lanes: each round, a lane sends the half of its rows that its partner
      // keeps, so the rounds cost kRows/2 + kRows/4 + ... shuffles instead of kRows * log2(lanes).
      int offset = p.lanes / 2;
#pragma unroll
      for (int half = kRows / 2; half > 0; half /= 2) {
        if (offset > 0) {
          const bool upper = lane & offset;
#pragma unroll
          for (int j = 0; j < half; ++j) {
            const float send = upper ? dots[j] : dots[j + half];
            const float keep = upper ? dots[j + half] : dots[j];
            dots[j] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
          }
          offset /= 2;
        }
      }
      for (; offset > 0; offset /= 2) dots[0] += __shfl_xor_sync(0xffffffffu, dots[0], offset);
      if (local < len && writer) {
        const float log_weight = s_bias[local];
        const int64_t slot = slot_begin + local;
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
          const int r = row_base + j;
          if (j < held && r < tile_rows) {
            const bool attended = local < min_local ? log_weight != -INFINITY
                                                    : kernels::slot_attended(slot, s_count[r], log_weight);
            s_probs[r * C + local] = attended ? dots[j] + log_weight : -INFINITY;
          }
        }
      }
    }
  }
  __syncthreads();

  // 2. One warp per row: chunk max, exp(logit - max) into shared memory and probs, sum of exp.
  const int warp = tid / 32, warp_lane = tid % 32;
  for (int r = warp; r < tile_rows; r += kDecodeWarps) {
    float* row = s_probs + r * C;
    float max = -INFINITY;
    for (int64_t i = warp_lane; i < len; i += 32) max = fmaxf(max, row[i]);
    for (int offset = 16; offset > 0; offset /= 2) max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, offset));
    float sum = 0.0f;
    float* global_row = probs ? probs + (pair * p.rows + row0 + r) * p.total_len + slot_begin : nullptr;
    for (int64_t i = warp_lane; i < len; i += 32) {
      const float e = kernels::shifted_exp(row[i], max);
      row[i] = e;
      if (global_row) global_row[i] = e;
      sum += e;
    }
    if (global_row) {  // columns past this head's length (a paged cache's shorter heads) are probability 0
      for (int64_t i = len + warp_lane; i < width; i += 32) global_row[i] = 0.0f;
    }
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (warp_lane == 0) partial_stats[(pair * p.rows + row0 + r) * p.num_chunks + chunk] = make_float2(max, sum);
  }
  __syncthreads();

  // 3. Σ_s p_s v_s: the same (group, lane) split and kInFlight slots per step, the value of a slot no row attends is
  //    never read. A group sums its slots in registers, then the groups are summed through shared memory, one row at
  //    a time.
  for (int64_t e_base = 0; e_base < d; e_base += lane_stride) {
    const int64_t e = e_base + lane * kVec;
    float acc[kRows][kVec];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[r][i] = 0.0f;
    }
    if (e < d) {
      for (int64_t base = group; base < len; base += static_cast<int64_t>(groups) * kInFlight) {
        float v[kInFlight][kVec];
        bool read[kInFlight];
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {
          const int64_t local = base + u * groups;
          read[u] = false;
          if (local < len) {
#pragma unroll
            for (int r = 0; r < kRows; ++r) read[u] |= r < tile_rows && s_probs[r * C + local] != 0.0f;
          }
#pragma unroll
          for (int i = 0; i < kVec; ++i) v[u][i] = 0.0f;
          if (read[u]) load_floats<scalar_t, kVec>(value_head + s_value_offset[local] + e, v[u]);
        }
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {
          if (!read[u]) continue;
          const int64_t local = base + u * groups;
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            const float weight = r < tile_rows ? s_probs[r * C + local] : 0.0f;
            if (weight != 0.0f) {  // 0 * NaN would leak a masked slot's garbage
#pragma unroll
              for (int i = 0; i < kVec; ++i) acc[r][i] = fmaf(weight, v[u][i], acc[r][i]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= tile_rows) break;
#pragma unroll
      for (int i = 0; i < kVec; ++i) s_reduce[group * lane_stride + lane * kVec + i] = acc[r][i];
      __syncthreads();
      if (tid < lane_stride && e_base + tid < d) {
        float total = 0.0f;
        for (int g = 0; g < groups; ++g) total += s_reduce[g * lane_stride + tid];
        partial_out[((pair * p.rows + row0 + r) * p.num_chunks + chunk) * d + e_base + tid] = total;
      }
      __syncthreads();
    }
  }
}

struct CombinePartials {
  __device__ kernels::SoftmaxPartial operator()(const kernels::SoftmaxPartial& a,
                                                const kernels::SoftmaxPartial& b) const {
    return kernels::combine(a, b);
  }
};

// One block per (query row, piece of piece_len slots): every block reduces the row's chunk statistics (a few hundred
// float2 at most, from L2), rescales its piece of the probabilities (when they are wanted: probs not null), and
// piece 0 combines the chunks into the output.
template <typename scalar_t>
__global__ void __launch_bounds__(kDecodeThreads)
    combine_chunks_kernel(const float* __restrict__ partial_out,  // [B * H * rows, chunks, d]
                          const float2* __restrict__ partial_stats,  // [B * H * rows, chunks]
                          float* __restrict__ probs,  // [B * H * rows, T], or null
                          scalar_t* __restrict__ out,  // [B * H * rows, d]
                          const int64_t* __restrict__ lengths,  // [B * H], or null: every head holds T slots
                          int64_t rows_per_head, int64_t total_len, int64_t head_dim, int64_t chunk_len,
                          int64_t num_chunks, int64_t piece_len) {
  using BlockReduce = cub::BlockReduce<kernels::SoftmaxPartial, kDecodeThreads>;
  __shared__ typename BlockReduce::TempStorage temp_storage;
  __shared__ kernels::SoftmaxPartial row_total;
  const int64_t row = blockIdx.x;
  const float2* stats = partial_stats + row * num_chunks;

  kernels::SoftmaxPartial local;
  for (int64_t c = threadIdx.x; c < num_chunks; c += kDecodeThreads) {
    local = kernels::combine(local, kernels::SoftmaxPartial{stats[c].x, stats[c].y});
  }
  const kernels::SoftmaxPartial total = BlockReduce(temp_storage).Reduce(local, CombinePartials{});
  if (threadIdx.x == 0) row_total = total;
  __syncthreads();
  const kernels::SoftmaxPartial all = row_total;

  if (blockIdx.y == 0) {
    const float* partial = partial_out + row * num_chunks * head_dim;
    for (int64_t e = threadIdx.x; e < head_dim; e += kDecodeThreads) {
      float acc = 0.0f;
      for (int64_t c = 0; c < num_chunks; ++c) {
        const float factor = kernels::chunk_normaliser(stats[c].x, all);
        if (factor != 0.0f) acc = fmaf(factor, partial[c * head_dim + e], acc);
      }
      out[row * head_dim + e] = static_cast<scalar_t>(acc);
    }
  }
  if (probs == nullptr) return;
  float* row_probs = probs + row * total_len;
  // Columns past the head's length stay the 0 that attend_chunk_kernel wrote, whatever the row's factors.
  const int64_t length = lengths ? lengths[row / rows_per_head] : total_len;
  const int64_t piece_end = min(length, (blockIdx.y + 1) * piece_len);
  for (int64_t s = blockIdx.y * piece_len + threadIdx.x; s < piece_end; s += kDecodeThreads) {
    row_probs[s] *= kernels::chunk_normaliser(stats[s / chunk_len].x, all);
  }
}

template <typename scalar_t, int kVec, int kRows>
void launch_attend_chunk(const char* op, const DecodeParams& params, int64_t pairs, const scalar_t* query,
                         const CacheView<scalar_t>& cache, float* probs, float* partial_out, float2* partial_stats,
                         cudaStream_t stream) {
  const size_t smem = 2 * sizeof(int64_t) * params.chunk_len +
                      sizeof(float) * (kRows * params.head_dim + (kRows + 1) * params.chunk_len + kDecodeThreads * kVec);
  const auto kernel = attend_chunk_kernel<scalar_t, kVec, kRows>;
  if (smem > 48 * 1024) {
    const int device = c10::cuda::current_device();
    int optin = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    TORCH_CHECK(smem <= static_cast<size_t>(optin), op, ": expected a head dim d that fits ", optin,
                " bytes of shared memory per block, got d = ", params.head_dim);
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  const int64_t blocks = pairs * params.num_tiles * params.num_chunks;
  TORCH_CHECK(blocks <= kernels::launch::kMaxGridX, op, ": expected at most ", kernels::launch::kMaxGridX,
              " blocks (B * H * tiles of 8 query rows * chunks), got ", blocks);
  kernel<<<static_cast<unsigned>(blocks), kDecodeThreads, smem, stream>>>(query, cache, probs, partial_out, partial_stats,
                                                                    params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int kVec>
void launch_attend_chunk_rows(const char* op, int rows_per_tile, const DecodeParams& params, int64_t pairs,
                              const scalar_t* query, const CacheView<scalar_t>& cache, float* probs,
                              float* partial_out, float2* partial_stats, cudaStream_t stream) {
  switch (rows_per_tile) {
    case 1:
      return launch_attend_chunk<scalar_t, kVec, 1>(op, params, pairs, query, cache, probs, partial_out,
                                                    partial_stats, stream);
    case 2:
      return launch_attend_chunk<scalar_t, kVec, 2>(op, params, pairs, query, cache, probs, partial_out,
                                                    partial_stats, stream);
    case 4:
      return launch_attend_chunk<scalar_t, kVec, 4>(op, params, pairs, query, cache, probs, partial_out,
                                                    partial_stats, stream);
    default:
      return launch_attend_chunk<scalar_t, kVec, 8>(op, params, pairs, query, cache, probs, partial_out,
                                                    partial_stats, stream);
  }
}

}  // namespace

template <typename scalar_t>
void split_decode_attention(const char* op, DecodeParams params, int64_t pairs, const scalar_t* query,
                            const CacheView<scalar_t>& cache, scalar_t* out, float* probs,
                            const at::TensorOptions& float_options) {
  namespace launch = kernels::launch;
  const int64_t rows = params.rows, d = params.head_dim;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const launch::DecodeSplit split = launch::decode_split(pairs, rows, d, params.total_len, sms);
  params.num_tiles = split.num_tiles;
  params.chunk_len = split.chunk_len;
  params.num_chunks = split.num_chunks;
  TORCH_CHECK(pairs * rows <= launch::kMaxGridX, op, ": expected at most ", launch::kMaxGridX,
              " query rows (B * Hq * q), got ", pairs * rows);
  at::Tensor partial_out = at::empty({pairs * rows, params.num_chunks, d}, float_options);
  at::Tensor partial_stats = at::empty({pairs * rows, params.num_chunks, 2}, float_options);
  float* partial_ptr = partial_out.mutable_data_ptr<float>();
  auto* stats_ptr = reinterpret_cast<float2*>(partial_stats.mutable_data_ptr<float>());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  constexpr int kWideVec = 16 / sizeof(scalar_t);  // one 16-byte load
  const bool wide = launch::rows_in_16_byte_pieces(reinterpret_cast<uintptr_t>(cache.keys), sizeof(scalar_t), d,
                                                   cache.key_strides) &&
                    launch::rows_in_16_byte_pieces(reinterpret_cast<uintptr_t>(cache.values), sizeof(scalar_t), d,
                                                   cache.value_strides);
  params.lanes = launch::decode_lanes(d, wide ? kWideVec : 1);
  if (wide) {
    launch_attend_chunk_rows<scalar_t, kWideVec>(op, split.rows_per_tile, params, pairs, query, cache, probs,
                                                 partial_ptr, stats_ptr, stream);
  } else {  // odd head dims or unaligned views: one element per load
    launch_attend_chunk_rows<scalar_t, 1>(op, split.rows_per_tile, params, pairs, query, cache, probs, partial_ptr,
                                          stats_ptr, stream);
  }
  const launch::CombineSplit combine = launch::combine_split(params.total_len);
  const dim3 grid(grid_dim(op, "query rows", pairs * rows), probs ? static_cast<unsigned>(combine.pieces) : 1u);
  combine_chunks_kernel<scalar_t><<<grid, kDecodeThreads, 0, stream>>>(
      partial_ptr, stats_ptr, probs, out, cache.lengths, rows, params.total_len, d, params.chunk_len,
      params.num_chunks, combine.piece_len);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template void split_decode_attention<float>(const char*, DecodeParams, int64_t, const float*,
                                            const CacheView<float>&, float*, float*, const at::TensorOptions&);
template void split_decode_attention<at::Half>(const char*, DecodeParams, int64_t, const at::Half*,
                                               const CacheView<at::Half>&, at::Half*, float*,
                                               const at::TensorOptions&);
template void split_decode_attention<at::BFloat16>(const char*, DecodeParams, int64_t, const at::BFloat16*,
                                                   const CacheView<at::BFloat16>&, at::BFloat16*, float*,
                                                   const at::TensorOptions&);

}  // namespace kvcomp::gpu
