"""WeightedKV ("WeightedKV: Attention Scores Weighted Key-Value Cache Merging for Large Language Models").

Algorithm 1 per kv head: running attention sums a and counts n; when the cache exceeds m slots, the slot j of lowest
average attention ā = a/n in the middle region (neither the sinks nor the recent window) loses its key, and its
value is folded into its right neighbour's, weighted by the averaged scores:
``V[j+1] ← (ā_j V_j + ā_{j+1} V_{j+1}) / (ā_j + ā_{j+1})``. No attention bias. GQA: a is the mean over the group's
query heads. The prompt is reduced greedily, one token at a time, from a_i = Σ_{j≥i} A[j, i] and n_i = T - i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress_cpp import ops
from kvpress_cpp.cache import LayerState
from kvpress_cpp.distributed import query_group_size
from kvpress_cpp.presses.base import KVCompDecodingPress, require_bool, require_int, score_prompt
from kvpress_cpp.presses.streaming import StreamingPrefill

__all__ = ["WeightedKVPress"]


@dataclass
class WeightedKVPress(StreamingPrefill, KVCompDecodingPress):
    """WeightedKV in prefill and at every decoding step.

    Attributes:
        cache_size: m, the slots kept per layer and kv head: a token count (int ≥ 1) or a fraction of the prompt
            length (float in (0, 1]).
        sinks: leading tokens never evicted (paper: 4).
        recent: the recent window never evicted (paper default m/2 - 4 when None).
        evict_only: the paper's ablation: evict the key and the value, merge nothing.
        prefill_chunk_size: stream the prompt through ``generate`` in chunks of this many tokens, compressing
            as it goes (``kvpress_cpp.presses.streaming``; ``cache_size`` must then be a token count, an int: a
            fraction of a prompt not seen whole is refused); None: one forward, compressed at its end.
    """

    budget_field = "cache_size"  # compression_ratio = 1 - cache_size (kvpress: fraction removed)
    decoding_keeps_every_slot = True  # a step merges (or evicts) down to the budget

    cache_size: int | float = 0.25
    sinks: int = 4
    recent: int | None = None
    evict_only: bool = False
    prefill_chunk_size: int | None = None

    def prompt_score_weights(self, module):
        return 1.0, 1.0 / query_group_size(module)  # plain sums of the group-mean attention

    def check_parameters(self) -> None:
        require_int("WeightedKVPress", "sinks", self.sinks, 0)
        if self.recent is not None:
            require_int("WeightedKVPress", "recent", self.recent, 1)
        require_bool("WeightedKVPress", "evict_only", self.evict_only)
        self.check_prefill_chunk_size(self.cache_size)
        if isinstance(self.cache_size, int):  # a count splits alike for every prompt: refused here, not at the first
            self.regions(self.cache_size)

    def regions(self, prompt_length: int) -> tuple[int, int, int]:
        """(m, sinks, recent) for a prompt of this length."""
        size = self.budget_slots(prompt_length)
        recent = self.recent if self.recent is not None else max(1, size // 2 - 4)
        if self.sinks + recent >= size:
            raise ValueError(f"WeightedKVPress: a cache of {size} slots has no middle region after {self.sinks} "
                             f"sinks and a recent window of {recent}; {self.larger_budget_advice(prompt_length)} "
                             f"or lower sinks / recent")
        return size, self.sinks, recent

    def compress_prefill(self, module, hidden_states, keys, values, attentions, log_weights, kwargs):
        group_size = query_group_size(module)
        sums = score_prompt(module, hidden_states, keys, log_weights, kwargs, *self.prompt_score_weights(module))
        length = keys.shape[-2]
        counts = torch.arange(length, 0, -1, dtype=torch.float32, device=keys.device).expand_as(sums)
        size, sinks, recent = self.regions(length)
        state = LayerState(log_weights, {"sums": sums, "counts": counts},
                           {"size": size, "sinks": sinks, "recent": recent, "group_size": group_size})
        keys, values, state = self._fit_size(keys, values, state)
        # The survivors get their own storage: the prompt's T slots are freed now, not at the first decoding step.
        return keys.clone(), values.clone(), state

    def compress_decoding(self, module, hidden_states, keys, values, attentions, state, kwargs):
        new_tokens = hidden_states.shape[1]
        state.per_slot["sums"] = ops.update_scores(state.per_slot["sums"], attentions, 1.0,
                                                   1.0 / state.counters["group_size"])
        arrivals = torch.arange(new_tokens, 0, -1, dtype=torch.float32, device=keys.device)
        counts = state.per_slot["counts"] + new_tokens
        state.per_slot["counts"] = torch.cat([counts, arrivals.expand(*counts.shape[:2], new_tokens)], dim=-1)
        return self._fit_size(keys, values, state)

    def _fit_size(self, keys, values, state: LayerState):
        size, sinks, recent = (state.counters[name] for name in ("size", "sinks", "recent"))
        evictions = max(0, keys.shape[-2] - size)
        if evictions:
            # In place: on a PagedKVCache, keys and values are its view over the block pools, updated where they lie.
            keys, values = ops.contiguous_rows(keys), ops.contiguous_rows(values)
            sums, counts = ops.contiguous_rows(state.per_slot["sums"]), ops.contiguous_rows(state.per_slot["counts"])
            keys, values, sums, counts = ops.weightedkv_evict(keys, values, sums, counts, sinks, recent, evictions,
                                                              not self.evict_only)
            state.per_slot = {"sums": sums, "counts": counts}
        state.log_weights = torch.zeros_like(state.per_slot["sums"])
        return keys, values, state
