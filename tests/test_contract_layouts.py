"""The contract's layout predicates (kvpress_cpp/_contract.py) against their definitions, enumerated element by
element: has_contiguous_rows (checks.h check_contiguous_rows) and _overlap (checks.h may_overlap), which the fake
kernels and the fuzz suite's oracle use in place of the C++ checks."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvpress_cpp._contract import CONTRACTS, _overlap, has_contiguous_rows


def _offsets(t: torch.Tensor) -> torch.Tensor:
    """The storage offset of every element of `t`, in its C order."""
    index = torch.arange(t.untyped_storage().nbytes() // t.element_size())
    return index.as_strided(t.shape, t.stride(), t.storage_offset())


def _rows_contiguous_in_order(t: torch.Tensor) -> bool:
    """Definition: every (b, h) row's elements sit at consecutive offsets in C order, and each row starts at or after
    the end of the row before it (rows in (b, h) order, apart)."""
    rows = _offsets(t).reshape(t.shape[0] * t.shape[1], -1)
    length = rows.shape[1]
    if length == 0:
        return True
    if not all(torch.equal(row, row[0] + torch.arange(length)) for row in rows):
        return False
    return all(int(rows[i + 1, 0]) >= int(rows[i, 0]) + length for i in range(rows.shape[0] - 1))


def test_has_contiguous_rows_is_its_definition_over_small_layouts():
    buffer = torch.zeros(512)
    checked = 0
    for batch, heads, slots, dim in itertools.product((1, 2, 3), (1, 2, 3), (1, 2), (1, 3)):
        row = slots * dim
        for s3, s2 in ((1, dim), (1, dim + 1), (2, 2 * dim)):
            inner = (slots - 1) * s2 + (dim - 1) * s3 + 1  # the span of one row
            for s1 in sorted({0, 1, row - 1, row, row + 1, inner, inner + 2} - {-1}):
                head_span = (heads - 1) * s1 + inner
                for s0 in sorted({0, row, heads * row - 1, heads * row, head_span - 1, head_span, head_span + 1,
                                  heads * s1, heads * s1 + 1} - {-1}):
                    t = buffer.as_strided((batch, heads, slots, dim), (s0, s1, s2, s3))
                    assert has_contiguous_rows(t) == _rows_contiguous_in_order(t), \
                        f"strides {(s0, s1, s2, s3)} for shape {(batch, heads, slots, dim)}"
                    checked += 1
    assert checked > 1000


def test_a_paged_like_view_whose_batch_rows_follow_the_last_head_directly_has_contiguous_rows():
    """Heads spaced wider than a row (a block pool's view), the next batch row starting right after the last head's
    row ends: in order, apart, so the in-place ops update it where it lies."""
    t = torch.zeros(64).as_strided((2, 2, 3, 4), (32, 20, 4, 1))  # rows at 0, 20, 32, 52, each 12 long
    assert _rows_contiguous_in_order(t) and has_contiguous_rows(t)


@pytest.mark.parametrize("n", [1, 4, 12])
def test_overlap_is_a_shared_element_of_two_views_of_one_buffer(n):
    buffer = torch.zeros(3 * n + 2)
    first = buffer[:n]
    for start in range(0, 2 * n + 2):
        second = buffer[start:start + n]
        shared = bool(set(_offsets(first).tolist()) & set(_offsets(second).tolist()))
        assert _overlap(first, second) == shared == (start < n), f"views [0, {n}) and [{start}, {start + n})"
        assert _overlap(second, first) == shared
    assert not _overlap(first, torch.zeros(n))  # another storage


def test_in_place_arguments_sharing_one_element_are_refused_as_the_kernel_refuses_them():
    """keys and values of weightedkv_evict overlapping in their last / first element: the C++ check refuses them, and
    so must the contract (the fake kernel, and the fuzz suite's oracle)."""
    B, H, T, d = 1, 1, 4, 2
    n = B * H * T * d
    for gap in (-1, 0):  # values start on keys' last element, or right after it
        buffer = torch.randn(2 * n + 1)
        keys = buffer[:n].view(B, H, T, d)
        values = buffer[n + gap:2 * n + gap].view(B, H, T, d)
        args = (keys, values, torch.rand(B, H, T), torch.ones(B, H, T), 0, 1, 1, True)
        try:
            torch.ops.kvcomp.weightedkv_evict(*(a.clone() if isinstance(a, torch.Tensor) and a is not keys
                                                and a is not values else a for a in args))
            eager = None
        except RuntimeError as error:
            eager = str(error)
        try:
            CONTRACTS["weightedkv_evict"].check(args)
            contract = None
        except RuntimeError as error:
            contract = str(error)
        assert (eager is None) == (contract is None) == (gap == 0), (gap, eager, contract)
        if eager is not None:
            assert "keys" in contract and "values" in contract and "separate memory" in contract
