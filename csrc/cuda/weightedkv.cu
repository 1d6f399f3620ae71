// CUDA kernels of the weightedkv family, for all (batch, kv-head) rows at once.
// A decoding step (one eviction at j), in place, two launches:
//   1. min_key_pieces: blocks (row, piece) over the middle slots, several per row so that batch 1 fills the device
//      (kernels::launch::row_pieces): each block's smallest eviction key (CUB BlockReduce). The same blocks copy the
//      slots that step 2 reads across the edges of its tiles, before step 2 overwrites them.
//   2. shift_after_eviction: blocks (row, tile of whole slots): each takes j from its row's pieces, reads the slots
//      after j that its tile needs (merging V[j] into V[j + 1], which lands at j) and then writes them one slot to
//      the left. No block writes what another reads, so the shift needs neither copies nor a grid-wide barrier.
// More evictions (a prompt), or a slot too wide for a tile, two launches into copies that are then copied back:
//   1. select_and_fold: one block per row. Finds the eviction threshold (the e-th smallest eviction key of the middle,
//      a block radix select), writes the input slot of every output slot (a CUB BlockScan over the survivors), then
//      folds each run of evicted slots into the survivor after it, one warp per run (kernels::fold_run), writing the
//      merged values straight into the output.
//   2. gather_survivors: one thread per 16 bytes (or element) of an output slot copies keys, values, sums and counts
//      of the survivors, except the values that step 1 merged.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "cuda/block_select.cuh"
#include "kernels/launch.h"
#include "kernels/weightedkv.h"
#include "kvcomp/dispatch.h"
#include "kvcomp/weightedkv.h"

namespace kvcomp {
namespace {

constexpr int kSelectThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kSelectWarps = kSelectThreads / kWarpSize;
constexpr int kGatherThreads = 256;
constexpr int64_t kMinSlotsPerPiece = 1024;  // min_key_pieces: 4 slots per thread at least
constexpr int kShiftThreads = 256;
constexpr int kShiftItemsPerThread = 4;  // chunks of keys and of values a thread holds across the shift's barrier
constexpr int64_t kShiftTileChunks = kShiftThreads * kShiftItemsPerThread;
constexpr unsigned kFullMask = 0xffffffffu;

struct KeyOf {
  const float* sums;  // [T] of this row
  const float* counts;  // [T] of this row
  __device__ uint64_t operator()(int64_t slot) const {
    return kernels::eviction_key(kernels::mean_score(sums[slot], counts[slot]), static_cast<uint32_t>(slot));
  }
  __device__ float mean(int64_t slot) const { return kernels::mean_score(sums[slot], counts[slot]); }
};

struct MinKey {
  __device__ uint64_t operator()(uint64_t a, uint64_t b) const { return a < b ? a : b; }
};

// kernels::fold_run's stack for one warp: every lane runs the same control flow; lane l owns the channels
// l, l + 32, ... of every value it touches, so the values need no synchronisation. The keys of the open levels live in
// global scratch (written by lane 0, then __syncwarp).
template <typename scalar_t>
struct WarpRunStack {
  const scalar_t* values;  // [T, d_v] of this row (input)
  KeyOf key_of;
  scalar_t* terminal_value;  // [d_v] in the output
  uint64_t* keys;  // [run length] of scratch, level l at keys[l - 1]
  scalar_t* open;  // [run length, d_v] of scratch, level l at open[(l - 1) * d_v]
  int64_t dim;
  int64_t terminal;
  int64_t levels;
  int lane;

  __device__ scalar_t* value_at(int64_t level) const { return level == 0 ? terminal_value : open + (level - 1) * dim; }
  __device__ int64_t slot_at(int64_t level) const { return level == 0 ? terminal : kernels::key_slot(keys[level - 1]); }

