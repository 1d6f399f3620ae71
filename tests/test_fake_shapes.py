"""The fake kernels (kvpress_cpp/_fake.py, from the contracts' outputs) give every op's eager output shapes and dtypes,
the in-place ops included (the fuzz suite's meta check skips an op whose fuzz runs it through a wrapper)."""

from __future__ import annotations

import random

import pytest
import torch

from kvpress_cpp._contract import CONTRACTS
from tests.test_fuzz_ops import CACHE, FUZZ, _as_tuple, _contract_rejects

pytestmark = pytest.mark.independent_of_transformers

CASES = 24


def _outputs(name: str, args: tuple):
    return _as_tuple(getattr(torch.ops.kvcomp, name)(*args))


@pytest.mark.parametrize("name", sorted(n for n in FUZZ if FUZZ[n].meta_shapes and CONTRACTS[n].outputs is not None))
def test_the_fake_gives_the_eager_shapes_and_dtypes(name):
    fuzz, compared = FUZZ[name], 0
    for k in range(CASES):
        r = random.Random(f"fake-shapes:{name}:{k}")
        args = fuzz.build(r, fuzz.sizes(r, {}), r.choice(CACHE))
        if _contract_rejects(CONTRACTS[name], args) is not None:
            continue
        eager = _outputs(name, tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
        meta = _outputs(name, tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
        assert len(meta) == len(eager)
        for i, (m, e) in enumerate(zip(meta, eager)):
            assert m.device.type == "meta"
            assert (tuple(m.shape), m.dtype) == (tuple(e.shape), e.dtype), \
                f"output {i}: fake {tuple(m.shape)} {m.dtype}, eager {tuple(e.shape)} {e.dtype} (case {k})"
        compared += 1
    assert compared >= CASES // 2


@pytest.mark.parametrize("return_probs, max_len", [(True, 7), (True, 12), (False, None), (False, 7)])
def test_the_paged_attention_fake_gives_the_eager_shapes(return_probs, max_len):
    """probs is (B, Hq, q, max_len or max(lengths)) with return_probs, width 0 without (whatever max_len says)."""
    B, H, G, q, d, N, S, M = 2, 2, 2, 1, 8, 12, 4, 3
    torch.manual_seed(0)
    query = torch.randn(B, H * G, q, d)
    key_blocks, value_blocks = torch.randn(N, S, d), torch.randn(N, S, d)
    log_weight_blocks = torch.zeros(N, S)
    block_tables = torch.randperm(N, generator=torch.Generator().manual_seed(0)).view(B, H, M)
    lengths = torch.tensor([[7, 3], [5, 1]])
    args = (query, key_blocks, value_blocks, log_weight_blocks, block_tables, lengths, 0.3, return_probs, max_len)
    eager = torch.ops.kvcomp.paged_decode_attention(*args)
    meta = torch.ops.kvcomp.paged_decode_attention(*(a.to("meta") if isinstance(a, torch.Tensor) else a
                                                     for a in args))
    expected_width = (max_len or int(lengths.max())) if return_probs else 0
    assert eager[1].shape == (B, H * G, q, expected_width)
    for m, e in zip(meta, eager):
        assert m.device.type == "meta" and (m.shape, m.dtype) == (e.shape, e.dtype)


def _error(call) -> str | None:
    try:
        call()
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("name", sorted(FUZZ))
def test_the_fakes_rank_and_dtype_errors_name_the_argument_as_the_kernels_do(name):
    """A tensor of the wrong rank or dtype: on meta tensors (the fake) as eagerly (the C++ check), the error names the
    op and that argument, and a wrong rank's error the rank it got."""
    from kvpress_cpp._contract import Tensor
    from tests.test_fuzz_ops import _replace, _wrong_dtype

    contract, fuzz, r = CONTRACTS[name], FUZZ[name], random.Random(f"fake-errors:{name}")
    for _ in range(20):
        args = fuzz.build(r, fuzz.sizes(r, {}), torch.float32)
        if _contract_rejects(contract, args) is None:
            break
    op = getattr(torch.ops.kvcomp, name)
    for i, arg in enumerate(contract.args):
        if not isinstance(arg, Tensor) or args[i] is None:
            continue
        for bad in (args[i].unsqueeze(0), args[i].to(_wrong_dtype(args[i]))):
            bad_args = _replace(args, i, bad)
            eager = _error(lambda: op(*(a.clone() if isinstance(a, torch.Tensor) else a for a in bad_args)))
            meta = _error(lambda: op(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in bad_args)))
            for words in (eager, meta):
                assert words is not None and f"kvcomp::{name}: expected {arg.name} of " in words, words
                if bad.dim() != args[i].dim():
                    assert f"got a {bad.dim()}-d tensor" in words, words


@pytest.mark.parametrize("name", sorted(FUZZ))
def test_a_size_one_off_is_refused_by_the_contract_where_the_kernel_refuses_it(name):
    """Each size symbol of a valid call one smaller or larger, every tensor sharing it following (the fuzz suite grows
    one tensor's size alone, which the shared-symbol check refuses whatever the rules say): the contract (the fake's
    check) refuses exactly the calls the C++ kernel refuses, e.g. KeepKV's state one slot short of T - q."""
    fuzz, contract, compared = FUZZ[name], CONTRACTS[name], 0
    op = getattr(torch.ops.kvcomp, name)
    for k in range(3):
        sizes = fuzz.sizes(random.Random(f"fake-off:{name}:{k}"), {})
        for symbol in sorted(sizes):
            for delta in (-1, 1):
                if sizes[symbol] + delta < 0:
                    continue
                pinned = {**sizes, symbol: sizes[symbol] + delta}  # every symbol given: only this one moves
                args = fuzz.build(random.Random(f"fake-off:{name}:{k}:build"), fuzz.sizes(random.Random(0), pinned),
                                  torch.float32)
                eager = _error(lambda: op(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args)))
                refused = _contract_rejects(contract, args)
                assert (eager is None) == (refused is None), \
                    f"{symbol} {delta:+d}: the kernel says {eager!r}, the contract {refused!r}"
                compared += 1
    assert compared > 0
