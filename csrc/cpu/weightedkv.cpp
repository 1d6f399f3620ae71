// CPU kernels of the weightedkv family.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include "cpu/vec.h"
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "kernels/weightedkv.h"
#include "kvcomp/weightedkv.h"

namespace kvcomp {
namespace {

using cpu::FloatVec;
using cpu::load_as_float;
using cpu::store_from_float;

// parent <- child * c_child + parent * c_parent over d channels, rounded to the cache dtype as a cache stored in it
// would hold the value after the step.
template <typename scalar_t>
void merge_rows(const scalar_t* child, scalar_t* parent, int64_t dim, kernels::MergeCoefficients coefficients) {
  const FloatVec c_child(coefficients.child), c_parent(coefficients.parent);
  for (int64_t c = 0; c < dim; c += FloatVec::size()) {
    const int64_t count = std::min<int64_t>(FloatVec::size(), dim - c);
    const FloatVec merged =
        kernels::weighted_merge(load_as_float(child + c, count), load_as_float(parent + c, count), c_child, c_parent);
    store_from_float(merged, parent + c, count);
  }
}

// The open slots of one run (see kernels::fold_run): level 0 is the terminal survivor, whose value already sits in
// the output; levels 1.. hold copies of the evicted slots' values while they receive their own merges.
template <typename scalar_t>
struct RunStack {
  const scalar_t* values;  // [T, d_v] of this row (input)
  const float* sums;  // [T]
  const float* counts;  // [T]
  scalar_t* terminal_value;  // [d_v] in the output
  int64_t dim;
  std::vector<uint64_t> keys;  // keys[level], keys[0] unused
  std::vector<scalar_t> open;  // [level - 1, d_v]

  scalar_t* value_at(int64_t level) { return level == 0 ? terminal_value : open.data() + (level - 1) * dim; }
  float mean_at(int64_t level) const {
    const int64_t slot = kernels::key_slot(keys[level]);
    return kernels::mean_score(sums[slot], counts[slot]);
  }

