// CUDA kernels of the kvzap family.
//   kvzap_score: for a decoding pass (B * q <= kSmallRows tokens, 16-byte aligned rows), each layer of the surrogate is
//     one kernel of one warp per output unit (small_rows_layer_kernel), bias and GELU in its epilogue; otherwise cuBLAS
//     GEMMs through ATen (kvcomp::run_kvzap_surrogate), with bias + GELU in place on the first GEMM's output and bias +
//     float32 on the last one, one thread per element (grid-stride).
//   kvzap_threshold and kvzap_decode_step: blocks (row, piece) over the (batch, head) rows, several per row so that
//     batch 1 fills the device too (kernels::launch::blocks_per_row): each thread decides its slots (the decoding step
//     first copies the state's and the new tokens' scores and positions into the grown row), CUB BlockReduce counts
//     the held ones, and one atomicAdd per block adds them to the row's count (integers: the order does not matter).
//     Nothing waits on the host: the decoding step is three launches (two for a linear surrogate) and a memset.
//   kvzap_paged_step: one thread per (batch, head) row (a decoding pass decides about one slot per row); the block
//     tables' check before it is the one host sync, unless the caller asks for it in the kernel (check_tables_on_device:
//     each thread asserts its row's length and the table entries it reads, nothing waits on the host).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>
#include <cub/warp/warp_reduce.cuh>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "kernels/kvzap.h"
#include "kernels/launch.h"
#include "kvcomp/dispatch.h"
#include "kvcomp/kvzap.h"

