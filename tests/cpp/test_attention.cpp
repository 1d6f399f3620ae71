// GoogleTest of the attention family: the device-free math (log-weights, causal limit, online-softmax step, masked-row
// convention, the CPU kernels' slot chunks) against hand computations, and the registered CPU kernels through the
// dispatcher.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <set>
#include <tuple>
#include <vector>

#include "kernels/attention.h"

namespace {

namespace k = kvcomp::kernels;
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(MergeCountBias, HandValues) {
  EXPECT_FLOAT_EQ(k::merge_count_bias(3.0f, 1.0f), std::log(3.0f));
  EXPECT_FLOAT_EQ(k::merge_count_bias(3.0f, 0.6f), 0.6f * std::log(3.0f));
  EXPECT_EQ(k::merge_count_bias(1.0f, 0.6f), 0.0f);  // a plain token
  EXPECT_EQ(k::merge_count_bias(5.0f, 0.0f), 0.0f);  // alpha 0: pure eviction
  EXPECT_EQ(k::merge_count_bias(1e-30f, 0.0f), 0.0f);
  for (const float alpha : {0.0f, 0.6f, 1.0f}) EXPECT_EQ(k::merge_count_bias(0.0f, alpha), -kInf) << alpha;
  EXPECT_TRUE(std::isnan(k::merge_count_bias(-1.0f, 1.0f)));
  EXPECT_TRUE(std::isnan(k::merge_count_bias(std::nanf(""), 0.6f)));
}

TEST(CausalSlotCount, QueryJSeesSlotsUpToTMinusQPlusJ) {
  EXPECT_EQ(k::causal_slot_count(0, 3, 10), 8);   // slots 0..7
  EXPECT_EQ(k::causal_slot_count(2, 3, 10), 10);  // the newest query sees everything
  EXPECT_EQ(k::causal_slot_count(0, 1, 10), 10);  // decoding: one query, all slots
  EXPECT_EQ(k::causal_slot_count(0, 4, 4), 1);    // prefill: the first token sees itself only
}

TEST(SlotAttended, CausalLimitAndMinusInfinity) {
  EXPECT_TRUE(k::slot_attended(7, 8, 0.0f));
  EXPECT_FALSE(k::slot_attended(8, 8, 0.0f));
  EXPECT_FALSE(k::slot_attended(0, 8, -kInf));
  EXPECT_TRUE(k::slot_attended(0, 8, std::log(3.0f)));
}

TEST(ShiftedExp, AllMinusInfinitySetGivesZeroNotNan) {
  EXPECT_EQ(k::shifted_exp(-kInf, -kInf), 0.0f);
  EXPECT_EQ(k::shifted_exp(-kInf, 2.0f), 0.0f);
  EXPECT_FLOAT_EQ(k::shifted_exp(1.0f, 3.0f), std::exp(-2.0f));
  EXPECT_FLOAT_EQ(k::shifted_exp(3.0f, 3.0f), 1.0f);
}

k::SoftmaxPartial partial_of(const std::vector<float>& logits) {
  float max = -kInf;
  for (const float l : logits) max = std::fmax(max, l);
  k::SoftmaxPartial p{max, 0.0f};
  for (const float l : logits) p.sum += k::shifted_exp(l, max);
  return p;
}

TEST(Combine, TwoChunksEqualTheWholeSet) {
  const k::SoftmaxPartial a = partial_of({1.0f, 2.0f}), b = partial_of({3.0f, -kInf});
  const k::SoftmaxPartial both = k::combine(a, b);
  EXPECT_FLOAT_EQ(both.max, 3.0f);
  EXPECT_FLOAT_EQ(both.sum, std::exp(-2.0f) + std::exp(-1.0f) + 1.0f);
  const k::SoftmaxPartial swapped = k::combine(b, a);
  EXPECT_FLOAT_EQ(swapped.max, both.max);
  EXPECT_FLOAT_EQ(swapped.sum, both.sum);
}

TEST(Combine, EmptyChunkIsTheIdentityAndTwoEmptyStayEmpty) {
  const k::SoftmaxPartial a = partial_of({0.5f, -1.0f}), empty;
  EXPECT_FLOAT_EQ(k::combine(a, empty).max, a.max);
  EXPECT_FLOAT_EQ(k::combine(empty, a).sum, a.sum);
  const k::SoftmaxPartial none = k::combine(empty, partial_of({-kInf, -kInf}));
  EXPECT_EQ(none.max, -kInf);
  EXPECT_EQ(none.sum, 0.0f);  // not NaN
  EXPECT_EQ(k::inverse_sum(none.sum), 0.0f);
}

TEST(Combine, OnlineSoftmaxOverAnySplitMatchesTheDirectSoftmax) {
  const std::vector<float> logits = {0.3f, -2.0f, 4.5f, -kInf, 1.25f, 4.0f, -0.5f};
  const k::SoftmaxPartial direct = partial_of(logits);
  for (size_t split = 0; split <= logits.size(); ++split) {
    k::SoftmaxPartial online;  // one slot at a time, as a running update
    for (size_t i = 0; i < split; ++i) online = k::combine(online, partial_of({logits[i]}));
    const k::SoftmaxPartial rest = partial_of(std::vector<float>(logits.begin() + split, logits.end()));
    const k::SoftmaxPartial total = k::combine(online, rest);
    EXPECT_FLOAT_EQ(total.max, direct.max) << split;
    EXPECT_NEAR(total.sum, direct.sum, 1e-6f) << split;
    // Probability of slot 2 through its chunk: exp(l - chunk max) * chunk_normaliser == softmax.
    const float chunk_max = split > 2 ? online.max : rest.max;
    EXPECT_NEAR(k::shifted_exp(logits[2], chunk_max) * k::chunk_normaliser(chunk_max, total),
                std::exp(4.5f - direct.max) / direct.sum, 1e-6f)
        << split;
  }
}

TEST(InverseSum, EmptyRowIsZeroNanStaysNan) {
  EXPECT_EQ(k::inverse_sum(0.0f), 0.0f);
  EXPECT_FLOAT_EQ(k::inverse_sum(4.0f), 0.25f);
  EXPECT_TRUE(std::isnan(k::inverse_sum(std::nanf(""))));
  EXPECT_EQ(k::chunk_normaliser(-kInf, k::SoftmaxPartial{}), 0.0f);
}

// ---------------------------------------------------------------------------------------------------------------
// Through the dispatcher.

TEST(ChunksPerPair, EnoughTasksForManyThreadsWithinBounds) {
  EXPECT_EQ(k::chunks_per_pair(3, 48), 16);   // SmolLM2's 3 kv heads: 22 wanted, 16 at most
  EXPECT_EQ(k::chunks_per_pair(6, 128), 11);  // ceil(64 / 6)
  EXPECT_EQ(k::chunks_per_pair(64, 128), 1);
  EXPECT_EQ(k::chunks_per_pair(200, 128), 1);
  EXPECT_EQ(k::chunks_per_pair(3, 5), 5);     // at most the op's own bound
  EXPECT_EQ(k::chunks_per_pair(1, 1), 1);
  EXPECT_EQ(k::chunks_per_pair(3, 0), 1);     // a pair always has one chunk, however short
}

TEST(DecodeSlotChunks, CoverEverySlotOnceInAlignedChunksOfAtLeastTheMinimum) {
  struct Case { int64_t pairs, max_len, align; };
  for (const Case c : {Case{3, 2048, 1}, Case{3, 4096, 1}, Case{1, 4100, 1}, Case{8, 32768, 1}, Case{64, 32768, 1},
                       Case{3, 1000, 1}, Case{3, 1, 1}, Case{4, 4100, 16}, Case{4, 4100, 24}, Case{2, 5, 16},
                       Case{12, 4096, 1}, Case{3, 100000, 16}}) {
    const k::SlotChunks chunks = k::decode_slot_chunks(c.pairs, c.max_len, c.align);
    SCOPED_TRACE(testing::Message() << "pairs " << c.pairs << ", max_len " << c.max_len << ", align " << c.align);
    EXPECT_GE(chunks.count, 1);
    EXPECT_LE(chunks.count, k::chunks_per_pair(c.pairs, c.max_len / k::kMinChunkSlots));
    EXPECT_EQ(chunks.len % c.align, 0);
    EXPECT_GE(chunks.len * chunks.count, c.max_len);               // every slot in a chunk
    EXPECT_LT(chunks.len * (chunks.count - 1), c.max_len);         // and no chunk left empty
    if (c.max_len >= k::kMinChunkSlots) EXPECT_GE(chunks.len, k::kMinChunkSlots);
  }
  // SmolLM2 decoding (3 kv heads): one chunk below 2048 slots, then about 1024 slots a chunk, 16 at most.
  EXPECT_EQ(k::decode_slot_chunks(3, 2047, 1).count, 1);
  EXPECT_EQ(k::decode_slot_chunks(3, 2048, 1).count, 2);
  EXPECT_EQ(k::decode_slot_chunks(3, 4096, 1).count, 4);
  EXPECT_EQ(k::decode_slot_chunks(3, 65536, 1).count, 16);
  EXPECT_EQ(k::decode_slot_chunks(64, 65536, 1).count, 1);  // enough tasks already
}

TEST(AttentionOps, CpuKernelsAreRegistered) {
  for (const char* name : {"kvcomp::merge_count_bias", "kvcomp::decode_attention"}) {
    const auto op = c10::Dispatcher::singleton().findOp({name, ""});
    ASSERT_TRUE(op.has_value()) << name;
    EXPECT_TRUE(op->hasKernelForDispatchKey(c10::DispatchKey::CPU)) << name;
  }
}

at::Tensor call_merge_count_bias(const at::Tensor& counts, double alpha) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvcomp::merge_count_bias", "")
                             .typed<at::Tensor(const at::Tensor&, double)>();
  return op.call(counts, alpha);
}

