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


def merge_count_bias(counts: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha * ln w`` for w > 0 (0 when alpha = 0), ``-inf`` for w == 0 (methods.md's log-weight convention)."""
    counts = counts.float()
    bias = alpha * counts.log() if alpha != 0 else torch.where(counts > 0, 0.0, counts.log())
    return torch.where(counts == 0, float("-inf"), bias)


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, log_weights: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(scale * q·k + b) · v`` with K, V and b repeated over the G query heads of each kv head and an explicit
    causal mask (query j of q is slot T - q + j and sees slots 0 .. T - q + j), in float64. A row with nothing to
    attend to (every allowed logit -inf) gives probabilities 0 and output 0. Returns (out in the query dtype,
    probs float32)."""
    group = query.shape[1] // keys.shape[1]
    num_queries, total_len = query.shape[2], keys.shape[2]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    bias = log_weights.double().repeat_interleave(group, dim=1)[:, :, None, :]
    logits = scale * (query.double() @ k.transpose(-1, -2)) + bias
    slots = torch.arange(total_len, device=query.device)
    positions = total_len - num_queries + torch.arange(num_queries, device=query.device)
    logits = logits.masked_fill(slots[None, :] > positions[:, None], float("-inf"))
    empty_row = (logits == float("-inf")).all(-1, keepdim=True)
    probs = torch.where(empty_row, 0.0, logits.softmax(-1))
    return (probs @ v).to(query.dtype), probs.float()