  __device__ void reset(int64_t terminal_slot) {
    terminal = terminal_slot;
    levels = 0;
    const scalar_t* source = values + terminal_slot * dim;
    for (int64_t c = lane; c < dim; c += kWarpSize) terminal_value[c] = source[c];
  }
  __device__ int64_t depth() const { return levels; }
  __device__ uint64_t top_key() const { return keys[levels - 1]; }
  __device__ void push(uint64_t key) {
    ++levels;
    if (lane == 0) keys[levels - 1] = key;
    const scalar_t* source = values + kernels::key_slot(key) * dim;
    scalar_t* target = value_at(levels);
    for (int64_t c = lane; c < dim; c += kWarpSize) target[c] = source[c];
    __syncwarp();
  }
  __device__ void pop_and_merge() {
    const kernels::MergeCoefficients coefficients =
        kernels::merge_coefficients(key_of.mean(slot_at(levels)), key_of.mean(slot_at(levels - 1)));
    const scalar_t* child = value_at(levels);
    scalar_t* parent = value_at(levels - 1);
    for (int64_t c = lane; c < dim; c += kWarpSize) {
      const float merged = kernels::weighted_merge(static_cast<float>(child[c]), static_cast<float>(parent[c]),
                                                   coefficients.child, coefficients.parent);
      parent[c] = static_cast<scalar_t>(merged);
    }
    --levels;
    __syncwarp();  // every lane has read the closed level's key before a push reuses it
  }
};

template <typename scalar_t>
__global__ void __launch_bounds__(kSelectThreads)
    select_and_fold_kernel(const scalar_t* __restrict__ values,  // [B, H, T, d_v]
                           const float* __restrict__ sums,  // [B, H, T]
                           const float* __restrict__ counts,  // [B, H, T]
                           scalar_t* __restrict__ values_out,  // [B, H, T - e, d_v]
                           int32_t* __restrict__ sources,  // [B, H, T - e]: input slot of each output slot
                           uint64_t* __restrict__ stack_keys,  // [B, H, e] scratch
                           scalar_t* __restrict__ open_values,  // [B, H, e, d_v] scratch
                           int64_t len, int64_t dim, int64_t middle_begin, int64_t middle_end, int64_t evictions,
                           bool merge_values) {
  using BlockScan = cub::BlockScan<int, kSelectThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ uint32_t histogram[256];
  __shared__ uint64_t shared_threshold;
  __shared__ uint32_t shared_rank;

  const int64_t row = blockIdx.x;
  const int64_t out_len = len - evictions;
  const KeyOf key_of{sums + row * len, counts + row * len};

  // 1. Threshold: a middle slot is evicted iff its key <= threshold.
  uint64_t threshold;
  if (evictions == middle_end - middle_begin) {
    threshold = ~static_cast<uint64_t>(0);
  } else {
    threshold = gpu::block_select_key(key_of, middle_begin, middle_end, static_cast<uint32_t>(evictions - 1), histogram,
                                 &shared_threshold, &shared_rank);
  }

  // 2. The input slot of every output slot, in order.
  int32_t* row_sources = sources + row * out_len;
  int64_t written = 0;
  for (int64_t tile = 0; tile < len; tile += kSelectThreads) {
    const int64_t slot = tile + threadIdx.x;
    const bool in_middle = slot >= middle_begin && slot < middle_end;
    const int alive = slot < len && !(in_middle && key_of(slot) <= threshold);
    int position, tile_alive;
    BlockScan(scan_storage).ExclusiveSum(alive, position, tile_alive);
    if (alive) row_sources[written + position] = static_cast<int32_t>(slot);
    written += tile_alive;
    __syncthreads();  // scan_storage is reused by the next tile
  }
  // __syncthreads above also made row_sources visible to the whole block.

  // 3. Fold each run of evicted slots into the survivor after it: output slot o is such a survivor iff the input slot
  // before its source was evicted. One warp per run.
  if (!merge_values) return;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  WarpRunStack<scalar_t> stack{values + row * len * dim, key_of, nullptr, nullptr, nullptr, dim, 0, 0, lane};
  for (int64_t tile = static_cast<int64_t>(warp) * kWarpSize; tile < out_len; tile += kSelectWarps * kWarpSize) {
    const int64_t o = tile + lane;
    const bool terminal = o < out_len && row_sources[o] != (o == 0 ? 0 : row_sources[o - 1] + 1);
    unsigned pending = __ballot_sync(kFullMask, terminal);
    while (pending) {
      const int64_t out = tile + __ffs(pending) - 1;
      pending &= pending - 1;
      const int64_t terminal_slot = row_sources[out];
      const int64_t first = out == 0 ? 0 : row_sources[out - 1] + 1;
      const int64_t evicted_before = first - out;  // evicted slots left of this run: its scratch starts there
      stack.terminal_value = values_out + (row * out_len + out) * dim;
      stack.keys = stack_keys + row * evictions + evicted_before;
      stack.open = open_values + (row * evictions + evicted_before) * dim;
      kernels::fold_run(first, terminal_slot, stack, key_of);
      __syncwarp();
    }
  }
}

// A decoding step's rows, updated where they lie (a contiguous tensor or a paged cache's view): keys and values in
// chunks of 16 bytes (or elements), with their row offsets in chunks; and the edge slots, which step 1 copies for
// step 2: edge t of a row is slot (t + 1) * slots_per_tile, the first of tile t + 1, which tile t reads and tile
// t + 1 overwrites.
template <typename Chunk>
struct ShiftRows {
  Chunk* keys;  // [B, H, T, key_chunks]
  Chunk* values;  // [B, H, T, value_chunks]
  float* sums;  // [B, H, T]
  float* counts;  // [B, H, T]
  kernels::RowStrides key_rows, value_rows, sum_rows, count_rows;
  Chunk* edge_keys;  // [B * H, tiles - 1, key_chunks]
  Chunk* edge_values;  // [B * H, tiles - 1, value_chunks]
  float* edge_scores;  // [B * H, tiles - 1, 2]: sum, count
  int64_t len, key_chunks, value_chunks, chunks_per_slot, slots_per_tile, tiles;

