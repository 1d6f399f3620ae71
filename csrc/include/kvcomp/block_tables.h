// The contents of a paged cache's block tables, checked before a kernel reads through them (paged_decode_attention,
// kvzap_paged_step): a wrong length or block index would read or write another sequence's slots, or wild memory.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>

namespace kvcomp {

// block_tables (B, H, max_blocks) and lengths (B, H) int64 on one device, over a pool of num_blocks blocks of
// block_size slots: every length in [min_length, max_blocks * block_size] (`bounds`: what those bounds are, for the
// error) and every block a (b, h) uses (the first ceil(length / block_size) entries of its table) in [0, num_blocks).
// Returns the longest length (0 for no (b, h)). A loop on the host for CPU tensors; on a GPU one reduction on the
// device and one host sync.
inline int64_t check_block_table_contents(const char* op, const at::Tensor& block_tables, const at::Tensor& lengths,
                                          int64_t num_blocks, int64_t block_size, int64_t min_length,
                                          const char* bounds) {
  const int64_t pairs = lengths.numel(), max_blocks = block_tables.size(2), heads = block_tables.size(1);
  if (pairs == 0) return 0;
  // [longest length, shortest length, first used table entry out of range (numel if none)]
  const int64_t capacity = max_blocks * block_size, entries = block_tables.numel();
  int64_t summary[3] = {0, capacity, entries};
  if (lengths.is_cpu()) {
    const at::Tensor lengths_c = lengths.contiguous(), tables_c = block_tables.contiguous();
    const int64_t* length = lengths_c.const_data_ptr<int64_t>();
    const int64_t* table = tables_c.const_data_ptr<int64_t>();
    summary[0] = summary[1] = length[0];
    for (int64_t pair = 0; pair < pairs; ++pair) {
      summary[0] = std::max(summary[0], length[pair]);
      summary[1] = std::min(summary[1], length[pair]);
      const int64_t used = std::clamp<int64_t>((length[pair] + block_size - 1) / block_size, 0, max_blocks);
      for (int64_t i = 0; i < used && summary[2] == entries; ++i) {
        const int64_t block = table[pair * max_blocks + i];
        if (block < 0 || block >= num_blocks) summary[2] = pair * max_blocks + i;
      }
    }
  } else {
    const at::Tensor blocks_used = (lengths + (block_size - 1)).div(block_size, "floor");
    const at::Tensor used = at::arange(max_blocks, lengths.options()).view({1, 1, -1}) < blocks_used.unsqueeze(-1);
    const at::Tensor out_of_range = used & ((block_tables < 0) | (block_tables >= num_blocks));
    // No table entries at all (max_blocks = 0): nothing to be out of range, and min() of nothing is an error.
    const at::Tensor first_bad =
        entries == 0 ? at::full({}, entries, lengths.options())
                     : at::where(out_of_range.flatten(), at::arange(entries, lengths.options()), entries).min();
    const at::Tensor on_host = at::stack({lengths.max(), lengths.min(), first_bad}).cpu();
    std::copy_n(on_host.const_data_ptr<int64_t>(), 3, summary);
  }
  TORCH_CHECK(summary[1] >= min_length && summary[0] <= capacity, op, ": expected every length in [", min_length, ", ",
              capacity, "] (", bounds, "), got lengths from ", summary[1], " to ", summary[0]);
  if (summary[2] < entries) {
    const int64_t entry = summary[2];
    const int64_t block = block_tables.flatten()[entry].item<int64_t>();
    TORCH_CHECK(false, op, ": block table index out of range: block_tables[", entry / (heads * max_blocks), ", ",
                entry / max_blocks % heads, ", ", entry % max_blocks, "] = ", block, " is used but not in [0, ",
                num_blocks, ")");
  }
  return summary[0];
}

}  // namespace kvcomp
