// CUDA kernels of the prompt_scores family: the log-sum-exp of every prompt query row, then the weighted column sums
// of the normalised probabilities. Neither materialises more than a 64 x 64 tile of logits (in shared memory) nor
// computes P·V.
//
// Rows are the (query, head-of-group) pairs of one kv head, query-major: row = j * G + g, so a tile of 64 rows holds
// the newest-or-oldest queries together and GQA never repeats keys. A tile of logits S = Q_tile · K_tileᵀ (64 x 64)
// is computed from shared memory:
//   * float16 / bfloat16 with head dim a multiple of 16: tensor cores (WMMA 16x16x16, float32 accumulation), each of
//     the 4 warps one 16-row strip;
//   * float32 (or another head dim): plain float32 FMA, each thread an 8 x 4 register block (no TF32: the logits keep
//     float32 products, as on CPU).
// log_sum_exp_kernel: one block per (batch, kv-head, row tile) over its key tiles, two threads per row each keeping
//   the online softmax (kernels::combine) of half of every tile's columns, combined once at the end.
// scores_kernel: one block per (batch, kv-head, key tile) over the row tiles, newest first, each thread summing one
//   column over half of the rows in a fixed order; the two halves add in a fixed order. Each score is written by one
//   block: deterministic, no atomics. Older rows are skipped once kernels::older_queries_negligible holds for the tile.
// log_unnormalised_scores_kernel: the same blocks, each column an online log-sum-exp of the weighted logits.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/launch.h"
#include "kernels/prompt_scores.h"
#include "kvcomp/prompt_scores.h"
#include "mma.cuh"
#include "shared_memory.cuh"

namespace kvcomp {
namespace {

constexpr int kTile = 64;             // rows of a query tile and keys of a key tile
constexpr int kThreads = 128;         // 4 warps: one 16-row strip each on tensor cores
constexpr int kLogitStride = kTile + 4;  // floats per row of the logits tile (padding against bank conflicts)
constexpr int kMaxHeadDim = 256;      // shared memory: two tiles of 64 x d plus the logits

template <typename scalar_t>
struct Mma {  // the WMMA element type of a cache dtype (float32: no tensor-core path)
  using type = void;
};
template <>
struct Mma<at::Half> {
  using type = __half;
};
template <>
struct Mma<at::BFloat16> {
  using type = __nv_bfloat16;
};

struct Layout {
  int64_t query_strides[3];  // batch, head, query (unit stride over d)
  int64_t key_strides[3];    // batch, head, slot
  int64_t query_heads, kv_heads, group_size, num_queries, total_len, head_dim;
  float scale;
  bool query_in_pieces, keys_in_pieces;  // rows readable 16 bytes at a time (launch::rows_in_16_byte_pieces)

