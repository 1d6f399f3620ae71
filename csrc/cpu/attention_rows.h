// Decode attention on CPU, shared by kvcomp::decode_attention (a rectangular cache) and kvcomp::paged_decode_attention
// (a cache read through block tables): the vectorised row kernels (logits of a run of contiguous slots for the query
// rows of one kv head, the softmax exponentials, the probability-weighted sum of values) and the split of each kv
// head's slots into chunks whose softmax partials are combined afterwards (flash-decoding).
#pragma once

// cpu/vec.h first: it sets the CPU_CAPABILITY that at::vec's headers read.
#include "cpu/vec.h"

#include <ATen/cpu/vec/functional.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>

#include "kernels/attention.h"

namespace kvcomp::cpu {

constexpr int64_t kLanes = FloatVec::size();

inline float reduce_sum(const FloatVec& v) {
  return at::vec::vec_reduce_all<float>([](const FloatVec& a, const FloatVec& b) { return a + b; }, v);
}

inline float reduce_max(const FloatVec& v) {
  return at::vec::vec_reduce_all<float>([](const FloatVec& a, const FloatVec& b) { return at::vec::maximum(a, b); },
                                        v);
}

// Horizontal sums of 4 vectors: out[i] = Σ lanes of acc[i]. On AVX-512 one transpose-reduction (7 shuffles, 5 adds)
// instead of 4 separate reductions.
inline void reduce_sum4(const FloatVec (&acc)[4], float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 a = acc[0], b = acc[1], c = acc[2], d = acc[3];
  // 128-bit lanes [a0+a2, a1+a3, b0+b2, b1+b3] and the same for c, d
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // 128-bit lane i holds 4 partial sums of vector i
  __m512 sums = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  sums = _mm512_add_ps(sums, _mm512_shuffle_ps(sums, sums, 0x4E));
  sums = _mm512_add_ps(sums, _mm512_shuffle_ps(sums, sums, 0xB1));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sums);
  for (int i = 0; i < 4; ++i) out[i] = lanes[4 * i];
#else
  for (int i = 0; i < 4; ++i) out[i] = reduce_sum(acc[i]);
#endif
}

// Σ_e query[r][e] * key[e] for kRows (1 to 4) query rows at once, so each key vector is loaded once for all of them.
template <int kRows, typename scalar_t>
inline void dot_rows(const float* query, int64_t query_stride, const scalar_t* key, int64_t head_dim, float* out) {
  FloatVec acc[4] = {FloatVec(0.0f), FloatVec(0.0f), FloatVec(0.0f), FloatVec(0.0f)};
  int64_t e = 0;
  for (; e + kLanes <= head_dim; e += kLanes) {
    const FloatVec k = load_as_float(key + e, kLanes);
    for (int r = 0; r < kRows; ++r) acc[r] = at::vec::fmadd(FloatVec::loadu(query + r * query_stride + e), k, acc[r]);
  }
  if (e < head_dim) {
    const int64_t count = head_dim - e;
    const FloatVec k = load_as_float(key + e, count);
    for (int r = 0; r < kRows; ++r) {
      acc[r] = at::vec::fmadd(FloatVec::loadu(query + r * query_stride + e, count), k, acc[r]);
    }
  }
  reduce_sum4(acc, out);
}

// acc[e] += weight * value[e], e < head_dim.
template <typename scalar_t>
inline void add_weighted(float* acc, float weight, const scalar_t* value, int64_t head_dim) {
  const FloatVec w(weight);
  for (int64_t e = 0; e < head_dim; e += kLanes) {
    const int64_t count = std::min(kLanes, head_dim - e);
    at::vec::fmadd(w, load_as_float(value + e, count), FloatVec::loadu(acc + e, count)).store(acc + e, count);
  }
}

constexpr int kAccRegisters = 16;  // accumulator vectors accumulate_values keeps in registers (of 32 on AVX-512)

