// GoogleTest of the zsmerge family: the device-free pieces (group bounds of the contiguous split, the merge formula,
// the NaN-safe argmin/argmax orders, the ring index) against hand computations, and both registered CPU kernels
// through the dispatcher.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "kernels/zsmerge.h"
#include "kvcomp/zsmerge.h"

namespace {

using kvcomp::kernels::EvictsFirst;
using kvcomp::kernels::KeepBetter;
using kvcomp::kernels::MergesFirst;
using kvcomp::kernels::SlotChoice;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(ZSMergeKernels, IsNanIsBitwise) {
  EXPECT_TRUE(kvcomp::kernels::is_nan(kNan));
  EXPECT_TRUE(kvcomp::kernels::is_nan(-kNan));
  EXPECT_FALSE(kvcomp::kernels::is_nan(kInf));
  EXPECT_FALSE(kvcomp::kernels::is_nan(-kInf));
  EXPECT_FALSE(kvcomp::kernels::is_nan(0.0f));
  EXPECT_FALSE(kvcomp::kernels::is_nan(std::numeric_limits<float>::max()));
}

TEST(ZSMergeKernels, GroupBoundsSplitSevenTokensIntoThree) {
  // 7 = 3 + 2 + 2: the first 7 mod 3 = 1 group is one longer.
  const int64_t expected[3][2] = {{0, 3}, {3, 5}, {5, 7}};
  for (int64_t g = 0; g < 3; ++g) {
    const auto bounds = kvcomp::kernels::residual_group_bounds(7, 3, g);
    EXPECT_EQ(bounds.begin, expected[g][0]) << "group " << g;
    EXPECT_EQ(bounds.end, expected[g][1]) << "group " << g;
  }
}

TEST(ZSMergeKernels, GroupBoundsTileEveryTokenOnce) {
  for (int64_t tokens = 1; tokens <= 40; ++tokens) {
    for (int64_t groups = 1; groups <= tokens; ++groups) {
      int64_t expected_begin = 0;
      for (int64_t g = 0; g < groups; ++g) {
        const auto bounds = kvcomp::kernels::residual_group_bounds(tokens, groups, g);
        const int64_t size = tokens / groups + (g < tokens % groups ? 1 : 0);
        ASSERT_EQ(bounds.begin, expected_begin) << tokens << " tokens, " << groups << " groups, group " << g;
        ASSERT_EQ(bounds.end - bounds.begin, size) << tokens << " tokens, " << groups << " groups, group " << g;
        expected_begin = bounds.end;
      }
      ASSERT_EQ(expected_begin, tokens);
    }
  }
}

TEST(ZSMergeKernels, MergeIsTheCountWeightedMean) {
  // A token (w = 1, x = 4) into a slot averaging 3 tokens (w = 3, x = 2): (4 + 3 * 2) / 4 = 2.5.
  EXPECT_FLOAT_EQ(kvcomp::kernels::merge_weighted(4.0f, 1.0f, 2.0f, 3.0f), 2.5f);
  // Two merged slots: (2 * 1 + 5 * 8) / 7 = 6.
  EXPECT_FLOAT_EQ(kvcomp::kernels::merge_weighted(1.0f, 2.0f, 8.0f, 5.0f), 6.0f);
  // Merging equal rows changes nothing; eq. 7's momentum form for w_i = 1.
  EXPECT_FLOAT_EQ(kvcomp::kernels::merge_weighted(-0.75f, 1.0f, -0.75f, 9.0f), -0.75f);
  const float w = 4.0f, slot = 0.3f, token = -1.2f;
  EXPECT_FLOAT_EQ(kvcomp::kernels::merge_weighted(token, 1.0f, slot, w), (w * slot + token) / (w + 1.0f));
}

TEST(ZSMergeKernels, NanPropagatingMaxFollowsTorchMaximum) {
  EXPECT_EQ(kvcomp::kernels::nan_propagating_max(0.2f, 0.7f), 0.7f);
  EXPECT_EQ(kvcomp::kernels::nan_propagating_max(0.7f, 0.2f), 0.7f);
  EXPECT_EQ(kvcomp::kernels::nan_propagating_max(-kInf, 3.0f), 3.0f);
  EXPECT_TRUE(std::isnan(kvcomp::kernels::nan_propagating_max(kNan, 1.0f)));
  EXPECT_TRUE(std::isnan(kvcomp::kernels::nan_propagating_max(1.0f, kNan)));
}

// Reduces values[0..n) with the same binary operator a CUB tree would use, in several association orders.
template <typename Order>
std::vector<int64_t> argbest_in_several_orders(const std::vector<float>& values, int64_t first_slot) {
  const KeepBetter<Order> keep;
  std::vector<SlotChoice> candidates;
  for (size_t k = 0; k < values.size(); ++k) candidates.push_back({values[k], first_slot + static_cast<int64_t>(k)});
  std::vector<int64_t> results;
  SlotChoice forward = Order::none(), backward = Order::none();
  for (const auto& c : candidates) forward = keep(forward, c);
  for (auto it = candidates.rbegin(); it != candidates.rend(); ++it) backward = keep(*it, backward);
  std::vector<SlotChoice> tree = candidates;  // pairwise, like a warp shuffle reduction
  while (tree.size() > 1) {
    std::vector<SlotChoice> next;
    for (size_t k = 0; k + 1 < tree.size(); k += 2) next.push_back(keep(tree[k], tree[k + 1]));
    if (tree.size() % 2) next.push_back(keep(tree.back(), Order::none()));
    tree = next;
  }
  return {forward.slot, backward.slot, tree[0].slot};
}

TEST(ZSMergeKernels, EvictionPicksTheLowestScoreFirstOnTies) {
  // context slots 2..6
  EXPECT_EQ(argbest_in_several_orders<EvictsFirst>({0.9f, 0.3f, 0.5f, 0.3f, 0.7f}, 2),
            (std::vector<int64_t>{3, 3, 3}));
  EXPECT_EQ(argbest_in_several_orders<EvictsFirst>({0.0f, -0.0f, 1.0f}, 2), (std::vector<int64_t>{2, 2, 2}));
  EXPECT_EQ(argbest_in_several_orders<EvictsFirst>({kInf, -kInf, kInf}, 2), (std::vector<int64_t>{3, 3, 3}));
}

TEST(ZSMergeKernels, EvictionCountsNanAsInfinity) {
  EXPECT_EQ(argbest_in_several_orders<EvictsFirst>({kNan, 0.8f, kNan, 0.4f}, 2), (std::vector<int64_t>{5, 5, 5}));
  // NaN ties with +inf: the lower slot wins.
  EXPECT_EQ(argbest_in_several_orders<EvictsFirst>({kInf, kNan, kInf}, 2), (std::vector<int64_t>{2, 2, 2}));
  EXPECT_EQ(argbest_in_several_orders<EvictsFirst>({kNan, kInf}, 2), (std::vector<int64_t>{2, 2, 2}));
  // All NaN: still a valid slot, the first context slot.
  EXPECT_EQ(argbest_in_several_orders<EvictsFirst>({kNan, kNan, kNan}, 2), (std::vector<int64_t>{2, 2, 2}));
}

TEST(ZSMergeKernels, MergeTargetPicksTheLargestSimilarityFirstOnTies) {
  EXPECT_EQ(argbest_in_several_orders<MergesFirst>({0.1f, 2.5f, -3.0f, 2.5f}, 0), (std::vector<int64_t>{1, 1, 1}));
  EXPECT_EQ(argbest_in_several_orders<MergesFirst>({kNan, 0.2f, kNan}, 0), (std::vector<int64_t>{1, 1, 1}));
  EXPECT_EQ(argbest_in_several_orders<MergesFirst>({-kInf, kNan}, 0), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(argbest_in_several_orders<MergesFirst>({kNan, kNan, kNan}, 0), (std::vector<int64_t>{0, 0, 0}));
}

TEST(ZSMergeKernels, NoneLosesToEveryRealSlot) {
  EXPECT_TRUE(EvictsFirst{}({kNan, 1000}, EvictsFirst::none()));
  EXPECT_FALSE(EvictsFirst{}(EvictsFirst::none(), {kNan, 1000}));
  EXPECT_TRUE(MergesFirst{}({kNan, 1000}, MergesFirst::none()));
  EXPECT_FALSE(MergesFirst{}(MergesFirst::none(), {kNan, 1000}));
}

TEST(ZSMergeKernels, OldestRecentSlotWalksTheRing) {
  // residual 2, context 4, recent 3: the ring is slots 6, 7, 8.
  std::vector<int64_t> slots;
  for (int64_t step = 0; step < 5; ++step) slots.push_back(kvcomp::kernels::oldest_recent_slot(2, 4, 3, 1, step));
  EXPECT_EQ(slots, (std::vector<int64_t>{7, 8, 6, 7, 8}));
}

TEST(ZSMergeKernels, PaperOrderLetsTheLeavingRecentTokenBeEvicted) {
  using kvcomp::kernels::evicted_slot;
  const SlotChoice context_lowest{0.3f, 4}, leaving_lower{0.1f, 9}, leaving_higher{0.5f, 9}, leaving_tied{0.3f, 9};
  EXPECT_EQ(evicted_slot(context_lowest, leaving_lower, true).slot, 9);
  EXPECT_EQ(evicted_slot(context_lowest, leaving_higher, true).slot, 4);
  EXPECT_EQ(evicted_slot(context_lowest, leaving_tied, true).slot, 4);  // ties keep the leaving token
  EXPECT_EQ(evicted_slot(context_lowest, {kNan, 9}, true).slot, 4);     // NaN counts as +inf
  EXPECT_EQ(evicted_slot(context_lowest, leaving_lower, false).slot, 4);  // the authors' order never takes it
}

// ----------------------------------------------------------------------------------------------------------------
// The ATen selection of the prefill (what the CUDA kernel runs), here on CPU tensors, against a stable sort.

std::vector<int64_t> stable_sort_order(const float* scores, int64_t tokens, int64_t recent, int64_t context) {
  std::vector<int64_t> candidates(tokens - recent);
  for (size_t k = 0; k < candidates.size(); ++k) candidates[k] = static_cast<int64_t>(k);
  std::stable_sort(candidates.begin(), candidates.end(), [scores](int64_t a, int64_t b) {
    const bool nan_a = std::isnan(scores[a]), nan_b = std::isnan(scores[b]);
    if (nan_a || nan_b) return !nan_a && nan_b;  // numbers before NaN
    return scores[a] > scores[b];
  });
  std::vector<int64_t> kept(candidates.begin(), candidates.begin() + context);
  std::vector<int64_t> others(candidates.begin() + context, candidates.end());
  std::sort(kept.begin(), kept.end());
  std::sort(others.begin(), others.end());
  std::vector<int64_t> order = others;
  order.insert(order.end(), kept.begin(), kept.end());
  for (int64_t position = tokens - recent; position < tokens; ++position) order.push_back(position);
  return order;
}

TEST(ZSMergeSelection, AtenSourceOrderMatchesAStableSort) {
  at::manual_seed(0);
  const int64_t tokens = 40, recent = 5, context = 9;
  // Scores on a coarse grid (many ties), with NaN, +-inf and -0.0 sprinkled in; one row all NaN.
  auto scores = (at::rand({2, 3, tokens}) * 4).floor() / 4;
  auto flat = scores.view({-1});
  for (int64_t k = 0; k < flat.numel(); k += 7) flat[k] = std::numeric_limits<float>::quiet_NaN();
  for (int64_t k = 3; k < flat.numel(); k += 11) flat[k] = -kInf;
  for (int64_t k = 5; k < flat.numel(); k += 13) flat[k] = kInf;
  for (int64_t k = 1; k < flat.numel(); k += 5) flat[k] = -0.0f;
  scores[1][2].fill_(std::numeric_limits<float>::quiet_NaN());
  scores[0][1].fill_(0.0f);  // all zero, every other one negative: the top-9 are the first nine positions
  scores[0][1].slice(0, 0, tokens, 2).fill_(-0.0f);
  const auto order = kvcomp::zsmerge_prefill_source_order(scores, recent, context);
  ASSERT_EQ(order.sizes(), scores.sizes());
  for (int64_t row = 0; row < 6; ++row) {
    const auto row_scores = scores.view({6, tokens})[row].contiguous();
    const auto expected = stable_sort_order(row_scores.data_ptr<float>(), tokens, recent, context);
    const auto got = order.view({6, tokens})[row].contiguous();
    EXPECT_EQ(std::vector<int64_t>(got.data_ptr<int64_t>(), got.data_ptr<int64_t>() + tokens), expected)
        << "row " << row;
  }
}

// ----------------------------------------------------------------------------------------------------------------
// Through the dispatcher

using PrefillFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                           const at::Tensor&, int64_t, int64_t,
                                                                           int64_t);
using DecodeFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                      int64_t, int64_t, bool);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> call_prefill(const at::Tensor& keys,
                                                                        const at::Tensor& values,
                                                                        const at::Tensor& scores, int64_t recent,
                                                                        int64_t context, int64_t residual) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kvcomp::zsmerge_prefill", "").typed<PrefillFn>();
  return op.call(keys, values, scores, recent, context, residual);
}

