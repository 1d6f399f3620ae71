"""GVote ("Lookahead Q-Cache"-style voting: budget-free KV compression by Gaussian sampling of future queries).

Per layer, at prefill only (``../shared/docs/methods.md``):
1. the budget of each query head is the size of the top-p set of the last prompt query's attention (p_nuc);
2. the attention input is summarised by its per-channel mean and variance over the non-sink tokens;
3. S future queries are sampled from that Gaussian (seeded), projected by the layer's q projection (and q_norm),
   and rotated with RoPE averaged over the n_f positions after the prompt;
4. every sample keeps its top-budget keys; a kv head keeps the union over its query heads' samples (plus the sinks
   with ``keep_sinks``).
The result has a different length per head: each layer is compacted to its longest head, the rest padded with -inf.
The compression ratio chosen is readable after a run (per layer and overall): ``compression_ratio`` is the paper's
(the mean over heads of the slots removed), ``memory_compression_ratio`` what the compacted cache really frees (each
layer holds its longest head).

Two options are not in the paper (deviations, off by default): ``recent`` keeps the last tokens of every head, and
``budget_queries`` takes each head's budget from the mean attention of the last w prompt queries instead of the
last one. On a small model the paper's form can drop the question's own tokens in some heads and give a head a
budget of a few tokens (README, "Faithfulness to the papers").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpress_cpp import ops
from kvpress_cpp.cache import compact_to_longest_head
from kvpress_cpp.distributed import gather_kv_heads, prerope_query_states
from kvpress_cpp.presses.base import (KVCompPress, last_query_states, require_bool, require_int, require_real,
                                      rotate_leading_dims)

__all__ = ["GVotePress", "MAX_FUTURE_POSITIONS", "MAX_NUM_SAMPLES"]

#: The most future positions whose rotary tables GVote averages (the paper: 512).
MAX_FUTURE_POSITIONS = 2**20
#: The most sampled future queries per layer: each is a (Hq, T) attention over the prompt.
MAX_NUM_SAMPLES = 2**16


@dataclass
class GVotePress(KVCompPress):
    """GVote at prefill: no budget to set, the sampled future queries choose it.

    Attributes:
        nucleus_p: p_nuc of the budget (paper default 0.95).
        num_samples: S sampled future queries per layer (paper default 8).
        future_positions: n_f positions after the prompt whose rotary tables are averaged (512; at most 2^20).
        sinks: n_s, leading tokens left out of the hidden-state statistics (paper step 2; it gives no value: 4).
        keep_sinks: also keep those n_s tokens in every head (methods.md's form; the paper, and the default, keep the
            union alone: the demo's needle benchmark measured no difference, README "Faithfulness to the papers").
        recent: deviation from the paper: the last tokens of the prompt, always kept (0: none).
        budget_queries: deviation from the paper: w, each head's budget is the top-p size of the mean attention of
            the last w prompt queries (1: the last query alone, the paper).
        seed: seed of the Gaussian samples (each layer draws from seed + layer index, on the CPU: the same samples on
            any device).
        chunk_size: (sample, head) rows whose logits are held at once (peak memory chunk_size × T, not S × T).
    """

    nucleus_p: float = 0.95
    num_samples: int = 8
    future_positions: int = 512
    sinks: int = 4
    keep_sinks: bool = False
    recent: int = 0
    budget_queries: int = 1
    seed: int = 0
    chunk_size: int = 64
    layer_memory_compression_ratios: dict[int, float] = field(default_factory=dict, init=False, repr=False)
    # Per layer compressed in this forward: the fraction of the prompt's columns the layer holds, per (batch row,
    # local kv head), until the last layer gathers them over the tensor-parallel ranks.
    _held_columns: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    #: Its inputs (the last query's attention, the hidden-state statistics) need no one-slot-per-token prompt.
    compresses_compressed_prompt = True

    def check_parameters(self) -> None:
        require_real("GVotePress", "nucleus_p", self.nucleus_p, "(0, 1]")
        for name in ("chunk_size", "budget_queries"):
            require_int("GVotePress", name, getattr(self, name), 1)
        # The samples are materialised, each with its attention over the prompt (2^62 overflowed torch's sizes).
        require_int("GVotePress", "num_samples", self.num_samples, 1, MAX_NUM_SAMPLES)
        # Their rotary tables are materialised (the model's own rotary module, any scaling): 2^20 of d = 128 take 1 GB.
        require_int("GVotePress", "future_positions", self.future_positions, 1, MAX_FUTURE_POSITIONS)
        for name in ("sinks", "recent"):
            require_int("GVotePress", name, getattr(self, name), 0)
        require_int("GVotePress", "seed", self.seed)
        require_bool("GVotePress", "keep_sinks", self.keep_sinks)

    @property
    def memory_compression_ratio(self) -> float:
        """Fraction of the prompt's cache memory freed, averaged over the layers of the last run: each layer holds
        its longest head (the others padded; on a tensor-parallel model, each rank its own heads' longest), so this
        is at most ``compression_ratio``. The same figure on every rank."""
        ratios = self.layer_memory_compression_ratios
        return sum(ratios.values()) / len(ratios) if ratios else 0.0

    def _compress_prompt(self, module, hidden_states, keys, values, attentions, kwargs):
        """The base's, then the share of the prompt's columns the layer holds, from the width it holds: a padded
        batch's rows are compressed one by one and stacked to the longest row's longest head."""
        if self._is_first_hooked_layer(module):  # (and nothing a forward stopped by an error left to gather)
            self.layer_memory_compression_ratios, self._held_columns = {}, {}
        result = super()._compress_prompt(module, hidden_states, keys, values, attentions, kwargs)
        self._held_columns[module.layer_idx] = torch.full(keys.shape[:2], result[0].shape[-2] / keys.shape[-2],
                                                          device=keys.device)
        return result

    def _after_layer(self, module, output):
        """At the last layer hooked, the memory ratios of the layers compressed in this forward, over every rank's
        heads (one all-gather; each rank holds its heads at its own longest)."""
        if self._is_last_hooked_layer(module) and self._held_columns:
            layers = sorted(self._held_columns)
            # On the last layer's device: under a device_map the layers' fractions lie on their own devices.
            device = output[0].device
            held = gather_kv_heads(torch.stack([self._held_columns[layer].to(device) for layer in layers]), module,
                                   dim=-1)
            self.layer_memory_compression_ratios.update(
                (layer, 1.0 - float(fraction.mean())) for layer, fraction in zip(layers, held.double()))
            self._held_columns.clear()
        return super()._after_layer(module, output)

    def compress_prefill(self, module, hidden_states, keys, values, attentions, log_weights, kwargs):
        budgets = self._nucleus_budgets(module, hidden_states, keys, values, log_weights, kwargs)
        future_queries = self._sample_future_queries(module, hidden_states)
        keep = ops.gvote_union_mask(keys, future_queries.to(keys.dtype), budgets,
                                    self.sinks if self.keep_sinks else 0, module.scaling, self.chunk_size)
        if self.recent:
            keep[..., -self.recent:] = True
        return compact_to_longest_head(keys, values, keep, log_weights)

    def _nucleus_budgets(self, module, hidden_states, keys, values, log_weights, kwargs) -> torch.Tensor:
        """Step 1: (B, Hq) top-p sizes of the last prompt query's attention (of the mean attention of the last
        ``budget_queries`` queries)."""
        last = last_query_states(module, hidden_states, kwargs, min(self.budget_queries, hidden_states.shape[1]),
                                 keys.dtype)
        _, probs = ops.decode_attention(last, keys, values, log_weights, module.scaling)
        return ops.nucleus_budget(probs.mean(2), self.nucleus_p)

    def _sample_future_queries(self, module, hidden_states) -> torch.Tensor:
        """Steps 2-3: (B, Hq, S, d) queries of Gaussian samples of the attention input, with averaged RoPE."""
        # A prompt no longer than the sinks leaves its last token for the statistics (its spread is then 0).
        body = hidden_states[:, min(self.sinks, hidden_states.shape[1] - 1):].float()
        mean, std = body.mean(1, keepdim=True), body.var(1, unbiased=False, keepdim=True).sqrt()
        # Drawn on the CPU whatever the layer's device: CPU and CUDA generators give different streams from one seed,
        # and the same samples keep the same cache on any device (a device_map may put this layer on either). One
        # draw for every row: a prompt is compressed as when run alone, wherever it sits in the batch (and each of
        # num_return_sequences' copies alike).
        generator = torch.Generator().manual_seed(self.seed + module.layer_idx)
        noise = torch.randn(1, self.num_samples, hidden_states.shape[-1],
                            generator=generator).to(hidden_states.device)
        samples = (mean + std * noise).to(hidden_states.dtype)
        queries = prerope_query_states(module, samples)  # this rank's query heads, from replicated samples
        prompt_length = hidden_states.shape[1]
        positions = torch.arange(prompt_length, prompt_length + self.future_positions, device=samples.device)
        # The model's rotary module sits on its first device; under a device_map this layer may be elsewhere. (The
        # layer's own: a Gemma 3 sliding layer's turns at another base, kvpress_adapters.give_layers_their_rotary.)
        cos, sin = (table[0].to(queries.device) for table in module.rotary_emb(samples, positions.unsqueeze(0)))
        # (the dims a partial rotary embedding never turns average to themselves)
        return rotate_leading_dims(queries, cos.shape[-1], lambda turned: ops.averaged_rope(turned, cos, sin))
