"""compact_to_longest_head against a per-head reference written from its definition: each (batch, kv head)'s kept
slots first, in order, the rest padding (zero keys and values, log-weight -inf), width the longest head's count, or
a caller's bound above it (capped at the slots there are)."""

from __future__ import annotations

import pytest
import torch

from kvpress_cpp.cache import compact_to_longest_head

INF = float("inf")


def _reference(keys, values, keep, log_weights, width):
    B, H, T, d = keys.shape
    out_k, out_v = torch.zeros(B, H, width, d), torch.zeros(B, H, width, d)
    out_b = torch.full((B, H, width), -INF)
    for b in range(B):
        for h in range(H):
            kept = [t for t in range(T) if keep[b, h, t]]
            for i, t in enumerate(kept):
                out_k[b, h, i], out_v[b, h, i], out_b[b, h, i] = keys[b, h, t], values[b, h, t], log_weights[b, h, t]
    return out_k, out_v, out_b


@pytest.mark.parametrize("longest", [None, "exact", "above", "beyond_slots"])
def test_compaction_matches_the_per_head_reference(longest):
    g = torch.Generator().manual_seed(3)
    B, H, T, d = 2, 3, 9, 4
    keys, values = torch.randn(B, H, T, d, generator=g), torch.randn(B, H, T, d, generator=g)
    keep = torch.rand(B, H, T, generator=g) < 0.5
    keep[0, 0] = True  # one head keeps every slot
    keep[1, 2] = False  # one keeps none
    log_weights = torch.randn(B, H, T, generator=g)
    scores = torch.randn(B, H, T, generator=g)
    most = int(keep.sum(-1).max())
    bound = {None: None, "exact": most, "above": most + 2, "beyond_slots": T + 5}[longest]
    width = most if bound is None else min(bound, T)
    new_keys, new_values, state = compact_to_longest_head(keys, values, keep, log_weights, {"scores": scores},
                                                          longest=bound)
    ref_k, ref_v, ref_b = _reference(keys, values, keep, log_weights, width)
    assert new_keys.shape == (B, H, width, d)
    torch.testing.assert_close(new_keys, ref_k, rtol=0, atol=0)
    torch.testing.assert_close(new_values, ref_v, rtol=0, atol=0)
    torch.testing.assert_close(state.log_weights, ref_b, rtol=0, atol=0)
    counts = keep.sum(-1)
    for b in range(B):
        for h in range(H):
            n = int(counts[b, h])
            assert torch.equal(state.per_slot["scores"][b, h, :n], scores[b, h][keep[b, h]])
