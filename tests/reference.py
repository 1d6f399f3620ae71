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


def weightedkv_merge_coefficients(mean_child: torch.Tensor, mean_parent: torch.Tensor) -> tuple[float, float]:
    """Weights of V[j] and V[j+1] in WeightedKV's merge: ā_j / (ā_j + ā_{j+1}) and ā_{j+1} / (ā_j + ā_{j+1}), with
    the combination's limits where it is undefined: NaN reads as +inf, one infinite ā takes its value alone, both
    infinite or a zero sum take the plain mean (never NaN from 0/0). The ratio in float64, rounded to float32."""
    child, parent = (float("inf") if torch.isnan(m) else float(m) for m in (mean_child, mean_parent))
    if abs(child) == float("inf") and abs(parent) == float("inf"):
        return 0.5, 0.5
    if abs(child) == float("inf"):
        return 1.0, 0.0
    if abs(parent) == float("inf"):
        return 0.0, 1.0
    if child + parent == 0.0:
        return 0.5, 0.5
    as_float32 = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731
    return as_float32(child / (child + parent)), as_float32(parent / (child + parent))


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
    """Algorithm 1's eviction step (lines 7-10) ``evictions`` times, one (batch, kv head) at a time, with physical
    deletion: ā = a / n; j = argmin ā over [sinks, T - recent) (NaN as +inf, ties to the first);
    V[j+1] <- (ā_j V[j] + ā_{j+1} V[j+1]) / (ā_j + ā_{j+1}); delete K[j], V[j], a[j], n[j]. Math in float32; the
    merged value is rounded to the cache dtype after each step, as the cache would store it."""
    batch, kv_heads = keys.shape[:2]
    out = [[], [], [], []]
    for b in range(batch):
        for h in range(kv_heads):
            k, v = keys[b, h].float(), values[b, h].float()
            a, n = sums[b, h].float(), counts[b, h].float()
            for _ in range(evictions):
                mean = a / n
                middle = mean[sinks : mean.shape[0] - recent]
                j = sinks + int(torch.where(torch.isnan(middle), float("inf"), middle).argmin())
                c_child, c_parent = weightedkv_merge_coefficients(mean[j], mean[j + 1])
                if merge_values:
                    merged = (c_child * v[j] + c_parent * v[j + 1]).to(values.dtype).float()
                    v = torch.cat([v[:j], merged[None], v[j + 2 :]])
                else:  # the eviction-only ablation
                    v = torch.cat([v[:j], v[j + 1 :]])
                k = torch.cat([k[:j], k[j + 1 :]])
                a = torch.cat([a[:j], a[j + 1 :]])
                n = torch.cat([n[:j], n[j + 1 :]])
            for i, t in enumerate((k, v, a, n)):
                out[i].append(t)
    shapes = [(batch, kv_heads) + t.shape for t in (out[0][0], out[1][0], out[2][0], out[3][0])] if out[0] else None
    if shapes is None:
        return (
            keys.new_empty(keys.shape[:2] + (keys.shape[2] - evictions, keys.shape[3])),
            values.new_empty(values.shape[:2] + (values.shape[2] - evictions, values.shape[3])),
            sums.new_empty(sums.shape[:2] + (sums.shape[2] - evictions,)),
            counts.new_empty(counts.shape[:2] + (counts.shape[2] - evictions,)),
        )
    return tuple(
        torch.stack(parts).view(shape).to(like.dtype)
        for parts, shape, like in zip(out, shapes, (keys, values, sums, counts))
    )
