"""Typed wrappers of the kvcomp operators. Shapes: B batch, Hq query heads, H kv heads (G = Hq / H), q new queries,
T cached slots (including the q new ones), d head dim. Scores are always float32; caches may be float32, float16 or
bfloat16.
"""

import torch

from kvpress_cpp._contract import has_contiguous_rows

#: The dtypes of the keys, values and queries the ops compute on (their schemas refuse the others).
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _default_scale(op: str, name: str, t: torch.Tensor) -> float:
    """The attention scale d ** -0.5 from the head dim of ``t`` (its last size), which must be >= 1."""
    if t.dim() == 0 or t.shape[-1] < 1:
        raise RuntimeError(f"kvcomp::{op}: expected a head dim d >= 1 for the default scale d ** -0.5, got {name} of "
                           f"shape {tuple(t.shape)}")
    return t.shape[-1] ** -0.5


def update_scores(scores: torch.Tensor, attn: torch.Tensor, decay: float = 1.0, input_scale: float = 1.0) -> torch.Tensor:
    """Fold the attention of q new queries into per-kv-head scores and extend them for the q new tokens.

    Args:
        scores: (B, H, T - q) float32 scores of the slots cached before this step ((B, H, 0) at prefill).
        attn: (B, Hq, q, T) attention probabilities of the new queries over all T slots, float32, float16 or
            bfloat16; query head h * G + g belongs to kv head h (transformers' GQA layout).
        decay: λ in [0, 1]; each query step multiplies the earlier scores by it.
        input_scale: weight of the new attention (1 for ZSMerge's group sum, 1/G for a group mean).

    Returns:
        (B, H, T) float32: ``decay^q * [scores, 0] + input_scale * Σ_j decay^(q-1-j) Σ_g attn[:, h*G+g, j]``.
        ZSMerge eq. 5 is decay=λ, input_scale=1; WeightedKV's running sum is decay=1, input_scale=1/G. (KeepKV's
        EMA is of unnormalised scores exp(q·k·scale), not of probabilities: its press keeps it in the log domain.)
    """
    return torch.ops.kvcomp.update_scores(scores, attn, decay, input_scale)