  __device__ int64_t rows() const { return group_size * num_queries; }
  __device__ int64_t row_tiles() const { return (rows() + kTile - 1) / kTile; }
  // The oldest row tile holding a row whose query sees the key tile starting at key_begin: queries
  // j >= key_begin - (T - q) see its first key. Key-tile blocks walk the row tiles from the newest down to it.
  __device__ int64_t first_row_tile_seeing(int64_t key_begin) const {
    const int64_t first_query = key_begin - (total_len - num_queries);
    return (first_query > 0 ? first_query : 0) * group_size / kTile;
  }
  // Prompt position of row r (query r / G): its causal limit.
  __device__ int64_t position(int64_t row) const { return total_len - num_queries + row / group_size; }
};

// Element stride of a shared-memory tile row: d padded by 8 elements (WMMA wants ldm a multiple of 8 for 16-bit
// types; the padding also spreads rows over the banks).
__host__ __device__ inline int tile_stride(int64_t head_dim) { return static_cast<int>(head_dim) + 8; }

// Rows 0 .. kTile - 1 of a shared tile from global memory, row r starting at element row_offset(r) of `source` (-1:
// zeros), `kWidth` elements per load: a 16-byte piece where the rows allow it, else one element. 32-bit index
// arithmetic: a tile holds at most kTile * kMaxHeadDim elements.
template <int kWidth, typename scalar_t, typename RowOffset>
__device__ void copy_rows(const scalar_t* __restrict__ source, int head_dim, RowOffset row_offset, scalar_t* tile) {
  using Piece = std::conditional_t<kWidth == 1, scalar_t, uint4>;
  static_assert(sizeof(Piece) == kWidth * sizeof(scalar_t), "a piece is kWidth elements");
  const int pieces = head_dim / kWidth, stride = tile_stride(head_dim);
  for (int i = threadIdx.x; i < kTile * pieces; i += blockDim.x) {
    const int r = i / pieces, e = (i - r * pieces) * kWidth;
    const int64_t offset = row_offset(r);
    Piece piece;
    if (offset >= 0) {
      piece = *reinterpret_cast<const Piece*>(source + offset + e);
    } else {
      memset(&piece, 0, sizeof(Piece));
    }
    *reinterpret_cast<Piece*>(tile + r * stride + e) = piece;
  }
}

template <typename scalar_t, typename RowOffset>
__device__ void load_rows(bool in_pieces, const scalar_t* __restrict__ source, int64_t head_dim, RowOffset row_offset,
                          scalar_t* tile) {
  if (in_pieces) {
    copy_rows<16 / sizeof(scalar_t)>(source, static_cast<int>(head_dim), row_offset, tile);
  } else {
    copy_rows<1>(source, static_cast<int>(head_dim), row_offset, tile);
  }
}

// Rows [row_begin, row_begin + kTile) of kv head (batch, head) into shared memory, zero past the last row. Each
// row's offset (a 64-bit division by G) is computed once, by one thread; ends with the offsets' barrier only: the
// tile itself is complete after the caller's next __syncthreads.
template <typename scalar_t>
__device__ void load_query_tile(const Layout& layout, const scalar_t* __restrict__ query, int64_t batch, int64_t head,
                                int64_t row_begin, scalar_t* tile) {
  __shared__ int64_t row_offsets[kTile];
  for (int r = threadIdx.x; r < kTile; r += blockDim.x) {
    const int64_t row = row_begin + r;
    int64_t offset = -1;
    if (row < layout.rows()) {
      const int64_t j = row / layout.group_size, g = row % layout.group_size;
      offset = batch * layout.query_strides[0] + (head * layout.group_size + g) * layout.query_strides[1] +
               j * layout.query_strides[2];
    }
    row_offsets[r] = offset;
  }
  __syncthreads();
  load_rows(layout.query_in_pieces, query, layout.head_dim, [&](int r) { return row_offsets[r]; }, tile);
}

// Keys [key_begin, key_begin + kTile) of (batch, head) into shared memory, zero past T.
template <typename scalar_t>
__device__ void load_key_tile(const Layout& layout, const scalar_t* __restrict__ keys, int64_t batch, int64_t head,
                              int64_t key_begin, scalar_t* tile) {
  const int64_t head_offset = batch * layout.key_strides[0] + head * layout.key_strides[1];
  load_rows(layout.keys_in_pieces, keys, layout.head_dim, [&](int c) {
    const int64_t slot = key_begin + c;
    return slot < layout.total_len ? head_offset + slot * layout.key_strides[2] : int64_t{-1};
  }, tile);
}

// logits[r][c] = Q_tile[r] · K_tile[c] (unscaled) for the 64 x 64 tile; ends with __syncthreads.
template <typename scalar_t>
__device__ void tile_logits(const scalar_t* q_tile, const scalar_t* k_tile, int64_t head_dim, float* logits) {
  const int stride = tile_stride(head_dim);
  using MmaType = typename Mma<scalar_t>::type;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (!std::is_void_v<MmaType>) {
    if (head_dim % 16 == 0) {
      using namespace nvcuda;
      const int warp = threadIdx.x / 32;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kTile / 16];
      for (auto& a : acc) wmma::fill_fragment(a, 0.0f);
      const MmaType* q = reinterpret_cast<const MmaType*>(q_tile) + warp * 16 * stride;
      const MmaType* k = reinterpret_cast<const MmaType*>(k_tile);
      for (int64_t e = 0; e < head_dim; e += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, MmaType, wmma::row_major> a;
        wmma::load_matrix_sync(a, q + e, stride);
        for (int n = 0; n < kTile / 16; ++n) {
          // K_tile row-major [key][d] is K_tileᵀ column-major.
          wmma::fragment<wmma::matrix_b, 16, 16, 16, MmaType, wmma::col_major> b;
          wmma::load_matrix_sync(b, k + n * 16 * stride + e, stride);
          wmma::mma_sync(acc[n], a, b, acc[n]);
        }
      }
      for (int n = 0; n < kTile / 16; ++n) {
        wmma::store_matrix_sync(logits + warp * 16 * kLogitStride + n * 16, acc[n], kLogitStride,
                                wmma::mem_row_major);
      }
      __syncthreads();
      return;
    }
  }
#endif
  // float32 FMA: thread (ty, tx) computes rows 8 ty .. 8 ty + 7 and columns tx, tx + 16, tx + 32, tx + 48.
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[8][4] = {};
  for (int64_t e = 0; e < head_dim; ++e) {
    float kv[4];
    for (int c = 0; c < 4; ++c) kv[c] = static_cast<float>(k_tile[(tx + 16 * c) * stride + e]);
    for (int r = 0; r < 8; ++r) {
      const float qv = static_cast<float>(q_tile[(8 * ty + r) * stride + e]);
      for (int c = 0; c < 4; ++c) acc[r][c] = fmaf(qv, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < 8; ++r) {
    for (int c = 0; c < 4; ++c) logits[(8 * ty + r) * kLogitStride + tx + 16 * c] = acc[r][c];
  }
  __syncthreads();
}

// scale · q·k + b of row `row` (prompt position `position`) and slot key_begin + c; -inf on -inf slots (whatever their
// key holds), past T and past the row's causal limit.
__device__ inline float masked_logit(const float* logits, int r, int c, int64_t key_begin, int64_t position,
                                     const float* bias, float scale) {
  const int64_t slot = key_begin + c;
  const float b = bias[c];
  if (slot > position || b == -INFINITY) return -INFINITY;
  return logits[r * kLogitStride + c] * scale + b;
}

// Shared memory: query tile, key tile (kTile x (d + 8) scalars each), logits (kTile x kLogitStride floats), the key
// tile's log-weights (kTile floats).
template <typename scalar_t>
size_t shared_bytes(int64_t head_dim) {
  return 2 * kTile * tile_stride(head_dim) * sizeof(scalar_t) + (kTile * kLogitStride + kTile) * sizeof(float);
}

template <typename scalar_t>
struct Shared {
  scalar_t* q_tile;
  scalar_t* k_tile;
  float* logits;
  float* bias;

  __device__ Shared(unsigned char* raw, int64_t head_dim) {
    const int64_t tile_elems = kTile * tile_stride(head_dim);
    q_tile = reinterpret_cast<scalar_t*>(raw);
    k_tile = q_tile + tile_elems;
    logits = reinterpret_cast<float*>(k_tile + tile_elems);
    bias = logits + kTile * kLogitStride;
  }
};

__device__ void load_bias(const Layout& layout, const float* __restrict__ log_weights, int64_t pair, int64_t key_begin,
                          float* bias) {
  for (int c = threadIdx.x; c < kTile; c += blockDim.x) {
    const int64_t slot = key_begin + c;
    bias[c] = slot < layout.total_len ? log_weights[pair * layout.total_len + slot] : -INFINITY;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Pass 1

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) log_sum_exp_kernel(Layout layout, const scalar_t* __restrict__ query,
                                                               const scalar_t* __restrict__ keys,
                                                               const float* __restrict__ log_weights,
                                                               float* __restrict__ lse) {  // [B, Hq, q]
  extern __shared__ __align__(128) unsigned char shared_raw[];
  const Shared<scalar_t> smem(shared_raw, layout.head_dim);
  const int64_t pair = blockIdx.y, batch = pair / layout.kv_heads, head = pair % layout.kv_heads;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t last_row = (layout.rows() < row_begin + kTile ? layout.rows() : row_begin + kTile) - 1;
  load_query_tile(layout, query, batch, head, row_begin, smem.q_tile);

  // Thread (r, half) keeps the online softmax of row r over the columns half * 32 .. half * 32 + 31 of every key
  // tile; the two halves combine once, at the end. It walks its columns from a staggered start so that the 32 threads
  // of a warp read 32 different banks at each step: a logits row is kLogitStride = 4 (mod 32) floats long, so rows
  // r mod 8 start in 8 different groups of 4 banks, and (r / 8 mod 2, half) picks the bank within the group.
  const int r = threadIdx.x / 2, half = threadIdx.x % 2, stagger = 2 * ((r / 8) % 2) + half;
  const int64_t row = row_begin + r, position = layout.position(row);
  const bool live = row <= last_row;
  kernels::SoftmaxPartial running;
  const int64_t key_end = layout.position(last_row) + 1;
  for (int64_t key_begin = 0; key_begin < key_end; key_begin += kTile) {
    __syncthreads();  // the previous tile's logits and keys are no longer read
    load_key_tile(layout, keys, batch, head, key_begin, smem.k_tile);
    load_bias(layout, log_weights, pair, key_begin, smem.bias);
    __syncthreads();
    tile_logits(smem.q_tile, smem.k_tile, layout.head_dim, smem.logits);
    if (!live) continue;
    float logits[kTile / 2], max = -INFINITY;
#pragma unroll
    for (int c = 0; c < kTile / 2; ++c) {
      const int column = half * (kTile / 2) + ((c + stagger) & (kTile / 2 - 1));
      logits[c] = masked_logit(smem.logits, r, column, key_begin, position, smem.bias, layout.scale);
      max = fmaxf(max, logits[c]);
    }
    // Not shifted_exp: fmaxf passes over NaN, so a half whose only other logits are -inf keeps max = -inf, and the
    // NaN must still reach its sum (exp(NaN + inf)) rather than count as 0.
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kTile / 2; ++c) sum += logits[c] == -INFINITY ? 0.0f : ::expf(logits[c] - max);
    running = kernels::combine(running, kernels::SoftmaxPartial{max, sum});
  }
  const kernels::SoftmaxPartial other{__shfl_xor_sync(0xffffffffu, running.max, 1),
                                      __shfl_xor_sync(0xffffffffu, running.sum, 1)};
  if (live && half == 0) {
    const int64_t j = row / layout.group_size, g = row % layout.group_size;
    lse[((batch * layout.query_heads) + head * layout.group_size + g) * layout.num_queries + j] =
        kernels::row_log_sum_exp(kernels::combine(running, other));
  }
}

static_assert(kThreads == 2 * kTile, "log_sum_exp_kernel: two threads per row");
static_assert(kLogitStride % 32 == 4, "log_sum_exp_kernel's column stagger assumes rows 4 banks apart");

// ---------------------------------------------------------------------------------------------------------------
// Pass 2

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) scores_kernel(Layout layout, const scalar_t* __restrict__ query,
                                                          const scalar_t* __restrict__ keys,
                                                          const float* __restrict__ log_weights,
                                                          const float* __restrict__ lse, double decay,
                                                          double input_scale, float* __restrict__ scores) {
  extern __shared__ __align__(128) unsigned char shared_raw[];
  const Shared<scalar_t> smem(shared_raw, layout.head_dim);
  __shared__ float row_lse[kTile], row_weight[kTile], half_sums[kThreads], tile_min;
  __shared__ int64_t row_position[kTile];
  const int64_t pair = blockIdx.y, batch = pair / layout.kv_heads, head = pair % layout.kv_heads;
  const int64_t key_begin = static_cast<int64_t>(blockIdx.x) * kTile;
  load_key_tile(layout, keys, batch, head, key_begin, smem.k_tile);
  load_bias(layout, log_weights, pair, key_begin, smem.bias);

  const int column = threadIdx.x % kTile, half = threadIdx.x / kTile;  // rows half * 32 .. half * 32 + 31
  float acc = 0.0f;
  for (int64_t tile = layout.row_tiles() - 1; tile >= layout.first_row_tile_seeing(key_begin); --tile) {
    const int64_t row_begin = tile * kTile;
    __syncthreads();  // the previous tile's rows are no longer read
    load_query_tile(layout, query, batch, head, row_begin, smem.q_tile);
    for (int r = threadIdx.x; r < kTile; r += blockDim.x) {
      const int64_t row = row_begin + r;
      float value = -INFINITY;
      if (row < layout.rows()) {
        const int64_t j = row / layout.group_size, g = row % layout.group_size;
        value = lse[((batch * layout.query_heads) + head * layout.group_size + g) * layout.num_queries + j];
        row_position[r] = layout.position(row);
      }
      // A row with nothing to attend to (or past the end) weighs 0; lse 0 then keeps exp's argument -inf.
      row_lse[r] = value == -INFINITY ? 0.0f : value;
      row_weight[r] = value == -INFINITY ? 0.0f
                                         : kernels::query_weight(decay, input_scale,
                                                                 layout.num_queries - 1 - row / layout.group_size);
    }
    __syncthreads();
    tile_logits(smem.q_tile, smem.k_tile, layout.head_dim, smem.logits);
    for (int r = half * (kTile / 2); r < (half + 1) * (kTile / 2); ++r) {
      if (row_weight[r] == 0.0f) continue;  // past the last row too: row_position[r] is unset there
      const float logit = masked_logit(smem.logits, r, column, key_begin, row_position[r], smem.bias, layout.scale);
      acc = fmaf(row_weight[r], ::expf(logit - row_lse[r]), acc);
    }
    if (tile == 0) break;
    const double bound = kernels::older_queries_weight_bound(decay, input_scale,
                                                             layout.num_queries - 1 - row_begin / layout.group_size);
    if (bound < INFINITY) {
      half_sums[threadIdx.x] = acc;
      __syncthreads();
      if (threadIdx.x == 0) {
        float min_score = INFINITY;
        for (int c = 0; c < kTile; ++c) {
          if (smem.bias[c] != -INFINITY) min_score = fminf(min_score, half_sums[c] + half_sums[c + kTile]);
        }
        tile_min = min_score;
      }
      __syncthreads();
      if (kernels::older_queries_negligible(layout.group_size, bound, tile_min)) break;
    }
  }
  __syncthreads();
  half_sums[threadIdx.x] = acc;
  __syncthreads();
  if (half == 0 && key_begin + column < layout.total_len) {
    scores[pair * layout.total_len + key_begin + column] = half_sums[column] + half_sums[column + kTile];
  }
}

static_assert(kThreads == 2 * kTile, "scores_kernel: two threads per column");

// ---------------------------------------------------------------------------------------------------------------
// prompt_log_unnormalised_scores: as scores_kernel (one block per key tile, row tiles newest first, two threads per
// column over half of the rows each, in a fixed order), but each thread keeps an online log-sum-exp
// (kernels::add_log_term) of scale q·k + b + ln w_j instead of a sum of probabilities; the halves combine in a fixed
// order. Nothing is skipped: without a row normaliser no bound caps an older query's term.

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) log_unnormalised_scores_kernel(Layout layout,
                                                                           const scalar_t* __restrict__ query,
                                                                           const scalar_t* __restrict__ keys,
                                                                           const float* __restrict__ log_weights,
                                                                           double log_decay, double log_input_scale,
                                                                           float* __restrict__ log_scores) {
  extern __shared__ __align__(128) unsigned char shared_raw[];
  const Shared<scalar_t> smem(shared_raw, layout.head_dim);
  __shared__ float row_log_weight[kTile], half_max[kThreads], half_sum[kThreads];
  __shared__ int64_t row_position[kTile];
  const int64_t pair = blockIdx.y, batch = pair / layout.kv_heads, head = pair % layout.kv_heads;
  const int64_t key_begin = static_cast<int64_t>(blockIdx.x) * kTile;
  load_key_tile(layout, keys, batch, head, key_begin, smem.k_tile);
  load_bias(layout, log_weights, pair, key_begin, smem.bias);

  const int column = threadIdx.x % kTile, half = threadIdx.x / kTile;  // rows half * 32 .. half * 32 + 31
  kernels::SoftmaxPartial running;
  for (int64_t tile = layout.row_tiles() - 1; tile >= layout.first_row_tile_seeing(key_begin); --tile) {
    const int64_t row_begin = tile * kTile;
    __syncthreads();  // the previous tile's rows are no longer read
    load_query_tile(layout, query, batch, head, row_begin, smem.q_tile);
    for (int r = threadIdx.x; r < kTile; r += blockDim.x) {
      row_log_weight[r] = kernels::query_log_weight(log_decay, log_input_scale,
                                                    layout.num_queries - 1 - (row_begin + r) / layout.group_size);
      row_position[r] = layout.position(row_begin + r);
    }
    __syncthreads();
    tile_logits(smem.q_tile, smem.k_tile, layout.head_dim, smem.logits);
    for (int r = half * (kTile / 2); r < (half + 1) * (kTile / 2) && row_begin + r < layout.rows(); ++r) {
      const float logit = masked_logit(smem.logits, r, column, key_begin, row_position[r], smem.bias, layout.scale);
      running = kernels::add_log_term(running, logit + row_log_weight[r]);
    }
  }
  half_max[threadIdx.x] = running.max;
  half_sum[threadIdx.x] = running.sum;
  __syncthreads();
  if (half == 0 && key_begin + column < layout.total_len) {
    const kernels::SoftmaxPartial both = kernels::combine(kernels::SoftmaxPartial{half_max[column], half_sum[column]},
                                                          kernels::SoftmaxPartial{half_max[column + kTile],
                                                                                  half_sum[column + kTile]});
    log_scores[pair * layout.total_len + key_begin + column] = kernels::row_log_sum_exp(both);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Tensor-core path (sm_80+, float16 / bfloat16, d = 64 or 128, rows in 16-byte pieces): passes 1 and 2 with the
// logits kept in mma.sync accumulators (mma.cuh), never written to shared memory, as flash-attention 2 keeps them.
// Each warp holds 32 rows of the operand that stays (pass 1: query rows; pass 2: keys) as A fragments in registers
// for the whole block, 128 per block; the operand that moves (pass 1: key tiles, oldest first; pass 2: query tiles,
// newest first) streams in tiles of 64 rows through two shared-memory buffers, the next tile copied by cp.async while
// the current one is multiplied, 32 rows at a time. Each B fragment read from shared memory feeds two mma (the
// warp's two 16-row blocks), and each streamed tile serves 128 fixed rows. Softmax in base 2 on logits pre-scaled by
// log2(e): one ex2 per probability. Tiles wholly inside the causal limit skip the mask.

constexpr int kStreamBuffers = 2;
constexpr int kWarpRows = 32;                        // fixed rows per warp: two 16-row mma blocks
constexpr int kFixedRows = kWarpRows * kThreads / 32;  // fixed rows per block
constexpr int kHalf = kTile / 2;                     // streamed rows multiplied at once
using mma::exp2_base;
using mma::kLn2;
using mma::kLog2e;
using mma::quad_sum;
constexpr int kNoSlot = 0x7fffffff;  // the causal limit of a slot no row sees (-inf log-weight, past T)

template <int kHeadDim>
struct MmaTiles {
  static constexpr int kStride = kHeadDim + 8;  // elements per shared row: 16-byte rows land on distinct banks
  static constexpr int kPieces = kHeadDim / 8;  // 16-byte pieces per row
  static constexpr int kSteps = kHeadDim / 16;  // mma k-steps over d
  // The fixed rows, then the streamed buffers (16-bit elements).
  static constexpr size_t kSharedBytes = (kFixedRows + kStreamBuffers * kTile) * kStride * 2;
  using Fragments = uint32_t[kWarpRows / 16][kSteps][4];
  using Accumulators = float[kWarpRows / 16][kHalf / 8][4];
};

// Row `row` of kv head (batch, head) as an element offset into the query: (query j, head g of the group) = divmod(row, G).
struct QueryRows {
  at::cuda::detail::IntDivider<unsigned> group;
  int64_t base, head_stride, query_stride;

  __device__ int64_t offset(int64_t row) const {
    const auto split = group.divmod(static_cast<unsigned>(row));
    return base + split.mod * head_stride + split.div * query_stride;
  }
};

__device__ QueryRows query_rows(const Layout& layout, at::cuda::detail::IntDivider<unsigned> group, int64_t batch,
                                int64_t head) {
  return {group, batch * layout.query_strides[0] + head * layout.group_size * layout.query_strides[1],
          layout.query_strides[1], layout.query_strides[2]};
}

// Rows [row_begin, row_begin + count) into shared memory by cp.async (zeros past `rows`); row_offset(row) gives the
// element offset of a row.
template <int kHeadDim, int count, typename scalar_t, typename RowOffset>
__device__ void copy_rows_async(const scalar_t* __restrict__ source, int64_t row_begin, int64_t rows,
                                RowOffset row_offset, scalar_t* tile) {
  using Tiles = MmaTiles<kHeadDim>;
  for (int i = threadIdx.x; i < count * Tiles::kPieces; i += kThreads) {
    const int r = i / Tiles::kPieces, piece = i % Tiles::kPieces;
    const bool valid = row_begin + r < rows;
    mma::copy_async<16>(tile + r * Tiles::kStride + piece * 8,
                        valid ? source + row_offset(row_begin + r) + piece * 8 : source, valid);
  }
}

// The A fragments of this warp's 32 fixed rows, all of d.
template <int kHeadDim, typename scalar_t>
__device__ void load_warp_rows(const scalar_t* fixed_rows, typename MmaTiles<kHeadDim>::Fragments& fragments) {
  using Tiles = MmaTiles<kHeadDim>;
  const int lane = threadIdx.x % 32;
  // ldmatrix blocks 0..3: rows 0-7 and 8-15 at columns 0-7, then the same at columns 8-15 (a[0..3]).
#pragma unroll
  for (int block = 0; block < kWarpRows / 16; ++block) {
    const scalar_t* row =
        fixed_rows + ((threadIdx.x / 32) * kWarpRows + block * 16 + lane % 16) * Tiles::kStride + (lane / 16) * 8;
#pragma unroll
    for (int step = 0; step < Tiles::kSteps; ++step) mma::load_blocks_x4(row + step * 16, fragments[block][step]);
  }
}

// acc[block][n] = (this warp's fixed rows 16 block ..) · (streamed rows 8 n .. 8 n + 7 of `streamed`)ᵀ over d, for
// kHalf streamed rows.
template <int kHeadDim, typename scalar_t>
__device__ void warp_logits(const typename MmaTiles<kHeadDim>::Fragments& fixed, const scalar_t* streamed,
                            typename MmaTiles<kHeadDim>::Accumulators& acc) {
  using Tiles = MmaTiles<kHeadDim>;
  const int lane = threadIdx.x % 32;
  // ldmatrix blocks 0..3: streamed rows 0-7 at columns 0-7 and 8-15 (b0, b1 of n-tile 2p), then rows 8-15 (2p + 1).
  const scalar_t* row = streamed + ((lane % 8) + (lane / 16) * 8) * Tiles::kStride + ((lane / 8) % 2) * 8;
#pragma unroll
  for (int block = 0; block < kWarpRows / 16; ++block) {
#pragma unroll
    for (int n = 0; n < kHalf / 8; ++n) acc[block][n][0] = acc[block][n][1] = acc[block][n][2] = acc[block][n][3] = 0;
  }
#pragma unroll
  for (int step = 0; step < Tiles::kSteps; ++step) {
#pragma unroll
    for (int pair = 0; pair < kHalf / 16; ++pair) {
      uint32_t b[4];
      mma::load_blocks_x4(row + pair * 16 * Tiles::kStride + step * 16, b);
#pragma unroll
      for (int block = 0; block < kWarpRows / 16; ++block) {
        mma::multiply_add<scalar_t>(acc[block][2 * pair], fixed[block][step], b[0], b[1]);
        mma::multiply_add<scalar_t>(acc[block][2 * pair + 1], fixed[block][step], b[2], b[3]);
      }
    }
  }
}

// Fixed row (block, h) of this lane: 32 warp + 16 block + 8 h + lane / 4. Streamed column (n, e) of a half:
// 8 n + 2 (lane % 4) + e, accumulator element acc[block][n][2 h + e].
__device__ inline int fixed_row(int block, int h) {
  return (threadIdx.x / 32) * kWarpRows + block * 16 + h * 8 + (threadIdx.x % 32) / 4;
}
__device__ inline int streamed_column(int n, int e) { return n * 8 + (threadIdx.x % 4) * 2 + e; }

// accumulate(std::true_type) where the causal limit (or a -inf slot) cuts into the tile, else the unmasked variant.
template <typename Accumulate>
__device__ inline void with_mask_if(bool masked, Accumulate accumulate) {
  if (masked) {
    accumulate(std::true_type{});
  } else {
    accumulate(std::false_type{});
  }
}

// Online softmax statistics in base 2: the running max m (of logits · log2 e) and Σ 2^(x - m).
__device__ inline kernels::SoftmaxPartial combine_base2(kernels::SoftmaxPartial a, kernels::SoftmaxPartial b) {
  const float base = exp2_base(fmaxf(a.max, b.max));
  return {fmaxf(a.max, b.max), a.sum * mma::exp2_fast(a.max - base) + b.sum * mma::exp2_fast(b.max - base)};
}

template <typename scalar_t, int kHeadDim>
__global__ void __launch_bounds__(kThreads) log_sum_exp_mma_kernel(Layout layout,
                                                                   at::cuda::detail::IntDivider<unsigned> group,
                                                                   const scalar_t* __restrict__ query,
                                                                   const scalar_t* __restrict__ keys,
                                                                   const float* __restrict__ log_weights,
                                                                   float* __restrict__ lse) {  // [B, Hq, q]
  using Tiles = MmaTiles<kHeadDim>;
  extern __shared__ __align__(128) unsigned char shared_raw[];
  scalar_t* fixed_rows = reinterpret_cast<scalar_t*>(shared_raw);
  scalar_t* buffers = fixed_rows + kFixedRows * Tiles::kStride;  // [kStreamBuffers][kTile][kStride]
  __shared__ float bias[kStreamBuffers][kTile];
  const int64_t pair = blockIdx.y, batch = pair / layout.kv_heads, head = pair % layout.kv_heads;
  const int64_t rows = layout.rows(), total_len = layout.total_len;
  // The newest rows see the most keys: their blocks start first.
  const int64_t row_begin = (gridDim.x - 1 - blockIdx.x) * static_cast<int64_t>(kFixedRows);
  const int64_t key_head = batch * layout.key_strides[0] + head * layout.key_strides[1];
  const QueryRows queries = query_rows(layout, group, batch, head);
  auto copy_keys = [&](int64_t key_begin, int buffer) {
    copy_rows_async<kHeadDim, kTile>(keys, key_begin, total_len,
                                     [&](int64_t slot) { return key_head + slot * layout.key_strides[2]; },
                                     buffers + buffer * kTile * Tiles::kStride);
    if (threadIdx.x < kTile) {  // past T: 0, and the causal limit masks it
      const int64_t slot = key_begin + threadIdx.x;
      mma::copy_async<4>(&bias[buffer][threadIdx.x], log_weights + (slot < total_len ? pair * total_len + slot : 0),
                         slot < total_len);
    }
    mma::commit_copies();
  };

  copy_rows_async<kHeadDim, kFixedRows>(query, row_begin, rows, [&](int64_t row) { return queries.offset(row); },
                                        fixed_rows);
  copy_keys(0, 0);
  mma::wait_copies();
  __syncthreads();
  typename Tiles::Fragments fixed;
  load_warp_rows<kHeadDim>(fixed_rows, fixed);

  int position[2][2];  // of this lane's rows (block, h); rows past the last are never written
#pragma unroll
  for (int block = 0; block < 2; ++block) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row_begin + fixed_row(block, h);
      position[block][h] = static_cast<int>(layout.position(row < rows ? row : rows - 1));
    }
  }
  const int64_t last_row = (rows < row_begin + kFixedRows ? rows : row_begin + kFixedRows) - 1;
  const int64_t key_tiles = (layout.position(last_row) + kTile) / kTile;
  const int64_t first_position = layout.position(row_begin);  // the block's oldest row
  const float scale = layout.scale * kLog2e;
  kernels::SoftmaxPartial running[2][2];
  for (int64_t tile = 0; tile < key_tiles; ++tile) {
    mma::wait_copies();
    __syncthreads();  // key tile `tile` is in, and no warp still reads the buffer the next one goes to
    if (tile + 1 < key_tiles) copy_keys((tile + 1) * kTile, (tile + 1) % kStreamBuffers);
    const int buffer = tile % kStreamBuffers;
    const int key_begin = static_cast<int>(tile * kTile);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      typename Tiles::Accumulators acc;
      warp_logits<kHeadDim>(fixed, buffers + (buffer * kTile + half * kHalf) * Tiles::kStride, acc);
      // Per column of this lane: its log-weight in base 2 and its causal limit (kNoSlot for a -inf slot).
      float column_bias[kHalf / 4];
      int column_slot[kHalf / 4];
      bool masked = key_begin + (half + 1) * kHalf - 1 > first_position;  // some column past some row's limit
#pragma unroll
      for (int n = 0; n < kHalf / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = half * kHalf + streamed_column(n, e);
          const float b = bias[buffer][c];
          column_bias[2 * n + e] = b * kLog2e;
          column_slot[2 * n + e] = b == -INFINITY ? kNoSlot : key_begin + c;
          masked = masked || b == -INFINITY;  // -inf whatever the key holds
        }
      }
      masked = __any_sync(0xffffffffu, masked);  // one path per warp
      auto accumulate = [&](auto with_mask) {
#pragma unroll
        for (int block = 0; block < 2; ++block) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float x[kHalf / 4], tile_max = -INFINITY;
#pragma unroll
            for (int k = 0; k < kHalf / 4; ++k) {
              x[k] = fmaf(acc[block][k / 2][2 * h + k % 2], scale, column_bias[k]);
              if constexpr (decltype(with_mask)::value) {
                if (column_slot[k] > position[block][h]) x[k] = -INFINITY;
              }
              tile_max = fmaxf(tile_max, x[k]);  // passes over NaN: exp2 below still carries it into the sum
            }
            kernels::SoftmaxPartial& row = running[block][h];
            const float max = fmaxf(row.max, tile_max), base = exp2_base(max);
            float sum = row.sum * mma::exp2_fast(row.max - base);
#pragma unroll
            for (int k = 0; k < kHalf / 4; ++k) sum += mma::exp2_fast(x[k] - base);
            row = {max, sum};
          }
        }
      };
      with_mask_if(masked, accumulate);
    }
  }
  mma::wait_copies();

  // The four lanes of a row hold disjoint columns: combine them (every lane ends with the same statistics).
