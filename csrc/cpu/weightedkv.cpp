// CPU kernels of the weightedkv family.
#include <ATen/Parallel.h>
#include "cpu/vec.h"
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/weightedkv.h"
#include "kvcomp/dispatch.h"
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

// The open slots of one run (see kernels::fold_run): level 0 is the terminal survivor, whose value is merged into where
// it lies (before the run moves left); levels 1.. hold copies of the evicted slots' values while they receive their own
// merges.
template <typename scalar_t>
struct RunStack {
  scalar_t* values;  // [T, d_v] of this row
  const float* sums;  // [T]
  const float* counts;  // [T]
  int64_t dim;
  std::vector<uint64_t> keys;  // keys[level]
  std::vector<scalar_t> open;  // [level - 1, d_v]

  scalar_t* value_at(int64_t level) {
    return level == 0 ? values + kernels::key_slot(keys[0]) * dim : open.data() + (level - 1) * dim;
  }
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

// Moves `count` slots of `width` elements from slot `from` to slot `to` <= from of the same row (ranges may overlap).
template <typename T>
void move_slots(T* row, int64_t to, int64_t from, int64_t count, int64_t width) {
  if (to != from) std::memmove(row + to * width, row + from * width, count * width * sizeof(T));
}

void weightedkv_evict_cpu(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& sums,
                          const at::Tensor& counts, int64_t sinks, int64_t recent, int64_t evictions,
                          bool merge_values) {
  const WeightedKVEvictShape shape = check_weightedkv_evict(keys, values, sums, counts, sinks, recent, evictions);
  if (shape.evictions == 0 || shape.rows() == 0) return;
  const int64_t len = shape.len;

  KVCOMP_DISPATCH_CACHE_TYPES(values.scalar_type(), "kvcomp::weightedkv_evict", [&] {
    scalar_t* keys_ptr = keys.mutable_data_ptr<scalar_t>();
    scalar_t* values_ptr = values.mutable_data_ptr<scalar_t>();
    float* sums_ptr = sums.mutable_data_ptr<float>();
    float* counts_ptr = counts.mutable_data_ptr<float>();
    const int64_t kd = shape.key_dim, vd = shape.value_dim;
    const int64_t middle_begin = shape.middle_begin(), middle_end = shape.middle_end();
    const int64_t middle = middle_end - middle_begin;
    const kernels::RowStrides key_rows = row_strides(keys), value_rows = row_strides(values);
    const kernels::RowStrides sum_rows = row_strides(sums), count_rows = row_strides(counts);

    at::parallel_for(0, shape.rows(), 1, [&](int64_t row_begin, int64_t row_end) {
      std::vector<uint8_t> evicted;
      std::vector<uint64_t> candidates;
      RunStack<scalar_t> stack{nullptr, nullptr, nullptr, vd, {}, {}};
      for (int64_t row = row_begin; row < row_end; ++row) {
        float* row_sums = sums_ptr + sum_rows.offset(row);
        float* row_counts = counts_ptr + count_rows.offset(row);
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

        // 2. Fold each run of evicted slots into the survivor right after it, where that survivor still lies, then
        // 3. move the run of survivors left over the evicted slots. Everything a fold reads lies at or after the run,
        // which no move has reached yet (moves only write before it).
        scalar_t* row_keys = keys_ptr + key_rows.offset(row);
        scalar_t* row_values = values_ptr + value_rows.offset(row);
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
          if (merge_values && alive_begin > evicted_begin) {  // a run of evicted slots ends in a (recent) survivor
            kernels::fold_run(evicted_begin, alive_begin, stack, key_of);
          }
          move_slots(row_keys, out, alive_begin, alive, kd);
          move_slots(row_values, out, alive_begin, alive, vd);
          move_slots(row_sums, out, alive_begin, alive, 1);
          move_slots(row_counts, out, alive_begin, alive, 1);
          out += alive;
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CPU, m) { m.impl("weightedkv_evict", &weightedkv_evict_cpu); }

}  // namespace kvcomp
