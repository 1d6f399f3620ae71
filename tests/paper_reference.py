"""The five methods as plain PyTorch, written from the papers and ``../shared/docs/methods.md`` (not from
kvpress_cpp's ops or presses), for the end-to-end tests (tests/test_end_to_end_methods.py).

Each reference follows one attention layer: it is fed, at every forward, the layer's new queries (post-RoPE), keys,
values and attention input as the model computed them, keeps its own cache per (batch, kv head) in float64 with
Python-level loops, and exposes that cache in the slot layout the method describes. It computes every attention
probability, score, choice and merge itself, in float64; a key or value it computes (a merge) is rounded to the
model's dtype once computed (:func:`stored`), as the cache stores it, so a float16 / bfloat16 model's reference holds
what that cache can hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["LayerInputs", "ZSMerge", "WeightedKV", "KeepKV", "GVote", "KVzap"]


@dataclass
class LayerInputs:
    """What one forward of one attention layer saw: queries (B, Hq, q, d), keys and values (B, H, q, d) of the q new
    tokens, the attention input (B, q, Dh), the attention scale, the layer index and the attention module."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    hidden: torch.Tensor
    scale: float
    layer_idx: int
    module: torch.nn.Module

    def every_head(self):
        """(b, h, queries, keys, values) of every (batch, kv head), as ``head``."""
        for b in range(self.keys.shape[0]):
            for h in range(self.keys.shape[1]):
                yield b, h, *self.head(b, h)

    def head(self, b: int, h: int):
        """(queries (G, q, d), keys (q, d), values (q, d)) of one (batch, kv head), float64."""
        group = self.queries.shape[1] // self.keys.shape[1]
        return (self.queries[b, h * group:(h + 1) * group].double(), self.keys[b, h].double(),
                self.values[b, h].double())


def probabilities(queries: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q·k·scale + bias) (G, q, n) of the q newest of n slots (causal among them)."""
    logits = queries @ keys.T * scale + bias
    q, n = queries.shape[-2], keys.shape[0]
    hidden = torch.arange(n) > (n - q + torch.arange(q)).unsqueeze(-1)
    return logits.masked_fill(hidden, float("-inf")).softmax(-1)


def stored(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A key or value computed in float64 as a cache of `dtype` (the model's) holds it: rounded once to that dtype."""
    return tensor.to(dtype).double()


def first_argmin(values: list[float]) -> int:
    return min(range(len(values)), key=lambda i: (values[i], i))