#pragma unroll
  for (int block = 0; block < 2; ++block) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      kernels::SoftmaxPartial& row_stats = running[block][h];
#pragma unroll
      for (int offset = 1; offset < 4; offset *= 2) {
        row_stats = combine_base2(row_stats, {__shfl_xor_sync(0xffffffffu, row_stats.max, offset),
                                              __shfl_xor_sync(0xffffffffu, row_stats.sum, offset)});
      }
      const int64_t row = row_begin + fixed_row(block, h);
      if (threadIdx.x % 4 == 0 && row < rows) {
        const auto split = group.divmod(static_cast<unsigned>(row));
        lse[((batch * layout.query_heads) + head * layout.group_size + split.mod) * layout.num_queries + split.div] =
            row_stats.sum == 0.0f ? -INFINITY : (row_stats.max + ::log2f(row_stats.sum)) * kLn2;
      }
    }
  }
}

// Per query row of a streamed tile: its log-sum-exp in base 2, its weight w_j, and its causal limit. A row that adds
// nothing (past the last row, nothing to attend to, a weight that is 0 in float32) has weight 0 and limit -1, and its
// tile takes the masked path.
struct alignas(16) RowTerms {  // aligned for the float2 / int2 reads of a lane's two rows
  float lse2[kStreamBuffers][kTile];
  float weight[kStreamBuffers][kTile];
  int position[kStreamBuffers][kTile];
};

