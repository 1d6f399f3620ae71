"""Tensor layouts the ops meet in caches, built for tests."""

import torch


def in_strided_rows(t: torch.Tensor, gap: int = 5, fill: float = 7.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` (B, H, ...) copied into a larger flat buffer filled with `fill`, each (batch, kv head) row contiguous with
    `gap` elements after it and 3 before the first (as a PagedKVCache's view lies over its block pools).
    Returns (buffer, view)."""
    batch, heads = t.shape[:2]
    row = t[0, 0].numel() if t.numel() else 0
    buffer = torch.full((batch * heads * (row + gap) + 3,), fill, dtype=t.dtype, device=t.device)
    view = buffer.as_strided(t.shape, (heads * (row + gap), row + gap, *t.stride()[2:]), 3)
    view.copy_(t)
    return buffer, view


def outside(buffer: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """The elements of `buffer` that `view` does not cover."""
    mask = torch.ones_like(buffer, dtype=torch.bool)
    mask.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(False)
    return buffer[mask]
