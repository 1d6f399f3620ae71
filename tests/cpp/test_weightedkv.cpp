// GoogleTest of the weightedkv family: the device-free pieces (merge weights incl. 0/0 and NaN, the NaN-safe argmin
// order, the run folding) against hand computations and the greedy steps written out, and the registered CPU kernel
// through the dispatcher.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/weightedkv.h"

namespace {

namespace k = kvcomp::kernels;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(MergeCoefficients, ConvexCombinationOfTheMeans) {
  // The paper's figure 3: v2 (mean 0.1) into v3 (mean 0.5) gives v2/6 + 5 v3/6.
  const auto c = k::merge_coefficients(0.1f, 0.5f);
  EXPECT_FLOAT_EQ(c.child, 1.0f / 6.0f);
  EXPECT_FLOAT_EQ(c.parent, 5.0f / 6.0f);
  const auto d = k::merge_coefficients(3.0f, 1.0f);
  EXPECT_FLOAT_EQ(d.child, 0.75f);
  EXPECT_FLOAT_EQ(d.parent, 0.25f);
}

TEST(MergeCoefficients, ZeroOverZeroIsThePlainMean) {
  for (const auto [child, parent] : {std::pair{0.0f, 0.0f}, {-0.0f, 0.0f}, {2.0f, -2.0f}}) {
    const auto c = k::merge_coefficients(child, parent);
    EXPECT_EQ(c.child, 0.5f) << child << " " << parent;
    EXPECT_EQ(c.parent, 0.5f) << child << " " << parent;
  }
  EXPECT_EQ(k::weighted_merge(4.0f, -2.0f, 0.5f, 0.5f), 1.0f);
}

TEST(MergeCoefficients, InfiniteAndNaNMeansTakeTheLimit) {
  const auto expect = [](float child, float parent, float want_child, float want_parent) {
    const auto c = k::merge_coefficients(child, parent);
    EXPECT_EQ(c.child, want_child) << child << " " << parent;
    EXPECT_EQ(c.parent, want_parent) << child << " " << parent;
    EXPECT_FALSE(std::isnan(c.child) || std::isnan(c.parent));
  };
  expect(kInf, 1.0f, 1.0f, 0.0f);
  expect(1.0f, kInf, 0.0f, 1.0f);
  expect(kInf, kInf, 0.5f, 0.5f);
  expect(kNaN, 1.0f, 1.0f, 0.0f);  // NaN reads as +inf, as in the argmin
  expect(0.0f, kNaN, 0.0f, 1.0f);
  expect(kNaN, kNaN, 0.5f, 0.5f);
  expect(kNaN, kInf, 0.5f, 0.5f);
  // Two large finite means: their float sum would overflow, the double one does not.
  expect(3e38f, 3e38f, 0.5f, 0.5f);
}

TEST(WeightedMerge, MatchesHandComputation) {
  const auto c = k::merge_coefficients(0.1f, 0.5f);
  EXPECT_NEAR(k::weighted_merge(6.0f, 12.0f, c.child, c.parent), 1.0f + 10.0f, 1e-5f);  // 6/6 + 5*12/6
  EXPECT_NEAR(k::weighted_merge(-3.0f, 3.0f, 0.25f, 0.75f), 1.5f, 0.0f);
}

TEST(OrderKey, FollowsTheFloatOrderWithNaNAsInfinity) {
  const std::vector<float> ascending = {-kInf, -3e38f, -1.0f, -1e-40f, 0.0f, 1e-40f, 1e-30f, 0.1f, 1.0f, 3e38f, kInf};
  for (size_t i = 0; i + 1 < ascending.size(); ++i)
    EXPECT_LT(k::order_key(ascending[i]), k::order_key(ascending[i + 1])) << ascending[i] << " " << ascending[i + 1];
  EXPECT_EQ(k::order_key(kNaN), k::order_key(kInf));
  EXPECT_EQ(k::order_key(-kNaN), k::order_key(kInf));
  EXPECT_EQ(k::order_key(-0.0f), k::order_key(0.0f));
  EXPECT_EQ(k::sanitize_mean(kNaN), kInf);
}

TEST(EvictionKey, TiesGoToTheLowerSlotAndTheSlotReadsBack) {
  EXPECT_LT(k::eviction_key(0.5f, 3), k::eviction_key(0.5f, 4));
  EXPECT_LT(k::eviction_key(0.4f, 9), k::eviction_key(0.5f, 2));
  EXPECT_LT(k::eviction_key(kInf, 1), k::eviction_key(kNaN, 2));  // all-NaN: the first slot
  EXPECT_LT(k::eviction_key(1e30f, 7), k::eviction_key(kNaN, 0));
  EXPECT_EQ(k::key_slot(k::eviction_key(0.25f, 123456)), 123456);
  EXPECT_EQ(k::key_slot(k::eviction_key(kNaN, 2147483647u)), 2147483647);
}

// A host stack over one-channel float values, rounded to float as the op rounds to the cache dtype.
struct VectorStack {
  const std::vector<float>& means;
  std::vector<float>& values;  // values[slot], updated in place: level 0 is the terminal, which survives
  std::vector<uint64_t> keys;
  std::vector<float> open;
  int64_t terminal = 0;
  void reset(int64_t t) {
    terminal = t;
    keys.clear();
    open.clear();
  }
  int64_t depth() const { return static_cast<int64_t>(keys.size()); }
  uint64_t top_key() const { return keys.back(); }
  void push(uint64_t key) {
    keys.push_back(key);
    open.push_back(values[k::key_slot(key)]);
  }
  void pop_and_merge() {
    const int64_t child_slot = k::key_slot(keys.back());
    const float child_value = open.back();
    keys.pop_back();
    open.pop_back();
    const int64_t parent_slot = keys.empty() ? terminal : k::key_slot(keys.back());
    float& parent_value = keys.empty() ? values[terminal] : open.back();
    const auto c = k::merge_coefficients(means[child_slot], means[parent_slot]);
    parent_value = k::weighted_merge(child_value, parent_value, c.child, c.parent);
  }
};

// The greedy steps written out: argmin over the middle of the current cache, merge into the right neighbour, erase.
std::vector<std::pair<int64_t, float>> greedy_steps(const std::vector<float>& means, std::vector<float> values,
                                                    int64_t sinks, int64_t recent, int64_t evictions) {
  std::vector<std::pair<int64_t, float>> cache;  // (slot, value)
  for (size_t s = 0; s < values.size(); ++s) cache.emplace_back(static_cast<int64_t>(s), values[s]);
  for (int64_t step = 0; step < evictions; ++step) {
    size_t best = sinks;
    const auto key = [&](size_t i) {
      return k::eviction_key(means[cache[i].first], static_cast<uint32_t>(cache[i].first));
    };
    for (size_t i = sinks; i < cache.size() - recent; ++i)
      if (key(i) < key(best)) best = i;
    const auto c = k::merge_coefficients(means[cache[best].first], means[cache[best + 1].first]);
    cache[best + 1].second = k::weighted_merge(cache[best].second, cache[best + 1].second, c.child, c.parent);
    cache.erase(cache.begin() + best);
  }
  return cache;
}

// The op's way: pick the e smallest keys at once, fold each run of evicted slots into the survivor after it.
std::vector<std::pair<int64_t, float>> fold_all_runs(const std::vector<float>& means, std::vector<float> values,
                                                     int64_t sinks, int64_t recent, int64_t evictions) {
  const auto len = static_cast<int64_t>(values.size());
  const auto key_of = [&](int64_t slot) { return k::eviction_key(means[slot], static_cast<uint32_t>(slot)); };
  std::vector<uint64_t> middle;
  for (int64_t s = sinks; s < len - recent; ++s) middle.push_back(key_of(s));
  std::sort(middle.begin(), middle.end());
  std::vector<bool> evicted(len, false);
  for (int64_t i = 0; i < evictions; ++i) evicted[k::key_slot(middle[i])] = true;
  VectorStack stack{means, values, {}, {}};
  std::vector<std::pair<int64_t, float>> cache;
  for (int64_t s = 0; s < len; ++s) {
    if (evicted[s]) continue;
    int64_t first = s;
    while (first > 0 && evicted[first - 1]) --first;
    if (first < s) k::fold_run(first, s, stack, key_of);
    cache.emplace_back(s, values[s]);
  }
  return cache;
}

TEST(FoldRun, EqualsTheGreedyStepsBitForBit) {
  std::mt19937 generator(1234);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t len = 2 + generator() % 40;
    const int64_t recent = 1 + generator() % std::min<int64_t>(len - 1, 5);
    const int64_t sinks = generator() % (len - recent + 1);
    const int64_t evictions = generator() % (len - sinks - recent + 1);
    std::vector<float> means(len), values(len);
    for (int64_t s = 0; s < len; ++s) {
      // coarse means make ties; a few NaN and infinities
      const float r = uniform(generator);
      means[s] = r < 0.05f ? kNaN : r < 0.08f ? kInf : std::floor(uniform(generator) * 6.0f) / 6.0f;
      values[s] = uniform(generator) * 10.0f - 5.0f;
    }
    const auto expected = greedy_steps(means, values, sinks, recent, evictions);
    const auto got = fold_all_runs(means, values, sinks, recent, evictions);
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].first, expected[i].first) << "trial " << trial << " output " << i;
      EXPECT_EQ(std::memcmp(&got[i].second, &expected[i].second, sizeof(float)), 0)
          << "trial " << trial << " output " << i << ": " << got[i].second << " vs " << expected[i].second;
    }
  }
}

