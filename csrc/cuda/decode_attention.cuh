// Split-K decode attention (flash-decoding) over a cache addressed through a CacheView: what decode_attention (a
// rectangular cache, attention.cu) and paged_decode_attention (a block table per head, paged_attention.cu) launch.
// The kernels live in decode_attention.cu, instantiated once for the cache dtypes.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "kernels/common.h"

namespace kvcomp::gpu {

// Where the keys, values and log-weights of slot s of kv head `pair` = b * H + h live. A rectangular cache ([B, H, T,
// d] views) addresses slot s itself; a paged cache addresses pool slot table[s / S] * S + s % S of pools [N * S, d]
// (strides {0, 0, d}) and holds lengths[pair] slots of the max_len the launch covers. Both are resolved once per
// chunk into shared memory, so the loops over K and V are the same for either.
template <typename scalar_t>
struct CacheView {
  const scalar_t* keys;
  const scalar_t* values;
  const float* log_weights;
  int64_t key_strides[3], value_strides[3];  // element strides over (batch, head, slot index); unit stride over d
  int64_t log_weight_strides[2];             // over (pair, slot index)
  const int64_t* block_tables = nullptr;     // [B * H, max_blocks]; null: a rectangular cache
  const int64_t* lengths = nullptr;          // [B * H]; null: every head holds total_len slots
  int64_t block_size = 1, max_blocks = 0;

  __device__ int64_t length(int64_t pair, int64_t total_len) const { return lengths ? lengths[pair] : total_len; }
  __device__ int64_t slot_index(int64_t pair, int64_t slot) const {
    return block_tables ? kernels::pool_slot(block_tables + pair * max_blocks, slot, block_size) : slot;
  }
};

struct DecodeParams {
  int64_t kv_heads, num_queries, total_len, head_dim, rows;  // rows = G * q query rows per kv head; total_len: the
                                                             // widest head (probs' last dim)
  float scale;
  // Chosen by split_decode_attention:
  int64_t chunk_len = 0, num_chunks = 0, num_tiles = 0;
  int lanes = 0;  // threads that share one slot (power of two <= 32); 256 / lanes slots are handled at once
};

// Decode attention of `pairs` (batch, kv head) pairs over `cache`: out [pairs * rows, d] and, where probs is not
// null, the normalised probabilities [pairs * rows, total_len] (0 past a head's length). `params` comes with its
// shape and scale; the split is chosen here. `op` names the op in errors.
template <typename scalar_t>
void split_decode_attention(const char* op, DecodeParams params, int64_t pairs, const scalar_t* query,
                            const CacheView<scalar_t>& cache, scalar_t* out, float* probs,
                            const at::TensorOptions& float_options);

}  // namespace kvcomp::gpu
