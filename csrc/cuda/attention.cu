// CUDA kernels of the attention family: merge-count log-weights and decode attention over a cache whose slots carry
// log-weights.
//
// decode_attention is flash-decoding (as FlashInfer's and FlashAttention's split-KV decode): memory-bound, so K and V
// must be read once, with several loads in flight per thread, and there must be enough blocks to fill the GPU even at
// batch 1. The T slots of each (batch, kv-head) are split into chunks of C slots (kernels::launch::decode_split):
//   attend_chunk_kernel, one block per (batch, kv-head, tile of query rows, chunk): stages the tile's queries (all
//     G * q rows of the group when G * q <= 8) and the chunk's log-weights in shared memory, reads the chunk's keys
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
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "kernels/attention.h"
#include "kernels/launch.h"
#include "kvcomp/attention.h"

namespace kvcomp {
namespace {

constexpr int kBiasThreads = 256;
constexpr int kThreads = 256;         // threads of both decode kernels
constexpr int kWarps = kThreads / 32;

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
  return 40 + kRows * kVec + 4 * kVec <= 65536 / (kThreads * min_blocks<kRows, kVec>()) ? 4 : 2;
}

// One block per (batch, kv-head, row tile, chunk): see the file comment. Shared memory:
//   s_query  [kRows, d]       tile queries times the scale, float
//   s_probs  [kRows, C]       logits, then exp(logit - chunk max)
//   s_bias   [C]              the chunk's log-weights
//   s_reduce [kThreads * kVec] per-slot-group partial outputs of one row, summed over the groups
template <typename scalar_t, int kVec, int kRows>
__global__ void __launch_bounds__(kThreads, min_blocks<kRows, kVec>())
    attend_chunk_kernel(const scalar_t* __restrict__ query,  // [B * H, rows, d]
                        const scalar_t* __restrict__ keys,  // [B, H, T, d], strides key_strides
                        const scalar_t* __restrict__ values,  // [B, H, T, d], strides value_strides
                        const float* __restrict__ log_weights,  // [B * H, T]
                        float* __restrict__ probs,  // [B * H, rows, T]: exp(logit - chunk max) on return
                        float* __restrict__ partial_out,  // [B * H, rows, chunks, d]
                        float2* __restrict__ partial_stats,  // [B * H, rows, chunks]: (chunk max, Σ exp)
                        const DecodeParams p) {
  constexpr int kInFlight = in_flight<kRows, kVec>();
  extern __shared__ float smem[];
  const int64_t d = p.head_dim, C = p.chunk_len;
  float* s_query = smem;
  float* s_probs = s_query + kRows * d;
  float* s_bias = s_probs + kRows * C;
  float* s_reduce = s_bias + C;

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

  __shared__ int64_t s_count[kRows];  // causal limit of each row of the tile
  for (int64_t i = tid; i < tile_rows * d; i += kThreads) {
    s_query[i] = static_cast<float>(query[(pair * p.rows + row0) * d + i]) * p.scale;
  }
  // Every lane of a group reads the log-weight of its slot: one coalesced read into shared memory instead.
  for (int64_t i = tid; i < len; i += kThreads) s_bias[i] = log_weights[pair * p.total_len + slot_begin + i];
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
      if (read[u]) load_floats<scalar_t, kVec>(key_head + (slot_begin + local) * p.key_strides[2] + e_first, k[u]);
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
        const scalar_t* key = key_head + (slot_begin + local) * p.key_strides[2];
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
          if (read[u]) load_floats<scalar_t, kVec>(value_head + (slot_begin + local) * p.value_strides[2] + e, v[u]);
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
// float2 at most, from L2), rescales its piece of the probabilities, and piece 0 combines the chunks into the output.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    combine_chunks_kernel(const float* __restrict__ partial_out,  // [B * H * rows, chunks, d]
                          const float2* __restrict__ partial_stats,  // [B * H * rows, chunks]
                          float* __restrict__ probs,  // [B * H * rows, T]
                          scalar_t* __restrict__ out,  // [B * H * rows, d]
                          int64_t total_len, int64_t head_dim, int64_t chunk_len, int64_t num_chunks,
                          int64_t piece_len) {
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

  if (blockIdx.y == 0) {
    const float* partial = partial_out + row * num_chunks * head_dim;
    for (int64_t e = threadIdx.x; e < head_dim; e += kThreads) {
      float acc = 0.0f;
      for (int64_t c = 0; c < num_chunks; ++c) {
        const float factor = kernels::chunk_normaliser(stats[c].x, all);
        if (factor != 0.0f) acc = fmaf(factor, partial[c * head_dim + e], acc);
      }
      out[row * head_dim + e] = static_cast<scalar_t>(acc);
    }
  }
  float* row_probs = probs + row * total_len;
  const int64_t piece_end = min(total_len, (blockIdx.y + 1) * piece_len);
  for (int64_t s = blockIdx.y * piece_len + threadIdx.x; s < piece_end; s += kThreads) {
    row_probs[s] *= kernels::chunk_normaliser(stats[s / chunk_len].x, all);
  }
}

template <typename scalar_t, int kVec, int kRows>
void launch_attend_chunk(const DecodeParams& params, int64_t pairs, const scalar_t* query, const scalar_t* keys,
                         const scalar_t* values, const float* log_weights, float* probs, float* partial_out,
                         float2* partial_stats, cudaStream_t stream) {
  const size_t smem =
      sizeof(float) * (kRows * params.head_dim + (kRows + 1) * params.chunk_len + kThreads * kVec);
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
  TORCH_CHECK(blocks <= kernels::launch::kMaxGridX, "kvcomp::decode_attention: expected at most ",
              kernels::launch::kMaxGridX, " blocks (B * H * tiles of 8 query rows * chunks), got ", blocks);
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

std::tuple<at::Tensor, at::Tensor> decode_attention_cuda(const at::Tensor& query, const at::Tensor& keys,
                                                         const at::Tensor& values, const at::Tensor& log_weights,
                                                         double scale) {
  namespace launch = kernels::launch;
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
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const launch::DecodeSplit split = launch::decode_split(pairs, rows, d, shape.total_len, sms);

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
  params.num_tiles = split.num_tiles;
  params.chunk_len = split.chunk_len;
  params.num_chunks = split.num_chunks;
  params.scale = static_cast<float>(scale);

  at::Tensor partial_out = at::empty({pairs * rows, params.num_chunks, d}, probs.options());
  at::Tensor partial_stats = at::empty({pairs * rows, params.num_chunks, 2}, probs.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const launch::CombineSplit combine = launch::combine_split(shape.total_len);
  TORCH_CHECK(pairs * rows <= launch::kMaxGridX, "kvcomp::decode_attention: expected at most ", launch::kMaxGridX,
              " query rows (B * Hq * q), got ", pairs * rows);

  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::decode_attention", [&] {
    constexpr int kWideVec = 16 / sizeof(scalar_t);  // one 16-byte load
    const scalar_t* keys_ptr = keys_c.const_data_ptr<scalar_t>();
    const scalar_t* values_ptr = values_c.const_data_ptr<scalar_t>();
    const bool wide =
        launch::rows_in_16_byte_pieces(reinterpret_cast<uintptr_t>(keys_ptr), sizeof(scalar_t), d, params.key_strides) &&
        launch::rows_in_16_byte_pieces(reinterpret_cast<uintptr_t>(values_ptr), sizeof(scalar_t), d,
                                       params.value_strides);
    params.lanes = launch::decode_lanes(d, wide ? kWideVec : 1);
    const scalar_t* query_ptr = query_c.const_data_ptr<scalar_t>();
    const float* bias_ptr = log_weights_c.const_data_ptr<float>();
    float* probs_ptr = probs.mutable_data_ptr<float>();
    float* partial_ptr = partial_out.mutable_data_ptr<float>();
    auto* stats_ptr = reinterpret_cast<float2*>(partial_stats.mutable_data_ptr<float>());
    if (wide) {
      launch_attend_chunk_rows<scalar_t, kWideVec>(split.rows_per_tile, params, pairs, query_ptr, keys_ptr,
                                                   values_ptr, bias_ptr, probs_ptr, partial_ptr, stats_ptr, stream);
    } else {  // odd head dims or unaligned views: one element per load
      launch_attend_chunk_rows<scalar_t, 1>(split.rows_per_tile, params, pairs, query_ptr, keys_ptr, values_ptr,
                                            bias_ptr, probs_ptr, partial_ptr, stats_ptr, stream);
    }
    const dim3 grid(grid_dim("kvcomp::decode_attention", "query rows", pairs * rows),
                    static_cast<unsigned>(combine.pieces));
    combine_chunks_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        partial_ptr, stats_ptr, probs_ptr, out.mutable_data_ptr<scalar_t>(), shape.total_len, d, params.chunk_len,
        params.num_chunks, combine.piece_len);
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
