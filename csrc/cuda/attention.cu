// CUDA kernels of the attention family: merge-count log-weights and decode attention over a cache whose slots carry
// log-weights.
//
// decode_attention is flash-decoding: memory-bound, so K and V must be read once, and there must be enough blocks to
// fill the GPU even at batch 1. The T slots of each (batch, kv-head) are split into chunks of C slots:
//   attend_chunk_kernel, one block per (batch, kv-head, tile of query rows, chunk): loads the tile's queries (all
//     G * q rows of the group when G * q <= 8) into shared memory, reads the chunk's keys once to get every row's
//     logits, writes exp(logit - chunk max) into probs, reads the chunk's values once to accumulate
//     Σ exp(logit - chunk max) v into a float32 workspace, and stores the chunk's (max, sum of exp).
//   combine_chunks_kernel, one block per query row: reduces the chunk statistics (CUB block reduction with the
//     online-softmax step kernels::combine), writes out = Σ_c f_c partial_c and rescales probs by f_c,
//     f_c = exp(m_c - M) / S. No atomics: the result does not depend on scheduling.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "kernels/attention.h"
#include "kvcomp/attention.h"

namespace kvcomp {
namespace {

constexpr int kBiasThreads = 256;
constexpr int kThreads = 256;         // threads of both decode kernels
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTileRows = 8;       // query rows per block; more rows (G * q > 8) take several tiles
constexpr int64_t kQueryTileFloats = 4096;  // shared-memory budget of the query tile (16 KiB)

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

// ---------------------------------------------------------------------------------------------------------------
// decode_attention

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

struct DecodeParams {
  int64_t kv_heads, num_queries, total_len, head_dim, rows;  // rows = G * q query rows per kv head
  int64_t key_strides[3], value_strides[3];                  // batch, head, slot (unit stride over d)
  int64_t chunk_len, num_chunks, num_tiles;
  int lanes;  // threads that share one slot (power of two <= 32); kThreads / lanes slots are handled at once
  float scale;
};

// Causal limit of query row `row` (= g * q + j) of a group.
__device__ __forceinline__ int64_t causal_count(const DecodeParams& p, int64_t row) {
  return kernels::causal_slot_count(row % p.num_queries, p.num_queries, p.total_len);
}

// One block per (batch, kv-head, row tile, chunk): see the file comment. Shared memory:
//   s_query  [kRows, d]       tile queries times the scale, float
//   s_probs  [kRows, C]       logits, then exp(logit - chunk max)
//   s_reduce [kThreads * kVec] per-slot-group partial outputs of one row, summed over the groups
template <typename scalar_t, int kVec, int kRows>
__global__ void __launch_bounds__(kThreads, kRows <= 4 && kRows * kVec <= 32 ? 3 : 2)
    attend_chunk_kernel(const scalar_t* __restrict__ query,  // [B * H, rows, d]
                        const scalar_t* __restrict__ keys,  // [B, H, T, d], strides key_strides
                        const scalar_t* __restrict__ values,  // [B, H, T, d], strides value_strides
                        const float* __restrict__ log_weights,  // [B * H, T]
                        float* __restrict__ probs,  // [B * H, rows, T]: exp(logit - chunk max) on return
                        float* __restrict__ partial_out,  // [B * H, rows, chunks, d]
                        float2* __restrict__ partial_stats,  // [B * H, rows, chunks]: (chunk max, Σ exp)
                        const DecodeParams p) {
  extern __shared__ float smem[];
  const int64_t d = p.head_dim, C = p.chunk_len;
  float* s_query = smem;
  float* s_probs = s_query + kRows * d;
  float* s_reduce = s_probs + kRows * C;

  const int64_t chunk = blockIdx.x % p.num_chunks;
  const int64_t tile = (blockIdx.x / p.num_chunks) % p.num_tiles;
  const int64_t pair = blockIdx.x / (p.num_chunks * p.num_tiles);
  const int64_t batch = pair / p.kv_heads, head = pair % p.kv_heads;
  const int64_t row0 = tile * kRows;
  const int tile_rows = static_cast<int>(min(static_cast<int64_t>(kRows), p.rows - row0));
  const int64_t slot_begin = chunk * C;
  const int64_t slot_end = min(p.total_len, slot_begin + C);
  const int64_t len = slot_end - slot_begin;

  const int tid = threadIdx.x;
  const int lane = tid % p.lanes;   // which kVec-wide pieces of d this thread reads
  const int group = tid / p.lanes;  // which slot of the current step it handles
  const int groups = kThreads / p.lanes;
  const int64_t lane_stride = static_cast<int64_t>(p.lanes) * kVec;

  const scalar_t* key_head = keys + batch * p.key_strides[0] + head * p.key_strides[1];
  const scalar_t* value_head = values + batch * p.value_strides[0] + head * p.value_strides[1];
  const float* bias = log_weights + pair * p.total_len;

  __shared__ int64_t s_count[kRows];  // causal limit of each row of the tile
  for (int64_t i = tid; i < tile_rows * d; i += kThreads) {
    s_query[i] = static_cast<float>(query[(pair * p.rows + row0) * d + i]) * p.scale;
  }
  if (tid < tile_rows) s_count[tid] = causal_count(p, row0 + tid);
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

  // 1. Logits: the `lanes` threads of a group read one key (coalesced) and reduce its dot products with shuffles.
  //    The loop bound is uniform over the block so that every lane of a warp reaches the shuffles.
#pragma unroll 2
  for (int64_t base = 0; base < len; base += groups) {
    const int64_t local = base + group;
    const bool valid = local < len;
    const int64_t slot = slot_begin + local;
    const float log_weight = valid ? bias[slot] : -INFINITY;
    const bool any = kernels::slot_attended(local, max_local, log_weight);  // some row of the tile attends the slot
    float dots[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) dots[r] = 0.0f;
    if (any && e_first < d) {  // masked and evicted slots: the key is never read
      const scalar_t* key = key_head + slot * p.key_strides[2];
      float k[kVec];
      load_floats<scalar_t, kVec>(key + e_first, k);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) dots[r] = fmaf(q_first[r][i], k[i], dots[r]);
      }
      for (int64_t e = e_first + lane_stride; e < d; e += lane_stride) {
        load_floats<scalar_t, kVec>(key + e, k);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r < tile_rows) {
#pragma unroll
            for (int i = 0; i < kVec; ++i) dots[r] = fmaf(s_query[r * d + e + i], k[i], dots[r]);
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
    if (valid && writer) {
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
  __syncthreads();

  // 2. One warp per row: chunk max, exp(logit - max) into shared memory and probs, sum of exp.
  const int warp = tid / 32, warp_lane = tid % 32;
  for (int r = warp; r < tile_rows; r += kWarps) {
    float* row = s_probs + r * C;
    float max = -INFINITY;
    for (int64_t i = warp_lane; i < len; i += 32) max = fmaxf(max, row[i]);
    for (int offset = 16; offset > 0; offset /= 2) max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, offset));
    float sum = 0.0f;
    float* global_row = probs + (pair * p.rows + row0 + r) * p.total_len + slot_begin;
    for (int64_t i = warp_lane; i < len; i += 32) {
      const float e = kernels::shifted_exp(row[i], max);
      row[i] = e;
      global_row[i] = e;
      sum += e;
    }
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (warp_lane == 0) partial_stats[(pair * p.rows + row0 + r) * p.num_chunks + chunk] = make_float2(max, sum);
  }
  __syncthreads();

  // 3. Σ_s p_s v_s: the same (group, lane) split, the value of a slot no row attends is never read. A group sums its
  //    slots in registers, then the groups are summed through shared memory, one row at a time.
  for (int64_t e_base = 0; e_base < d; e_base += lane_stride) {
    const int64_t e = e_base + lane * kVec;
    float acc[kRows][kVec];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[r][i] = 0.0f;
    }
    if (e < d) {
#pragma unroll 2
      for (int64_t local = group; local < len; local += groups) {
        float weight[kRows];
        bool any = false;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          weight[r] = r < tile_rows ? s_probs[r * C + local] : 0.0f;
          any |= weight[r] != 0.0f;
        }
        if (!any) continue;
        float v[kVec];
        load_floats<scalar_t, kVec>(value_head + (slot_begin + local) * p.value_strides[2] + e, v);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (weight[r] != 0.0f) {  // 0 * NaN would leak a masked slot's garbage
#pragma unroll
            for (int i = 0; i < kVec; ++i) acc[r][i] = fmaf(weight[r], v[i], acc[r][i]);
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

// One block per query row: combine its chunks into the output and the normalised probabilities.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    combine_chunks_kernel(const float* __restrict__ partial_out,  // [B * H * rows, chunks, d]
                          const float2* __restrict__ partial_stats,  // [B * H * rows, chunks]
                          float* __restrict__ probs,  // [B * H * rows, T]
                          scalar_t* __restrict__ out,  // [B * H * rows, d]
                          int64_t total_len, int64_t head_dim, int64_t chunk_len, int64_t num_chunks) {
  using BlockReduce = cub::BlockReduce<kernels::SoftmaxPartial, kThreads>;
  __shared__ typename BlockReduce::TempStorage temp_storage;
  __shared__ kernels::SoftmaxPartial row_total;
  const int64_t row = blockIdx.x;
  const float2* stats = partial_stats + row * num_chunks;

  kernels::SoftmaxPartial local;
  for (int64_t c = threadIdx.x; c < num_chunks; c += kThreads) {
    local = kernels::combine(local, kernels::SoftmaxPartial{stats[c].x, stats[c].y});
  }
  const kernels::SoftmaxPartial total = BlockReduce(temp_storage).Reduce(local, CombinePartials{});
  if (threadIdx.x == 0) row_total = total;
  __syncthreads();
  const kernels::SoftmaxPartial all = row_total;

  const float* partial = partial_out + row * num_chunks * head_dim;
  for (int64_t e = threadIdx.x; e < head_dim; e += kThreads) {
    float acc = 0.0f;
    for (int64_t c = 0; c < num_chunks; ++c) {
      const float factor = kernels::chunk_normaliser(stats[c].x, all);
      if (factor != 0.0f) acc = fmaf(factor, partial[c * head_dim + e], acc);
    }
    out[row * head_dim + e] = static_cast<scalar_t>(acc);
  }
  float* row_probs = probs + row * total_len;
  for (int64_t s = threadIdx.x; s < total_len; s += kThreads) {
    row_probs[s] *= kernels::chunk_normaliser(stats[s / chunk_len].x, all);
  }
}

int next_power_of_two(int64_t n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

template <typename scalar_t, int kVec, int kRows>
void launch_attend_chunk(const DecodeParams& params, int64_t pairs, const scalar_t* query, const scalar_t* keys,
                         const scalar_t* values, const float* log_weights, float* probs, float* partial_out,
                         float2* partial_stats, cudaStream_t stream) {
  const size_t smem = sizeof(float) * (kRows * params.head_dim + kRows * params.chunk_len + kThreads * kVec);
  const auto kernel = attend_chunk_kernel<scalar_t, kVec, kRows>;
  if (smem > 48 * 1024) {
    const int device = c10::cuda::current_device();
    int optin = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    TORCH_CHECK(smem <= static_cast<size_t>(optin), "kvcomp::decode_attention: expected a head dim d that fits ",
                optin, " bytes of shared memory per block, got d = ", params.head_dim);
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  const int64_t blocks = pairs * params.num_tiles * params.num_chunks;
  TORCH_CHECK(blocks <= INT32_MAX, "kvcomp::decode_attention: expected at most ", INT32_MAX,
              " blocks (B * H * tiles of 8 query rows * chunks), got ", blocks);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(query, keys, values, log_weights, probs,
                                                                    partial_out, partial_stats, params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int kVec>
void launch_attend_chunk_rows(int rows_per_tile, const DecodeParams& params, int64_t pairs, const scalar_t* query,
                              const scalar_t* keys, const scalar_t* values, const float* log_weights, float* probs,
                              float* partial_out, float2* partial_stats, cudaStream_t stream) {
  switch (rows_per_tile) {
    case 1:
      return launch_attend_chunk<scalar_t, kVec, 1>(params, pairs, query, keys, values, log_weights, probs,
                                                    partial_out, partial_stats, stream);
    case 2:
      return launch_attend_chunk<scalar_t, kVec, 2>(params, pairs, query, keys, values, log_weights, probs,
                                                    partial_out, partial_stats, stream);
    case 4:
      return launch_attend_chunk<scalar_t, kVec, 4>(params, pairs, query, keys, values, log_weights, probs,
                                                    partial_out, partial_stats, stream);
    default:
      return launch_attend_chunk<scalar_t, kVec, 8>(params, pairs, query, keys, values, log_weights, probs,
                                                    partial_out, partial_stats, stream);
  }
}

bool aligned(const void* ptr, int64_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

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

  const int64_t rows = shape.rows(), d = shape.head_dim;
  // Rows per tile: a power of two <= 8 whose queries fit kQueryTileFloats; one tile holds the whole group in decoding.
  const int64_t max_tile = std::max<int64_t>(1, std::min<int64_t>(kMaxTileRows, kQueryTileFloats / d));
  int rows_per_tile = next_power_of_two(std::min(rows, max_tile));
  if (rows_per_tile > max_tile) rows_per_tile /= 2;

  DecodeParams params{};
  params.kv_heads = shape.kv_heads;
  params.num_queries = shape.num_queries;
  params.total_len = shape.total_len;
  params.head_dim = d;
  params.rows = rows;
  for (int i = 0; i < 3; ++i) {
    params.key_strides[i] = keys_c.stride(i);
    params.value_strides[i] = values_c.stride(i);
  }
  params.num_tiles = (rows + rows_per_tile - 1) / rows_per_tile;
  params.scale = static_cast<float>(scale);
  // Chunks of 256 slots, shorter (down to 64) while the grid would not fill the GPU twice over.
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  params.chunk_len = 256;
  while (params.chunk_len > 64 &&
         pairs * params.num_tiles * ((shape.total_len + params.chunk_len - 1) / params.chunk_len) < 2 * sms) {
    params.chunk_len /= 2;
  }
  params.num_chunks = (shape.total_len + params.chunk_len - 1) / params.chunk_len;

  at::Tensor partial_out = at::empty({pairs * rows, params.num_chunks, d}, probs.options());
  at::Tensor partial_stats = at::empty({pairs * rows, params.num_chunks, 2}, probs.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::decode_attention", [&] {
    constexpr int kWideVec = 16 / sizeof(scalar_t);  // one 16-byte load
    const scalar_t* keys_ptr = keys_c.const_data_ptr<scalar_t>();
    const scalar_t* values_ptr = values_c.const_data_ptr<scalar_t>();
    bool wide = d % kWideVec == 0 && aligned(keys_ptr, 16) && aligned(values_ptr, 16);
    for (int i = 0; i < 3; ++i) wide = wide && params.key_strides[i] % kWideVec == 0 && params.value_strides[i] % kWideVec == 0;
    const int vec = wide ? kWideVec : 1;
    params.lanes = std::min(32, next_power_of_two((d + vec - 1) / vec));
    const scalar_t* query_ptr = query_c.const_data_ptr<scalar_t>();
    const float* bias_ptr = log_weights_c.const_data_ptr<float>();
    float* probs_ptr = probs.mutable_data_ptr<float>();
    float* partial_ptr = partial_out.mutable_data_ptr<float>();
    auto* stats_ptr = reinterpret_cast<float2*>(partial_stats.mutable_data_ptr<float>());
    if (wide) {
      launch_attend_chunk_rows<scalar_t, kWideVec>(rows_per_tile, params, pairs, query_ptr, keys_ptr, values_ptr,
                                                   bias_ptr, probs_ptr, partial_ptr, stats_ptr, stream);
    } else {  // odd head dims or unaligned views: one element per load
      launch_attend_chunk_rows<scalar_t, 1>(rows_per_tile, params, pairs, query_ptr, keys_ptr, values_ptr, bias_ptr,
                                            probs_ptr, partial_ptr, stats_ptr, stream);
    }
    combine_chunks_kernel<scalar_t><<<grid_dim("kvcomp::decode_attention", "query rows", pairs * rows), kThreads, 0, stream>>>(
        partial_ptr, stats_ptr, probs_ptr, out.mutable_data_ptr<scalar_t>(), shape.total_len, d, params.chunk_len,
        params.num_chunks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CUDA, m) {
  m.impl("merge_count_bias", &merge_count_bias_cuda);
  m.impl("decode_attention", &decode_attention_cuda);
}

}  // namespace kvcomp
