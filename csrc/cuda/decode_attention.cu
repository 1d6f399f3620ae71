// The split-K decode attention kernels of decode_attention.cuh (CacheView, split_decode_attention).
//
// Memory-bound, as FlashInfer's and FlashAttention's split-KV decode: K and V must be read once, with enough bytes in
// flight on every multiprocessor, and there must be enough blocks to fill the GPU even at batch 1. The T slots of
// each (batch, kv-head) are split into chunks (kernels::launch::decode_split); each chunk is attended by one of:
//   attend_chunk_mma_kernel (sm_80+, float16 / bfloat16, d = 64 or 128, rows in 16-byte pieces, the probabilities
//     wanted over 64k cached slots or more, or more than 8 query rows per (batch, kv-head);
//     launch::tensor_core_decode_pays),
//     one block of 4 warps per (batch, kv-head, tile of 16 query rows, chunk of up to 2048 slots): the chunk's keys
//     and values stream through shared memory in tiles of 64 slots by cp.async, the next tile in flight while the
//     current one is multiplied; each warp takes 16 slots of a tile: S = Q Kᵀ on tensor cores (mma.cuh; the query
//     rows padded to 16 with zeros), the online softmax in base 2, O += P V with P split into a high and a low
//     half-precision part so that the weights keep ~16 bits. The warps' partials are combined at the end.
//   attend_chunk_kernel (the usual decode without probabilities or over few slots, float32, other head dims,
//     unaligned views), one block per (batch, kv-head, tile of query rows, chunk of up to 256 slots): stages where
//     the chunk's key and value rows are in the cache (CacheView), the tile's queries (all G * q rows of the group
//     when G * q <= 8) and the chunk's log-weights in shared memory, asks for the attended slots' value rows in L2,
//     reads the chunk's keys once (kInFlight slots per thread group issued before the first use) to get every row's
//     logits, writes exp(logit - chunk max) into probs, reads the chunk's values once the same way to accumulate
//     Σ exp(logit - chunk max) v into a float32 workspace, and stores the chunk's (max, sum of exp).
// Both leave the same thing per (query row, chunk): the partial output Σ exp(logit - m_c) v, the statistics (m_c, Σ
// exp(logit - m_c)) and, where probs are wanted, exp(logit - m_c) in probs; a slot no row attends (-inf, past the
// head's length) is never read, so whatever it holds, even NaN, it contributes nothing. (One difference: with q > 1,
// a NaN or infinite value in one of a head's last q - 1 slots reaches, on the tensor-core path, the earlier queries'
// rows too, which the causal mask gives weight 0 there: mma multiplies 0 by it, as the float64 reference's P V does.
// attend_chunk_kernel skips zero weights.) Then
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
#include <cstdlib>
#include <type_traits>

#include "cuda/decode_attention.cuh"
#include "cuda/mma.cuh"
#include "cuda/shared_memory.cuh"
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
// HBM3's latency-bandwidth product asks (~15 KiB). ptxas (CUDA 13.0, sm_90) still spills a little in four
// instantiations: half <8, 1> (48-60 bytes stored, reloads in the key loop), half <8, 8> (72-76), float32 <4, 4> (84)
// and <1, 8> (36). Whether two slots in flight there are faster than four with those spills is for a GPU to measure.
template <int kRows, int kVec>
constexpr int in_flight() {
  return 40 + kRows * kVec + 4 * kVec <= 65536 / (kDecodeThreads * min_blocks<kRows, kVec>()) ? 4 : 2;
}

// The (batch, kv head) pair, tile of query rows and chunk of slots that block blockIdx.x of either attend kernel
// covers: blocks run chunk-major within a tile, tile-major within a pair.
struct ChunkBlock {
  int64_t chunk, pair, batch, head;
  int64_t row0;       // the tile's first query row
  int64_t length;     // the head's slots (a paged cache's heads differ)
  int64_t slot_begin; // the chunk's first slot
  int64_t len;        // this head's slots of the chunk
  int64_t width;      // the chunk's columns of probs
  int tile_rows;      // query rows of the tile (fewer in the last)
};