void call_decode(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& scores, const at::Tensor& counts,
                 int64_t ring_position, int64_t recent, int64_t context, int64_t residual) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kvcomp::zsmerge_decode_step", "").typed<DecodeFn>();
  op.call(keys, values, scores, counts, ring_position, recent, context, residual, /*paper_order=*/false);
}

TEST(ZSMergeOps, CpuKernelsAreRegistered) {
  for (const char* name : {"kvcomp::zsmerge_prefill", "kvcomp::zsmerge_decode_step"}) {
    const auto op = c10::Dispatcher::singleton().findOp({name, ""});
    ASSERT_TRUE(op.has_value()) << name;
    EXPECT_TRUE(op->hasKernelForDispatchKey(c10::DispatchKey::CPU)) << name;
  }
}

TEST(ZSMergeOps, PrefillByHand) {
  // T = 8, recent 2, context 2, residual 2. Scores of tokens 0..5 (the candidates): top-2 = tokens 1 and 4.
  // Residual tokens 0 2 3 5 -> groups {0, 2} and {3, 5}. keys[t] = t, values[t] = 10 t (d = 1).
  const auto positions = at::arange(8, at::kFloat).view({1, 1, 8, 1});
  const auto scores = at::tensor({0.1f, 0.9f, 0.3f, 0.2f, 0.8f, 0.05f, 0.0f, 0.0f}).view({1, 1, 8});
  const auto [keys, values, out_scores, counts] = call_prefill(positions, 10 * positions, scores, 2, 2, 2);
  const std::vector<float> expected_keys{1.0f, 4.0f, 1.0f, 4.0f, 6.0f, 7.0f};  // means (0+2)/2, (3+5)/2
  const std::vector<float> expected_scores{0.3f, 0.2f, 0.9f, 0.8f, 0.0f, 0.0f};
  const std::vector<float> expected_counts{2, 2, 1, 1, 1, 1};
  for (int64_t slot = 0; slot < 6; ++slot) {
    EXPECT_FLOAT_EQ(keys[0][0][slot][0].item<float>(), expected_keys[slot]) << "slot " << slot;
    EXPECT_FLOAT_EQ(values[0][0][slot][0].item<float>(), 10 * expected_keys[slot]) << "slot " << slot;
    EXPECT_FLOAT_EQ(out_scores[0][0][slot].item<float>(), expected_scores[slot]) << "slot " << slot;
    EXPECT_FLOAT_EQ(counts[0][0][slot].item<float>(), expected_counts[slot]) << "slot " << slot;
  }
}

