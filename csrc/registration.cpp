// Every kvcomp operator schema, in one place. Kernels live in csrc/cpu/<family>.cpp and csrc/cuda/<family>.cu,
// shared validation in csrc/include/kvcomp/<family>.h, device-free math in csrc/kernels/<family>.h, Python fakes in
// kvpress_cpp/_fake.py and typed wrappers in kvpress_cpp/ops.py.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <string>
#include <vector>

TORCH_LIBRARY(kvcomp, m) {
  // scores family: fold the attention probabilities of q new queries (B, Hq, q, T) into per-kv-head float32 scores
  // (B, H, T - q) -> (B, H, T): out = decay^q * scores + input_scale * sum_j decay^(q-1-j) * sum_g attn[g, j].
  m.def("update_scores(Tensor scores, Tensor attn, float decay, float input_scale) -> Tensor");

  // attention family: per-slot float32 log-weights b (0 plain token, alpha * ln w merged slot, -inf evicted/padding)
  // and the decode attention that adds them to the logits.
  // merge counts or votes (B, H, T) float32 -> log-weights (B, H, T): alpha * ln w for w > 0, -inf for w == 0.
  m.def("merge_count_bias(Tensor counts, float alpha) -> Tensor");
  // softmax(scale * q.k + b) v of q new queries (B, Hq, q, d) over keys/values (B, H, T, d), causal over the last q
  // slots, GQA without repeating K/V -> (out (B, Hq, q, d) in the query dtype, probs (B, Hq, q, T) float32).
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor log_weights, float scale) -> (Tensor, Tensor)");

  // paged_attention family: decode_attention over a paged cache. Keys, values (N, S, d) and log-weights (N, S) float32
  // live in a pool of N blocks of S slots; (b, h) holds lengths[b, h] slots in the blocks block_tables[b, h, :]
  // (B, H, max_blocks) int64, slot t at block_tables[b, h, t // S], offset t % S. q new queries (B, Hq, q, d) are the
  // last q slots of each (b, h) (causal; a (b, h) shorter than q gives its first queries output 0) -> (out (B, Hq, q, d)
  // in the query dtype, probs (B, Hq, q, max length) float32 over each head's slots, 0 beyond its length; probs has
  // width 0 unless return_probs). max_len, where the caller knows it (a cache that keeps its lengths on the host), is
  // the width of probs and a bound on every length; the tables' contents are then checked on the device by a kernel
  // queued before the attention's (a device-side assert) instead of on the host, so that a GPU call does not sync.
  m.def("paged_decode_attention(Tensor query, Tensor key_blocks, Tensor value_blocks, Tensor log_weight_blocks, "
        "Tensor block_tables, Tensor lengths, float scale, bool return_probs, int? max_len=None) -> (Tensor, Tensor)");

  // weightedkv family: `evictions` greedy steps of WeightedKV's Algorithm 1 on each (batch, kv-head), in place: evict the
  // middle slot (not the first `sinks`, not the last `recent`) of least mean sums/counts, fold its value into its right
  // neighbour's, weighted by the two means, and shift the later slots left. keys (B, H, T, d), values (B, H, T, d_v),
  // sums, counts (B, H, T) float32; slots [0, T - evictions) are the result. merge_values=False is the paper's
  // eviction-only ablation (values dropped). Each (batch, kv head) row contiguous, the rows at any increasing stride
  // (a paged cache's strided view over its block pools is updated without a copy).
  m.def(
      "weightedkv_evict(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) sums, Tensor(d!) counts, int sinks, int recent, "
      "int evictions, bool merge_values=True) -> ()");

  // zsmerge family, cache of M = residual + context + recent slots per (batch, kv-head) (layout in
  // csrc/kernels/zsmerge.h). Prefill of T >= M tokens: keys/values (B, H, T, d), scores (B, H, T) float32 ->
  // keys, values (B, H, M, d), scores, counts (B, H, M) float32: the last `recent` tokens, the top-`context` of the
  // rest by score (ties to the lower position, NaN lowest), the others averaged into `residual` contiguous groups.
  m.def("zsmerge_prefill(Tensor keys, Tensor values, Tensor scores, int recent, int context, int residual) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  // In place, for q >= 1 new tokens appended at slots [M, M + q) of keys/values (B, H, M + q, d) and scores/counts
  // (B, H, M + q) float32, one at a time: evict the context argmin i*, merge it into the residual slot of largest
  // k_i* . k_j (counts-weighted mean, counts add, scores max), move the oldest recent token (ring slot
  // (ring_position + t) mod recent) into i* and the new token into its ring slot. Slots [0, M) are the result.
  // paper_order (Algorithm 1 of the paper): the leaving recent token is a candidate of the argmin too (ties to the
  // context), and when it is evicted the new token simply takes its ring slot. Each (batch, kv head) row contiguous, the
  // rows at any increasing stride (a paged cache's strided view over its block pools is updated without a copy).
  m.def("zsmerge_decode_step(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) scores, Tensor(d!) counts, "
        "int ring_position, int recent, int context, int residual, bool paper_order=False) -> ()");

  // keepkv family. keys (B, H, T, d), keep (B, H, T) bool -> targets (B, H, T) int64: -1 retained; for an evicted
  // slot the retained slot of its row with the highest key cosine similarity (float32 rounded to 2^-16, zero keys 0
  // with finite keys, a non-finite key NaN with all, NaN as -inf, ties to the lower slot) if that similarity >=
  // threshold in [-1, 1], else -2. max_evicted: a bound on the evicted slots of any row (a decoding step's new
  // tokens), which spares CUDA its host sync; a row over it is still matched.
  m.def("keepkv_match(Tensor keys, Tensor keep, float threshold, int? max_evicted=None) -> Tensor");
  // KeepKV's ZIP merge of each retained slot c with the evicted slots targeting it (eq. 7, set form, log domain):
  // keys, values (B, H, T, d), votes p, log_scores ln s, targets (B, H, T) -> merged keys, values, votes (B, H, T, .);
  // the convex key where eq. 7's is ill-conditioned (kernels::zip_guard_passes), and for every set with convex=True
  // (the authors' released variant). Evicted slots keep their inputs.
  // check_targets=False skips CUDA's host-synced check of targets (straight from keepkv_match); CPU always checks.
  m.def("keepkv_zip_merge(Tensor keys, Tensor values, Tensor votes, Tensor log_scores, Tensor targets, bool convex, "
        "bool check_targets=True) -> (Tensor, Tensor, Tensor)");
  // One KeepKV decoding step of a layer, for q >= 1 new tokens at the end of keys, values (B, H, T, d): the EMA of
  // every slot's score (eq. 8, log domain, S <- β^q S + Σ_j (1-β) β^(q-1-j) s̄_j with s̄ the group mean of
  // exp(q·k·scale), recovered from the attention's probabilities (B, Hq, q, T) and log_weights b (B, H, T) as
  // ln p - b + LSE) and each slot's age; log_ema, age, votes (B, H, T - q) are the slots' before the step (the new
  // tokens start at -inf, 0, 1). If T > budget, the T - budget slots of lowest ln ŝ = ln S - ln(1 - β^age) (ties to
  // the lower slot; not the first `sinks` nor the last `recent`) are evicted, each ZIP-merged (as keepkv_zip_merge,
  // fed ln ŝ) into its most similar retained slot (as keepkv_match) or dropped; a merged slot takes its set's
  // vote-weighted mean ŝ and oldest age. keys and values are updated in place (contiguous (batch, kv head) rows in
  // order, at any stride: a paged cache's view over its block pools): their first min(T, budget) slots become the
  // retained slots in order, merged. -> log_ema, age, votes, log_weights = ln votes (B, H, min(T, budget)) float32 of
  // those slots, and dropped (B, H): the votes of the slots dropped without merge.
  m.def("keepkv_decode_step(Tensor(a!) keys, Tensor(b!) values, Tensor queries, Tensor probabilities, "
        "Tensor log_weights, Tensor log_ema, Tensor age, Tensor votes, float scale, float ema_decay, int budget, "
        "int sinks, int recent, float threshold, bool convex) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");

  // gvote family (prefill only). Nucleus budget of the last prompt query: probs (B, Hq, T) float32 -> (B, Hq) int64,
  // the smallest k >= 1 with (sum of the k largest) >= p * (row sum), NaN and negative entries counting as 0 mass.
  m.def("nucleus_budget(Tensor probs, float p) -> Tensor");
  // RoPE with the rotary tables averaged over n_f future positions: queries (B, Hq, S, d) pre-RoPE, cos / sin (n_f, d)
  // -> q * mean(cos) + rotate_half(q) * mean(sin), (B, Hq, S, d) in the queries' dtype.
  m.def("averaged_rope(Tensor queries, Tensor cos, Tensor sin) -> Tensor");
  // Union keep mask: keys (B, H, T, d), queries (B, Hq, S, d), budgets (B, Hq) int64 -> keep (B, H, T) bool, the union
  // over the G query heads of each kv head and their S samples of each sample's top-budget keys by scale * q.k (ties
  // to the lower slot, NaN lowest), plus the first `sinks` slots; at most chunk_size rows of T logits at a time.
  m.def("gvote_union_mask(Tensor keys, Tensor queries, Tensor budgets, int sinks, float scale, int chunk_size) "
        "-> Tensor");

  // kvzap family. The KVzap surrogate of one layer on its attention input: hidden (B, T, Dh) -> log-scores (B, H, T)
  // float32; linear (weight1 (H, Dh), bias1 (H)) or MLP (weight1 (Dh', Dh), bias1 (Dh'), exact GELU, weight2 (H, Dh'),
  // bias2 (H)), weights and biases in the dtype of hidden; GEMMs by ATen, bias / GELU / layout fused around them.
  m.def("kvzap_score(Tensor hidden, Tensor weight1, Tensor bias1, Tensor? weight2=None, Tensor? bias2=None) -> Tensor");
  // KVzap's DMS-style keep rule for a pass that took the cache from tokens_before to tokens_after tokens: every slot
  // whose absolute position (positions (B, H, T) int64) left the window of the last `window` tokens in this pass,
  // [max(0, tokens_before - window), max(0, tokens_after - window)), is evicted iff its score < threshold.
  // log_weights, scores (B, H, T) float32 -> (log_weights with -inf on the evicted slots, held (B, H) int64: the
  // slots of each row whose log-weight is not -inf).
  m.def("kvzap_threshold(Tensor log_weights, Tensor scores, Tensor positions, float threshold, int window, "
        "int tokens_before, int tokens_after) -> (Tensor, Tensor)");
  // KVzap's decoding pass on a rectangular cache, as one op: kvzap_score of the q new tokens' attention input hidden
  // (B, q, Dh), appended to the state's scores and positions (B, H, T) (float32, int64; the new tokens' positions are
  // tokens_before .. tokens_before + q - 1), then kvzap_threshold over the grown state for the pass tokens_before ->
  // tokens_before + q. log_weights (B, H, T + q) float32 are the layer's, the new tokens' slots last. -> (log_weights,
  // scores, positions: (B, H, T + q) each, held (B, H) int64).
  m.def("kvzap_decode_step(Tensor hidden, Tensor weight1, Tensor bias1, Tensor? weight2, Tensor? bias2, "
        "Tensor log_weights, Tensor scores, Tensor positions, float threshold, int window, int tokens_before) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  // kvzap_threshold's decoding pass on a paged cache, in place in its per-slot pools: log-weights, scores (N, S)
  // float32 and positions (N, S) int64, read through block_tables (B, H, max_blocks) and lengths (B, H) as in
  // paged_decode_attention (each block owned by one (b, h)). The q new tokens, each (b, h)'s last q slots, get the
  // positions tokens_before .. tokens_before + q - 1 and their scores new_scores (B, H, q) float32. The D tokens that
  // leave the window in this pass must then be each (b, h)'s slots length - window - D .. length - window - 1 (every
  // older token is decided, every later one in the window): where those slots hold exactly their positions, they are
  // decided as kvzap_threshold decides them. -> held (B, H) int64: how many of them each (b, h) holds, or -1 where they
  // are not there (log-weights untouched; kvzap_threshold over the (b, h)'s view then decides them, as it would have).
  // check_tables_on_device: on a GPU, the tables' contents are checked in the kernel (a device-side assert) rather than
  // before it on the host (one host sync), lengths and ranges only: blocks shared between (b, h) are found by the host
  // check alone. A CPU call checks them on the host either way.
  m.def("kvzap_paged_step(Tensor(a!) log_weight_blocks, Tensor(b!) score_blocks, Tensor(c!) position_blocks, "
        "Tensor block_tables, Tensor lengths, Tensor new_scores, float threshold, int window, int tokens_before, "
        "bool check_tables_on_device=False) -> Tensor");

  // prompt_scores family (prefill scoring without P.V; math in csrc/kernels/prompt_scores.h). The q newest prompt
  // queries (B, Hq, q, d) over keys (B, H, T, d) with log-weights b (B, H, T) float32, causal, GQA without repeating
  // keys. Log-sum-exp of every query row of scale * q.k + b -> (B, Hq, q) float32 (-inf for a row that sees nothing).
  m.def("prompt_log_sum_exp(Tensor query, Tensor keys, Tensor log_weights, float scale) -> Tensor");
  // Scores (B, H, T) float32: s_i = sum_j input_scale * decay^(q-1-j) * sum_g exp(scale * q_gj.k_i + b_i - lse_gj),
  // decay in (0, 1]; older queries whose total weight is below float32 resolution of a key tile's scores are skipped.
  m.def("prompt_scores(Tensor query, Tensor keys, Tensor log_weights, Tensor log_sum_exp, float scale, float decay, "
        "float input_scale) -> Tensor");
  // The prompt's attention and its scores from one QK^T (CPU): values (B, H, T, d) -> the attention output
  // softmax(scale * q.k + b) v as (B, q, Hq, d) in the query dtype (the layout the model's attention returns; 0 for a
  // row that sees nothing), its log-sum-exp (B, Hq, q) float32 and prompt_scores' scores (B, H, T) float32.
  m.def("prompt_attention_with_scores(Tensor query, Tensor keys, Tensor values, Tensor log_weights, float scale, "
        "float decay, float input_scale) -> (Tensor, Tensor, Tensor)");
  // The log of the scores without a softmax (KeepKV's EMA over its recent window), (B, H, T) float32:
  // ln sum_j input_scale * decay^(q-1-j) * sum_g exp(scale * q_gj.k_i + b_i), causal, decay in (0, 1),
  // input_scale > 0; -inf for a slot no query sees. An online log-sum-exp per slot: no overflow whatever the logits.
  m.def("prompt_log_unnormalised_scores(Tensor query, Tensor keys, Tensor log_weights, float scale, float decay, "
        "float input_scale) -> Tensor");
}

namespace {

// Every kvcomp op.
constexpr const char* kOps[] = {
    "update_scores",  "merge_count_bias",    "decode_attention",     "paged_decode_attention",
    "zsmerge_prefill", "zsmerge_decode_step", "weightedkv_evict",     "keepkv_match",
    "keepkv_zip_merge", "keepkv_decode_step", "nucleus_budget",       "averaged_rope",
    "gvote_union_mask", "kvzap_score",        "kvzap_threshold",      "kvzap_decode_step",
    "kvzap_paged_step", "prompt_log_sum_exp", "prompt_scores",        "prompt_attention_with_scores",
    "prompt_log_unnormalised_scores"};

// Whether `op` updates arguments in place: a Tensor(a!) in its schema (TORCH_LIBRARY above has defined it by now).
bool updates_in_place(const char* op) {
  const std::string name = std::string("kvcomp::") + op;
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").schema().is_mutable();
}

// Under torch.autocast an op computes in the dtypes it is given, as its fake and its reference do: the ATen GEMMs
// inside some kernels (gvote_union_mask's scores, kvzap_score's surrogate, keepkv_match's similarities) would
// otherwise run in the autocast dtype, silently less precise or refused by the kernel reading their result.
void run_outside_autocast(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  op.redispatchBoxed(keys - c10::autocast_dispatch_keyset, stack);
}

// An op that updates tensors in place bumps their version counters, as torch's in-place ops do: autograd then refuses
// a backward through a tensor it saved before the update, and a paged cache notices an edit of the view it handed
// out (PagedLayer._view_edited_in_place). torch's autogradNotImplementedInplaceOrViewFallback bumps only returned
// tensors, and these ops return none of those they update.
void bump_versions_of_updated(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  std::vector<at::Tensor> updated;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& value = (*stack)[stack->size() - arguments.size() + i];
    const auto* alias = arguments[i].alias_info();
    if (alias != nullptr && alias->isWrite() && value.isTensor()) updated.push_back(value.toTensor());
  }
  {
    at::AutoDispatchBelowADInplaceOrView below;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& tensor : updated) {
    if (!tensor.is_inference()) torch::autograd::increment_version(tensor);  // inference tensors keep no version
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcomp, ADInplaceOrView, m) {
  for (const char* op : kOps) {
    if (updates_in_place(op)) m.impl(op, torch::CppFunction::makeFromBoxedFunction<&bump_versions_of_updated>());
  }
}

// No op has a backward: an output computed from inputs that require grad carries a node that raises
// "derivative for kvcomp::<op> is not implemented" when backward reaches it (instead of torch's default warning and
// silently wrong gradients). The ops that update in place are not listed: they refuse inputs that require grad.
TORCH_LIBRARY_IMPL(kvcomp, Autograd, m) {
  for (const char* op : kOps) {
    if (!updates_in_place(op)) m.impl(op, torch::autograd::autogradNotImplementedFallback());
  }
}

TORCH_LIBRARY_IMPL(kvcomp, AutocastCPU, m) {
  for (const char* op : kOps) m.impl(op, torch::CppFunction::makeFromBoxedFunction<&run_outside_autocast>());
}

TORCH_LIBRARY_IMPL(kvcomp, AutocastCUDA, m) {
  for (const char* op : kOps) m.impl(op, torch::CppFunction::makeFromBoxedFunction<&run_outside_autocast>());
}
