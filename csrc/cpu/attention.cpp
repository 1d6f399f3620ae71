// CPU kernels of the attention family: merge-count log-weights and decode attention over a cache whose slots carry
// log-weights.
#include <ATen/Parallel.h>
#include "cpu/attention_rows.h"
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

using namespace cpu;
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
    // The vector form of kernels::merge_count_bias (GoogleTest checks the two agree on the special values), the
    // range's tail included (a partial vector): the vector log and the scalar logf may round apart, and the threads'
    // ranges end wherever the thread count puts them.
    for (int64_t i = begin; i < end; i += kLanes) {
      const int64_t lanes = std::min<int64_t>(kLanes, end - i);
      const FloatVec count = FloatVec::loadu(in_ptr + i, lanes);
      FloatVec bias = alpha_v * count.log();  // NaN for w < 0 or NaN
      if (alpha_f == 0.0f) bias = FloatVec::blendv(bias, zero, count > zero);
      bias = FloatVec::blendv(bias, minus_inf, count == zero);
      bias.store(out_ptr + i, lanes);
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// decode_attention

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
  for (int64_t block = slot_begin; block < slot_end; block += kSlotBlock) {
    slot_logits(query, rows, d, slot_count.data(), keys + block * key_slot_stride, key_slot_stride,
                log_weights + block, block, std::min(slot_end, block + kSlotBlock) - block, probs + block, total_len);
  }

  // 2. Per row: chunk max, exp(logit - max) in place, sum.
  for (int64_t row = 0; row < rows; ++row) {
    stats[row * stats_stride] = exp_in_place(probs + row * total_len + slot_begin, slot_end - slot_begin);
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
