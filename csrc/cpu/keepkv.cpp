// CPU kernels of the keepkv family. One task per (batch, kv-head) row: the row's evicted and retained slots are
// listed in C++, so there is no ATen launch per decoding step.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // see cpu/zsmerge.cpp (_mm512_cvtph_ps false positive)
#endif
#include <ATen/Parallel.h>
#include "cpu/vec.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/keepkv.h"
#include "kvcomp/dispatch.h"
#include "kvcomp/keepkv.h"

namespace kvcomp {
namespace {

using cpu::FloatVec;
using cpu::grain_for;
using cpu::load_as_float;
using cpu::store_from_float;

// Rows with at most this many evicted slots compute their cosines directly (a decoding step evicts one); more go
// through at::mm on normalised keys, kMatchChunkElements similarities at a time.
constexpr int64_t kDirectMaxEvicted = 8;
constexpr int64_t kMatchChunkElements = 1 << 20;

float horizontal_sum(const FloatVec& v) {
  float lanes[FloatVec::size()];
  v.store(lanes);
  float total = 0.0f;
  for (const float lane : lanes) total += lane;
  return total;
}

// a·b and ||b||^2 in one pass, float32.
template <typename scalar_t>
void dot_and_norm(const float* a, const scalar_t* b, int64_t head_dim, float& dot, float& norm_sq_b) {
  FloatVec d(0.0f), n(0.0f);
  for (int64_t c = 0; c < head_dim; c += FloatVec::size()) {
    const int64_t lanes = std::min<int64_t>(FloatVec::size(), head_dim - c);
    const FloatVec x = load_as_float(b + c, lanes);
    d = at::vec::fmadd(FloatVec::loadu(a + c, lanes), x, d);
    n = at::vec::fmadd(x, x, n);
  }
  dot = horizontal_sum(d);
  norm_sq_b = horizontal_sum(n);
}

// row (float32, scaled by `scale`) of a key.
template <typename scalar_t>
float load_row(const scalar_t* key, int64_t head_dim, float* out) {
  FloatVec n(0.0f);
  for (int64_t c = 0; c < head_dim; c += FloatVec::size()) {
    const int64_t lanes = std::min<int64_t>(FloatVec::size(), head_dim - c);
    const FloatVec x = load_as_float(key + c, lanes);
    x.store(out + c, lanes);
    n = at::vec::fmadd(x, x, n);
  }
  return horizontal_sum(n);
}

// ||x||^2 of a float32 row, after rescaling it in place by kernels::key_rescale when its squares overflowed or
// underflowed (the cosines it enters do not change). A zero key takes the slow check too, and stays 0.
float rescaled_norm_sq(float* row, int64_t head_dim, float norm_sq) {
  if (kernels::norm_sq_is_safe(norm_sq)) return norm_sq;
  float max_abs = 0.0f;
  for (int64_t c = 0; c < head_dim; ++c) max_abs = kernels::max_magnitude(max_abs, row[c]);
  const float scale = kernels::key_scale(norm_sq, max_abs);
  float rescaled = 0.0f;
  for (int64_t c = 0; c < head_dim; ++c) {
    row[c] *= scale;
    rescaled += row[c] * row[c];
  }
  return rescaled;
}

// The rounded cosine of a loaded (and rescaled) evicted row with a retained key whose float32 squares went out of
// the safe range: the retained key is loaded and rescaled too. Rare (keys beyond 2^50 or below 2^-50).
template <typename scalar_t>
float rescaled_cosine(const float* evicted_row, float norm_sq_e, const scalar_t* key, int64_t head_dim,
                      float* retained_row) {
  const float norm_sq_r = rescaled_norm_sq(retained_row, head_dim, load_row(key, head_dim, retained_row));
  float dot = 0.0f;
  for (int64_t c = 0; c < head_dim; ++c) dot += evicted_row[c] * retained_row[c];
  return kernels::cosine_similarity(dot, norm_sq_e, norm_sq_r);
}

template <typename scalar_t>
void match_one_row(const scalar_t* keys, const bool* keep, int64_t slots, int64_t head_dim, float threshold,
                   int64_t* targets, std::vector<int64_t>& evicted, std::vector<int64_t>& retained,
                   std::vector<float>& scratch) {
  evicted.clear();
  retained.clear();
  for (int64_t t = 0; t < slots; ++t) {
    targets[t] = keep[t] ? kernels::kKeepKVRetained : kernels::kKeepKVEvictedNoMerge;
    (keep[t] ? retained : evicted).push_back(t);
  }
  const int64_t num_evicted = static_cast<int64_t>(evicted.size()), num_retained = static_cast<int64_t>(retained.size());
  if (num_evicted == 0 || num_retained == 0) return;
  if (num_evicted <= kDirectMaxEvicted) {
    scratch.resize(2 * head_dim);
    float* evicted_row = scratch.data();
    for (const int64_t e : evicted) {
      const float norm_sq_e =
          rescaled_norm_sq(evicted_row, head_dim, load_row(keys + e * head_dim, head_dim, evicted_row));
      kernels::SlotChoice best = kernels::MergesFirst::none();
      for (const int64_t r : retained) {  // ascending: ties keep the lower slot
        float dot, norm_sq_r;
        dot_and_norm(evicted_row, keys + r * head_dim, head_dim, dot, norm_sq_r);
        const float similarity =
            kernels::norm_sq_is_safe(norm_sq_r)
                ? kernels::cosine_similarity(dot, norm_sq_e, norm_sq_r)
                : rescaled_cosine(evicted_row, norm_sq_e, keys + r * head_dim, head_dim, evicted_row + head_dim);
        const kernels::SlotChoice candidate{similarity, r};
        if (kernels::MergesFirst{}(candidate, best)) best = candidate;
      }
      targets[e] = kernels::match_target(best, threshold);
    }
    return;
  }
  // GEMM path: normalised retained keys (R, d) once, evicted keys in chunks (C, d), similarities (C, R) by at::mm.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(num_evicted, kMatchChunkElements / num_retained));
  scratch.resize((num_retained + chunk) * head_dim + chunk * num_retained);
  float* retained_rows = scratch.data();
  float* evicted_rows = retained_rows + num_retained * head_dim;
  float* similarities = evicted_rows + chunk * head_dim;
  const auto normalise = [&](int64_t slot, float* out) {
    const float norm_sq = rescaled_norm_sq(out, head_dim, load_row(keys + slot * head_dim, head_dim, out));
    const float inverse = kernels::inverse_norm(norm_sq);
    for (int64_t c = 0; c < head_dim; ++c) out[c] *= inverse;
  };
  for (int64_t r = 0; r < num_retained; ++r) normalise(retained[r], retained_rows + r * head_dim);
  const auto options = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor retained_t = at::from_blob(retained_rows, {num_retained, head_dim}, options);
  for (int64_t begin = 0; begin < num_evicted; begin += chunk) {
    const int64_t count = std::min(chunk, num_evicted - begin);
    for (int64_t k = 0; k < count; ++k) normalise(evicted[begin + k], evicted_rows + k * head_dim);
    at::Tensor out = at::from_blob(similarities, {count, num_retained}, options);
    at::mm_out(out, at::from_blob(evicted_rows, {count, head_dim}, options), retained_t.t());
    for (int64_t k = 0; k < count; ++k) {  // the fused masked argmax of one evicted slot
      const float* row = similarities + k * num_retained;
      kernels::SlotChoice best = kernels::MergesFirst::none();
      for (int64_t r = 0; r < num_retained; ++r) {
        const kernels::SlotChoice candidate{kernels::rounded_cosine(row[r]), retained[r]};
        if (kernels::MergesFirst{}(candidate, best)) best = candidate;
      }
      targets[evicted[begin + k]] = kernels::match_target(best, threshold);
    }
  }
}

at::Tensor keepkv_match_cpu(const at::Tensor& keys, const at::Tensor& keep, double threshold,
                            std::optional<int64_t> max_evicted) {  // a bound for CUDA; the CPU needs none
  const KeepKVShape shape = check_keepkv_match(keys, keep, threshold, max_evicted);
  const at::Tensor keys_c = keys.contiguous();
  const at::Tensor keep_c = keep.contiguous();
  at::Tensor targets = at::empty({shape.batch, shape.kv_heads, shape.slots}, keep.options().dtype(at::kLong));
  KVCOMP_DISPATCH_CACHE_TYPES(keys.scalar_type(), "kvcomp::keepkv_match", [&] {
    const scalar_t* keys_ptr = keys_c.const_data_ptr<scalar_t>();
    const bool* keep_ptr = keep_c.const_data_ptr<bool>();
    int64_t* targets_ptr = targets.mutable_data_ptr<int64_t>();
    const int64_t slots = shape.slots, head_dim = shape.head_dim;
    at::parallel_for(0, shape.rows(), grain_for(slots * head_dim), [&](int64_t begin, int64_t end) {
      std::vector<int64_t> evicted, retained;
      std::vector<float> scratch;
      for (int64_t row = begin; row < end; ++row) {
        match_one_row(keys_ptr + row * slots * head_dim, keep_ptr + row * slots, slots, head_dim,
                      static_cast<float>(threshold), targets_ptr + row * slots, evicted, retained, scratch);
      }
    });
  });
  return targets;
}

// ---------------------------------------------------------------------------------------------------------------
// keepkv_zip_merge

// acc += w * row (float32).
template <typename scalar_t>
void accumulate_row(const scalar_t* row, float w, int64_t head_dim, float* acc) {
  const FloatVec weight(w);
  for (int64_t c = 0; c < head_dim; c += FloatVec::size()) {
    const int64_t lanes = std::min<int64_t>(FloatVec::size(), head_dim - c);
    at::vec::fmadd(load_as_float(row + c, lanes), weight, FloatVec::loadu(acc + c, lanes)).store(acc + c, lanes);
  }
}

template <typename scalar_t>
void store_scaled(const float* acc, float scale, int64_t head_dim, scalar_t* out) {
  const FloatVec s(scale);
  for (int64_t c = 0; c < head_dim; c += FloatVec::size()) {
    const int64_t lanes = std::min<int64_t>(FloatVec::size(), head_dim - c);
    store_from_float(FloatVec::loadu(acc + c, lanes) * s, out + c, lanes);
  }
}

template <typename scalar_t>
void zip_one_row(const scalar_t* keys, const scalar_t* values, const float* votes, const float* log_scores,
                 const int64_t* targets, int64_t slots, int64_t head_dim, bool convex, int64_t row, int64_t kv_heads,
                 scalar_t* out_keys, scalar_t* out_values, float* out_votes,
                 std::vector<std::pair<int64_t, int64_t>>& pairs, std::vector<float>& acc) {
  pairs.clear();
  for (int64_t e = 0; e < slots; ++e) {
    const int64_t t = targets[e];
    if (t == kernels::kKeepKVRetained || t == kernels::kKeepKVEvictedNoMerge) continue;
    if (t < 0 || t >= slots || targets[t] != kernels::kKeepKVRetained) {
      fail_keepkv_target(slots, row / kv_heads, row % kv_heads, e, t);
    }
    pairs.emplace_back(t, e);
  }
  std::sort(pairs.begin(), pairs.end());  // grouped by target, members ascending
  acc.resize(2 * head_dim);
  float* key_acc = acc.data();
  float* value_acc = key_acc + head_dim;
  for (size_t begin = 0; begin < pairs.size();) {
    const int64_t c = pairs[begin].first;
    size_t end = begin;
    while (end < pairs.size() && pairs[end].first == c) ++end;
    float max_log = kernels::zip_max_log(-kernels::infinity(), votes[c], log_scores[c]);
    for (size_t k = begin; k < end; ++k) {
      const int64_t e = pairs[k].second;
      max_log = kernels::zip_max_log(max_log, votes[e], log_scores[e]);
    }
    kernels::ZipSums sums;
    sums.add(votes[c], log_scores[c], max_log);
    for (size_t k = begin; k < end; ++k) sums.add(votes[pairs[k].second], log_scores[pairs[k].second], max_log);
    const kernels::ZipCoefficients coefficients = kernels::zip_coefficients(max_log, sums, convex);
    out_votes[c] = sums.votes;
    if (coefficients.merged) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      const auto add = [&](int64_t slot) {
        const float w = kernels::zip_weight(votes[slot], log_scores[slot], max_log);
        if (w > 0.0f) {
          accumulate_row(keys + slot * head_dim, w, head_dim, key_acc);
          accumulate_row(values + slot * head_dim, w, head_dim, value_acc);
        }
      };
      add(c);
      for (size_t k = begin; k < end; ++k) add(pairs[k].second);
      store_scaled(key_acc, coefficients.key_scale, head_dim, out_keys + c * head_dim);
      store_scaled(value_acc, coefficients.value_scale, head_dim, out_values + c * head_dim);
    }
    begin = end;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> keepkv_zip_merge_cpu(const at::Tensor& keys, const at::Tensor& values,
                                                                    const at::Tensor& votes,
                                                                    const at::Tensor& log_scores,
                                                                    const at::Tensor& targets, bool convex,
                                                                    bool /*check_targets: the CPU checks for free*/) {
  const KeepKVShape shape = check_keepkv_zip_merge(keys, values, votes, log_scores, targets);
  // The outputs start as copies (evicted and unmerged slots keep their inputs); merged slots are overwritten.
  at::Tensor out_keys = keys.contiguous().clone();
  at::Tensor out_values = values.contiguous().clone();
  at::Tensor out_votes = votes.contiguous().clone();
  const at::Tensor log_scores_c = log_scores.contiguous();
  const at::Tensor targets_c = targets.contiguous();
  KVCOMP_DISPATCH_CACHE_TYPES(keys.scalar_type(), "kvcomp::keepkv_zip_merge", [&] {
    scalar_t* keys_ptr = out_keys.mutable_data_ptr<scalar_t>();
    scalar_t* values_ptr = out_values.mutable_data_ptr<scalar_t>();
    float* votes_ptr = out_votes.mutable_data_ptr<float>();
    const float* log_ptr = log_scores_c.const_data_ptr<float>();
    const int64_t* targets_ptr = targets_c.const_data_ptr<int64_t>();
    const int64_t slots = shape.slots, head_dim = shape.head_dim;
    at::parallel_for(0, shape.rows(), grain_for(slots * 8), [&](int64_t begin, int64_t end) {
      std::vector<std::pair<int64_t, int64_t>> pairs;
      std::vector<float> acc;
      std::vector<float> votes_in;
      for (int64_t row = begin; row < end; ++row) {
        // Sums read the input votes, the outputs are written in place of the copies: keep the inputs apart.
        float* row_votes = votes_ptr + row * slots;
        votes_in.assign(row_votes, row_votes + slots);
        // Keys and values: a merged row c is written after all its members were read, and a member is an evicted
        // slot (never written), so reading the copies is reading the inputs.
        zip_one_row(keys_ptr + row * slots * head_dim, values_ptr + row * slots * head_dim, votes_in.data(),
                    log_ptr + row * slots, targets_ptr + row * slots, slots, head_dim, convex, row, shape.kv_heads,
                    keys_ptr + row * slots * head_dim, values_ptr + row * slots * head_dim, row_votes, pairs, acc);
      }
    });
  });
  return {out_keys, out_values, out_votes};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CPU, m) {
  m.impl("keepkv_match", &keepkv_match_cpu);
  m.impl("keepkv_zip_merge", &keepkv_zip_merge_cpu);
}

}  // namespace kvcomp
