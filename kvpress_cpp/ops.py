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