// out[r][e0 : e0 + width] += Σ_s probs[r][s] * value_s[e0 : e0 + width] over the slots [slot_begin, slot_end), for
// kRows rows and width <= kVecs * kLanes: the accumulators stay in registers while the slots (in L1) stream by.
// A slot no row attends is skipped, and a row with probability 0 for a slot skips it too (0 * NaN garbage = NaN).
// kFull: width == kVecs * kLanes, every load and store a whole vector known at compile time (no branches, no spills).
template <int kRows, int kVecs, bool kFull, typename scalar_t>
inline void accumulate_values(const float* probs, int64_t probs_stride, const scalar_t* values, int64_t value_stride,
                              int64_t slot_begin, int64_t slot_end, int64_t e0, int64_t width, float* out,
                              int64_t out_stride) {
  static_assert(kRows * kVecs <= kAccRegisters);
  const int vecs = kFull ? kVecs : static_cast<int>((width + kLanes - 1) / kLanes);
  const int64_t last = kFull ? kLanes : width - (vecs - 1) * kLanes;  // lanes of the last vector
  FloatVec acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r) {
    for (int i = 0; i < kVecs; ++i) {
      if (i < vecs) acc[r][i] = FloatVec::loadu(out + r * out_stride + e0 + i * kLanes, i + 1 < vecs ? kLanes : last);
    }
  }
  for (int64_t slot = slot_begin; slot < slot_end; ++slot) {
    float p[kRows];
    bool any = false;
    for (int r = 0; r < kRows; ++r) {
      p[r] = probs[r * probs_stride + slot];
      any = any || p[r] != 0.0f;
    }
    if (!any) continue;
    const scalar_t* value = values + slot * value_stride + e0;
    FloatVec v[kVecs];
    for (int i = 0; i < kVecs; ++i) {
      if (i < vecs) v[i] = load_as_float(value + i * kLanes, i + 1 < vecs ? kLanes : last);
    }
    for (int r = 0; r < kRows; ++r) {
      if (p[r] == 0.0f) continue;
      const FloatVec w(p[r]);
      for (int i = 0; i < kVecs; ++i) {
        if (i < vecs) acc[r][i] = at::vec::fmadd(w, v[i], acc[r][i]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int i = 0; i < kVecs; ++i) {
      if (i < vecs) acc[r][i].store(out + r * out_stride + e0 + i * kLanes, i + 1 < vecs ? kLanes : last);
    }
  }
}

// accumulate_values, with the whole-vector instantiation when width fills kVecs vectors (d = 32, 64, 128, 256, ...).
template <int kRows, int kVecs, typename scalar_t>
inline void accumulate_rows(const float* probs, int64_t probs_stride, const scalar_t* values, int64_t value_stride,
                            int64_t slot_begin, int64_t slot_end, int64_t e0, int64_t width, float* out,
                            int64_t out_stride) {
  if (width == kVecs * kLanes) {
    accumulate_values<kRows, kVecs, true>(probs, probs_stride, values, value_stride, slot_begin, slot_end, e0, width,
                                          out, out_stride);
  } else {
    accumulate_values<kRows, kVecs, false>(probs, probs_stride, values, value_stride, slot_begin, slot_end, e0, width,
                                           out, out_stride);
  }
}

// accumulate_values for rows [0, rows) of a slot block: as many rows per pass as the whole of d allows in the
// accumulator registers (4 rows of d <= 4 vectors, 2 of d <= 8, else 1 row and d in pieces of 16 vectors), so each
// pass reads whole value rows in order (the first from memory, the others from L1).
template <typename scalar_t>
void accumulate_block(const float* probs, int64_t probs_stride, const scalar_t* values, int64_t value_stride,
                      int64_t slot_begin, int64_t slot_end, int64_t rows, int64_t head_dim, float* out,
                      int64_t out_stride) {
  const int64_t vecs = (head_dim + kLanes - 1) / kLanes;
  for (int64_t row = 0; row < rows;) {
    const float* p = probs + row * probs_stride;
    float* o = out + row * out_stride;
    const int64_t left = rows - row;
#define KVCOMP_ACCUMULATE(ROWS, VECS, E0, WIDTH) \
  accumulate_rows<ROWS, VECS>(p, probs_stride, values, value_stride, slot_begin, slot_end, E0, WIDTH, o, out_stride)
    if (vecs <= 2) {
      const int64_t n = std::min<int64_t>(4, left);
      if (n == 4) KVCOMP_ACCUMULATE(4, 2, 0, head_dim);
      else if (n == 3) KVCOMP_ACCUMULATE(3, 2, 0, head_dim);
      else if (n == 2) KVCOMP_ACCUMULATE(2, 2, 0, head_dim);
      else KVCOMP_ACCUMULATE(1, 2, 0, head_dim);
      row += n;
    } else if (vecs <= 4) {
      const int64_t n = std::min<int64_t>(4, left);
      if (n == 4) KVCOMP_ACCUMULATE(4, 4, 0, head_dim);
      else if (n == 3) KVCOMP_ACCUMULATE(3, 4, 0, head_dim);
      else if (n == 2) KVCOMP_ACCUMULATE(2, 4, 0, head_dim);
      else KVCOMP_ACCUMULATE(1, 4, 0, head_dim);
      row += n;
    } else if (vecs <= 8) {
      const int64_t n = std::min<int64_t>(2, left);
      if (n == 2) KVCOMP_ACCUMULATE(2, 8, 0, head_dim);
      else KVCOMP_ACCUMULATE(1, 8, 0, head_dim);
      row += n;
    } else {
      for (int64_t e0 = 0; e0 < head_dim; e0 += 16 * kLanes) {
        KVCOMP_ACCUMULATE(1, 16, e0, std::min(16 * kLanes, head_dim - e0));
      }
      row += 1;
    }
#undef KVCOMP_ACCUMULATE
  }
}

// Logits of the contiguous slots first_slot + s, s in [0, num_slots), for query rows [0, rows) (float, already
// scaled, row r at query + r * d): logits[r * logits_stride + s] = q_r . k + log_weights[s] if
// kernels::slot_attended(first_slot + s, slot_count[r], log_weights[s]), else -inf. The key of slot first_slot + s is
// at keys + s * key_stride. Masked slots (causal or -inf) are never read, so whatever they hold contributes nothing.
template <typename scalar_t>
void slot_logits(const float* query, int64_t rows, int64_t d, const int64_t* slot_count, const scalar_t* keys,
                 int64_t key_stride, const float* log_weights, int64_t first_slot, int64_t num_slots, float* logits,
                 int64_t logits_stride) {
  float dots[4];
  for (int64_t row = 0; row < rows;) {
    // Up to 4 rows share each key load; a key is read when at least one of them attends to its slot.
    const int64_t group_rows = std::min<int64_t>(4, rows - row);
    const int64_t* count = slot_count + row;
    const int64_t group_count = *std::max_element(count, count + group_rows);
    const float* q = query + row * d;
    for (int64_t s = 0; s < num_slots; ++s) {
      const int64_t slot = first_slot + s;
      const float log_weight = log_weights[s];
      if (kernels::slot_attended(slot, group_count, log_weight)) {
        const scalar_t* key = keys + s * key_stride;
        switch (group_rows) {
          case 4: dot_rows<4>(q, d, key, d, dots); break;
          case 3: dot_rows<3>(q, d, key, d, dots); break;
          case 2: dot_rows<2>(q, d, key, d, dots); break;
          default: dot_rows<1>(q, d, key, d, dots); break;
        }
      }
      for (int64_t r = 0; r < group_rows; ++r) {
        logits[(row + r) * logits_stride + s] =
            kernels::slot_attended(slot, count[r], log_weight) ? dots[r] + log_weight : -INFINITY;
      }
    }
    row += group_rows;
  }
}

// Turns len logits into exp(logit - max) in place and returns their softmax statistics (max, sum); all -inf gives
// zeros and {-inf, 0}.
inline kernels::SoftmaxPartial exp_in_place(float* p, int64_t len) {
  int64_t i = 0;
  FloatVec max_v(-INFINITY);
  for (; i + kLanes <= len; i += kLanes) max_v = at::vec::maximum(max_v, FloatVec::loadu(p + i));
  float max = reduce_max(max_v);
  // NaN-propagating as at::vec::maximum above (std::fmax would drop a NaN for a -inf of a causally masked tail, and
  // the chunk would then read as empty instead of NaN).
  for (; i < len; ++i) max = (kernels::is_nan(p[i]) || p[i] > max) ? p[i] : max;
  kernels::SoftmaxPartial partial{max, 0.0f};
  if (max == -INFINITY) {
    std::fill(p, p + len, 0.0f);
    return partial;
  }
  const FloatVec max_b(max);
  FloatVec sum_v(0.0f);
  for (i = 0; i + kLanes <= len; i += kLanes) {
    const FloatVec e = (FloatVec::loadu(p + i) - max_b).exp();
    e.store(p + i);
    sum_v = sum_v + e;
  }
  float sum = reduce_sum(sum_v);
  for (; i < len; ++i) sum += (p[i] = kernels::shifted_exp(p[i], max));
  partial.sum = sum;
  return partial;
}

// A run of contiguous slots of one (batch, kv head): slot first + s has its key at keys + s * key_stride, its value at
// values + s * value_stride and its log-weight at log_weights[s], s < length.
template <typename scalar_t>
struct SlotRun {
  const scalar_t* keys;
  const scalar_t* values;
  const float* log_weights;
  int64_t key_stride, value_stride, length;
};

// Softmax partials of the slots [slot_begin, slot_end) of one (batch, kv head) for its query rows (float, already
// scaled, row r at query + r * d, seeing the slots below slot_count[r]). run_at(first, end) is the run of contiguous
// slots from `first`, ending at `end` at the latest. Each key and value is read from memory once, whatever the rows.
//   probs:       row r's exp(logit_s - chunk max) at probs[r * probs_stride + s - slot_begin]
//   partial_out: row r's Σ_s exp(logit_s - chunk max) v_s at partial_out + r * out_stride (d floats)
//   stats:       row r's SoftmaxPartial at stats[r * stats_stride]
template <typename RunAt>
void attend_slots(const float* query, int64_t rows, int64_t d, const int64_t* slot_count, const RunAt& run_at,
                  int64_t slot_begin, int64_t slot_end, float* probs, int64_t probs_stride, float* partial_out,
                  int64_t out_stride, kernels::SoftmaxPartial* stats, int64_t stats_stride) {
  // 1. Logits, a run at a time; masked slots (causal or -inf) get -inf without their key being read.
  for (int64_t first = slot_begin; first < slot_end;) {
    const auto run = run_at(first, slot_end);
    slot_logits(query, rows, d, slot_count, run.keys, run.key_stride, run.log_weights, first, run.length,
                probs + (first - slot_begin), probs_stride);
    first += run.length;
  }
  // 2. Per row: chunk max, exp(logit - max) in place, sum.
  for (int64_t row = 0; row < rows; ++row) {
    stats[row * stats_stride] = exp_in_place(probs + row * probs_stride, slot_end - slot_begin);
  }
  // 3. Σ_s p_s v_s for every row, a run at a time (accumulate_block reads each value once for all rows).
  for (int64_t row = 0; row < rows; ++row) std::fill_n(partial_out + row * out_stride, d, 0.0f);
  for (int64_t first = slot_begin; first < slot_end;) {
    const auto run = run_at(first, slot_end);
    accumulate_block(probs + (first - slot_begin), probs_stride, run.values, run.value_stride, 0, run.length, rows, d,
                     partial_out, out_stride);
    first += run.length;
  }
}

// One query row's output from its chunks' partials: out = Σ_c f_c partial_c, f_c = kernels::chunk_normaliser, and,
// when probs is given, its probabilities: probs[s] *= f_c over chunk c's slots below `length`.
template <typename scalar_t>
void finish_row(kernels::SlotChunks chunks, int64_t length, int64_t d, const float* partial_out,
                const kernels::SoftmaxPartial* stats, float* probs, scalar_t* out, float* scratch) {
  kernels::SoftmaxPartial total;
  for (int64_t c = 0; c < chunks.count; ++c) total = kernels::combine(total, stats[c]);
  std::fill_n(scratch, d, 0.0f);
  for (int64_t c = 0; c < chunks.count; ++c) {
    const float factor = kernels::chunk_normaliser(stats[c].max, total);
    const int64_t begin = std::min(length, c * chunks.len), end = std::min(length, begin + chunks.len);
    if (probs != nullptr) {
      at::vec::map([factor](FloatVec p) { return p * FloatVec(factor); }, probs + begin, probs + begin, end - begin);
    }
    if (factor != 0.0f) add_weighted(scratch, factor, partial_out + c * d, d);
  }
  for (int64_t e = 0; e < d; ++e) out[e] = static_cast<scalar_t>(scratch[e]);
}

// Decode attention of `pairs` (batch, kv head)s, one task per (pair, slot chunk). Whichever task finishes a pair's
// chunks last combines that pair's partials into its rows' outputs, while they are still in cache. The chunks depend on the
// shape alone (kernels::decode_slot_chunks) and the partials are combined in chunk order, so the result rounds the
// same on any number of threads.
//   query:          [pairs, rows, d] float, already scaled; row r of a pair is query r % num_queries of its group
//   pair_length(p): the slots of pair p, at most chunks.len * chunks.count
//   pair_runs(p):   a callable (first, end) -> SlotRun over pair p's slots, as attend_slots's run_at
//   probs:          [pairs, rows, probs_width] (probs_width >= every pair's length; the slots past a pair's length
//                   are left as they are), or nullptr when the caller wants none
//   out:            [pairs, rows, d]
template <typename scalar_t, typename PairLength, typename PairRuns>
void decode_attention_in_chunks(int64_t pairs, int64_t rows, int64_t num_queries, int64_t d,
                                kernels::SlotChunks chunks, const float* query, const PairLength& pair_length,
                                const PairRuns& pair_runs, float* probs, int64_t probs_width, scalar_t* out) {
  // [pair, row, chunk, d] unnormalised chunk outputs and [pair, row, chunk] chunk statistics.
  std::vector<float> partial_out(pairs * rows * chunks.count * d);
  std::vector<kernels::SoftmaxPartial> stats(pairs * rows * chunks.count);
  // Chunks of each pair still to run; acq_rel, so the task that takes the last one sees the others' partials.
  const std::unique_ptr<std::atomic<int64_t>[]> chunks_left(new std::atomic<int64_t>[pairs]);
  for (int64_t pair = 0; pair < pairs; ++pair) chunks_left[pair].store(chunks.count, std::memory_order_relaxed);
  at::parallel_for(0, pairs * chunks.count, grain_for(rows * chunks.len * d), [&](int64_t task_begin, int64_t task_end) {
    std::vector<float> scratch(d), chunk_probs(probs == nullptr ? rows * chunks.len : 0);
    std::vector<int64_t> slot_count(rows);
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t pair = task / chunks.count, chunk = task % chunks.count, length = pair_length(pair);
      for (int64_t row = 0; row < rows; ++row) {
        // A pair shorter than q (a padded sequence of a paged batch) leaves its first queries nothing to attend.
        slot_count[row] = kernels::causal_slot_count(row % num_queries, num_queries, length);
      }
      const int64_t slot_begin = std::min(length, chunk * chunks.len);
      const int64_t slot_end = std::min(length, slot_begin + chunks.len);
      float* pair_probs = probs == nullptr ? nullptr : probs + pair * rows * probs_width;
      float* pair_partial = partial_out.data() + pair * rows * chunks.count * d;
      kernels::SoftmaxPartial* pair_stats = stats.data() + pair * rows * chunks.count;
      attend_slots(query + pair * rows * d, rows, d, slot_count.data(), pair_runs(pair), slot_begin, slot_end,
                   probs == nullptr ? chunk_probs.data() : pair_probs + slot_begin,
                   probs == nullptr ? chunks.len : probs_width, pair_partial + chunk * d, chunks.count * d,
                   pair_stats + chunk, chunks.count);
      if (chunks_left[pair].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
      for (int64_t row = 0; row < rows; ++row) {
        finish_row(chunks, length, d, pair_partial + row * chunks.count * d, pair_stats + row * chunks.count,
                   pair_probs == nullptr ? nullptr : pair_probs + row * probs_width, out + (pair * rows + row) * d,
                   scratch.data());
      }
    }
  });
}

}  // namespace kvcomp::cpu
