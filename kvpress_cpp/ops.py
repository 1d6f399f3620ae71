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


def zsmerge_prefill(
    keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, recent: int, context: int, residual: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compress a prompt's cache of T tokens into ZSMerge's M = residual + context + recent slots (paper 3.2-3.4).

    Output layout per (batch, kv head): slots [0, residual) residual merge slots, [residual, residual + context) the
    context (top-score) tokens, [residual + context, M) the recent ring with its oldest token first (ring_position 0).

    Args:
        keys: (B, H, T, d) post-RoPE keys, float32, float16 or bfloat16, T > M.
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
        float32 (1 for plain tokens; the counts sum to T).
    """
    return torch.ops.kvcomp.zsmerge_prefill(keys, values, scores, recent, context, residual)


def zsmerge_decode_step(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    counts: torch.Tensor,
    ring_position: int,
    recent: int,
    context: int,
    residual: int,
) -> None:
    """Fold q >= 1 newly appended tokens into a full ZSMerge cache, in place (Algorithm 1, one token at a time).

    The M = residual + context + recent slots (layout of ``zsmerge_prefill``) are followed by the q new tokens at
    [M, M + q), their scores already updated (``update_scores``) and their counts 1. For each new token t in order,
    per (batch, kv head): i* = argmin of the context scores (NaN counts as +inf, ties to the lower slot); if
    residual > 0, j* = argmax over the residual slots of k_i*·k_j (eq. 6, float32; NaN counts as -inf, ties to the
    lower slot) and slot i* merges into j*: ``k_j <- (w_i k_i + w_j k_j) / (w_i + w_j)``, the same for v,
    ``w_j <- w_i + w_j``, ``s_j <- max(s_i, s_j)`` (NaN propagates); with residual == 0, i* is evicted. Then the
    oldest recent token (slot residual + context + (ring_position + t) mod recent) moves into slot i* and the new
    token (slot M + t, with its score and count) into the ring slot it freed.

    Args:
        keys: (B, H, M + q, d) contiguous, float32, float16 or bfloat16; updated in place.
        values: (B, H, M + q, d) contiguous, the dtype of keys; updated in place.
        scores: (B, H, M + q) contiguous float32; updated in place.
        counts: (B, H, M + q) contiguous float32 fusion counts w; updated in place.
        ring_position: offset in [0, recent) of the oldest recent token, shared by all heads.
        recent, context, residual: the slot budget (recent >= 1, context >= 1, residual >= 0).

    Afterwards slots [0, M) hold the compressed cache (slots [M, M + q) are stale): the caller narrows every
    tensor to M and advances ``ring_position = (ring_position + q) % recent``.
    """
    torch.ops.kvcomp.zsmerge_decode_step(keys, values, scores, counts, ring_position, recent, context, residual)