template <typename scalar_t, int kHeadDim>
__global__ void __launch_bounds__(kThreads) scores_mma_kernel(Layout layout,
                                                              at::cuda::detail::IntDivider<unsigned> group,
                                                              const scalar_t* __restrict__ query,
                                                              const scalar_t* __restrict__ keys,
                                                              const float* __restrict__ log_weights,
                                                              const float* __restrict__ lse, double decay,
                                                              double input_scale, float* __restrict__ scores) {
  using Tiles = MmaTiles<kHeadDim>;
  extern __shared__ __align__(128) unsigned char shared_raw[];
  scalar_t* fixed_rows = reinterpret_cast<scalar_t*>(shared_raw);
  scalar_t* buffers = fixed_rows + kFixedRows * Tiles::kStride;  // [kStreamBuffers][kTile][kStride]
  __shared__ RowTerms terms;
  __shared__ float warp_min[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t pair = blockIdx.y, batch = pair / layout.kv_heads, head = pair % layout.kv_heads;
  const int64_t rows = layout.rows(), total_len = layout.total_len, num_queries = layout.num_queries;
  const int64_t key_begin = static_cast<int64_t>(blockIdx.x) * kFixedRows;
  const int64_t key_head = batch * layout.key_strides[0] + head * layout.key_strides[1];
  const QueryRows queries = query_rows(layout, group, batch, head);
  const float* row_lse = lse + (batch * layout.query_heads + head * layout.group_size) * num_queries;

  // Row r of tile `tile`, read by thread r < kTile into registers (the global loads overlap the tile's products),
  // then stored for the buffer that tile goes to.
  struct Row {
    float lse2 = 0.0f, weight = 0.0f;
    int position = -1;
  };
  auto fetch_row = [&](int64_t tile) {
    Row row;
    const int64_t index = tile * kTile + threadIdx.x;
    if (threadIdx.x < kTile && index < rows) {
      const auto split = group.divmod(static_cast<unsigned>(index));
      const float value = row_lse[split.mod * num_queries + split.div];
      const int64_t age = num_queries - 1 - split.div;
      const float weight = value == -INFINITY ? 0.0f
                           : decay == 1.0      ? static_cast<float>(input_scale)
                                               : kernels::query_weight(decay, input_scale, age);
      if (weight != 0.0f) row = {value * kLog2e, weight, static_cast<int>(total_len - 1 - age)};
    }
    return row;
  };
  auto store_row = [&](const Row& row, int buffer) {
    if (threadIdx.x < kTile) {
      terms.lse2[buffer][threadIdx.x] = row.lse2;
      terms.weight[buffer][threadIdx.x] = row.weight;
      terms.position[buffer][threadIdx.x] = row.position;
    }
  };
  auto copy_queries = [&](int64_t tile, int buffer) {
    copy_rows_async<kHeadDim, kTile>(query, tile * kTile, rows, [&](int64_t row) { return queries.offset(row); },
                                     buffers + buffer * kTile * Tiles::kStride);
    mma::commit_copies();
  };

  copy_rows_async<kHeadDim, kFixedRows>(keys, key_begin, total_len,
                                        [&](int64_t slot) { return key_head + slot * layout.key_strides[2]; },
                                        fixed_rows);
  const int64_t newest = layout.row_tiles() - 1, oldest = layout.first_row_tile_seeing(key_begin);
  copy_queries(newest, 0);
  const Row first = fetch_row(newest);
  store_row(first, 0);
  // Whether the row this thread stored for the tile in hand adds nothing: such a row is masked, never multiplied
  // by 0 (a NaN or infinite logit of it would make 0 · NaN), as the other kernels skip it.
  bool adds_nothing = threadIdx.x < kTile && first.weight == 0.0f;
  mma::wait_copies();
  __syncthreads();
  typename Tiles::Fragments fixed;
  load_warp_rows<kHeadDim>(fixed_rows, fixed);

  // This lane's keys (block, h), each with its log-weight in base 2 and causal limit (kNoSlot: -inf, scored 0).
  float key_bias[2][2], partial[2][2] = {};
  int key_slot[2][2];
#pragma unroll
  for (int block = 0; block < 2; ++block) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t slot = key_begin + fixed_row(block, h);
      const float b = slot < total_len ? log_weights[pair * total_len + slot] : -INFINITY;
      key_bias[block][h] = b * kLog2e;
      key_slot[block][h] = b == -INFINITY ? kNoSlot : static_cast<int>(slot);
    }
  }
  const int64_t last_key = key_begin + kFixedRows - 1;
  const float scale = layout.scale * kLog2e;
  for (int64_t tile = newest; tile >= oldest; --tile) {
    mma::wait_copies();
    // Query tile `tile` and its rows are in, and no warp still reads the buffer the next one goes to.
    const bool some_row_adds_nothing = __syncthreads_or(adds_nothing);
    const int buffer = (newest - tile) % kStreamBuffers, next = 1 - buffer;
    Row next_row;
    if (tile > oldest) {
      copy_queries(tile - 1, next);
      next_row = fetch_row(tile - 1);
    }
    // Unmasked when every row of the tile adds to, and sees, every key of the block.
    const int64_t row_begin = tile * kTile;
    const bool masked = some_row_adds_nothing || layout.position(row_begin) < last_key;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      typename Tiles::Accumulators acc;
      warp_logits<kHeadDim>(fixed, buffers + (buffer * kTile + half * kHalf) * Tiles::kStride, acc);
      auto accumulate = [&](auto with_mask) {
#pragma unroll
        for (int n = 0; n < kHalf / 8; ++n) {
          const int r = half * kHalf + streamed_column(n, 0);
          const float2 lse2 = *reinterpret_cast<const float2*>(&terms.lse2[buffer][r]);
          const float2 weight = *reinterpret_cast<const float2*>(&terms.weight[buffer][r]);
          const int2 position = *reinterpret_cast<const int2*>(&terms.position[buffer][r]);
#pragma unroll
          for (int block = 0; block < 2; ++block) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float p0 = mma::exp2_fast(fmaf(acc[block][n][2 * h], scale, key_bias[block][h]) - lse2.x);
              const float p1 = mma::exp2_fast(fmaf(acc[block][n][2 * h + 1], scale, key_bias[block][h]) - lse2.y);
              float& sum = partial[block][h];
              if constexpr (decltype(with_mask)::value) {
                sum = key_slot[block][h] > position.x ? sum : fmaf(weight.x, p0, sum);
                sum = key_slot[block][h] > position.y ? sum : fmaf(weight.y, p1, sum);
              } else {
                sum = fmaf(weight.y, p1, fmaf(weight.x, p0, sum));
              }
            }
          }
        }
      };
      with_mask_if(masked, accumulate);
    }
    if (tile > oldest) {
      store_row(next_row, next);
      adds_nothing = threadIdx.x < kTile && next_row.weight == 0.0f;
    }

    const double bound = kernels::older_queries_weight_bound(decay, input_scale,
                                                             num_queries - 1 - row_begin / layout.group_size);
    if (tile > oldest && bound < INFINITY) {
      // The smallest partial score over the block's scored keys: each key's is the sum over the four lanes of its
      // row.
      float key_min = INFINITY;
#pragma unroll
      for (int block = 0; block < 2; ++block) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float total = quad_sum(partial[block][h]);  // every lane shuffles, scored key or not
          if (key_slot[block][h] != kNoSlot) key_min = fminf(key_min, total);
        }
      }
      for (int offset = 4; offset < 32; offset *= 2) {
        key_min = fminf(key_min, __shfl_xor_sync(0xffffffffu, key_min, offset));
      }
      if (lane == 0) warp_min[warp] = key_min;
      __syncthreads();
      float tile_min = warp_min[0];
      for (int w = 1; w < kThreads / 32; ++w) tile_min = fminf(tile_min, warp_min[w]);
      if (kernels::older_queries_negligible(layout.group_size, bound, tile_min)) break;
    }
  }
  mma::wait_copies();