  __device__ KeyOf key_of(int64_t row) const {
    return {sums + sum_rows.offset(row), counts + count_rows.offset(row)};
  }
  __device__ Chunk* key(int64_t row, int64_t slot) const { return keys + key_rows.offset(row) + slot * key_chunks; }
  __device__ Chunk* value(int64_t row, int64_t slot) const {
    return values + value_rows.offset(row) + slot * value_chunks;
  }
  __device__ int64_t edge(int64_t row, int64_t tile) const { return row * (tiles - 1) + tile; }
};

// A decoding step, 1: block (row, piece) writes the smallest eviction key of its piece of the middle slots, and
// copies the row's edges piece, piece + pieces, ...
template <typename Chunk>
__global__ void __launch_bounds__(kSelectThreads)
    min_key_pieces_kernel(ShiftRows<Chunk> rows,
                          uint64_t* __restrict__ piece_minima,  // [B * H, gridDim.y]
                          int64_t middle_begin, int64_t middle_end, int64_t piece_len) {
  using BlockReduce = cub::BlockReduce<uint64_t, kSelectThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  const int64_t row = blockIdx.x;
  const KeyOf key_of = rows.key_of(row);
  const int64_t begin = middle_begin + static_cast<int64_t>(blockIdx.y) * piece_len;
  const int64_t end = begin + piece_len < middle_end ? begin + piece_len : middle_end;
  uint64_t best = ~static_cast<uint64_t>(0);
  for (int64_t slot = begin + threadIdx.x; slot < end; slot += kSelectThreads) best = MinKey()(best, key_of(slot));
  best = BlockReduce(reduce_storage).Reduce(best, MinKey());
  if (threadIdx.x == 0) piece_minima[row * gridDim.y + blockIdx.y] = best;
  for (int64_t tile = blockIdx.y; tile < rows.tiles - 1; tile += gridDim.y) {
    const int64_t slot = (tile + 1) * rows.slots_per_tile, edge = rows.edge(row, tile);
    for (int64_t c = threadIdx.x; c < rows.key_chunks; c += kSelectThreads) {
      rows.edge_keys[edge * rows.key_chunks + c] = rows.key(row, slot)[c];
    }
    for (int64_t c = threadIdx.x; c < rows.value_chunks; c += kSelectThreads) {
      rows.edge_values[edge * rows.value_chunks + c] = rows.value(row, slot)[c];
    }
    if (threadIdx.x == 0) {
      rows.edge_scores[2 * edge] = key_of.sums[slot];
      rows.edge_scores[2 * edge + 1] = key_of.counts[slot];
    }
  }
}

// coefficients.child * child + coefficients.parent * parent, element by element in float32, rounded to scalar_t.
template <typename scalar_t, typename Chunk>
__device__ Chunk merged_chunk(const Chunk& child, const Chunk& parent, kernels::MergeCoefficients coefficients) {
  constexpr int kElements = sizeof(Chunk) / sizeof(scalar_t);
  const scalar_t* child_elements = reinterpret_cast<const scalar_t*>(&child);
  const scalar_t* parent_elements = reinterpret_cast<const scalar_t*>(&parent);
  Chunk out;
  scalar_t* merged = reinterpret_cast<scalar_t*>(&out);
#pragma unroll
  for (int e = 0; e < kElements; ++e) {
    merged[e] = static_cast<scalar_t>(kernels::weighted_merge(static_cast<float>(child_elements[e]),
                                                              static_cast<float>(parent_elements[e]),
                                                              coefficients.child, coefficients.parent));
  }
  return out;
}

// A decoding step, 2: block (row, tile) takes the evicted slot j (the smallest key of the row's pieces; row_pieces
// leaves none empty, so it is a middle slot and j + 1 < T exists) and writes its tile's output slots o >= j: o = j
// gets slot j + 1's key, sum and count and V[j] merged into V[j + 1] (the one-slot run of kernels::fold_run: same
// coefficients, same float32 expression), each later o slot o + 1's. The block reads all of it before it writes any
// (one barrier): slot j and the slots after it up to the tile's end are its own, and the one after those, the next
// tile's first, comes from step 1's copy.
template <typename scalar_t, typename Chunk>
__global__ void __launch_bounds__(kShiftThreads)
    shift_after_eviction_kernel(ShiftRows<Chunk> rows,
                                const uint64_t* __restrict__ piece_minima,  // [B * H, pieces]
                                int64_t pieces, bool merge_values) {
  __shared__ uint64_t shared_key;
  const int64_t row = blockIdx.x / rows.tiles, tile = blockIdx.x % rows.tiles;
  if (threadIdx.x < kWarpSize) {
    uint64_t best = ~static_cast<uint64_t>(0);
    for (int64_t piece = threadIdx.x; piece < pieces; piece += kWarpSize) {
      best = MinKey()(best, piece_minima[row * pieces + piece]);
    }
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      best = MinKey()(best, static_cast<uint64_t>(__shfl_down_sync(
                                kFullMask, static_cast<unsigned long long>(best), offset)));
    }
    if (threadIdx.x == 0) shared_key = best;
  }
  __syncthreads();
  const int64_t j = kernels::key_slot(shared_key);
  const int64_t tile_first = tile * rows.slots_per_tile;
  const int64_t last = min(tile_first + rows.slots_per_tile, rows.len - 1);
  const int64_t first = max(tile_first, j);
  if (first >= last) return;  // the tile lies before j: it stays as it is (the whole block returns)
  const bool reads_edge = tile < rows.tiles - 1;  // slot `last` is the next tile's first: read from its copy
  const int64_t edge = reads_edge ? rows.edge(row, tile) : 0;
  const KeyOf key_of = rows.key_of(row);
  // Slot o + 1's sum and count, from the edge's copy where o + 1 is the next tile's first slot.
  const auto sum_after = [&](int64_t o) {
    return reads_edge && o + 1 == last ? rows.edge_scores[2 * edge] : key_of.sums[o + 1];
  };
  const auto count_after = [&](int64_t o) {
    return reads_edge && o + 1 == last ? rows.edge_scores[2 * edge + 1] : key_of.counts[o + 1];
  };
  kernels::MergeCoefficients coefficients{0.0f, 1.0f};
  if (merge_values && first == j) {  // j is in this tile
    coefficients = kernels::merge_coefficients(key_of.mean(j), kernels::mean_score(sum_after(j), count_after(j)));
  }

