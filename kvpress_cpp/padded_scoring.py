"""kvpress's ``DMSPress`` on a left-padded batch: its scorer scores each row's own tokens, as if the row ran alone.

``DMSPress`` scores a prefill's tokens with its ``ScorerPress`` in one batched call. A scorer that relates a token to
the others (SnapKV's window attention over the keys, ExpectedAttention's softmax over the keys, its query statistics
and sink tokens) then sees the padding of the shorter rows, so a row's scores, and the slots evicted, depend on the
batch it was padded into; on a :class:`~kvpress_cpp.paged_cache.PagedKVCache`, whose view shows dropped padding as
zero keys, they also differ from the rectangular cache's. Importing this module (``kvpress_cpp.presses`` and
``kvpress_cpp.paged_cache`` do) wraps ``DMSPress.forward_hook``: on a padded prefill its scorer runs row by row on
each row's real tokens (hidden states, keys, values and the attention kwargs cut as for our own presses' rows), and
the padding columns score +inf, so ``DMSPress`` never marks them (they hold no slot on a paged cache, and the mask
hides them on a rectangular one). Unpadded passes and decoding steps run ``DMSPress`` unchanged; a scorer that looks
at each token alone (KVzap, Knorm) gives the same scores either way.
"""

from __future__ import annotations

import torch
from kvpress import DMSPress
from kvpress.presses.base_press import is_prefilling

from kvpress_cpp.attention import padding_log_weights
from kvpress_cpp.presses.base import _row_kwargs

__all__ = ["patch_dms_press"]

_PATCHED_ATTR = "_kvcomp_scores_rows_alone"


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


def patch_dms_press() -> None:
    """Wrap ``DMSPress.forward_hook`` so that a padded prefill is scored row by row (see the module). Idempotent."""
    forward_hook = DMSPress.forward_hook
    if getattr(forward_hook, _PATCHED_ATTR, False):
        return

    def scoring_rows_alone(self, module, input, kwargs, output):
        padding = _prefill_padding(kwargs)
        if padding is None:
            return forward_hook(self, module, input, kwargs, output)
        scorer = self.press
        self.press = _RowByRowScorer(scorer, padding)
        try:
            return forward_hook(self, module, input, kwargs, output)
        finally:
            self.press = scorer

    setattr(scoring_rows_alone, _PATCHED_ATTR, True)
    DMSPress.forward_hook = scoring_rows_alone


patch_dms_press()