#pragma unroll
  for (int block = 0; block < 2; ++block) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float total = quad_sum(partial[block][h]);
      const int64_t slot = key_begin + fixed_row(block, h);
      if (lane % 4 == 0 && slot < total_len) {
        scores[pair * total_len + slot] = key_slot[block][h] == kNoSlot ? 0.0f : total;
      }
    }
  }
}

// Whether a call takes the tensor-core path: half precision at d = 64 or 128 in 16-byte rows, rows and slots (plus a
// block's reach past T) indexed in 32 bits, and this build's kernels holding sm_80+ code for the device (a build for
// an older architecture would reach the __trap of mma.cuh).
bool tensor_core_path(const PromptScoresShape& shape, const Layout& layout, at::ScalarType dtype) {
  if (!(dtype == at::kHalf || dtype == at::kBFloat16) || !(shape.head_dim == 64 || shape.head_dim == 128) ||
      !layout.query_in_pieces || !layout.keys_in_pieces || shape.total_len > kNoSlot - kFixedRows ||
      shape.group_size * shape.num_queries > kNoSlot - kFixedRows) {
    return false;
  }
  return mma::code_for_current_device();
}

Layout make_layout(const PromptScoresShape& shape, const at::Tensor& query, const at::Tensor& keys, double scale) {
  Layout layout{{query.stride(0), query.stride(1), query.stride(2)},
                {keys.stride(0), keys.stride(1), keys.stride(2)},
                shape.query_heads, shape.kv_heads, shape.group_size, shape.num_queries, shape.total_len, shape.head_dim,
                static_cast<float>(scale)};
  const auto address = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()); };
  layout.query_in_pieces = kernels::launch::rows_in_16_byte_pieces(address(query), query.element_size(),
                                                                   shape.head_dim, layout.query_strides);
  layout.keys_in_pieces = kernels::launch::rows_in_16_byte_pieces(address(keys), keys.element_size(), shape.head_dim,
                                                                  layout.key_strides);
  return layout;
}