def merge_count_bias(counts: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Per-slot log-weights from merge counts: the bias every merging press adds to the attention logits.

    Args:
        counts: (B, H, T) float32 number of tokens each slot stands for (ZSMerge's merge count w) or KeepKV's
            electoral votes p; 0 marks an evicted or padding slot. Counts < 0 or NaN give NaN (not checked: that
            would need a device sync).
        alpha: finite, >= 0 (ZSMerge 0.6, KeepKV 1; 0 gives every held slot bias 0, whatever its count).

    Returns:
        (B, H, T) float32: ``alpha * ln(w)`` where w > 0 (exactly 0 for every w > 0 when alpha = 0), ``-inf`` where
        w == 0.
    """
    return torch.ops.kvcomp.merge_count_bias(counts, alpha)


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    log_weights: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the q newest tokens over a cache whose slots carry log-weights, plus its probabilities.

    ``logit[s] = scale * q·k_s + log_weights[b, h, s]``, softmax over the allowed slots, ``out = Σ_s p_s v_s``.
    The q queries are the last q of the T cached slots: query j attends to slots 0 .. T - q + j (causal). Grouped-query
    attention is native: query head h * G + g reads kv head h, and K and V are never repeated. Float32 accumulation in
    the log domain; a -inf slot is skipped (its key and value are not even read), and a row whose allowed slots are all
    -inf gives output 0 and probabilities 0. On CPU, from T = 2048 on, each kv head's slots are split into up to 16
    chunks (flash-decoding's split, combined in a fixed order) whose number and bounds follow B * H and T alone, so the
    result is the same bits on any number of threads (it may round apart in a batch of another size).

    Args:
        query: (B, Hq, q, d) float32, float16 or bfloat16, 1 <= q <= T.
        keys: (B, H, T, d) same dtype as query, Hq a multiple of H; any strides over (B, H, T) as long as d is
            contiguous (e.g. the first T slots of a preallocated cache are read in place).
        values: (B, H, T, d) same dtype as query.
        log_weights: (B, H, T) float32: 0 for a plain token, alpha * ln w for a slot standing for w tokens
            (:func:`merge_count_bias`), -inf for an evicted or padding slot.
        scale: the model's attention scale, finite and > 0; default ``d ** -0.5``.

    Returns:
        ``(out, probs)``: out (B, Hq, q, d) in the query dtype, probs (B, Hq, q, T) float32 attention probabilities
        (exactly 0 on causally masked and -inf slots), ready for :func:`update_scores`.
    """
    if scale is None:
        scale = _default_scale("decode_attention", "query", query)
    return torch.ops.kvcomp.decode_attention(query, keys, values, log_weights, scale)


def weightedkv_evict(
    keys: torch.Tensor,
    values: torch.Tensor,
    sums: torch.Tensor,
    counts: torch.Tensor,
    sinks: int,
    recent: int,
    evictions: int,
    merge_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """WeightedKV's eviction step (Algorithm 1, lines 7-10), applied ``evictions`` times in a row on every (batch,
    kv head), in place.

    One step: ``ā = sums / counts``; ``j = argmin ā`` over the middle slots, i.e. neither the first ``sinks`` nor the
    last ``recent`` ones (ties to the lower slot, NaN counts as +inf, so all-NaN evicts the first middle slot);
    ``V[j+1] <- (ā_j V[j] + ā_{j+1} V[j+1]) / (ā_j + ā_{j+1})`` (the plain mean when that is 0/0; an infinite ā takes
    its own value alone); then slot j's key, value, sum and count are deleted and the later slots move left.
    ``sums[j+1]`` and ``counts[j+1]`` are kept as they are. Each step recomputes the argmin on the cache the previous
    one left, exactly as ``evictions`` calls with ``evictions=1``; merged values are rounded to the cache dtype after
    every step, as a cache stored in it would hold them, so the two agree bit for bit.

    Args:
        keys: (B, H, T, d) float32, float16 or bfloat16; updated in place.
        values: (B, H, T, d_v), the dtype of keys (d_v may differ from d); updated in place.
        sums: (B, H, T) float32 running attention sums a (``update_scores`` with decay=1, input_scale=1/G); updated
            in place.
        counts: (B, H, T) float32 number of attention rows summed into each slot, n; updated in place.
        sinks: >= 0 leading slots that are never evicted (the paper keeps 4).
        recent: >= 1 trailing slots that are never evicted (the paper: m/2 - 4); at least 1, because the last
            middle slot merges into its right neighbour.
        evictions: 0 <= evictions <= T - sinks - recent steps: 1 when a decoding step took the cache to m + 1,
            T - m to reduce a prefill of T tokens to m slots.
        merge_values: False is the paper's eviction-only ablation: slot j's value is dropped with its key.

    Each argument's (batch, kv head) rows must be contiguous and in order, at any stride (:func:`contiguous_rows`):
    a contiguous tensor, or a :class:`~kvpress_cpp.paged_cache.PagedKVCache` view over its block pools, which is
    then updated where it lies.

    Returns:
        (keys, values, sums, counts)[:, :, :T - evictions]: views of the arguments' first T - e slots, (B, H, T - e, d),
        (B, H, T - e, d_v), (B, H, T - e), (B, H, T - e), the survivors in their original order. The slots after them
        hold stale data.
    """
    torch.ops.kvcomp.weightedkv_evict(keys, values, sums, counts, sinks, recent, evictions, merge_values)
    kept = keys.shape[2] - evictions
    return keys[:, :, :kept], values[:, :, :kept], sums[:, :, :kept], counts[:, :, :kept]


def zsmerge_prefill(
    keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, recent: int, context: int, residual: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compress a prompt's cache of T tokens into ZSMerge's M = residual + context + recent slots (paper 3.2-3.4).

    Output layout per (batch, kv head): slots [0, residual) residual merge slots, [residual, residual + context) the
    context (top-score) tokens, [residual + context, M) the recent ring with its oldest token first (ring_position 0).

    Args:
        keys: (B, H, T, d) post-RoPE keys, float32, float16 or bfloat16, T >= M (T = M: one token per residual slot).
        values: (B, H, T, d) values, the dtype of keys.
        scores: (B, H, T) float32 contribution scores (eq. 5, e.g. from ``update_scores`` with decay=λ).
        recent: Bp >= 1, the last Bp tokens are kept in order.
        context: Bc >= 1, the top-Bc of the tokens [0, T - Bp) by score, kept in position order (ties go to the lower
            position; NaN ranks below every number, -inf included).
        residual: Br >= 0. The other n = T - Bp - Bc tokens, in position order, are split into Br contiguous groups
            (the first n mod Br one token longer); each slot holds the float32 mean of its group's keys and values,
            the group's maximum score (NaN if any is NaN) and its size as count. With Br = 0 they are evicted.

    Returns:
        keys (B, H, M, d), values (B, H, M, d) in the dtype of keys, scores (B, H, M) float32, counts (B, H, M)
        float32 (1 for plain tokens; the counts sum to T, or to M with residual = 0, whose other tokens are evicted).
    """
    return torch.ops.kvcomp.zsmerge_prefill(keys, values, scores, recent, context, residual)


def contiguous_rows(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (B, H, ...) itself when each (batch, kv head) row is contiguous and the rows are in order, at any
    stride (what the in-place decode ops such as :func:`zsmerge_decode_step` take: a contiguous tensor, or a paged
    cache's strided view over its block pools); otherwise a contiguous copy."""
    return tensor if tensor.is_contiguous() or has_contiguous_rows(tensor) else tensor.contiguous()


def zsmerge_decode_step(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    counts: torch.Tensor,
    ring_position: int,
    recent: int,
    context: int,
    residual: int,
    paper_order: bool = False,
) -> None:
    """Fold q >= 1 newly appended tokens into a full ZSMerge cache, in place (Algorithm 1, one token at a time).

    The M = residual + context + recent slots (layout of ``zsmerge_prefill``) are followed by the q new tokens at
    [M, M + q), their scores already updated (``update_scores``) and their counts 1. For each new token t in order,
    per (batch, kv head): i* = argmin of the context scores (NaN counts as +inf, ties to the lower slot); if
    residual > 0, j* = argmax over the residual slots of k_i*·k_j (eq. 6, float32; NaN counts as -inf, ties to the
    lower slot) and slot i* merges into j*: ``k_j <- (w_i k_i + w_j k_j) / (w_i + w_j)``, the same for v,
    ``w_j <- w_i + w_j``, ``s_j <- max(s_i, s_j)`` (NaN propagates); with residual == 0, i* is evicted. Then the
    oldest recent token (slot residual + context + (ring_position + t) mod recent) moves into slot i* and the new
    token (slot M + t, with its score and count) into the ring slot it freed. That is the authors' code; with
    ``paper_order`` (the paper's Algorithm 1) the oldest recent token joins the context before the argmin, so it is
    i* itself when its score is the lowest (ties to the context slot): it merges as above and the new token takes its
    ring slot.

    Args:
        keys: (B, H, M + q, d) float32, float16 or bfloat16; updated in place.
        values: (B, H, M + q, d), the dtype of keys; updated in place.
        scores: (B, H, M + q) float32; updated in place.
        counts: (B, H, M + q) float32 fusion counts w; updated in place.
        ring_position: offset in [0, recent) of the oldest recent token, shared by all heads.
        recent, context, residual: the slot budget (recent >= 1, context >= 1, residual >= 0).
        paper_order: the paper's eviction order instead of the authors' code's.

    Each tensor argument's (batch, kv head) rows must be contiguous and in order, at any stride
    (:func:`contiguous_rows`): a contiguous tensor, or a :class:`~kvpress_cpp.paged_cache.PagedKVCache` view over its
    block pools, which is then updated where it lies.

    Afterwards slots [0, M) hold the compressed cache (slots [M, M + q) are stale): the caller narrows every
    tensor to M and advances ``ring_position = (ring_position + q) % recent``.
    """
    torch.ops.kvcomp.zsmerge_decode_step(keys, values, scores, counts, ring_position, recent, context, residual,
                                         paper_order)


def keepkv_match(keys: torch.Tensor, keep: torch.Tensor, threshold: float = 0.8,
                 max_evicted: int | None = None) -> torch.Tensor:
    """KeepKV's merge targets: each evicted slot's most similar retained slot of the same (batch, kv head).

    Similarity is the key cosine in float32, clamped to [-1, 1] and rounded to the nearest multiple of 2^-16 before
    it is compared (a zero key has similarity 0 with every finite key; a key with a NaN or infinite component has a
    NaN similarity with every key, zero keys included, and NaN counts as -inf: it is matched with nothing; ties go to
    the lower slot). The rounding is the stated tolerance: float32 cosines differ from exact ones by about
    sqrt(d)·6e-8, and by the path, so a key identical to a retained one always has similarity exactly 1 (it merges at
    threshold 1.0) and equally similar retained keys tie exactly, on every path. Keys are rescaled before squaring,
    so magnitudes from 1e-38 to 3e38 give the same cosines, on every path. Rows with few evicted slots (a decoding
    step) compute them directly, others with a GEMM of normalised keys (on CUDA torch's float32 matmul settings
    apply, TF32 only if allowed).

    Args:
        keys: (B, H, T, d) float32, float16 or bfloat16.
        keep: (B, H, T) bool, True for the retained slots.
        threshold: in [-1, 1] (KeepKV's default 0.8); an evicted slot merges only if its best similarity >= threshold.
        max_evicted: a bound ≥ 0 on the evicted slots of any row (e.g. a decoding step's new tokens). On CUDA it
            spares the host sync that reads the largest count, so the call can be captured in a CUDA graph; a row
            evicting more is still matched in full (only slower). None: read it on the device.

    Returns:
        (B, H, T) int64 targets: -1 for a retained slot; for an evicted slot the index t of its retained target, or -2
        (evicted without merge: best similarity below threshold, NaN, or nothing retained in the row).
    """
    return torch.ops.kvcomp.keepkv_match(keys, keep, threshold, max_evicted)


def keepkv_zip_merge(
    keys: torch.Tensor,
    values: torch.Tensor,
    votes: torch.Tensor,
    log_scores: torch.Tensor,
    targets: torch.Tensor,
    convex: bool = False,
    check_targets: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KeepKV's ZIP merge (paper eq. 7, set form) of every retained slot with the evicted slots that target it.

    For retained c and S = {c} ∪ {e : targets[e] == c}, in the log domain (m = max ℓ over S, w = p·exp(ℓ - m), float32
    accumulation): ``k_r = (Σ w k)·(m + ln(Σ w / Σ p)) / (Σ w ℓ)``, ``v_r = Σ w v / Σ w``, ``p_r = Σ p``. For the query
    whose logits gave ℓ, attention with bias ln p is then unchanged by the merge (theorem 3). Guard: when
    |Σ w ℓ| <= 1e-3 · Σ w · max|ℓ| (near-zero denominator), when m + ln(Σ w / Σ p) or Σ w ℓ is not finite, or when
    the ZIP key's growth over the convex key, Σ w · (m + ln(Σ w / Σ p)) / Σ w ℓ, leaves [0.5, 2] (this includes the
    two of other signs; ``kernels::kZipMaxKeyGrowth``), the convex key ``Σ w k / Σ w`` is used instead;
    ``convex=True`` always uses it (the authors' released code). Members with p <= 0, ℓ = -inf or NaN carry w = 0; a
    set with Σ w = 0 keeps c's key and value (its vote still becomes Σ p). Sets of one slot and evicted slots are
    returned unchanged.

    Args:
        keys, values: (B, H, T, d) float32, float16 or bfloat16 (one dtype).
        votes: (B, H, T) float32 electoral votes p >= 0.
        log_scores: (B, H, T) float32 ℓ = ln s (logits q·k·scale, or the log of KeepKV's EMA score estimate).
        targets: (B, H, T) int64 from ``keepkv_match``: -1 retained, -2 evicted without merge, t >= 0 the retained
            slot t of the same row. Anything else raises (on CUDA this check costs one host sync).
        convex: use the convex key for every set.
        check_targets: False skips that check on CUDA (no host sync, so the call can be captured in a CUDA graph)
            for targets straight from ``keepkv_match``; an invalid target then merges nowhere. The CPU always checks.

    Returns:
        keys (B, H, T, d), values (B, H, T, d) in the input dtype and votes (B, H, T) float32, new tensors; the caller
        drops the evicted slots (targets != -1).
    """
    return torch.ops.kvcomp.keepkv_zip_merge(keys, values, votes, log_scores, targets, convex, check_targets)


def keepkv_decode_step(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor,
    probabilities: torch.Tensor,
    log_weights: torch.Tensor,
    log_ema: torch.Tensor,
    age: torch.Tensor,
    votes: torch.Tensor,
    scale: float,
    ema_decay: float,
    budget: int,
    sinks: int,
    recent: int,
    threshold: float = 0.8,
    convex: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One KeepKV decoding step of a layer whose last q slots are the new tokens: EMA update, eviction, ZIP merge and
    packing in one call (no ATen launch per part), keys and values updated in place.

    1. The logits ℓ = q·k·scale of every (query head, new token, slot) come from the attention's probabilities:
       ``ℓ = ln p - b + LSE``, the row's LSE from its slot of largest p (one dot product per row; NaN counts as
       -inf there, so a NaN p makes only its own slot's ℓ NaN); ℓ = -inf where p = 0. s̄ = exp(ℓ) averaged over the
       G query heads of each kv head.
    2. EMA (eq. 8, log domain): ``ln S ← ln(β^q S + Σ_j (1-β) β^(q-1-j) s̄_j)``, the new tokens starting at S = 0,
       age 0, vote 1; every slot's age grows by the new queries that see it (slot t: min(q, T - t)).
    3. If T > budget: the T - budget slots of lowest ``ln ŝ = ln S - ln(1 - β^age)`` (NaN lowest, slots without
       votes first, ties to the lower slot) among neither the first `sinks` nor the last `recent` slots are evicted;
       each merges into its most similar retained slot (``keepkv_match``) with ``keepkv_zip_merge`` fed ln ŝ, or is
       dropped. A merged slot's ŝ is its set's vote-weighted mean Σ p ŝ / Σ p and its age the oldest member's.

    Args:
        keys, values: (B, H, T, d) float32, float16 or bfloat16, the new tokens last, with contiguous (batch, kv head)
            rows in order at any stride (:func:`contiguous_rows`: a paged cache's view is updated in its blocks);
            updated in place, their first T' slots becoming the retained slots.
        queries: (B, Hq, q, d) post-RoPE queries of the new tokens (dtype of keys), Hq a multiple of H.
        probabilities: (B, Hq, q, T) float32, the attention's softmax of ``ℓ + b`` (``decode_attention``).
        log_weights: (B, H, T) float32 bias b that attention added.
        log_ema, age, votes: (B, H, T - q) float32 state of the slots before the new tokens.
        scale: the attention's logit scale. ema_decay: β in (0, 1).
        budget: M > sinks + recent, slots kept per (batch, kv head). threshold: cosine in [-1, 1] a merge needs.
        convex: the convex key for every merge (the authors' released code).

    Returns:
        keys, values: views of the inputs' first T' = min(T, budget) slots (the retained slots in order, merged);
        log_ema, age, votes, log_weights = ln votes (B, H, T') float32 of those slots (new tensors), and dropped
        (B, H) float32: the votes of the slots dropped this step.
    """
    state = torch.ops.kvcomp.keepkv_decode_step(keys, values, queries, probabilities, log_weights, log_ema, age, votes,
                                                 scale, ema_decay, budget, sinks, recent, threshold, convex)
    kept = state[0].shape[-1]
    return (keys.narrow(-2, 0, kept), values.narrow(-2, 0, kept), *state)


def nucleus_budget(probs: torch.Tensor, p: float = 0.95) -> torch.Tensor:
    """GVote's budget (step 1 of its Algorithm 1): the size of the top-p (nucleus) set of each head's attention.

    Args:
        probs: (B, Hq, T) float32 attention probabilities of the last prompt query (e.g. ``decode_attention``'s probs
            with q = 1, squeezed). Rows need not sum to exactly 1: the mass is taken relative to the row sum. NaN,
            negative values and -0 count as mass 0; +inf takes the whole mass for p < 1 (p = 1 counts the support,
            as below).
        p: p_nuc in (0, 1] (paper default 0.95).

    Returns:
        (B, Hq) int64: the smallest k >= 1 with (sum of the k largest masses) >= p * (row sum), the sums accumulated
        in float64 over the masses in descending order. p = 1 gives the support (the number of positive masses)
        exactly; a row without any positive mass gives 1; T = 0 gives 0. Computed on the device, no host sync.
    """
    return torch.ops.kvcomp.nucleus_budget(probs, p)


def averaged_rope(queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE with the rotary tables averaged over the n_f positions after the prompt (GVote step 3).

    ``out = q * mean_f(cos) + rotate_half(q) * mean_f(sin)``, rotate_half(x) = cat(-x[d/2:], x[:d/2]) (transformers'
    convention). By linearity this is the mean over the n_f positions of ``apply_rotary_pos_emb`` applied to q.

    Args:
        queries: (B, Hq, S, d) pre-RoPE queries (e.g. the S sampled hidden states through q_proj / q_norm), float32,
            float16 or bfloat16, d even.
        cos: (n_f, d) rotary cos table of the future positions (transformers' layout: the d/2 frequencies repeated
            twice), any of the three float dtypes, on the device of queries.
        sin: (n_f, d) rotary sin table, same layout.

    Returns:
        (B, Hq, S, d) in the dtype of queries: the means are taken in float64 and rounded to float32 once, the
        product in float32, rounded once to the queries' dtype.
    """
    return torch.ops.kvcomp.averaged_rope(queries, cos, sin)


def gvote_union_mask(
    keys: torch.Tensor,
    queries: torch.Tensor,
    budgets: torch.Tensor,
    sinks: int = 4,
    scale: float | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """GVote's keep set (step 4): the union over samples and over the query heads of a group of each sample's top-k
    keys, plus the sinks.

    For each (batch, query head h, sample s), the k = clamp(budgets[b, h], 0, T) slots of largest logit
    ``scale * q_s·k_t`` (float32; ties go to the lower slot, NaN ranks below every number, -inf included) are kept;
    kv head g keeps the union over its query heads g*G .. g*G + G - 1 and all their samples, plus slots
    [0, min(sinks, T)). The logits come from a batched matmul: on CUDA, torch's float32 matmul settings apply (with
    TF32 allowed, ``torch.backends.cuda.matmul.allow_tf32`` or ``set_float32_matmul_precision("high")``, logits are
    rounded to TF32's 10-bit mantissa, and near-ties may then select other slots than on the CPU).

    Args:
        keys: (B, H, T, d) post-RoPE keys, float32, float16 or bfloat16.
        queries: (B, Hq, S, d) the sampled future queries (post ``averaged_rope``), the dtype of keys, Hq a multiple
            of H.
        budgets: (B, Hq) int64, e.g. from :func:`nucleus_budget`; values outside [0, T] are clamped (on the device).
        sinks: >= 0 first slots always kept (paper: 4).
        scale: finite and > 0; default ``d ** -0.5``. (A positive scale does not change the order, except where
            float32 rounding makes two logits equal.)
        chunk_size: >= 1; at most this many (query head, sample) rows of T float32 logits exist at once (plus, for
            float16 / bfloat16 caches, a float32 copy of the keys of the kv heads of a chunk). The result does not
            depend on it.

    Returns:
        (B, H, T) bool keep mask.
    """
    if scale is None:
        scale = _default_scale("gvote_union_mask", "keys", keys)
    return torch.ops.kvcomp.gvote_union_mask(keys, queries, budgets, sinks, scale, chunk_size)


def kvzap_score(
    hidden: torch.Tensor,
    weight1: torch.Tensor,
    bias1: torch.Tensor,
    weight2: torch.Tensor | None = None,
    bias2: torch.Tensor | None = None,
) -> torch.Tensor:
    """KVzap's surrogate of one layer: predicted log KVzip+ scores of every token for every kv head.

    Linear surrogate (weight2 = bias2 = None): ``x·W1ᵀ + b1``. MLP surrogate: ``GELU(x·W1ᵀ + b1)·W2ᵀ + b2`` with the
    exact (erf) GELU of ``nn.GELU()``. The matrix products are ATen's (MKL / oneDNN, cuBLAS); the bias + GELU pass and
    the final bias + float32 pass are fused kernels, and the last product is computed as ``W·xᵀ`` so it comes out in
    the (B, H, T) layout without a transpose. In float16 / bfloat16 the hidden layer is rounded to that dtype between
    the two products (as the module run in that dtype would); everything else is float32.

    Args:
        hidden: (B, T, Dh) the layer's attention input (the output of its input norm), float32, float16 or bfloat16.
        weight1: (H, Dh) for the linear surrogate, (Dh', Dh) for the MLP; the dtype and device of hidden.
        bias1: (H,) or (Dh',).
        weight2: (H, Dh') for the MLP, else None.
        bias2: (H,) for the MLP, else None.

    Returns:
        (B, H, T) float32 scores (kvpress's ``KVzapPress.score`` layout).
    """
    return torch.ops.kvcomp.kvzap_score(hidden, weight1, bias1, weight2, bias2)


def kvzap_threshold(
    log_weights: torch.Tensor,
    scores: torch.Tensor,
    positions: torch.Tensor,
    threshold: float,
    window: int,
    tokens_before: int,
    tokens_after: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KVzap's keep rule (DMS style) for one pass that took the cache from ``tokens_before`` to ``tokens_after``
    tokens (0 → T at prefill, n → n + q for q new tokens).

    A token is decided once, when it leaves the sliding window of the last ``window`` tokens: the slots whose absolute
    position lies in ``[max(0, tokens_before - window), max(0, tokens_after - window))`` are decided in this pass and
    evicted iff ``score < threshold`` (float32 comparison; NaN scores are kept, as kvpress's DMSPress keeps them).
    Every other slot keeps its log-weight: the window is never evicted, earlier decisions stand.

    Args:
        log_weights: (B, H, T) float32 per-slot log-weights (0 token, -inf evicted or padding).
        scores: (B, H, T) float32 the slots' surrogate scores (any value for slots not decided now).
        positions: (B, H, T) int64 absolute cache position of each slot (any value for padding slots, whose
            log-weight is already -inf).
        threshold: τ, not NaN (±inf allowed).
        window: w ≥ 0 (KVzap: 128).
        tokens_before, tokens_after: 0 ≤ tokens_before ≤ tokens_after.

    Returns:
        (log_weights (B, H, T) float32 with -inf on the slots evicted now, held (B, H) int64: the number of slots of
        each row whose new log-weight is not -inf, so that a caller compacting to the longest head needs no extra
        reduction).
    """
    return torch.ops.kvcomp.kvzap_threshold(log_weights, scores, positions, threshold, window, tokens_before,
                                            tokens_after)


def kvzap_decode_step(
    hidden: torch.Tensor,
    weight1: torch.Tensor,
    bias1: torch.Tensor,
    weight2: torch.Tensor | None,
    bias2: torch.Tensor | None,
    log_weights: torch.Tensor,
    scores: torch.Tensor,
    positions: torch.Tensor,
    threshold: float,
    window: int,
    tokens_before: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """KVzap's decoding pass on a rectangular cache as one op: :func:`kvzap_score` of the q new tokens, appended to
    the state's scores and positions, then :func:`kvzap_threshold` over the grown state for the pass
    ``tokens_before → tokens_before + q``. Equal to::

        new = kvzap_score(hidden, weight1, bias1, weight2, bias2)
        scores = torch.cat([scores, new], -1)
        positions = torch.cat([positions, torch.arange(tokens_before, tokens_before + q).expand(B, H, q)], -1)
        log_weights, held = kvzap_threshold(log_weights, scores, positions, threshold, window, tokens_before,
                                            tokens_before + q)

    without the intermediate tensors: on CUDA, for a decoding pass (B·q ≤ 16 tokens, 16-byte aligned rows), two
    launches for the MLP surrogate (one for the linear) and one for the rest, where that composition takes about ten.

    Args:
        hidden: (B, q, Dh) the new tokens' attention input; weight1, bias1, weight2, bias2: as in :func:`kvzap_score`.
        log_weights: (B, H, T + q) float32, the layer's log-weights with the new tokens' slots last (as the attention
            read them; 0 for a token).
        scores: (B, H, T) float32, positions: (B, H, T) int64: the state of the T slots before the pass.
        threshold, window: as in :func:`kvzap_threshold`; tokens_before: the tokens the cache had seen before the pass.

    Returns:
        (log_weights, scores, positions: (B, H, T + q) each, held (B, H) int64), as :func:`kvzap_threshold` returns
        them with the grown scores and positions.
    """
    return torch.ops.kvcomp.kvzap_decode_step(hidden, weight1, bias1, weight2, bias2, log_weights, scores, positions,
                                              threshold, window, tokens_before)


def kvzap_paged_step(
    log_weight_blocks: torch.Tensor,
    score_blocks: torch.Tensor,
    position_blocks: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    new_scores: torch.Tensor,
    threshold: float,
    window: int,
    tokens_before: int,
    check_tables_on_device: bool = False,
) -> torch.Tensor:
    """:func:`kvzap_threshold` for a decoding pass of q new tokens on a paged cache, in place in its per-slot pools,
    without gathering any (batch, kv head) row.

    After every pass each row ends with its undecided tokens in position order (a token is decided when it leaves the
    window): the D = |[max(0, tokens_before - window), max(0, tokens_before + q - window))| tokens leaving the window
    now, then the window. So those D tokens are the row's slots ``length - window - D .. length - window - 1``, unless
    the row is not what decoding made it (padding among its first tokens, a cache cut back); the op checks the
    positions stored there.

    Args:
        log_weight_blocks, score_blocks: (N, S) float32 pools of N blocks of S slots, contiguous, updated in place.
        position_blocks: (N, S) int64 pool of the slots' absolute positions, contiguous, updated in place.
        block_tables: (B, H, max_blocks) int64; slot t of (b, h) is slot t % S of block block_tables[b, h, t // S]. Each
            block belongs to one (b, h): a block two used entries name is refused (not in the kernel's own check).
        lengths: (B, H) int64 slots per (b, h), in [q, max_blocks * S], the new tokens included.
        new_scores: (B, H, q) float32 the new tokens' surrogate scores, q ≥ 1.
        threshold: τ, not NaN. window: w ≥ 0. tokens_before: the tokens seen before this pass, ≥ 0.
        check_tables_on_device: on a GPU, check the tables' contents (the lengths, the blocks each row's step touches)
            in the kernel, a bad entry stopping the stream with a device-side assert, rather than before it on the host
            (one host sync; shared blocks are found only there); for tables the caller built itself
            (:class:`~kvpress_cpp.paged_cache.PagedKVCache`). A CPU call checks them on the host either way (nothing
            to wait for).

    Returns:
        (B, H) int64: per row, how many of the D tokens leaving the window it holds (not -inf) after the keep rule;
        -1 where the slots ``length - window - D ..`` do not hold positions ``tokens_before - window ..`` in order (that
        row's log-weights untouched: run kvzap_threshold over its view). Either way the new tokens' positions and
        scores are written.
    """
    return torch.ops.kvcomp.kvzap_paged_step(log_weight_blocks, score_blocks, position_blocks, block_tables, lengths,
                                             new_scores, threshold, window, tokens_before, check_tables_on_device)


def prompt_log_sum_exp(query: torch.Tensor, keys: torch.Tensor, log_weights: torch.Tensor,
                       scale: float | None = None) -> torch.Tensor:
    """Log-sum-exp of the prompt's attention rows, the first pass of :func:`prompt_scores`.

    Args:
        query: (B, Hq, q, d) float32, float16 or bfloat16: the queries of the last q of the T prompt tokens (query j
            is token T - q + j and sees tokens 0 .. T - q + j); any strides over (B, Hq, q) with d contiguous.
        keys: (B, H, T, d) in the query dtype, Hq a multiple of H (never repeated); strides as for query.
        log_weights: (B, H, T) float32 per-slot log-weights b (0 for a token, -inf for padding).
        scale: the model's attention scale, finite and > 0; default ``d ** -0.5``.

    Returns:
        (B, Hq, q) float32: ``log Σ_i exp(scale * q·k_i + b_i)`` over the slots each row sees (float32 online softmax
        over key tiles, no (q, T) matrix); -inf for a row whose visible slots are all -inf. A -inf slot's key is not
        read (NaN there changes nothing).
    """
    if scale is None:
        scale = _default_scale("prompt_log_sum_exp", "query", query)
    return torch.ops.kvcomp.prompt_log_sum_exp(query, keys, log_weights, scale)


def prompt_scores(query: torch.Tensor, keys: torch.Tensor, log_weights: torch.Tensor, scale: float | None = None,
                  decay: float = 1.0, input_scale: float = 1.0,
                  log_sum_exp: torch.Tensor | None = None) -> torch.Tensor:
    """Per-kv-head scores of a prompt's keys from its q newest queries, at the cost of attention without P·V.

    ``s_i = Σ_j input_scale * decay^(q-1-j) * Σ_g softmax(scale * q_{g,j}·Kᵀ + b)_i`` over the G query heads of each
    kv head, causal: ZSMerge's prefill scores (decay λ, input_scale 1) and WeightedKV's sums (decay 1, 1/G); KeepKV
    averages unnormalised scores instead (:func:`prompt_log_unnormalised_scores`). It equals :func:`update_scores`
    folding the full attention of those queries one by one, without materialising it: a log-sum-exp pass
    (:func:`prompt_log_sum_exp`, skipped when ``log_sum_exp`` is given), then one pass adding normalised probabilities
    over tiles of keys. Older queries whose total weight is below float32 resolution of every score of a key tile
    (decay < 1) are left out (the bound is documented in ``csrc/kernels/prompt_scores.h``). Deterministic on CPU and
    CUDA (each score is summed by one task in a fixed order); workspace: tiles only, whatever T. On CUDA, float16 and
    bfloat16 at d = 64 or 128 (rows in 16-byte pieces) run on tensor cores (mma.sync, the logits kept in registers;
    ``csrc/cuda/prompt_scores.cu``; measured against the layer's sdpa in ``docs/benchmarks.md``).

    Args:
        query, keys, log_weights, scale: as for :func:`prompt_log_sum_exp`.
        decay: in (0, 1].
        input_scale: finite, >= 0.
        log_sum_exp: (B, Hq, q) float32 from :func:`prompt_log_sum_exp` (or the model's own attention forward).

    Returns:
        (B, H, T) float32 scores (0 on -inf slots).
    """
    if scale is None:
        scale = _default_scale("prompt_scores", "query", query)
    if log_sum_exp is None:
        log_sum_exp = torch.ops.kvcomp.prompt_log_sum_exp(query, keys, log_weights, scale)
    return torch.ops.kvcomp.prompt_scores(query, keys, log_weights, log_sum_exp, scale, decay, input_scale)


# The CPU kernel's tiles (csrc/cpu/prompt_scores.cpp: kFusedQueryTile, kKeyTile, kRowBlock) and its chunks of query
# tiles (csrc/kernels/common.h: chunks_per_pair, kCpuTasksTarget, kMaxPairChunks).
_FUSED_QUERY_TILE, _KEY_TILE, _ROW_BLOCK, _CPU_TASKS_TARGET, _MAX_PAIR_CHUNKS = 64, 128, 4, 64, 16
#: The most workspace :func:`prompt_attention_with_scores` may take (beyond its outputs) before its callers fall
#: back to sdpa + :func:`prompt_scores` (the issue's bound on prompt scoring).
FUSED_PROMPT_WORKSPACE_LIMIT = 64 * 2**20


def prompt_attention_workspace_bytes(query: torch.Tensor, keys: torch.Tensor, threads: int | None = None) -> int:
    """The dominant workspace of :func:`prompt_attention_with_scores` on CPU, in bytes: per thread, the probability
    rows of one query tile over all T keys (G x 64 rows rounded to 4, times T rounded to 128, float32), plus the
    partial column sums of each chunk of query tiles: ceil(64 / (B x H)) chunks per (batch, kv head), 1 to 16, at
    most one per tile. (Per-row tiles of d or T / 128 floats come on top: under 2% of it.)"""
    batch, query_heads, num_queries, _ = query.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    rows = -(-query_heads // kv_heads * _FUSED_QUERY_TILE // _ROW_BLOCK) * _ROW_BLOCK
    padded_len = -(-total // _KEY_TILE) * _KEY_TILE
    pairs = batch * kv_heads
    chunks = min(max(1, min(_MAX_PAIR_CHUNKS, -(-_CPU_TASKS_TARGET // max(pairs, 1)))),
                 -(-num_queries // _FUSED_QUERY_TILE))
    threads = torch.get_num_threads() if threads is None else threads
    return 4 * padded_len * (min(threads, chunks * pairs) * rows + chunks * pairs)


def prompt_attention_with_scores(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                 log_weights: torch.Tensor, scale: float | None = None, decay: float = 1.0,
                                 input_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompt's causal attention and its scores from one QKᵀ (CPU): what the model's prefill attention and
    :func:`prompt_scores` compute apart, with every probability formed once.

    Per (batch, kv head, tile of 64 queries x G heads) the logits against all keys, the exact log-sum-exp of every row,
    P·V accumulated with an online softmax, and the normalised column sums weighted as in :func:`prompt_scores`
    (queries whose weight is 0 in float32 add nothing). Deterministic (fixed reduction order, whatever the thread
    count); workspace: :func:`prompt_attention_workspace_bytes`, which grows with T (callers check it against
    :data:`FUSED_PROMPT_WORKSPACE_LIMIT`). No CUDA kernel: on CUDA, sdpa + :func:`prompt_scores`.

    Args:
        query, keys, log_weights, scale: as for :func:`prompt_log_sum_exp`.
        values: (B, H, T, d), the dtype of query.
        decay, input_scale: the query weights input_scale * decay^(q-1-j), as for :func:`prompt_scores`.

    Returns:
        (output (B, q, Hq, d) in the query dtype: softmax(scale * q·Kᵀ + b)·V, 0 for a row that sees nothing,
        log_sum_exp (B, Hq, q) float32, scores (B, H, T) float32).
    """
    if scale is None:
        scale = _default_scale("prompt_attention_with_scores", "query", query)
    return torch.ops.kvcomp.prompt_attention_with_scores(query, keys, values, log_weights, scale, decay, input_scale)


def prompt_log_unnormalised_scores(query: torch.Tensor, keys: torch.Tensor, log_weights: torch.Tensor,
                                   scale: float | None = None, decay: float = 0.9,
                                   input_scale: float = 1.0) -> torch.Tensor:
    """The log of the prompt's scores without a softmax: ``ln s_i = ln Σ_j input_scale · decay^(q-1-j) Σ_g
    exp(scale · q_{g,j}·k_i + b_i)`` over the q newest prompt queries that see slot i (causal), the query heads g of
    slot i's kv head (GQA, keys never repeated). KeepKV's EMA of exp(q·k·scale) over its recent window: decay β,
    input_scale (1-β)/G.

    Per (batch, kv head, tile of 128 keys), query tiles newest first, an online log-sum-exp per slot (running max and
    rescaled sum), so nothing overflows whatever the logits; deterministic (fixed order, whatever the thread count);
    workspace a few tiles per thread, whatever T.

    Args:
        query, keys, log_weights, scale: as for :func:`prompt_log_sum_exp` (b = -inf: a slot no query sees).
        decay: in (0, 1).
        input_scale: > 0.

    Returns:
        (B, H, T) float32 ln s, -inf for a slot no query sees (past every query's causal limit, or b = -inf).
    """
    if scale is None:
        scale = _default_scale("prompt_log_unnormalised_scores", "query", query)
    return torch.ops.kvcomp.prompt_log_unnormalised_scores(query, keys, log_weights, scale, decay, input_scale)


def paged_decode_attention(
    query: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    log_weight_blocks: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
    return_probs: bool = True,
    max_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_attention` over a paged cache: each (batch, kv head) reads its own slots through its block table.

    Slot t of (b, h) is at ``block_tables[b, h, t // S]``, offset ``t % S``, in pools of N blocks of S slots
    (:class:`kvpress_cpp.paged_cache.PagedKVCache`'s layout). Heads may hold different numbers of slots; the q queries
    are the last q slots of every (b, h) (causal), and a (b, h) with fewer than q slots (a shorter prompt of a batch)
    leaves its first queries nothing to attend to: output 0. On CPU, split and combined as :func:`decode_attention`
    (chunks of whole blocks, their bounds from B * H and the longest length or ``max_len``): the same bits on any
    number of threads.

    Args:
        query: (B, Hq, q, d) float32, float16 or bfloat16, q >= 1, Hq a multiple of H.
        key_blocks, value_blocks: (N, S, d) in the query dtype, S >= 1.
        log_weight_blocks: (N, S) float32 log-weights of the slots (0 token, alpha * ln w merged, -inf evicted).
        block_tables: (B, H, max_blocks) int64; the first ceil(lengths[b, h] / S) entries of each row must be in
            [0, N), the rest are not read.
        lengths: (B, H) int64 in [0, max_blocks * S].
        scale: attention scale, finite and > 0; default ``d ** -0.5``.
        return_probs: also return the probabilities (else probs has width 0).
        max_len: where the caller knows it without reading the device (``PagedLayer.longest_length()``), a bound
            in [1, max_blocks * S] on every length and the width of probs. Without it the op finds max(lengths)
            itself and checks the tables before the kernel: one host sync on a GPU. With it a GPU call syncs nothing:
            a kernel checks the tables' contents on the device and stops the stream with a device-side assert
            (``CUDA error: device-side assert triggered``, the bad entry printed) where one is out of range, which,
            unlike the error without max_len, leaves the process's CUDA context unusable (as PyTorch's index ops).

    Returns:
        ``(out, probs)``: out (B, Hq, q, d) in the query dtype, probs (B, Hq, q, max_len or max(lengths)) float32
        indexed by each head's slot, exactly 0 beyond its length and on masked slots.
    """
    if scale is None:
        scale = _default_scale("paged_decode_attention", "query", query)
    return torch.ops.kvcomp.paged_decode_attention(query, key_blocks, value_blocks, log_weight_blocks, block_tables,
                                                   lengths, scale, return_probs, max_len)
