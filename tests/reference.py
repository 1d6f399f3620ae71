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
                merged = (c_child * v[j] + c_parent * v[j + 1]).to(values.dtype).float()
                v = torch.cat([v[:j], merged[None], v[j + 2 :]])
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
