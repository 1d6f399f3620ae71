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
#include <cfloat>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/keepkv.h"
#include "kvcomp/dispatch.h"
#include "kvcomp/keepkv.h"

namespace kvcomp {
namespace {

using cpu::FloatVec;
using cpu::first_argmax;
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

// a·b and ||b||^2 in one pass, float32, as vectors of lane partial sums.
template <typename scalar_t>
void dot_and_norm_lanes(const float* a, const scalar_t* b, int64_t head_dim, FloatVec& dot, FloatVec& norm_sq_b) {
  dot = norm_sq_b = FloatVec(0.0f);
  for (int64_t c = 0; c < head_dim; c += FloatVec::size()) {
    const int64_t lanes = std::min<int64_t>(FloatVec::size(), head_dim - c);
    const FloatVec x = load_as_float(b + c, lanes);
    dot = at::vec::fmadd(FloatVec::loadu(a + c, lanes), x, dot);
    norm_sq_b = at::vec::fmadd(x, x, norm_sq_b);
  }
}

// a·b and ||b||^2 in one pass, float32.
template <typename scalar_t>
void dot_and_norm(const float* a, const scalar_t* b, int64_t head_dim, float& dot, float& norm_sq_b) {
  FloatVec d, n;
  dot_and_norm_lanes(a, b, head_dim, d, n);
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

// dot_and_norm of one row `a` with up to FloatVec::size() keys: the per-key lane sums come from one transpose of the
// accumulators and a vector sum over lanes in the same order as horizontal_sum (so the same bits), instead of two
// scalar reductions per key.
template <typename scalar_t>
void dots_and_norms(const float* a, const scalar_t* keys, const int64_t* slots, int64_t count, int64_t head_dim,
                    float* dots, float* norms_sq) {
  constexpr int lanes = FloatVec::size();
  alignas(64) float dot_lanes[lanes * lanes] = {}, norm_lanes[lanes * lanes] = {};
  alignas(64) float by_lane[lanes * lanes];
  for (int64_t k = 0; k < count; ++k) {
    FloatVec d, n;
    dot_and_norm_lanes(a, keys + slots[k] * head_dim, head_dim, d, n);
    d.store(dot_lanes + k * lanes);
    n.store(norm_lanes + k * lanes);
  }
  for (auto [accumulators, out] : {std::pair{dot_lanes, dots}, std::pair{norm_lanes, norms_sq}}) {
    at::vec::transpose_mxn<float, lanes, lanes>(accumulators, lanes, by_lane, lanes);
    FloatVec sum(0.0f);
    for (int j = 0; j < lanes; ++j) sum = sum + FloatVec::loadu(by_lane + j * lanes);
    sum.store(out, count);
  }
}

// kernels::cosine_similarity of one key (||a||^2 = norm_sq_a) with `count` <= FloatVec::size() keys, lane by lane:
// the same correctly rounded float operations (square roots, product, quotient, clamp, rounding to the grid), so the
// same bits, without a square root and a division in series per slot.
void cosine_similarities(const float* dots, float norm_sq_a, const float* norms_sq_b, int64_t count, float* out) {
  if (norm_sq_a == 0.0f) {
    std::fill_n(out, count, 0.0f);
    return;
  }
  const FloatVec norm_sq_b = FloatVec::loadu(norms_sq_b, count);
  const FloatVec cosine = FloatVec::loadu(dots, count) / (FloatVec(sqrtf(norm_sq_a)) * norm_sq_b.sqrt());
  const FloatVec clamped = at::vec::clamp(cosine, FloatVec(-1.0f), FloatVec(1.0f));
  const FloatVec resolution(kernels::kCosineResolution);
  FloatVec rounded = (clamped / resolution).round() * resolution;
  rounded = FloatVec::blendv(rounded, cosine, cosine != cosine);  // NaN stays NaN
  const FloatVec zero(0.0f);
  FloatVec::blendv(rounded, zero, norm_sq_b == zero).store(out, count);
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
      constexpr int64_t lanes = FloatVec::size();
      float dots[lanes], norms_sq[lanes], similarities[lanes];
      for (int64_t i = 0; i < num_retained; i += lanes) {  // ascending: ties keep the lower slot
        const int64_t count = std::min(lanes, num_retained - i);
        dots_and_norms(evicted_row, keys, retained.data() + i, count, head_dim, dots, norms_sq);
        cosine_similarities(dots, norm_sq_e, norms_sq, count, similarities);
        for (int64_t k = 0; k < count; ++k) {
          const int64_t r = retained[i + k];
          const float similarity =
              kernels::norm_sq_is_safe(norms_sq[k])
                  ? similarities[k]
                  : rescaled_cosine(evicted_row, norm_sq_e, keys + r * head_dim, head_dim, evicted_row + head_dim);
          const kernels::SlotChoice candidate{similarity, r};
          if (kernels::MergesFirst{}(candidate, best)) best = candidate;
        }
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
                 std::vector<std::pair<int64_t, int64_t>>& pairs, std::vector<float>& acc,
                 const int64_t* destination = nullptr) {  // the output row of each retained slot (identity if null)
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
    const int64_t out = destination != nullptr ? destination[c] : c;
    out_votes[out] = sums.votes;
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
      store_scaled(key_acc, coefficients.key_scale, head_dim, out_keys + out * head_dim);
      store_scaled(value_acc, coefficients.value_scale, head_dim, out_values + out * head_dim);
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

// ---------------------------------------------------------------------------------------------------------------
// keepkv_decode_step

struct StepScalars {
  float scale, log_decay, log_fold_weight;  // q·k scale, ln β, ln(1 - β)
  int64_t budget, sinks, recent;
  float threshold;
  bool convex;
};

// Per-thread buffers of one row's step.
struct StepScratch {
  std::vector<float> log_normalisers, group_factors, log_mean, sums, log_ema, age, votes, merged_votes, log_estimate,
      eviction_key, scratch, acc;
  std::vector<int64_t> order, targets, evicted, retained, destination;
  std::vector<std::pair<int64_t, int64_t>> pairs;
  std::unique_ptr<bool[]> keep;
  int64_t keep_size = 0;
};

// ln(e^a + e^b) lane by lane: -inf where both are -inf.
FloatVec log_add_exp(const FloatVec& a, const FloatVec& b) {
  const FloatVec high = at::vec::maximum(a, b), low = at::vec::minimum(a, b);
  const FloatVec sum = high + (low - high).exp().log1p();
  return FloatVec::blendv(sum, high, high == FloatVec(-kernels::infinity()));
}

// ln(1 - e^x) lane by lane for x <= 0 (kernels::log_one_minus_exp).
FloatVec log_one_minus_exp(const FloatVec& x) {
  const FloatVec near_zero = (FloatVec(0.0f) - x.expm1()).log(), far = (FloatVec(0.0f) - x.exp()).log1p();
  return FloatVec::blendv(far, near_zero, x > FloatVec(-0.69314718f));
}

// KeepKV's attention bias ln p of `count` votes (α = 1: -inf for p = 0).
void log_votes(const float* votes, int64_t count, float* out) {
  for (int64_t t = 0; t < count; t += FloatVec::size()) {
    const int64_t lanes = std::min<int64_t>(FloatVec::size(), count - t);
    FloatVec::loadu(votes + t, lanes).log().store(out + t, lanes);
  }
}

// ln of the softmax normaliser of every (g, j) query row of one kv head, from its slot of largest probability:
// LSE = q·k·scale + b - ln p there (one dot product a row), so that ℓ = ln p - b + LSE for every slot.
template <typename scalar_t>
void log_normalisers_of_row(const scalar_t* keys, const scalar_t* queries, const float* probabilities,
                            const float* log_weights, int64_t group, int64_t new_tokens, int64_t slots,
                            int64_t head_dim, int64_t query_head_stride, float scale, float* out,
                            std::vector<float>& query) {
  query.resize(head_dim);
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t j = 0; j < new_tokens; ++j) {
      const float* p = probabilities + (g * new_tokens + j) * slots;
      const int64_t top = first_argmax(p, slots);
      load_row(queries + g * query_head_stride + j * head_dim, head_dim, query.data());
      float dot, unused_norm;
      dot_and_norm(query.data(), keys + top * head_dim, head_dim, dot, unused_norm);
      out[g * new_tokens + j] = dot * scale + log_weights[top] - logf(p[top]);
    }
  }
}

// keys and values are updated in place: their first min(T, budget) slots become the retained ones, merged.
template <typename scalar_t>
void decode_step_one_row(scalar_t* keys, scalar_t* values, const scalar_t* queries,
                         const float* probabilities, const float* log_weights, const float* log_ema_in,
                         const float* age_in, const float* votes_in, int64_t group, int64_t new_tokens,
                         int64_t slots, int64_t head_dim, int64_t query_head_stride, const StepScalars& scalars,
                         int64_t row, int64_t kv_heads, float* out_log_ema, float* out_age, float* out_votes, float* out_log_weights,
                         float* out_dropped, StepScratch& w) {
  const int64_t old_slots = slots - new_tokens;
  // EMA fold of the q queries in order (query j weighted (1-β) β^(q-1-j)), each slot's age grown by the queries that
  // see it (the new tokens are the last q slots: slot t is seen by min(q, T - t)).
  w.log_normalisers.resize(group * new_tokens);
  log_normalisers_of_row(keys, queries, probabilities, log_weights, group, new_tokens, slots, head_dim,
                         query_head_stride, scalars.scale, w.log_normalisers.data(), w.scratch);
  w.log_ema.resize(slots);
  w.age.resize(slots);
  w.votes.resize(slots);
  // s̄ = (1/G) Σ_g p_g exp(LSE_g - b): with the query's largest LSE factored out, one weighted sum and one log a
  // slot, vectorised over the slots. A sum below FLT_MIN (every term underflowed, or none: p = 0) is redone in the
  // log domain.
  w.group_factors.resize(group);
  w.log_mean.resize(slots);
  w.sums.resize(slots);
  const float log_group = logf(static_cast<float>(group));
  for (int64_t j = 0; j < new_tokens; ++j) {
    const float* normalisers = w.log_normalisers.data() + j;  // stride new_tokens over g
    float shift = -kernels::infinity();
    for (int64_t g = 0; g < group; ++g) shift = std::max(shift, normalisers[g * new_tokens]);
    for (int64_t g = 0; g < group; ++g) w.group_factors[g] = expf(normalisers[g * new_tokens] - shift);
    const float weight = scalars.log_fold_weight + scalars.log_decay * static_cast<float>(new_tokens - 1 - j);
    const FloatVec offset(shift - log_group + weight);
    for (int64_t t = 0; t < slots; t += FloatVec::size()) {
      const int64_t lanes = std::min<int64_t>(FloatVec::size(), slots - t);
      FloatVec sum(0.0f);
      for (int64_t g = 0; g < group; ++g) {
        sum = at::vec::fmadd(FloatVec::loadu(probabilities + (g * new_tokens + j) * slots + t, lanes),
                             FloatVec(w.group_factors[g]), sum);
      }
      sum.store(w.sums.data() + t, lanes);
      (sum.log() + offset - FloatVec::loadu(log_weights + t, lanes)).store(w.log_mean.data() + t, lanes);
    }
    for (int64_t t = 0; t < slots; ++t) {
      if (w.sums[t] >= FLT_MIN) continue;
      float high = -kernels::infinity();
      for (int64_t g = 0; g < group; ++g) {
        const float p = probabilities[(g * new_tokens + j) * slots + t];
        if (p > 0.0f) high = std::max(high, logf(p) + normalisers[g * new_tokens]);
      }
      float total = 0.0f;
      for (int64_t g = 0; g < group; ++g) {
        const float p = probabilities[(g * new_tokens + j) * slots + t];
        if (p > 0.0f) total += expf(logf(p) + normalisers[g * new_tokens] - high);
      }
      // -inf: the query sees no slot t (adds nothing); +inf: a logit overflowed float32 (as logsumexp, +inf).
      w.log_mean[t] = (high == -kernels::infinity() || high == kernels::infinity())
                          ? high
                          : high + logf(total) - log_group - log_weights[t] + weight;
    }
    if (j == 0) {  // the fold of the new queries starts as the first one's term (ln(0 + e^x) = x, exactly)
      w.log_ema.swap(w.log_mean);
      continue;
    }
    for (int64_t t = 0; t < slots; t += FloatVec::size()) {
      const int64_t lanes = std::min<int64_t>(FloatVec::size(), slots - t);
      log_add_exp(FloatVec::loadu(w.log_ema.data() + t, lanes), FloatVec::loadu(w.log_mean.data() + t, lanes))
          .store(w.log_ema.data() + t, lanes);
    }
  }
  // S <- β^q S + the fold; each slot's age grows by the new queries that see it (the new tokens are the last q
  // slots: slot t is seen by min(q, T - t)).
  const float log_decay_q = static_cast<float>(new_tokens) * scalars.log_decay;
  for (int64_t t = 0; t < old_slots; t += FloatVec::size()) {
    const int64_t lanes = std::min<int64_t>(FloatVec::size(), old_slots - t);
    log_add_exp(FloatVec::loadu(log_ema_in + t, lanes) + FloatVec(log_decay_q), FloatVec::loadu(w.log_ema.data() + t, lanes))
        .store(w.log_ema.data() + t, lanes);
  }
  for (int64_t t = 0; t < slots; ++t) {
    const bool is_old = t < old_slots;
    w.age[t] = (is_old ? age_in[t] : 0.0f) + static_cast<float>(std::min(new_tokens, slots - t));
    w.votes[t] = is_old ? votes_in[t] : 1.0f;
  }
  const int64_t kept = std::min(slots, scalars.budget);
  if (kept == slots) {  // room left: nothing evicted, keys and values stay as they are
    std::copy_n(w.log_ema.data(), slots, out_log_ema);
    std::copy_n(w.age.data(), slots, out_age);
    std::copy_n(w.votes.data(), slots, out_votes);
    log_votes(w.votes.data(), slots, out_log_weights);
    *out_dropped = 0.0f;
    return;
  }
  // Evict the T - M slots of lowest ln ŝ (ties to the lower slot) among neither the sinks nor the recent window.
  w.log_estimate.resize(slots);
  w.eviction_key.resize(slots);
  w.order.resize(slots);
  for (int64_t t = 0; t < slots; t += FloatVec::size()) {  // ln ŝ = ln S - ln(1 - β^age)
    const int64_t lanes = std::min<int64_t>(FloatVec::size(), slots - t);
    const FloatVec decay_powers = FloatVec::loadu(w.age.data() + t, lanes) * FloatVec(scalars.log_decay);
    (FloatVec::loadu(w.log_ema.data() + t, lanes) - log_one_minus_exp(decay_powers))
        .store(w.log_estimate.data() + t, lanes);
  }
  for (int64_t t = 0; t < slots; ++t) {
    const bool is_protected = t < scalars.sinks || t >= slots - scalars.recent;
    w.eviction_key[t] = kernels::keepkv_eviction_key(w.log_estimate[t], w.votes[t], is_protected);
    w.order[t] = t;
  }
  const int64_t evictions = slots - kept;
  const auto evicted_first = [&](int64_t a, int64_t b) {
    return w.eviction_key[a] < w.eviction_key[b] || (w.eviction_key[a] == w.eviction_key[b] && a < b);
  };
  std::nth_element(w.order.begin(), w.order.begin() + (evictions - 1), w.order.end(), evicted_first);
  if (w.keep_size < slots) {
    w.keep.reset(new bool[slots]);
    w.keep_size = slots;
  }
  std::fill_n(w.keep.get(), slots, true);
  for (int64_t e = 0; e < evictions; ++e) w.keep[w.order[e]] = false;
  // Each evicted slot merges into its most similar retained slot (or is dropped), then the retained slots are
  // packed in order: output row r holds the r-th retained slot, merged with its set.
  w.targets.resize(slots);
  match_one_row(keys, w.keep.get(), slots, head_dim, scalars.threshold, w.targets.data(), w.evicted, w.retained, w.scratch);
  float dropped = 0.0f;
  for (int64_t t = 0; t < slots; ++t) {
    if (w.targets[t] == kernels::kKeepKVEvictedNoMerge) dropped += w.votes[t];
  }
  *out_dropped = dropped;
  // Merged keys and values land on their retained slot first (a set reads only its own members, and no retained slot
  // is a member), then the retained slots move down in order: slot retained[r] >= r, so no move overwrites a slot
  // still to be read.
  w.merged_votes = w.votes;
  zip_one_row(static_cast<const scalar_t*>(keys), static_cast<const scalar_t*>(values), w.votes.data(),
              w.log_estimate.data(), w.targets.data(), slots, head_dim, scalars.convex, row, kv_heads, keys, values,
              w.merged_votes.data(), w.pairs, w.acc);
  w.destination.assign(slots, -1);
  for (int64_t r = 0; r < kept;) {  // one move per run of consecutive retained slots
    int64_t run = 1;
    while (r + run < kept && w.retained[r + run] == w.retained[r] + run) ++run;
    if (w.retained[r] != r) {
      std::memmove(keys + r * head_dim, keys + w.retained[r] * head_dim, run * head_dim * sizeof(scalar_t));
      std::memmove(values + r * head_dim, values + w.retained[r] * head_dim, run * head_dim * sizeof(scalar_t));
    }
    r += run;
  }
  for (int64_t r = 0; r < kept; ++r) {
    const int64_t c = w.retained[r];
    w.destination[c] = r;
    out_votes[r] = w.merged_votes[c];
    out_age[r] = w.age[c];
    out_log_ema[r] = w.votes[c] <= 0.0f ? -kernels::infinity() : w.log_ema[c];
  }
  // A merged set's ŝ is its vote-weighted mean Σ p ŝ / Σ p (what eq. 7's key scores, theorem 3), its age the oldest
  // member's; ln S is recovered from ŝ with that age. w.pairs holds the (target, member) pairs grouped by target.
  for (size_t begin = 0; begin < w.pairs.size();) {
    const int64_t c = w.pairs[begin].first;
    size_t end = begin;
    while (end < w.pairs.size() && w.pairs[end].first == c) ++end;
    const auto weighted = [&](int64_t slot) { return w.log_estimate[slot] + logf(w.votes[slot]); };
    float peak = weighted(c), age = w.age[c];
    for (size_t m = begin; m < end; ++m) {
      peak = std::max(peak, weighted(w.pairs[m].second));
      age = std::max(age, w.age[w.pairs[m].second]);
    }
    const int64_t r = w.destination[c];
    out_age[r] = age;
    if (!(out_votes[r] > 0.0f) || peak == -kernels::infinity() || kernels::is_nan(peak)) {
      out_log_ema[r] = -kernels::infinity();
    } else {
      float mass = expf(weighted(c) - peak);
      for (size_t m = begin; m < end; ++m) mass += expf(weighted(w.pairs[m].second) - peak);
      out_log_ema[r] = peak + logf(mass) - logf(out_votes[r]) + kernels::log_one_minus_exp(age * scalars.log_decay);
    }
    begin = end;
  }
  log_votes(out_votes, kept, out_log_weights);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> keepkv_decode_step_cpu(
    at::Tensor& keys, at::Tensor& values, const at::Tensor& queries, const at::Tensor& probabilities,
    const at::Tensor& log_weights, const at::Tensor& log_ema, const at::Tensor& age, const at::Tensor& votes,
    double scale, double ema_decay, int64_t budget, int64_t sinks, int64_t recent, double threshold, bool convex) {
  const KeepKVStepShape shape = check_keepkv_decode_step(keys, values, queries, probabilities, log_weights, log_ema,
                                                         age, votes, scale, ema_decay, budget, sinks, recent,
                                                         threshold);
  const int64_t batch = shape.cache.batch, kv_heads = shape.cache.kv_heads, slots = shape.cache.slots;
  const int64_t head_dim = shape.cache.head_dim, kept = shape.kept, group = shape.group, q = shape.queries;
  // The (B, H, ...) rows are read (and keys, values updated) where they lie (a paged cache's view over its pools).
  const KeepKVStepTensors t = keepkv_step_tensors(shape, queries, probabilities, log_weights, log_ema, age, votes);
  const kernels::RowStrides key_rows = row_strides(keys), value_rows = row_strides(values);
  const kernels::RowStrides log_weight_rows = row_strides(t.log_weights), log_ema_rows = row_strides(t.log_ema);
  const kernels::RowStrides age_rows = row_strides(t.age), vote_rows = row_strides(t.votes);
  const StepScalars scalars{static_cast<float>(scale), static_cast<float>(std::log(ema_decay)),
                            static_cast<float>(std::log1p(-ema_decay)), budget, sinks, recent,
                            static_cast<float>(threshold), convex};
  KVCOMP_DISPATCH_CACHE_TYPES(keys.scalar_type(), "kvcomp::keepkv_decode_step", [&] {
    scalar_t* keys_ptr = keys.mutable_data_ptr<scalar_t>();
    scalar_t* values_ptr = values.mutable_data_ptr<scalar_t>();
    const scalar_t* queries_ptr = t.queries.const_data_ptr<scalar_t>();
    const float* probabilities_ptr = t.probabilities.const_data_ptr<float>();
    at::parallel_for(0, batch * kv_heads, grain_for(slots * (head_dim + group * q)), [&](int64_t begin, int64_t end) {
      StepScratch scratch;
      for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / kv_heads, h = row % kv_heads;
        const int64_t first_query_head = b * kv_heads * group + h * group;
        decode_step_one_row(keys_ptr + key_rows.offset(row), values_ptr + value_rows.offset(row),
                            queries_ptr + first_query_head * q * head_dim,
                            probabilities_ptr + first_query_head * q * slots,
                            t.log_weights.const_data_ptr<float>() + log_weight_rows.offset(row),
                            t.log_ema.const_data_ptr<float>() + log_ema_rows.offset(row),
                            t.age.const_data_ptr<float>() + age_rows.offset(row),
                            t.votes.const_data_ptr<float>() + vote_rows.offset(row), group, q, slots, head_dim,
                            q * head_dim, scalars, row, kv_heads,
                            t.out_log_ema.mutable_data_ptr<float>() + row * kept,
                            t.out_age.mutable_data_ptr<float>() + row * kept,
                            t.out_votes.mutable_data_ptr<float>() + row * kept,
                            t.out_log_weights.mutable_data_ptr<float>() + row * kept,
                            t.out_dropped.mutable_data_ptr<float>() + row, scratch);
      }
    });
  });
  return t.outputs();
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, CPU, m) {
  m.impl("keepkv_match", &keepkv_match_cpu);
  m.impl("keepkv_zip_merge", &keepkv_zip_merge_cpu);
  m.impl("keepkv_decode_step", &keepkv_decode_step_cpu);
}

}  // namespace kvcomp
