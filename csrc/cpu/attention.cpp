// CPU kernels of the attention family: merge-count log-weights and decode attention over a cache whose slots carry
// log-weights.
#include <ATen/Parallel.h>
#include "cpu/vec.h"
#include <ATen/cpu/vec/functional.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "kernels/attention.h"
#include "kvcomp/attention.h"

namespace kvcomp {
namespace {

using FloatVec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = FloatVec::size();
constexpr int64_t kBiasGrain = 1 << 15;      // counts per merge_count_bias task
constexpr int64_t kSlotBlock = 32;           // keys that stay in L1 while every query row of the group reads them
constexpr int64_t kMinChunkSlots = 1024;     // shortest slot chunk worth its own task when B * H < threads

// ---------------------------------------------------------------------------------------------------------------
// merge_count_bias

at::Tensor merge_count_bias_cpu(const at::Tensor& counts, double alpha) {
  check_merge_count_bias(counts, alpha);
  const at::Tensor counts_c = counts.contiguous();
  at::Tensor out = at::empty(counts.sizes(), counts.options());
  const float* in_ptr = counts_c.const_data_ptr<float>();
  float* out_ptr = out.mutable_data_ptr<float>();
  const float alpha_f = static_cast<float>(alpha);
  const FloatVec alpha_v(alpha_f), zero(0.0f), minus_inf(-INFINITY);
  at::parallel_for(0, counts.numel(), kBiasGrain, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    // The vector form of kernels::merge_count_bias (GoogleTest checks the two agree on the special values).
    for (; i + kLanes <= end; i += kLanes) {
      const FloatVec count = FloatVec::loadu(in_ptr + i);
      FloatVec bias = alpha_v * count.log();  // NaN for w < 0 or NaN
      if (alpha_f == 0.0f) bias = FloatVec::blendv(bias, zero, count > zero);
      bias = FloatVec::blendv(bias, minus_inf, count == zero);
      bias.store(out_ptr + i);
    }
    for (; i < end; ++i) out_ptr[i] = kernels::merge_count_bias(in_ptr[i], alpha_f);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// decode_attention

// count (<= kLanes) adjacent cache values as floats, zero-padded.
template <typename scalar_t>
inline FloatVec load_float(const scalar_t* src, int64_t count) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return count == kLanes ? FloatVec::loadu(src) : FloatVec::loadu(src, count);
  } else {
    if (count == kLanes) {
      FloatVec out;
      if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        at::vec::load_fp32_from_bf16(src, out);
      } else {
        at::vec::load_fp32_from_fp16(src, out);
      }
      return out;
    }
    float widened[kLanes] = {};
    for (int64_t i = 0; i < count; ++i) widened[i] = static_cast<float>(src[i]);
    return FloatVec::loadu(widened);
  }
}

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
    const FloatVec k = load_float(key + e, kLanes);
    for (int r = 0; r < kRows; ++r) acc[r] = at::vec::fmadd(FloatVec::loadu(query + r * query_stride + e), k, acc[r]);
  }
  if (e < head_dim) {
    const int64_t count = head_dim - e;
    const FloatVec k = load_float(key + e, count);
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
    at::vec::fmadd(w, load_float(value + e, count), FloatVec::loadu(acc + e, count)).store(acc + e, count);
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
      if (i < vecs) v[i] = load_float(value + i * kLanes, i + 1 < vecs ? kLanes : last);
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

struct DecodeLayout {
  DecodeAttentionShape shape;
  int64_t key_strides[3], value_strides[3];  // batch, head, slot (unit stride over d)
  int64_t chunk_len, num_chunks;
};

// Softmax statistics and unnormalised output of the slots [slot_begin, slot_end) of one (batch, kv-head), for all
// G * q query rows of its group: K and V of the chunk are read from memory once, whatever G * q.
//   query:   [rows, d] float, already multiplied by the scale
//   probs:   [rows, T] float; on return exp(logit - chunk max) over the chunk
//   partial_out: row r at partial_out + r * out_stride, d floats: Σ_s exp(logit_s - chunk max) v_s
//   stats:   row r at stats[r * stats_stride]: the chunk's SoftmaxPartial
template <typename scalar_t>
void attend_chunk(const DecodeLayout& layout, const float* query, const scalar_t* keys, const scalar_t* values,
                  const float* log_weights, float* probs, float* partial_out, int64_t out_stride,
                  kernels::SoftmaxPartial* stats, int64_t stats_stride, int64_t slot_begin, int64_t slot_end) {
  const DecodeAttentionShape& shape = layout.shape;
  const int64_t rows = shape.rows(), d = shape.head_dim, total_len = shape.total_len;
  const int64_t key_slot_stride = layout.key_strides[2], value_slot_stride = layout.value_strides[2];

  // 1. Logits, a block of keys at a time; masked slots (causal or -inf) get -inf without reading their key.
  std::vector<int64_t> slot_count(rows);  // causal limit of each row
  for (int64_t row = 0; row < rows; ++row) {
    slot_count[row] = kernels::causal_slot_count(row % shape.num_queries, shape.num_queries, total_len);
  }
  float dots[4];
  for (int64_t block = slot_begin; block < slot_end; block += kSlotBlock) {
    const int64_t block_end = std::min(slot_end, block + kSlotBlock);
    for (int64_t row = 0; row < rows;) {
      // Up to 4 rows share each key load; a key is read when at least one of them attends to its slot.
      const int64_t group_rows = std::min<int64_t>(4, rows - row);
      const int64_t* count = slot_count.data() + row;
      const int64_t group_count = *std::max_element(count, count + group_rows);
      const float* q = query + row * d;
      for (int64_t slot = block; slot < block_end; ++slot) {
        const float log_weight = log_weights[slot];
        if (kernels::slot_attended(slot, group_count, log_weight)) {
          const scalar_t* key = keys + slot * key_slot_stride;
          switch (group_rows) {
            case 4: dot_rows<4>(q, d, key, d, dots); break;
            case 3: dot_rows<3>(q, d, key, d, dots); break;
            case 2: dot_rows<2>(q, d, key, d, dots); break;
            default: dot_rows<1>(q, d, key, d, dots); break;
          }
        }
        for (int64_t r = 0; r < group_rows; ++r) {
          probs[(row + r) * total_len + slot] =
              kernels::slot_attended(slot, count[r], log_weight) ? dots[r] + log_weight : -INFINITY;
        }
      }
      row += group_rows;
    }
  }

  // 2. Per row: chunk max, exp(logit - max) in place, sum.
  const int64_t len = slot_end - slot_begin;
  for (int64_t row = 0; row < rows; ++row) {
    float* p = probs + row * total_len + slot_begin;
    int64_t i = 0;
    FloatVec max_v(-INFINITY);
    for (; i + kLanes <= len; i += kLanes) max_v = at::vec::maximum(max_v, FloatVec::loadu(p + i));
    float max = reduce_max(max_v);
    for (; i < len; ++i) max = std::fmax(max, p[i]);
    kernels::SoftmaxPartial partial{max, 0.0f};
    if (max == -INFINITY) {
      std::fill(p, p + len, 0.0f);
    } else {
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
    }
    stats[row * stats_stride] = partial;
  }

  // 3. Σ_s p_s v_s for every row, a block of slots at a time (accumulate_block): each value vector is read from
  //    memory once for all rows.
  for (int64_t row = 0; row < rows; ++row) std::fill(partial_out + row * out_stride, partial_out + row * out_stride + d, 0.0f);
  for (int64_t block = slot_begin; block < slot_end; block += kSlotBlock) {
    accumulate_block(probs, total_len, values, value_slot_stride, block, std::min(slot_end, block + kSlotBlock), rows,
                     d, partial_out, out_stride);
  }
}

// Combine the chunk partials of one query row: out = Σ_c f_c partial_c, probs of chunk c *= f_c, with
// f_c = exp(m_c - M) / S (kernels::chunk_normaliser).
template <typename scalar_t>
void finish_row(const DecodeLayout& layout, const float* partial_out, const kernels::SoftmaxPartial* stats,
                float* probs, scalar_t* out, float* scratch) {
  const int64_t d = layout.shape.head_dim, total_len = layout.shape.total_len;
  kernels::SoftmaxPartial total;
  for (int64_t c = 0; c < layout.num_chunks; ++c) total = kernels::combine(total, stats[c]);
  std::fill(scratch, scratch + d, 0.0f);
  for (int64_t c = 0; c < layout.num_chunks; ++c) {
    const float factor = kernels::chunk_normaliser(stats[c].max, total);
    const int64_t begin = c * layout.chunk_len, end = std::min(total_len, begin + layout.chunk_len);
    at::vec::map([factor](FloatVec p) { return p * FloatVec(factor); }, probs + begin, probs + begin, end - begin);
    if (factor != 0.0f) add_weighted(scratch, factor, partial_out + c * d, d);
  }
  for (int64_t e = 0; e < d; ++e) out[e] = static_cast<scalar_t>(scratch[e]);
}

std::tuple<at::Tensor, at::Tensor> decode_attention_cpu(const at::Tensor& query, const at::Tensor& keys,
                                                        const at::Tensor& values, const at::Tensor& log_weights,
                                                        double scale) {
  const DecodeAttentionShape shape = check_decode_attention(query, keys, values, log_weights, scale);
  at::Tensor out = at::empty(query.sizes(), query.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor probs = at::empty({shape.batch, shape.query_heads, shape.num_queries, shape.total_len},
                               query.options().dtype(at::kFloat));
  const int64_t pairs = shape.batch * shape.kv_heads;  // (batch, kv-head) pairs
  if (pairs == 0) return {out, probs};

  // The cache may be a view (e.g. the first T slots of a preallocated buffer): any strides over (B, H, T), as long as
  // d is contiguous; otherwise it is copied.
  const at::Tensor keys_c = keys.stride(3) == 1 ? keys : keys.contiguous();
  const at::Tensor values_c = values.stride(3) == 1 ? values : values.contiguous();
  const at::Tensor log_weights_c = log_weights.contiguous();
  const at::Tensor query_f = query.to(at::kFloat).mul(scale).contiguous();  // [B * H, G * q, d], scale folded in

  DecodeLayout layout{shape, {keys_c.stride(0), keys_c.stride(1), keys_c.stride(2)},
                      {values_c.stride(0), values_c.stride(1), values_c.stride(2)}, shape.total_len, 1};
  // Parallel over (batch, kv-head); when there are fewer pairs than threads, over slot chunks of each pair too
  // (flash-decoding), the chunks' softmax partials being combined afterwards.
  const int64_t threads = at::get_num_threads();
  if (pairs < threads) {
    const int64_t wanted = std::min((threads + pairs - 1) / pairs, std::max<int64_t>(1, shape.total_len / kMinChunkSlots));
    layout.chunk_len = (shape.total_len + wanted - 1) / wanted;
    layout.num_chunks = (shape.total_len + layout.chunk_len - 1) / layout.chunk_len;
  }
  const int64_t rows = shape.rows(), d = shape.head_dim, chunks = layout.num_chunks;
  // [B * H, rows, chunks, d] unnormalised chunk outputs and [B * H, rows, chunks] chunk statistics.
  std::vector<float> partial_out(pairs * rows * chunks * d);
  std::vector<kernels::SoftmaxPartial> stats(pairs * rows * chunks);

  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::decode_attention", [&] {
    const scalar_t* keys_ptr = keys_c.const_data_ptr<scalar_t>();
    const scalar_t* values_ptr = values_c.const_data_ptr<scalar_t>();
    const float* query_ptr = query_f.const_data_ptr<float>();
    const float* bias_ptr = log_weights_c.const_data_ptr<float>();
    float* probs_ptr = probs.mutable_data_ptr<float>();
    scalar_t* out_ptr = out.mutable_data_ptr<scalar_t>();

    const auto pair_offsets = [&](int64_t pair, int64_t& key_offset, int64_t& value_offset) {
      const int64_t b = pair / shape.kv_heads, h = pair % shape.kv_heads;
      key_offset = b * layout.key_strides[0] + h * layout.key_strides[1];
      value_offset = b * layout.value_strides[0] + h * layout.value_strides[1];
    };
    at::parallel_for(0, pairs * chunks, 1, [&](int64_t task_begin, int64_t task_end) {
      std::vector<float> scratch(d);
      for (int64_t task = task_begin; task < task_end; ++task) {
        const int64_t pair = task / chunks, chunk = task % chunks;
        int64_t key_offset, value_offset;
        pair_offsets(pair, key_offset, value_offset);
        const int64_t slot_begin = chunk * layout.chunk_len;
        const int64_t slot_end = std::min(shape.total_len, slot_begin + layout.chunk_len);
        float* pair_probs = probs_ptr + pair * rows * shape.total_len;
        float* pair_partial = partial_out.data() + (pair * rows * chunks + chunk) * d;
        kernels::SoftmaxPartial* pair_stats = stats.data() + pair * rows * chunks + chunk;
        attend_chunk(layout, query_ptr + pair * rows * d, keys_ptr + key_offset, values_ptr + value_offset,
                     bias_ptr + pair * shape.total_len, pair_probs, pair_partial, chunks * d, pair_stats, chunks,
                     slot_begin, slot_end);
        if (chunks == 1) {  // the whole row is here: normalise without a second pass over the tasks
          for (int64_t row = 0; row < rows; ++row) {
            finish_row(layout, pair_partial + row * d, pair_stats + row, pair_probs + row * shape.total_len,
                       out_ptr + (pair * rows + row) * d, scratch.data());
          }
        }
      }
    });
    if (chunks > 1) {
      at::parallel_for(0, pairs * rows, 1, [&](int64_t row_begin, int64_t row_end) {
        std::vector<float> scratch(d);
        for (int64_t row = row_begin; row < row_end; ++row) {
          finish_row(layout, partial_out.data() + row * chunks * d, stats.data() + row * chunks,
                     probs_ptr + row * shape.total_len, out_ptr + row * d, scratch.data());
        }
      });
    }
  });
  return {out, probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CPU, m) {
  m.impl("merge_count_bias", &merge_count_bias_cpu);
  m.impl("decode_attention", &decode_attention_cpu);
}

}  // namespace kvcomp
