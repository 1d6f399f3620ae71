"""KeepKV ("KeepKV: Eliminating Output Perturbation in KV Cache Compression for Efficient LLMs Inference").

Each layer and kv head keeps at most M slots: 4 sinks, the recent window R and the heavy hitters of highest EMA score
estimate ``ŝ_t = S_t / (1 - β^t)`` (eq. 8, ``S_t = β S_{t-1} + (1-β) s_t`` with s the attention averaged over the
query heads of the group, initialised from the last R prompt queries). Every evicted slot merges into the retained
slot of highest key cosine similarity if that similarity reaches the threshold (ZIP merge, eq. 7, set form), else it
is dropped. A slot carries its electoral votes p, attended with the bias ln p (α = 1) through the shared attention
path. A kvpress scorer may choose the prompt's heavy hitters instead of ŝ; the budget may decay across layers
(PyramidInfer-style). Numerics and defaults: ``../shared/docs/methods.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from kvpress.presses.scorer_press import ScorerPress

from kvpress_cpp import ops
from kvpress_cpp.cache import LayerState, compact_to_longest_head
from kvpress_cpp.presses.base import KVCompDecodingPress, score_prompt

__all__ = ["KeepKVPress"]

# Floor under ŝ before its log enters the ZIP merge (a slot never attended has ŝ = 0).
_SCORE_FLOOR = torch.finfo(torch.float32).tiny


@dataclass
class KeepKVPress(KVCompDecodingPress):
    """KeepKV in prefill and at every decoding step.

    Attributes:
        budget: M, the slots kept per layer and kv head, sinks and recent window included: a token count (int ≥ 1)
            or a fraction of the prompt length (float in (0, 1]).
        sinks: leading tokens never evicted (paper: 4).
        recent: R, the recent window never evicted; the last R prompt queries initialise the EMA.
        similarity_threshold: an evicted slot merges only if its best key cosine reaches it (paper: 0.8).
        ema_decay: β of the EMA score estimate (not given by the paper: 0.9).
        convex: merge keys convexly, ``Σ w k / Σ w`` (the authors' released code) instead of eq. 7's ZIP key.
        scorer: a kvpress ScorerPress whose ``score`` (B, H, T) chooses the prompt's heavy hitters instead of ŝ.
        layer_budgets: "uniform", or "pyramid" (cosine decay from 1.5 M at the first layer to 0.5 M at the last,
            the mean over layers kept equal to M).
        merge_first: prefill as in the paper's table 3: merge similar pairs among all the prompt's middle tokens
            first (each token whose best similarity to a higher-scored one reaches the threshold), then evict by ŝ
            among the merged slots.
    """

    budget: int | float = 0.25
    sinks: int = 4
    recent: int = 32
    similarity_threshold: float = 0.8
    ema_decay: float = 0.9
    convex: bool = False
    scorer: ScorerPress | None = None
    layer_budgets: str = "uniform"
    merge_first: bool = False

    scores_prompt = True

    def __post_init__(self):
        if isinstance(self.budget, bool) or not ((isinstance(self.budget, int) and self.budget >= 1) or (
                isinstance(self.budget, float) and 0 < self.budget <= 1)):
            raise ValueError(f"KeepKVPress: budget must be a token count ≥ 1 or a fraction in (0, 1], "
                             f"got {self.budget!r}")
        if self.sinks < 0:
            raise ValueError(f"KeepKVPress: sinks must be ≥ 0, got {self.sinks}")
        if self.recent < 1:
            raise ValueError(f"KeepKVPress: recent must be ≥ 1, got {self.recent}")
        if not -1 <= self.similarity_threshold <= 1:
            raise ValueError(f"KeepKVPress: similarity_threshold must be in [-1, 1], got {self.similarity_threshold}")
        if not 0 < self.ema_decay < 1:
            raise ValueError(f"KeepKVPress: ema_decay (β) must be in (0, 1), got {self.ema_decay}")
        if self.scorer is not None and not isinstance(self.scorer, ScorerPress):
            raise ValueError(f"KeepKVPress: scorer must be a kvpress ScorerPress, got {type(self.scorer).__name__}")
        if self.layer_budgets not in ("uniform", "pyramid"):
            raise ValueError(f"KeepKVPress: layer_budgets must be 'uniform' or 'pyramid', got {self.layer_budgets!r}")
        if self.merge_first and self.scorer is not None:
            raise ValueError("KeepKVPress: merge_first ranks the merged slots by ŝ; it cannot be combined with a scorer")

    def layer_budget(self, prompt_length: int, layer_idx: int, num_layers: int) -> int:
        """M of one layer for a prompt of this length."""
        budget = self.budget if isinstance(self.budget, int) else max(1, round(self.budget * prompt_length))
        if self.layer_budgets == "uniform" or num_layers == 1:
            return budget
        return pyramid_budgets(budget, num_layers)[layer_idx]

    def compress_prefill(self, module, hidden_states, keys, values, attentions, log_weights, kwargs):
        if not bool(torch.isfinite(log_weights).all()):
            raise ValueError("KeepKVPress: padded batches are not supported (padding would be merged into real "
                             "tokens); pass sequences of equal length")
        length = keys.shape[-2]
        budget = self.layer_budget(length, module.layer_idx, module.config.num_hidden_layers)
        if self.sinks + self.recent >= budget:
            raise ValueError(f"KeepKVPress: a budget of {budget} slots (layer {module.layer_idx}) leaves no heavy "
                             f"hitter after {self.sinks} sinks and a recent window of {self.recent}; raise the budget "
                             f"or lower sinks / recent")
        group_size = module.config.num_attention_heads // keys.shape[1]
        steps = min(self.recent, length)
        ema = score_prompt(module, hidden_states, keys, log_weights, kwargs, self.ema_decay,
                           (1 - self.ema_decay) / group_size, first_query=length - steps)
        votes = torch.ones_like(ema)
        state = LayerState(log_weights, {"ema": ema, "votes": votes},
                           {"steps": steps, "budget": budget, "tokens_seen": length, "group_size": group_size})
        # Tokens dropped without merge (the votes of the slots dropped), per (batch, kv head): a (B, H) float32
        # tensor kept on the device (an int would cost a host sync per step).
        state.counters["dropped"] = torch.zeros(keys.shape[:2], dtype=torch.float32, device=keys.device)
        if length <= budget:
            state.log_weights = ops.merge_count_bias(votes, 1.0)
            return keys, values, state
        ranking = None
        if self.scorer is not None:
            ranking = self.scorer.score(module, hidden_states, keys, values, attentions, kwargs).float()
        elif self.merge_first:
            keys, values, state = self._merge_first(keys, values, state)
        return self._evict(keys, values, state, ranking)

    def compress_decoding(self, module, hidden_states, keys, values, attentions, state, kwargs):
        new_tokens = hidden_states.shape[1]
        state.per_slot["ema"] = ops.update_scores(state.per_slot["ema"], attentions, self.ema_decay,
                                                  (1 - self.ema_decay) / state.counters["group_size"])
        state.per_slot["votes"] = torch.nn.functional.pad(state.per_slot["votes"], (0, new_tokens), value=1.0)
        state.counters["steps"] += new_tokens
        state.counters["tokens_seen"] += new_tokens
        if keys.shape[-2] <= state.counters["budget"]:
            state.log_weights = ops.merge_count_bias(state.per_slot["votes"], 1.0)
            return keys, values, state
        return self._evict(keys, values, state)

    def estimate(self, state: LayerState) -> torch.Tensor:
        """ŝ (B, H, T): the bias-corrected EMA."""
        return state.per_slot["ema"] / (1 - self.ema_decay ** state.counters["steps"])

    def _evict(self, keys, values, state: LayerState, ranking: torch.Tensor | None = None):
        """Evict the slots beyond the budget of lowest ranking (ŝ by default) among neither the sinks nor the recent
        window, merging each into its most similar retained slot where the similarity reaches the threshold."""
        length, budget = keys.shape[-2], state.counters["budget"]
        estimate = self.estimate(state)
        ranking = (estimate if ranking is None else ranking).nan_to_num(nan=float("-inf"))
        protected = torch.zeros(length, dtype=torch.bool, device=keys.device)
        protected[:self.sinks] = True
        protected[length - self.recent:] = True
        ranking = ranking.masked_fill(state.per_slot["votes"] <= 0, float("-inf")).masked_fill(protected, float("inf"))
        evicted = torch.topk(ranking, length - budget, dim=-1, largest=False).indices
        keep = torch.ones_like(ranking, dtype=torch.bool).scatter(-1, evicted, False)
        return self._merge_and_compact(keys, values, state, keep, estimate)

    def _merge_and_compact(self, keys, values, state: LayerState, keep: torch.Tensor, estimate: torch.Tensor):
        targets = ops.keepkv_match(keys, keep, self.similarity_threshold)
        # A dropped slot drops every token it stands for (its votes; 0 for a slot merged away by merge_first).
        dropped = state.per_slot["votes"].masked_fill(targets != -2, 0.0).sum(-1)
        state.counters["dropped"] = state.counters["dropped"] + dropped
        keys, values, votes, ema = self._zip(keys, values, state, targets, estimate)
        keys, values, compacted = compact_to_longest_head(keys, values, keep, torch.zeros_like(votes),
                                                          {"ema": ema, "votes": votes})
        state.per_slot = compacted.per_slot
        state.log_weights = ops.merge_count_bias(state.per_slot["votes"], 1.0)
        return keys, values, state

    def _merge_first(self, keys, values, state: LayerState):
        """Table 3's merge-first prefill: the lower half of the middle tokens by ŝ merge into their most similar token
        of the upper half where the similarity reaches the threshold (so a pair merges into its heavier member and
        chains are cut). Merged-away slots stay in place with 0 votes, and are the first evicted by ``_evict``."""
        length = keys.shape[-2]
        count = length - self.sinks - self.recent
        if count < 2:
            return keys, values, state
        estimate = self.estimate(state)
        middle = torch.zeros(length, dtype=torch.bool, device=keys.device)
        middle[self.sinks:length - self.recent] = True
        ranking = estimate.nan_to_num(nan=float("-inf")).masked_fill(~middle, float("inf"))
        lower = torch.topk(ranking, count // 2, dim=-1, largest=False).indices
        keep = torch.ones_like(ranking, dtype=torch.bool).scatter(-1, lower, False)
        targets = ops.keepkv_match(keys, keep, self.similarity_threshold)
        targets = torch.where(targets == -2, -1, targets)  # no similar partner: stays, for the eviction by score
        merged = targets >= 0
        keys, values, votes, ema = self._zip(keys, values, state, targets, estimate)
        state.per_slot = {"ema": ema.masked_fill(merged, 0.0), "votes": votes.masked_fill(merged, 0.0)}
        return keys, values, state

    def _zip(self, keys, values, state: LayerState, targets: torch.Tensor, estimate: torch.Tensor):
        """ZIP-merge the slots with a target ≥ 0 into it: (keys, values, votes, EMA); a merged slot's EMA is the sum
        of its set's (theorem 3: it is attended as they were)."""
        votes, ema = state.per_slot["votes"], state.per_slot["ema"]
        # ŝ estimates the attention p·s of a slot of p votes (the bias ln p is in the attention that fed it); the ZIP
        # merge wants the score s of one of its tokens.
        log_scores = (estimate / votes.clamp_min(1.0)).clamp_min(_SCORE_FLOOR).log()
        keys, values, votes = ops.keepkv_zip_merge(keys, values, votes, log_scores, targets, self.convex)
        merged = targets >= 0
        slot = torch.arange(targets.shape[-1], device=targets.device).expand_as(targets)
        ema = ema.scatter_add(-1, torch.where(merged, targets, slot), torch.where(merged, ema, 0.0))
        return keys, values, votes, ema


def pyramid_budgets(budget: int, num_layers: int, amplitude: float = 0.5) -> list[int]:
    """Per-layer budgets decaying as a cosine from (1 + amplitude)·M to (1 - amplitude)·M, summing to exactly
    num_layers·M (the cosine's mean over equally spaced layers is 0; rounding leftovers go to the largest
    remainders)."""
    exact = [budget * (1 + amplitude * math.cos(math.pi * layer / (num_layers - 1))) for layer in range(num_layers)]
    floors = [max(1, math.floor(value)) for value in exact]
    leftover = budget * num_layers - sum(floors)
    for layer in sorted(range(num_layers), key=lambda layer: floors[layer] - exact[layer])[:max(0, leftover)]:
        floors[layer] += 1
    return floors