class ZSMerge:
    """ZSMerge (paper §3, Algorithm 1) with the methods.md defaults. Layout: [residual | context | recent ring].

    The prompt's scores are its decayed attention sums (methods.md). With `similarity_prefill` the prompt is laid out
    only up to the budget (M tokens, so each residual slot holds one token, as Algorithm 1 lines 12-13 fill them) and
    every later prompt token enters as a decoding token does: the lowest-score context token merges into the residual
    slot of largest k_r·k_t (eqs. 6-7), with the prompt's scores, which the prompt's queries have already set. A
    prompt within the budget is held as it is; the decoding token that first takes the cache past M finds the M tokens
    laid out the same way (one per residual slot) and enters as every later token does."""

    def __init__(self, budget: int, recent_fraction: float = 0.4, residual: int = 1, decay: float = 0.98,
                 alpha: float = 0.6, paper_order: bool = False, similarity_prefill: bool = False):
        self.recent = max(1, round(recent_fraction * budget))
        self.residual, self.context = residual, budget - self.recent - residual
        self.decay, self.alpha, self.paper_order = decay, alpha, paper_order
        self.similarity_prefill = similarity_prefill
        self.heads = {}
        self.leaving_evicted = 0  # steps where the paper's order evicted the token leaving the recent window

    def prefill(self, x: LayerInputs) -> None:
        budget = self.recent + self.context + self.residual
        for b, h, queries, keys, values in x.every_head():
            tokens = keys.shape[0]
            attention = probabilities(queries, keys, torch.zeros(tokens, dtype=torch.float64), x.scale)
            decays = self.decay ** torch.arange(tokens - 1, -1, -1, dtype=torch.float64)
            score = (attention * decays.unsqueeze(-1)).sum((0, 1)).tolist()  # Σ_g Σ_j λ^(T-1-j) A[j, i]
            if tokens <= budget:  # room for every token: each is held as it is until the cache first exceeds M
                self.heads[b, h] = {"held": [dict(key=keys[i], value=values[i], count=1.0, score=score[i])
                                             for i in range(tokens)]}
                continue
            laid_out = budget if self.similarity_prefill else tokens
            head = {"slots": self.lay_out(keys[:laid_out], values[:laid_out], score[:laid_out], x.keys.dtype),
                    "ring": 0}
            for t in range(laid_out, tokens):
                self.admit(head, dict(key=keys[t], value=values[t], count=1.0, score=score[t]), x.keys.dtype)
            self.heads[b, h] = head

    def lay_out(self, keys: torch.Tensor, values: torch.Tensor, score: list[float], dtype: torch.dtype) -> list[dict]:
        """methods.md's prefill: the last Bp tokens, the top-Bc of the rest by score, the remaining tokens averaged in
        Br contiguous groups (one token each when exactly Br remain)."""
        tokens = keys.shape[0]
        older = range(tokens - self.recent)
        context = sorted(sorted(older, key=lambda i: (-score[i], i))[:self.context])
        merged = [i for i in older if i not in context]
        groups, start = [], 0
        for group in range(self.residual):
            size = len(merged) // self.residual + (group < len(merged) % self.residual)
            groups.append(merged[start:start + size])
            start += size
        slots = [dict(key=stored(keys[g].mean(0), dtype), value=stored(values[g].mean(0), dtype),
                      count=float(len(g)), score=max(score[i] for i in g)) for g in groups]
        return slots + [dict(key=keys[i], value=values[i], count=1.0, score=score[i])
                        for i in context + list(range(tokens - self.recent, tokens))]

    def decode(self, x: LayerInputs) -> None:
        """q new tokens (the paper's q = 1, or a multi-token pass read as q steps of the scores, then the tokens
        entering in order): each query in turn updates eq. 5's scores of the slots and of the new tokens it sees."""
        budget = self.recent + self.context + self.residual
        for (b, h), head in self.heads.items():
            queries, keys, values = x.head(b, h)
            slots = head.get("slots", head.get("held"))
            held, new_tokens = len(slots), keys.shape[0]
            bias = torch.tensor([self.alpha * math.log(slot["count"]) for slot in slots] + [0.0] * new_tokens,
                                dtype=torch.float64)
            all_keys = torch.cat([torch.stack([slot["key"] for slot in slots]), keys])
            attention = probabilities(queries, all_keys, bias, x.scale).sum(0)  # eq. 5, summed over the group
            new_scores = [0.0] * new_tokens
            for j in range(new_tokens):
                for slot, a in zip(slots, attention[j, :held].tolist()):
                    slot["score"] = self.decay * slot["score"] + a
                new_scores = [self.decay * s + a for s, a in zip(new_scores, attention[j, held:].tolist())]
            for t in range(new_tokens):
                new = dict(key=keys[t], value=values[t], count=1.0, score=new_scores[t])
                if "held" in head:
                    if len(slots) < budget:
                        slots.append(new)
                        continue
                    # The cache first exceeds M: Algorithm 1 has filled every slot, one token each, and merges from
                    # here.
                    head["slots"] = self.lay_out(torch.stack([t["key"] for t in slots]),
                                                 torch.stack([t["value"] for t in slots]),
                                                 [t["score"] for t in slots], x.keys.dtype)
                    head["ring"] = 0
                    del head["held"]
                    slots = head["slots"]
                self.admit(head, new, x.keys.dtype)

    def admit(self, head: dict, new: dict, dtype: torch.dtype) -> None:
        """One token enters a full cache (Algorithm 1, lines 6-16): the lowest-score context token is merged into the
        residual slot of largest k_r·k_t (eq. 6) as a count-weighted mean (eq. 7), the oldest recent token takes its
        slot and the new token the ring's."""
        slots = head["slots"]
        first_context = self.residual
        leaving = first_context + self.context + head["ring"]
        candidates = list(range(first_context, first_context + self.context))
        if self.paper_order:  # Algorithm 1: the token leaving the recent window joins the context first
            candidates.append(leaving)
        evicted = candidates[first_argmin([slots[i]["score"] for i in candidates])]
        if self.residual:
            victim = slots[evicted]
            target = max(range(self.residual), key=lambda j: (float(slots[j]["key"] @ victim["key"]), -j))
            into = slots[target]
            total = victim["count"] + into["count"]
            into["key"] = stored((victim["count"] * victim["key"] + into["count"] * into["key"]) / total, dtype)
            into["value"] = stored((victim["count"] * victim["value"] + into["count"] * into["value"]) / total, dtype)
            into["count"], into["score"] = total, max(victim["score"], into["score"])
        if evicted != leaving:
            slots[evicted] = slots[leaving]
        else:
            self.leaving_evicted += 1
        slots[leaving] = new
        head["ring"] = (head["ring"] + 1) % self.recent

    def cache(self, b: int, h: int) -> dict[str, torch.Tensor]:
        head = self.heads[b, h]
        slots = head.get("slots", head.get("held"))
        counts = torch.tensor([slot["count"] for slot in slots], dtype=torch.float64)
        return {"keys": torch.stack([slot["key"] for slot in slots]),
                "values": torch.stack([slot["value"] for slot in slots]),
                "log_weights": self.alpha * counts.log(), "counts": counts,
                "scores": torch.tensor([slot["score"] for slot in slots], dtype=torch.float64)}