  const int64_t items = (last - first) * rows.chunks_per_slot;  // <= kShiftTileChunks (slot_tiles)
  Chunk key_reads[kShiftItemsPerThread], value_reads[kShiftItemsPerThread];
  float sum_reads[kShiftItemsPerThread], count_reads[kShiftItemsPerThread];
#pragma unroll
  for (int i = 0; i < kShiftItemsPerThread; ++i) {
    const int64_t item = threadIdx.x + static_cast<int64_t>(i) * kShiftThreads;
    if (item >= items) break;
    const int64_t o = first + item / rows.chunks_per_slot, c = item % rows.chunks_per_slot;
    const bool from_edge = reads_edge && o + 1 == last;
    if (c < rows.key_chunks) {
      key_reads[i] = from_edge ? rows.edge_keys[edge * rows.key_chunks + c] : rows.key(row, o + 1)[c];
    }
    if (c < rows.value_chunks) {
      value_reads[i] = from_edge ? rows.edge_values[edge * rows.value_chunks + c] : rows.value(row, o + 1)[c];
      if (merge_values && o == j) {
        value_reads[i] = merged_chunk<scalar_t>(rows.value(row, j)[c], value_reads[i], coefficients);
      }
    }
    if (c == 0) {
      sum_reads[i] = sum_after(o);
      count_reads[i] = count_after(o);
    }
  }
  __syncthreads();
  float* sums = rows.sums + rows.sum_rows.offset(row);
  float* counts = rows.counts + rows.count_rows.offset(row);
#pragma unroll
  for (int i = 0; i < kShiftItemsPerThread; ++i) {
    const int64_t item = threadIdx.x + static_cast<int64_t>(i) * kShiftThreads;
    if (item >= items) break;
    const int64_t o = first + item / rows.chunks_per_slot, c = item % rows.chunks_per_slot;
    if (c < rows.key_chunks) rows.key(row, o)[c] = key_reads[i];
    if (c < rows.value_chunks) rows.value(row, o)[c] = value_reads[i];
    if (c == 0) {
      sums[o] = sum_reads[i];
      counts[o] = count_reads[i];
    }
  }
}

// The input slot of output slot o of a row, and whether select_and_fold merged its value: a merged survivor ends a
// run of evicted slots, so its source does not follow the previous one's.
struct SourceList {
  const int32_t* sources;  // [B * H, T - e]
  int64_t out_len;
  __device__ int64_t source(int64_t row, int64_t o) const { return sources[row * out_len + o]; }
  __device__ bool merged(int64_t row, int64_t o) const {
    return source(row, o) != (o == 0 ? 0 : source(row, o - 1) + 1);
  }
};

// Chunk: uint4 (16 bytes) when every row of keys and values is a whole number of aligned 16-byte chunks, else
// scalar_t.
template <typename Chunk>
__global__ void __launch_bounds__(kGatherThreads)
    gather_survivors_kernel(const Chunk* __restrict__ keys,  // [B, H, T, key_chunks]
                            const Chunk* __restrict__ values,  // [B, H, T, value_chunks]
                            const float* __restrict__ sums,  // [B, H, T]
                            const float* __restrict__ counts,  // [B, H, T]
                            SourceList sources,
                            Chunk* __restrict__ keys_out,  // [B, H, T - e, key_chunks]
                            Chunk* __restrict__ values_out,  // [B, H, T - e, value_chunks]
                            float* __restrict__ sums_out,  // [B, H, T - e]
                            float* __restrict__ counts_out,  // [B, H, T - e]
                            int64_t len, int64_t out_len, int64_t key_chunks, int64_t value_chunks,
                            int64_t chunks_per_slot, int64_t total, bool merge_values) {
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < total;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t chunk = index % chunks_per_slot;
    const int64_t out_slot = index / chunks_per_slot;  // row * out_len + o
    const int64_t o = out_slot % out_len;
    const int64_t row = out_slot / out_len;
    const int64_t in_slot = row * len + sources.source(row, o);
    if (chunk < key_chunks) keys_out[out_slot * key_chunks + chunk] = keys[in_slot * key_chunks + chunk];
    if (chunk < value_chunks && !(merge_values && sources.merged(row, o))) {
      values_out[out_slot * value_chunks + chunk] = values[in_slot * value_chunks + chunk];
    }
    if (chunk == 0) {
      sums_out[out_slot] = sums[in_slot];
      counts_out[out_slot] = counts[in_slot];
    }
  }
}

