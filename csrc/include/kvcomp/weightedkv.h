// Validation and shape of the weightedkv family, called first by the CPU and the CUDA kernel alike.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>

#include "kvcomp/checks.h"

namespace kvcomp {

struct WeightedKVEvictShape {
  int64_t batch, kv_heads, len, key_dim, value_dim;
  int64_t sinks, recent, evictions;
  int64_t middle_begin() const { return sinks; }    // first slot that may be evicted
  int64_t middle_end() const { return len - recent; }  // one past the last one
  int64_t rows() const { return batch * kv_heads; }
  int64_t out_len() const { return len - evictions; }
};

inline WeightedKVEvictShape check_weightedkv_evict(const at::Tensor& keys, const at::Tensor& values,
                                                   const at::Tensor& sums, const at::Tensor& counts, int64_t sinks,
                                                   int64_t recent, int64_t evictions) {
  constexpr const char* op = "kvcomp::weightedkv_evict";
  check_dim(op, "keys", keys, 4, "(B, H, T, d)");
  check_dim(op, "values", values, 4, "(B, H, T, d)");
  check_dim(op, "sums", sums, 3, "(B, H, T)");
  check_dim(op, "counts", counts, 3, "(B, H, T)");
  check_floating(op, "keys", keys);
  TORCH_CHECK(values.scalar_type() == keys.scalar_type(), op, ": expected values of the dtype of keys (",
              keys.scalar_type(), "), got ", values.scalar_type());
  check_dtype(op, "sums", sums, at::kFloat);
  check_dtype(op, "counts", counts, at::kFloat);
  check_same_device(op, "values", values, "keys", keys);
  check_same_device(op, "sums", sums, "keys", keys);
  check_same_device(op, "counts", counts, "keys", keys);

  WeightedKVEvictShape shape{keys.size(0), keys.size(1), keys.size(2), keys.size(3), values.size(3),
                             sinks,        recent,       evictions};
  check_size(op, "values", values, 0, shape.batch, "batch of keys");
  check_size(op, "values", values, 1, shape.kv_heads, "kv heads of keys");
  check_size(op, "values", values, 2, shape.len, "slots of keys");
  check_size(op, "sums", sums, 0, shape.batch, "batch of keys");
  check_size(op, "sums", sums, 1, shape.kv_heads, "kv heads of keys");
  check_size(op, "sums", sums, 2, shape.len, "slots of keys");
  check_size(op, "counts", counts, 0, shape.batch, "batch of keys");
  check_size(op, "counts", counts, 1, shape.kv_heads, "kv heads of keys");
  check_size(op, "counts", counts, 2, shape.len, "slots of keys");
  check_contiguous_rows(op, "keys", keys);
  check_contiguous_rows(op, "values", values);
  check_contiguous_rows(op, "sums", sums);
  check_contiguous_rows(op, "counts", counts);
  check_inplace_arguments(op, {{"keys", &keys}, {"values", &values}, {"sums", &sums}, {"counts", &counts}});
  // Slots are indexed with 32 bits on the GPU (and in the argmin key).
  TORCH_CHECK(shape.len <= std::numeric_limits<int32_t>::max(), op, ": expected at most 2^31 - 1 slots, got T = ",
              shape.len);

  TORCH_CHECK(sinks >= 0, op, ": expected sinks >= 0, got sinks = ", sinks);
  TORCH_CHECK(recent >= 1, op, ": expected recent >= 1 (the last middle slot needs a right neighbour), got recent = ",
              recent);
  TORCH_CHECK(evictions >= 0, op, ": expected evictions >= 0, got evictions = ", evictions);
  // Written as a difference so that huge sinks / recent cannot overflow.
  TORCH_CHECK(sinks <= shape.len && recent <= shape.len - sinks && evictions <= shape.len - sinks - recent, op,
              ": expected evictions <= T - sinks - recent (enough middle slots to evict), got evictions = ", evictions,
              ", T = ", shape.len, ", sinks = ", sinks, ", recent = ", recent);
  return shape;
}

}  // namespace kvcomp