TEST(FoldRun, PaperStepFive) {
  // Slots v1..v5 with the figure's means at step 5; one eviction, no sinks, the newest slot recent.
  const std::vector<float> means = {0.4f, 0.1f, 0.5f, 0.4f, 0.3f};
  const auto cache = fold_all_runs(means, {10.0f, 6.0f, 12.0f, 0.0f, 0.0f}, 0, 1, 1);
  ASSERT_EQ(cache.size(), 4u);
  EXPECT_EQ(cache[1].first, 2);
  EXPECT_NEAR(cache[1].second, 6.0f / 6.0f + 5.0f * 12.0f / 6.0f, 1e-5f);
}

using EvictResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The op updates its arguments in place; the result is their first T - evictions slots.
EvictResult call_weightedkv_evict(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& sums,
                                  const at::Tensor& counts, int64_t sinks, int64_t recent, int64_t evictions) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvcomp::weightedkv_evict", "")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                      int64_t, bool)>();
  op.call(keys, values, sums, counts, sinks, recent, evictions, /*merge_values=*/true);
  const int64_t kept = keys.size(2) - evictions;
  return {keys.narrow(2, 0, kept), values.narrow(2, 0, kept), sums.narrow(2, 0, kept), counts.narrow(2, 0, kept)};
}