template <typename scalar_t, typename Chunk>
void launch_gather(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& sums, const at::Tensor& counts,
                   const SourceList& sources, at::Tensor& keys_out, at::Tensor& values_out, at::Tensor& sums_out,
                   at::Tensor& counts_out, const WeightedKVEvictShape& shape, bool merge_values, cudaStream_t stream) {
  constexpr int64_t per_chunk = sizeof(Chunk) / sizeof(scalar_t);
  const int64_t key_chunks = shape.key_dim / per_chunk, value_chunks = shape.value_dim / per_chunk;
  const int64_t chunks_per_slot = std::max<int64_t>({key_chunks, value_chunks, 1});
  const int64_t total = shape.rows() * shape.out_len() * chunks_per_slot;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((total + kGatherThreads - 1) / kGatherThreads, 1 << 20));
  gather_survivors_kernel<Chunk><<<blocks, kGatherThreads, 0, stream>>>(
      reinterpret_cast<const Chunk*>(keys.const_data_ptr<scalar_t>()),
      reinterpret_cast<const Chunk*>(values.const_data_ptr<scalar_t>()), sums.const_data_ptr<float>(),
      counts.const_data_ptr<float>(), sources,
      reinterpret_cast<Chunk*>(keys_out.mutable_data_ptr<scalar_t>()),
      reinterpret_cast<Chunk*>(values_out.mutable_data_ptr<scalar_t>()), sums_out.mutable_data_ptr<float>(),
      counts_out.mutable_data_ptr<float>(), shape.len, shape.out_len(), key_chunks, value_chunks, chunks_per_slot,
      total, merge_values);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned_16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

