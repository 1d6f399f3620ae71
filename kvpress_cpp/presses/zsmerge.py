"""ZSMerge (Liu, Liu and Tang, "ZSMerge: Zero-Shot KV Cache Compression for Memory-Efficient Long-Context LLMs").

Each layer and kv head holds at most M = Bp + Bc + Br slots: the Bp most recent tokens (a ring), the Bc tokens of
highest contribution score, and Br residual slots into which evicted tokens are merged. Scores decay (eq. 5,
``s ← λ·s + a`` with a the attention summed over the query heads of the group); a merged slot standing for w tokens
is attended with the bias α·ln w (eq. 8) through the shared attention path. Order of operations and defaults follow
the authors' code unless ``eviction_order="paper"`` (``../shared/docs/methods.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress_cpp import ops
from kvpress_cpp.cache import LayerState
from kvpress_cpp.presses.base import KVCompDecodingPress, require_int, require_real, score_prompt
from kvpress_cpp.presses.streaming import StreamingPrefill

__all__ = ["ZSMergePress"]


@dataclass
class ZSMergePress(StreamingPrefill, KVCompDecodingPress):
    """ZSMerge in prefill and at every decoding step.

    Attributes:
        budget: M, the slots kept per layer and kv head: a token count (int ≥ 1) or a fraction of the prompt
            length (float in (0, 1]).
        recent_fraction: Bp / M, the recent ring (authors' scripts: 0.4).
        residual_slots: Br, the merge slots (paper default 1; 0 turns ZSMerge into pure eviction).
        decay: λ of the contribution score (eq. 5).
        alpha: α of the merge-count bias α·ln w (eq. 8; 0 attends a merged slot as one token).
        prefill_merge: "contiguous" (default: the evicted prompt tokens form Br contiguous groups, averaged) or
            "similarity" (the first M prompt tokens laid out, one per residual slot, and eqs. 6-7 applied token by
            token to the prompt beyond them, as in decoding).
        eviction_order: which token a full cache evicts at a decoding step: "authors" (the authors' code: the lowest
            score of the context as it stands, before the token leaving the recent window joins it) or "paper"
            (Algorithm 1: the leaving token joins the context first and may be the one evicted).
        prefill_chunk_size: stream the prompt through ``generate`` in chunks of this many tokens, compressing
            as it goes (``kvpress_cpp.presses.streaming``; ``budget`` must then be a token count, an int: a
            fraction of a prompt not seen whole is refused); None: one forward, compressed at its end.
    """

    budget_field = "budget"  # compression_ratio = 1 - budget (kvpress: fraction removed)
    decoding_keeps_every_slot = True  # a step merges (or evicts) down to the budget

    budget: int | float = 0.25
    recent_fraction: float = 0.4
    residual_slots: int = 1
    decay: float = 0.98
    alpha: float = 0.6
    prefill_merge: str = "contiguous"
    eviction_order: str = "authors"
    prefill_chunk_size: int | None = None

    def prompt_score_weights(self, module):
        return self.decay, 1.0  # eq. 5: λ-decayed sums over the group's query heads

    def check_parameters(self) -> None:
        require_real("ZSMergePress", "recent_fraction", self.recent_fraction, "(0, 1)")
        require_int("ZSMergePress", "residual_slots", self.residual_slots, 0)
        require_real("ZSMergePress", "decay (λ)", self.decay, "(0, 1]")  # λ = 0 would weigh no query at all
        require_real("ZSMergePress", "alpha", self.alpha, "[0, 1]")
        if self.prefill_merge not in ("contiguous", "similarity"):
            raise ValueError(f"ZSMergePress: prefill_merge must be 'contiguous' or 'similarity', got {self.prefill_merge!r}")
        if self.eviction_order not in ("authors", "paper"):
            raise ValueError(f"ZSMergePress: eviction_order must be 'authors' or 'paper', got {self.eviction_order!r}")
        self.check_prefill_chunk_size(self.budget)
        if isinstance(self.budget, int):  # a count splits alike for every prompt: refused here, not at the first one
            self.split(self.budget)

    def split(self, prompt_length: int) -> tuple[int, int, int]:
        """(Bp, Bc, Br) for a prompt of this length."""
        budget = self.budget_slots(prompt_length)
        recent = max(1, round(self.recent_fraction * budget))
        context = budget - recent - self.residual_slots
        if context < 1:
            raise ValueError(
                f"ZSMergePress: a budget of {budget} slots leaves no context slot after {recent} recent and "
                f"{self.residual_slots} residual slots; {self.larger_budget_advice(prompt_length)} or lower "
                f"recent_fraction / residual_slots"
            )
        return recent, context, self.residual_slots

    def compress_prefill(self, module, hidden_states, keys, values, attentions, log_weights, kwargs):
        scores = score_prompt(module, hidden_states, keys, log_weights, kwargs, *self.prompt_score_weights(module))
        recent, context, residual = self.split(keys.shape[-2])
        state = LayerState(log_weights, {"scores": scores}, {"recent": recent, "context": context,
                                                             "residual": residual, "tokens_seen": keys.shape[-2]})
        return self._fit_budget(keys, values, state, lay_out_all=self.prefill_merge == "contiguous")

    def compress_decoding(self, module, hidden_states, keys, values, attentions, state, kwargs):
        new_tokens = hidden_states.shape[1]
        state.per_slot["scores"] = ops.update_scores(state.per_slot["scores"], attentions, self.decay, 1.0)
        if "counts" in state.per_slot:
            state.per_slot["counts"] = torch.nn.functional.pad(state.per_slot["counts"], (0, new_tokens), value=1.0)
        state.counters["tokens_seen"] += new_tokens
        return self._fit_budget(keys, values, state, lay_out_all=False)

    def _fit_budget(self, keys, values, state: LayerState, lay_out_all: bool):
        """Append while there is room; the first time the cache exceeds M, lay out the recent / context / residual
        regions, over every token held (`lay_out_all`: a contiguous prefill, methods.md) or over the first M, one
        token per residual slot (Algorithm 1 fills the residual slots before it merges any token: a similarity
        prefill, or a cache a decoding pass or a streamed chunk first takes past M); merge every later token
        (eqs. 6-7)."""
        recent, context, residual = (state.counters[name] for name in ("recent", "context", "residual"))
        budget = recent + context + residual
        scores = state.per_slot["scores"]
        if keys.shape[-2] <= budget:
            state.log_weights = torch.zeros_like(scores)
            return keys, values, state
        if "counts" not in state.per_slot:
            laid_out = keys.shape[-2] if lay_out_all else budget
            head_k, head_v, head_s, counts = ops.zsmerge_prefill(keys[..., :laid_out, :], values[..., :laid_out, :],
                                                                 scores[..., :laid_out], recent, context, residual)
            keys = torch.cat([head_k, keys[..., laid_out:, :]], dim=-2)
            values = torch.cat([head_v, values[..., laid_out:, :]], dim=-2)
            scores = torch.cat([head_s, scores[..., laid_out:]], dim=-1)
            counts = torch.nn.functional.pad(counts, (0, scores.shape[-1] - budget), value=1.0)
            state.counters["ring_position"] = 0
        else:
            counts = state.per_slot["counts"]
        new_tokens = keys.shape[-2] - budget
        if new_tokens:
            # In place where the rows already lie in order: a paged cache's view is then updated in its blocks, and
            # the write-back of slots [0, M) finds them there (no copy in or out).
            keys, values = ops.contiguous_rows(keys), ops.contiguous_rows(values)
            scores, counts = ops.contiguous_rows(scores), ops.contiguous_rows(counts)
            ops.zsmerge_decode_step(keys, values, scores, counts, state.counters["ring_position"], recent, context,
                                    residual, paper_order=self.eviction_order == "paper")
            state.counters["ring_position"] = (state.counters["ring_position"] + new_tokens) % recent
        state.per_slot = {"scores": scores[..., :budget], "counts": counts[..., :budget]}
        state.log_weights = ops.merge_count_bias(state.per_slot["counts"], self.alpha)
        return keys.narrow(-2, 0, budget), values.narrow(-2, 0, budget), state
