"""kvpress's ``DMSPress`` on our cache, on padded batches and on tensor-parallel ranks.

Importing this module (``kvpress_cpp.presses`` and ``kvpress_cpp.paged_cache`` do) wraps ``DMSPress.forward_hook``;
kvpress itself is unchanged. Two things change:

* **Padded prefills are scored row by row.** ``DMSPress`` scores a prefill's tokens with its ``ScorerPress`` in one
  batched call. A scorer that relates a token to the others (SnapKV's window attention over the keys,
  ExpectedAttention's softmax over the keys, its query statistics and sink tokens) then sees the padding of the
  shorter rows, so a row's scores, and the slots evicted, depend on the batch it was padded into; on a
  :class:`~kvpress_cpp.paged_cache.PagedKVCache`, whose view shows dropped padding as zero keys, they also differ
  from the rectangular cache's. On a padded prefill the scorer now runs on each row's real tokens (hidden states,
  keys, values and the attention kwargs cut as for our own presses' rows) and the padding columns score +inf, so
  ``DMSPress`` never marks them (they hold no slot on a paged cache, and the mask hides them on a rectangular one).
  A scorer that looks at each token alone (KVzap, Knorm) gives the same scores either way.
* **``compression_ratio`` counts the press's own marks.** ``DMSPress`` measures it as the marks left in
  ``module.masked_key_indices`` over the layer's (B, H, T) keys. A paged cache evicts those marks for real and clears
  them, so that read only the last pass's marks (0.007 where the rectangular cache reports 0.487); on a
  tensor-parallel rank it covered the rank's heads only. Each layer's ratio is now the marks ``DMSPress`` added since
  the prefill over B·H·T of the model (H all its kv heads, T the tokens cached), the counts summed over the ranks
  (one all-gather per pass, at the last layer): the same figure on every cache and every rank.

Unpadded passes score as before.
"""

from __future__ import annotations

import torch
from kvpress import DMSPress
from kvpress.presses.base_press import is_prefilling

from kvpress_cpp.attention import padding_log_weights
from kvpress_cpp.distributed import gather_kv_heads, kv_head_shard
from kvpress_cpp.presses.base import _row_kwargs

__all__ = ["patch_dms_press"]

_PATCHED_ATTR = "_kvcomp_adapted"
_MARKS_ATTR = "_kvcomp_marks"  # on the press: layer → [marks added since the prefill, tokens cached]


def _prefill_padding(kwargs: dict) -> list[int] | None:
    """The left padding of each row of a prefill pass, or None for a pass with no padding (or not a prefill)."""
    hidden_states, attention_mask = kwargs["hidden_states"], kwargs.get("attention_mask")
    batch, new_tokens = hidden_states.shape[:2]
    if attention_mask is None or not is_prefilling(kwargs["cache_position"], new_tokens):
        return None
    is_real = torch.isfinite(padding_log_weights(attention_mask, batch, 1, new_tokens, hidden_states.device)[:, 0])
    padding = (~is_real).sum(-1)
    if not bool(padding.any()):
        return None
    if not bool(is_real.any(-1).all()):
        raise ValueError(f"DMSPress: batch rows {(~is_real.any(-1)).nonzero().flatten().tolist()} hold padding only "
                         f"(an empty prompt)")
    if not bool((is_real.int().argmax(-1) == padding).all()):
        raise ValueError("DMSPress: only left padding is supported (tokenizer padding_side='left'), as `generate` "
                         "expects of decoder-only models")
    return padding.tolist()


class _RowByRowScorer:
    """Stands in for DMSPress's scorer during a padded prefill: ``score`` runs the scorer on each row's real tokens
    and pads the row's scores with +inf."""

    def __init__(self, scorer, padding: list[int]):
        self.scorer, self.padding = scorer, padding

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        rows = []
        for row, pad in enumerate(self.padding):
            row_attentions = attentions[row:row + 1, :, pad:, pad:] if attentions is not None else None
            scores = self.scorer.score(module, hidden_states[row:row + 1, pad:], keys[row:row + 1, :, pad:],
                                       values[row:row + 1, :, pad:], row_attentions, _row_kwargs(kwargs, row, pad))
            rows.append(torch.nn.functional.pad(scores, (pad, 0), value=float("inf")))
        return torch.cat(rows)


def _mark_count(module) -> int:
    marked = getattr(module, "masked_key_indices", None)
    return 0 if marked is None else len(marked[0])


def _count_marks(press: DMSPress, module, kwargs: dict, marked_before: int) -> None:
    """Record the marks this pass added on `module`'s layer and set ``press.compression_ratios`` from the counts."""
    hidden_states = kwargs["hidden_states"]
    new_tokens, layer_idx = hidden_states.shape[1], module.layer_idx
    prefilling = is_prefilling(kwargs["cache_position"], new_tokens)
    if not prefilling and not press.decoding:
        return  # DMSPress did nothing on this pass
    marks = press.__dict__.setdefault(_MARKS_ATTR, {})
    added = _mark_count(module) - marked_before
    tokens = int(kwargs["cache_position"][-1]) + 1
    marks[layer_idx] = [added if prefilling else marks.get(layer_idx, [0])[0] + added, tokens]
    config = module.config
    slots = hidden_states.shape[0] * config.num_key_value_heads
    if kv_head_shard(module) is None:
        press.compression_ratios[layer_idx] = marks[layer_idx][0] / (slots * tokens)
    elif layer_idx == config.num_hidden_layers - 1:  # every rank's marks, for every layer, once per pass
        layers = sorted(marks)
        counts = torch.tensor([[marks[layer][0]] for layer in layers], device=hidden_states.device)
        totals = gather_kv_heads(counts, module, dim=-1).sum(-1).tolist()
        press.compression_ratios.update({layer: total / (slots * marks[layer][1])
                                         for layer, total in zip(layers, totals)})


def patch_dms_press() -> None:
    """Wrap ``DMSPress.forward_hook`` (see the module). Idempotent."""
    forward_hook = DMSPress.forward_hook
    if getattr(forward_hook, _PATCHED_ATTR, False):
        return

    def adapted_forward_hook(self, module, input, kwargs, output):
        marked_before = _mark_count(module)
        padding = _prefill_padding(kwargs)
        scorer = self.press
        if padding is not None:
            self.press = _RowByRowScorer(scorer, padding)
        try:
            output = forward_hook(self, module, input, kwargs, output)
        finally:
            self.press = scorer
        _count_marks(self, module, kwargs, marked_before)
        return output

    setattr(adapted_forward_hook, _PATCHED_ATTR, True)
    DMSPress.forward_hook = adapted_forward_hook


patch_dms_press()