std::tuple<at::Tensor, at::Tensor> call_decode_attention(const at::Tensor& query, const at::Tensor& keys,
                                                         const at::Tensor& values, const at::Tensor& log_weights,
                                                         double scale) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvcomp::decode_attention", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, double)>();
  return op.call(query, keys, values, log_weights, scale);
}

TEST(MergeCountBiasOp, VectorLoopAgreesWithTheScalarMath) {
  // 37 counts: two full SIMD vectors and a tail, with every special value in both.
  const std::vector<float> specials = {0.0f, 1.0f, 3.0f, 0.5f, 1e-30f, 1e30f, kInf, -1.0f, std::nanf(""), -0.0f, 7.0f};
  std::vector<float> counts(37);
  for (size_t i = 0; i < counts.size(); ++i) counts[i] = specials[i % specials.size()];
  const auto tensor = at::from_blob(counts.data(), {1, 1, 37}, at::kFloat).clone();
  for (const double alpha : {0.0, 0.6, 1.0}) {
    const auto out = call_merge_count_bias(tensor, alpha).contiguous();
    const float* got = out.data_ptr<float>();
    for (size_t i = 0; i < counts.size(); ++i) {
      const float expected = k::merge_count_bias(counts[i], static_cast<float>(alpha));
      if (std::isnan(expected)) {
        EXPECT_TRUE(std::isnan(got[i])) << "count " << counts[i] << " alpha " << alpha;
      } else if (std::isinf(expected)) {
        EXPECT_EQ(got[i], expected) << "count " << counts[i] << " alpha " << alpha;
      } else {
        EXPECT_NEAR(got[i], expected, 1e-5f * std::fabs(expected) + 1e-6f) << "count " << counts[i] << " alpha " << alpha;
      }
    }
  }
}