template <typename scalar_t>
__device__ ChunkBlock chunk_block(const DecodeParams& p, const CacheView<scalar_t>& cache, int rows_per_tile) {
  ChunkBlock block;
  block.chunk = blockIdx.x % p.num_chunks;
  block.pair = blockIdx.x / (p.num_chunks * p.num_tiles);
  block.batch = block.pair / p.kv_heads;
  block.head = block.pair % p.kv_heads;
  block.row0 = (blockIdx.x / p.num_chunks) % p.num_tiles * rows_per_tile;
  block.tile_rows = static_cast<int>(min(static_cast<int64_t>(rows_per_tile), p.rows - block.row0));
  block.length = cache.length(block.pair, p.total_len);
  block.slot_begin = block.chunk * p.chunk_len;
  block.len = max(min(block.length, block.slot_begin + p.chunk_len) - block.slot_begin, int64_t{0});
  block.width = min(p.total_len, block.slot_begin + p.chunk_len) - block.slot_begin;
  return block;
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

  const ChunkBlock b = chunk_block(p, cache, kRows);

  const int tid = threadIdx.x;
  const int lane = tid % p.lanes;   // which kVec-wide pieces of d this thread reads
  const int group = tid / p.lanes;  // which slot of the current step it handles
  const int groups = kDecodeThreads / p.lanes;
  const int64_t lane_stride = static_cast<int64_t>(p.lanes) * kVec;

  const scalar_t* __restrict__ key_head = cache.keys + b.batch * cache.key_strides[0] + b.head * cache.key_strides[1];
  const scalar_t* __restrict__ value_head =
      cache.values + b.batch * cache.value_strides[0] + b.head * cache.value_strides[1];

  __shared__ int64_t s_count[kRows];  // causal limit of each row of the tile
  for (int64_t i = tid; i < b.tile_rows * d; i += kDecodeThreads) {
    s_query[i] = static_cast<float>(query[(b.pair * p.rows + b.row0) * d + i]) * p.scale;
  }
  // Each slot's rows in the cache (a block-table lookup where paged) and its log-weight, resolved once into shared
  // memory: every lane of a group uses them, in each of the steps below.
  for (int64_t i = tid; i < b.len; i += kDecodeThreads) {
    const int64_t index = cache.slot_index(b.pair, b.slot_begin + i);
    s_key_offset[i] = index * cache.key_strides[2];
    s_value_offset[i] = index * cache.value_strides[2];
    s_bias[i] = cache.log_weights[b.pair * cache.log_weight_strides[0] + index * cache.log_weight_strides[1]];
  }
  if (tid < b.tile_rows) {
    s_count[tid] = kernels::causal_slot_count((b.row0 + tid) % p.num_queries, p.num_queries, b.length);
  }
  __syncthreads();

  // This lane's first kVec-wide piece of every query row, in registers (the one piece for d <= lanes * kVec, as in
  // every usual head dim); further pieces are read from shared memory.
  const int64_t e_first = lane * kVec;
  float q_first[kRows][kVec];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) q_first[r][i] = r < b.tile_rows && e_first < d ? s_query[r * d + e_first + i] : 0.0f;
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
  int min_local = static_cast<int>(b.len), max_local = 0;
  for (int r = 0; r < b.tile_rows; ++r) {
    const int64_t local_count = min(max(s_count[r] - b.slot_begin, int64_t{0}), b.len);
    min_local = min(min_local, static_cast<int>(local_count));
    max_local = max(max_local, static_cast<int>(local_count));
  }

  // 0. Step 3 reads the values of the attended slots after the softmax: asking for them now, one L2 prefetch per
  //    32-byte sector, keeps HBM busy through steps 1 and 2 (and the chunk's values fit L2 many times over).
  {
    constexpr int kSector = 32 / sizeof(scalar_t);
    const int sectors = static_cast<int>((d + kSector - 1) / kSector);
    for (int i = tid; i < static_cast<int>(b.len) * sectors; i += kDecodeThreads) {  // len <= C <= 256
      const int local = i / sectors;
      if (kernels::slot_attended(local, max_local, s_bias[local])) {
        prefetch_l2(value_head + s_value_offset[local] + (i - local * sectors) * kSector);
      }
    }
  }

  // 1. Logits: the `lanes` threads of a group read one key (coalesced) and reduce its dot products with shuffles.
  //    Each step a group takes kInFlight slots, groups apart, and issues all their loads before the first use.
  //    The loop bound is uniform over the block so that every lane of a warp reaches the shuffles.
  for (int64_t base = 0; base < b.len; base += static_cast<int64_t>(groups) * kInFlight) {
    float k[kInFlight][kVec];
    bool read[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t local = base + u * groups + group;
      // Masked and evicted slots: the key is never read (some row of the tile must attend the slot).
      read[u] = local < b.len && e_first < d && kernels::slot_attended(local, max_local, s_bias[local]);
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
            if (r < b.tile_rows) {
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
      if (local < b.len && writer) {
        const float log_weight = s_bias[local];
        const int64_t slot = b.slot_begin + local;
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
          const int r = row_base + j;
          if (j < held && r < b.tile_rows) {
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
  for (int r = warp; r < b.tile_rows; r += kDecodeWarps) {
    float* row = s_probs + r * C;
    float max = -INFINITY;
    for (int64_t i = warp_lane; i < b.len; i += 32) max = fmaxf(max, row[i]);
    for (int offset = 16; offset > 0; offset /= 2) max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, offset));
    float sum = 0.0f;
    float* global_row = probs ? probs + (b.pair * p.rows + b.row0 + r) * p.total_len + b.slot_begin : nullptr;
    for (int64_t i = warp_lane; i < b.len; i += 32) {
      // Not shifted_exp: fmaxf passes over NaN, so a row whose other logits are all -inf (a NaN query) keeps
      // max = -inf, and its NaN must still reach the sum (NaN - -inf = NaN), as on the CPU (attention_rows.h).
      const float e = row[i] == -INFINITY ? 0.0f : ::expf(row[i] - max);
      row[i] = e;
      if (global_row) global_row[i] = e;
      sum += e;
    }
    if (global_row) {  // columns past this head's length (a paged cache's shorter heads) are probability 0
      for (int64_t i = b.len + warp_lane; i < b.width; i += 32) global_row[i] = 0.0f;
    }
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (warp_lane == 0) partial_stats[(b.pair * p.rows + b.row0 + r) * p.num_chunks + b.chunk] = make_float2(max, sum);
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
      for (int64_t base = group; base < b.len; base += static_cast<int64_t>(groups) * kInFlight) {
        float v[kInFlight][kVec];
        bool read[kInFlight];
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {
          const int64_t local = base + u * groups;
          read[u] = false;
          if (local < b.len) {
#pragma unroll
            for (int r = 0; r < kRows; ++r) read[u] |= r < b.tile_rows && s_probs[r * C + local] != 0.0f;
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
            const float weight = r < b.tile_rows ? s_probs[r * C + local] : 0.0f;
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
      if (r >= b.tile_rows) break;
#pragma unroll
      for (int i = 0; i < kVec; ++i) s_reduce[group * lane_stride + lane * kVec + i] = acc[r][i];
      __syncthreads();
      if (tid < lane_stride && e_base + tid < d) {
        float total = 0.0f;
        for (int g = 0; g < groups; ++g) total += s_reduce[g * lane_stride + tid];
        partial_out[((b.pair * p.rows + b.row0 + r) * p.num_chunks + b.chunk) * d + e_base + tid] = total;
      }
      __syncthreads();
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Tensor-core path (see the file comment). Shared memory, 16-bit elements first:
//   query  [kMmaRows][kStride]                     the tile's rows, zeros past the last
//   tiles  [2 buffers][keys, values][kMmaTile][kStride]
//   slot   [chunk_len] int64                        each chunk slot's row in the cache (a block-table lookup
//                                                    where paged)
//   bias   [chunk_len] float                        its log-weight
// After the last tile the buffers hold the warps' partials: out [kMmaWarps][kMmaRows][d] and (max, sum)
// [kMmaWarps][kMmaRows], in base 2.
constexpr int kMmaThreads = 128;
constexpr int kMmaWarps = kMmaThreads / 32;
constexpr int kMmaRows = kernels::launch::kTensorCoreDecodeRows;  // 16 query rows: one mma row block
constexpr int kMmaTile = kernels::launch::kTensorCoreDecodeTile;  // 64 slots per streamed tile
constexpr int kWarpSlots = kMmaTile / kMmaWarps;                  // 16: one k-step of P V
static_assert(kMmaRows == 16 && kWarpSlots == 16, "one mma row block of queries, one k-step of P V per warp");

template <int kHeadDim>
struct DecodeMmaTiles {
  static constexpr int kStride = kHeadDim + 8;    // elements per shared row: 16-byte rows land on distinct banks
  static constexpr int kPieces = kHeadDim / 8;    // 16-byte pieces per row
  static constexpr int kSteps = kHeadDim / 16;    // k-steps of Q Kᵀ over d
  static constexpr int kOutTiles = kHeadDim / 8;  // n-tiles of P V over d
  static constexpr int kTileElements = kMmaTile * kStride;
  static constexpr size_t kRowBytes = 2 * (kMmaRows + 4 * kMmaTile) * kStride;
  static_assert(kRowBytes % 16 == 0, "the slot array after the tiles must stay aligned");
  static_assert(sizeof(float) * kMmaWarps * kMmaRows * (kHeadDim + 2) <= 2 * 4 * kTileElements,
                "the warps' partials must fit the tile buffers");
  static size_t shared_bytes(int64_t chunk_len) { return kRowBytes + (sizeof(int64_t) + sizeof(float)) * chunk_len; }
};

template <typename scalar_t, int kHeadDim>
__global__ void __launch_bounds__(kMmaThreads, 2)
    attend_chunk_mma_kernel(const scalar_t* __restrict__ query,  // [B * H, rows, d], 16-byte aligned
                            const CacheView<scalar_t> cache,
                            float* __restrict__ probs,  // [B * H, rows, T]: exp(logit - chunk max) on return; or null
                            float* __restrict__ partial_out,  // [B * H, rows, chunks, d]
                            float2* __restrict__ partial_stats,  // [B * H, rows, chunks]: (chunk max, Σ exp)
                            const DecodeParams p) {
  using Tiles = DecodeMmaTiles<kHeadDim>;
  constexpr int kStride = Tiles::kStride;
  extern __shared__ __align__(16) unsigned char smem[];
  const int chunk_len = static_cast<int>(p.chunk_len);
  scalar_t* s_query = reinterpret_cast<scalar_t*>(smem);
  scalar_t* s_tiles = s_query + kMmaRows * kStride;
  int64_t* s_slot = reinterpret_cast<int64_t*>(smem + Tiles::kRowBytes);
  float* s_bias = reinterpret_cast<float*>(s_slot + chunk_len);
  __shared__ float s_row_base[kMmaRows];

  const ChunkBlock b = chunk_block(p, cache, kMmaRows);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const scalar_t* key_head = cache.keys + b.batch * cache.key_strides[0] + b.head * cache.key_strides[1];
  const scalar_t* value_head = cache.values + b.batch * cache.value_strides[0] + b.head * cache.value_strides[1];

  for (int i = tid; i < b.len; i += kMmaThreads) {
    const int64_t index = cache.slot_index(b.pair, b.slot_begin + i);
    s_slot[i] = index;
    s_bias[i] = cache.log_weights[b.pair * cache.log_weight_strides[0] + index * cache.log_weight_strides[1]];
  }
  for (int i = tid; i < kMmaRows * Tiles::kPieces; i += kMmaThreads) {
    const int r = i / Tiles::kPieces, piece = i % Tiles::kPieces;
    const bool valid = r < b.tile_rows;
    mma::copy_async<16>(s_query + r * kStride + piece * 8,
                        query + (valid ? (b.pair * p.rows + b.row0 + r) * kHeadDim + piece * 8 : 0), valid);
  }
  __syncthreads();  // the slots and log-weights, which the tile copies read

  // Tile `tile` of the chunk into buffer tile % 2; a slot no row attends is filled with zeros, not read.
  const int tiles = (b.len + kMmaTile - 1) / kMmaTile;
  auto copy_tile = [&](int tile) {
    scalar_t* keys = s_tiles + (tile % 2) * 2 * Tiles::kTileElements;
    auto copy_rows = [&](const scalar_t* head_rows, int64_t slot_stride, scalar_t* rows) {
      for (int i = tid; i < kMmaTile * Tiles::kPieces; i += kMmaThreads) {
        const int r = i / Tiles::kPieces, piece = i % Tiles::kPieces, local = tile * kMmaTile + r;
        const bool valid = local < b.len && s_bias[local] != -INFINITY;
        mma::copy_async<16>(rows + r * kStride + piece * 8,
                            valid ? head_rows + s_slot[local] * slot_stride + piece * 8 : head_rows, valid);
      }
    };
    copy_rows(key_head, cache.key_strides[2], keys);
    copy_rows(value_head, cache.value_strides[2], keys + Tiles::kTileElements);
    mma::commit_copies();
  };
  if (tiles > 0) {
    copy_tile(0);  // its group holds the query rows too
  } else {
    mma::commit_copies();  // the query rows alone
  }
  mma::wait_copies();
  __syncthreads();

  // The A fragments of the 16 query rows over all of d (every warp holds them all: the warps split the slots).
  uint32_t q_frag[Tiles::kSteps][4];
  {
    const scalar_t* row = s_query + (lane % 16) * kStride + (lane / 16) * 8;
#pragma unroll
    for (int step = 0; step < Tiles::kSteps; ++step) mma::load_blocks_x4(row + step * 16, q_frag[step]);
  }
  // This lane's rows of the tile are lane / 4 (h = 0) and lane / 4 + 8 (h = 1); its slots of a warp's 16 are
  // 8 (k / 2) + 2 (lane % 4) + k % 2 for k < 4 (accumulator element [k / 2][2 h + k % 2]). Each row's causal limit,
  // relative to the chunk (0 for the padding rows).
  int limit[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = lane / 4 + 8 * h;
    const int64_t count =
        kernels::causal_slot_count((b.row0 + r) % p.num_queries, p.num_queries, b.length) - b.slot_begin;
    limit[h] = r < b.tile_rows ? static_cast<int>(min(max(count, int64_t{0}), b.len)) : 0;
  }
  float* probs_rows = probs ? probs + (b.pair * p.rows + b.row0) * p.total_len + b.slot_begin : nullptr;
  const float scale = p.scale * mma::kLog2e;
  float running_max[2] = {-INFINITY, -INFINITY}, running_sum[2] = {0.0f, 0.0f};
  float out[Tiles::kOutTiles][4];
#pragma unroll
  for (int n = 0; n < Tiles::kOutTiles; ++n) out[n][0] = out[n][1] = out[n][2] = out[n][3] = 0.0f;

  for (int tile = 0; tile < tiles; ++tile) {
    mma::wait_copies();
    __syncthreads();  // tile `tile` is in, and no warp still reads the buffer the next one goes to
    if (tile + 1 < tiles) copy_tile(tile + 1);
    const scalar_t* keys = s_tiles + (tile % 2) * 2 * Tiles::kTileElements + warp * kWarpSlots * kStride;
    const scalar_t* values = keys + Tiles::kTileElements;

    // S = Q Kᵀ over this warp's 16 slots: ldmatrix blocks of slots 0-7 at d 0-7 and 8-15 (b0, b1 of n-tile 0),
    // then slots 8-15 (n-tile 1).
    float logits[2][4] = {};
    const scalar_t* key_row = keys + ((lane % 8) + (lane / 16) * 8) * kStride + ((lane / 8) % 2) * 8;
#pragma unroll
    for (int step = 0; step < Tiles::kSteps; ++step) {
      uint32_t b[4];
      mma::load_blocks_x4(key_row + step * 16, b);
      mma::multiply_add<scalar_t>(logits[0], q_frag[step], b[0], b[1]);
      mma::multiply_add<scalar_t>(logits[1], q_frag[step], b[2], b[3]);
    }

    // Logits in base 2 with the log-weight, -inf where the row does not attend the slot; the raw values go to
    // probs (normalised after the last tile), then the online softmax step of each row over the quad of lanes.
    const int first = tile * kMmaTile + warp * kWarpSlots;
    float x[2][4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int c = first + 8 * (k / 2) + 2 * (lane % 4) + k % 2;
      const float bias = c < b.len ? s_bias[c] : -INFINITY;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        x[h][k] = c < limit[h] && bias != -INFINITY ? fmaf(logits[k / 2][2 * h + k % 2], scale, bias * mma::kLog2e)
                                                    : -INFINITY;
        if (probs_rows && lane / 4 + 8 * h < b.tile_rows && c < b.len) {
          probs_rows[(lane / 4 + 8 * h) * p.total_len + c] = x[h][k];
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = fmaxf(fmaxf(x[h][0], x[h][1]), fmaxf(x[h][2], x[h][3]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float new_max = fmaxf(running_max[h], tile_max), base = mma::exp2_base(new_max);
      const float correction = mma::exp2_fast(running_max[h] - base);
      running_max[h] = new_max;
      float sum = 0.0f;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        x[h][k] = mma::exp2_fast(x[h][k] - base);
        sum += x[h][k];
      }
      running_sum[h] = fmaf(running_sum[h], correction, sum);
#pragma unroll
      for (int n = 0; n < Tiles::kOutTiles; ++n) {
        out[n][2 * h] *= correction;
        out[n][2 * h + 1] *= correction;
      }
    }

    // O += P V. P's A fragment (16 rows x 16 slots) is the logits' accumulator layout: a[0] rows lane / 4 at slots
    // 2 (lane % 4) + {0, 1}, a[1] the rows 8 down, a[2], a[3] the same 8 slots right. V's B fragments by transposed
    // ldmatrix: slots 0-7 and 8-15 at d 0-7 (b0, b1 of n-tile 2 pair), then at d 8-15 (n-tile 2 pair + 1).
    uint32_t p_high[4], p_low[4];
    mma::split_pair<scalar_t>(x[0][0], x[0][1], p_high[0], p_low[0]);
    mma::split_pair<scalar_t>(x[1][0], x[1][1], p_high[1], p_low[1]);
    mma::split_pair<scalar_t>(x[0][2], x[0][3], p_high[2], p_low[2]);
    mma::split_pair<scalar_t>(x[1][2], x[1][3], p_high[3], p_low[3]);
    const scalar_t* value_row = values + ((lane % 8) + ((lane / 8) % 2) * 8) * kStride + (lane / 16) * 8;
#pragma unroll
    for (int pair_of_tiles = 0; pair_of_tiles < Tiles::kOutTiles / 2; ++pair_of_tiles) {
      uint32_t b[4];
      mma::load_blocks_x4_transposed(value_row + pair_of_tiles * 16, b);
      mma::multiply_add<scalar_t>(out[2 * pair_of_tiles], p_high, b[0], b[1]);
      mma::multiply_add<scalar_t>(out[2 * pair_of_tiles], p_low, b[0], b[1]);
      mma::multiply_add<scalar_t>(out[2 * pair_of_tiles + 1], p_high, b[2], b[3]);
      mma::multiply_add<scalar_t>(out[2 * pair_of_tiles + 1], p_low, b[2], b[3]);
    }
  }
  __syncthreads();  // every warp is done with the tile buffers, which now take the partials

  // The warps' partials, then per row of the tile the chunk's: max M over the warps, out = Σ_w 2^(m_w - M) out_w and
  // sum = Σ_w 2^(m_w - M) sum_w. A warp that attended nothing of the row (sum 0) is skipped, so that its slots'
  // non-finite values, which only other rows attend, do not reach the row through 0 · NaN; a NaN sum is kept.
  float* s_out = reinterpret_cast<float*>(s_tiles);
  float2* s_stats = reinterpret_cast<float2*>(s_out + kMmaWarps * kMmaRows * kHeadDim);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = lane / 4 + 8 * h;
    const float sum = mma::quad_sum(running_sum[h]);
    if (lane % 4 == 0) s_stats[warp * kMmaRows + r] = make_float2(running_max[h], sum);
#pragma unroll
    for (int n = 0; n < Tiles::kOutTiles; ++n) {
      float* destination = s_out + (warp * kMmaRows + r) * kHeadDim + n * 8 + 2 * (lane % 4);
      destination[0] = out[n][2 * h];
      destination[1] = out[n][2 * h + 1];
    }
  }
  __syncthreads();
  for (int i = tid; i < b.tile_rows * kHeadDim; i += kMmaThreads) {
    const int r = i / kHeadDim, e = i % kHeadDim;
    float max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) max = fmaxf(max, s_stats[w * kMmaRows + r].x);
    const float base = mma::exp2_base(max);
    float total = 0.0f, sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) {
      const float2 stats = s_stats[w * kMmaRows + r];
      if (stats.y == 0.0f) continue;
      const float factor = mma::exp2_fast(stats.x - base);
      total = fmaf(factor, s_out[(w * kMmaRows + r) * kHeadDim + e], total);
      sum = fmaf(factor, stats.y, sum);
    }
    const int64_t row = b.pair * p.rows + b.row0 + r;
    partial_out[(row * p.num_chunks + b.chunk) * kHeadDim + e] = total;
    if (e == 0) {
      partial_stats[row * p.num_chunks + b.chunk] = make_float2(max * mma::kLn2, sum);
      s_row_base[r] = base;
    }
  }
  if (probs_rows == nullptr) return;
  __syncthreads();  // the rows' shifts, and the raw logits every warp wrote
  for (int r = 0; r < b.tile_rows; ++r) {
    float* row = probs_rows + r * p.total_len;
    for (int c = tid; c < b.width; c += kMmaThreads) row[c] = c < b.len ? mma::exp2_fast(row[c] - s_row_base[r]) : 0.0f;
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
  static const size_t static_smem = static_shared_bytes(kernel);  // s_count
  if (smem + static_smem > kSharedBytesWithoutOptIn) {
    const size_t allowed = allow_most_dynamic_shared_bytes(kernel, static_smem);
    TORCH_CHECK(smem <= allowed, op, ": expected a head dim d whose chunk fits the ", allowed,
                " bytes of shared memory this device gives a block, got d = ", params.head_dim);
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

template <typename scalar_t, int kHeadDim>
void launch_attend_chunk_mma(const char* op, const DecodeParams& params, int64_t pairs, const scalar_t* query,
                             const CacheView<scalar_t>& cache, float* probs, float* partial_out, float2* partial_stats,
                             cudaStream_t stream) {
  const auto kernel = attend_chunk_mma_kernel<scalar_t, kHeadDim>;
  const size_t smem = DecodeMmaTiles<kHeadDim>::shared_bytes(params.chunk_len);
  static const size_t static_smem = static_shared_bytes(kernel);
  // 99 KiB and more on every sm_80+ part: the largest chunk (98.6 KB at d = 128) fits
  const size_t allowed = allow_most_dynamic_shared_bytes(kernel, static_smem);
  TORCH_CHECK(smem <= allowed, op, ": the tensor-core kernel needs ", smem,
              " bytes of dynamic shared memory per block, the device allows ", allowed);
  const int64_t blocks = pairs * params.num_tiles * params.num_chunks;
  TORCH_CHECK(blocks <= kernels::launch::kMaxGridX, op, ": expected at most ", kernels::launch::kMaxGridX,
              " blocks (B * H * tiles of 16 query rows * chunks), got ", blocks);
  kernel<<<static_cast<unsigned>(blocks), kMmaThreads, smem, stream>>>(query, cache, probs, partial_out,
                                                                       partial_stats, params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether a call takes the tensor-core path: half precision, d = 64 or 128, the query and the cache's rows in 16-byte
// pieces, this build's kernels holding sm_80+ code for the device, and then, unless KVCOMP_DECODE_KERNEL names a
// kernel, probabilities wanted over enough cached slots or more query rows per (batch, kv head) than one split-K tile
// holds (launch::tensor_core_decode_pays).
template <typename scalar_t>
bool tensor_core_path(const char* op, int64_t rows, int64_t head_dim, bool with_probs, int64_t cached_slots,
                      const scalar_t* query, bool cache_in_pieces) {
  using kernels::launch::DecodeKernelChoice;
  const char* setting = std::getenv("KVCOMP_DECODE_KERNEL");
  const DecodeKernelChoice choice = kernels::launch::decode_kernel_choice(setting);
  TORCH_CHECK(choice != DecodeKernelChoice::kUnknown, op,
              ": KVCOMP_DECODE_KERNEL must be unset, auto, split_k or tensor_cores, got '", setting, "'");
  if constexpr (std::is_same_v<scalar_t, float>) {
    return false;
  } else {
    const bool can_run = (head_dim == 64 || head_dim == 128) && cache_in_pieces &&
                         reinterpret_cast<uintptr_t>(query) % 16 == 0 && mma::code_for_current_device();
    if (!can_run || choice == DecodeKernelChoice::kSplitK) return false;
    return choice == DecodeKernelChoice::kTensorCores ||
           kernels::launch::tensor_core_decode_pays(rows, head_dim, with_probs, cached_slots);
  }
}

}  // namespace

template <typename scalar_t>
void split_decode_attention(const char* op, DecodeParams params, int64_t pairs, const scalar_t* query,
                            const CacheView<scalar_t>& cache, scalar_t* out, float* probs,
                            const at::TensorOptions& float_options) {
  namespace launch = kernels::launch;
  const int64_t rows = params.rows, d = params.head_dim;
  TORCH_CHECK(pairs * rows <= launch::kMaxGridX, op, ": expected at most ", launch::kMaxGridX,
              " query rows (B * Hq * q), got ", pairs * rows);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  constexpr int kWideVec = 16 / sizeof(scalar_t);  // one 16-byte load
  const bool wide = launch::rows_in_16_byte_pieces(reinterpret_cast<uintptr_t>(cache.keys), sizeof(scalar_t), d,
                                                   cache.key_strides) &&
                    launch::rows_in_16_byte_pieces(reinterpret_cast<uintptr_t>(cache.values), sizeof(scalar_t), d,
                                                   cache.value_strides);
  const bool tensor_cores = tensor_core_path(op, rows, d, probs != nullptr, pairs * params.total_len, query, wide);
  const launch::DecodeSplit split =
      tensor_cores ? launch::tensor_core_decode_split(pairs, rows, d, params.total_len, sms)
                   : launch::decode_split(pairs, rows, d, params.total_len, sms);
  params.num_tiles = split.num_tiles;
  params.chunk_len = split.chunk_len;
  params.num_chunks = split.num_chunks;
  at::Tensor partial_out = at::empty({pairs * rows, params.num_chunks, d}, float_options);
  at::Tensor partial_stats = at::empty({pairs * rows, params.num_chunks, 2}, float_options);
  float* partial_ptr = partial_out.mutable_data_ptr<float>();
  auto* stats_ptr = reinterpret_cast<float2*>(partial_stats.mutable_data_ptr<float>());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  if (tensor_cores) {
    if constexpr (!std::is_same_v<scalar_t, float>) {
      if (d == 64) {
        launch_attend_chunk_mma<scalar_t, 64>(op, params, pairs, query, cache, probs, partial_ptr, stats_ptr, stream);
      } else {
        launch_attend_chunk_mma<scalar_t, 128>(op, params, pairs, query, cache, probs, partial_ptr, stats_ptr, stream);
      }
    }
  } else if (wide) {
    params.lanes = launch::decode_lanes(d, kWideVec);
    launch_attend_chunk_rows<scalar_t, kWideVec>(op, split.rows_per_tile, params, pairs, query, cache, probs,
                                                 partial_ptr, stats_ptr, stream);
  } else {  // odd head dims or unaligned views: one element per load
    params.lanes = launch::decode_lanes(d, 1);
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
