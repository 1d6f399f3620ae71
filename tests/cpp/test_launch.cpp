// GoogleTest of the CUDA launch configurations (kernels/launch.h): grid limits, split counts and chunk lengths, checked
// against hand computations and against the properties the kernels rely on (every item covered, no grid dimension
// over CUDA's limit), on a machine without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/launch.h"
#include "kernels/radix_select.h"

namespace {

namespace launch = kvcomp::kernels::launch;
namespace rs = kvcomp::kernels::radix_select;

TEST(LaunchArithmetic, CeilDivAndPowersOfTwo) {
  EXPECT_EQ(launch::ceil_div(10, 4), 3);
  EXPECT_EQ(launch::ceil_div(12, 4), 3);
  EXPECT_EQ(launch::ceil_div(1, 256), 1);
  EXPECT_EQ(launch::next_power_of_two(1), 1);
  EXPECT_EQ(launch::next_power_of_two(5), 8);
  EXPECT_EQ(launch::next_power_of_two(16), 16);
}

TEST(LaunchArithmetic, GridStrideBlocksCoverOrCap) {
  EXPECT_EQ(launch::grid_stride_blocks(0, 256, 65535), 1);  // never an empty grid
  EXPECT_EQ(launch::grid_stride_blocks(257, 256, 65535), 2);
  EXPECT_EQ(launch::grid_stride_blocks(int64_t{1} << 40, 256, 65535), 65535);  // the loop strides over the rest
}

TEST(LaunchArithmetic, GridYNeverExceedsTheLimit) {
  EXPECT_EQ(launch::grid_y(0), 1);
  EXPECT_EQ(launch::grid_y(8), 8);
  EXPECT_EQ(launch::grid_y(65535), 65535);
  EXPECT_EQ(launch::grid_y(70000), 65535);  // keepkv_match: 70k evicted slots in one chunk used to throw
  EXPECT_EQ(launch::grid_y(int64_t{1} << 40), launch::kMaxGridY);
}

// keepkv_decode_step's fused kernel: wherever its blocks fill half the device, and on short rows; long rows too few to
// fill it take the ATen composition (on an H200 the fused step took 3656 µs at 8 rows of 32k slots, 10x its time at
// 8 rows of 4k).
TEST(KeepKVFusedStep, TakenWhereItsRowsFillTheDeviceOrAreShort) {
  EXPECT_TRUE(launch::keepkv_fused_step_pays(8, 4096, 132));     // fused: 351 µs
  EXPECT_TRUE(launch::keepkv_fused_step_pays(128, 4096, 132));   // 549
  EXPECT_TRUE(launch::keepkv_fused_step_pays(128, 32768, 132));  // 4219
  EXPECT_FALSE(launch::keepkv_fused_step_pays(8, 32768, 132));   // 3656
  EXPECT_TRUE(launch::keepkv_fused_step_pays(66, 1 << 20, 132));  // half the device: each block its own SM
  EXPECT_FALSE(launch::keepkv_fused_step_pays(65, 4097, 132));
  EXPECT_TRUE(launch::keepkv_fused_step_pays(1, 1, 132));
  EXPECT_TRUE(launch::keepkv_fused_step_pays(0, 1 << 20, 132));  // batch 0: nothing to launch
}

// The keepkv_match GEMM chunk: what a chunk holds stays within the float budget, and the chunks cover every evicted
// slot however large the count (the grid strides along y, so no chunk is too large for a launch).
TEST(KeepKVMatchChunk, WithinBudgetAndCoversEveryEvictedSlot) {
  constexpr int64_t budget = int64_t{1} << 26;
  struct Case {
    int64_t max_evicted, rows, max_retained;
  };
  for (const Case c : {Case{100, 8, 1000}, Case{70000, 1, 16}, Case{29000, 64, 3300}, Case{5, 1, 1},
                       Case{1 << 20, 2, 1 << 20}}) {
    const int64_t chunk = launch::keepkv_match_chunk(c.max_evicted, c.rows, c.max_retained, budget);
    EXPECT_GE(chunk, 1);
    EXPECT_LE(chunk, c.max_evicted);
    if (chunk > 1) EXPECT_LE(chunk * c.rows * c.max_retained, budget) << c.max_evicted << " " << c.rows;
    int64_t covered = 0;
    for (int64_t begin = 0; begin < c.max_evicted; begin += chunk) covered += std::min(chunk, c.max_evicted - begin);
    EXPECT_EQ(covered, c.max_evicted);
  }
  EXPECT_EQ(launch::keepkv_match_chunk(70000, 1, 16, budget), 70000);  // > 65535: one chunk, y-stride in the grid
  EXPECT_EQ(launch::keepkv_match_chunk(10, 0, 0, budget), 10);          // no division by zero
}

// Where one evicted slot's similarities (rows x max_retained floats) are already over the budget, the chunks still hold
// one evicted slot each: the largest chunk within the budget would be none, and a chunk of none never ends the
// kernel's loop over the chunks (begin += chunk).
TEST(KeepKVMatchChunk, OneEvictedSlotWhereOneIsAlreadyOverTheBudget) {
  constexpr int64_t budget = int64_t{1} << 26;
  EXPECT_EQ(launch::keepkv_match_chunk(100, 128, int64_t{1} << 20, budget), 1);  // 2^27 floats a slot
  EXPECT_EQ(launch::keepkv_match_chunk(100, 64, int64_t{1} << 20, budget), 1);   // exactly the budget
  EXPECT_EQ(launch::keepkv_match_chunk(100, 3, 7, 20), 1);                      // 21 floats a slot against 20
  EXPECT_EQ(launch::keepkv_match_chunk(100, 3, 7, 41), 1);                      // 2 slots would need 42
  EXPECT_EQ(launch::keepkv_match_chunk(100, 3, 7, 42), 2);
}

TEST(BlocksPerRow, FillsTheDeviceAtBatchOneWithoutTinyBlocks) {
  // kvzap_threshold on an H100 (132 SMs): 8 rows of 32k slots -> 33 blocks per row (2 waves), 1k slots each at least.
  EXPECT_EQ(launch::blocks_per_row(8, 32768, 132, 1024), 32);  // capped by 32768 / 1024
  EXPECT_EQ(launch::blocks_per_row(8, 1 << 20, 132, 1024), 33);
  EXPECT_EQ(launch::blocks_per_row(4096, 32768, 132, 1024), 1);  // many rows fill the device already
  EXPECT_EQ(launch::blocks_per_row(8, 100, 132, 1024), 1);       // short rows: one block
  EXPECT_EQ(launch::blocks_per_row(0, 100, 132, 1024), 1);
  // The cap is the row's pieces of 1024 rounded up: 1025 slots in 2 blocks of 513 and 512, over 1024 / 2 each.
  EXPECT_EQ(launch::blocks_per_row(1, 1025, 132, 1024), 2);
  EXPECT_EQ(launch::blocks_per_row(1, 2048, 132, 1024), 2);
  EXPECT_EQ(launch::blocks_per_row(1, 2049, 132, 1024), 3);
  EXPECT_LE(launch::blocks_per_row(1, int64_t{1} << 40, 1 << 20, 1), launch::kMaxGridY);
  // kvzap's decisions ask for 8 blocks per SM: at B = 16, 8 kv heads, T = 32k, 9 per row (1152 blocks, 11 slots a
  // thread) where 2 waves gave 3 (384 blocks, 43 slots a thread, a third of each SM's threads).
  EXPECT_EQ(launch::blocks_per_row(128, 32769, 132, 1024, 8), 9);
  EXPECT_EQ(launch::blocks_per_row(128, 32769, 132, 1024), 3);
  // The pieces cover the row: blocks * ceil(len / blocks) >= len, and no block starts past the end.
  for (const int64_t len : {1, 1000, 1025, 32768, 100003}) {
    const int64_t blocks = launch::blocks_per_row(2, len, 132, 1024);
    const int64_t piece = launch::ceil_div(len, blocks);
    EXPECT_GE(blocks * piece, len);
    EXPECT_LT((blocks - 1) * piece, len) << len;
  }
}

// The decoding steps' in-place shifts: tiles of whole slots that fit a block's registers, parts of a slot past that.
TEST(SlotTiles, CoverTheRowAndEachSlot) {
  // bf16, d = 128, 16-byte chunks: 16 chunks a slot, 1024 a block: 64 slots a tile, 16 tiles for 1024 slots.
  EXPECT_EQ(launch::slot_tiles(1024, 16, 1024).slots_per_tile, 64);
  EXPECT_EQ(launch::slot_tiles(1024, 16, 1024).tiles, 16);
  EXPECT_EQ(launch::slot_tiles(1024, 16, 1024).chunk_tiles, 1);
  EXPECT_EQ(launch::slot_tiles(1025, 16, 1024).tiles, 17);  // a last tile of one slot
  EXPECT_EQ(launch::slot_tiles(7, 1024, 1024).slots_per_tile, 1);  // the widest slot that fits one tile
  EXPECT_EQ(launch::slot_tiles(7, 1024, 1024).chunk_tiles, 1);
  EXPECT_EQ(launch::slot_tiles(5, 1025, 1024).chunk_tiles, 2);  // wider: a slot in two parts, one slot a tile
  EXPECT_EQ(launch::slot_tiles(5, 1025, 1024).tiles, 5);
  for (const int64_t len : {1, 2, 63, 64, 65, 1000, 32767}) {
    for (const int64_t chunks : {0, 1, 3, 16, 100, 1024, 1025, 5000}) {
      const launch::SlotTiles tiles = launch::slot_tiles(len, chunks, 1024);
      EXPECT_LE(tiles.slots_per_tile * tiles.chunks_per_tile, 1024);  // a tile's reads fit
      EXPECT_GE(tiles.tiles * tiles.slots_per_tile, len) << len << " " << chunks;  // every slot covered
      EXPECT_LT((tiles.tiles - 1) * tiles.slots_per_tile, len);  // no empty tile
      EXPECT_GE(tiles.chunk_tiles * tiles.chunks_per_tile, chunks);  // every chunk of a slot covered
      EXPECT_LT((tiles.chunk_tiles - 1) * tiles.chunks_per_tile, std::max<int64_t>(chunks, 1));
    }
  }
}

// weightedkv_evict's decoding step: the minimum over the middle slots in pieces, one block each.
TEST(RowPieces, TileTheRowWithoutEmptyPieces) {
  // H100, batch 1, 8 kv heads, 32k middle slots: 33 pieces wanted, capped by 32768 / 1024 = 32 pieces of 1024.
  EXPECT_EQ(launch::row_pieces(8, 32768, 132, 1024).count, 32);
  EXPECT_EQ(launch::row_pieces(8, 32768, 132, 1024).length, 1024);
  EXPECT_EQ(launch::row_pieces(512, 32768, 132, 1024).count, 1);  // many rows: one block per row
  EXPECT_EQ(launch::row_pieces(1, 9, 132, 1).count, 9);
  // blocks_per_row(2, 9, 4, 1) = 4 pieces of ceil(9 / 4) = 3 would leave the fourth empty: 3 pieces instead.
  EXPECT_EQ(launch::blocks_per_row(2, 9, 4, 1), 4);
  EXPECT_EQ(launch::row_pieces(2, 9, 4, 1).count, 3);
  EXPECT_EQ(launch::row_pieces(2, 9, 4, 1).length, 3);
  EXPECT_EQ(launch::row_pieces(1, 0, 132, 1024).count, 1);  // nothing to split: one (empty) piece, never zero blocks
  EXPECT_EQ(launch::row_pieces(1, 0, 132, 1024).length, 1);
  for (const int64_t rows : {1, 3, 8, 64, 4096}) {
    for (const int64_t len : {1, 2, 7, 9, 1000, 1025, 4095, 32768, 100003}) {
      for (const int64_t min_items : {1, 64, 1024}) {
        const launch::RowPieces pieces = launch::row_pieces(rows, len, 132, min_items);
        EXPECT_GE(pieces.count, 1);
        EXPECT_LE(pieces.count, launch::kMaxGridY);
        EXPECT_LE(pieces.count, launch::blocks_per_row(rows, len, 132, min_items));
        EXPECT_GE(pieces.count * pieces.length, len) << rows << " " << len << " " << min_items;  // all covered
        EXPECT_LT((pieces.count - 1) * pieces.length, len) << rows << " " << len << " " << min_items;  // none empty
      }
    }
  }
}

// decode_attention, the target shape: B = 8, 8 kv heads, 32 query heads (G = 4), q = 1, d = 128.
TEST(DecodeSplit, TargetShapeOneTileOfTheGroupAndFullChunks) {
  const launch::DecodeSplit split = launch::decode_split(/*pairs=*/64, /*rows=*/4, /*head_dim=*/128,
                                                         /*total_len=*/16384, /*sms=*/132);
  EXPECT_EQ(split.rows_per_tile, 4);  // the whole group: K and V read once per kv head
  EXPECT_EQ(split.num_tiles, 1);
  EXPECT_EQ(split.chunk_len, 256);  // 64 * 64 blocks fill 132 SMs many times over
  EXPECT_EQ(split.num_chunks, 64);
  EXPECT_EQ(split.blocks(), 64);
}

TEST(DecodeSplit, ShortChunksWhenTheGridWouldNotFillTheDevice) {
  // Batch 1, 8 kv heads, T = 4096: 8 * 16 = 128 blocks < 2 * 132 -> 128-slot chunks (256 blocks) -> 64 (512).
  const launch::DecodeSplit split = launch::decode_split(8, 4, 128, 4096, 132);
  EXPECT_EQ(split.chunk_len, 64);
  EXPECT_EQ(split.num_chunks, 64);
  // Never below 64 slots, however small the grid.
  EXPECT_EQ(launch::decode_split(1, 1, 128, 100, 132).chunk_len, 64);
  EXPECT_EQ(launch::decode_split(1, 1, 128, 100, 132).num_chunks, 2);
}

TEST(DecodeSplit, TilesOfQueryRows) {
  // Prefill-like: 4 query heads per kv head, 100 queries -> 400 rows, tiles of 8.
  const launch::DecodeSplit split = launch::decode_split(8, 400, 128, 1000, 132);
  EXPECT_EQ(split.rows_per_tile, 8);
  EXPECT_EQ(split.num_tiles, 50);
  // Rows per tile a power of two that fits the query budget: 3 rows -> 4; d = 1024 -> 4096 / 1024 = 4 rows at most;
  // d = 1536 -> 2 (a power of two <= 2.67); d = 8192 -> 1.
  EXPECT_EQ(launch::decode_split(1, 3, 128, 64, 132).rows_per_tile, 4);
  EXPECT_EQ(launch::decode_split(1, 8, 1024, 64, 132).rows_per_tile, 4);
  EXPECT_EQ(launch::decode_split(1, 8, 1536, 64, 132).rows_per_tile, 2);
  EXPECT_EQ(launch::decode_split(1, 8, 8192, 64, 132).rows_per_tile, 1);
  for (const int64_t rows : {1, 2, 3, 5, 8, 9, 31, 400}) {
    const launch::DecodeSplit s = launch::decode_split(2, rows, 64, 5000, 132);
    EXPECT_GE(s.num_tiles * s.rows_per_tile, rows);
    EXPECT_LT((s.num_tiles - 1) * s.rows_per_tile, rows);
    EXPECT_GE(s.num_chunks * s.chunk_len, 5000);
    EXPECT_LT((s.num_chunks - 1) * s.chunk_len, 5000);
  }
}

// The tensor-core kernel: one block per 16 query rows and chunk; its chunks are whole 64-slot tiles.
TEST(TensorCoreDecodeSplit, TargetShapeLongChunksThatStillFillTheDevice) {
  // B = 8, 8 kv heads, G = 4, T = 16k: 64 pairs x 8 chunks of 2048 = 512 blocks, two per SM of 132 about twice over.
  const launch::DecodeSplit split = launch::tensor_core_decode_split(64, 4, 128, 16384, 132);
  EXPECT_EQ(split.rows_per_tile, 4);
  EXPECT_EQ(split.num_tiles, 1);
  EXPECT_EQ(split.chunk_len, 2048);
  EXPECT_EQ(split.num_chunks, 8);
  // Batch 1 at 16k: 8 pairs -> chunks halved to 256 (8 x 64 = 512 blocks >= 2 x 132); never below 256 slots.
  EXPECT_EQ(launch::tensor_core_decode_split(8, 4, 128, 16384, 132).chunk_len, 256);
  EXPECT_EQ(launch::tensor_core_decode_split(1, 1, 128, 100, 132).chunk_len, 256);
  EXPECT_EQ(launch::tensor_core_decode_split(1, 1, 128, 100, 132).num_chunks, 1);
}

// Tensor cores where the probabilities are wanted over 64k cached slots or more (each case measured there favoured
// them), and where the split-K kernel would cut a (batch, kv head)'s rows into several tiles (each reading the keys
// again): otherwise not at the usual decode (q = 1, G <= 8), from 9 rows on (several tokens a pass, wide groups).
TEST(TensorCoreDecodeSplit, TakenWithProbabilitiesOverManySlotsOrWhereSplitKWouldReadTheKeysOncePerRowTile) {
  constexpr int64_t kMany = launch::kTensorCoreDecodeMinSlotsWithProbs;
  for (const int64_t head_dim : {64, 128}) {
    for (const int64_t rows : {1, 3, 4, 8}) {
      EXPECT_FALSE(launch::tensor_core_decode_pays(rows, head_dim, /*with_probs=*/false, kMany * 4)) << rows;
      EXPECT_TRUE(launch::tensor_core_decode_pays(rows, head_dim, /*with_probs=*/true, kMany)) << rows;
      EXPECT_FALSE(launch::tensor_core_decode_pays(rows, head_dim, /*with_probs=*/true, kMany - 1)) << rows;
    }
    for (const int64_t rows : {9, 16, 24, 400}) {
      for (const bool with_probs : {false, true}) {
        EXPECT_TRUE(launch::tensor_core_decode_pays(rows, head_dim, with_probs, 1)) << rows;
      }
    }
  }
  // The measured cases (H200, 8 kv heads, G = 4): B = 1, T = 1k (8k cached slots) split-K; B = 4, T = 1k about even;
  // B = 8, T = 1k and B = 1, T = 8k (64k) tensor cores.
  EXPECT_FALSE(launch::tensor_core_decode_pays(4, 128, true, 8 * 1024));
  EXPECT_FALSE(launch::tensor_core_decode_pays(4, 128, true, 32 * 1024));
  EXPECT_TRUE(launch::tensor_core_decode_pays(4, 128, true, 64 * 1024));
}

TEST(DecodeKernelChoice, RoutedUnlessTheEnvironmentNamesAKernel) {
  using launch::DecodeKernelChoice;
  EXPECT_EQ(launch::decode_kernel_choice(nullptr), DecodeKernelChoice::kRouted);
  EXPECT_EQ(launch::decode_kernel_choice(""), DecodeKernelChoice::kRouted);
  EXPECT_EQ(launch::decode_kernel_choice("auto"), DecodeKernelChoice::kRouted);
  EXPECT_EQ(launch::decode_kernel_choice("split_k"), DecodeKernelChoice::kSplitK);
  EXPECT_EQ(launch::decode_kernel_choice("tensor_cores"), DecodeKernelChoice::kTensorCores);
  for (const char* wrong : {"tensor-cores", "Split_K", "split_k ", "1"}) {
    EXPECT_EQ(launch::decode_kernel_choice(wrong), DecodeKernelChoice::kUnknown) << wrong;
  }
}

TEST(TensorCoreDecodeSplit, TilesOfSixteenRowsAndWholeSlotTiles) {
  for (const int64_t rows : {1, 4, 8, 15, 16, 17, 24, 400}) {
    for (const int64_t total_len : {1, 63, 64, 300, 4100, 65536}) {
      const launch::DecodeSplit s = launch::tensor_core_decode_split(3, rows, 64, total_len, 132);
      // The kernel starts tile t at row 16 t: tiles of fewer rows only where one tile holds them all.
      EXPECT_TRUE(s.rows_per_tile == launch::kTensorCoreDecodeRows || s.num_tiles == 1) << rows;
      EXPECT_GE(s.num_tiles * launch::kTensorCoreDecodeRows, rows);
      EXPECT_EQ(s.chunk_len % launch::kTensorCoreDecodeTile, 0) << total_len;
      EXPECT_GE(s.num_chunks * s.chunk_len, total_len);
      EXPECT_LT((s.num_chunks - 1) * s.chunk_len, total_len);
    }
  }
}

TEST(DecodeLanes, OneSixteenByteLoadPerLaneForUsualHeadDims) {
  EXPECT_EQ(launch::decode_lanes(128, 8), 16);  // bf16 / fp16, d = 128: 16 lanes x 8 elements
  EXPECT_EQ(launch::decode_lanes(128, 4), 32);  // float32
  EXPECT_EQ(launch::decode_lanes(64, 8), 8);
  EXPECT_EQ(launch::decode_lanes(256, 8), 32);
  EXPECT_EQ(launch::decode_lanes(512, 8), 32);  // capped at a warp: lanes loop over the rest of d
  EXPECT_EQ(launch::decode_lanes(7, 1), 8);
}

// A 16-byte load reads 8 bfloat16 / half or 4 float32 elements; it is only legal where every row of the view starts
// on a 16-byte boundary, so the address and every stride must be multiples of a piece, and d a whole number of them.
TEST(SixteenBytePieces, EveryRowStartsOnABoundaryAndHoldsWholePieces) {
  const int64_t contiguous_bf16[3] = {8 * 1024 * 128, 1024 * 128, 128};  // (B, H, T, d = 128)
  EXPECT_TRUE(launch::rows_in_16_byte_pieces(4096, 2, 128, contiguous_bf16));
  EXPECT_FALSE(launch::rows_in_16_byte_pieces(4096 + 2, 2, 128, contiguous_bf16));  // a view one element in
  EXPECT_FALSE(launch::rows_in_16_byte_pieces(4096 + 8, 2, 128, contiguous_bf16));  // 8 bytes in
  EXPECT_TRUE(launch::rows_in_16_byte_pieces(4096 + 16, 2, 128, contiguous_bf16));
  const int64_t padded_rows[3] = {8 * 1000 * 136, 1000 * 136, 136};  // rows 272 bytes apart: 16 | 272
  EXPECT_TRUE(launch::rows_in_16_byte_pieces(0, 2, 128, padded_rows));
  const int64_t strided_rows[3] = {8 * 1000 * 130, 1000 * 130, 130};  // rows 260 bytes apart: row 1 misaligned
  EXPECT_FALSE(launch::rows_in_16_byte_pieces(0, 2, 128, strided_rows));
  const int64_t odd_head_stride[3] = {8 * 1000 * 128 + 4, 1000 * 128 + 4, 128};  // head 1 starts 8 bytes off
  EXPECT_FALSE(launch::rows_in_16_byte_pieces(0, 2, 128, odd_head_stride));
  const int64_t d_60[3] = {60 * 64 * 4, 60 * 64, 60};
  EXPECT_FALSE(launch::rows_in_16_byte_pieces(0, 2, 60, d_60));  // 60 elements: 7.5 pieces of 8
  EXPECT_TRUE(launch::rows_in_16_byte_pieces(0, 4, 60, d_60));   // float32: 15 pieces of 4
  const int64_t float_strides[3] = {4 * 64 * 6, 64 * 6, 6};
  EXPECT_FALSE(launch::rows_in_16_byte_pieces(0, 4, 4, float_strides));  // rows 24 bytes apart
  const int64_t doubles[3] = {64, 16, 2};
  EXPECT_TRUE(launch::rows_in_16_byte_pieces(0, 8, 2, doubles));
}

TEST(CombineSplit, PiecesCoverTheSlotsWithinTheGridLimit) {
  EXPECT_EQ(launch::combine_split(16384).pieces, 4);
  EXPECT_EQ(launch::combine_split(16384).piece_len, 4096);
  EXPECT_EQ(launch::combine_split(1).pieces, 1);
  EXPECT_EQ(launch::combine_split(0).pieces, 1);
  for (const int64_t len : {int64_t{1}, int64_t{4097}, int64_t{32768}, int64_t{1} << 31, int64_t{1} << 40}) {
    const launch::CombineSplit s = launch::combine_split(len);
    EXPECT_LE(s.pieces, launch::kMaxGridY);
    EXPECT_GE(s.pieces * s.piece_len, len) << len;
    EXPECT_LT((s.pieces - 1) * s.piece_len, len) << len;
  }
}

// The radix select as gvote_union_mask's split kernels run it, replayed on the CPU: per pass, each piece's histogram
// of the keys matching the prefix (piece_histogram_kernel), then the pieces' counts added per digit, an exclusive
// scan, and the one digit that holds the rank (next_digit_kernel). Its result must be the key of that rank.
uint64_t split_select(const std::vector<uint64_t>& keys, int64_t pieces, int64_t piece_len, uint32_t rank) {
  const int64_t len = static_cast<int64_t>(keys.size());
  uint64_t prefix = 0;
  for (int shift = rs::kFirstShift; shift >= 0; shift -= 8) {
    if (rs::byte_is_zero(shift, len)) continue;
    std::vector<uint32_t> histograms(pieces * rs::kRadix, 0);
    for (int64_t piece = 0; piece < pieces; ++piece) {
      const int64_t begin = piece * piece_len, end = std::min(len, begin + piece_len);
      for (int64_t slot = begin; slot < end; ++slot) {
        if ((keys[slot] & rs::high_mask(shift)) == prefix) ++histograms[piece * rs::kRadix + rs::digit_of(keys[slot], shift)];
      }
    }
    uint32_t below = 0;
    int holders = 0;
    uint64_t next_prefix = prefix;
    uint32_t next_rank = rank;
    for (uint32_t digit = 0; digit < rs::kRadix; ++digit) {
      uint32_t count = 0;
      for (int64_t piece = 0; piece < pieces; ++piece) count += histograms[piece * rs::kRadix + digit];
      if (rs::holds_rank(below, count, rank)) {
        ++holders;
        next_prefix = prefix | (static_cast<uint64_t>(digit) << shift);
        next_rank = rank - below;
      }
      below += count;
    }
    EXPECT_EQ(holders, 1) << "shift " << shift;  // exactly one thread of next_digit_kernel writes
    prefix = next_prefix;
    rank = next_rank;
  }
  return prefix;
}

TEST(SplitRadixSelect, FindsTheKeyOfEveryRankWithTiesAndSkippedSlotBytes) {
  std::mt19937 generator(7);
  for (const int64_t len : {1, 2, 255, 256, 257, 5000, 70000}) {
    // Selection keys: an order word with many ties (few distinct logits), the slot in the low 32 bits.
    std::uniform_int_distribution<uint32_t> order(0x7f000000u, 0x7f000003u);
    std::vector<uint64_t> keys(len);
    for (int64_t slot = 0; slot < len; ++slot) keys[slot] = (uint64_t{order(generator)} << 32) | uint64_t(slot);
    std::vector<uint64_t> sorted = keys;
    std::sort(sorted.begin(), sorted.end());
    const launch::RowPieces pieces = launch::row_pieces(1, len, 132, 1024);
    for (const int64_t rank : {int64_t{0}, len / 3, len - 1}) {
      EXPECT_EQ(split_select(keys, pieces.count, pieces.length, static_cast<uint32_t>(rank)), sorted[rank])
          << len << " " << rank;
      EXPECT_EQ(split_select(keys, 1, len, static_cast<uint32_t>(rank)), sorted[rank]) << len << " " << rank;
    }
  }
}

TEST(SplitRadixSelect, MasksAndSkippedBytes) {
  EXPECT_EQ(rs::high_mask(56), 0u);
  EXPECT_EQ(rs::high_mask(48), 0xff00000000000000u);
  EXPECT_EQ(rs::high_mask(0), 0xffffffffffffff00u);
  EXPECT_TRUE(rs::byte_is_zero(8, 256));  // slots 0..255: byte 1 is 0 everywhere
  EXPECT_FALSE(rs::byte_is_zero(8, 257));
  EXPECT_FALSE(rs::byte_is_zero(0, 1));  // the lowest byte is always selected
  EXPECT_FALSE(rs::byte_is_zero(32, 1));  // logit bytes are never skipped
  EXPECT_EQ(rs::digit_of(0x0123456789abcdefu, 8), 0xcdu);
  EXPECT_TRUE(rs::holds_rank(3, 2, 4));
  EXPECT_FALSE(rs::holds_rank(3, 2, 5));
  EXPECT_FALSE(rs::holds_rank(3, 0, 3));  // an empty digit holds nothing
  EXPECT_FALSE(rs::holds_rank(4, 2, 3));
}

}  // namespace
