// GoogleTest of the block tables' check (kvcomp/block_tables.h): the tensor-operation summary a GPU call runs,
// compared on CPU tensors with the host loop a CPU call runs and with hand-built tables, so the GPU's path is tested on
// a machine without one.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kvcomp/block_tables.h"

namespace {

using kvcomp::BlockTableSummary;

at::Tensor int64_tensor(const std::vector<int64_t>& values, at::IntArrayRef shape) {
  return at::tensor(values, at::kLong).view(shape);
}

void expect_same(const BlockTableSummary& a, const BlockTableSummary& b) {
  EXPECT_EQ(a.longest, b.longest);
  EXPECT_EQ(a.shortest, b.shortest);
  EXPECT_EQ(a.first_out_of_range, b.first_out_of_range);
  EXPECT_EQ(a.first_shared, b.first_shared);
}

// (B = 1, H = 2, max_blocks = 3), blocks of 4 slots: lengths 5 and 9 use 2 and 3 entries.
TEST(BlockTableSummary, HandBuiltTables) {
  const at::Tensor lengths = int64_tensor({5, 9}, {1, 2});
  const at::Tensor apart = int64_tensor({0, 1, -1, 2, 3, 4}, {1, 2, 3});
  const at::Tensor shared = int64_tensor({0, 1, -1, 2, 1, 4}, {1, 2, 3});  // entry 4 names entry 1's block
  const at::Tensor unused_shared = int64_tensor({0, 1, 4, 2, 3, 4}, {1, 2, 3});  // entry 2 is past length 5's blocks
  const at::Tensor out_of_range = int64_tensor({0, 7, -1, 2, 0, 1}, {1, 2, 3});  // entry 1: block 7 of 5
  for (bool on_host : {true, false}) {
    const auto summary = [&](const at::Tensor& tables, bool exclusive) {
      return on_host ? kvcomp::block_table_summary_on_host(tables, lengths, 5, 4, exclusive)
                     : kvcomp::block_table_summary_with_tensor_ops(tables, lengths, 5, 4, exclusive);
    };
    expect_same(summary(apart, true), {9, 5, 6, 6});
    expect_same(summary(shared, true), {9, 5, 6, 4});
    expect_same(summary(shared, false), {9, 5, 6, 6});  // a read-only op may share blocks
    expect_same(summary(unused_shared, true), {9, 5, 6, 6});
    expect_same(summary(out_of_range, true), {9, 5, 1, 4});  // and entry 4 names entry 0's block
  }
}

TEST(BlockTableSummary, TensorOperationsAgreeWithTheHostLoop) {
  std::mt19937_64 random(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t batch = 1 + random() % 3, heads = 1 + random() % 3, max_blocks = random() % 4;
    const int64_t block_size = 1 + random() % 4, num_blocks = 1 + random() % 8;
    std::vector<int64_t> lengths(batch * heads), tables(batch * heads * max_blocks);
    for (auto& length : lengths) length = static_cast<int64_t>(random() % (max_blocks * block_size + 3)) - 1;
    for (auto& block : tables) block = static_cast<int64_t>(random() % (num_blocks + 2)) - 1;  // -1 .. num_blocks
    const at::Tensor lengths_t = int64_tensor(lengths, {batch, heads});
    const at::Tensor tables_t = int64_tensor(tables, {batch, heads, max_blocks});
    for (bool exclusive : {false, true}) {
      SCOPED_TRACE("trial " + std::to_string(trial) + (exclusive ? ", exclusive" : ""));
      expect_same(kvcomp::block_table_summary_with_tensor_ops(tables_t, lengths_t, num_blocks, block_size, exclusive),
                  kvcomp::block_table_summary_on_host(tables_t, lengths_t, num_blocks, block_size, exclusive));
    }
  }
}

}  // namespace
