"""kvcomp::weightedkv_evict against its plain-PyTorch reference (Algorithm 1 with physical deletion), the paper's
figure 3, opcheck, torch.compile and bad input."""

from fractions import Fraction

import pytest
import torch

from kvpress_cpp import ops
from tests import reference
from tests.layouts import in_strided_rows, outside

pytestmark = pytest.mark.independent_of_transformers

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Merged values are rounded to the cache dtype after every step by the op and the reference alike; what is left is
# float32 rounding (fused multiply-add or not) that can flip the last bit of a half / bfloat16 value, and carry it
# through later merges: a few ulps of |v| <= ~5 (bf16: 2^-6 at 2..4; f16: 2^-9).
VALUE_TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=4e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=3e-2),
}


def make_inputs(batch, kv_heads, total_len, dtype, device, key_dim=16, value_dim=16, seed=0):
    """Random keys / values, sums and counts as a press would hold them (n >= 1, a of the order of n * 1/T)."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, total_len, key_dim, generator=generator)
    values = torch.randn(batch, kv_heads, total_len, value_dim, generator=generator)
    counts = torch.randint(1, 2 * total_len, (batch, kv_heads, total_len), generator=generator).float()
    sums = torch.rand(batch, kv_heads, total_len, generator=generator) * counts / total_len
    return keys.to(device, dtype), values.to(device, dtype), sums.to(device), counts.to(device)


def evict_copies(keys, values, sums, counts, *args):
    """The op on copies of the cache (it updates its arguments in place): the arguments stay as they were."""
    return ops.weightedkv_evict(keys.clone(), values.clone(), sums.clone(), counts.clone(), *args)


def to_cpu(tensors):
    return tuple(t.cpu() for t in tensors)


def assert_matches(got, expected, dtype):
    """Keys, sums and counts are copies of the survivors, so they match exactly; values up to rounding."""
    assert [t.shape for t in got] == [t.shape for t in expected]
    assert [t.dtype for t in got] == [t.dtype for t in expected]
    got, expected = to_cpu(got), to_cpu(expected)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(got[2], expected[2], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got[3], expected[3], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got[1], expected[1], equal_nan=True, **VALUE_TOLERANCE[dtype])


# (T, sinks, recent, evictions): none, a decoding step, some, all the middle (prefill reduction), the figure's
# setting (no sinks, the newest slot only), sinks with a one-slot recent window.
SETTINGS = [
    (48, 4, 8, 0),
    (48, 4, 8, 1),
    (48, 4, 8, 17),
    (48, 4, 8, 36),
    (48, 0, 1, 1),
    (48, 0, 1, 30),
    (48, 0, 1, 47),
    (48, 2, 1, 45),
    (9, 4, 5, 0),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("total_len,sinks,recent,evictions", SETTINGS)
@pytest.mark.parametrize("merge_values", [True, False], ids=["merge", "evict-only"])
def test_matches_reference(device, dtype, total_len, sinks, recent, evictions, merge_values):
    inputs = make_inputs(2, 3, total_len, dtype, device, key_dim=16, value_dim=24, seed=evictions)
    got = evict_copies(*inputs, sinks, recent, evictions, merge_values)
    expected = reference.weightedkv_evict(*to_cpu(inputs), sinks, recent, evictions, merge_values)
    assert got[0].shape == (2, 3, total_len - evictions, 16) and got[1].shape == (2, 3, total_len - evictions, 24)
    assert all(t.device == inputs[0].device for t in got)
    assert_matches(got, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sinks,recent,evictions", [(4, 8, 25), (0, 1, 39), (3, 2, 12)])
def test_k_evictions_equal_k_single_steps(device, dtype, sinks, recent, evictions):
    """evictions=k is k greedy steps, bit for bit (merged values are rounded to the cache dtype at every step)."""
    cache = make_inputs(2, 3, 40, dtype, device, seed=7)
    at_once = evict_copies(*cache, sinks, recent, evictions)
    for _ in range(evictions):
        cache = evict_copies(*cache, sinks, recent, 1)
    for one_by_one, together in zip(cache, at_once):
        assert torch.equal(one_by_one, together)


@pytest.mark.parametrize("device", DEVICES)
def test_evicted_slots_are_the_smallest_means_and_sums_stay(device):
    """The survivors' sums and counts are never touched, so the evicted slots are the e smallest means of the
    middle, and the survivors keep their keys, sums and counts in order."""
    keys, values, sums, counts = make_inputs(1, 2, 30, torch.float32, device, seed=3)
    sinks, recent, evictions = 3, 4, 11
    out_keys, _, out_sums, out_counts = evict_copies(keys, values, sums, counts, sinks, recent, evictions)
    for h in range(2):
        mean = (sums[0, h] / counts[0, h]).cpu()
        middle = torch.arange(sinks, 30 - recent)
        evicted = set(middle[mean[middle].argsort(stable=True)[:evictions]].tolist())
        kept = torch.tensor([s for s in range(30) if s not in evicted], device=device)
        assert torch.equal(out_keys[0, h], keys[0, h, kept])
        assert torch.equal(out_sums[0, h], sums[0, h, kept])
        assert torch.equal(out_counts[0, h], counts[0, h, kept])


def one_hot(n, d, device):
    return torch.eye(d, device=device)[:n]


@pytest.mark.parametrize("device", DEVICES)
def test_paper_figure_3(device):
    """Fig. 3 of the paper: cache size m = 4, values v1..v8 (one-hot here, so that a merged value shows its mixture).

    The paper gives the outcome, not the attention map, so the rows below are reconstructed to produce it. Algorithm 1
    has no sinks and takes the argmin over every slot but the newest (j in {0, ..., m-1} of m + 1): sinks=0, recent=1.
    Each step folds the attention row A_t over the current cache into a (update_scores, decay=1, input_scale=1/G with
    G = 1) and n += 1 (the new slot starts at n = 1), and evicts one slot once the cache holds m + 1.
      step 5: ā = [.4, .1, .5, .4 | .3]: v2 (0.1) merges into v3 (0.5): v3 <- v2/6 + 5 v3/6, k2 removed (paper);
      step 6: ā = [1/3, .425, .3667, .35 | .1]: v1 merges into v3;
      step 7: ā = [.38, .275, .3, .3 | .1]: v4 merges into v5;
      step 8: ā = [.35, .225, .3, .25 | .1]: v5 merges into v6;
    leaving v3, v6, v7, v8 where v3 and v6 hold three values each (paper).
    """
    rows = [
        [1.0],
        [0.6, 0.4],
        [0.3, 0.0, 0.7],
        [0.05, 0.0, 0.4, 0.55],
        [0.05, 0.0, 0.4, 0.25, 0.3],
        [0.0, 0.2, 0.3, 0.4, 0.1],  # over v1, v3', v4, v5, v6
        [0.2, 0.0, 0.2, 0.5, 0.1],  # over v3'', v4, v5, v6, v7
        [0.2, 0.0, 0.3, 0.4, 0.1],  # over v3'', v5', v6, v7, v8
    ]
    m, d = 4, 8
    tokens = one_hot(8, d, device).view(1, 1, 8, d)
    keys = values = torch.empty(1, 1, 0, d, device=device)
    sums = counts = torch.empty(1, 1, 0, device=device)
    for step, row in enumerate(rows, start=1):
        keys = torch.cat([keys, tokens[:, :, step - 1 : step]], dim=2)
        values = torch.cat([values, tokens[:, :, step - 1 : step]], dim=2)
        attn = torch.tensor(row, device=device).view(1, 1, 1, -1)
        sums = ops.update_scores(sums, attn, decay=1.0, input_scale=1.0)
        counts = torch.cat([counts + 1, torch.ones(1, 1, 1, device=device)], dim=2)
        if keys.shape[2] > m:
            keys, values, sums, counts = ops.weightedkv_evict(keys, values, sums, counts, 0, 1, evictions=1)
        if step == 5:
            assert keys[0, 0].argmax(-1).tolist() == [0, 2, 3, 4]  # k2 removed
            expected = torch.tensor([0, 1 / 6, 5 / 6, 0, 0, 0, 0, 0], device=device)
            torch.testing.assert_close(values[0, 0, 1], expected)  # v2/6 + 5 v3/6 in v3's slot
            torch.testing.assert_close(sums[0, 0], torch.tensor([2.0, 1.5, 0.8, 0.3], device=device))
            torch.testing.assert_close(counts[0, 0], torch.tensor([5.0, 3.0, 2.0, 1.0], device=device))

    assert keys[0, 0].argmax(-1).tolist() == [2, 5, 6, 7]  # k3, k6, k7, k8
    # The mixtures by hand, with the means of the steps above.
    c1 = Fraction(1, 3) / (Fraction(1, 3) + Fraction(17, 40))  # step 6: v1 (1/3) into v3 (0.425)
    v3 = [c1, (1 - c1) / 6, (1 - c1) * 5 / 6, 0, 0, 0, 0, 0]
    c4 = Fraction(275, 575)  # step 7: v4 (0.275) into v5 (0.3)
    c5 = Fraction(225, 525)  # step 8: v5' (0.225) into v6 (0.3)
    v6 = [0, 0, 0, c5 * c4, c5 * (1 - c4), 1 - c5, 0, 0]
    expected = torch.tensor([[float(x) for x in v3], [float(x) for x in v6]], device=device)
    torch.testing.assert_close(values[0, 0, :2], expected)
    assert torch.equal(values[0, 0, 2:], tokens[0, 0, 6:])  # v7, v8 untouched
    assert (values[0, 0, 0] > 0).sum() == 3 and (values[0, 0, 1] > 0).sum() == 3  # three values each


@pytest.mark.parametrize("device", DEVICES)
def test_ties_evict_the_lower_slot(device):
    """Equal means: argmin's first occurrence. Every step evicts the first middle slot into the next one."""
    keys, values, _, _ = make_inputs(1, 1, 12, torch.float32, device)
    sums, counts = torch.ones(1, 1, 12, device=device), torch.full((1, 1, 12), 2.0, device=device)
    out = evict_copies(keys, values, sums, counts, 2, 3, 5)
    assert torch.equal(out[0][0, 0], torch.cat([keys[0, 0, :2], keys[0, 0, 7:]]))
    # Equal weights: each step averages, so slot 7 ends up with v2/32 + v3/32 + v4/16 + v5/8 + v6/4 + v7/2.
    weights = torch.tensor([1 / 32, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2], device=device)
    torch.testing.assert_close(out[1][0, 0, 2], weights @ values[0, 0, 2:8])
    assert_matches(out, reference.weightedkv_evict(*to_cpu((keys, values, sums, counts)), 2, 3, 5), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_means_take_the_plain_mean(device):
    """ā_j + ā_{j+1} == 0: the plain mean, never NaN from 0/0."""
    values = torch.tensor([[1.0, -2.0], [3.0, 6.0], [5.0, 5.0]], device=device).view(1, 1, 3, 2)
    keys = values.clone()
    sums, counts = torch.zeros(1, 1, 3, device=device), torch.ones(1, 1, 3, device=device)
    _, out_values, _, _ = evict_copies(keys, values, sums, counts, 0, 1, 1)
    assert torch.equal(out_values[0, 0], torch.tensor([[2.0, 2.0], [5.0, 5.0]], device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_means_are_evicted_last(device, dtype):
    """NaN sums (or 0/0 means) read as +inf: those slots are evicted only when nothing finite is left; a merge with an
    infinite weight keeps that value alone. No crash, every index valid, and the op agrees with the reference."""
    keys, values, sums, counts = make_inputs(2, 3, 24, dtype, device, seed=11)
    sums[0, 0, [3, 7, 8]] = float("nan")
    sums[0, 1, 5], counts[0, 1, 5] = 0.0, 0.0  # 0/0
    counts[0, 2, 6] = 0.0  # x/0 = +inf
    sums[1, 0] = float("nan")  # a row of NaN only
    values[1, 1, :, 0] = float("nan")  # NaN values are merged, not crashed on
    values[1, 2, 4, 1] = float("inf")
    for evictions in (1, 8, 20):
        got = evict_copies(keys, values, sums, counts, 2, 2, evictions)
        expected = reference.weightedkv_evict(*to_cpu((keys, values, sums, counts)), 2, 2, evictions)
        assert_matches(got, expected, dtype)
        # the NaN row evicts the first middle slots; merging +inf with +inf weights is the plain mean: finite values
        assert torch.equal(got[0][1, 0], torch.cat([keys[1, 0, :2], keys[1, 0, 2 + evictions :]]))
        assert torch.isfinite(got[1][1, 0]).all()
    # with 8 evictions among 20 middle slots, the NaN slots of row (0, 0) survive
    kept = evict_copies(keys, values, sums, counts, 2, 2, 8)[2][0, 0]
    assert torch.isnan(kept).sum() == 3


@pytest.mark.parametrize("device", DEVICES)
def test_rows_not_contiguous_are_refused_and_contiguous_rows_copies_them(device):
    """The op updates (batch, kv head) rows in place, so each row must be contiguous: a (B, T, H, d) storage viewed as
    (B, H, T, d) is refused naming the op and the argument; ops.contiguous_rows gives it rows that are, and then the
    result is the contiguous inputs' (a value dim unlike the key dim)."""
    keys, values, sums, counts = make_inputs(2, 3, 20, torch.float32, device, key_dim=6, value_dim=10, seed=2)
    keys_t = keys.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(RuntimeError, match=r"kvcomp::weightedkv_evict: expected keys with contiguous \(batch, kv "
                       r"head\) rows in order"):
        torch.ops.kvcomp.weightedkv_evict(keys_t, values.clone(), sums.clone(), counts.clone(), 1, 2, 9)
    got = ops.weightedkv_evict(ops.contiguous_rows(keys_t), values.clone(), sums.clone(), counts.clone(), 1, 2, 9)
    assert_matches(got, reference.weightedkv_evict(keys, values, sums, counts, 1, 2, 9), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("evictions", [0, 1, 9])
def test_updated_in_place_in_strided_rows(device, evictions):
    """Rows at their own strides inside larger buffers (a PagedKVCache's view over its block pools) are updated where
    they lie: the results are views of the arguments' first T - e slots and equal the reference's, and nothing
    outside the rows is written."""
    inputs = make_inputs(2, 3, 20, torch.float32, device, key_dim=6, value_dim=10, seed=3)
    strided = [in_strided_rows(t) for t in inputs]
    got = ops.weightedkv_evict(*(view for _, view in strided), 1, 2, evictions)
    assert_matches(got, reference.weightedkv_evict(*to_cpu(inputs), 1, 2, evictions), torch.float32)
    for (buffer, view), result in zip(strided, got):
        assert result.data_ptr() == view.data_ptr() and result.stride() == view.stride()
        assert bool((outside(buffer, view) == 7.0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    inputs = make_inputs(0, 3, 10, torch.float16, device)
    out = evict_copies(*inputs, 2, 2, 4)
    assert [t.shape for t in out] == [(0, 3, 6, 16), (0, 3, 6, 16), (0, 3, 6), (0, 3, 6)]


@CUDA
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "total_len,sinks,recent,evictions",
    [(1025, 4, 508, 1), (4096, 4, 508, 3072), (3000, 0, 1, 2999), (2500, 4, 100, 1200), (700, 3, 2, 1)],
)
def test_cuda_matches_cpu_at_scale(dtype, total_len, sinks, recent, evictions):
    """Long rows (many tiles of the block loops, many runs per warp, long runs) and enough rows to fill the GPU: the
    CUDA op picks exactly the same slots as the CPU op (validated against the reference above)."""
    inputs = make_inputs(4, 9, total_len, dtype, "cuda", key_dim=128, value_dim=128, seed=total_len)
    got = evict_copies(*inputs, sinks, recent, evictions)
    expected = evict_copies(*to_cpu(inputs), sinks, recent, evictions)
    assert_matches(got, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", ["first_and_last", "tied_far_apart", "tied_neighbours"])
def test_decoding_step_over_long_rows(device, dtype, where):
    """One eviction from rows long enough that CUDA splits the middle over many blocks per row (batch 1: the pieces
    of kernels::launch::row_pieces): the smallest mean at the first or the last middle slot, or tied between slots
    far apart (different pieces) or adjacent; the lower tied slot goes, as torch.argmin's first occurrence."""
    total_len, sinks, recent = 40_000, 4, 8
    keys, values, sums, counts = make_inputs(1, 2, total_len, dtype, "cpu", key_dim=64, value_dim=64, seed=12)
    planted = {"first_and_last": [[sinks], [total_len - recent - 1]],
               "tied_far_apart": [[sinks + 1024, total_len - recent - 2], [7_000, 31_000]],
               "tied_neighbours": [[sinks + 1023, sinks + 1024], [20_000, 20_001]]}[where]
    for row, slots in enumerate(planted):
        sums[0, row, slots] = -counts[0, row, slots]  # mean exactly -1: below every other (non-negative) mean
    inputs = tuple(t.to(device) for t in (keys, values, sums, counts))
    got = evict_copies(*inputs, sinks, recent, 1)
    expected = reference.weightedkv_evict(keys, values, sums, counts, sinks, recent, 1)
    assert_matches(got, expected, dtype)
    for row, slots in enumerate(planted):  # the lowest planted slot went: its right neighbour now sits there
        assert torch.equal(got[0][0, row, slots[0]].cpu(), keys[0, row, slots[0] + 1])


@CUDA
@pytest.mark.parametrize("dtype,dim", [(torch.float32, 128), (torch.bfloat16, 128), (torch.bfloat16, 64),
                                       (torch.float16, 36)])
@pytest.mark.parametrize("merge_values", [True, False], ids=["merge", "evict-only"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "paged-view"])
def test_cuda_decoding_step_at_every_slot_across_tile_edges(dtype, dim, merge_values, strided):
    """One eviction in place at each of the slots 4 to 163, one row each, in rows of 257 slots (the 256 written are
    whole tiles). The CUDA shift cuts a row into tiles of 8 to 128 slots (as many as a block holds: 16-byte chunks,
    or elements where a slot is not whole chunks: d = 36 in float16, or a paged view's rows off alignment), so the
    evicted slot and its right neighbour fall on both sides of several tile edges, where a tile reads the next one's
    first slot from the copy taken before the shift."""
    sinks, recent, rows = 4, 8, 160
    keys, values, sums, counts = make_inputs(1, rows, 257, dtype, "cpu", key_dim=dim, value_dim=dim, seed=21)
    for row in range(rows):
        sums[0, row, sinks + row] = -counts[0, row, sinks + row]  # mean exactly -1: below every other mean
    expected = reference.weightedkv_evict(keys, values, sums, counts, sinks, recent, 1, merge_values)
    on_cuda = [t.cuda() for t in (keys, values, sums, counts)]
    got = (ops.weightedkv_evict(*(in_strided_rows(t)[1] for t in on_cuda), sinks, recent, 1, merge_values) if strided
           else evict_copies(*on_cuda, sinks, recent, 1, merge_values))
    assert_matches(got, expected, dtype)


@CUDA
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_monotone_means_make_one_long_run(dtype):
    """Increasing means: every middle slot is evicted into its right neighbour in one chain (one warp, one run of
    the whole middle); decreasing means: each evicted slot goes left to right into the next one."""
    for direction in (1, -1):
        keys, values, _, _ = make_inputs(2, 2, 2048, dtype, "cuda", key_dim=64, value_dim=64, seed=5)
        sums = torch.linspace(0.1, 2.0, 2048, device="cuda")
        sums = (sums if direction > 0 else sums.flip(0)).expand(2, 2, -1).contiguous()
        counts = torch.ones(2, 2, 2048, device="cuda")
        inputs = (keys, values, sums, counts)
        got = evict_copies(*inputs, 4, 4, 1500)
        assert_matches(got, evict_copies(*to_cpu(inputs), 4, 4, 1500), dtype)


@CUDA
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value_dim", [1, 5, 40, 136, 1030])
@pytest.mark.parametrize("evictions", [1, 40])
def test_cuda_unaligned_and_odd_dims(dtype, value_dim, evictions):
    """Element-wise copies where rows are not whole 16-byte chunks, or the storage starts off alignment; with 1030
    elements a slot off alignment, one decoding step's slot is wider than the in-place shift's tile and takes the
    out-of-place path."""
    keys, values, sums, counts = make_inputs(2, 3, 70, dtype, "cuda", key_dim=value_dim, value_dim=value_dim, seed=9)
    expected = evict_copies(*to_cpu((keys, values, sums, counts)), 2, 3, evictions)
    for offset in (0, 1):
        k = torch.empty(keys.numel() + offset, dtype=dtype, device="cuda")[offset:].view_as(keys).copy_(keys)
        got = ops.weightedkv_evict(k, values.clone(), sums.clone(), counts.clone(), 2, 3, evictions)
        assert_matches(got, expected, dtype)


@CUDA
def test_cuda_runs_on_the_current_stream_and_device():
    inputs = make_inputs(2, 3, 300, torch.bfloat16, "cuda", seed=4)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        got = evict_copies(*inputs, 4, 10, 200)
    stream.synchronize()
    assert_matches(got, evict_copies(*to_cpu(inputs), 4, 10, 200), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for dtype, evictions in ((torch.float32, 1), (torch.bfloat16, 6), (torch.float16, 0)):
        inputs = make_inputs(2, 3, 14, dtype, device)
        torch.library.opcheck(torch.ops.kvcomp.weightedkv_evict.default, (*inputs, 2, 3, evictions))


def test_compile_fullgraph():
    """Compiled, the in-place op updates the caller's cache as in eager mode."""
    def decode_step(keys, values, sums, counts):
        keys, values, sums, counts = ops.weightedkv_evict(keys, values, sums, counts, 2, 4, 1)
        return keys * 1.0, values + 0.0, sums / counts, counts

    compiled = torch.compile(decode_step, fullgraph=True)
    inputs = make_inputs(1, 2, 17, torch.float32, "cpu")
    copies = [t.clone() for t in inputs]
    for got, expected in zip(compiled(*inputs), decode_step(*copies)):
        torch.testing.assert_close(got, expected)
    for updated, expected in zip(inputs, copies):
        torch.testing.assert_close(updated, expected)


def test_compile_dynamic_length():
    def evict_half(keys, values, sums, counts):
        return ops.weightedkv_evict(keys, values, sums, counts, 1, 1, 6)

    compiled = torch.compile(evict_half, fullgraph=True, dynamic=True)
    for total_len in (20, 31):
        inputs = make_inputs(1, 2, total_len, torch.float32, "cpu", seed=total_len)
        copies = [t.clone() for t in inputs]
        for got, expected in zip(compiled(*inputs), evict_half(*copies)):
            torch.testing.assert_close(got, expected)


BAD_INPUTS = [  # (make args from (keys, values, sums, counts), message)
    (lambda k, v, s, n: (k[0], v, s, n, 1, 1, 1), r"expected keys of shape \(B, H, T, d\), got a 3-d tensor"),
    (lambda k, v, s, n: (k, v[..., 0], s, n, 1, 1, 1), r"expected values of shape \(B, H, T, d\), got a 3-d tensor"),
    (lambda k, v, s, n: (k, v, s[0], n, 1, 1, 1), r"expected sums of shape \(B, H, T\), got a 2-d tensor"),
    (lambda k, v, s, n: (k, v, s, n[..., None], 1, 1, 1), r"expected counts of shape \(B, H, T\), got a 4-d tensor"),
    (lambda k, v, s, n: (k.int(), v, s, n, 1, 1, 1), r"expected keys of dtype float32, float16 or bfloat16, got Int"),
    (lambda k, v, s, n: (k, v.half(), s, n, 1, 1, 1), r"expected values of the dtype of keys \(Float\), got Half"),
    (lambda k, v, s, n: (k, v, s.double(), n, 1, 1, 1), r"expected sums of dtype Float, got Double"),
    (lambda k, v, s, n: (k, v, s, n.long(), 1, 1, 1), r"expected counts of dtype Float, got Long"),
    (lambda k, v, s, n: (k, v[:1], s, n, 1, 1, 1), r"expected values.size\(0\) == 2 \(batch of keys\)"),
    (lambda k, v, s, n: (k, v[:, :2], s, n, 1, 1, 1), r"expected values.size\(1\) == 3 \(kv heads of keys\)"),
    (lambda k, v, s, n: (k, v[:, :, :-1], s, n, 1, 1, 1), r"expected values.size\(2\) == 10 \(slots of keys\)"),
    (lambda k, v, s, n: (k, v, s[:, :, 1:], n, 1, 1, 1), r"expected sums.size\(2\) == 10 \(slots of keys\)"),
    (lambda k, v, s, n: (k, v, s, n[:, :1], 1, 1, 1), r"expected counts.size\(1\) == 3 \(kv heads of keys\)"),
    (lambda k, v, s, n: (k, v, s, n, -1, 1, 1), r"expected sinks >= 0, got sinks = -1"),
    (lambda k, v, s, n: (k, v, s, n, 1, 0, 1),
     r"expected recent >= 1 \(the last middle slot needs a right neighbour\), got recent = 0"),
    (lambda k, v, s, n: (k, v, s, n, 1, 1, -2), r"expected evictions >= 0, got evictions = -2"),
    (lambda k, v, s, n: (k, v, s, n, 4, 3, 4), r"expected evictions <= T - sinks - recent \(enough middle slots to "
     r"evict\), got evictions = 4, T = 10, sinks = 4, recent = 3"),
    (lambda k, v, s, n: (k, v, s, n, 11, 1, 0),
     r"expected evictions <= T - sinks - recent .*, got evictions = 0, T = 10, sinks = 11, recent = 1"),
    (lambda k, v, s, n: (k, v, s, n, 0, 2**62, 1),
     r"expected evictions <= T - sinks - recent .*, got evictions = 1, T = 10, sinks = 0, "
     r"recent = 4611686018427387904"),
]


@pytest.mark.parametrize("make_args,message", BAD_INPUTS)
def test_bad_input_names_op_and_value(make_args, message):
    inputs = make_inputs(2, 3, 10, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"kvcomp::weightedkv_evict: " + message):
        torch.ops.kvcomp.weightedkv_evict(*make_args(*inputs))


@CUDA
@pytest.mark.parametrize("make_args,message", BAD_INPUTS)
def test_bad_input_names_op_and_value_on_cuda(make_args, message):
    inputs = make_inputs(2, 3, 10, torch.float32, "cuda")
    with pytest.raises(RuntimeError, match=r"kvcomp::weightedkv_evict: " + message):
        torch.ops.kvcomp.weightedkv_evict(*make_args(*inputs))


@CUDA
@pytest.mark.parametrize("which", range(4))
def test_mixed_devices_rejected(which):
    """Any CUDA tensor sends the call to the CUDA kernel, whose shared check finds the odd one out."""
    inputs = list(make_inputs(1, 2, 10, torch.float32, "cuda"))
    inputs[which] = inputs[which].cpu()
    odd_one = ["values", "values", "sums", "counts"][which]  # keys on CPU: values are not on keys' device
    with pytest.raises(RuntimeError, match=rf"kvcomp::weightedkv_evict: expected {odd_one} on the device of keys"):
        torch.ops.kvcomp.weightedkv_evict(*inputs, 1, 1, 1)
