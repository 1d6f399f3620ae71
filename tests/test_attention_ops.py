"""kvcomp::merge_count_bias and kvcomp::decode_attention against their plain-PyTorch references, the properties of the
log-weight convention (methods.md), opcheck, torch.compile and bad input. Every device test also runs on CUDA when a
GPU is present; the shapes are chosen so that the CUDA kernel meets several slot chunks, partial tiles of query rows,
head dims that leave lanes idle or need the one-element load path, and strided or unaligned cache views."""

import math

import pytest
import torch

from kvpress_cpp import ops
from tests import reference
from tests.threads import at_one_and_two_threads

pytestmark = pytest.mark.independent_of_transformers

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Output tolerance: the kernel and the float64 reference see the same rounded inputs; the output is rounded once to
# the query dtype. Probabilities are float32 whatever the cache dtype.
OUT_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
           torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
PROBS_TOL = dict(rtol=2e-5, atol=2e-6)
# Half-precision outputs of ~1e-2 over tens of thousands of slots: OUT_TOL's absolute bound in bf16 would pass a
# 2048-slot chunk left out, these do not.
LONG_ROW_OUT_TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=2e-4), torch.float16: dict(rtol=2e-3, atol=5e-5)}
INF = float("inf")


def make_inputs(batch, query_heads, kv_heads, num_queries, total_len, head_dim, dtype=torch.float32, device="cpu",
                seed=0, evicted=0.1):
    """query, keys, values, log_weights: merged slots (b = 0.6 ln w, w in [1, 5)) and a fraction of -inf slots."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, query_heads, num_queries, head_dim, generator=generator)
    keys = torch.randn(batch, kv_heads, total_len, head_dim, generator=generator)
    values = torch.randn(batch, kv_heads, total_len, head_dim, generator=generator)
    counts = 1 + 4 * torch.rand(batch, kv_heads, total_len, generator=generator)
    counts[torch.rand(batch, kv_heads, total_len, generator=generator) < evicted] = 0
    log_weights = reference.merge_count_bias(counts, 0.6)
    return (query.to(device, dtype), keys.to(device, dtype), values.to(device, dtype), log_weights.to(device))


def check_against_reference(query, keys, values, log_weights, scale):
    out, probs = ops.decode_attention(query, keys, values, log_weights, scale)
    expected_out, expected_probs = reference.decode_attention(query, keys, values, log_weights, scale)
    assert out.dtype == query.dtype and out.shape == query.shape and out.device == query.device
    assert probs.dtype == torch.float32 and probs.shape == (*query.shape[:3], keys.shape[2])
    torch.testing.assert_close(probs, expected_probs, **PROBS_TOL)
    torch.testing.assert_close(out, expected_out, **OUT_TOL[query.dtype])
    return out, probs


# ---------------------------------------------------------------------------------------------------------------
# decode_attention against the reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_heads,kv_heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("num_queries", [1, 5])
@pytest.mark.parametrize("total_len", ["q", 37, 300])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_decode_attention_matches_reference(device, dtype, query_heads, kv_heads, num_queries, total_len, head_dim):
    total_len = num_queries if total_len == "q" else total_len
    inputs = make_inputs(2, query_heads, kv_heads, num_queries, total_len, head_dim, dtype, device)
    check_against_reference(*inputs, head_dim**-0.5)


def test_the_default_scale_is_one_over_the_square_root_of_the_head_dim():
    """scale=None is 1/sqrt(d), d the query's last size, whatever its other sizes (5 queries, 37 slots, d = 16)."""
    query, keys, values, log_weights = make_inputs(2, 8, 2, 5, 37, 16)
    out, probs = check_against_reference(query, keys, values, log_weights, 16**-0.5)
    default_out, default_probs = ops.decode_attention(query, keys, values, log_weights)
    torch.testing.assert_close(default_probs, probs, rtol=0, atol=0)
    torch.testing.assert_close(default_out, out, rtol=0, atol=0)
    scores = reference.prompt_scores(query, keys, log_weights, 16**-0.5, 1.0, 1.0)
    torch.testing.assert_close(ops.prompt_scores(query, keys, log_weights), scores.float(), **PROBS_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_many_slot_chunks_and_row_tiles(device, dtype, head_dim):
    """B * H = 1 with T = 4100: the CPU splits the slots into 4 chunks of 1025, CUDA into many; G * q = 24 query rows
    take 3 tiles of 8 on CUDA in float32, 2 tiles of 16 on the tensor-core path (half precision: chunks of several
    64-slot tiles, the last one partial)."""
    inputs = make_inputs(1, 8, 1, 3, 4100, head_dim, dtype, device, seed=1, evicted=0.3)
    check_against_reference(*inputs, 0.125)


@pytest.mark.parametrize("batch,kv_heads", [(1, 1), (1, 3)])
def test_cpu_result_does_not_depend_on_the_thread_count(batch, kv_heads):
    """The CPU kernel splits each kv head's slots into chunks fixed by the shape, so one and two threads give the same
    bits (it once split by the thread count when B * H was below it, and the chunks' partials rounded apart)."""
    inputs = make_inputs(batch, 3 * kv_heads, kv_heads, 1, 4100, 64, seed=2, evicted=0.2)
    one_thread, two_threads = at_one_and_two_threads(lambda: ops.decode_attention(*inputs, 0.125))
    assert torch.equal(one_thread[0], two_threads[0]) and torch.equal(one_thread[1], two_threads[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [18, 96, 256])
def test_odd_head_dims_and_strided_cache_views(device, dtype, head_dim):
    """Keys and values are the first T slots of a preallocated (B, H, T_max, d) cache (read in place), the query a
    transposed (B, q, Hq, d) projection; d = 18 forces one-element loads, 96 leaves lanes idle, 256 gives each lane
    several pieces of d."""
    query, keys, values, log_weights = make_inputs(2, 6, 3, 2, 90, head_dim, dtype, device, seed=2)
    buffer_k = torch.zeros(2, 3, 128, head_dim, dtype=dtype, device=device)
    buffer_v = torch.zeros_like(buffer_k)
    buffer_k[:, :, :90] = keys
    buffer_v[:, :, :90] = values
    keys_view, values_view = buffer_k[:, :, :90], buffer_v[:, :, :90]
    query_view = query.transpose(1, 2).contiguous().transpose(1, 2)
    assert not keys_view.is_contiguous() and not query_view.is_contiguous()
    check_against_reference(query_view, keys_view, values_view, log_weights, 0.2)


@pytest.mark.parametrize("device", DEVICES)
def test_unaligned_cache_pointer(device):
    """A cache that starts one element into its storage: no 16-byte loads possible, the kernel must notice."""
    query, keys, values, log_weights = make_inputs(1, 4, 2, 1, 50, 64, torch.bfloat16, device, seed=3)
    storage = torch.empty(keys.numel() + 1, dtype=keys.dtype, device=device)
    shifted = storage[1:].view(keys.shape)
    shifted.copy_(keys)
    assert shifted.data_ptr() % 16 != 0
    check_against_reference(query, shifted, values, log_weights, 0.125)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    query, keys, values, log_weights = make_inputs(0, 4, 2, 1, 5, 16, torch.float32, device)
    out, probs = ops.decode_attention(query, keys, values, log_weights)
    assert out.shape == (0, 4, 1, 16) and probs.shape == (0, 4, 1, 5)


# ---------------------------------------------------------------------------------------------------------------
# Properties of the log-weight convention (the tests)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_minus_inf_slot_equals_slot_removed(device, dtype):
    """A -inf slot contributes exactly nothing, even when its key and value hold NaN (garbage in padding)."""
    query, keys, values, log_weights = make_inputs(2, 8, 2, 3, 40, 32, dtype, device, seed=4, evicted=0.0)
    log_weights[:, :, 7] = -INF
    keys[:, :, 7] = float("nan")
    values[:, :, 7] = float("nan")
    out, probs = ops.decode_attention(query, keys, values, log_weights, 0.2)
    keep = [s for s in range(40) if s != 7]
    out_removed, probs_removed = ops.decode_attention(
        query, keys[:, :, keep], values[:, :, keep], log_weights[:, :, keep], 0.2)
    assert torch.isfinite(out).all()
    assert (probs[..., 7] == 0).all()
    torch.testing.assert_close(out, out_removed, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(probs[..., keep], probs_removed, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_log_weight_equals_identical_copies(device):
    """One slot with b = ln w (merge_count_bias of count w, alpha 1) gives the same attention as w = 3 identical copies
    of that slot with b = 0, and its probability is the sum of theirs."""
    query, keys, values, _ = make_inputs(1, 8, 2, 2, 20, 64, torch.float32, device, seed=5)
    counts = torch.ones(1, 2, 20, device=device)
    counts[:, :, 6] = 3
    merged_out, merged_probs = ops.decode_attention(query, keys, values, ops.merge_count_bias(counts, 1.0), 0.125)
    copies = [0, 1, 2, 3, 4, 5, 6, 6, 6] + list(range(7, 20))
    copies_out, copies_probs = ops.decode_attention(
        query, keys[:, :, copies], values[:, :, copies], torch.zeros(1, 2, 22, device=device), 0.125)
    torch.testing.assert_close(merged_out, copies_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged_probs[..., 6], copies_probs[..., 6:9].sum(-1), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(merged_probs[..., 7:], copies_probs[..., 9:], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_all_minus_inf_row_gives_zeros(device):
    """A kv head whose slots are all -inf gives output 0 and probabilities 0 (not NaN) for its whole group; with q = 2,
    masking every slot but the last leaves query 0 with nothing (zeros) and query 1 with the last slot only."""
    query, keys, values, log_weights = make_inputs(2, 8, 2, 2, 300, 16, torch.float32, device, seed=6, evicted=0.0)
    log_weights[0, 1] = -INF
    log_weights[1, 0, :-1] = -INF
    out, probs = ops.decode_attention(query, keys, values, log_weights, 0.25)
    assert torch.isfinite(out).all() and torch.isfinite(probs).all()
    assert (out[0, 4:] == 0).all() and (probs[0, 4:] == 0).all()
    assert (out[1, :4, 0] == 0).all() and (probs[1, :4, 0] == 0).all()
    assert (probs[1, :4, 1, -1] == 1).all() and (probs[1, :4, 1, :-1] == 0).all()
    torch.testing.assert_close(out[1, :4, 1], values[1, 0, -1].expand(4, 16))
    check_against_reference(query, keys, values, log_weights, 0.25)


@pytest.mark.parametrize("device", DEVICES)
def test_probs_sum_to_one_and_vanish_where_masked(device):
    query, keys, values, log_weights = make_inputs(2, 8, 2, 4, 300, 32, torch.float32, device, seed=7, evicted=0.3)
    _, probs = ops.decode_attention(query, keys, values, log_weights, 0.2)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 8, 4, device=device), rtol=1e-5, atol=1e-5)
    causal = torch.arange(300, device=device)[None, :] <= (296 + torch.arange(4, device=device))[:, None]
    allowed = causal & (log_weights != -INF).repeat_interleave(4, dim=1)[:, :, None, :]
    assert (probs[~allowed] == 0).all()
    assert (probs[allowed] > 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_nan_input_does_not_crash(device):
    """NaN in a key, a query or a log-weight propagates to the rows that read it, and nowhere else."""
    query, keys, values, log_weights = make_inputs(2, 8, 2, 1, 300, 16, torch.float32, device, seed=8, evicted=0.0)
    keys[0, 0, 3] = float("nan")
    query[1, 7, 0, 0] = float("nan")
    log_weights[1, 0, 10] = float("nan")
    out, probs = ops.decode_attention(query, keys, values, log_weights, 0.25)
    assert out.shape == (2, 8, 1, 16) and probs.shape == (2, 8, 1, 300)
    assert torch.isfinite(out[0, 4:]).all() and torch.isfinite(out[1, 4:7]).all()
    torch.testing.assert_close(out[0, 4:], reference.decode_attention(query, keys, values, log_weights, 0.25)[0][0, 4:])
    # The rows that read a NaN are NaN, the NaN query's too: its other logits are all NaN, so no finite maximum is
    # left to shift by (the CUDA kernel's maximum passed over the NaN and read the row as empty: zeros).
    for rows in (out[0, :4], out[1, :4], out[1, 7], probs[0, :4], probs[1, :4], probs[1, 7]):
        assert rows.isnan().all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 128)])
def test_nan_and_minus_inf_at_the_usual_decode_over_many_slots(device, dtype, head_dim):
    """Half precision at q = 1 over 64k cached slots, where CUDA takes its tensor-core kernel with probabilities
    (launch::tensor_core_decode_pays): a NaN key makes its kv head's rows NaN, a NaN query its own row, and -inf slots
    holding NaN keys and values contribute nothing; every other row is the float64 reference's."""
    query, keys, values, log_weights = make_inputs(1, 8, 2, 1, 32768, head_dim, dtype, device, seed=10, evicted=0.0)
    keys[0, 0, 3] = float("nan")
    query[0, 7, 0, 0] = float("nan")
    log_weights[0, 1, 100:164] = -INF
    # The reference's 0 * NaN would be NaN: it reads the -inf slots' zeros, the op their garbage.
    expected_out, expected_probs = reference.decode_attention(query, keys, values, log_weights, head_dim ** -0.5)
    keys[0, 1, 100:164] = float("nan")
    values[0, 1, 100:164] = float("nan")
    out, probs = ops.decode_attention(query, keys, values, log_weights, head_dim ** -0.5)
    attended = torch.ones(32768, dtype=torch.bool, device=device)
    attended[100:164] = False
    for rows in (out[0, :4], out[0, 7], probs[0, :4], probs[0, 7][..., attended]):
        assert rows.isnan().all()
    torch.testing.assert_close(out[0, 4:7], expected_out[0, 4:7].to(out), **LONG_ROW_OUT_TOL[dtype])
    torch.testing.assert_close(probs[0, 4:7], expected_probs[0, 4:7].to(probs), **PROBS_TOL)
    assert (probs[0, 4:7, :, 100:164] == 0).all()


@CUDA
@pytest.mark.parametrize("kernel", ["split_k", "tensor_cores"])
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 128), (torch.float16, 64)])
@pytest.mark.parametrize("num_queries,total_len", [(1, 300), (1, 4100), (5, 4100)])
def test_each_decode_kernel_named_by_the_environment_matches_reference(monkeypatch, kernel, dtype, head_dim,
                                                                       num_queries, total_len):
    """KVCOMP_DECODE_KERNEL forces one kernel where the routing would pick the other (the benchmark times both at one
    shape): each gives the reference's output and probabilities, on both sides of the routing's 64k-slot line."""
    monkeypatch.setenv("KVCOMP_DECODE_KERNEL", kernel)
    inputs = make_inputs(2, 8, 2, num_queries, total_len, head_dim, dtype, "cuda", seed=11, evicted=0.2)
    check_against_reference(*inputs, head_dim**-0.5)


