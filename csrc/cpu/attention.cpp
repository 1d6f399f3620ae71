// CPU kernels of the attention family: merge-count log-weights and decode attention over a cache whose slots carry
// log-weights.
#include <ATen/Parallel.h>
#include "cpu/attention_rows.h"
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "kernels/attention.h"
#include "kvcomp/attention.h"

namespace kvcomp {
namespace {

using namespace cpu;
constexpr int64_t kBiasGrain = 1 << 15;  // counts per merge_count_bias task
constexpr int64_t kSlotBlock = 32;       // keys that stay in L1 while every query row of the group reads them

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
  const int64_t total_len = shape.total_len;

  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::decode_attention", [&] {
    const scalar_t* keys_ptr = keys_c.const_data_ptr<scalar_t>();
    const scalar_t* values_ptr = values_c.const_data_ptr<scalar_t>();
    const float* bias_ptr = log_weights_c.const_data_ptr<float>();
    const int64_t key_slot_stride = keys_c.stride(2), value_slot_stride = values_c.stride(2);
    const auto pair_runs = [&](int64_t pair) {
      const int64_t b = pair / shape.kv_heads, h = pair % shape.kv_heads;
      const scalar_t* pair_keys = keys_ptr + b * keys_c.stride(0) + h * keys_c.stride(1);
      const scalar_t* pair_values = values_ptr + b * values_c.stride(0) + h * values_c.stride(1);
      const float* pair_bias = bias_ptr + pair * total_len;
      // Runs of kSlotBlock slots: their keys stay in L1 while every query row of the group reads them.
      return [=](int64_t first, int64_t end) {
        return SlotRun<scalar_t>{pair_keys + first * key_slot_stride, pair_values + first * value_slot_stride,
                                 pair_bias + first, key_slot_stride, value_slot_stride,
                                 std::min(kSlotBlock, end - first)};
      };
    };
    decode_attention_in_chunks(pairs, shape.rows(), shape.num_queries, shape.head_dim,
                               kernels::decode_slot_chunks(pairs, total_len, 1), query_f.const_data_ptr<float>(),
                               [total_len](int64_t) { return total_len; }, pair_runs,
                               probs.mutable_data_ptr<float>(), total_len, out.mutable_data_ptr<scalar_t>());
  });
  return {out, probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CPU, m) {
  m.impl("merge_count_bias", &merge_count_bias_cpu);
  m.impl("decode_attention", &decode_attention_cpu);
}

}  // namespace kvcomp
