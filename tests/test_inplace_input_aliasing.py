"""The arguments an in-place op only reads (kvzap_paged_step's block tables, lengths and new scores; keepkv_decode_step's
queries, probabilities and per-slot state) must not share memory with the arguments it updates: the kernel would
read its own writes. kvzap_paged_step read a length back after writing a new token's position over it, left the
validated range and wrote wild memory (a segfault); keepkv_decode_step read queries over keys it had already packed
(a silently different result). Each is now an error naming the op and both arguments, eagerly and on meta tensors
(the fake, as under torch.compile) alike."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvpress_cpp  # noqa: F401  (registers torch.ops.kvcomp)

pytestmark = pytest.mark.independent_of_transformers

ROOT = Path(__file__).resolve().parents[1]


def _paged_step_with_lengths_in_the_position_pool():
    """Row 0's two new tokens land in pool slots 6 and 7, where lengths[0, 0] and lengths[0, 1] live: writing row 0's
    positions turns row 1's length into 10^15 + 1."""
    blocks, block_size, new_tokens = 4, 4, 2
    pool = torch.zeros(blocks * block_size, dtype=torch.int64)
    position_blocks = pool.view(blocks, block_size)
    lengths = pool[6:8].view(1, 2)
    lengths[0, 0], lengths[0, 1] = 8, 4
    tables = torch.tensor([[[0, 1], [2, 3]]])
    return (torch.zeros(blocks, block_size), torch.zeros(blocks, block_size), position_blocks, tables, lengths,
            torch.zeros(1, 2, new_tokens), 0.0, 2, 10**15)


def test_kvzap_paged_step_refuses_lengths_inside_the_pools_it_writes():
    # In a subprocess: before the check this call segfaulted.
    code = ("from tests.test_inplace_input_aliasing import _paged_step_with_lengths_in_the_position_pool as case\n"
            "import torch\n"
            "try:\n"
            "    torch.ops.kvcomp.kvzap_paged_step(*case())\n"
            "except RuntimeError as error:\n"
            "    print(str(error).splitlines()[0])\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-800:]}"
    assert done.stdout.startswith("kvcomp::kvzap_paged_step: expected lengths and position_blocks to be separate "
                                  "memory (position_blocks is updated in place)"), done.stdout


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta: the fake kernel, as under torch.compile
@pytest.mark.parametrize("read", ["block_tables", "lengths", "new_scores"])
def test_kvzap_paged_step_refuses_each_read_argument_over_a_pool(read, device):
    log_weights, scores = torch.zeros(4, 4, device=device), torch.zeros(4, 4, device=device)
    positions = torch.zeros(4, 4, dtype=torch.int64, device=device)
    args = {"block_tables": torch.tensor([[[0], [1]]], device=device),
            "lengths": torch.tensor([[2, 2]], device=device), "new_scores": torch.zeros(1, 2, 1, device=device)}
    pool = scores if read == "new_scores" else positions
    view = pool.view(-1)[:2]
    view.copy_(args[read].view(-1))
    args[read] = view.view(args[read].shape)
    written = "score_blocks" if read == "new_scores" else "position_blocks"
    with pytest.raises(RuntimeError, match=f"kvcomp::kvzap_paged_step: expected {read} and {written} to be separate "
                                           "memory"):
        torch.ops.kvcomp.kvzap_paged_step(log_weights, scores, positions, args["block_tables"], args["lengths"],
                                          args["new_scores"], 0.0, 1, 3)


def _keepkv_step_args(queries_in_keys: bool):
    batch, kv_heads, query_heads, new_tokens, slots, head_dim = 1, 2, 2, 2, 14, 8
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(batch, kv_heads, slots, head_dim, generator=generator)
    values = torch.randn(batch, kv_heads, slots, head_dim, generator=generator)
    queries = torch.randn(batch, query_heads, new_tokens, head_dim, generator=generator)
    if queries_in_keys:  # queries stored over row 0's first slots, which the step packs before row 1 reads them
        keys.view(-1)[:queries.numel()] = queries.view(-1)
        queries = keys.view(-1)[:queries.numel()].view(queries.shape)
    logits = torch.einsum("bhqd,bhtd->bhqt", queries, keys) * head_dim**-0.5
    hidden = torch.arange(slots) > slots - new_tokens + torch.arange(new_tokens).unsqueeze(-1)
    probabilities = logits.masked_fill(hidden, -math.inf).softmax(-1)
    state = (batch, kv_heads, slots - new_tokens)
    return (keys, values, queries, probabilities, torch.zeros(batch, kv_heads, slots), torch.randn(state, generator=generator),
            torch.ones(state), torch.ones(state), head_dim**-0.5, 0.9, 8, 1, 2, 0.5, False)


def test_keepkv_decode_step_refuses_queries_stored_over_the_keys_it_packs():
    args = _keepkv_step_args(queries_in_keys=True)
    apart = (args[0].clone(), args[1].clone(), args[2].clone(), *args[3:])
    torch.ops.kvcomp.keepkv_decode_step(*apart)  # the same values in separate memory: valid
    with pytest.raises(RuntimeError, match="kvcomp::keepkv_decode_step: expected queries and keys to be separate "
                                           "memory"):
        torch.ops.kvcomp.keepkv_decode_step(*args)


def _on_meta_keeping_views(args):
    """args on meta, a view of the first tensor's storage staying one (to("meta") would copy it apart)."""
    first = args[0].to("meta")
    moved = []
    for a in args:
        if isinstance(a, torch.Tensor) and a is not args[0] and a.untyped_storage().data_ptr() == \
                args[0].untyped_storage().data_ptr():
            moved.append(first.as_strided(a.shape, a.stride(), a.storage_offset()))
        elif isinstance(a, torch.Tensor):
            moved.append(first if a is args[0] else a.to("meta"))
        else:
            moved.append(a)
    return tuple(moved)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("index, name", [(2, "queries"), (5, "log_ema")])
def test_keepkv_decode_step_refuses_a_read_argument_over_keys(index, name, device):
    args = list(_keepkv_step_args(queries_in_keys=False))
    keys = args[0]
    args[index] = keys.view(-1)[:args[index].numel()].view(args[index].shape)
    args = tuple(args) if device == "cpu" else _on_meta_keeping_views(args)
    with pytest.raises(RuntimeError, match=f"kvcomp::keepkv_decode_step: expected {name} and keys to be separate "
                                           "memory"):
        torch.ops.kvcomp.keepkv_decode_step(*args)