class WeightedKV:
    """WeightedKV (paper Algorithm 1): running attention sums a and counts n, evict the key of the lowest mean a/n in
    the middle region and fold its value into its right neighbour. No attention bias."""

    def __init__(self, size: int, sinks: int = 4, recent: int | None = None):
        self.size, self.sinks = size, sinks
        self.recent = recent if recent is not None else size // 2 - 4
        self.heads = {}

    def prefill(self, x: LayerInputs) -> None:
        for b, h, queries, keys, values in x.every_head():
            tokens = keys.shape[0]
            attention = probabilities(queries, keys, torch.zeros(tokens, dtype=torch.float64), x.scale).mean(0)
            head = {"keys": list(keys), "values": list(values), "sums": attention.sum(0).tolist(),
                    "counts": [float(tokens - i) for i in range(tokens)], "dtype": x.values.dtype}
            while len(head["keys"]) > self.size:
                self.evict(head)
            self.heads[b, h] = head

    def decode(self, x: LayerInputs) -> None:
        """q new tokens (q = 1 in the paper; a multi-token pass adds each query's attention, counts the queries that
        saw each slot, then evicts down to the cache size)."""
        for (b, h), head in self.heads.items():
            queries, keys, values = x.head(b, h)
            new_tokens = keys.shape[0]
            all_keys = torch.stack(head["keys"] + list(keys))
            attention = probabilities(queries, all_keys, torch.zeros(len(all_keys), dtype=torch.float64),
                                      x.scale).mean(0).sum(0)
            head["keys"] += list(keys)
            head["values"] += list(values)
            head["sums"] = [a + t for a, t in zip(head["sums"] + [0.0] * new_tokens, attention.tolist())]
            head["counts"] = ([n + new_tokens for n in head["counts"]]
                              + [float(new_tokens - t) for t in range(new_tokens)])
            while len(head["keys"]) > self.size:
                self.evict(head)

    def evict(self, head: dict) -> None:
        mean = [a / n for a, n in zip(head["sums"], head["counts"])]
        middle = range(self.sinks, len(mean) - self.recent)
        j = middle[first_argmin([mean[i] for i in middle])]
        values = head["values"]
        values[j + 1] = stored((mean[j] * values[j] + mean[j + 1] * values[j + 1]) / (mean[j] + mean[j + 1]),
                               head["dtype"])
        for name in ("keys", "values", "sums", "counts"):
            del head[name][j]

    def cache(self, b: int, h: int) -> dict[str, torch.Tensor]:
        head = self.heads[b, h]
        return {"keys": torch.stack(head["keys"]), "values": torch.stack(head["values"]),
                "log_weights": torch.zeros(len(head["keys"]), dtype=torch.float64),
                "counts": torch.tensor(head["counts"], dtype=torch.float64),
                "scores": torch.tensor(head["sums"], dtype=torch.float64)}