TEST(ZSMergeOps, DecodeStepByHand) {
  // residual 1, context 2, recent 2, ring_position 1; one new token. d = 2.
  // slot:   0 (residual, w 3)   1 (ctx)   2 (ctx)   3 (ring, newest)  4 (ring, oldest)  5 (new)
  const auto keys = at::tensor({1.f, 0.f, 0.f, 1.f, 1.f, 1.f, 2.f, 2.f, 3.f, 3.f, 4.f, 4.f}).view({1, 1, 6, 2});
  const auto values = keys * 10;
  const auto scores = at::tensor({0.5f, 0.7f, 0.2f, 0.6f, 0.4f, 0.9f}).view({1, 1, 6});
  const auto counts = at::tensor({3.f, 1.f, 1.f, 1.f, 1.f, 1.f}).view({1, 1, 6});
  call_decode(keys, values, scores, counts, 1, 2, 2, 1);
  // i* = slot 2 (0.2); merges into slot 0: k = (1 * (1, 1) + 3 * (1, 0)) / 4 = (1, 0.25), w = 4, s = max(.2, .5).
  // The oldest ring token (slot 3 + 1 = 4) moves into slot 2, the new token into slot 4.
  const std::vector<float> expected_keys{1.f, 0.25f, 0.f, 1.f, 3.f, 3.f, 2.f, 2.f, 4.f, 4.f};
  const auto got = keys.narrow(2, 0, 5).flatten();
  for (int64_t k = 0; k < 10; ++k) EXPECT_FLOAT_EQ(got[k].item<float>(), expected_keys[k]) << "element " << k;
  EXPECT_TRUE(at::allclose(values.narrow(2, 0, 5), keys.narrow(2, 0, 5) * 10));
  const std::vector<float> expected_scores{0.5f, 0.7f, 0.4f, 0.6f, 0.9f}, expected_counts{4, 1, 1, 1, 1};
  for (int64_t slot = 0; slot < 5; ++slot) {
    EXPECT_FLOAT_EQ(scores[0][0][slot].item<float>(), expected_scores[slot]) << "slot " << slot;
    EXPECT_FLOAT_EQ(counts[0][0][slot].item<float>(), expected_counts[slot]) << "slot " << slot;
  }
}

TEST(ZSMergeOps, ErrorNamesTheOpAndTheValue) {
  const auto keys = at::zeros({1, 2, 10, 4});
  const auto scores = at::zeros({1, 2, 10});
  try {
    call_decode(keys, keys.clone(), scores, scores.clone(), 3, 3, 4, 2);
    FAIL() << "ring_position 3 with recent 3 was accepted";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("kvcomp::zsmerge_decode_step"), std::string::npos) << message;
    EXPECT_NE(message.find("ring_position in [0, recent) = [0, 3), got 3"), std::string::npos) << message;
  }
  try {
    call_prefill(keys, keys, scores, 3, 4, 4);
    FAIL() << "T = 10 tokens into M = 11 slots was accepted";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("kvcomp::zsmerge_prefill"), std::string::npos) << message;
    EXPECT_NE(message.find("T = keys.size(2) >= M = recent + context + residual = 11, got T = 10"), std::string::npos)
        << message;
  }
}

}  // namespace
