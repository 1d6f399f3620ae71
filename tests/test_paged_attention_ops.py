"""kvcomp::paged_decode_attention against a float64 reference over the gathered blocks (tests/reference.py), its
agreement with kvcomp::decode_attention on the same slots, opcheck and bad input. Device tests also run on CUDA when a
GPU is present. Block tables are shuffled so that no head's blocks are contiguous or in order, heads hold different
lengths (0 included, and fewer than q), and blocks of the pool are left unused (holding NaN, which must never leak)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvpress_cpp  # noqa: F401
from kvpress_cpp import ops
from tests import reference
from tests.test_attention_ops import CUDA, DEVICES, DTYPES, INF, LONG_ROW_OUT_TOL, OUT_TOL, PROBS_TOL
from tests.threads import at_one_and_two_threads

pytestmark = pytest.mark.independent_of_transformers


def make_paged(lengths, query_heads, num_queries, head_dim, block_size, dtype=torch.float32, device="cpu", seed=0,
               spare_blocks=3, evicted=0.1):
    """query and a paged pool holding `lengths` (B, H) slots per head in shuffled blocks; unused blocks hold NaN."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.long)
    batch, heads = lengths.shape
    blocks_needed = (lengths + block_size - 1) // block_size
    max_blocks = max(1, int(blocks_needed.max()))
    num_blocks = int(blocks_needed.sum()) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.full((batch, heads, max_blocks), -1, dtype=torch.long)
    taken = 0
    for b in range(batch):
        for h in range(heads):
            count = int(blocks_needed[b, h])
            tables[b, h, :count] = order[taken:taken + count]
            taken += count
    key_blocks = torch.full((num_blocks, block_size, head_dim), float("nan"))
    value_blocks = torch.full((num_blocks, block_size, head_dim), float("nan"))
    log_weight_blocks = torch.full((num_blocks, block_size), float("nan"))
    used = order[:taken]
    key_blocks[used] = torch.randn(taken, block_size, head_dim, generator=generator)
    value_blocks[used] = torch.randn(taken, block_size, head_dim, generator=generator)
    counts = 1 + 4 * torch.rand(taken, block_size, generator=generator)
    counts[torch.rand(taken, block_size, generator=generator) < evicted] = 0
    log_weight_blocks[used] = reference.merge_count_bias(counts, 0.6)
    query = torch.randn(batch, query_heads, num_queries, head_dim, generator=generator)
    return (query.to(device, dtype), key_blocks.to(device, dtype), value_blocks.to(device, dtype),
            log_weight_blocks.to(device), tables.to(device), lengths.to(device))


def check_against_reference(inputs, scale=0.3, max_len=None):
    """The op against the reference; with max_len, the reference's probabilities widened with zero columns."""
    out, probs = ops.paged_decode_attention(*inputs, scale, max_len=max_len)
    expected_out, expected_probs = reference.paged_decode_attention(*(t.cpu() for t in inputs), scale)
    query, lengths = inputs[0], inputs[-1]
    width = max_len or int(lengths.max())
    assert out.dtype == query.dtype and out.shape == query.shape and out.device == query.device
    assert probs.shape == (*query.shape[:3], width)
    expected_probs = torch.nn.functional.pad(expected_probs, (0, width - expected_probs.shape[-1]))
    torch.testing.assert_close(probs.cpu(), expected_probs, **PROBS_TOL)
    torch.testing.assert_close(out.cpu(), expected_out, **OUT_TOL[query.dtype])
    return out, probs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_heads,lengths", [
    (8, [[37, 5], [16, 0]]),  # groups of 4, a head of exactly one block (when S = 16), an empty head
    (3, [[300, 1, 49]]),  # groups of 1, a long head
], ids=["gqa", "mha"])
@pytest.mark.parametrize("num_queries", [1, 7])
@pytest.mark.parametrize("block_size", [1, 16, 24])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_matches_reference(device, dtype, query_heads, lengths, num_queries, block_size, head_dim):
    inputs = make_paged(lengths, query_heads, num_queries, head_dim, block_size, dtype, device)
    check_against_reference(inputs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [16, 24])
@pytest.mark.parametrize("num_queries", [1, 5])
@pytest.mark.parametrize("return_probs", [True, False])
def test_long_heads_split_into_slot_chunks(device, block_size, num_queries, return_probs):
    """Heads long enough for the CPU kernel to split their slots into chunks (4 of 1040 or 1032 slots here, whole
    blocks), next to heads that fill only the first chunk or none."""
    inputs = make_paged([[4100, 700], [0, 2500]], 6, num_queries, 64, block_size, device=device, evicted=0.2)
    if return_probs:
        check_against_reference(inputs)
    else:
        out, _ = ops.paged_decode_attention(*inputs, 0.3, return_probs=False)
        expected_out, _ = reference.paged_decode_attention(*(t.cpu() for t in inputs), 0.3)
        torch.testing.assert_close(out.cpu(), expected_out, **OUT_TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 128)])
