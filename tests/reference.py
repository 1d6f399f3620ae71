"""Plain-PyTorch references of every kvcomp op, written from the papers' formulas (see ../shared/docs/methods.md),
in float32 math, as directly as possible and with no attention to speed.
"""

import torch
import torch.nn.functional as F


def update_scores(scores: torch.Tensor, attn: torch.Tensor, decay: float, input_scale: float) -> torch.Tensor:
    """The score recurrence applied one query at a time: extend with zeros for the q new slots, then for each new
    query j in order, ``s <- decay * s + input_scale * Σ_g attn[:, h*G+g, j]`` (ZSMerge eq. 5 for decay=λ)."""
    batch, kv_heads, _ = scores.shape
    query_heads, num_queries, total_len = attn.shape[1:]
    per_kv_head = attn.float().reshape(batch, kv_heads, query_heads // kv_heads, num_queries, total_len).sum(2)
    folded = F.pad(scores.float(), (0, num_queries))
    for query in range(num_queries):
        folded = decay * folded + input_scale * per_kv_head[:, :, query]
    return folded
