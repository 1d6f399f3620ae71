// Validation and output shapes of the paged_attention family (paged_decode_attention), called first by the CPU and
// the CUDA kernels alike.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>

#include "kvcomp/attention.h"
#include "kvcomp/checks.h"

namespace kvcomp {

struct PagedAttentionShape {
  int64_t batch, query_heads, kv_heads, group_size, num_queries, head_dim;
  int64_t num_blocks, block_size, max_blocks;  // pool blocks, slots per block, block-table entries per (b, h)
  int64_t max_len;                             // the longest (b, h): the width of probs
  int64_t rows() const { return group_size * num_queries; }
};

// Checks shapes, dtypes and devices, and the block tables' contents: every length in [0, max_blocks * block_size] and
// every block a (b, h) uses (the first ceil(length / block_size) entries of its table) in [0, num_blocks). Reading
// the contents costs one host sync on a GPU; the longest length comes from the same sync.
inline PagedAttentionShape check_paged_decode_attention(const at::Tensor& query, const at::Tensor& key_blocks,
                                                        const at::Tensor& value_blocks,
                                                        const at::Tensor& log_weight_blocks,
                                                        const at::Tensor& block_tables, const at::Tensor& lengths,
                                                        double scale) {
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
  TORCH_CHECK(std::isfinite(scale) && scale > 0.0, op, ": expected a finite scale > 0, got ", scale);

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
  if (shape.batch * shape.kv_heads == 0) return shape;

  // [longest length, shortest length, first used table entry out of range (numel if none)]: a loop over the tables
  // on the host; on a GPU one reduction on the device and one sync.
  const int64_t capacity = shape.max_blocks * shape.block_size, entries = block_tables.numel();
  int64_t summary[3] = {0, capacity, entries};
  if (lengths.is_cpu()) {
    const at::Tensor lengths_c = lengths.contiguous(), tables_c = block_tables.contiguous();
    const int64_t* length = lengths_c.const_data_ptr<int64_t>();
    const int64_t* table = tables_c.const_data_ptr<int64_t>();
    summary[0] = summary[1] = length[0];
    for (int64_t pair = 0; pair < shape.batch * shape.kv_heads; ++pair) {
      summary[0] = std::max(summary[0], length[pair]);
      summary[1] = std::min(summary[1], length[pair]);
      const int64_t used = std::clamp<int64_t>((length[pair] + shape.block_size - 1) / shape.block_size, 0,
                                               shape.max_blocks);
      for (int64_t i = 0; i < used && summary[2] == entries; ++i) {
        const int64_t block = table[pair * shape.max_blocks + i];
        if (block < 0 || block >= shape.num_blocks) summary[2] = pair * shape.max_blocks + i;
      }
    }
  } else {
    const at::Tensor blocks_used = (lengths + (shape.block_size - 1)).div(shape.block_size, "floor");
    const at::Tensor used =
        at::arange(shape.max_blocks, lengths.options()).view({1, 1, -1}) < blocks_used.unsqueeze(-1);
    const at::Tensor out_of_range = used & ((block_tables < 0) | (block_tables >= shape.num_blocks));
    const at::Tensor first_bad =
        at::where(out_of_range.flatten(), at::arange(entries, lengths.options()), entries).min();
    const at::Tensor on_host = at::stack({lengths.max(), lengths.min(), first_bad}).cpu();
    std::copy_n(on_host.const_data_ptr<int64_t>(), 3, summary);
  }
  shape.max_len = summary[0];
  TORCH_CHECK(summary[1] >= 0 && shape.max_len <= capacity, op, ": expected every length in [0, ", capacity,
              "] (max_blocks * block size), got lengths from ", summary[1], " to ", shape.max_len);
  if (summary[2] < entries) {
    const int64_t entry = summary[2];
    const int64_t block = block_tables.flatten()[entry].item<int64_t>();
    TORCH_CHECK(false, op, ": block table index out of range: block_tables[", entry / (shape.kv_heads * shape.max_blocks),
                ", ", entry / shape.max_blocks % shape.kv_heads, ", ", entry % shape.max_blocks, "] = ", block,
                " is used but not in [0, ", shape.num_blocks, ")");
  }
  return shape;
}

}  // namespace kvcomp
