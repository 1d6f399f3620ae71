// Validation and output shapes of the paged_attention family (paged_decode_attention), called first by the CPU and
// the CUDA kernels alike.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>

#include "kvcomp/attention.h"
#include "kvcomp/block_tables.h"
#include "kvcomp/checks.h"

namespace kvcomp {

struct PagedAttentionShape {
  int64_t batch, query_heads, kv_heads, group_size, num_queries, head_dim;
  int64_t num_blocks, block_size, max_blocks;  // pool blocks, slots per block, block-table entries per (b, h)
  int64_t max_len;                             // the width of probs: the caller's max_len, else the longest (b, h)
  int64_t rows() const { return group_size * num_queries; }
};

// Checks shapes, dtypes and devices, and the block tables' contents (check_block_table_contents, every length in
// [0, max_blocks * block_size]), which also gives the longest length: one host sync on a GPU. With max_len given
// (in [1, max_blocks * block_size]) a GPU call reads nothing on the host: a kernel queued before the attention's
// (assert_block_tables_kernel) asserts each length <= max_len and each block index used in [0, N); the host loop of
// a CPU call checks both before the kernel.
inline PagedAttentionShape check_paged_decode_attention(const at::Tensor& query, const at::Tensor& key_blocks,
                                                        const at::Tensor& value_blocks,
                                                        const at::Tensor& log_weight_blocks,
                                                        const at::Tensor& block_tables, const at::Tensor& lengths,
                                                        double scale, std::optional<int64_t> max_len) {
  constexpr const char* op = "kvcomp::paged_decode_attention";
  check_dim(op, "query", query, 4, "(B, Hq, q, d)");
  check_dim(op, "key_blocks", key_blocks, 3, "(N, S, d)");
  check_dim(op, "value_blocks", value_blocks, 3, "(N, S, d)");
  check_dim(op, "log_weight_blocks", log_weight_blocks, 2, "(N, S)");
  check_dim(op, "block_tables", block_tables, 3, "(B, H, max_blocks)");
  check_dim(op, "lengths", lengths, 2, "(B, H)");
  check_floating(op, "query", query);
  check_dtype(op, "key_blocks", key_blocks, query.scalar_type());
  check_dtype(op, "value_blocks", value_blocks, query.scalar_type());
  check_dtype(op, "log_weight_blocks", log_weight_blocks, at::kFloat);
  check_dtype(op, "block_tables", block_tables, at::kLong);
  check_dtype(op, "lengths", lengths, at::kLong);
  check_same_device(op, "key_blocks", key_blocks, "query", query);
  check_same_device(op, "value_blocks", value_blocks, "query", query);
  check_same_device(op, "log_weight_blocks", log_weight_blocks, "query", query);
  check_same_device(op, "block_tables", block_tables, "query", query);
  check_same_device(op, "lengths", lengths, "query", query);
  check_finite_positive(op, "scale", scale);

  PagedAttentionShape shape{query.size(0),      query.size(1),      block_tables.size(1), 0, query.size(2),
                            query.size(3),      key_blocks.size(0), key_blocks.size(1),   block_tables.size(2), 0};
  TORCH_CHECK(shape.block_size >= 1, op, ": expected a block size (key_blocks.size(1)) >= 1, got ",
              shape.block_size);
  check_size(op, "block_tables", block_tables, 0, shape.batch, "batch of query");
  shape.group_size = check_query_group(op, query, shape.kv_heads, "block_tables");
  TORCH_CHECK(shape.num_queries >= 1, op, ": expected at least one query, got query of shape ", query.sizes());
  check_size(op, "key_blocks", key_blocks, 2, shape.head_dim, "head dim d of query");
  for (int64_t dim = 0; dim < 3; ++dim) {
    check_size(op, "value_blocks", value_blocks, dim, key_blocks.size(dim), "the size of key_blocks");
  }
  check_size(op, "log_weight_blocks", log_weight_blocks, 0, shape.num_blocks, "blocks of key_blocks");
  check_size(op, "log_weight_blocks", log_weight_blocks, 1, shape.block_size, "block size of key_blocks");
  check_size(op, "lengths", lengths, 0, shape.batch, "batch of query");
  check_size(op, "lengths", lengths, 1, shape.kv_heads, "kv heads of block_tables");

  if (max_len) {
    const int64_t capacity = shape.max_blocks * shape.block_size;
    TORCH_CHECK(*max_len >= 1 && *max_len <= capacity, op, ": expected max_len in [1, ", capacity,
                "] (max_blocks * block size), got ", *max_len);
  }
  if (max_len && !lengths.is_cpu()) {  // left to assert_block_tables_kernel: no sync
    shape.max_len = *max_len;
    return shape;
  }
  const int64_t longest = check_block_table_contents(op, block_tables, lengths, shape.num_blocks, shape.block_size, 0,
                                                     "max_blocks * block size");
  TORCH_CHECK(!max_len || longest <= *max_len, op, ": expected every length <= max_len = ", max_len.value_or(0),
              ", got a length of ", longest);
  shape.max_len = max_len.value_or(longest);
  return shape;
}

}  // namespace kvcomp
