"""The Python wrappers of kvpress_cpp/ops.py: what they do around the op (default scale and its error, the layouts
they pass through, the workspace bound they compute)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from kvpress_cpp import ops
from kvpress_cpp._contract import has_contiguous_rows

pytestmark = pytest.mark.independent_of_transformers


def _head_dim_zero_calls():
    """Each wrapper deriving a default scale, called by keyword with every tensor of head dim 0: name -> kwargs."""
    query, cache, log_weights = torch.zeros(1, 2, 1, 0), torch.zeros(1, 1, 4, 0), torch.zeros(1, 1, 4)
    blocks, block_weights = torch.zeros(1, 4, 0), torch.zeros(1, 4)
    tables, lengths = torch.zeros(1, 1, 1, dtype=torch.int64), torch.full((1, 1), 4, dtype=torch.int64)
    attention = {"query": query, "keys": cache, "log_weights": log_weights}
    return {
        "decode_attention": {**attention, "values": cache},
        "prompt_log_sum_exp": attention,
        "prompt_scores": attention,
        "prompt_attention_with_scores": {**attention, "values": cache},
        "prompt_log_unnormalised_scores": attention,
        "paged_decode_attention": {"query": query, "key_blocks": blocks, "value_blocks": blocks,
                                   "log_weight_blocks": block_weights, "block_tables": tables, "lengths": lengths},
        "gvote_union_mask": {"keys": cache, "queries": query, "budgets": torch.ones(1, 2, dtype=torch.int64)},
    }


@pytest.mark.parametrize("name", sorted(_head_dim_zero_calls()))
def test_the_default_scale_error_names_an_argument_of_the_call_and_its_shape(name):
    """The error names the op, and the tensor it names is one the caller passed (by that name), of the shape it
    reports, whose head dim is the 0 at fault."""
    kwargs = _head_dim_zero_calls()[name]
    wrapper = getattr(ops, name)
    assert set(kwargs) <= set(inspect.signature(wrapper).parameters)
    with pytest.raises(RuntimeError) as raised:
        wrapper(**kwargs)
    message = str(raised.value)
    assert message.startswith(f"kvcomp::{name}: expected a head dim d >= 1 for the default scale"), message
    found = re.search(r"got (\w+) of shape \(([^)]*)\)", message)
    assert found, message
    named, shape = found.group(1), tuple(int(s) for s in found.group(2).split(",") if s.strip())
    assert named in kwargs, f"the error names {named}, not an argument of {name}: {message}"
    assert shape == tuple(kwargs[named].shape) and shape[-1] == 0, message


def test_contiguous_rows_passes_a_view_with_rows_in_order_through_and_copies_any_other():
    """What the in-place decode steps are given: the tensor itself where its (batch, kv head) rows are contiguous and
    in order (a paged cache's view over its pools, updated where it lies), else a contiguous copy of it."""
    pool = torch.randn(80)
    paged = pool.as_strided((2, 2, 3, 4), (40, 20, 4, 1))  # each row 12 contiguous floats, 20 apart
    assert not paged.is_contiguous() and has_contiguous_rows(paged)
    assert ops.contiguous_rows(paged) is paged
    contiguous = torch.randn(2, 3, 5)
    assert ops.contiguous_rows(contiguous) is contiguous
    for other in (torch.randn(2, 3, 5, 4).transpose(1, 2), torch.randn(2, 3, 5, 8)[..., ::2]):
        copy = ops.contiguous_rows(other)
        assert copy.is_contiguous() and copy.data_ptr() != other.data_ptr() and torch.equal(copy, other)


@pytest.mark.parametrize("query_tokens", [1, 64])
def test_a_single_task_takes_one_threads_workspace_whatever_the_thread_count(query_tokens):
    """One (batch, kv head) and one tile of queries are one task of the kernel's parallel loop: one thread runs it,
    so the workspace bound does not grow with the threads available."""
    query, keys = torch.empty(1, 4, query_tokens, 64), torch.empty(1, 1, 1000, 64)
    one = ops.prompt_attention_workspace_bytes(query, keys, threads=1)
    for threads in (2, 8, 64):
        assert ops.prompt_attention_workspace_bytes(query, keys, threads=threads) == one