@CUDA
def test_an_unknown_decode_kernel_in_the_environment_is_named(monkeypatch):
    monkeypatch.setenv("KVCOMP_DECODE_KERNEL", "tensor-cores")
    inputs = make_inputs(1, 4, 2, 1, 64, 64, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match=r"kvcomp::decode_attention: KVCOMP_DECODE_KERNEL .* got 'tensor-cores'"):
        ops.decode_attention(*inputs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("total_len", [17, 33, 300])
@pytest.mark.parametrize("nan_slot", [0, -2])
def test_nan_log_weight_reaches_every_row_that_sees_it(device, total_len, nan_slot):
    """Several queries (q = 3): the earlier rows end in causally masked -inf slots, which may fall in the scalar tail
    after the vector part of a chunk's maximum; a NaN log-weight still makes every row that sees it NaN and no other
    row, as the float64 softmax does (the tail's max once dropped the NaN for a -inf, leaving the chunk empty)."""
    query, keys, values, log_weights = make_inputs(1, 4, 2, 3, total_len, 16, torch.float32, device, seed=9,
                                                   evicted=0.0)
    log_weights[0, 0, nan_slot] = float("nan")
    out, probs = ops.decode_attention(query, keys, values, log_weights, 0.25)
    expected_out, expected_probs = reference.decode_attention(query, keys, values, log_weights, 0.25)
    assert torch.equal(out.isnan().any(-1).cpu(), expected_out.isnan().any(-1).cpu())
    assert torch.equal(probs.isnan().any(-1).cpu(), expected_probs.isnan().any(-1).cpu())
    assert bool(out.isnan().any()) and not bool(out[:, 2:].isnan().any()), "kv head 1 never reads the NaN"
    torch.testing.assert_close(out, expected_out.to(out.device), equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("total_len", [5, 20])
def test_a_nan_key_as_the_only_slot_attended_makes_its_rows_nan(device, total_len):
    """Every slot -inf but the last, whose key holds a NaN: its logit is the chunk's only one, in the scalar tail after
    the vector part (or alone, with fewer slots than a vector), and the rows reading it come out NaN as the float64
    softmax gives them; a maximum that passed over the NaN would read the row as empty (zeros)."""
    query, keys, values, log_weights = make_inputs(1, 4, 2, 1, total_len, 16, torch.float32, device, seed=3,
                                                   evicted=0.0)
    log_weights[:, :, :-1] = -INF
    keys[0, 0, -1, 5] = float("nan")
    out, probs = ops.decode_attention(query, keys, values, log_weights, 0.25)
    expected_out, expected_probs = reference.decode_attention(query, keys, values, log_weights, 0.25)
    assert bool(out[0, :2].isnan().all()) and bool(probs[0, :2, :, -1].isnan().all())
    torch.testing.assert_close(out, expected_out.to(out.device), equal_nan=True)
    torch.testing.assert_close(probs, expected_probs.to(probs.device), equal_nan=True)


# ---------------------------------------------------------------------------------------------------------------
# merge_count_bias


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_merge_count_bias_matches_reference(device, alpha):
    generator = torch.Generator().manual_seed(9)
    counts = torch.randint(0, 6, (2, 3, 37), generator=generator).float() * torch.rand(2, 3, 37, generator=generator).add(0.5)
    counts[0, 0, :4] = torch.tensor([0.0, 1.0, 3.0, 1e-30])
    counts = counts.to(device)
    got = ops.merge_count_bias(counts, alpha)
    expected = reference.merge_count_bias(counts, alpha)
    assert got.dtype == torch.float32 and got.shape == counts.shape
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert (got[counts == 0] == -INF).all()
    if alpha == 0:
        assert (got[counts > 0] == 0).all()
    assert got[0, 0, 1] == 0  # a plain token
    assert math.isclose(got[0, 0, 2].item(), alpha * math.log(3), rel_tol=1e-6)


def test_merge_count_bias_of_a_count_does_not_depend_on_where_it_sits():
    """Each count's bias is the same alone, in a long tensor, and at any thread count: the CPU kernel's threads split
    the tensor wherever the thread count puts the ends of their ranges, and a range's tail took the scalar logf, which
    rounds apart from the vector log on a few percent of counts."""
    counts = torch.rand(70001, generator=torch.Generator().manual_seed(3)).mul(50).add(1).view(1, 1, -1)
    one_thread, two_threads = at_one_and_two_threads(lambda: ops.merge_count_bias(counts, 0.6))
    assert torch.equal(one_thread, two_threads)
    alone = torch.cat([ops.merge_count_bias(counts[..., i:i + 1], 0.6) for i in range(0, 4000)], dim=-1)
    assert torch.equal(alone, one_thread[..., :4000])


@pytest.mark.parametrize("device", DEVICES)
def test_merge_count_bias_negative_or_nan_count_gives_nan(device):
    counts = torch.tensor([[[2.0, -1.0, float("nan"), 0.0]]], device=device)
    got = ops.merge_count_bias(counts, 0.6)
    assert torch.isnan(got[0, 0, 1:3]).all() and got[0, 0, 3] == -INF and torch.isfinite(got[0, 0, 0])


# ---------------------------------------------------------------------------------------------------------------
# opcheck, torch.compile, registration


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_decode_attention(device, dtype):
    query, keys, values, log_weights = make_inputs(2, 8, 2, 2, 9, 16, dtype, device)
    torch.library.opcheck(torch.ops.kvcomp.decode_attention.default, (query, keys, values, log_weights, 0.25))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_merge_count_bias(device):
    counts = torch.tensor([[[0.0, 1.0, 2.5], [3.0, 0.0, 1.0]]], device=device)
    torch.library.opcheck(torch.ops.kvcomp.merge_count_bias.default, (counts, 0.6))


def test_compile_fullgraph():
    def merged_attention(query, keys, values, counts):
        out, probs = ops.decode_attention(query, keys, values, ops.merge_count_bias(counts, 0.6), 0.25)
        return out * 2.0, probs.sum(1)

    query, keys, values, _ = make_inputs(1, 4, 2, 1, 12, 16)
    counts = torch.randint(0, 4, (1, 2, 12)).float()
    compiled = torch.compile(merged_attention, fullgraph=True)
    for got, expected in zip(compiled(query, keys, values, counts), merged_attention(query, keys, values, counts)):
        torch.testing.assert_close(got, expected)


# ---------------------------------------------------------------------------------------------------------------
# bad input: every check names the op and the offending value

Q, K, V, B = "query", "keys", "values", "log_weights"
BAD_ATTENTION_INPUTS = [
    (lambda q, k, v, b: (q[0], k, v, b, 0.25), r"expected query of shape \(B, Hq, q, d\), got a 3-d tensor"),
    (lambda q, k, v, b: (q, k[0], v, b, 0.25), r"expected keys of shape \(B, H, T, d\), got a 3-d tensor"),
    (lambda q, k, v, b: (q, k, v[None], b, 0.25), r"expected values of shape \(B, H, T, d\), got a 5-d tensor"),
    (lambda q, k, v, b: (q, k, v, b[0], 0.25), r"expected log_weights of shape \(B, H, T\), got a 2-d tensor"),
    (lambda q, k, v, b: (q.to(torch.int32), k, v, b, 0.25),
     r"expected query of dtype float32, float16 or bfloat16, got Int"),
    (lambda q, k, v, b: (q.double(), k.double(), v.double(), b, 0.25),
     r"expected query of dtype float32, float16 or bfloat16, got Double"),
    (lambda q, k, v, b: (q, k.half(), v, b, 0.25), r"expected keys of dtype Float, got Half"),
    (lambda q, k, v, b: (q, k, v.to(torch.int64), b, 0.25), r"expected values of dtype Float, got Long"),
    (lambda q, k, v, b: (q.half(), k.half(), v.half(), b.half(), 0.25), r"expected log_weights of dtype Float, got Half"),
    (lambda q, k, v, b: (q, k[:1], v[:1], b[:1], 0.25), r"expected keys.size\(0\) == 2 \(batch of query\)"),
    (lambda q, k, v, b: (q[:, :7], k, v, b, 0.25),
     r"expected the 7 query heads of query to be a positive multiple of the 2 kv heads of keys"),
    (lambda q, k, v, b: (q[:, :, :, :8], k, v, b, 0.25), r"expected keys.size\(3\) == 8 \(head dim d of query\)"),
    (lambda q, k, v, b: (q, k, v[..., :8], b, 0.25), r"expected values.size\(3\) == 16 \(the size of keys\)"),
    (lambda q, k, v, b: (q, k, v[:, :1], b, 0.25), r"expected values.size\(1\) == 2 \(the size of keys\)"),
    (lambda q, k, v, b: (q, k, v[:, :, :-1], b, 0.25), r"expected values.size\(2\) == 6 \(the size of keys\)"),
    (lambda q, k, v, b: (q, k, v, b[:, :, :-1], 0.25),
     r"expected log_weights.size\(2\) == 6 \(cache length T of keys\), got log_weights of shape \[2, 2, 5\]"),
    (lambda q, k, v, b: (q, k, v, b[:1], 0.25), r"expected log_weights.size\(0\) == 2 \(batch of keys\)"),
    (lambda q, k, v, b: (q, k, v, b[:, :1], 0.25), r"expected log_weights.size\(1\) == 2 \(kv heads of keys\)"),
    (lambda q, k, v, b: (q.expand(2, 8, 7, 16), k, v, b, 0.25),
     r"expected 1 <= q <= T .*query.size\(2\) = 7 and T = .* = 6"),
    (lambda q, k, v, b: (q[:, :, :0], k, v, b, 0.25),
     r"expected 1 <= q <= T .*query.size\(2\) = 0 and T = .* = 6"),
    (lambda q, k, v, b: (q, k, v, b, 0.0), r"expected a finite float32 scale > 0, got 0"),
    (lambda q, k, v, b: (q, k, v, b, -0.25), r"expected a finite float32 scale > 0, got -0.25"),
    (lambda q, k, v, b: (q, k, v, b, float("nan")), r"expected a finite float32 scale > 0, got nan"),
    (lambda q, k, v, b: (q, k, v, b, float("inf")), r"expected a finite float32 scale > 0, got inf"),
]


@pytest.mark.parametrize("make_args,message", BAD_ATTENTION_INPUTS)
def test_decode_attention_bad_input_names_op_and_value(make_args, message):
    inputs = make_inputs(2, 8, 2, 1, 6, 16)
    with pytest.raises(RuntimeError, match=r"kvcomp::decode_attention: " + message):
        torch.ops.kvcomp.decode_attention(*make_args(*inputs))


BAD_BIAS_INPUTS = [
    (lambda c: (c[0], 0.6), r"expected counts of shape \(B, H, T\), got a 2-d tensor"),
    (lambda c: (c.to(torch.int32), 0.6), r"expected counts of dtype Float, got Int"),
    (lambda c: (c.half(), 0.6), r"expected counts of dtype Float, got Half"),
    (lambda c: (c, -0.5), r"expected a finite float32 alpha >= 0, got -0.5"),
    (lambda c: (c, float("nan")), r"expected a finite float32 alpha >= 0, got nan"),
    (lambda c: (c, float("inf")), r"expected a finite float32 alpha >= 0, got inf"),
]


@pytest.mark.parametrize("make_args,message", BAD_BIAS_INPUTS)
def test_merge_count_bias_bad_input_names_op_and_value(make_args, message):
    with pytest.raises(RuntimeError, match=r"kvcomp::merge_count_bias: " + message):
        torch.ops.kvcomp.merge_count_bias(*make_args(torch.ones(1, 2, 5)))


@CUDA
@pytest.mark.parametrize("moved", [K, V, B])
def test_mixed_devices_rejected(moved):
    inputs = dict(zip((Q, K, V, B), make_inputs(2, 8, 2, 1, 6, 16, device="cuda")))
    inputs[moved] = inputs[moved].cpu()
    with pytest.raises(RuntimeError, match=rf"kvcomp::decode_attention: expected {moved} on the device of query"):
        torch.ops.kvcomp.decode_attention(*inputs.values(), 0.25)
