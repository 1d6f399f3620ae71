"""KeepKV ("KeepKV: Eliminating Output Perturbation in KV Cache Compression for Efficient LLMs Inference").

Each layer and kv head keeps at most M slots: 4 sinks, the recent window R and the heavy hitters of highest EMA score
estimate ``ŝ = S / (1 - β^t)`` (eq. 8, ``S ← β S + (1-β) s``), with s the unnormalised score exp(q·k·scale) of one
token of the slot (the vote bias ln p left out), averaged over the query heads of the group, initialised from the
last R prompt queries, and t the slot's own age (the queries that have seen it). S is kept in the log domain. Every
evicted slot merges into the retained slot of highest key cosine similarity if that similarity reaches the threshold
(ZIP merge, eq. 7, set form, fed ln ŝ), else it is dropped. A slot carries its electoral votes p, attended with the bias ln p (α = 1) through the shared attention
path. A kvpress scorer may choose the prompt's heavy hitters instead of ŝ; the budget may decay across layers
(PyramidInfer-style). Numerics and defaults: ``../shared/docs/methods.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from kvpress.presses.scorer_press import ScorerPress

from kvpress_cpp import ops
from kvpress_cpp.attention import take_decode_query, take_prefill_attention
from kvpress_cpp.cache import LayerState, compact_to_longest_head
from kvpress_cpp.presses.base import (KVCompDecodingPress, last_query_states, query_states, require_bool, require_int,
                                      require_real)
from kvpress_cpp.presses.kvzap import KVzapPress

__all__ = ["KeepKVPress"]


@dataclass
class KeepKVPress(KVCompDecodingPress):
    """KeepKV in prefill and at every decoding step.

    Attributes:
        budget: M, the slots kept per layer and kv head, sinks and recent window included: a token count (int ≥ 1)
            or a fraction of the prompt length (float in (0, 1]).
        sinks: leading tokens never evicted (paper: 4).
        recent: R, the recent window never evicted; the last R prompt queries initialise the EMA. A token count
            (int ≥ 1) or a fraction of the layer's budget M (float in (0, 1)), the form of the paper's appendix
            ("the ratio between the recent window and the heavy hitter varies between 5:1 and 4:1": 0.8); a
            fraction is cut to M - sinks - 1 where it would leave no heavy hitter (short prompts).
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

    budget_field = "budget"  # compression_ratio = 1 - budget (kvpress: fraction removed)
    decoding_keeps_every_slot = True  # a step merges (or evicts) down to the budget

    budget: int | float = 0.25
    sinks: int = 4
    recent: int | float = 0.8
    similarity_threshold: float = 0.8
    ema_decay: float = 0.9
    convex: bool = False
    scorer: ScorerPress | None = None
    layer_budgets: str = "uniform"
    merge_first: bool = False

    def check_parameters(self) -> None:
        require_int("KeepKVPress", "sinks", self.sinks, 0)
        if isinstance(self.recent, bool) or not ((isinstance(self.recent, int) and self.recent >= 1) or (
                isinstance(self.recent, float) and 0 < self.recent < 1)):
            raise ValueError(f"KeepKVPress: recent must be a token count ≥ 1 or a fraction of the budget in (0, 1), "
                             f"got {self.recent!r}")
        require_real("KeepKVPress", "similarity_threshold", self.similarity_threshold, "[-1, 1]")
        require_real("KeepKVPress", "ema_decay (β)", self.ema_decay, "(0, 1)")
        require_bool("KeepKVPress", "convex", self.convex)
        require_bool("KeepKVPress", "merge_first", self.merge_first)
        if self.scorer is not None and not isinstance(self.scorer, ScorerPress):
            raise ValueError(f"KeepKVPress: scorer must be a kvpress ScorerPress, got {type(self.scorer).__name__}")
        if self.layer_budgets not in ("uniform", "pyramid"):
            raise ValueError(f"KeepKVPress: layer_budgets must be 'uniform' or 'pyramid', got {self.layer_budgets!r}")
        if self.merge_first and self.scorer is not None:
            raise ValueError("KeepKVPress: merge_first ranks the merged slots by ŝ; it cannot be combined with a scorer")
        if isinstance(self.budget, int) and self.layer_budgets == "uniform":  # every prompt's M: refused here
            self.checked_recent_slots(self.budget, self.budget)

    def post_init_from_model(self, model):
        super().post_init_from_model(model)
        if self.scorer is not None:
            self.scorer.post_init_from_model(model)  # scorers that load from the model (Q-filters, KVzap, stats)

    def tensor_parallel_limitation(self) -> str | None:
        if self.scorer is None or isinstance(self.scorer, KVzapPress):
            return None
        return (f"its scorer {type(self.scorer).__name__} is a kvpress scorer, written for one process holding every "
                f"head (it may read the model's head counts against one rank's keys); use the default ŝ ranking or "
                f"kvpress_cpp.presses.KVzapPress")

    def layer_budget(self, prompt_length: int, layer_idx: int, num_layers: int) -> int:
        """M of one layer for a prompt of this length."""
        budget = self.budget_slots(prompt_length)
        if self.layer_budgets == "uniform" or num_layers == 1:
            return budget
        return pyramid_budgets(budget, num_layers)[layer_idx]

    def recent_slots(self, budget: int) -> int:
        """R for a layer of budget M: a count as given; a fraction of M, cut where it would leave no heavy hitter
        after the sinks (the default 0.8 of a 55-token prompt's M = 14 is 11, and 4 sinks + 11 refused the prompt)."""
        if isinstance(self.recent, int):
            return self.recent
        return max(1, min(round(self.recent * budget), budget - self.sinks - 1))

    def checked_recent_slots(self, budget: int, prompt_length: int, where: str = "") -> int:
        """R for a layer of budget M, which must leave a heavy hitter after the sinks and R."""
        recent = self.recent_slots(budget)
        if self.sinks + recent >= budget:
            lower = "sinks / recent" if isinstance(self.recent, int) else "sinks"  # a fractional window is cut already
            raise ValueError(f"KeepKVPress: a budget of {budget} slots{where} leaves no heavy hitter after "
                             f"{self.sinks} sinks and a recent window of {recent}; "
                             f"{self.larger_budget_advice(prompt_length)} or lower {lower}")
        return recent

    def compress_prefill(self, module, hidden_states, keys, values, attentions, log_weights, kwargs):
        length = keys.shape[-2]
        budget = self.layer_budget(length, module.layer_idx, module.config.num_hidden_layers)
        recent = self.checked_recent_slots(budget, length, f" (layer {module.layer_idx})")
        # The last `recent` prompt queries initialise the EMA: S_i = Σ_j (1-β) β^(T-1-j) s̄_j,i over the window's
        # queries j at or after slot i, s̄ the group mean of exp(q·k·scale), in the log domain by one tile-bounded op.
        window = min(recent, length)
        queries = self._window_queries(module, hidden_states, kwargs, window, keys.dtype)
        group = queries.shape[1] // keys.shape[1]
        log_ema = ops.prompt_log_unnormalised_scores(queries, keys, log_weights, module.scaling, self.ema_decay,
                                                     (1 - self.ema_decay) / group)
        # Each slot's age: the window's queries at or after it.
        age = (length - torch.arange(length, dtype=torch.float32, device=keys.device)).clamp(max=window)
        age = age.expand_as(log_ema).contiguous()
        votes = torch.ones_like(log_ema)
        state = LayerState(log_weights, {"log_ema": log_ema, "age": age, "votes": votes},
                           {"budget": budget, "recent": recent, "tokens_seen": length})
        # Tokens dropped without merge (the votes of the slots dropped), per (batch, kv head): a (B, H) float32
        # tensor kept on the device (an int would cost a host sync per step).
        state.counters["dropped"] = torch.zeros(keys.shape[:2], dtype=torch.float32, device=keys.device)
        if length <= budget:
            state.log_weights = ops.merge_count_bias(votes, 1.0)
            return keys, values, state
        ranking = None
        if self.scorer is not None:
            try:
                ranking = self.scorer.score(module, hidden_states, keys, values, attentions, kwargs).float()
            except torch.OutOfMemoryError:
                raise  # as it came: a caller backs off on it
            except (AssertionError, IndexError, RuntimeError, ValueError) as error:  # kvpress's scorers assert
                raise ValueError(f"KeepKVPress: its scorer {type(self.scorer).__name__} failed at layer "
                                 f"{module.layer_idx} on a prompt of {length} tokens: "
                                 f"{str(error) or type(error).__name__}") from error
        elif self.merge_first:
            keys, values, state = self._merge_first(keys, values, state)
        return self._evict(keys, values, state, ranking)

    def compress_decoding(self, module, hidden_states, keys, values, attentions, state, kwargs):
        new_tokens = hidden_states.shape[1]
        log_weights = state.align(keys.shape[-2] - new_tokens, new_tokens)  # the new tokens' b = 0 included
        queries = take_decode_query(module, new_tokens)
        if queries is None or queries.shape[0] != keys.shape[0]:  # a padded batch's row (RowStates): its own queries
            queries = query_states(module, hidden_states, kwargs, keys.dtype)
        # One op folds the new queries into every slot's EMA (their logits recovered from the attention's
        # probabilities, not recomputed over the keys) and, past the budget, evicts, merges and packs the layer in
        # place: a paged cache's view is updated in its blocks, and its write-back finds the slots there.
        keys, values = ops.contiguous_rows(keys), ops.contiguous_rows(values)
        keys, values, log_ema, age, votes, state.log_weights, dropped = ops.keepkv_decode_step(
            keys, values, queries, attentions, log_weights,
            state.per_slot["log_ema"], state.per_slot["age"], state.per_slot["votes"], module.scaling,
            self.ema_decay, state.counters["budget"], self.sinks, state.counters["recent"], self.similarity_threshold,
            self.convex)
        state.per_slot = {"log_ema": log_ema, "age": age, "votes": votes}
        state.counters["dropped"] = state.counters["dropped"] + dropped
        state.counters["tokens_seen"] += new_tokens
        return keys, values, state

    def prompt_score_weights(self, module):
        # No normalised scores (KeepKV's are exp(q·k·scale), not probabilities): input_scale 0 weighs every query out,
        # so the prompt pass only keeps its queries for _window_queries.
        return 1.0, 0.0

    @staticmethod
    def _window_queries(module, hidden_states, kwargs, window: int, dtype: torch.dtype) -> torch.Tensor:
        """The post-RoPE queries (B, Hq, window, d) of the prompt's last `window` tokens: those the layer's prompt
        pass kept (:meth:`prompt_score_weights`), else recomputed for the window only."""
        kept = take_prefill_attention(module, hidden_states.shape[1])
        if kept is not None:
            return kept.queries[:, :, -window:]
        return last_query_states(module, hidden_states, kwargs, window, dtype)

    def log_estimate(self, state: LayerState) -> torch.Tensor:
        """ln ŝ (B, H, T): the bias-corrected EMA of each slot's per-token score, corrected by its own age."""
        return state.per_slot["log_ema"] - _log1mexp(state.per_slot["age"] * math.log(self.ema_decay))

    def _evict(self, keys, values, state: LayerState, ranking: torch.Tensor | None = None):
        """Evict the slots beyond the budget of lowest ranking (ŝ by default) among neither the sinks nor the recent
        window, merging each into its most similar retained slot where the similarity reaches the threshold."""
        length, budget = keys.shape[-2], state.counters["budget"]
        log_estimate = self.log_estimate(state)
        ranking = (log_estimate if ranking is None else ranking).nan_to_num(nan=float("-inf"))
        protected = torch.zeros(length, dtype=torch.bool, device=keys.device)
        protected[:self.sinks] = True
        protected[length - state.counters["recent"]:] = True
        ranking = ranking.masked_fill(state.per_slot["votes"] <= 0, float("-inf")).masked_fill(protected, float("inf"))
        evicted = torch.topk(ranking, length - budget, dim=-1, largest=False).indices
        keep = torch.ones_like(ranking, dtype=torch.bool).scatter(-1, evicted, False)
        return self._merge_and_compact(keys, values, state, keep, log_estimate)

    def _merge_and_compact(self, keys, values, state: LayerState, keep: torch.Tensor, log_estimate: torch.Tensor):
        # Every row evicts exactly length - M slots and keeps M: bounds that spare the host syncs (CUDA graphs).
        evicted_per_row = keep.shape[-1] - state.counters["budget"]
        targets = ops.keepkv_match(keys, keep, self.similarity_threshold, max_evicted=evicted_per_row)
        # A dropped slot drops every token it stands for (its votes; 0 for a slot merged away by merge_first).
        dropped = state.per_slot["votes"].masked_fill(targets != -2, 0.0).sum(-1)
        state.counters["dropped"] = state.counters["dropped"] + dropped
        keys, values, merged_state = self._zip(keys, values, state, targets, log_estimate)
        keys, values, compacted = compact_to_longest_head(keys, values, keep, torch.zeros_like(log_estimate),
                                                          merged_state, longest=state.counters["budget"])
        state.per_slot = compacted.per_slot
        state.log_weights = ops.merge_count_bias(state.per_slot["votes"], 1.0)
        return keys, values, state

    def _merge_first(self, keys, values, state: LayerState):
        """Table 3's merge-first prefill: the lower half of the middle tokens by ŝ merge into their most similar
        retained token (of the upper half, the sinks or the recent window) where the similarity reaches the threshold
        (so a middle pair merges into its heavier member and chains are cut). Merged-away slots stay in place with 0
        votes, and are the first evicted by ``_evict``."""
        length = keys.shape[-2]
        recent = state.counters["recent"]
        count = length - self.sinks - recent
        if count < 2:
            return keys, values, state
        log_estimate = self.log_estimate(state)
        middle = torch.zeros(length, dtype=torch.bool, device=keys.device)
        middle[self.sinks:length - recent] = True
        ranking = log_estimate.nan_to_num(nan=float("-inf")).masked_fill(~middle, float("inf"))
        lower = torch.topk(ranking, count // 2, dim=-1, largest=False).indices
        keep = torch.ones_like(ranking, dtype=torch.bool).scatter(-1, lower, False)
        targets = ops.keepkv_match(keys, keep, self.similarity_threshold)
        targets = torch.where(targets == -2, -1, targets)  # no similar partner: stays, for the eviction by score
        merged = targets >= 0
        keys, values, merged_state = self._zip(keys, values, state, targets, log_estimate)
        merged_state["log_ema"] = merged_state["log_ema"].masked_fill(merged, float("-inf"))
        merged_state["votes"] = merged_state["votes"].masked_fill(merged, 0.0)
        state.per_slot = merged_state
        return keys, values, state

    def _zip(self, keys, values, state: LayerState, targets: torch.Tensor, log_estimate: torch.Tensor):
        """ZIP-merge the slots with a target ≥ 0 into it → keys, values and the per-slot state (log_ema, age, votes).

        The merged slot's ŝ is the vote-weighted mean Σ p ŝ / Σ p of its set, which is what eq. 7's key scores for
        a query whose scores were ŝ (theorem 3), and its age the oldest of the set's."""
        votes = state.per_slot["votes"]
        # targets come from keepkv_match: valid by construction, so CUDA skips its host-synced check.
        keys, values, merged_votes = ops.keepkv_zip_merge(keys, values, votes, log_estimate, targets, self.convex,
                                                          check_targets=False)
        slot = torch.arange(targets.shape[-1], device=targets.device).expand_as(targets)
        owner = torch.where(targets >= 0, targets, slot)
        weighted = log_estimate + votes.log()
        peak = torch.full_like(weighted, float("-inf")).scatter_reduce(-1, owner, weighted, "amax")
        peak = peak.masked_fill(~torch.isfinite(peak), 0.0)
        mass = torch.zeros_like(weighted).scatter_add(-1, owner, (weighted - peak.gather(-1, owner)).exp())
        merged_estimate = (peak + mass.log() - merged_votes.log()).masked_fill(merged_votes <= 0, float("-inf"))
        age = state.per_slot["age"].scatter_reduce(-1, owner, state.per_slot["age"], "amax")
        log_ema = merged_estimate + _log1mexp(age * math.log(self.ema_decay))
        return keys, values, {"log_ema": log_ema, "age": age, "votes": merged_votes}


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """ln(1 - e^x) for x ≤ 0, accurate at both ends (-inf at x = 0)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


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