// The survivors of every row, folded, as new tensors of T - evictions slots (select_and_fold, then the gather).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> evicted_copies(
    const at::Tensor& keys, const at::Tensor& values, const at::Tensor& sums, const at::Tensor& counts,
    const WeightedKVEvictShape& shape, bool merge_values) {
  const at::Tensor keys_c = keys.contiguous(), values_c = values.contiguous();
  const at::Tensor sums_c = sums.contiguous(), counts_c = counts.contiguous();
  const int64_t out_len = shape.out_len();
  at::Tensor keys_out = at::empty({shape.batch, shape.kv_heads, out_len, shape.key_dim}, keys_c.options());
  at::Tensor values_out = at::empty({shape.batch, shape.kv_heads, out_len, shape.value_dim}, values_c.options());
  at::Tensor sums_out = at::empty({shape.batch, shape.kv_heads, out_len}, sums_c.options());
  at::Tensor counts_out = at::empty({shape.batch, shape.kv_heads, out_len}, counts_c.options());

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const unsigned row_blocks = grid_dim("kvcomp::weightedkv_evict", "rows", shape.rows());
  const at::Tensor sources = at::empty({shape.rows(), out_len}, sums_c.options().dtype(at::kInt));
  const at::Tensor stack_keys = at::empty({shape.rows(), shape.evictions}, sums_c.options().dtype(at::kLong));
  const at::Tensor open_values = at::empty({shape.rows(), shape.evictions, shape.value_dim}, values_c.options());
  KVCOMP_DISPATCH_CACHE_TYPES(values.scalar_type(), "kvcomp::weightedkv_evict", [&] {
    select_and_fold_kernel<scalar_t><<<row_blocks, kSelectThreads, 0, stream>>>(
        values_c.const_data_ptr<scalar_t>(), sums_c.const_data_ptr<float>(), counts_c.const_data_ptr<float>(),
        values_out.mutable_data_ptr<scalar_t>(), sources.mutable_data_ptr<int32_t>(),
        reinterpret_cast<uint64_t*>(stack_keys.mutable_data_ptr<int64_t>()), open_values.mutable_data_ptr<scalar_t>(),
        shape.len, shape.value_dim, shape.middle_begin(), shape.middle_end(), shape.evictions, merge_values);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const SourceList source_list{sources.const_data_ptr<int32_t>(), out_len};
    const bool vectorised = (shape.key_dim * sizeof(scalar_t)) % 16 == 0 &&
                            (shape.value_dim * sizeof(scalar_t)) % 16 == 0 && aligned_16(keys_c.const_data_ptr()) &&
                            aligned_16(values_c.const_data_ptr()) && aligned_16(keys_out.const_data_ptr()) &&
                            aligned_16(values_out.const_data_ptr());
    if (vectorised) {
      launch_gather<scalar_t, uint4>(keys_c, values_c, sums_c, counts_c, source_list, keys_out, values_out, sums_out,
                                     counts_out, shape, merge_values, stream);
    } else {
      launch_gather<scalar_t, scalar_t>(keys_c, values_c, sums_c, counts_c, source_list, keys_out, values_out,
                                        sums_out, counts_out, shape, merge_values, stream);
    }
  });
  return {keys_out, values_out, sums_out, counts_out};
}

