// Launch configurations of the CUDA kernels (grid sizes, split counts, chunk lengths). Device-free, so that
// GoogleTest checks the arithmetic on a machine without a GPU; the CUDA glue only reads the device's multiprocessor
// count and passes it in.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>

namespace kvcomp::kernels::launch {

// CUDA's limits on the grid: gridDim.x up to 2^31 - 1, gridDim.y and gridDim.z up to 65535.
constexpr int64_t kMaxGridX = 2147483647;
constexpr int64_t kMaxGridY = 65535;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int next_power_of_two(int64_t n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// Blocks of a grid-stride loop over `total` items at `threads` per block: one item per thread up to `cap` blocks,
// at least one block.
inline int64_t grid_stride_blocks(int64_t total, int threads, int64_t cap) {
  return std::clamp<int64_t>(ceil_div(total, threads), 1, cap);
}

// gridDim.y for `count` items along y, handled by a loop of stride gridDim.y: any count fits.
inline int64_t grid_y(int64_t count) { return std::clamp<int64_t>(count, 1, kMaxGridY); }

// keepkv_match, GEMM path: evicted slots per chunk so that one chunk of similarities (rows x chunk x max_retained
// floats) stays within `budget_floats`; at least one, at most max_evicted.
inline int64_t keepkv_match_chunk(int64_t max_evicted, int64_t rows, int64_t max_retained, int64_t budget_floats) {
  return std::max<int64_t>(1, std::min<int64_t>(max_evicted, budget_floats / std::max<int64_t>(1, rows * max_retained)));
}

// Whether keepkv_decode_step's fused kernel, one block per (batch, kv head) row walking the row's slots several
// times, is taken over the op's ATen composition on `rows` rows of `slots` slots with `sms` multiprocessors: where the
// rows keep half the device busy, or the rows are short. On an H200 (run 13, benchmarks/results/gpu/keepkv.json,
// bfloat16) the fused step took 3656 µs at 8 rows of 32768 slots, 10x its 351 µs at 8 rows of 4096 (each block walks
// its row alone while 124 of 132 multiprocessors idle), and 549 / 4219 µs at 128 rows of 4096 / 32768. The ATen
// composition was not timed there: bench_keepkv's lighter three-op step (update_scores, keepkv_match,
// keepkv_zip_merge) took 907 µs at 8 rows of 32768, 595 at 8 of 4096, and the op's path adds the eviction sort,
// the merge's copies and the packing (about 0.9 GB moved at 8 x 32768, bf16: ~0.2 ms at the copy bandwidth, and ~60
// launches). The bench's keepkv_decode_step row at B = 1, T = 32768 times this path on the next GPU run.
constexpr int64_t kFusedKeepKVStepMaxSlotsAtFewRows = 4096;

inline bool keepkv_fused_step_pays(int64_t rows, int64_t slots, int64_t sms) {
  // No rows: the fused op returns at once (the path the zero-size tests run).
  return rows == 0 || 2 * rows >= sms || slots <= kFusedKeepKVStepMaxSlotsAtFewRows;
}

// Blocks per row of a row-wise elementwise pass with a per-row reduction (kvzap_threshold): enough blocks for
// `waves` waves over `sms` multiprocessors even at batch 1, but no more than the row's pieces of `min_items` items
// (rounded up), so that a block holds over min_items / 2 items unless the whole row is shorter.
inline int64_t blocks_per_row(int64_t rows, int64_t len, int64_t sms, int64_t min_items, int64_t waves = 2) {
  const int64_t wanted = ceil_div(waves * sms, std::max<int64_t>(rows, 1));
  const int64_t most = std::clamp<int64_t>(ceil_div(len, min_items), 1, kMaxGridY);
  return std::clamp<int64_t>(wanted, 1, most);
}

// A row's `len` items split for blocks (row, piece) of a split-T pass whose per-piece results a second stage
// combines: blocks_per_row pieces at most, each of `length` items but the last; none is empty, so every block has
// work and the pieces tile the row exactly: piece p holds items [p * length, min(len, (p + 1) * length)).
struct RowPieces {
  int64_t count;   // gridDim.y
  int64_t length;  // items per piece
};

inline RowPieces row_pieces(int64_t rows, int64_t len, int64_t sms, int64_t min_items) {
  const int64_t length = std::max<int64_t>(1, ceil_div(len, blocks_per_row(rows, len, sms, min_items)));
  return {std::max<int64_t>(1, ceil_div(len, length)), length};
}

// The in-place shifts of a decoding step (weightedkv_evict, keepkv_decode_step) move a row's slots left past the
// evicted ones. The out_len slots they write are cut into tiles, one block each, which holds all that its tile reads
// (at most max_chunks chunks of 16 bytes or elements) in registers before it writes any of it: tiles of whole slots,
// and of parts of a slot only where one slot is wider than max_chunks.
struct SlotTiles {
  int64_t slots_per_tile;
  int64_t tiles;            // along a row's slots
  int64_t chunks_per_tile;  // of a slot
  int64_t chunk_tiles;      // along a slot: 1 unless chunks_per_slot > max_chunks
};

inline SlotTiles slot_tiles(int64_t out_len, int64_t chunks_per_slot, int64_t max_chunks) {
  const int64_t chunks = std::clamp<int64_t>(chunks_per_slot, 1, max_chunks);
  const int64_t slots = max_chunks / chunks;
  return {slots, ceil_div(std::max<int64_t>(out_len, 0), slots), chunks,
          ceil_div(std::max<int64_t>(chunks_per_slot, 1), chunks)};
}

// decode_attention (flash-decoding): one block per (batch, kv head, tile of query rows, chunk of slots).
struct DecodeSplit {
  int rows_per_tile;   // query rows a block holds: a power of two <= max_tile_rows (the whole group when decoding)
  int64_t num_tiles;   // ceil(rows / rows_per_tile)
  int64_t chunk_len;   // slots per block
  int64_t num_chunks;  // ceil(T / chunk_len)
  int64_t blocks() const { return num_tiles * num_chunks; }  // per (batch, kv head)
};

// Rows per tile: a power of two <= max_tile_rows whose queries fit query_tile_floats floats. Chunks of
// max_chunk slots, halved (down to min_chunk) while the grid would not fill the device twice over.
inline DecodeSplit decode_split(int64_t pairs, int64_t rows, int64_t head_dim, int64_t total_len, int64_t sms,
                                int max_tile_rows = 8, int64_t query_tile_floats = 4096, int64_t max_chunk = 256,
                                int64_t min_chunk = 64) {
  DecodeSplit split{};
  const int64_t max_tile = std::max<int64_t>(1, std::min<int64_t>(max_tile_rows, query_tile_floats / head_dim));
  split.rows_per_tile = next_power_of_two(std::min(rows, max_tile));
  if (split.rows_per_tile > max_tile) split.rows_per_tile /= 2;
  split.num_tiles = ceil_div(rows, split.rows_per_tile);
  split.chunk_len = max_chunk;
  while (split.chunk_len > min_chunk && pairs * split.num_tiles * ceil_div(total_len, split.chunk_len) < 2 * sms) {
    split.chunk_len /= 2;
  }
  split.num_chunks = ceil_div(total_len, split.chunk_len);
  return split;
}

// The tensor-core decode kernel (decode_attention.cu): blocks of kTensorCoreDecodeRows query rows (one mma row block,
// padded with zeros) streaming a chunk in tiles of kTensorCoreDecodeTile slots. Chunks are whole tiles, as long as
// 2048 slots (the pipeline's fill and the warps' final combine are paid once per chunk), halved down to 256 while
// the grid would not give every multiprocessor two blocks.
constexpr int kTensorCoreDecodeRows = 16;
constexpr int kTensorCoreDecodeTile = 64;

inline DecodeSplit tensor_core_decode_split(int64_t pairs, int64_t rows, int64_t head_dim, int64_t total_len,
                                            int64_t sms) {
  return decode_split(pairs, rows, head_dim, total_len, sms, kTensorCoreDecodeRows, kTensorCoreDecodeRows * head_dim,
                      /*max_chunk=*/2048, /*min_chunk=*/256);
}

// Whether a half-precision call with `rows` query rows per (batch, kv head) over `cached_slots` slots in all (pairs x
// the widest head) takes the tensor-core kernel. Where the split-K kernel would split the rows into several row
// tiles (reading each key and value once per tile), always. At the usual decode (q = 1, a group of 8 or fewer: one
// tile) only with the probabilities (what decode_attention always returns, and the presses read) over at least 64k
// cached slots. On an H200, with probabilities (bf16, 8 kv heads, G = 4, d = 128; run 10 tensor cores, run 13
// split-K; benchmarks/results/gpu/summary.md) split-K took 1.36-1.70x the tensor-core op's time from 64k cached slots
// on (B = 1, T = 8k-32k; B = 4 and 8, T = 8k-32k; B = 8, T = 1k), 0.93x at 32k (B = 4, T = 1k) and 0.56x at 8k (B = 1,
// T = 1k). Without them (paged_decode_attention's return_probs=False) the split-K kernel took 113.5 / 207 /
// 399 us at B = 4, T = 16k / 32k / 64k (run 9); the tensor-core one has not been timed there.
constexpr int64_t kTensorCoreDecodeMinSlotsWithProbs = 65536;

inline bool tensor_core_decode_pays(int64_t rows, int64_t head_dim, bool with_probs, int64_t cached_slots) {
  return (with_probs && cached_slots >= kTensorCoreDecodeMinSlotsWithProbs) ||
         decode_split(1, rows, head_dim, 1, 1).num_tiles > 1;
}

// Which kernel a call that both decode kernels can serve takes: the routing above, or the one named by the environment
// variable KVCOMP_DECODE_KERNEL (`split_k`, `tensor_cores`; unset, empty or `auto`: the routing). The routing's
// figures come from two runs on two machines; bench_attention times both kernels at one shape in one run with it.
enum class DecodeKernelChoice { kRouted, kSplitK, kTensorCores, kUnknown };

inline DecodeKernelChoice decode_kernel_choice(const char* setting) {
  const std::string_view name = setting == nullptr ? "" : setting;
  if (name.empty() || name == "auto") return DecodeKernelChoice::kRouted;
  if (name == "split_k") return DecodeKernelChoice::kSplitK;
  if (name == "tensor_cores") return DecodeKernelChoice::kTensorCores;
  return DecodeKernelChoice::kUnknown;
}

// Threads that share one slot: enough for the head dim at `vec` elements per load, a power of two <= 32.
inline int decode_lanes(int64_t head_dim, int vec) {
  return std::min(32, next_power_of_two(ceil_div(head_dim, vec)));
}

// Whether rows of `head_dim` elements of `element_bytes` each, unit stride over d, starting at `address` with element
// strides `strides` over (batch, head, slot), can be read in 16-byte pieces: every row starts on a 16-byte boundary
// and holds a whole number of pieces. Views that are not (odd head dims, slices at odd offsets) take one element
// per load.
inline bool rows_in_16_byte_pieces(uintptr_t address, int64_t element_bytes, int64_t head_dim,
                                   const int64_t (&strides)[3]) {
  const int64_t per_piece = 16 / element_bytes;
  bool fits = address % 16 == 0 && 16 % element_bytes == 0 && head_dim % per_piece == 0;
  for (const int64_t stride : strides) fits = fits && stride % per_piece == 0;
  return fits;
}

// The combine of the chunks runs one block per (query row, piece of the slots): each piece rescales at least
// `min_piece` probabilities (and at most 65535 pieces per row); piece 0 also writes the row's output.
struct CombineSplit {
  int64_t pieces;     // gridDim.y
  int64_t piece_len;  // slots per piece
};

inline CombineSplit combine_split(int64_t total_len, int64_t min_piece = 4096) {
  const int64_t pieces = std::clamp<int64_t>(ceil_div(total_len, min_piece), 1, kMaxGridY);
  return {pieces, std::max<int64_t>(1, ceil_div(total_len, pieces))};
}

}  // namespace kvcomp::kernels::launch
