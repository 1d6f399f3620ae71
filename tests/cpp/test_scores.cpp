// GoogleTest of the scores family: the device-free math against the recurrence written out by hand, and the
// registered CPU kernel through the dispatcher (which also proves the registrations survived linking).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <vector>

#include "kernels/scores.h"

namespace {

// attn laid out [G, q, T] for one (batch, kv-head), value = 0.01 * (1 + head + 3 * query + 7 * slot).
std::vector<float> make_group_attention(int64_t group, int64_t queries, int64_t total) {
  std::vector<float> attn(group * queries * total);
  for (int64_t h = 0; h < group; ++h)
    for (int64_t j = 0; j < queries; ++j)
      for (int64_t t = 0; t < total; ++t) attn[(h * queries + j) * total + t] = 0.01f * (1 + h + 3 * j + 7 * t);
  return attn;
}

TEST(FoldAttentionIntoScore, MatchesStepByStepRecurrence) {
  const int64_t group = 3, queries = 4, total = 5;
  const float decay = 0.9f, scale = 0.5f, old_score = 2.0f;
  const auto attn = make_group_attention(group, queries, total);
  for (int64_t slot = 0; slot < total; ++slot) {
    float expected = old_score;  // q single-token updates: s <- decay * s + scale * sum_g a[g, j, slot]
    for (int64_t j = 0; j < queries; ++j) {
      float group_sum = 0.0f;
      for (int64_t h = 0; h < group; ++h) group_sum += attn[(h * queries + j) * total + slot];
      expected = decay * expected + scale * group_sum;
    }
    const auto load = [&](int64_t h, int64_t j) { return attn[(h * queries + j) * total + slot]; };
    const float got =
        kvcomp::kernels::fold_attention_into_score(old_score, load, group, queries, decay, std::pow(decay, 4.0f), scale);
    EXPECT_NEAR(got, expected, 1e-5f) << "slot " << slot;
  }
}

TEST(FoldAttentionIntoScore, ZeroDecayKeepsOnlyTheLastQuery) {
  const int64_t group = 2, queries = 3, total = 4;
  const auto attn = make_group_attention(group, queries, total);
  const int64_t slot = 2;
  const float last = attn[(0 * queries + 2) * total + slot] + attn[(1 * queries + 2) * total + slot];
  const auto load = [&](int64_t h, int64_t j) { return attn[(h * queries + j) * total + slot]; };
  EXPECT_FLOAT_EQ(kvcomp::kernels::fold_attention_into_score(5.0f, load, group, queries, 0.0f, 0.0f, 1.0f), last);
}

TEST(UpdateScoresOp, CpuKernelIsRegistered) {
  const auto op = c10::Dispatcher::singleton().findOp({"kvcomp::update_scores", ""});
  ASSERT_TRUE(op.has_value());
  EXPECT_TRUE(op->hasKernelForDispatchKey(c10::DispatchKey::CPU));
}

at::Tensor call_update_scores(const at::Tensor& scores, const at::Tensor& attn, double decay, double scale) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvcomp::update_scores", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, double)>();
  return op.call(scores, attn, decay, scale);
}

TEST(UpdateScoresOp, MatchesTensorFormulaOnGqa) {
  at::manual_seed(0);
  const int64_t batch = 2, kv_heads = 2, group = 3, queries = 2, old_len = 5;
  const auto scores = at::rand({batch, kv_heads, old_len});
  const auto attn = at::rand({batch, kv_heads * group, queries, old_len + queries});
  const double decay = 0.8;
  const auto grouped = attn.view({batch, kv_heads, group, queries, old_len + queries}).sum(2);
  const auto expected = decay * decay * at::constant_pad_nd(scores, {0, queries}) +
                        decay * grouped.select(2, 0) + grouped.select(2, 1);
  EXPECT_TRUE(at::allclose(call_update_scores(scores, attn, decay, 1.0), expected, 1e-5, 1e-6));
}

TEST(UpdateScoresOp, ErrorNamesTheOpAndTheValue) {
  const auto scores = at::zeros({1, 2, 3});
  const auto attn = at::zeros({1, 4, 1, 4});
  try {
    call_update_scores(scores, attn, 1.5, 1.0);
    FAIL() << "decay 1.5 was accepted";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("kvcomp::update_scores"), std::string::npos) << message;
    EXPECT_NE(message.find("1.5"), std::string::npos) << message;
  }
}

}  // namespace