class KeepKV:
    """KeepKV (paper eqs. 7-8 as methods.md records them): electoral votes p attended as ln p, EMA score estimates
    ŝ = S / (1 - β^t) of s = exp(q·k·scale) (group mean, t the slot's own age), 4 sinks, a recent window, the heavy
    hitters of highest ŝ; each evicted slot merges into its most cosine-similar retained slot (ZIP merge, eq. 7) if
    the similarity reaches the threshold, else it is dropped. A merged slot's ŝ is Σ p ŝ / Σ p (what eq. 7's key
    scores for a query whose scores were ŝ) and its age the oldest of its set's."""

    def __init__(self, budget: int, sinks: int = 4, recent: int = 32, threshold: float = 0.8, beta: float = 0.9,
                 max_key_growth: float | None = None):
        self.budget, self.sinks, self.recent, self.threshold, self.beta = budget, sinks, recent, threshold, beta
        # None: methods.md's guard alone (eq. 7's key wherever its denominator is not near 0 nor of the other sign).
        # A number g: also the convex key where eq. 7's key is more than g times, or less than 1/g times, the convex
        # key: the press's documented deviation (README, KeepKV; kernels::kZipMaxKeyGrowth).
        self.max_key_growth = max_key_growth
        self.heads = {}

    def prefill(self, x: LayerInputs) -> None:
        for b, h, queries, keys, values in x.every_head():
            tokens = keys.shape[0]
            head = {"keys": list(keys), "values": list(values), "votes": [1.0] * tokens,
                    "ema": [0.0] * tokens, "age": [0] * tokens, "dtype": x.keys.dtype}
            steps = min(self.recent, tokens)
            for j in range(tokens - steps, tokens):  # the last R prompt queries, in order
                self.observe(head, queries[:, j] @ keys[:j + 1].T * x.scale)
            self.evict(head)
            self.heads[b, h] = head

    def decode(self, x: LayerInputs) -> None:
        """q new tokens (q = 1 in the paper; a multi-token pass observes its queries in order, each over the slots
        it sees, then evicts down to the budget once)."""
        for (b, h), head in self.heads.items():
            queries, keys, values = x.head(b, h)
            held = len(head["keys"])
            for t in range(keys.shape[0]):
                for name, new in (("keys", keys[t]), ("values", values[t]), ("votes", 1.0), ("ema", 0.0),
                                  ("age", 0)):
                    head[name].append(new)
            every_key = torch.stack(head["keys"])
            for j in range(keys.shape[0]):
                self.observe(head, queries[:, j] @ every_key[:held + j + 1].T * x.scale)
            self.evict(head)

    def observe(self, head: dict, logits: torch.Tensor) -> None:
        """One query: S ← β S + (1-β) s for the slots it sees (logits (G, seen)), s the group mean of exp(logit)."""
        scores = logits.exp().mean(0).tolist()
        for i, s in enumerate(scores):
            head["ema"][i] = self.beta * head["ema"][i] + (1 - self.beta) * s
            head["age"][i] += 1

    def estimate(self, head: dict) -> list[float]:
        return [s / (1 - self.beta ** t) for s, t in zip(head["ema"], head["age"])]

    def evict(self, head: dict) -> None:
        count = len(head["keys"])
        if count <= self.budget:
            return
        estimate = self.estimate(head)
        middle = range(self.sinks, count - self.recent)
        evicted = sorted(middle, key=lambda i: estimate[i])[:count - self.budget]
        retained = [i for i in range(count) if i not in evicted]
        keys = torch.stack(head["keys"])
        norms = keys.norm(dim=-1, keepdim=True)
        unit = torch.where(norms == 0, 0.0, keys / norms)  # a zero key's cosine is 0; a non-finite key's NaN
        sets = {c: [c] for c in retained}
        for e in evicted:
            similarity = (unit[retained] @ unit[e]).nan_to_num(nan=float("-inf"))
            if float(similarity.max()) >= self.threshold:
                sets[retained[int(similarity.argmax())]].append(e)
        for c, members in sets.items():
            if len(members) > 1:
                self.zip_merge(head, c, members, estimate)
        for name in ("keys", "values", "votes", "ema", "age"):
            head[name] = [head[name][i] for i in retained]

    def zip_merge(self, head: dict, c: int, members: list[int], estimate: list[float]) -> None:
        """Eq. 7, set form: w = p ŝ, k_r = (Σ w k)·ln(Σ w / Σ p) / Σ (w ln ŝ) (the convex key Σ w k / Σ w when the
        denominator is near 0 or of the other sign), v_r = Σ w v / Σ w, p_r = Σ p."""
        p = torch.tensor([head["votes"][i] for i in members], dtype=torch.float64)
        s = torch.tensor([estimate[i] for i in members], dtype=torch.float64)
        keys = torch.stack([head["keys"][i] for i in members])
        values = torch.stack([head["values"][i] for i in members])
        w = p * s
        numerator, denominator = (w.sum() / p.sum()).log(), (w * s.log()).sum()
        convex = bool(denominator.abs() <= 1e-3 * w.sum() * s.log().abs().max() or numerator * denominator < 0)
        if self.max_key_growth is not None and not convex and numerator != 0:
            growth = float(numerator * w.sum() / denominator)  # eq. 7's key over the convex key
            convex = not 1 / self.max_key_growth <= growth <= self.max_key_growth
        key = (w @ keys) / w.sum() if convex else (w @ keys) * numerator / denominator
        head["keys"][c], head["values"][c] = stored(key, head["dtype"]), stored((w @ values) / w.sum(), head["dtype"])
        head["votes"][c] = float(p.sum())
        head["age"][c] = max(head["age"][i] for i in members)
        head["ema"][c] = float((p @ s) / p.sum()) * (1 - self.beta ** head["age"][c])

    def cache(self, b: int, h: int) -> dict[str, torch.Tensor]:
        head = self.heads[b, h]
        votes = torch.tensor(head["votes"], dtype=torch.float64)
        return {"keys": torch.stack(head["keys"]), "values": torch.stack(head["values"]),
                "log_weights": votes.log(), "counts": votes,
                "scores": torch.tensor(self.estimate(head), dtype=torch.float64).log()}


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's RoPE cos and sin (n, d) at these positions (no scaling)."""
    inverse_frequency = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.double().unsqueeze(-1) * inverse_frequency
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class GVote:
    """GVote (paper Algorithm 1) at prefill; decoding appends. Per query head: budget B = the size of the top-p set
    of the last prompt query's attention; S Gaussian samples of the attention input (mean and biased variance over
    the tokens after the sinks), projected by q_proj, with RoPE averaged over the n_f positions after the prompt;
    each sample keeps its top-B keys; the union over samples and over the group is kept (plus the sinks with
    `keep_sinks`, methods.md's form).
    The documented deviations: the last `recent` tokens kept too, and the budget taken from the mean attention of the
    last `budget_queries` prompt queries."""

    def __init__(self, nucleus_p: float = 0.95, samples: int = 8, future: int = 512, sinks: int = 4, seed: int = 0,
                 keep_sinks: bool = False, recent: int = 0, budget_queries: int = 1):
        self.nucleus_p, self.samples, self.future, self.sinks, self.seed = nucleus_p, samples, future, sinks, seed
        self.keep_sinks, self.recent, self.budget_queries = keep_sinks, recent, budget_queries
        self.heads = {}

    def prefill(self, x: LayerInputs) -> None:
        batch, kv_heads, tokens, head_dim = x.keys.shape
        group = x.queries.shape[1] // kv_heads
        config = x.module.config
        # The draws are seeded per layer (the press's documented seed + layer index), one draw for every row (a prompt
        # is compressed as when run alone, wherever it sits in a batch), so both sample the same points.
        generator = torch.Generator().manual_seed(self.seed + x.layer_idx)
        noise = torch.randn(self.samples, x.hidden.shape[-1], generator=generator)
        # transformers 4 keeps θ on the config, transformers 5 in its rope_parameters
        theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
        cos, sin = rotary_tables(torch.arange(tokens, tokens + self.future), head_dim, theta)
        cos, sin = cos.mean(0), sin.mean(0)
        for b in range(batch):
            body = x.hidden[b, self.sinks:].double()
            samples = (body.mean(0) + body.var(0, unbiased=False).sqrt() * noise.double()).float()
            queries = x.module.q_proj(samples.to(x.module.q_proj.weight.dtype)).view(self.samples, -1, head_dim)
            if hasattr(x.module, "q_norm"):  # "q_proj (+ q_norm)" (methods.md): Qwen3 normalises each head's query
                queries = x.module.q_norm(queries)
            queries = queries.double()  # (S, Hq, d)
            queries = queries * cos + rotate_half(queries) * sin
            for h in range(kv_heads):
                last_queries, keys, values = x.head(b, h)
                keep = set(range(min(self.sinks, tokens))) if self.keep_sinks else set()
                keep |= set(range(max(0, tokens - self.recent), tokens))
                for g in range(group):
                    count = min(self.budget_queries, tokens)
                    attention = probabilities(last_queries[g:g + 1, -count:], keys, torch.zeros(tokens), x.scale)
                    attention = attention[0].mean(0)
                    mass = attention.sort(descending=True).values.cumsum(0)
                    budget = min(int((mass < self.nucleus_p).sum()) + 1, tokens)
                    for sample in range(self.samples):
                        logits = queries[sample, h * group + g] @ keys.T
                        keep |= set(logits.topk(budget).indices.tolist())
                kept = sorted(keep)
                self.heads[b, h] = {"keys": list(keys[kept]), "values": list(values[kept])}

    def decode(self, x: LayerInputs) -> None:
        for (b, h), head in self.heads.items():
            _, keys, values = x.head(b, h)
            head["keys"] += list(keys)
            head["values"] += list(values)

    def cache(self, b: int, h: int) -> dict[str, torch.Tensor]:
        head = self.heads[b, h]
        return {"keys": torch.stack(head["keys"]), "values": torch.stack(head["values"])}


