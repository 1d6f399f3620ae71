"""Typed wrappers of the kvcomp operators. Shapes: B batch, Hq query heads, H kv heads (G = Hq / H), q new queries,
T cached slots (including the q new ones), d head dim. Scores are always float32; caches may be float32, float16 or
bfloat16.
"""

import torch


def update_scores(scores: torch.Tensor, attn: torch.Tensor, decay: float = 1.0, input_scale: float = 1.0) -> torch.Tensor:
    """Fold the attention of q new queries into per-kv-head scores and extend them for the q new tokens.

    Args:
        scores: (B, H, T - q) float32 scores of the slots cached before this step ((B, H, 0) at prefill).
        attn: (B, Hq, q, T) attention probabilities of the new queries over all T slots, any float dtype; query head
            h * G + g belongs to kv head h (transformers' GQA layout).
        decay: λ in [0, 1]; each query step multiplies the earlier scores by it.
        input_scale: weight of the new attention (1 for ZSMerge's group sum, 1/G for a group mean,
            (1 - β)/G for KeepKV's EMA).

    Returns:
        (B, H, T) float32: ``decay^q * [scores, 0] + input_scale * Σ_j decay^(q-1-j) Σ_g attn[:, h*G+g, j]``.
        ZSMerge eq. 5 is decay=λ, input_scale=1; WeightedKV's running sum is decay=1, input_scale=1/G;
        KeepKV's EMA is decay=β, input_scale=(1-β)/G (bias correction 1/(1-β^t) is applied when read).
    """
    return torch.ops.kvcomp.update_scores(scores, attn, decay, input_scale)


def merge_count_bias(counts: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Per-slot log-weights from merge counts: the bias every merging press adds to the attention logits.

    Args:
        counts: (B, H, T) float32 number of tokens each slot stands for (ZSMerge's merge count w) or KeepKV's
            electoral votes p; 0 marks an evicted or padding slot. Counts < 0 or NaN give NaN (not checked: that
            would need a device sync).
        alpha: finite, >= 0 (ZSMerge 0.6, KeepKV 1; 0 is pure eviction).

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
    -inf gives output 0 and probabilities 0.

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
        scale = query.shape[-1] ** -0.5
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
    kv head).

    One step: ``ā = sums / counts``; ``j = argmin ā`` over the middle slots, i.e. neither the first ``sinks`` nor the
    last ``recent`` ones (ties to the lower slot, NaN counts as +inf, so all-NaN evicts the first middle slot);
    ``V[j+1] <- (ā_j V[j] + ā_{j+1} V[j+1]) / (ā_j + ā_{j+1})`` (the plain mean when that is 0/0; an infinite ā takes
    its own value alone); then slot j's key, value, sum and count are deleted. ``sums[j+1]`` and ``counts[j+1]`` are
    kept as they are. Each step recomputes the argmin on the cache the previous one left, exactly as ``evictions``
    calls with ``evictions=1``; merged values are rounded to the cache dtype after every step, as a cache stored in it
    would hold them, so the two agree bit for bit.

    Args:
        keys: (B, H, T, d) float32, float16 or bfloat16.
        values: (B, H, T, d_v), the dtype of keys (d_v may differ from d).
        sums: (B, H, T) float32 running attention sums a (``update_scores`` with decay=1, input_scale=1/G).
        counts: (B, H, T) float32 number of attention rows summed into each slot, n.
        sinks: >= 0 leading slots that are never evicted (the paper keeps 4).
        recent: >= 1 trailing slots that are never evicted (the paper: m/2 - 4); at least 1, because the last
            middle slot merges into its right neighbour.
        evictions: 0 <= evictions <= T - sinks - recent steps: 1 when a decoding step took the cache to m + 1,
            T - m to reduce a prefill of T tokens to m slots.
        merge_values: False is the paper's eviction-only ablation: slot j's value is dropped with its key.

    Returns:
        (keys, values, sums, counts) with T - evictions slots: (B, H, T - e, d), (B, H, T - e, d_v), (B, H, T - e),
        (B, H, T - e); new tensors, the survivors in their original order.
    """
    return torch.ops.kvcomp.weightedkv_evict(keys, values, sums, counts, sinks, recent, evictions, merge_values)