TEST(WeightedKVEvictOp, CpuKernelIsRegistered) {
  const auto op = c10::Dispatcher::singleton().findOp({"kvcomp::weightedkv_evict", ""});
  ASSERT_TRUE(op.has_value());
  EXPECT_TRUE(op->hasKernelForDispatchKey(c10::DispatchKey::CPU));
}

TEST(WeightedKVEvictOp, OneStepByHand) {
  // One row, 5 slots, 1 sink, 1 recent; means [.9, .3, .2, .6, .1]: slot 2 (0.2) merges into slot 3 (0.6).
  const auto sums = at::tensor({0.9f, 0.6f, 0.2f, 1.8f, 0.1f}).view({1, 1, 5});
  const auto counts = at::tensor({1.0f, 2.0f, 1.0f, 3.0f, 1.0f}).view({1, 1, 5});
  const auto keys = at::arange(10, at::kFloat).view({1, 1, 5, 2});
  const auto values = at::arange(5, at::kFloat).mul(4).view({1, 1, 5, 1});  // 0, 4, 8, 12, 16
  const auto [k_out, v_out, s_out, n_out] = call_weightedkv_evict(keys, values, sums, counts, 1, 1, 1);
  EXPECT_TRUE(at::equal(k_out, at::tensor({0.f, 1.f, 2.f, 3.f, 6.f, 7.f, 8.f, 9.f}).view({1, 1, 4, 2})));
  EXPECT_TRUE(at::allclose(v_out.flatten(), at::tensor({0.0f, 4.0f, 0.25f * 8 + 0.75f * 12, 16.0f})));
  EXPECT_TRUE(at::equal(s_out.flatten(), at::tensor({0.9f, 0.6f, 1.8f, 0.1f})));
  EXPECT_TRUE(at::equal(n_out.flatten(), at::tensor({1.0f, 2.0f, 3.0f, 1.0f})));
}

TEST(WeightedKVEvictOp, ErrorNamesTheOpAndTheValues) {
  const auto keys = at::zeros({1, 2, 6, 4}), values = at::zeros({1, 2, 6, 4});
  const auto sums = at::ones({1, 2, 6}), counts = at::ones({1, 2, 6});
  try {
    call_weightedkv_evict(keys, values, sums, counts, 2, 3, 2);
    FAIL() << "2 evictions from 1 middle slot were accepted";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("kvcomp::weightedkv_evict"), std::string::npos) << message;
    EXPECT_NE(message.find("evictions = 2, T = 6, sinks = 2, recent = 3"), std::string::npos) << message;
  }
}

}  // namespace