def kvzap_surrogate_scores(surrogate: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """(B, q, H) float64 log-scores of KVzap's surrogate on the attention input (B, q, Dh): KVzap-Linear
    ``x W^T + b``, or KVzap-MLP, two layers with a GELU between them (the exact, erf form) and a hidden width Dh / 8."""
    def linear(layer, x):
        return x @ layer.weight.double().T + layer.bias.double()

    if isinstance(surrogate, torch.nn.Linear):
        return linear(surrogate, hidden.double())
    first, _, last = surrogate
    pre = linear(first, hidden.double())
    return linear(last, 0.5 * pre * (1 + torch.erf(pre / math.sqrt(2))))


class KVzap:
    """KVzap (paper Algorithm 1, DMS-style keep rule): a surrogate on the attention input predicts each token's
    log-score per kv head; a token is decided once, when it leaves the window of the last w tokens, and evicted if
    its score is below τ."""

    def __init__(self, surrogates: list[torch.nn.Module], threshold: float, window: int):
        self.surrogates, self.threshold, self.window = surrogates, threshold, window
        self.heads, self.tokens = {}, 0

    def prefill(self, x: LayerInputs) -> None:
        self.tokens = 0
        self.heads = {(b, h): {"keys": [], "values": [], "scores": [], "positions": []}
                      for b in range(x.keys.shape[0]) for h in range(x.keys.shape[1])}
        self.decode(x)

    def decode(self, x: LayerInputs) -> None:
        surrogate = self.surrogates[x.layer_idx]
        scores = kvzap_surrogate_scores(surrogate, x.hidden)  # (B, q, H)
        new_tokens = x.keys.shape[2]
        for (b, h), head in self.heads.items():
            _, keys, values = x.head(b, h)
            head["keys"] += list(keys)
            head["values"] += list(values)
            head["scores"] += scores[b, :, h].tolist()
            head["positions"] += list(range(self.tokens, self.tokens + new_tokens))
        self.tokens += new_tokens
        for head in self.heads.values():
            kept = [i for i, (position, score) in enumerate(zip(head["positions"], head["scores"]))
                    if position >= self.tokens - self.window or not score < self.threshold]
            for name in head:
                head[name] = [head[name][i] for i in kept]

    def cache(self, b: int, h: int) -> dict[str, torch.Tensor]:
        head = self.heads[b, h]
        return {"keys": torch.stack(head["keys"]), "values": torch.stack(head["values"]),
                "positions": torch.tensor(head["positions"], dtype=torch.float64)}
