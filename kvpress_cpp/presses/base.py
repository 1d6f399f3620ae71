"""The base of kvpress_cpp's presses: kvpress press classes that own a per-slot cache state.

A press hooks every attention layer (kvpress's ``BasePress.__call__``) and, after each forward, may rewrite the
layer's keys, values and :class:`~kvpress_cpp.cache.LayerState`:

* ``compress_prefill`` runs on the first pass over an empty cache layer. Prefill is recognised from the cache itself
  (the layer holds exactly this pass's tokens), not from ``cache_position``, which newer transformers drop.
* ``compress_decoding`` runs on every later pass (one generated token, or several such as kvpress's question pass),
  for presses that compress during decoding.

Presses that compress during decoding derive from :class:`KVCompDecodingPress`, which is also a kvpress
``PrefillDecodingPress``: kvpress's pipeline then keeps the press active while it generates, as ``generate`` does
under ``with press(model):``. Prefill-only presses derive from :class:`KVCompPress`, a plain ``BasePress``, so the
pipeline can reuse one compressed context for several questions.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from kvpress.presses.base_press import BasePress
from kvpress.presses.prefill_decoding_press import PrefillDecodingPress
from kvpress.utils import get_prerope_query_states
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvpress_cpp import ops

from kvpress_cpp.attention import padding_log_weights, patch_eager_attention
from kvpress_cpp.cache import LayerState, attach, get_state, set_state

__all__ = ["KVCompPress", "KVCompDecodingPress", "query_states", "fold_prompt_attention"]


def query_states(module: nn.Module, hidden_states: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The layer's post-RoPE queries (B, Hq, q, d) for `hidden_states`, as its forward computed them (with q_norm
    where the model has one)."""
    queries = get_prerope_query_states(module, hidden_states)
    cos, sin = kwargs["position_embeddings"]
    return apply_rotary_pos_emb(queries, queries, cos, sin)[0]


def fold_prompt_attention(module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor,
                          values: torch.Tensor, log_weights: torch.Tensor, kwargs: dict, decay: float,
                          input_scale: float, first_query: int = 0, chunk_size: int = 512) -> torch.Tensor:
    """Scores (B, H, T) of a prompt: the attention of its queries [first_query, T) folded by ``update_scores``.

    The prompt's attention is never materialised whole: each chunk of queries gets its probabilities over the keys
    it can see (``decode_attention`` is causal over the newest slots), and the scores grow with them, so the result
    equals folding the queries one at a time (e.g. ZSMerge's Σ_j λ^(T-1-j) A[j, i]).
    """
    queries = query_states(module, hidden_states, kwargs)
    total = keys.shape[-2]
    scores = torch.zeros(*keys.shape[:2], first_query, dtype=torch.float32, device=keys.device)
    for start in range(first_query, total, chunk_size):
        end = min(start + chunk_size, total)
        _, probs = ops.decode_attention(queries[:, :, start:end], keys[:, :, :end], values[:, :, :end],
                                        log_weights[..., :end], module.scaling)
        scores = ops.update_scores(scores, probs, decay, input_scale)
    return scores


@dataclass
class KVCompPress(BasePress):
    """Base of the presses whose compression keeps a per-slot state (log-weights, scores) on the cache."""

    def compress_prefill(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor,
                         values: torch.Tensor, attentions: torch.Tensor | None, log_weights: torch.Tensor,
                         kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, LayerState] | None:
        """Compress the prompt of one layer: keys, values (B, H, T, d) and their log-weights (B, H, T) float32
        (0, or -inf on padding) → new keys, values and state, or None to keep the layer as it is (no state)."""
        raise NotImplementedError

    def compress_decoding(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor,
                          values: torch.Tensor, attentions: torch.Tensor | None, state: LayerState | None,
                          kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, LayerState] | None:
        """Fold the q new tokens of a later pass into one layer (attentions: their probabilities (B, Hq, q, T)
        when the layer has state). Prefill-only presses leave the cache alone."""
        return None

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        """kvpress's entry point for composed presses: the prefill compression, keys and values only."""
        result = self._compress_prompt(module, hidden_states, keys, values, attentions, kwargs)
        return (keys, values) if result is None else result[:2]

    def _compress_prompt(self, module, hidden_states, keys, values, attentions, kwargs):
        """compress_prefill with the prompt's log-weights: 0, or -inf where transformers' mask marks padding."""
        log_weights = padding_log_weights(kwargs.get("attention_mask"), *keys.shape[:3], keys.device)
        return self.compress_prefill(module, hidden_states, keys, values, attentions, log_weights, kwargs)

    def forward_hook(self, module: nn.Module, input: list[torch.Tensor], kwargs: dict, output: list):
        cache = kwargs.get("past_key_values", kwargs.get("past_key_value"))
        if cache is None:
            return output
        layer = cache.layers[module.layer_idx]
        hidden_states = kwargs["hidden_states"]
        is_prefill = layer.get_seq_length() == hidden_states.shape[1]
        if not is_prefill and not isinstance(self, KVCompDecodingPress):
            return output  # read no keys: on a PagedKVCache that would gather the whole layer at every step
        keys, values = layer.keys, layer.values
        attentions = output[1] if len(output) > 1 else None
        if is_prefill:
            result = self._compress_prompt(module, hidden_states, keys, values, attentions, kwargs)
        else:
            result = self.compress_decoding(module, hidden_states, keys, values, attentions, get_state(layer),
                                            kwargs)
        if result is not None:
            layer.keys, layer.values, state = result
            set_state(layer, state)
            attach(module, layer)
        return output

    @contextmanager
    def __call__(self, model):
        patch_eager_attention(model)
        with super().__call__(model):
            yield


@dataclass
class KVCompDecodingPress(KVCompPress, PrefillDecodingPress):
    """Base of the presses that also compress at every decoding step (and in kvpress's pipeline's decoding)."""

    # PrefillDecodingPress delegates to two inner presses; ours does both phases itself.
    prefilling_press: None = field(default=None, init=False, repr=False)
    decoding_press: None = field(default=None, init=False, repr=False)