// What the launch shapes bound: the shared tiles (d) and gridDim.y, one (batch, kv head) pair each.
void check_cuda_limits(const char* op, const PromptScoresShape& shape) {
  TORCH_CHECK(shape.head_dim <= kMaxHeadDim, op, ": the CUDA kernel supports head dims up to ", kMaxHeadDim,
              ", got d = ", shape.head_dim);
  TORCH_CHECK(shape.batch * shape.kv_heads <= kernels::launch::kMaxGridY, op, ": the CUDA kernels take at most ",
              kernels::launch::kMaxGridY, " (batch, kv head) pairs, got B·H = ", shape.batch * shape.kv_heads);
}

// Calls launch(std::integral_constant<int, d>) for the head dims the tensor-core kernels are built for.
template <typename Launch>
void with_head_dim(int64_t head_dim, Launch launch) {
  if (head_dim == 64) {
    launch(std::integral_constant<int, 64>{});
  } else {
    launch(std::integral_constant<int, 128>{});
  }
}

at::cuda::detail::IntDivider<unsigned> group_divider(const PromptScoresShape& shape) {
  return at::cuda::detail::IntDivider<unsigned>(static_cast<unsigned>(shape.group_size));
}

// Lets `kernel` take `bytes` of dynamic shared memory and checks them against what the device allows a block beside
// the kernel's static shared memory (a float32 d = 256 tile needs 150 KiB: an H100's 227 KiB holds it, the 99 KiB of
// sm_86 / sm_89 do not), so that too large a head dim is named instead of failing the launch.
template <typename Kernel>
void allow_shared_bytes(const char* op, Kernel kernel, size_t bytes, int64_t head_dim) {
  const size_t allowed = gpu::allow_most_dynamic_shared_bytes(kernel, gpu::static_shared_bytes(kernel));
  TORCH_CHECK(bytes <= allowed, op, ": expected a head dim d whose tiles fit the ", allowed,
              " bytes of shared memory this device gives a block, got d = ", head_dim, " (", bytes,
              " bytes; a half-precision query and cache need half as many)");
}