TEST(DecodeAttentionOp, MatchesTensorFormulaOnCausalGqa) {
  at::manual_seed(0);
  const int64_t batch = 2, kv_heads = 2, group = 3, queries = 2, total = 11, dim = 20;
  const auto query = at::randn({batch, kv_heads * group, queries, dim});
  const auto keys = at::randn({batch, kv_heads, total, dim});
  const auto values = at::randn({batch, kv_heads, total, dim});
  auto log_weights = at::rand({batch, kv_heads, total}).mul(3).add(1).log();
  log_weights.index_put_({0, 1, 4}, -kInf);
  const double scale = 0.3;

  const auto bias = log_weights.repeat_interleave(group, 1).unsqueeze(2);
  auto logits = at::matmul(query, keys.repeat_interleave(group, 1).transpose(-1, -2)) * scale + bias;
  const auto causal = at::ones({queries, total}, at::kBool).tril(total - queries);
  logits = logits.masked_fill(causal.logical_not(), -kInf);
  const auto probs = logits.softmax(-1);
  const auto expected = at::matmul(probs, values.repeat_interleave(group, 1));

  const auto [out, got_probs] = call_decode_attention(query, keys, values, log_weights, scale);
  EXPECT_TRUE(at::allclose(out, expected, 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(got_probs, probs, 1e-5, 1e-6));
  EXPECT_EQ(got_probs.index({0, 3, 0, 4}).item<float>(), 0.0f);     // -inf slot of kv head 1
  EXPECT_EQ(got_probs.index({1, 0, 0, total - 1}).item<float>(), 0.0f);  // causally masked
}

// Sets torch's thread count for one test and gives the earlier count back when the test ends.
class ThreadCountForTest {
 public:
  explicit ThreadCountForTest(int threads) : before_(at::get_num_threads()) { at::set_num_threads(threads); }
  ~ThreadCountForTest() { at::set_num_threads(before_); }

 private:
  int before_;
};

TEST(CpuThreads, ParallelLoopsRunOnTheThreadsTorchIsGiven) {
  // Built without -fopenmp (CMakeLists.txt and setup.py add it), at::parallel_for runs its body on the calling thread
  // whatever at::set_num_threads says, and no test here would reach a kernel's threaded path.
  const ThreadCountForTest two_threads(2);
  std::mutex mutex;
  std::set<int> threads_seen;
  at::parallel_for(0, 64, 1, [&](int64_t, int64_t) {
    const std::lock_guard<std::mutex> lock(mutex);
    threads_seen.insert(at::get_thread_num());
  });
  EXPECT_EQ(threads_seen.size(), 2u);
}

TEST(DecodeAttentionOp, SameBitsOnOneThreadAndOnTwo) {
  // One (batch, kv head) of 4100 slots runs as slot chunks, which two threads finish in either order, and whichever
  // finishes last combines them: the bits must not depend on which one that was.
  at::manual_seed(1);
  const auto query = at::randn({1, 3, 1, 64});
  const auto keys = at::randn({1, 1, 4100, 64});
  const auto values = at::randn({1, 1, 4100, 64});
  const auto log_weights = at::rand({1, 1, 4100}).log();
  const double scale = 0.125;
  at::Tensor one_thread_out, one_thread_probs;
  {
    const ThreadCountForTest one_thread(1);
    std::tie(one_thread_out, one_thread_probs) = call_decode_attention(query, keys, values, log_weights, scale);
  }
  const ThreadCountForTest two_threads(2);
  for (int repeat = 0; repeat < 20; ++repeat) {
    const auto [out, probs] = call_decode_attention(query, keys, values, log_weights, scale);
    ASSERT_TRUE(at::equal(out, one_thread_out)) << "repeat " << repeat;
    ASSERT_TRUE(at::equal(probs, one_thread_probs)) << "repeat " << repeat;
  }
}

TEST(AttentionOps, ErrorsNameTheOpAndTheValue) {
  const auto query = at::zeros({1, 4, 1, 8}), cache = at::zeros({1, 2, 3, 8}), log_weights = at::zeros({1, 2, 3});
  const auto expect_error = [](const auto& call, const std::string& op, const std::string& value) {
    try {
      call();
      ADD_FAILURE() << value << " was accepted";
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_NE(message.find(op), std::string::npos) << message;
      EXPECT_NE(message.find(value), std::string::npos) << message;
    }
  };
  expect_error([&] { call_decode_attention(query, cache, cache, log_weights, -0.5); }, "kvcomp::decode_attention",
               "-0.5");
  expect_error([&] { call_decode_attention(query, cache, cache.narrow(2, 0, 2), log_weights, 1.0); },
               "kvcomp::decode_attention", "values of shape [1, 2, 2, 8]");
  expect_error([&] { call_merge_count_bias(log_weights, -0.25); }, "kvcomp::merge_count_bias", "-0.25");
}

}  // namespace
