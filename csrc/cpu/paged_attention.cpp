// CPU kernel of the paged_attention family: decode attention over a paged cache, whose keys, values and log-weights
// live in a pool of fixed-size blocks and are read through a block table per (batch, kv head).
#include "cpu/attention_rows.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

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
  const int64_t d = shape.head_dim, block_size = shape.block_size;

  KVCOMP_DISPATCH_CACHE_TYPES(query.scalar_type(), "kvcomp::paged_decode_attention", [&] {
    const scalar_t* keys_ptr = keys_c.const_data_ptr<scalar_t>();
    const scalar_t* values_ptr = values_c.const_data_ptr<scalar_t>();
    const float* bias_ptr = log_weights_c.const_data_ptr<float>();
    const int64_t* tables_ptr = tables_c.const_data_ptr<int64_t>();
    const int64_t* lengths_ptr = lengths_c.const_data_ptr<int64_t>();
    const auto pair_runs = [&](int64_t pair) {
      const int64_t* table = tables_ptr + pair * shape.max_blocks;
      // A run is the rest of the block holding `first`: chunks start on block boundaries, so it is the whole block.
      return [=](int64_t first, int64_t end) {
        const int64_t start = kernels::pool_slot(table, first, block_size);
        return SlotRun<scalar_t>{keys_ptr + start * d, values_ptr + start * d, bias_ptr + start, d, d,
                                 std::min(block_size - first % block_size, end - first)};
      };
    };
    decode_attention_in_chunks(pairs, shape.rows(), shape.num_queries, d,
                               kernels::decode_slot_chunks(pairs, shape.max_len, block_size),
                               query_f.const_data_ptr<float>(), [lengths_ptr](int64_t pair) { return lengths_ptr[pair]; },
                               pair_runs, return_probs ? probs.mutable_data_ptr<float>() : nullptr, shape.max_len,
                               out.mutable_data_ptr<scalar_t>());
  });
  return {out, probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention_cpu); }

}  // namespace kvcomp