def test_usual_decode_with_probabilities_over_many_slots(device, dtype, head_dim):
    """q = 1, groups of 4, half precision, heads of 32768 and 30001 slots (64k cached slots, the widest head counted
    for both): where CUDA takes its tensor-core kernel with probabilities (launch::tensor_core_decode_pays) through the
    block tables; the shorter head's probabilities are 0 past its length."""
    inputs = make_paged([[32768, 30001]], 8, 1, head_dim, 16, dtype, device, evicted=0.1)
    out, probs = ops.paged_decode_attention(*inputs, head_dim ** -0.5)
    expected_out, expected_probs = reference.paged_decode_attention(*(t.cpu() for t in inputs), head_dim ** -0.5)
    assert probs.shape == (1, 8, 1, 32768)
    expected_probs = torch.nn.functional.pad(expected_probs, (0, 32768 - expected_probs.shape[-1]))
    torch.testing.assert_close(probs.cpu(), expected_probs, **PROBS_TOL)
    assert (probs[0, 4:, :, 30001:] == 0).all()
    torch.testing.assert_close(out.cpu(), expected_out.to(out.dtype), **LONG_ROW_OUT_TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("length", [5, 20])
def test_a_nan_key_as_the_only_slot_attended_makes_its_rows_nan(device, length):
    """As over a rectangular cache: a head's only attended slot (the others -inf) holds a NaN key, its logit alone in
    the scalar tail of the chunk's maximum; the rows reading it come out NaN, as the float64 softmax gives them."""
    query, key_blocks, value_blocks, log_weight_blocks, tables, lengths = make_paged([[length, 9]], 4, 1, 16, 16,
                                                                                     device=device, evicted=0.0)
    for slot in range(length - 1):
        log_weight_blocks[tables[0, 0, slot // 16], slot % 16] = -INF
    key_blocks[tables[0, 0, (length - 1) // 16], (length - 1) % 16, 5] = float("nan")
    inputs = (query, key_blocks, value_blocks, log_weight_blocks, tables, lengths)
    out, probs = ops.paged_decode_attention(*inputs, 0.3)
    expected_out, expected_probs = reference.paged_decode_attention(*(t.cpu() for t in inputs), 0.3)
    assert bool(out[0, :2].isnan().all()) and bool(probs[0, :2, :, length - 1].isnan().all())
    torch.testing.assert_close(out.cpu(), expected_out, equal_nan=True)
    torch.testing.assert_close(probs.cpu(), expected_probs, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_a_nan_query_makes_its_row_nan_and_no_other(device):
    """Every logit of a NaN query is NaN: no finite maximum is left to shift by, and the row must still come out NaN,
    as the float64 softmax gives it (the CUDA kernel's maximum passed over the NaN and read the row as empty)."""
    query, *rest = make_paged([[37, 300]], 4, 1, 16, 16, device=device, evicted=0.0)
    query[0, 3, 0, 0] = float("nan")
    out, probs = ops.paged_decode_attention(query, *rest, 0.3)
    expected_out, expected_probs = reference.paged_decode_attention(query.cpu(), *(t.cpu() for t in rest), 0.3)
    assert out[0, 3].isnan().all() and probs[0, 3, :, :300].isnan().all()
    torch.testing.assert_close(out[0, :3].cpu(), expected_out[0, :3], **OUT_TOL[torch.float32])
    torch.testing.assert_close(probs[0, :3].cpu(), expected_probs[0, :3], **PROBS_TOL)


@pytest.mark.parametrize("return_probs", [True, False])
def test_cpu_result_does_not_depend_on_the_thread_count(return_probs):
    inputs = make_paged([[4100, 700, 2500]], 9, 1, 64, 16, seed=3, evicted=0.2)
    one_thread, two_threads = at_one_and_two_threads(
        lambda: ops.paged_decode_attention(*inputs, 0.3, return_probs=return_probs))
    assert torch.equal(one_thread[0], two_threads[0]) and torch.equal(one_thread[1], two_threads[1])


@pytest.mark.parametrize("device", DEVICES)
def test_head_shorter_than_queries_gives_zero_rows(device):
    """A (b, h) with L < q slots (a shorter prompt of a padded batch): its first q - L queries see nothing."""
    inputs = make_paged([[3, 9]], 4, 6, 16, 4, device=device, evicted=0.0)
    out, probs = check_against_reference(inputs)
    group = 2
    assert bool((out[0, :group, :3] == 0).all()) and bool((probs[0, :group, :3] == 0).all())
    assert bool((probs[0, :group, 3:].sum(-1) - 1).abs().max() < 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_queries", [1, 4])
def test_equals_decode_attention_on_the_same_slots(device, num_queries):
    """Heads of equal length in a paged pool give decode_attention's result on the rectangular gather."""
    inputs = make_paged([[45, 45], [45, 45]], 6, num_queries, 32, 8, device=device)
    query, key_blocks, value_blocks, log_weight_blocks, tables, lengths = inputs
    out, probs = ops.paged_decode_attention(*inputs, 0.2)
    cpu = [t.cpu() for t in (key_blocks, value_blocks, log_weight_blocks)]
    keys, values = (reference.gather_paged(t, tables.cpu(), lengths.cpu()) for t in cpu[:2])
    log_weights = reference.gather_paged(cpu[2], tables.cpu(), lengths.cpu())
    expected_out, expected_probs = ops.decode_attention(query, keys.to(device), values.to(device),
                                                        log_weights.to(device), 0.2)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs, expected_probs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 16), (torch.bfloat16, 64)])  # CUDA: both kernels
def test_without_probs(device, dtype, head_dim):
    inputs = make_paged([[20, 33]], 4, 2, head_dim, 16, dtype, device)
    out, probs = ops.paged_decode_attention(*inputs, 0.25, return_probs=False)
    expected, _ = ops.paged_decode_attention(*inputs, 0.25)
    assert probs.shape == (1, 4, 2, 0)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_opcheck():
    inputs = make_paged([[20, 7]], 4, 2, 16, 8)
    torch.library.opcheck(torch.ops.kvcomp.paged_decode_attention, (*inputs, 0.25, True))
    torch.library.opcheck(torch.ops.kvcomp.paged_decode_attention, (*inputs, 0.25, True, 23))


def test_compile_fullgraph():
    compiled = torch.compile(ops.paged_decode_attention, fullgraph=True)
    for lengths in ([[20, 7]], [[3, 41], [16, 0]]):  # (a second shape: traced again or dynamic, never stale)
        inputs = make_paged(lengths, 4, 2, 16, 8)
        for got, expected in zip(compiled(*inputs, 0.25), ops.paged_decode_attention(*inputs, 0.25)):
            assert torch.equal(got, expected)


# ---------------------------------------------------------------------------------------------------------------
# max_len: the caller's bound on the lengths, so that a GPU call reads nothing back


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("extra", [0, 1, 11])  # up to the tables' 48 slots
def test_max_len_is_the_width_of_probs(device, extra):
    """Columns past the longest head are 0 like those past any head's length; the rest is the reference's."""
    inputs = make_paged([[37, 5], [16, 0]], 8, 3, 32, 16, device=device)
    longest = 37
    _, probs = check_against_reference(inputs, max_len=longest + extra)
    assert bool((probs[..., longest:] == 0).all())


@CUDA
def test_max_len_call_reads_nothing_back():
    """With max_len the op syncs nothing (the tables are checked on the device); without it, it must sync to find the
    longest length, which shows that the sync check sees a sync."""
    inputs = make_paged([[300, 1, 49]], 6, 1, 64, 16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = ops.paged_decode_attention(*inputs, 0.2, max_len=300)
        with pytest.raises(RuntimeError, match="synchroniz"):
            ops.paged_decode_attention(*inputs, 0.2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected, _ = reference.paged_decode_attention(*(t.cpu() for t in inputs), 0.2)
    torch.testing.assert_close(out.cpu(), expected, **OUT_TOL[torch.float32])


BAD_TABLE_ON_DEVICE = """
import torch
from kvpress_cpp import ops
from tests.test_paged_attention_ops import make_paged
inputs = list(make_paged([[20, 7]], 4, 1, 16, 8, device="cuda"))
inputs[{index}] = torch.tensor({value}, device="cuda")
ops.paged_decode_attention(*inputs, 0.25, max_len=24)
torch.cuda.synchronize()
"""


@CUDA
@pytest.mark.parametrize("index,value,says", [  # (b, h) = (0, 1) is pair 1; the pool has 7 blocks
    (4, [[[0, 1, 2], [9, -1, -1]]],
     r"block table index out of range: block_tables\[1, 0\] \(b \* H \+ h, entry\) = 9 is used but not in \[0, 7\)"),
    (5, [[20, 25]], r"expected every length in \[0, max_len = 24\], got lengths\[1\] \(b \* H \+ h\) = 25"),
], ids=["block", "length"])
def test_max_len_bad_table_stops_on_the_device(index, value, says):
    """A bad table the host did not read stops the kernel with a device-side assert naming the op and the entry (in
    a subprocess: the assert leaves its CUDA context unusable)."""
    # CUDA_LAUNCH_BLOCKING: the check kernel's launch waits for it, so its printf is flushed before the error
    done = subprocess.run([sys.executable, "-c", BAD_TABLE_ON_DEVICE.format(index=index, value=value)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent,
                          env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})
    assert done.returncode != 0
    assert "device-side assert" in done.stderr
    assert re.search("kvcomp::paged_decode_attention: " + says, done.stdout + done.stderr)


# ---------------------------------------------------------------------------------------------------------------
# Bad input: an error naming the op and the value


def test_block_index_out_of_range():
    inputs = list(make_paged([[20, 7]], 4, 1, 16, 8))
    inputs[4] = inputs[4].clone()
    num_blocks = inputs[1].shape[0]
    inputs[4][0, 1, 0] = num_blocks
    with pytest.raises(RuntimeError, match=rf"kvcomp::paged_decode_attention: block table index out of range: "
                                           rf"block_tables\[0, 1, 0\] = {num_blocks} is used but not in "
                                           rf"\[0, {num_blocks}\)"):
        ops.paged_decode_attention(*inputs)
    inputs[4][0, 1, 0] = -1
    with pytest.raises(RuntimeError, match=r"block_tables\[0, 1, 0\] = -1"):
        ops.paged_decode_attention(*inputs)


def test_unused_table_entries_are_not_read():
    inputs = list(make_paged([[20, 7]], 4, 1, 16, 8))
    inputs[4] = inputs[4].clone()
    inputs[4][0, 1, 2] = 10 ** 9  # beyond head (0, 1)'s single block
    check_against_reference(inputs)


def test_length_beyond_max_len():
    inputs = make_paged([[20, 7]], 4, 1, 16, 8)
    with pytest.raises(RuntimeError, match=r"kvcomp::paged_decode_attention: expected every length <= max_len = 19, "
                                           r"got a length of 20"):
        ops.paged_decode_attention(*inputs, max_len=19)


@pytest.mark.parametrize("max_len", [0, -3, 25])
def test_max_len_out_of_range(max_len):
    inputs = make_paged([[20, 7]], 4, 1, 16, 8)  # 3 blocks of 8 per head: 24 slots
    with pytest.raises(RuntimeError, match=rf"kvcomp::paged_decode_attention: expected max_len in \[1, 24\] "
                                           rf"\(max_blocks \* block size\), got {max_len}"):
        ops.paged_decode_attention(*inputs, max_len=max_len)


def test_length_beyond_the_table():
    inputs = list(make_paged([[20, 7]], 4, 1, 16, 8))
    inputs[5] = torch.tensor([[20, 25]])
    with pytest.raises(RuntimeError, match=r"kvcomp::paged_decode_attention: expected every length in \[0, 24\].*"
                                           r"got lengths from 20 to 25"):
        ops.paged_decode_attention(*inputs)


def test_mismatched_dtypes():
    inputs = list(make_paged([[20, 7]], 4, 1, 16, 8))
    with pytest.raises(RuntimeError, match=r"kvcomp::paged_decode_attention: expected key_blocks of dtype Half"):
        ops.paged_decode_attention(inputs[0].half(), *inputs[1:])
    inputs[4] = inputs[4].int()
    with pytest.raises(RuntimeError, match=r"kvcomp::paged_decode_attention: expected block_tables of dtype Long"):
        ops.paged_decode_attention(*inputs)


@CUDA
def test_mismatched_devices():
    inputs = list(make_paged([[20, 7]], 4, 1, 16, 8, device="cuda"))
    inputs[4] = inputs[4].cpu()
    with pytest.raises(RuntimeError, match=r"kvcomp::paged_decode_attention: expected block_tables on the device"):
        ops.paged_decode_attention(*inputs)


def test_non_positive_block_size():
    query = torch.randn(1, 2, 1, 8)
    empty = torch.empty(4, 0, 8)
    with pytest.raises(RuntimeError, match=r"kvcomp::paged_decode_attention: expected a block size \(key_blocks.size"
                                           r"\(1\)\) >= 1, got 0"):
        ops.paged_decode_attention(query, empty, empty, torch.empty(4, 0), torch.zeros(1, 2, 1, dtype=torch.long),
                                   torch.zeros(1, 2, dtype=torch.long))


def test_bad_group():
    inputs = list(make_paged([[20, 7, 3]], 6, 1, 16, 8))
    with pytest.raises(RuntimeError, match=r"expected the 4 query heads of query to be a positive multiple of the 3"):
        ops.paged_decode_attention(inputs[0][:, :4], *inputs[1:])
