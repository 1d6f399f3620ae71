// CPU kernel of the paged_attention family: decode attention over a paged cache, whose keys, values and log-weights
// live in a pool of fixed-size blocks and are read through a block table per (batch, kv head).
#include <ATen/Parallel.h>
#include "cpu/attention_rows.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "kernels/attention.h"
#include "kvcomp/paged_attention.h"

namespace kvcomp {
namespace {

using namespace cpu;

std::tuple<at::Tensor, at::Tensor> paged_decode_attention_cpu(const at::Tensor& query, const at::Tensor& key_blocks,
                                                              const at::Tensor& value_blocks,
                                                              const at::Tensor& log_weight_blocks,
                                                              const at::Tensor& block_tables,
                                                              const at::Tensor& lengths, double scale,
                                                              bool return_probs, std::optional<int64_t> max_len) {
  const PagedAttentionShape shape = check_paged_decode_attention(query, key_blocks, value_blocks, log_weight_blocks,
                                                                 block_tables, lengths, scale, max_len);
  at::Tensor out = at::empty(query.sizes(), query.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor probs = at::zeros({shape.batch, shape.query_heads, shape.num_queries, return_probs ? shape.max_len : 0},
                               query.options().dtype(at::kFloat));
  const int64_t pairs = shape.batch * shape.kv_heads;
  if (pairs == 0) return {out, probs};

  const at::Tensor keys_c = key_blocks.contiguous(), values_c = value_blocks.contiguous();
  const at::Tensor log_weights_c = log_weight_blocks.contiguous();
  const at::Tensor tables_c = block_tables.contiguous(), lengths_c = lengths.contiguous();
  const at::Tensor query_f = query.to(at::kFloat).mul(scale).contiguous();  // [B * H, G * q, d], scale folded in
  const int64_t rows = shape.rows(), d = shape.head_dim, block_size = shape.block_size;
  const int64_t probs_width = probs.size(3);

  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::paged_decode_attention", [&] {
    const scalar_t* keys_ptr = keys_c.const_data_ptr<scalar_t>();
    const scalar_t* values_ptr = values_c.const_data_ptr<scalar_t>();
    const float* bias_ptr = log_weights_c.const_data_ptr<float>();
    const int64_t* tables_ptr = tables_c.const_data_ptr<int64_t>();
    const int64_t* lengths_ptr = lengths_c.const_data_ptr<int64_t>();
    const float* query_ptr = query_f.const_data_ptr<float>();
    float* probs_ptr = probs.mutable_data_ptr<float>();
    scalar_t* out_ptr = out.mutable_data_ptr<scalar_t>();

    // One task per (batch, kv head): all G * q rows of the group read each block's keys and values once.
    at::parallel_for(0, pairs, grain_for(rows * std::max<int64_t>(1, shape.max_len) * d), [&](int64_t begin, int64_t end) {
      std::vector<float> scratch, acc(rows * d);
      std::vector<int64_t> slot_count(rows);
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t length = lengths_ptr[pair];
        const int64_t* table = tables_ptr + pair * shape.max_blocks;
        // Logits, then probabilities, of row r at logits + r * stride: in probs when asked for, else in scratch.
        float* logits;
        int64_t stride;
        if (return_probs) {
          logits = probs_ptr + pair * rows * probs_width;
          stride = probs_width;
        } else {
          scratch.resize(rows * length);
          logits = scratch.data();
          stride = length;
        }
        for (int64_t row = 0; row < rows; ++row) {
          // A (b, h) shorter than q (a padded sequence of the batch) leaves its first queries nothing to attend.
          slot_count[row] = kernels::causal_slot_count(row % shape.num_queries, shape.num_queries, length);
        }
        const float* pair_query = query_ptr + pair * rows * d;
        for (int64_t first = 0; first < length; first += block_size) {
          const int64_t block = table[first / block_size];
          slot_logits(pair_query, rows, d, slot_count.data(), keys_ptr + block * block_size * d, d,
                      bias_ptr + block * block_size, first, std::min(block_size, length - first), logits + first,
                      stride);
        }
        for (int64_t row = 0; row < rows; ++row) {
          float* p = logits + row * stride;
          const float inverse = kernels::inverse_sum(exp_in_place(p, length).sum);
          at::vec::map([inverse](FloatVec x) { return x * FloatVec(inverse); }, p, p, length);
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t first = 0; first < length; first += block_size) {
          const int64_t block = table[first / block_size];
          accumulate_block(logits + first, stride, values_ptr + block * block_size * d, d, 0,
                           std::min(block_size, length - first), rows, d, acc.data(), d);
        }
        scalar_t* pair_out = out_ptr + pair * rows * d;
        for (int64_t i = 0; i < rows * d; ++i) pair_out[i] = static_cast<scalar_t>(acc[i]);
      }
    });
  });
  return {out, probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention_cpu); }

}  // namespace kvcomp