namespace kvcomp {
namespace {

namespace z = kernels::kvzap;

constexpr int kThreads = 256;
constexpr int kWarpSize = 32;

constexpr int64_t kMinSlotsPerBlock = 1024;  // kvzap_threshold: 4 slots per thread at least
// Blocks per multiprocessor the decisions ask for (blocks_per_row's waves): 8 of 256 threads fill an SM. With 2, at
// B = 16, 8 kv heads, T = 32k (an H200, run 13) each thread walked 43 slots at a third of the SM's threads, and the
// decoding step's copy of the state ran at ~1 TB/s (182 µs against plain PyTorch's 149).
constexpr int64_t kDecisionBlocksPerSM = 8;

inline unsigned grid_for(int64_t total) {
  return static_cast<unsigned>(kernels::launch::grid_stride_blocks(total, kThreads, 65535));
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    bias_gelu_kernel(scalar_t* __restrict__ pre,  // [N, Dh'], in place
                     const float* __restrict__ bias,  // [Dh']
                     int64_t total, int64_t cols) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    pre[i] = static_cast<scalar_t>(z::gelu(static_cast<float>(pre[i]) + bias[i % cols]));
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    bias_to_float_kernel(const scalar_t* product,  // [B, H, T]; not __restrict__: `out` itself for float32
                         const float* __restrict__ bias,  // [H]
                         float* out,  // [B, H, T]
                         int64_t total, int64_t heads, int64_t len) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = static_cast<float>(product[i]) + bias[(i / len) % heads];
}

void bias_gelu_cuda_(at::Tensor& pre, const at::Tensor& bias) {
  const int64_t total = pre.numel();
  if (total == 0) return;
  const at::Tensor bias_f = bias.to(at::kFloat).contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  KVCOMP_DISPATCH_CACHE_TYPES(pre.scalar_type(), "kvcomp::kvzap_score", [&] {
    bias_gelu_kernel<scalar_t><<<grid_for(total), kThreads, 0, stream>>>(
        pre.mutable_data_ptr<scalar_t>(), bias_f.const_data_ptr<float>(), total, pre.size(1));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor bias_to_float_cuda(const at::Tensor& product, const at::Tensor& bias) {
  at::Tensor out = product.scalar_type() == at::kFloat ? product : at::empty(product.sizes(), product.options().dtype(at::kFloat));
  const int64_t total = product.numel();
  if (total == 0) return out;
  const at::Tensor bias_f = bias.to(at::kFloat).contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  KVCOMP_DISPATCH_CACHE_TYPES(product.scalar_type(), "kvcomp::kvzap_score", [&] {
    bias_to_float_kernel<scalar_t><<<grid_for(total), kThreads, 0, stream>>>(
        product.const_data_ptr<scalar_t>(), bias_f.const_data_ptr<float>(), out.mutable_data_ptr<float>(), total,
        product.size(1), product.size(2));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// The surrogate for the few tokens of a decoding pass. Through the GEMM path each layer costs two launches (cuBLAS,
// then the elementwise pass), which is all the time one token takes; here each layer is one launch. A warp computes
// one output unit for every token: it reads the unit's weight row once, 16 bytes per lane per step, and the tokens'
// inputs, which the block's warps share through L1. The roundings are the GEMM path's: the product rounded to the
// input dtype, then bias (float32) and GELU rounded again for the hidden layer, or bias added in float32 for the
// scores.

constexpr int kSmallRows = 16;
constexpr int kSmallRowsWarps = 4;

template <typename scalar_t>
struct alignas(16) Piece {
  static constexpr int kElements = 16 / sizeof(scalar_t);
  scalar_t values[kElements];
};

template <typename scalar_t>
__device__ inline Piece<scalar_t> load_piece(const scalar_t* source) {
  Piece<scalar_t> piece;
  *reinterpret_cast<uint4*>(&piece) = *reinterpret_cast<const uint4*>(source);
  return piece;
}

// The hidden layer's activations, [tokens, units] in the input dtype.
template <typename scalar_t>
struct ActivationOutput {
  scalar_t* data;
  int64_t units;
  __device__ void write(int64_t token, int64_t unit, float product, float bias) const {
    data[token * units + unit] =
        static_cast<scalar_t>(z::gelu(static_cast<float>(static_cast<scalar_t>(product)) + bias));
  }
};

// Where the scores go, float32: token r is (b, t) = (r / len, r % len), unit h its kv head, written at
// (b * heads + h) * row_stride + offset + t (the decoding step writes its new tokens after the state's T slots).
struct ScoreLayout {
  float* data;
  int64_t len, heads, row_stride, offset;
};

template <typename scalar_t>
struct ScoreOutput {
  ScoreLayout layout;
  __device__ void write(int64_t token, int64_t unit, float product, float bias) const {
    const int64_t b = token / layout.len, t = token % layout.len;
    layout.data[(b * layout.heads + unit) * layout.row_stride + layout.offset + t] =
        static_cast<float>(static_cast<scalar_t>(product)) + bias;
  }
};

template <typename scalar_t, typename Output>
__global__ void __launch_bounds__(kSmallRowsWarps * kWarpSize)
    small_rows_layer_kernel(const scalar_t* __restrict__ input,  // [tokens, in_dim]
                            const scalar_t* __restrict__ weight,  // [units, in_dim]
                            const scalar_t* __restrict__ bias,  // [units]
                            Output out, int tokens, int64_t in_dim, int64_t units) {
  using WarpReduce = cub::WarpReduce<float>;
  __shared__ typename WarpReduce::TempStorage reduce_storage[kSmallRowsWarps];
  constexpr int kElements = Piece<scalar_t>::kElements;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kSmallRowsWarps + warp;
  if (unit >= units) return;  // the whole warp
  float products[kSmallRows] = {};
  const scalar_t* weight_row = weight + unit * in_dim;
#pragma unroll 2
  for (int64_t k = static_cast<int64_t>(lane) * kElements; k < in_dim; k += kWarpSize * kElements) {
    const Piece<scalar_t> w = load_piece(weight_row + k);
#pragma unroll
    for (int token = 0; token < kSmallRows; ++token) {
      if (token < tokens) {
        const Piece<scalar_t> x = load_piece(input + token * in_dim + k);
#pragma unroll
        for (int e = 0; e < kElements; ++e)
          products[token] += static_cast<float>(w.values[e]) * static_cast<float>(x.values[e]);
      }
    }
  }
  const float bias_f = static_cast<float>(bias[unit]);
#pragma unroll
  for (int token = 0; token < kSmallRows; ++token) {
    if (token < tokens) {
      const float product = WarpReduce(reduce_storage[warp]).Sum(products[token]);  // lane 0's
      __syncwarp();  // the storage is used again
      if (lane == 0) out.write(token, unit, product, bias_f);
    }
  }
}

// The hidden states the small-rows kernels read, where they take the surrogate on `hidden`: a decoding pass's few
// tokens, and rows of whole 16-byte pieces (hidden made contiguous: a copy of a few tokens at most). Otherwise none:
// the GEMM path.
std::optional<at::Tensor> small_rows_hidden(const at::Tensor& hidden, const at::Tensor& weight1,
                                            const c10::optional<at::Tensor>& weight2, const KVzapScoreShape& shape) {
  const int64_t tokens = shape.batch * shape.len, elements = 16 / static_cast<int64_t>(hidden.element_size());
  if (tokens < 1 || tokens > kSmallRows) return std::nullopt;
  const at::Tensor hidden_c = hidden.contiguous();
  const auto aligned = [](const at::Tensor& t) {
    return t.is_contiguous() && reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) % 16 == 0;
  };
  if (!aligned(hidden_c) || !aligned(weight1) || (weight2.has_value() && !aligned(*weight2)) ||
      shape.input_dim % elements != 0 || shape.hidden_dim % elements != 0) {
    return std::nullopt;
  }
  return hidden_c;
}

// The surrogate on small_rows_hidden's hidden states, its scores written where `layout` says.
void run_small_rows_surrogate(const at::Tensor& hidden, const at::Tensor& weight1, const at::Tensor& bias1,
                              const c10::optional<at::Tensor>& weight2, const c10::optional<at::Tensor>& bias2,
                              const KVzapScoreShape& shape, ScoreLayout layout, const char* op) {
  TORCH_INTERNAL_ASSERT(shape.batch * shape.len >= 1 && shape.batch * shape.len <= kSmallRows, op,
                        ": the small-rows surrogate takes 1 to ", kSmallRows, " tokens, got ", shape.batch * shape.len);
  const int tokens = static_cast<int>(shape.batch * shape.len);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto blocks = [&](int64_t units) {
    return grid_dim(op, "surrogate units", kernels::launch::ceil_div(units, kSmallRowsWarps),
                    kernels::launch::kMaxGridX);
  };
  KVCOMP_DISPATCH_CACHE_TYPES(hidden.scalar_type(), "kvcomp::kvzap_score", [&] {
    const scalar_t* input = hidden.const_data_ptr<scalar_t>();
    at::Tensor activations;
    if (shape.mlp()) {
      activations = at::empty({tokens, shape.hidden_dim}, hidden.options());
      const ActivationOutput<scalar_t> hidden_layer{activations.mutable_data_ptr<scalar_t>(), shape.hidden_dim};
      small_rows_layer_kernel<scalar_t><<<blocks(shape.hidden_dim), kSmallRowsWarps * kWarpSize, 0, stream>>>(
          input, weight1.const_data_ptr<scalar_t>(), bias1.contiguous().const_data_ptr<scalar_t>(), hidden_layer,
          tokens, shape.input_dim, shape.hidden_dim);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      input = activations.const_data_ptr<scalar_t>();
    }
    const at::Tensor& weight = shape.mlp() ? *weight2 : weight1;
    const at::Tensor bias = (shape.mlp() ? *bias2 : bias1).contiguous();
    const ScoreOutput<scalar_t> scores{layout};
    small_rows_layer_kernel<scalar_t><<<blocks(shape.heads), kSmallRowsWarps * kWarpSize, 0, stream>>>(
        input, weight.const_data_ptr<scalar_t>(), bias.const_data_ptr<scalar_t>(), scores, tokens,
        shape.mlp() ? shape.hidden_dim : shape.input_dim, shape.heads);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor kvzap_score_cuda(const at::Tensor& hidden, const at::Tensor& weight1, const at::Tensor& bias1,
                            const c10::optional<at::Tensor>& weight2, const c10::optional<at::Tensor>& bias2) {
  const KVzapScoreShape shape = check_kvzap_score(hidden, weight1, bias1, weight2, bias2);
  const c10::cuda::OptionalCUDAGuard device_guard(hidden.device());
  if (const std::optional<at::Tensor> small = small_rows_hidden(hidden, weight1, weight2, shape)) {
    at::Tensor scores = at::empty({shape.batch, shape.heads, shape.len}, hidden.options().dtype(at::kFloat));
    run_small_rows_surrogate(*small, weight1, bias1, weight2, bias2, shape,
                             {scores.mutable_data_ptr<float>(), shape.len, shape.heads, shape.len, 0},
                             "kvcomp::kvzap_score");
    return scores;
  }
  return run_kvzap_surrogate(hidden, weight1, bias1, weight2, bias2, shape, bias_gelu_cuda_, bias_to_float_cuda);
}

// ---------------------------------------------------------------------------------------------------------------
// kvzap_threshold and kvzap_decode_step: block (row, piece) decides the slots [piece * piece_len, ...) of its row by
// decide_slot(row, t) (true: held) and adds how many it holds to held[row] (zeroed).

template <typename DecideSlot>
__global__ void __launch_bounds__(kThreads)
    decide_rows_kernel(DecideSlot decide_slot, unsigned long long* __restrict__ held, int64_t len, int64_t piece_len) {
  using BlockReduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  const int64_t row = blockIdx.x;
  const int64_t end = min(len, (blockIdx.y + 1) * piece_len);
  unsigned long long count = 0;
  for (int64_t t = blockIdx.y * piece_len + threadIdx.x; t < end; t += kThreads) count += decide_slot(row, t);
  count = BlockReduce(reduce_storage).Sum(count);
  if (threadIdx.x == 0 && count > 0) atomicAdd(held + row, count);
}

template <typename DecideSlot>
void decide_rows(const char* op, const DecideSlot& decide_slot, at::Tensor& held, int64_t rows, int64_t len) {
  if (rows == 0 || len == 0) return;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t pieces = kernels::launch::blocks_per_row(rows, len, sms, kMinSlotsPerBlock, kDecisionBlocksPerSM);
  const dim3 grid(grid_dim(op, "rows", rows, kernels::launch::kMaxGridX), static_cast<unsigned>(pieces));
  static_assert(sizeof(unsigned long long) == sizeof(int64_t), "held counts are added as 64-bit unsigned");
  decide_rows_kernel<<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      decide_slot, reinterpret_cast<unsigned long long*>(held.mutable_data_ptr<int64_t>()), len,
      kernels::launch::ceil_div(len, pieces));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

struct ThresholdSlot {
  const float* log_weights;  // [rows, len]
  const float* scores;       // [rows, len]
  const int64_t* positions;  // [rows, len]
  float* out;                // [rows, len]
  int64_t len;
  z::DecisionRange range;
  float threshold;
  __device__ bool operator()(int64_t row, int64_t t) const {
    const int64_t slot = row * len + t;  // read-only inputs through the read-only cache (no alias with out)
    out[slot] = z::thresholded_log_weight(__ldg(log_weights + slot), __ldg(scores + slot), __ldg(positions + slot),
                                          range, threshold);
    return z::is_held(out[slot]);
  }
};

struct GrowSlot {
  z::GrowingRows rows;
  z::DecisionRange range;
  float threshold;
  __device__ bool operator()(int64_t row, int64_t t) const {
    return z::grow_and_decide_slot(rows, row, t, range, threshold);
  }
};

std::tuple<at::Tensor, at::Tensor> kvzap_threshold_cuda(const at::Tensor& log_weights, const at::Tensor& scores,
                                                        const at::Tensor& positions, double threshold, int64_t window,
                                                        int64_t tokens_before, int64_t tokens_after) {
  const KVzapThresholdShape shape =
      check_kvzap_threshold(log_weights, scores, positions, threshold, window, tokens_before, tokens_after);
  const c10::cuda::OptionalCUDAGuard device_guard(log_weights.device());
  const at::Tensor log_weights_c = log_weights.contiguous(), scores_c = scores.contiguous();
  const at::Tensor positions_c = positions.contiguous();
  at::Tensor out = at::empty_like(log_weights_c);
  at::Tensor held = at::zeros({shape.batch, shape.heads}, log_weights.options().dtype(at::kLong));
  const ThresholdSlot decide_slot{log_weights_c.const_data_ptr<float>(),
                                  scores_c.const_data_ptr<float>(),
                                  positions_c.const_data_ptr<int64_t>(),
                                  out.mutable_data_ptr<float>(),
                                  shape.len,
                                  z::decision_range(tokens_before, tokens_after, window),
                                  static_cast<float>(threshold)};
  decide_rows("kvcomp::kvzap_threshold", decide_slot, held, shape.rows(), shape.len);
  return {out, held};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kvzap_decode_step_cuda(
    const at::Tensor& hidden, const at::Tensor& weight1, const at::Tensor& bias1,
    const c10::optional<at::Tensor>& weight2, const c10::optional<at::Tensor>& bias2, const at::Tensor& log_weights,
    const at::Tensor& scores, const at::Tensor& positions, double threshold, int64_t window, int64_t tokens_before) {
  constexpr const char* op = "kvcomp::kvzap_decode_step";
  const KVzapDecodeStepShape shape = check_kvzap_decode_step(hidden, weight1, bias1, weight2, bias2, log_weights, scores,
                                                             positions, threshold, window, tokens_before);
  const c10::cuda::OptionalCUDAGuard device_guard(hidden.device());
  KVzapDecodeStepTensors state = kvzap_decode_step_tensors(log_weights, scores, positions);
  at::Tensor held = at::zeros({shape.surrogate.batch, shape.surrogate.heads}, positions.options());
  const int64_t q = shape.new_tokens(), after = shape.slots_after();
  // The new tokens' scores: straight into their slots of scores_out, or from the GEMM path's (B, H, q).
  at::Tensor new_scores;
  const float* new_scores_ptr = state.scores_out.const_data_ptr<float>() + shape.slots_before;
  int64_t new_scores_stride = after;
  if (const std::optional<at::Tensor> small = small_rows_hidden(hidden, weight1, weight2, shape.surrogate)) {
    run_small_rows_surrogate(*small, weight1, bias1, weight2, bias2, shape.surrogate,
                             {state.scores_out.mutable_data_ptr<float>(), q, shape.surrogate.heads, after,
                              shape.slots_before},
                             op);
  } else {
    new_scores = run_kvzap_surrogate(hidden, weight1, bias1, weight2, bias2, shape.surrogate, bias_gelu_cuda_,
                                     bias_to_float_cuda);
    new_scores_ptr = new_scores.const_data_ptr<float>();
    new_scores_stride = q;
  }
  const GrowSlot decide_slot{state.rows(shape, new_scores_ptr, new_scores_stride, tokens_before),
                             z::decision_range(tokens_before, tokens_before + q, window),
                             static_cast<float>(threshold)};
  decide_rows(op, decide_slot, held, shape.rows(), after);
  return state.outputs(held);
}

// The row's length in [q, max_blocks * block_size] and every table entry of the slots the step touches in
// [0, num_blocks), asserted on the device (as PyTorch's index kernels do), where the host checked nothing.
__device__ bool row_tables_in_range(const z::PagedRow& paged, int64_t row, int64_t max_blocks, int64_t num_blocks,
                                    int64_t new_tokens, int64_t tokens_before, int64_t window) {
  const int64_t capacity = max_blocks * paged.block_size;
  const bool length_in_range = paged.length >= new_tokens && paged.length <= capacity;
  CUDA_KERNEL_ASSERT_PRINTF(length_in_range,
                            "kvcomp::kvzap_paged_step: expected every length in [q = %lld, max_blocks * block size = "
                            "%lld], got lengths[%lld] (b * H + h) = %lld",
                            static_cast<long long>(new_tokens), static_cast<long long>(capacity),
                            static_cast<long long>(row), static_cast<long long>(paged.length));
  if (!length_in_range) return false;
  const int64_t first = z::first_slot_touched(paged.length, new_tokens, tokens_before, window) / paged.block_size;
  for (int64_t entry = first; entry <= (paged.length - 1) / paged.block_size; ++entry) {
    const int64_t block = paged.table[entry];
    CUDA_KERNEL_ASSERT_PRINTF(block >= 0 && block < num_blocks,
                              "kvcomp::kvzap_paged_step: block table index out of range: block_tables[%lld, %lld] "
                              "(b * H + h, entry) = %lld is used but not in [0, %lld)",
                              static_cast<long long>(row), static_cast<long long>(entry),
                              static_cast<long long>(block), static_cast<long long>(num_blocks));
    if (block < 0 || block >= num_blocks) return false;
  }
  return true;
}

__global__ void __launch_bounds__(kThreads)
    kvzap_paged_step_kernel(float* __restrict__ log_weights,  // [N * S]
                            float* __restrict__ scores,  // [N * S]
                            int64_t* __restrict__ positions,  // [N * S]
                            const int64_t* __restrict__ block_tables,  // [B * H, max_blocks]
                            const int64_t* __restrict__ lengths,  // [B * H]
                            const float* __restrict__ new_scores,  // [B * H, q]
                            int64_t* __restrict__ held,  // [B * H]
                            int64_t rows, int64_t max_blocks, int64_t block_size, int64_t num_blocks,
                            int64_t new_tokens, int64_t tokens_before, int64_t window, float threshold,
                            bool check_tables) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (row >= rows) return;
  const z::PagedRow paged{block_tables + row * max_blocks, block_size, lengths[row]};
  if (check_tables && !row_tables_in_range(paged, row, max_blocks, num_blocks, new_tokens, tokens_before, window)) {
    held[row] = -1;  // (after a device-side assert, which ends the stream's work)
    return;
  }
  held[row] = z::paged_step_row(log_weights, scores, positions, paged, new_scores + row * new_tokens, new_tokens,
                                tokens_before, window, threshold);
}

at::Tensor kvzap_paged_step_cuda(at::Tensor& log_weight_blocks, at::Tensor& score_blocks, at::Tensor& position_blocks,
                                 const at::Tensor& block_tables, const at::Tensor& lengths,
                                 const at::Tensor& new_scores, double threshold, int64_t window,
                                 int64_t tokens_before, bool check_tables_on_device) {
  const KVzapPagedStepShape shape = check_kvzap_paged_step(log_weight_blocks, score_blocks, position_blocks,
                                                           block_tables, lengths, new_scores, threshold, window,
                                                           tokens_before, check_tables_on_device);
  const c10::cuda::OptionalCUDAGuard device_guard(log_weight_blocks.device());
  at::Tensor held = at::empty({shape.batch, shape.heads}, lengths.options());
  if (shape.rows() == 0) return held;
  const at::Tensor tables_c = block_tables.contiguous(), lengths_c = lengths.contiguous();
  const at::Tensor new_scores_c = new_scores.contiguous();
  const unsigned blocks = grid_dim("kvcomp::kvzap_paged_step", "rows",
                                  kernels::launch::ceil_div(shape.rows(), kThreads), kernels::launch::kMaxGridX);
  kvzap_paged_step_kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      log_weight_blocks.mutable_data_ptr<float>(), score_blocks.mutable_data_ptr<float>(),
      position_blocks.mutable_data_ptr<int64_t>(), tables_c.const_data_ptr<int64_t>(),
      lengths_c.const_data_ptr<int64_t>(), new_scores_c.const_data_ptr<float>(), held.mutable_data_ptr<int64_t>(),
      shape.rows(), shape.max_blocks, shape.block_size, log_weight_blocks.size(0), shape.new_tokens, tokens_before,
      window, static_cast<float>(threshold), check_tables_on_device);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return held;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CUDA, m) {
  m.impl("kvzap_score", &kvzap_score_cuda);
  m.impl("kvzap_threshold", &kvzap_threshold_cuda);
  m.impl("kvzap_decode_step", &kvzap_decode_step_cuda);
  m.impl("kvzap_paged_step", &kvzap_paged_step_cuda);
}

}  // namespace kvcomp
