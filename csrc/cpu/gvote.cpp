// CPU kernels of the gvote family: nucleus budget (partition + sort per row), averaged RoPE (one pass), and the union
// of the samples' top-k keys (chunked float32 GEMM, nth_element per row, OR over the rows of each kv head).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include "cpu/vec.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "kernels/gvote.h"
#include "kvcomp/dispatch.h"
#include "kvcomp/gvote.h"

namespace kvcomp {
namespace {

namespace g = kernels::gvote;

at::Tensor nucleus_budget_cpu(const at::Tensor& probs, double p) {
  const NucleusBudgetShape shape = check_nucleus_budget(probs, p);
  const at::Tensor probs_c = probs.contiguous();
  at::Tensor budgets = at::empty({shape.batch, shape.query_heads}, probs_c.options().dtype(at::kLong));
  if (shape.rows() == 0) return budgets;
  const float* probs_ptr = probs_c.const_data_ptr<float>();
  int64_t* budgets_ptr = budgets.mutable_data_ptr<int64_t>();
  const int64_t len = shape.len;
  at::parallel_for(0, shape.rows(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> masses;
    for (int64_t row = begin; row < end; ++row) {
      // Only the positive masses matter: the zeros (and NaN, negatives) neither change the sums nor come first.
      masses.clear();
      for (int64_t t = 0; t < len; ++t) {
        const float mass = g::nucleus_mass(probs_ptr[row * len + t]);
        if (mass > 0.0f) masses.push_back(mass);
      }
      std::sort(masses.begin(), masses.end(), std::greater<float>());
      const int64_t positive = static_cast<int64_t>(masses.size());
      budgets_ptr[row] = len == 0 ? 0 : (positive == 0 ? 1 : g::nucleus_count_sorted(masses.data(), positive, p));
    }
  });
  return budgets;
}

at::Tensor averaged_rope_cpu(const at::Tensor& queries, const at::Tensor& cos, const at::Tensor& sin) {
  const AveragedRopeShape shape = check_averaged_rope(queries, cos, sin);
  const at::Tensor queries_c = queries.contiguous();
  at::Tensor out = at::empty_like(queries_c);
  if (shape.rows == 0) return out;
  const at::Tensor tables = averaged_rope_tables(cos, sin);  // (2, d) float32
  const float* mean_cos = tables.const_data_ptr<float>();
  const float* mean_sin = mean_cos + shape.dim;
  const int64_t dim = shape.dim;
  KVCOMP_DISPATCH_CACHE_TYPES(queries.scalar_type(), "kvcomp::averaged_rope", [&] {
    const scalar_t* q_ptr = queries_c.const_data_ptr<scalar_t>();
    scalar_t* out_ptr = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, shape.rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const scalar_t* q = q_ptr + row * dim;
        for (int64_t c = 0; c < dim; ++c) {
          const g::RotateHalfSource source = g::rotate_half_source(c, dim);
          out_ptr[row * dim + c] = static_cast<scalar_t>(g::averaged_rope_channel(
              static_cast<float>(q[c]), static_cast<float>(q[source.index]), source.sign, mean_cos[c], mean_sin[c]));
        }
      }
    });
  });
  return out;
}

at::Tensor gvote_union_mask_cpu(const at::Tensor& keys, const at::Tensor& queries, const at::Tensor& budgets,
                                int64_t sinks, double scale, int64_t chunk_size) {
  const GVoteUnionShape shape = check_gvote_union_mask(keys, queries, budgets, sinks, scale, chunk_size);
  at::Tensor mask = at::zeros({shape.batch, shape.kv_heads, shape.len}, keys.options().dtype(at::kBool));
  const int64_t len = shape.len;
  if (sinks > 0 && len > 0) mask.narrow(2, 0, std::min(sinks, len)).fill_(true);
  const at::Tensor budgets_c = budgets.contiguous();
  const int64_t* budgets_ptr = budgets_c.const_data_ptr<int64_t>();
  bool* mask_ptr = mask.mutable_data_ptr<bool>();
  const int64_t samples = shape.samples, per_head = shape.rows_per_kv_head();
  const float scale_f = static_cast<float>(scale);

  std::vector<uint64_t> thresholds;
  std::vector<int64_t> budget_of;
  for_each_logit_chunk(keys, queries, shape, chunk_size, [&](const at::Tensor& logits, int64_t first_row) {
    const int64_t rows = logits.size(0);
    const float* logits_ptr = logits.const_data_ptr<float>();
    const auto key = [&](int64_t row, int64_t slot) {
      return g::selection_key(logits_ptr[row * len + slot] * scale_f, static_cast<uint32_t>(slot));
    };
    // 1. Per row: the k-th smallest selection key (k = the row's query head's budget, clamped to [0, T]).
    thresholds.assign(rows, 0);
    budget_of.assign(rows, 0);
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint64_t> row_keys;
      for (int64_t row = begin; row < end; ++row) {
        const int64_t k = g::clamp_budget(budgets_ptr[(first_row + row) / samples], len);
        budget_of[row] = k;
        if (k == 0 || k == len) continue;
        row_keys.resize(len);
        for (int64_t slot = 0; slot < len; ++slot) row_keys[slot] = key(row, slot);
        std::nth_element(row_keys.begin(), row_keys.begin() + (k - 1), row_keys.end());
        thresholds[row] = row_keys[k - 1];
      }
    });
    // 2. OR each row's top-k into its kv head's mask; threads own slot ranges, so no two write the same byte.
    at::parallel_for(0, len, 2048, [&](int64_t begin, int64_t end) {
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t k = budget_of[row];
        if (k == 0) continue;
        bool* head_mask = mask_ptr + ((first_row + row) / per_head) * len;
        if (k == len) {
          std::fill(head_mask + begin, head_mask + end, true);
          continue;
        }
        const uint64_t threshold = thresholds[row];
        for (int64_t slot = begin; slot < end; ++slot) {
          if (key(row, slot) <= threshold) head_mask[slot] = true;
        }
      }
    });
  });
  return mask;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CPU, m) {
  m.impl("nucleus_budget", &nucleus_budget_cpu);
  m.impl("averaged_rope", &averaged_rope_cpu);
  m.impl("gvote_union_mask", &gvote_union_mask_cpu);
}

}  // namespace kvcomp
