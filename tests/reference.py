"""Plain-PyTorch references of every kvcomp op, written from the papers' formulas (see ../shared/docs/methods.md),
as directly as possible and with no attention to speed: in float64 unless a function says otherwise (those that
follow the op's float32 arithmetic do so where that rounding is the op's contract, e.g. a selection made in float32).
"""

import math

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
    probs = softmax_or_zero(prompt_attention(query, keys, log_weights, scale))
    v = values.double().repeat_interleave(query.shape[1] // keys.shape[1], dim=1)
    return (probs @ v).to(query.dtype), probs.float()


def softmax_or_zero(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, 0 for a row with nothing to attend to (every logit -inf)."""
    empty_row = (logits == float("-inf")).all(-1, keepdim=True)
    return torch.where(empty_row, 0.0, logits.softmax(-1))


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


def zsmerge_prefill(
    keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, recent: int, context: int, residual: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ZSMerge prefill (methods.md), one (batch, kv head) at a time with Python lists: keep the last `recent` tokens;
    keep the top-`context` of the rest by score (ties to the lower position, NaN below every number), in position
    order; split the others, in order, into `residual` contiguous groups (the first n mod residual one longer) and
    average each group's keys and values in float32, score = group max (NaN propagates), count = group size.
    Output slots: [residual groups | context | recent]."""
    batch, kv_heads, tokens, head_dim = keys.shape
    slots = recent + context + residual
    out_keys = keys.new_empty((batch, kv_heads, slots, head_dim))
    out_values = values.new_empty((batch, kv_heads, slots, head_dim))
    out_scores = torch.empty(batch, kv_heads, slots, device=scores.device)
    out_counts = torch.empty(batch, kv_heads, slots, device=scores.device)
    for b in range(batch):
        for h in range(kv_heads):
            score = scores[b, h].tolist()
            candidates = range(tokens - recent)

            def rank(position):  # sorts best first
                nan = score[position] != score[position]
                return (1, 0.0, position) if nan else (0, -score[position], position)

            kept = sorted(sorted(candidates, key=rank)[:context])
            others = [position for position in candidates if position not in set(kept)]
            groups, start = [], 0
            for group in range(residual):
                size = len(others) // residual + (1 if group < len(others) % residual else 0)
                groups.append(others[start : start + size])
                start += size
            for slot, members in enumerate(groups):
                out_keys[b, h, slot] = keys[b, h, members].float().mean(0).to(keys.dtype)
                out_values[b, h, slot] = values[b, h, members].float().mean(0).to(values.dtype)
                out_scores[b, h, slot] = scores[b, h, members].max()
                out_counts[b, h, slot] = len(members)
            for slot, position in enumerate(kept + list(range(tokens - recent, tokens)), start=residual):
                out_keys[b, h, slot] = keys[b, h, position]
                out_values[b, h, slot] = values[b, h, position]
                out_scores[b, h, slot] = scores[b, h, position]
                out_counts[b, h, slot] = 1.0
    return out_keys, out_values, out_scores, out_counts


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
    """ZSMerge decode step (methods.md, the authors' order, or with ``paper_order`` the paper's Algorithm 1), in
    place, one new token and one (batch, kv head) at a time. Slots [0, M) are [residual | context | recent ring], the q new tokens sit at [M, M + q). Per new token t:
    i* = argmin of the context scores (NaN as +inf, first on ties); if residual: j* = argmax over the residual slots
    of k_i*·k_j (eq. 6, float32, NaN as -inf, first on ties), k_j <- (w_i k_i + w_j k_j)/(w_i + w_j) computed in
    float32 and stored in the cache dtype, same for v, w_j <- w_i + w_j, s_j <- max(s_i, s_j); then the oldest
    recent token (ring slot (ring_position + t) mod recent) moves into i*, and the new token into that ring slot.
    In the paper's order the oldest recent token is a candidate of the argmin too, after the context (so ties keep
    it); when it is i*, it is merged and the new token takes its ring slot."""
    batch, kv_heads, total, _ = keys.shape
    slots = recent + context + residual
    inf = float("inf")
    for b in range(batch):
        for h in range(kv_heads):
            for step in range(total - slots):
                oldest = residual + context + (ring_position + step) % recent
                candidates = [*range(residual, residual + context)] + ([oldest] if paper_order else [])
                ranked = scores[b, h, candidates]
                i = candidates[int(torch.where(ranked.isnan(), inf, ranked).argmin())]
                if residual > 0:
                    similarity = keys[b, h, :residual].float() @ keys[b, h, i].float()
                    j = int(torch.where(similarity.isnan(), -inf, similarity).argmax())
                    w_i, w_j = counts[b, h, i].clone(), counts[b, h, j].clone()
                    for cache in (keys, values):
                        merged = (w_i * cache[b, h, i].float() + w_j * cache[b, h, j].float()) / (w_i + w_j)
                        cache[b, h, j] = merged.to(cache.dtype)
                    counts[b, h, j] = w_i + w_j
                    scores[b, h, j] = torch.maximum(scores[b, h, i], scores[b, h, j])
                for cache in (keys, values, scores, counts):
                    cache[b, h, i] = cache[b, h, oldest].clone()
                    cache[b, h, oldest] = cache[b, h, slots + step]


def zsmerge_decode_step_vectorised(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    counts: torch.Tensor,
    ring_position: int,
    recent: int,
    context: int,
    residual: int,
) -> None:
    """The same step as ``zsmerge_decode_step``, vectorised over (batch, kv head) with gathers and scatters (a loop
    over the q new tokens only): what a plain-PyTorch press would run, the fair baseline of the benchmark."""
    batch, kv_heads, total, head_dim = keys.shape
    slots = recent + context + residual
    inf = float("inf")
    for step in range(total - slots):
        ctx = scores[:, :, residual : residual + context]
        i = residual + ctx.masked_fill(ctx.isnan(), inf).argmin(-1, keepdim=True)  # (B, H, 1)
        i_rows = i.unsqueeze(-1).expand(batch, kv_heads, 1, head_dim)
        if residual > 0:
            key_i = keys.gather(2, i_rows).float()
            similarity = (keys[:, :, :residual].float() @ key_i.transpose(-1, -2)).squeeze(-1)  # (B, H, residual)
            j = similarity.masked_fill(similarity.isnan(), -inf).argmax(-1, keepdim=True)
            j_rows = j.unsqueeze(-1).expand(batch, kv_heads, 1, head_dim)
            w_i, w_j = counts.gather(2, i), counts.gather(2, j)
            for cache in (keys, values):
                merged = (w_i[..., None] * cache.gather(2, i_rows).float() + w_j[..., None] * cache.gather(2, j_rows).float())
                cache.scatter_(2, j_rows, (merged / (w_i + w_j)[..., None]).to(cache.dtype))
            scores.scatter_(2, j, torch.maximum(scores.gather(2, i), scores.gather(2, j)))
            counts.scatter_(2, j, w_i + w_j)
        oldest = residual + context + (ring_position + step) % recent
        fresh = slots + step
        keys.scatter_(2, i_rows, keys[:, :, oldest : oldest + 1].clone())
        values.scatter_(2, i_rows, values[:, :, oldest : oldest + 1].clone())
        scores.scatter_(2, i, scores[:, :, oldest : oldest + 1].clone())
        counts.scatter_(2, i, counts[:, :, oldest : oldest + 1].clone())
        for cache in (keys, values, scores, counts):
            cache[:, :, oldest] = cache[:, :, fresh]


def zsmerge_prefill_vectorised(
    keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, recent: int, context: int, residual: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same prefill as ``zsmerge_prefill``, vectorised over (batch, kv head) with stable sorts, gathers and
    index_add: the fair plain-PyTorch baseline of the benchmark."""
    batch, kv_heads, tokens, head_dim = keys.shape
    candidates = tokens - recent
    n = candidates - context
    cand = scores[..., :candidates]
    # best first: by score descending (NaN as -inf), then NaN after every number; stable sorts keep positions in order.
    order = torch.where(cand.isnan(), float("-inf"), cand).sort(dim=-1, descending=True, stable=True).indices
    order = order.gather(-1, cand.isnan().gather(-1, order).to(torch.uint8).sort(dim=-1, stable=True).indices)
    in_context = torch.zeros_like(cand, dtype=torch.long).scatter_(-1, order[..., :context], 1)
    positions = torch.arange(candidates, device=scores.device)
    source = (positions + in_context * tokens).sort(-1).indices  # [residual ascending | context ascending]
    kept = torch.cat([source[..., n:], torch.arange(candidates, tokens, device=scores.device).expand(batch, kv_heads, recent)], -1)
    rows = kept.unsqueeze(-1).expand(-1, -1, -1, head_dim)
    out = [keys.gather(2, rows), values.gather(2, rows), scores.gather(2, kept), torch.ones(kept.shape, device=scores.device)]
    if residual == 0:
        return tuple(out)
    sizes = torch.tensor([n // residual + (1 if g < n % residual else 0) for g in range(residual)], device=scores.device)
    group = torch.repeat_interleave(torch.arange(residual, device=scores.device), sizes)  # (n,) group of each rank
    members = source[..., :n]
    member_rows = members.unsqueeze(-1).expand(-1, -1, -1, head_dim)
    means = []
    for cache in (keys, values):
        sums = torch.zeros(batch, kv_heads, residual, head_dim, device=cache.device).index_add_(
            2, group, cache.gather(2, member_rows).float())
        means.append((sums / sizes[:, None]).to(cache.dtype))
    group_max = torch.full((batch, kv_heads, residual), float("-inf"), device=scores.device).scatter_reduce(
        2, group.expand(batch, kv_heads, n), scores.gather(2, members), "amax")
    counts = sizes.float().expand(batch, kv_heads, residual)
    return tuple(torch.cat([r, o], 2) for r, o in zip((*means, group_max, counts), out))


KEEPKV_COSINE_RESOLUTION = 2.0**-16  # kernels::kCosineResolution


def keepkv_rounded_cosine(cos: float) -> float:
    """A cosine clamped to [-1, 1] and rounded to the nearest multiple of 2^-16 (half to even), as keepkv_match
    compares them."""
    return round(min(max(cos, -1.0), 1.0) / KEEPKV_COSINE_RESOLUTION) * KEEPKV_COSINE_RESOLUTION


def keepkv_match(keys: torch.Tensor, keep: torch.Tensor, threshold: float,
                 max_evicted: int | None = None) -> torch.Tensor:
    """For each evicted slot, the retained slot of its row with the highest key cosine (float64, rounded to 2^-16;
    zero keys 0 against finite keys, NaN as -inf, ties to the lower slot) if >= threshold, else -2; retained slots
    -1. ``max_evicted`` only spares the CUDA kernel a host sync: the result does not depend on it."""
    batch, kv_heads, slots, _ = keys.shape
    targets = torch.where(keep, -1, -2).to(torch.int64)
    for b in range(batch):
        for h in range(kv_heads):
            retained = [t for t in range(slots) if keep[b, h, t]]
            for e in range(slots):
                if keep[b, h, e] or not retained:
                    continue
                best, best_slot = None, None
                for r in retained:
                    a, c = keys[b, h, e].double(), keys[b, h, r].double()
                    na, nc = a.norm(), c.norm()
                    dot = float(a @ c)
                    if dot != dot:  # a non-finite key: no match, even with a zero key
                        cos = float("-inf")
                    elif na == 0 or nc == 0:
                        cos = 0.0
                    else:
                        cos = dot / float(na * nc)
                        cos = float("-inf") if cos != cos else keepkv_rounded_cosine(cos)
                    if best is None or cos > best:
                        best, best_slot = cos, r
                if best >= threshold:
                    targets[b, h, e] = best_slot
    return targets


KEEPKV_GUARD_EPS = 1e-3  # kernels::kZipGuardRelativeEps
KEEPKV_MAX_KEY_GROWTH = 2.0  # kernels::kZipMaxKeyGrowth: the ZIP key at most this many times the convex key (or 1/x)


def keepkv_zip_coefficients(ell: torch.Tensor, p: torch.Tensor, convex: bool):
    """(w, key_scale, value_scale, zip_used) of one set from its log-scores and votes (1-d, float64), or None when
    Σ w = 0; zip_used is False where the guard (or ``convex``) gives the convex key."""
    contributes = (p > 0) & (ell > float("-inf"))
    if not contributes.any():
        return None
    m = ell[contributes].max()
    w = torch.where(contributes, p * torch.exp(torch.where(contributes, ell - m, 0.0)), 0.0)
    weight, votes = w.sum(), p.sum()
    if not (weight > 0) or not torch.isfinite(weight):
        return None
    weighted_log = (w[contributes] * ell[contributes]).sum()
    max_abs = ell[contributes & (w > 0)].abs().max() if (w > 0).any() else torch.tensor(0.0)
    numerator = m + torch.log(weight / votes)
    usable = (not convex and bool(torch.isfinite(numerator)) and bool(torch.isfinite(weighted_log))
              and abs(float(weighted_log)) > KEEPKV_GUARD_EPS * float(weight) * float(max_abs)
              and (float(numerator) == 0
                   or 1 / KEEPKV_MAX_KEY_GROWTH <= float(numerator * weight / weighted_log) <= KEEPKV_MAX_KEY_GROWTH))
    key_scale = numerator / weighted_log if usable else 1 / weight
    return w, key_scale, 1 / weight, usable


def keepkv_zip_merge(keys, values, votes, log_scores, targets, convex=False, check_targets=True):
    """KeepKV's set ZIP merge straight from the formulas, one set at a time, float64 inside (see ops.keepkv_zip_merge):
    returns (keys, values, votes) in the input dtypes. Valid targets only, so ``check_targets`` changes nothing."""
    out_k, out_v, out_p = keys.clone(), values.clone(), votes.clone()
    batch, kv_heads, slots, _ = keys.shape
    for b in range(batch):
        for h in range(kv_heads):
            for c in range(slots):
                if targets[b, h, c] != -1:
                    continue
                members = [c] + [e for e in range(slots) if targets[b, h, e] == c]
                if len(members) == 1:
                    continue
                p = votes[b, h, members].double()
                out_p[b, h, c] = p.sum().to(votes.dtype)
                coefficients = keepkv_zip_coefficients(log_scores[b, h, members].double(), p, convex)
                if coefficients is None:
                    continue
                w, key_scale, value_scale, _ = coefficients
                out_k[b, h, c] = (key_scale * (w[:, None] * keys[b, h, members].double()).sum(0)).to(keys.dtype)
                out_v[b, h, c] = (value_scale * (w[:, None] * values[b, h, members].double()).sum(0)).to(values.dtype)
    return out_k, out_v, out_p


def keepkv_match_vectorised(keys: torch.Tensor, keep: torch.Tensor, threshold: float) -> torch.Tensor:
    """keepkv_match over all rows at once (normalise, one batched matmul, masked argmax): the plain-PyTorch baseline."""
    k = keys.float()
    normalised = k / k.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    similarity = normalised @ normalised.transpose(-1, -2)  # (B, H, T, T)
    similarity = (similarity.clamp(-1, 1) / KEEPKV_COSINE_RESOLUTION).round() * KEEPKV_COSINE_RESOLUTION
    similarity = similarity.nan_to_num(nan=float("-inf")).masked_fill(~keep[:, :, None, :], float("-inf"))
    best, slot = similarity.max(-1)
    targets = torch.where(best >= threshold, slot, -2)
    return torch.where(keep, -1, targets)


def keepkv_zip_merge_vectorised(keys, values, votes, log_scores, targets, convex=False):
    """keepkv_zip_merge over all rows at once with scatters (float32): the plain-PyTorch baseline of the benchmark."""
    batch, kv_heads, slots, head_dim = keys.shape
    inf = float("inf")
    position = torch.arange(slots, device=keys.device)
    group = torch.where(targets >= 0, targets, torch.where(targets == -1, position, slots))  # -2 -> bucket T
    contributes = (votes > 0) & (log_scores > -inf)
    ell = log_scores.masked_fill(~contributes, -inf)
    m = torch.full((batch, kv_heads, slots + 1), -inf, device=keys.device).scatter_reduce(2, group, ell, "amax")
    m_member = m.gather(2, group)
    w = torch.where(contributes, votes * torch.exp(torch.where(contributes, ell - m_member, 0.0)), 0.0)
    zeros = torch.zeros(batch, kv_heads, slots + 1, device=keys.device)
    weight = zeros.scatter_add(2, group, w)
    vote_sum = zeros.scatter_add(2, group, votes)
    size = zeros.scatter_add(2, group, torch.ones_like(votes))
    weighted_log = zeros.scatter_add(2, group, torch.where(w > 0, w * ell, 0.0))
    max_abs = zeros.scatter_reduce(2, group, torch.where(w > 0, ell.abs(), 0.0), "amax")
    rows = group[..., None].expand(-1, -1, -1, head_dim)
    key_sum = torch.zeros(batch, kv_heads, slots + 1, head_dim, device=keys.device).scatter_add(
        2, rows, w[..., None] * keys.float())
    value_sum = torch.zeros_like(key_sum).scatter_add(2, rows, w[..., None] * values.float())
    numerator = m + torch.log(weight / vote_sum)
    usable = (torch.isfinite(numerator) & torch.isfinite(weighted_log)
              & (weighted_log.abs() > KEEPKV_GUARD_EPS * weight * max_abs)
              & ((numerator == 0) | ((1 / KEEPKV_MAX_KEY_GROWTH <= numerator * weight / weighted_log)
                                     & (numerator * weight / weighted_log <= KEEPKV_MAX_KEY_GROWTH)))) & (not convex)
    key_scale = torch.where(usable, numerator / weighted_log, 1 / weight)[..., :slots]
    merged = ((size > 1) & (weight > 0) & torch.isfinite(weight))[..., :slots] & (targets == -1)
    out_k = torch.where(merged[..., None], (key_sum[..., :slots, :] * key_scale[..., None]).to(keys.dtype), keys)
    out_v = torch.where(merged[..., None], (value_sum[..., :slots, :] / weight[..., :slots, None]).to(values.dtype),
                        values)
    out_p = torch.where((size[..., :slots] > 1) & (targets == -1), vote_sum[..., :slots], votes)
    return out_k, out_v, out_p


def keepkv_step_selection(keys, queries, probabilities, log_weights, log_ema, age, votes, scale, ema_decay, budget,
                          sinks, recent, threshold, logits_from="probabilities"):
    """The first half of a KeepKV decoding step (see ops.keepkv_decode_step) from the formulas, float64: per slot of
    keys (B, H, T, d) whose last q are the new tokens, the EMA ln S (eq. 8, folding the q new queries in order, each
    s̄ the group mean of exp(ℓ)), the age (+ the causal count of new queries, min(q, T - t)), the votes (1 for new
    tokens), ln ŝ = ln(S / (1 - β^age)), and the targets (keepkv_match; all -1 when T <= budget) of the eviction of
    the T - budget slots of lowest ŝ (NaN lowest, no-vote slots first, ties to the lower slot), neither sinks nor
    recent. ℓ is what the attention that gave `probabilities` (B, Hq, q, T) computed: ℓ = ln p - b + LSE, the row's
    LSE = q·k·scale + b - ln p at its slot of largest p (NaN as -inf, the first of equals; ℓ = -inf where p = 0);
    for a consistent softmax this is q·k·scale itself, which ``logits_from="queries"`` takes directly (-inf where
    b = -inf or causally masked)."""
    batch, kv_heads, slots, head_dim = keys.shape
    new_tokens, old_slots = queries.shape[2], slots - queries.shape[2]
    group = queries.shape[1] // kv_heads
    bias = log_weights.double()[:, :, None, None]
    if logits_from == "queries":
        logits = (prompt_attention(queries, keys, log_weights, scale).reshape(batch, kv_heads, group, new_tokens, slots)
                  - bias).nan_to_num(nan=float("-inf"))  # -inf - (-inf) where b = -inf: a slot no query sees
    else:
        grouped = queries.double().reshape(batch, kv_heads, group, new_tokens, head_dim)
        p = probabilities.double().reshape(batch, kv_heads, group, new_tokens, slots)
        top = p.nan_to_num(nan=float("-inf")).argmax(-1, keepdim=True)  # a NaN p poisons its own slot only
        top_keys = keys.double()[:, :, None, None].expand(-1, -1, group, new_tokens, -1, -1).gather(
            -2, top.unsqueeze(-1).expand(*top.shape, head_dim)).squeeze(-2)
        top_logit = ((grouped * top_keys).sum(-1, keepdim=True) * scale).float().double()  # float32, as attention's
        log_sum_exp = top_logit + bias.expand_as(p).gather(-1, top) - p.gather(-1, top).log()
        logits = torch.where(p > 0, p.log() - bias + log_sum_exp, float("-inf"))  # (B, H, G, q, T)
    log_mean = torch.logsumexp(logits, dim=2) - math.log(group)  # (B, H, q, T)
    log_s = F.pad(log_ema.double(), (0, new_tokens), value=float("-inf"))
    for j in range(new_tokens):
        log_s = torch.logaddexp(log_s + math.log(ema_decay), math.log1p(-ema_decay) + log_mean[:, :, j])
    sees = torch.arange(slots) <= old_slots + torch.arange(new_tokens).unsqueeze(-1)  # causal (q, T)
    new_age = F.pad(age.double(), (0, new_tokens)) + sees.sum(0)
    new_votes = F.pad(votes.double(), (0, new_tokens), value=1.0)
    log_estimate = log_s - torch.log1p(-torch.tensor(ema_decay, dtype=torch.float64) ** new_age)
    keep = torch.ones(batch, kv_heads, slots, dtype=torch.bool)
    if slots > budget:
        key = log_estimate.nan_to_num(nan=float("-inf")).masked_fill(new_votes <= 0, float("-inf"))
        protected = (torch.arange(slots) < sinks) | (torch.arange(slots) >= slots - recent)
        key = key.masked_fill(protected, float("inf"))
        order = torch.sort(key, dim=-1, stable=True).indices
        keep.scatter_(-1, order[..., :slots - budget], False)
    return log_s, new_age, new_votes, log_estimate, keepkv_match(keys, keep, threshold)


def keepkv_decode_step(keys, values, queries, probabilities, log_weights, log_ema, age, votes, scale, ema_decay,
                       budget, sinks, recent, threshold, convex, logits_from="probabilities"):
    """A KeepKV decoding step (ops.keepkv_decode_step) from the formulas, float64 inside: the selection above, eq. 7's set merge fed
    ln ŝ (keepkv_zip_merge), a merged slot's ŝ the vote-weighted mean Σ p ŝ / Σ p of its set and its age the oldest
    member's (ln S = ln ŝ + ln(1 - β^age)), then the retained slots in order."""
    log_s, new_age, new_votes, log_estimate, targets = keepkv_step_selection(
        keys, queries, probabilities, log_weights, log_ema, age, votes, scale, ema_decay, budget, sinks, recent,
        threshold, logits_from)
    batch, kv_heads, slots, _ = keys.shape
    out_keys, out_values, merged_votes = keepkv_zip_merge(keys, values, new_votes, log_estimate.float(), targets,
                                                          convex)
    merged_votes = merged_votes.double()
    log_s, new_age = log_s.clone(), new_age.clone()
    dropped = torch.zeros(batch, kv_heads, dtype=torch.float64)
    for b in range(batch):
        for h in range(kv_heads):
            dropped[b, h] = new_votes[b, h][targets[b, h] == -2].sum()
            for c in (targets[b, h] == -1).nonzero().flatten().tolist():
                members = [c] + (targets[b, h] == c).nonzero().flatten().tolist()
                if new_votes[b, h, c] <= 0:
                    log_s[b, h, c] = float("-inf")
                if len(members) == 1:
                    continue
                p = new_votes[b, h, members]
                log_merged_estimate = torch.logsumexp(p.log() + log_estimate[b, h, members], 0) - p.sum().log()
                new_age[b, h, c] = new_age[b, h, members].max()
                log_s[b, h, c] = log_merged_estimate + (-torch.expm1(new_age[b, h, c] * math.log(ema_decay))).log()
    kept = targets == -1
    rows = min(slots, budget)  # every row keeps that many

    def pack(t):
        return t[kept].reshape(batch, kv_heads, rows, *t.shape[3:])

    return (pack(out_keys), pack(out_values), pack(log_s).float(), pack(new_age).float(), pack(merged_votes).float(),
            pack(merged_votes).log().float(), dropped.float())


def nucleus_budget(probs: torch.Tensor, p: float) -> torch.Tensor:
    """GVote's |top-p(A0)|: masses (NaN and negatives as 0) sorted in descending order, cumsum in float64, the first
    k whose cumsum reaches p * total; p = 1 is the support (positive masses); at least 1 (0 for T = 0)."""
    masses = torch.where(probs.float() > 0, probs.float(), 0.0).double()
    if probs.shape[-1] == 0:
        return torch.zeros(probs.shape[:2], dtype=torch.int64)
    support = (masses > 0).sum(-1)
    if p >= 1.0:
        return support.clamp_min(1)
    cumulative = masses.sort(-1, descending=True).values.cumsum(-1)
    target = p * cumulative[..., -1:]
    below = (cumulative < target).sum(-1)
    return torch.minimum(below + 1, support).clamp_min(1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: cat(-x[d/2:], x[:d/2])."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def averaged_rope(queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation applied at each of the n_f future positions, then averaged (float64), in the queries' dtype."""
    q = queries.double()
    rotated = [q * c.double() + rotate_half(q) * s.double() for c, s in zip(cos, sin)]
    return torch.stack(rotated).mean(0).to(queries.dtype)


def topk_slots(logits: torch.Tensor, k: int) -> list[int]:
    """The k slots of largest logit, ties to the lower slot, NaN below everything (a stable sort)."""
    k = max(0, min(k, logits.shape[-1]))
    order = torch.where(logits.isnan(), float("-inf"), logits).argsort(descending=True, stable=True)
    order = order[logits[order].isnan().argsort(stable=True)]  # NaN after -inf, in slot order
    return order[:k].tolist()


def gvote_union_mask(keys: torch.Tensor, queries: torch.Tensor, budgets: torch.Tensor, sinks: int,
                     scale: float) -> torch.Tensor:
    """The keep set as a Python set union of every sample's top-k slots over the G query heads of each kv head, plus
    the sinks, from the full (B, Hq, S, T) float32 logits."""
    batch, kv_heads, total_len, _ = keys.shape
    query_heads, samples = queries.shape[1:3]
    group = query_heads // kv_heads
    k = keys.float().repeat_interleave(group, dim=1)
    logits = (queries.float() @ k.transpose(-1, -2)) * scale  # (B, Hq, S, T)
    keep = torch.zeros(batch, kv_heads, total_len, dtype=torch.bool)
    for b in range(batch):
        for h in range(kv_heads):
            kept = set(range(min(sinks, total_len)))
            for g in range(group):
                for s in range(samples):
                    kept |= set(topk_slots(logits[b, h * group + g, s].cpu(), int(budgets[b, h * group + g])))
            keep[b, h, sorted(kept)] = True
    return keep


def kvzap_surrogate_module(weight1, bias1, weight2=None, bias2=None) -> torch.nn.Module:
    """The surrogate as kvpress's KVzapModel builds one layer of it: nn.Linear, or Linear → nn.GELU() → Linear,
    holding the given weights (float32)."""
    def linear(weight, bias):
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0])
        layer.weight.data.copy_(weight.float())
        layer.bias.data.copy_(bias.float())
        return layer

    if weight2 is None:
        return linear(weight1, bias1)
    return torch.nn.Sequential(linear(weight1, bias1), torch.nn.GELU(), linear(weight2, bias2))


def kvzap_score(hidden, weight1, bias1, weight2=None, bias2=None) -> torch.Tensor:
    """(B, H, T) float32: the surrogate module run in float32 on (B, T, Dh), transposed as kvpress's
    KVzapPress.score does."""
    module = kvzap_surrogate_module(weight1.cpu(), bias1.cpu(), None if weight2 is None else weight2.cpu(),
                                    None if bias2 is None else bias2.cpu())
    with torch.no_grad():
        return module(hidden.float().cpu()).transpose(1, 2).contiguous()


def kvzap_threshold(log_weights, scores, positions, threshold, window, tokens_before, tokens_after):
    """The keep rule: a slot whose position left the window in this pass (tokens_before - window <= position <
    tokens_after - window) is evicted iff its (float32) score < threshold (NaN is not); held counts what is left."""
    begin, end = max(0, tokens_before - window), max(0, tokens_after - window)
    positions, scores = positions.cpu(), scores.cpu().float()
    leaving = (positions >= begin) & (positions < end)
    out = log_weights.cpu().masked_fill(leaving & (scores < torch.tensor(threshold, dtype=torch.float32)),
                                        float("-inf"))
    held = (out != float("-inf")).sum(-1)
    return out, held


def kvzap_decode_step(hidden, weight1, bias1, weight2, bias2, log_weights, scores, positions, threshold, window,
                      tokens_before, score=kvzap_score):
    """A decoding pass on a rectangular cache: the new tokens' scores (:func:`kvzap_score`, or `score` of the same
    arguments) and positions appended to the state's, then :func:`kvzap_threshold` over the grown state. Returns
    (log_weights, scores, positions, held)."""
    batch, heads = log_weights.shape[:2]
    new_tokens = hidden.shape[1]
    grown_scores = torch.cat([scores.cpu(), score(hidden, weight1, bias1, weight2, bias2)], -1)
    new_positions = torch.arange(tokens_before, tokens_before + new_tokens).expand(batch, heads, new_tokens)
    grown_positions = torch.cat([positions.cpu(), new_positions], -1)
    out, held = kvzap_threshold(log_weights.cpu(), grown_scores, grown_positions, threshold, window, tokens_before,
                                tokens_before + new_tokens)
    return out, grown_scores, grown_positions, held


def kvzap_paged_step(log_weight_blocks, score_blocks, position_blocks, block_tables, lengths, new_scores, threshold,
                     window, tokens_before, check_tables_on_device=False):
    """The paged decoding pass row by row, on each row's slot list: the new tokens' positions and scores written to its
    last q slots; then, if the row holds the D tokens leaving the window at slots length - window - D .. in order,
    those slots are decided by :func:`kvzap_threshold` and held counts those still held (an earlier slot claiming
    one of their positions too, in a row decoding did not make, is left alone); otherwise held is -1 and its
    log-weights stay. Returns (held, log_weight_blocks, score_blocks, position_blocks), the pools as new tensors."""
    pools = [t.clone().cpu() for t in (log_weight_blocks, score_blocks, position_blocks)]
    flat_log_weights, flat_scores, flat_positions = (t.view(-1) for t in pools)
    block_size, new_tokens = log_weight_blocks.shape[1], new_scores.shape[-1]
    tokens_after = tokens_before + new_tokens
    begin, end = max(0, tokens_before - window), max(0, tokens_after - window)
    held = torch.empty(lengths.shape, dtype=torch.int64)
    for b, h in torch.cartesian_prod(*(torch.arange(n) for n in lengths.shape)).view(-1, 2).tolist():
        length = int(lengths[b, h])
        slots = torch.tensor([int(block_tables[b, h, t // block_size]) * block_size + t % block_size
                              for t in range(length)], dtype=torch.int64)
        flat_positions[slots[length - new_tokens:]] = torch.arange(tokens_before, tokens_after)
        flat_scores[slots[length - new_tokens:]] = new_scores[b, h].cpu()
        decided = end - begin
        leaving = slots[length - window - decided:length - window] if length >= window + decided else slots[:0]
        if decided and flat_positions[leaving].tolist() != list(range(begin, end)):
            held[b, h] = -1
            continue
        row = (t[leaving].view(1, 1, -1) for t in (flat_log_weights, flat_scores, flat_positions))
        row_log_weights, _ = kvzap_threshold(*row, threshold, window, tokens_before, tokens_after)
        flat_log_weights[leaving] = row_log_weights.view(-1)
        held[b, h] = int((row_log_weights != float("-inf")).sum())
    return (held, *pools)


def dms_keep(scores: torch.Tensor, threshold: float, window: int) -> torch.Tensor:
    """The KVzap / DMS rule over a whole sequence at once (paper Algorithm 1): scores (B, H, N) of every token ever
    seen → keep (B, H, N) bool: the last `window` tokens, and every earlier token whose score is not below the
    threshold (NaN kept, as DMSPress's `scores < threshold` never selects it)."""
    total = scores.shape[-1]
    in_window = torch.arange(total, device=scores.device) >= total - window
    return in_window | ~(scores.float() < torch.tensor(threshold, dtype=torch.float32))


def prompt_attention(query: torch.Tensor, keys: torch.Tensor, log_weights: torch.Tensor, scale: float):
    """Full float64 logits ``scale * q·k + b`` of the q newest prompt queries over the T tokens, keys and b repeated
    over the G query heads, causal (query j is token T - q + j): (B, Hq, q, T), -inf where masked."""
    group = query.shape[1] // keys.shape[1]
    num_queries, total_len = query.shape[2], keys.shape[2]
    k = keys.double().repeat_interleave(group, dim=1)
    bias = log_weights.double().repeat_interleave(group, dim=1)[:, :, None, :]
    logits = scale * (query.double() @ k.transpose(-1, -2)) + bias
    slots = torch.arange(total_len, device=query.device)
    positions = total_len - num_queries + torch.arange(num_queries, device=query.device)
    return logits.masked_fill(slots[None, :] > positions[:, None], float("-inf"))


def prompt_log_sum_exp(query, keys, log_weights, scale):
    """``log Σ_i exp(logit_i)`` of every row of :func:`prompt_attention`, float64 (-inf for an empty row)."""
    return prompt_attention(query, keys, log_weights, scale).logsumexp(-1)


def prompt_scores(query, keys, log_weights, scale, decay, input_scale, log_sum_exp=None):
    """The formula in float64: ``s_i = Σ_j input_scale * decay^(q-1-j) Σ_g softmax(logits)[g, j, i]`` with the full
    softmax of :func:`prompt_attention` (empty rows 0) and the weights written out per query: (B, H, T). With
    `log_sum_exp` (B, Hq, q), as the op takes it: each row normalised by it instead, exp(logit - lse), a row whose
    log-sum-exp is ±inf adding nothing (it sees no slot) and a NaN one making its slots NaN."""
    batch, kv_heads, total_len = log_weights.shape
    logits = prompt_attention(query, keys, log_weights, scale)
    if log_sum_exp is None:
        probs = softmax_or_zero(logits)
    else:
        lse = log_sum_exp.double()[..., None]
        probs = torch.where(torch.isinf(lse), 0.0, (logits - lse).exp())
    num_queries = query.shape[2]
    weights = torch.tensor([input_scale * decay ** (num_queries - 1 - j) for j in range(num_queries)],
                           dtype=torch.float64, device=query.device)
    weighted = (probs * weights[:, None]).sum(2)  # (B, Hq, T)
    return weighted.reshape(batch, kv_heads, query.shape[1] // kv_heads, total_len).sum(2)


def prompt_attention_with_scores(query, keys, values, log_weights, scale, decay, input_scale):
    """The three outputs from their formulas, float64: the attention output ``softmax(logits) · V`` of
    :func:`prompt_attention`'s logits (V repeated over the group, empty rows 0) as (B, q, Hq, d), the log-sum-exp
    (B, Hq, q) and :func:`prompt_scores` (B, H, T)."""
    logits = prompt_attention(query, keys, log_weights, scale)
    empty_row = (logits == float("-inf")).all(-1, keepdim=True)
    probs = torch.where(empty_row, 0.0, logits.softmax(-1))
    group_values = values.double().repeat_interleave(query.shape[1] // keys.shape[1], dim=1)
    return ((probs @ group_values).transpose(1, 2), logits.logsumexp(-1),
            prompt_scores(query, keys, log_weights, scale, decay, input_scale))


def prompt_log_unnormalised_scores(query, keys, log_weights, scale, decay, input_scale):
    """``ln s_i = ln Σ_j Σ_g input_scale · decay^(q-1-j) · exp(logit[g, j, i])`` in float64, the logits of
    :func:`prompt_attention` (b added, -inf past each query's causal limit), the weights written out per query and the
    sum taken as one log-sum-exp over (g, j): (B, H, T), -inf for a slot no query sees."""
    batch, kv_heads, total_len = log_weights.shape
    num_queries = query.shape[2]
    logits = prompt_attention(query, keys, log_weights, scale)
    log_w = torch.tensor([math.log(input_scale) + (num_queries - 1 - j) * math.log(decay) for j in range(num_queries)],
                         dtype=torch.float64, device=query.device)
    group = query.shape[1] // kv_heads
    terms = (logits + log_w[:, None]).reshape(batch, kv_heads, group * num_queries, total_len)  # (B, H, G·q, T)
    return terms.logsumexp(2)


def keepkv_former_prefill_fold(queries, keys, log_weights, scale, decay, input_scale, chunk_size=256):
    """KeepKV's former prefill EMA (before kvcomp::prompt_log_unnormalised_scores), the plain-PyTorch baseline of the
    press test and the benchmark, ln S (B, H, T) float32: the window's queries a chunk of 256 at a time, their
    (B, H, G, q, T) float32 logits, each chunk folded by one log-sum-exp over (group, query) of logits + ln((1-β)
    β^(q-1-j)) masked causally, minus ln G, into ln S ← logaddexp(ln S + q ln β, folded). b is not read (KeepKV's
    prefill has none but 0)."""
    batch, kv_heads, length = keys.shape[:3]
    window, group = queries.shape[2], queries.shape[1] // kv_heads
    assert math.isclose(input_scale, (1 - decay) / group) and bool((log_weights == 0).all())
    log_ema = torch.full((batch, kv_heads, length), -math.inf)
    slots = torch.arange(length)
    for start in range(length - window, length, chunk_size):
        end = min(start + chunk_size, length)
        count = end - start
        grouped = queries[:, :, start - length + window:end - length + window].float()
        logits = grouped.view(batch, kv_heads, group, count, -1) @ keys.float().unsqueeze(2).transpose(-1, -2) * scale
        weights = math.log1p(-decay) + math.log(decay) * torch.arange(count - 1, -1, -1, dtype=torch.float32)
        bias = weights.unsqueeze(-1).masked_fill(slots > torch.arange(start, end).unsqueeze(-1), -math.inf)
        folded = torch.logsumexp(logits + bias, dim=(2, 3)) - math.log(group)
        log_ema = torch.logaddexp(log_ema + count * math.log(decay), folded)
    return log_ema


def gather_paged(blocks: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor, fill: float = 0.0):
    """The slots of a paged pool (N, S, ...) as a rectangular (B, H, T, ...) tensor, T = max(lengths), one Python
    step per slot (independent of the cache's vectorised gathers); slots beyond a head's length hold `fill`."""
    block_size = blocks.shape[1]
    batch, heads = lengths.shape
    total = int(lengths.max()) if lengths.numel() else 0
    out = torch.full((batch, heads, total, *blocks.shape[2:]), fill, dtype=blocks.dtype)
    for b in range(batch):
        for h in range(heads):
            for t in range(int(lengths[b, h])):
                out[b, h, t] = blocks[int(block_tables[b, h, t // block_size]), t % block_size]
    return out


def paged_decode_attention(query, key_blocks, value_blocks, log_weight_blocks, block_tables, lengths, scale,
                           head_attention=None):
    """Float64 paged decode attention: each (b, h) gathered to its own lengths[b, h] slots, then
    :func:`decode_attention` (or `head_attention`, of the same arguments) per (b, h) with its own causal limit (query j
    sees slots 0 .. L - q + j; a head shorter than q leaves its first queries empty: output 0). Returns (out in the
    query dtype, probs float32 padded with 0 to max(lengths))."""
    head_attention = head_attention or decode_attention
    keys = gather_paged(key_blocks, block_tables, lengths)
    values = gather_paged(value_blocks, block_tables, lengths)
    log_weights = gather_paged(log_weight_blocks, block_tables, lengths, float("-inf"))
    batch, heads = lengths.shape
    group = query.shape[1] // heads
    out = torch.zeros(query.shape, dtype=query.dtype)
    probs = torch.zeros(*query.shape[:3], keys.shape[2], dtype=torch.float32)
    for b in range(batch):
        for h in range(heads):
            length, rows = int(lengths[b, h]), slice(h * group, (h + 1) * group)
            one_head = (slice(b, b + 1), slice(h, h + 1), slice(0, length))
            head_out, head_probs = head_attention(query[b:b + 1, rows], keys[one_head], values[one_head],
                                                  log_weights[one_head], scale)
            out[b, rows], probs[b, rows, :, :length] = head_out[0], head_probs[0]
    return out, probs