// A tensor-core kernel over `items` fixed rows (query rows or keys) of each (batch, kv head) pair: kFixedRows per
// block along x, one pair along y.
template <int kHeadDim, typename Kernel, typename... Args>
void launch_tensor_cores(const char* op, Kernel kernel, int64_t items, unsigned pairs, Args... args) {
  const size_t bytes = MmaTiles<kHeadDim>::kSharedBytes;
  allow_shared_bytes(op, kernel, bytes, kHeadDim);
  const dim3 grid(static_cast<unsigned>(kernels::launch::ceil_div(items, kFixedRows)), pairs);
  kernel<<<grid, kThreads, bytes, at::cuda::getCurrentCUDAStream()>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor prompt_log_sum_exp_cuda(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& log_weights,
                                   double scale) {
  const PromptScoresShape shape = check_prompt_log_sum_exp(query, keys, log_weights, scale);
  check_cuda_limits("kvcomp::prompt_log_sum_exp", shape);
  const c10::cuda::OptionalCUDAGuard device_guard(query.device());
  at::Tensor lse = at::empty({shape.batch, shape.query_heads, shape.num_queries}, query.options().dtype(at::kFloat));
  if (shape.batch == 0) return lse;  // a grid of 0 blocks is an invalid launch
  const at::Tensor query_c = with_unit_stride_last(query), keys_c = with_unit_stride_last(keys);
  const at::Tensor log_weights_c = log_weights.contiguous();
  const Layout layout = make_layout(shape, query_c, keys_c, scale);
  const dim3 grid(static_cast<unsigned>((shape.group_size * shape.num_queries + kTile - 1) / kTile),
                  static_cast<unsigned>(shape.batch * shape.kv_heads));
  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::prompt_log_sum_exp", [&] {
    if constexpr (!std::is_same_v<scalar_t, float>) {
      if (tensor_core_path(shape, layout, query.scalar_type())) {
        return with_head_dim(shape.head_dim, [&](auto head_dim) {
          constexpr int kHeadDim = decltype(head_dim)::value;
          launch_tensor_cores<kHeadDim>("kvcomp::prompt_log_sum_exp", log_sum_exp_mma_kernel<scalar_t, kHeadDim>,
                                        shape.group_size * shape.num_queries, grid.y, layout, group_divider(shape),
                                        query_c.const_data_ptr<scalar_t>(), keys_c.const_data_ptr<scalar_t>(),
                                        log_weights_c.const_data_ptr<float>(), lse.mutable_data_ptr<float>());
        });
      }
    }
    const size_t bytes = shared_bytes<scalar_t>(shape.head_dim);
    allow_shared_bytes("kvcomp::prompt_log_sum_exp", log_sum_exp_kernel<scalar_t>, bytes, shape.head_dim);
    log_sum_exp_kernel<scalar_t><<<grid, kThreads, bytes, at::cuda::getCurrentCUDAStream()>>>(
        layout, query_c.const_data_ptr<scalar_t>(), keys_c.const_data_ptr<scalar_t>(),
        log_weights_c.const_data_ptr<float>(), lse.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return lse;
}

at::Tensor prompt_scores_cuda(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& log_weights,
                              const at::Tensor& log_sum_exp, double scale, double decay, double input_scale) {
  const PromptScoresShape shape =
      check_prompt_scores(query, keys, log_weights, log_sum_exp, scale, decay, input_scale);
  check_cuda_limits("kvcomp::prompt_scores", shape);
  const c10::cuda::OptionalCUDAGuard device_guard(query.device());
  at::Tensor scores = at::empty({shape.batch, shape.kv_heads, shape.total_len}, query.options().dtype(at::kFloat));
  if (shape.batch == 0) return scores;
  const at::Tensor query_c = with_unit_stride_last(query), keys_c = with_unit_stride_last(keys);
  const at::Tensor log_weights_c = log_weights.contiguous(), lse_c = log_sum_exp.contiguous();
  const Layout layout = make_layout(shape, query_c, keys_c, scale);
  const dim3 grid(static_cast<unsigned>((shape.total_len + kTile - 1) / kTile),
                  static_cast<unsigned>(shape.batch * shape.kv_heads));
  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::prompt_scores", [&] {
    if constexpr (!std::is_same_v<scalar_t, float>) {
      if (tensor_core_path(shape, layout, query.scalar_type())) {
        return with_head_dim(shape.head_dim, [&](auto head_dim) {
          constexpr int kHeadDim = decltype(head_dim)::value;
          launch_tensor_cores<kHeadDim>("kvcomp::prompt_scores", scores_mma_kernel<scalar_t, kHeadDim>,
                                        shape.total_len, grid.y, layout, group_divider(shape),
                                        query_c.const_data_ptr<scalar_t>(),
                                        keys_c.const_data_ptr<scalar_t>(), log_weights_c.const_data_ptr<float>(),
                                        lse_c.const_data_ptr<float>(), decay, input_scale,
                                        scores.mutable_data_ptr<float>());
        });
      }
    }
    const size_t bytes = shared_bytes<scalar_t>(shape.head_dim);
    allow_shared_bytes("kvcomp::prompt_scores", scores_kernel<scalar_t>, bytes, shape.head_dim);
    scores_kernel<scalar_t><<<grid, kThreads, bytes, at::cuda::getCurrentCUDAStream()>>>(
        layout, query_c.const_data_ptr<scalar_t>(), keys_c.const_data_ptr<scalar_t>(),
        log_weights_c.const_data_ptr<float>(), lse_c.const_data_ptr<float>(), decay, input_scale,
        scores.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return scores;
}

at::Tensor prompt_log_unnormalised_scores_cuda(const at::Tensor& query, const at::Tensor& keys,
                                               const at::Tensor& log_weights, double scale, double decay,
                                               double input_scale) {
  constexpr const char* op = "kvcomp::prompt_log_unnormalised_scores";
  const PromptScoresShape shape =
      check_prompt_log_unnormalised_scores(query, keys, log_weights, scale, decay, input_scale);
  check_cuda_limits(op, shape);
  const c10::cuda::OptionalCUDAGuard device_guard(query.device());
  at::Tensor log_scores = at::empty({shape.batch, shape.kv_heads, shape.total_len}, query.options().dtype(at::kFloat));
  if (shape.batch == 0) return log_scores;
  const at::Tensor query_c = with_unit_stride_last(query), keys_c = with_unit_stride_last(keys);
  const at::Tensor log_weights_c = log_weights.contiguous();
  const Layout layout = make_layout(shape, query_c, keys_c, scale);
  const dim3 grid(static_cast<unsigned>((shape.total_len + kTile - 1) / kTile),
                  static_cast<unsigned>(shape.batch * shape.kv_heads));
  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), op, [&] {
    const size_t bytes = shared_bytes<scalar_t>(shape.head_dim);
    allow_shared_bytes(op, log_unnormalised_scores_kernel<scalar_t>, bytes, shape.head_dim);
    log_unnormalised_scores_kernel<scalar_t><<<grid, kThreads, bytes, at::cuda::getCurrentCUDAStream()>>>(
        layout, query_c.const_data_ptr<scalar_t>(), keys_c.const_data_ptr<scalar_t>(),
        log_weights_c.const_data_ptr<float>(), std::log(decay), std::log(input_scale),
        log_scores.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return log_scores;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CUDA, m) {
  m.impl("prompt_log_sum_exp", &prompt_log_sum_exp_cuda);
  m.impl("prompt_scores", &prompt_scores_cuda);
  m.impl("prompt_log_unnormalised_scores", &prompt_log_unnormalised_scores_cuda);
}

}  // namespace kvcomp