// A decoding step (one eviction) where the rows lie, in two launches (file comment); false, with nothing launched,
// where a slot is wider than a tile's registers hold.
template <typename scalar_t, typename Chunk>
bool evict_one_in_place(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& sums,
                        const at::Tensor& counts, const WeightedKVEvictShape& shape, bool merge_values) {
  constexpr int64_t per_chunk = sizeof(Chunk) / sizeof(scalar_t);
  const int64_t key_chunks = shape.key_dim / per_chunk, value_chunks = shape.value_dim / per_chunk;
  const int64_t chunks_per_slot = std::max<int64_t>({key_chunks, value_chunks, 1});
  const kernels::launch::SlotTiles tiles =
      kernels::launch::slot_tiles(shape.out_len(), chunks_per_slot, kShiftTileChunks);
  // Every part of slot j would read its sum and count for the merge while the first part overwrites them.
  if (tiles.chunk_tiles > 1) return false;
  const int64_t middle_len = shape.middle_end() - shape.middle_begin();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const kernels::launch::RowPieces pieces =
      kernels::launch::row_pieces(shape.rows(), middle_len, sms, kMinSlotsPerPiece);
  const unsigned row_blocks = grid_dim("kvcomp::weightedkv_evict", "rows", shape.rows());
  const unsigned shift_blocks = grid_dim("kvcomp::weightedkv_evict", "(row, tile) pairs", shape.rows() * tiles.tiles);

  const int64_t edges = shape.rows() * (tiles.tiles - 1);
  const at::Tensor piece_minima = at::empty({shape.rows(), pieces.count}, sums.options().dtype(at::kLong));
  const at::Tensor edge_keys = at::empty({edges, shape.key_dim}, keys.options());
  const at::Tensor edge_values = at::empty({edges, shape.value_dim}, values.options());
  const at::Tensor edge_scores = at::empty({edges, 2}, sums.options());
  const ShiftRows<Chunk> rows{reinterpret_cast<Chunk*>(keys.mutable_data_ptr<scalar_t>()),
                              reinterpret_cast<Chunk*>(values.mutable_data_ptr<scalar_t>()),
                              sums.mutable_data_ptr<float>(),
                              counts.mutable_data_ptr<float>(),
                              row_strides(keys, per_chunk),
                              row_strides(values, per_chunk),
                              row_strides(sums),
                              row_strides(counts),
                              reinterpret_cast<Chunk*>(edge_keys.mutable_data_ptr<scalar_t>()),
                              reinterpret_cast<Chunk*>(edge_values.mutable_data_ptr<scalar_t>()),
                              edge_scores.mutable_data_ptr<float>(),
                              shape.len,
                              key_chunks,
                              value_chunks,
                              chunks_per_slot,
                              tiles.slots_per_tile,
                              tiles.tiles};
  uint64_t* minima = reinterpret_cast<uint64_t*>(piece_minima.mutable_data_ptr<int64_t>());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  min_key_pieces_kernel<Chunk><<<dim3(row_blocks, static_cast<unsigned>(pieces.count)), kSelectThreads, 0, stream>>>(
      rows, minima, shape.middle_begin(), shape.middle_end(), pieces.length);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  shift_after_eviction_kernel<scalar_t, Chunk><<<shift_blocks, kShiftThreads, 0, stream>>>(rows, minima, pieces.count,
                                                                                           merge_values);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

// A decoding step shifts the rows in place; more evictions (or a slot too wide for that) gather the survivors into
// new tensors, which are copied back over the rows' first T - evictions slots (a row's survivors move left over slots
// that other blocks still read).
void weightedkv_evict_cuda(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& sums,
                           const at::Tensor& counts, int64_t sinks, int64_t recent, int64_t evictions,
                           bool merge_values) {
  const WeightedKVEvictShape shape = check_weightedkv_evict(keys, values, sums, counts, sinks, recent, evictions);
  if (shape.evictions == 0 || shape.rows() == 0) return;
  const c10::cuda::OptionalCUDAGuard device_guard(keys.device());
  if (shape.evictions == 1) {
    bool shifted = false;
    KVCOMP_DISPATCH_CACHE_TYPES(keys.scalar_type(), "kvcomp::weightedkv_evict", [&] {
      shifted = rows_in_16_byte_chunks(keys) && rows_in_16_byte_chunks(values)
                    ? evict_one_in_place<scalar_t, uint4>(keys, values, sums, counts, shape, merge_values)
                    : evict_one_in_place<scalar_t, scalar_t>(keys, values, sums, counts, shape, merge_values);
    });
    if (shifted) return;
  }
  const auto [keys_out, values_out, sums_out, counts_out] =
      evicted_copies(keys, values, sums, counts, shape, merge_values);
  const int64_t out_len = shape.out_len();
  keys.narrow(2, 0, out_len).copy_(keys_out);
  values.narrow(2, 0, out_len).copy_(values_out);
  sums.narrow(2, 0, out_len).copy_(sums_out);
  counts.narrow(2, 0, out_len).copy_(counts_out);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CUDA, m) { m.impl("weightedkv_evict", &weightedkv_evict_cuda); }

}  // namespace kvcomp