  void reset(int64_t terminal) {
    keys.assign(1, static_cast<uint64_t>(terminal));
  }
  int64_t depth() const { return static_cast<int64_t>(keys.size()) - 1; }
  uint64_t top_key() const { return keys.back(); }
  void push(uint64_t key) {
    keys.push_back(key);
    if (static_cast<int64_t>(open.size()) < depth() * dim) open.resize(depth() * dim);
    std::memcpy(value_at(depth()), values + kernels::key_slot(key) * dim, dim * sizeof(scalar_t));
  }
  void pop_and_merge() {
    const int64_t top = depth();
    merge_rows(value_at(top), value_at(top - 1), dim, kernels::merge_coefficients(mean_at(top), mean_at(top - 1)));
    keys.pop_back();
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> weightedkv_evict_cpu(
    const at::Tensor& keys, const at::Tensor& values, const at::Tensor& sums, const at::Tensor& counts, int64_t sinks,
    int64_t recent, int64_t evictions, bool merge_values) {
  const WeightedKVEvictShape shape = check_weightedkv_evict(keys, values, sums, counts, sinks, recent, evictions);
  if (shape.evictions == 0) {
    return {keys.contiguous().clone(), values.contiguous().clone(), sums.contiguous().clone(),
            counts.contiguous().clone()};
  }
  const at::Tensor keys_c = with_contiguous_rows(keys), values_c = with_contiguous_rows(values);
  const at::Tensor sums_c = with_contiguous_rows(sums), counts_c = with_contiguous_rows(counts);
  const int64_t len = shape.len, out_len = shape.out_len();
  at::Tensor keys_out = at::empty({shape.batch, shape.kv_heads, out_len, shape.key_dim}, keys_c.options());
  at::Tensor values_out = at::empty({shape.batch, shape.kv_heads, out_len, shape.value_dim}, values_c.options());
  at::Tensor sums_out = at::empty({shape.batch, shape.kv_heads, out_len}, sums_c.options());
  at::Tensor counts_out = at::empty({shape.batch, shape.kv_heads, out_len}, counts_c.options());
  if (shape.rows() == 0) return {keys_out, values_out, sums_out, counts_out};

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "kvcomp::weightedkv_evict", [&] {
    const scalar_t* keys_ptr = keys_c.const_data_ptr<scalar_t>();
    const scalar_t* values_ptr = values_c.const_data_ptr<scalar_t>();
    const float* sums_ptr = sums_c.const_data_ptr<float>();
    const float* counts_ptr = counts_c.const_data_ptr<float>();
    scalar_t* keys_out_ptr = keys_out.mutable_data_ptr<scalar_t>();
    scalar_t* values_out_ptr = values_out.mutable_data_ptr<scalar_t>();
    float* sums_out_ptr = sums_out.mutable_data_ptr<float>();
    float* counts_out_ptr = counts_out.mutable_data_ptr<float>();
    const int64_t kd = shape.key_dim, vd = shape.value_dim;
    const int64_t middle_begin = shape.middle_begin(), middle_end = shape.middle_end();
    const int64_t middle = middle_end - middle_begin;
    const kernels::RowStrides key_rows = row_strides(keys_c), value_rows = row_strides(values_c);
    const kernels::RowStrides sum_rows = row_strides(sums_c), count_rows = row_strides(counts_c);

    at::parallel_for(0, shape.rows(), 1, [&](int64_t row_begin, int64_t row_end) {
      std::vector<uint8_t> evicted;
      std::vector<uint64_t> candidates;
      RunStack<scalar_t> stack{nullptr, nullptr, nullptr, nullptr, vd, {}, {}};
      for (int64_t row = row_begin; row < row_end; ++row) {
        const float* row_sums = sums_ptr + sum_rows.offset(row);
        const float* row_counts = counts_ptr + count_rows.offset(row);
        const auto key_of = [&](int64_t slot) {
          return kernels::eviction_key(kernels::mean_score(row_sums[slot], row_counts[slot]),
                                       static_cast<uint32_t>(slot));
        };

        // 1. The evicted set: the e smallest keys of the middle (one argmin for a decoding step).
        evicted.assign(len, 0);
        if (shape.evictions == middle) {
          std::fill(evicted.begin() + middle_begin, evicted.begin() + middle_end, 1);
        } else if (shape.evictions == 1) {
          uint64_t best = key_of(middle_begin);
          for (int64_t slot = middle_begin + 1; slot < middle_end; ++slot) best = std::min(best, key_of(slot));
          evicted[kernels::key_slot(best)] = 1;
        } else {
          candidates.resize(middle);
          for (int64_t slot = middle_begin; slot < middle_end; ++slot) candidates[slot - middle_begin] = key_of(slot);
          std::nth_element(candidates.begin(), candidates.begin() + (shape.evictions - 1), candidates.end());
          for (int64_t i = 0; i < shape.evictions; ++i) evicted[kernels::key_slot(candidates[i])] = 1;
        }

        // 2. Compact the survivors (memcpy per run of adjacent survivors), 3. fold each run of evicted slots into the
        // survivor right after it.
        const scalar_t* row_keys = keys_ptr + key_rows.offset(row);
        const scalar_t* row_values = values_ptr + value_rows.offset(row);
        scalar_t* row_keys_out = keys_out_ptr + row * out_len * kd;
        scalar_t* row_values_out = values_out_ptr + row * out_len * vd;
        stack.values = row_values;
        stack.sums = row_sums;
        stack.counts = row_counts;
        int64_t out = 0, slot = 0;
        while (slot < len) {
          const int64_t evicted_begin = slot;
          while (slot < len && evicted[slot]) ++slot;
          const int64_t alive_begin = slot;
          while (slot < len && !evicted[slot]) ++slot;
          const int64_t alive = slot - alive_begin;
          std::memcpy(row_keys_out + out * kd, row_keys + alive_begin * kd, alive * kd * sizeof(scalar_t));
          std::memcpy(row_values_out + out * vd, row_values + alive_begin * vd, alive * vd * sizeof(scalar_t));
          std::memcpy(sums_out_ptr + row * out_len + out, row_sums + alive_begin, alive * sizeof(float));
          std::memcpy(counts_out_ptr + row * out_len + out, row_counts + alive_begin, alive * sizeof(float));
          if (merge_values && alive_begin > evicted_begin) {  // a run of evicted slots ends in a (recent) survivor
            stack.terminal_value = row_values_out + out * vd;
            kernels::fold_run(evicted_begin, alive_begin, stack, key_of);
          }
          out += alive;
        }
      }
    });
  });
  return {keys_out, values_out, sums_out, counts_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CPU, m) { m.impl("weightedkv_evict", &weightedkv_evict_cpu); }

}  // namespace kvcomp
