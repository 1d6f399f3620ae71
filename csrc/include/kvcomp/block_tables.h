// The contents of a paged cache's block tables, checked before a kernel reads through them (paged_decode_attention,
// kvzap_paged_step): a wrong length or block index would read or write another sequence's slots, or wild memory.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace kvcomp {

// What check_block_table_contents found: the longest and shortest length, and the flat index into block_tables of the
// first used entry out of [0, num_blocks) and of the first used entry whose block an earlier used entry also names
// (block_tables.numel() where there is none; the second is looked for only when asked, and only among entries in
// range).
struct BlockTableSummary {
  int64_t longest, shortest, first_out_of_range, first_shared;
};

// A loop on the host, for CPU tensors. `pairs` >= 1.
inline BlockTableSummary block_table_summary_on_host(const at::Tensor& block_tables, const at::Tensor& lengths,
                                                     int64_t num_blocks, int64_t block_size, bool exclusive_blocks) {
  const int64_t pairs = lengths.numel(), max_blocks = block_tables.size(2), entries = block_tables.numel();
  const at::Tensor lengths_c = lengths.contiguous(), tables_c = block_tables.contiguous();
  const int64_t* length = lengths_c.const_data_ptr<int64_t>();
  const int64_t* table = tables_c.const_data_ptr<int64_t>();
  BlockTableSummary summary{length[0], length[0], entries, entries};
  std::vector<bool> named(exclusive_blocks ? num_blocks : 0, false);
  for (int64_t pair = 0; pair < pairs; ++pair) {
    summary.longest = std::max(summary.longest, length[pair]);
    summary.shortest = std::min(summary.shortest, length[pair]);
    const int64_t used = std::clamp<int64_t>((length[pair] + block_size - 1) / block_size, 0, max_blocks);
    for (int64_t i = 0; i < used; ++i) {
      const int64_t entry = pair * max_blocks + i, block = table[entry];
      if (block < 0 || block >= num_blocks) {
        summary.first_out_of_range = std::min(summary.first_out_of_range, entry);
      } else if (exclusive_blocks) {
        if (named[block]) summary.first_shared = std::min(summary.first_shared, entry);
        named[block] = true;
      }
    }
  }
  return summary;
}

// The same in tensor operations, for tensors on a GPU (any device: GoogleTest compares it with the loop on the CPU).
// One host sync.
inline BlockTableSummary block_table_summary_with_tensor_ops(const at::Tensor& block_tables, const at::Tensor& lengths,
                                                             int64_t num_blocks, int64_t block_size,
                                                             bool exclusive_blocks) {
  const int64_t max_blocks = block_tables.size(2), entries = block_tables.numel();
  // With no table entries (max_blocks = 0) only the lengths are checked: min() of nothing throws.
  at::Tensor first_out_of_range = at::full({}, entries, lengths.options()), first_shared = first_out_of_range;
  const at::Tensor blocks_used = (lengths + (block_size - 1)).div(block_size, "floor");
  const at::Tensor used =
      (at::arange(max_blocks, lengths.options()).view({1, 1, -1}) < blocks_used.unsqueeze(-1)).flatten();
  const at::Tensor blocks = block_tables.flatten();
  const at::Tensor in_range = (blocks >= 0) & (blocks < num_blocks);
  const at::Tensor entry = at::arange(entries, lengths.options());
  if (entries > 0) first_out_of_range = at::where(used & ~in_range, entry, entries).min();
  if (exclusive_blocks && entries > 0) {
    // Each block's earliest naming entry, by a scatter of the entries' indices with "amin"; an entry is shared where
    // its block's earliest naming entry is another (earlier) one. Unused or out-of-range entries go to a spare slot.
    const at::Tensor named = used & in_range;
    const at::Tensor slot = at::where(named, blocks, num_blocks);
    const at::Tensor earliest =
        at::full({num_blocks + 1}, entries, lengths.options()).scatter_reduce(0, slot, entry, "amin");
    first_shared = at::where(named & (earliest.index_select(0, slot) < entry), entry, entries).min();
  }
  const at::Tensor on_host = at::stack({lengths.max(), lengths.min(), first_out_of_range, first_shared}).cpu();
  const int64_t* summary = on_host.const_data_ptr<int64_t>();
  return {summary[0], summary[1], summary[2], summary[3]};
}

// block_tables (B, H, max_blocks) and lengths (B, H) int64 on one device, over a pool of num_blocks blocks of
// block_size slots: every length in [min_length, max_blocks * block_size] (`bounds`: what those bounds are, for the
// error) and every block a (b, h) uses (the first ceil(length / block_size) entries of its table) in [0, num_blocks).
// With exclusive_blocks (an op that writes through the tables), no block used by two entries either: two rows sharing
// a block would overwrite each other's slots. Returns the longest length (0 for no (b, h)). A loop on the host for
// CPU tensors; on a GPU tensor operations and one host sync.
inline int64_t check_block_table_contents(const char* op, const at::Tensor& block_tables, const at::Tensor& lengths,
                                          int64_t num_blocks, int64_t block_size, int64_t min_length,
                                          const char* bounds, bool exclusive_blocks = false) {
  if (lengths.numel() == 0) return 0;
  const BlockTableSummary summary =
      lengths.is_cpu()
          ? block_table_summary_on_host(block_tables, lengths, num_blocks, block_size, exclusive_blocks)
          : block_table_summary_with_tensor_ops(block_tables, lengths, num_blocks, block_size, exclusive_blocks);
  const int64_t heads = block_tables.size(1), max_blocks = block_tables.size(2), entries = block_tables.numel();
  const int64_t capacity = max_blocks * block_size;
  TORCH_CHECK(summary.shortest >= min_length && summary.longest <= capacity, op, ": expected every length in [",
              min_length, ", ", capacity, "] (", bounds, "), got lengths from ", summary.shortest, " to ",
              summary.longest);
  const auto entry_name = [&](int64_t entry) {
    return c10::str("block_tables[", entry / (heads * max_blocks), ", ", entry / max_blocks % heads, ", ",
                    entry % max_blocks, "] = ", block_tables.flatten()[entry].item<int64_t>());
  };
  TORCH_CHECK(summary.first_out_of_range == entries, op, ": block table index out of range: ",
              entry_name(summary.first_out_of_range), " is used but not in [0, ", num_blocks, ")");
  TORCH_CHECK(summary.first_shared == entries, op, ": ", entry_name(summary.first_shared),
              " names a block an earlier used entry names too: the op writes through the tables, so each block must "
              "belong to one (batch, kv head)");
  return summary.longest;
}

}  // namespace kvcomp
