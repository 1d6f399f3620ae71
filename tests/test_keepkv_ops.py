"""kvcomp::keepkv_match and kvcomp::keepkv_zip_merge against their plain-PyTorch references, KeepKV's theorem 3
(attention of the scoring query is unchanged by a ZIP merge), attention sag of convex merging (theorem 2), vote
conservation, the ZIP guard, NaN / inf / zero votes, opcheck, torch.compile and bad input."""

import math

import pytest
import torch

from kvpress_cpp import ops
from tests import reference

pytestmark = pytest.mark.independent_of_transformers

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def tolerances(dtype):
    return {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


def keep_pattern(name, batch, heads, slots, generator):
    if name == "random":
        keep = torch.rand(batch, heads, slots, generator=generator) < 0.4
        keep[..., 0] = True
        return keep
    if name == "one_evicted":  # a decoding step: the newest slot is evicted
        keep = torch.ones(batch, heads, slots, dtype=torch.bool)
        keep[..., -1] = False
        return keep
    if name == "many_evicted":  # prefill-like: more than the direct path's 8 evicted slots per row
        keep = torch.zeros(batch, heads, slots, dtype=torch.bool)
        keep[..., ::4] = True
        return keep
    if name == "none_retained":
        return torch.zeros(batch, heads, slots, dtype=torch.bool)
    if name == "all_retained":
        return torch.ones(batch, heads, slots, dtype=torch.bool)
    if name == "mixed_rows":  # one row keeps nothing, one keeps everything, the others random
        keep = torch.rand(batch, heads, slots, generator=generator) < 0.5
        keep[0, 0] = False
        keep[-1, -1] = True
        return keep
    raise ValueError(name)


KEEP_PATTERNS = ["random", "one_evicted", "many_evicted", "none_retained", "all_retained", "mixed_rows"]


def correlated_keys(batch, heads, slots, head_dim, generator):
    """Keys around a few directions, so that cosines spread over [-1, 1] and thresholds like 0.8 matter."""
    centres = torch.randn(batch, heads, 3, head_dim, generator=generator)
    which = torch.randint(0, 3, (batch, heads, slots), generator=generator)
    base = centres.gather(2, which[..., None].expand(-1, -1, -1, head_dim))
    return base + 0.4 * torch.randn(batch, heads, slots, head_dim, generator=generator)


# ----------------------------------------------------------------------------------------------------------------
# keepkv_match


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", KEEP_PATTERNS)
@pytest.mark.parametrize("threshold", [0.8, -1.0, 1.0])
@pytest.mark.parametrize("heads", [2, 3])
def test_match_matches_reference(device, dtype, pattern, threshold, heads):
    generator = torch.Generator().manual_seed(0)
    keys = correlated_keys(2, heads, 40, 16, generator).to(dtype)
    keep = keep_pattern(pattern, 2, heads, 40, generator)
    got = ops.keepkv_match(keys.to(device), keep.to(device), threshold)
    expected = reference.keepkv_match(keys, keep, threshold)
    assert got.dtype == torch.int64 and got.shape == keep.shape and got.device.type == device
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("evicted", [1, 8, 9, 300])  # both sides of the direct / GEMM switch
def test_match_large_rows(device, evicted):
    generator = torch.Generator().manual_seed(1)
    slots = 600
    keys = correlated_keys(2, 2, slots, 72, generator)
    keep = torch.ones(2, 2, slots, dtype=torch.bool)
    keep[..., torch.randperm(slots, generator=generator)[:evicted]] = False
    got = ops.keepkv_match(keys.to(device), keep.to(device), 0.5).cpu()
    expected = reference.keepkv_match_vectorised(keys.double(), keep, 0.5)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("evicted", [1, 2, 8])
@pytest.mark.parametrize("head_dim", [5, 20, 67])
def test_match_direct_path_at_any_width(device, dtype, evicted, head_dim):
    """The direct path (at most 8 evicted slots: a decoding step) reduces its keys a vector width (8 or 16) at a
    time: head sizes that are not a multiple of a vector, and retained counts that leave a partial group, match the
    reference exactly."""
    generator = torch.Generator().manual_seed(11)
    slots = 37
    keys = correlated_keys(2, 3, slots, head_dim, generator).to(dtype)
    keep = torch.ones(2, 3, slots, dtype=torch.bool)
    keep[..., torch.randperm(slots, generator=generator)[:evicted]] = False
    got = ops.keepkv_match(keys.to(device), keep.to(device), 0.5).cpu()
    expected = reference.keepkv_match(keys, keep, 0.5)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert bool((got >= 0).any()), "no slot merged: the threshold never mattered"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("evicted", [1, 3])
def test_match_decoding_step_over_long_rows(device, evicted):
    """Direct path over rows long enough that CUDA splits the retained slots over many blocks per evicted slot
    (kernels::launch::row_pieces) and combines their best candidates: the best match in the first or the last slot,
    or tied exactly (power-of-two scales of one direction) between far-apart slots, where the lower slot wins."""
    generator = torch.Generator().manual_seed(8)
    slots = 6000
    keys = correlated_keys(1, 2, slots, 64, generator)
    keep = torch.ones(1, 2, slots, dtype=torch.bool)
    evicted_slots = torch.arange(evicted) * 1500 + 700
    keep[..., evicted_slots] = False
    for e, (row, first, second) in zip(evicted_slots.tolist(), [(0, 0, 5999), (1, 513, 4100), (0, 2047, 2048)]):
        keys[0, row, first] = keys[0, row, e] * 4.0  # exact copies of e's direction: cosine 1, a tie
        keys[0, row, second] = keys[0, row, e] * 0.5
    got = ops.keepkv_match(keys.to(device), keep.to(device), 0.5, max_evicted=evicted).cpu()
    expected = reference.keepkv_match_vectorised(keys.double(), keep, 0.5)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got[0, 0, 700] == 0
    if evicted > 1:
        assert got[0, 1, 2200] == 513 and got[0, 0, 3700] == 2047


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("evicted,bound", [(1, 1), (5, 1), (9, 8), (300, 0)])
def test_match_with_a_bound_on_evicted_slots(device, evicted, bound):
    """max_evicted only spares CUDA's host sync (a decoding step passes its new tokens): a row evicting more than the
    bound is still matched in full."""
    generator = torch.Generator().manual_seed(4)
    slots = 400
    keys = correlated_keys(2, 2, slots, 64, generator)
    keep = torch.ones(2, 2, slots, dtype=torch.bool)
    keep[..., torch.randperm(slots, generator=generator)[:evicted]] = False
    got = ops.keepkv_match(keys.to(device), keep.to(device), 0.5, max_evicted=bound).cpu()
    expected = reference.keepkv_match_vectorised(keys.double(), keep, 0.5)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"kvcomp::keepkv_match: expected max_evicted >= 0, got -1"):
        ops.keepkv_match(keys.to(device), keep.to(device), 0.5, max_evicted=-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("many", [False, True])
def test_match_zero_norm_nan_and_ties(device, many):
    keys = torch.randn(1, 1, 24, 8, generator=torch.Generator().manual_seed(2))
    keep = torch.zeros(1, 1, 24, dtype=torch.bool)
    keep[..., 12:] = True
    if not many:
        keep[..., 3:12] = True  # evicted: 0, 1, 2 only (direct path)
    keys[0, 0, 0] = 0.0  # zero key: similarity 0 with every retained slot -> the lowest retained slot at threshold 0
    keys[0, 0, 1] = float("nan")  # NaN similarities count as -inf: no target even at threshold -1
    keys[0, 0, 14] = keys[0, 0, 2] * 2.0  # same direction twice (power-of-two scales: exact cosines): a tie,
    keys[0, 0, 20] = keys[0, 0, 2] * 4.0  # the lower slot wins
    lowest_retained = 12 if many else 3
    got = ops.keepkv_match(keys.to(device), keep.to(device), -1.0).cpu()
    assert got[0, 0, 0] == lowest_retained and got[0, 0, 1] == -2 and got[0, 0, 2] == 14
    keys[0, 0, 13] = 0.0  # a retained zero key: the NaN key is matched with it on neither path (it once was on one)
    got = ops.keepkv_match(keys.to(device), keep.to(device), -1.0).cpu()
    assert got[0, 0, 1] == -2
    got = ops.keepkv_match(keys.to(device), keep.to(device), 0.0).cpu()
    assert got[0, 0, 0] == lowest_retained and got[0, 0, 1] == -2
    keys[0, 0][keep[0, 0]] = 0.0  # every retained key zero: similarity 0 for all of them
    got = ops.keepkv_match(keys.to(device), keep.to(device), 0.1).cpu()
    assert (got[0, 0, :12][~keep[0, 0, :12]] == -2).all() and (got[0, 0, 12:] == -1).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("many", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_key_is_matched_with_nothing_on_both_paths(device, many, dtype, bad):
    """A key with one NaN or infinite component, evicted or retained, has no similarity with any key, zero keys
    included (whose similarity with finite keys is 0), whichever path the number of evicted slots takes."""
    generator = torch.Generator().manual_seed(8)
    keys = torch.randn(1, 2, 24, 8, generator=generator)
    keep = keep_pattern("many_evicted" if many else "one_evicted", 1, 2, 24, generator)
    evicted, retained = (~keep[0, 0]).nonzero().flatten(), keep[0, 0].nonzero().flatten()
    keys[0, :, retained[0]] = 0.0
    keys[0, 0, evicted[0], 3] = bad
    keys[0, 1, retained[1], 5] = bad
    keys = keys.to(dtype)
    got = ops.keepkv_match(keys.to(device), keep.to(device), -1.0).cpu()
    torch.testing.assert_close(got, reference.keepkv_match(keys, keep, -1.0), rtol=0, atol=0)
    assert got[0, 0, evicted[0]] == -2 and (got[0, 1][~keep[0, 1]] != retained[1]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("many", [False, True])
@pytest.mark.parametrize("scale", [3e19, 1e30, 1e-25, 1e-38])
def test_match_extreme_magnitudes(device, many, scale):
    """Cosines do not depend on the keys' scale: float32 squares overflow beyond ~1.8e19 and underflow below ~1e-19,
    so keys are rescaled before squaring, on both paths."""
    generator = torch.Generator().manual_seed(5)
    keys = correlated_keys(2, 2, 24, 16, generator)
    keep = keep_pattern("many_evicted" if many else "one_evicted", 2, 2, 24, generator)
    expected = reference.keepkv_match(keys, keep, 0.5)
    assert (ops.keepkv_match(keys.to(device), keep.to(device), 0.5).cpu() == expected).all()
    assert (ops.keepkv_match((keys * scale).to(device), keep.to(device), 0.5).cpu() == expected).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("many", [False, True])
def test_match_threshold_one_and_ties_alike_on_both_paths(device, many):
    """Cosines are rounded to 2^-16: an evicted key equal to a retained one (cosine 1 up to float32 rounding, which
    differs by path) merges at threshold 1.0, and retained keys of one direction but different lengths tie, the lower
    slot winning."""
    generator = torch.Generator().manual_seed(6)
    keys = torch.randn(1, 3, 24, 64, generator=generator) * 7.3
    keep = keep_pattern("many_evicted" if many else "one_evicted", 1, 3, 24, generator)
    evicted = (~keep[0, 0]).nonzero().flatten()
    retained = keep[0, 0].nonzero().flatten()
    for row in range(3):
        for e in evicted:
            keys[0, row, e] = keys[0, row, retained[-1]]  # an exact copy of the last retained key
        keys[0, row, retained[1]] = keys[0, row, retained[-1]] * 0.3  # same direction, not a power-of-two scale
    got = ops.keepkv_match(keys.to(device), keep.to(device), 1.0).cpu()
    assert (got[0][:, evicted] == retained[1]).all()
    assert (got == reference.keepkv_match(keys, keep, 1.0)).all()


@pytest.mark.parametrize("device", DEVICES)
def test_match_inf_keys_do_not_crash(device):
    keys = torch.randn(2, 2, 16, 8)
    keys[0, 0, 3, 2] = float("inf")
    keys[1, 1, :, 0] = float("-inf")
    keep = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(3)) < 0.5
    got = ops.keepkv_match(keys.to(device), keep.to(device), -1.0).cpu()
    assert ((got == -1) == keep).all() and (got >= -2).all() and (got < 16).all()
    retained_target = keep.gather(2, got.clamp_min(0))
    assert retained_target[got >= 0].all()


# ----------------------------------------------------------------------------------------------------------------
# keepkv_zip_merge against the reference


def merge_inputs(batch, heads, slots, head_dim, dtype, seed=0, pattern="random"):
    generator = torch.Generator().manual_seed(seed)
    keys = correlated_keys(batch, heads, slots, head_dim, generator)
    values = torch.randn(batch, heads, slots, head_dim, generator=generator)
    votes = 0.5 + 2.5 * torch.rand(batch, heads, slots, generator=generator)
    log_scores = 1.0 + 4.0 * torch.rand(batch, heads, slots, generator=generator)
    keep = keep_pattern(pattern, batch, heads, slots, generator)
    targets = reference.keepkv_match(keys, keep, 0.3)
    return keys.to(dtype), values.to(dtype), votes, log_scores, targets


def assert_merge_close(got, expected, dtype):
    for name, a, b in zip(("keys", "values", "votes"), got, expected):
        tol = tolerances(dtype) if name != "votes" else {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(a.cpu(), b, equal_nan=True, msg=lambda m, name=name: f"{name}: {m}", **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", KEEP_PATTERNS)
@pytest.mark.parametrize("convex", [False, True])
@pytest.mark.parametrize("heads", [2, 3])
def test_zip_merge_matches_reference(device, dtype, pattern, convex, heads):
    inputs = merge_inputs(2, heads, 30, 16, dtype, pattern=pattern)
    got = ops.keepkv_zip_merge(*(t.to(device) for t in inputs), convex)
    assert [t.dtype for t in got] == [dtype, dtype, torch.float32] and all(t.device.type == device for t in got)
    assert_merge_close(got, reference.keepkv_zip_merge(*inputs, convex), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("convex", [False, True])
def test_zip_merge_vectorised_baseline_matches_reference(device, convex):
    inputs = merge_inputs(2, 3, 30, 16, torch.float32, seed=4)
    got = reference.keepkv_zip_merge_vectorised(*(t.to(device) for t in inputs), convex)
    assert_merge_close(got, reference.keepkv_zip_merge(*inputs, convex), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_zip_merge_vectorised_baseline_bounds_the_key_growth(device):
    """A pair whose ZIP key would grow past KEEPKV_MAX_KEY_GROWTH times the convex one (scores of opposite signs,
    the numerator and the weighted log of one sign): the reference falls back to the convex key, as the kernel does,
    and the baseline the benchmark times must too."""
    generator = torch.Generator().manual_seed(6)
    keys, values = torch.randn(2, 1, 1, 2, 8, generator=generator)
    log_scores = torch.tensor([[[0.5, -0.6]]])
    votes, targets = torch.ones(1, 1, 2), torch.tensor([[[-1, 0]]])
    inputs = (keys, values, votes, log_scores, targets)
    assert not reference.keepkv_zip_coefficients(log_scores[0, 0].double(), votes[0, 0].double(), False)[3]
    got = reference.keepkv_zip_merge_vectorised(*(t.to(device) for t in inputs))
    assert_merge_close(got, reference.keepkv_zip_merge(*inputs), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_zip_merge_large_sets_and_head_dim(device):
    """A set with more members than the CUDA block's 256 threads, d above the block size."""
    slots, head_dim = 700, 300
    generator = torch.Generator().manual_seed(5)
    keys = torch.randn(1, 2, slots, head_dim, generator=generator)
    values = torch.randn(1, 2, slots, head_dim, generator=generator)
    votes = 1.0 + torch.rand(1, 2, slots, generator=generator)
    log_scores = 1.0 + torch.rand(1, 2, slots, generator=generator)
    targets = torch.full((1, 2, slots), -1)
    targets[0, 0, 1:600] = 0  # 599 members into slot 0
    targets[0, 1, 100:400] = torch.randint(400, slots, (300,), generator=generator)
    inputs = (keys, values, votes, log_scores, targets)
    for convex in (False, True):
        got = ops.keepkv_zip_merge(*(t.to(device) for t in inputs), convex)
        assert_merge_close(got, reference.keepkv_zip_merge(*inputs, convex), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_zip_merge_untouched_slots_are_bit_exact(device):
    keys, values, votes, log_scores, targets = merge_inputs(2, 2, 30, 16, torch.bfloat16, seed=6)
    out_k, out_v, out_p = ops.keepkv_zip_merge(*(t.to(device) for t in (keys, values, votes, log_scores, targets)))
    merged_into = torch.zeros_like(targets).scatter_add_(2, targets.clamp_min(0), (targets >= 0).long()) > 0
    untouched = ~merged_into
    assert torch.equal(out_k.cpu()[untouched], keys[untouched]) and torch.equal(out_v.cpu()[untouched], values[untouched])
    assert torch.equal(out_p.cpu()[untouched], votes[untouched])


# ----------------------------------------------------------------------------------------------------------------
# theorem 3, attention sag, votes


def theorem_setup(batch, kv_heads, group, slots, head_dim, dtype, seed, targets, query_in_group=0):
    """Keys whose logits for one query head per kv head (head h * G + query_in_group) lie in [1, 5]; ℓ is exactly
    q·k·scale of the stored keys (float64, rounded to float32 for the float32 op)."""
    generator = torch.Generator().manual_seed(seed)
    scale = 1.0 / math.sqrt(head_dim)
    query = torch.randn(batch, kv_heads * group, 1, head_dim, generator=generator, dtype=torch.float64)
    query = query.to(dtype).double()  # ℓ from the query the attention will use
    q = query[:, query_in_group::group, 0]  # (B, H, d): the scoring query head of each kv head
    noise = torch.randn(batch, kv_heads, slots, head_dim, generator=generator, dtype=torch.float64)
    noise -= (noise @ q[..., None]) / (q * q).sum(-1)[..., None, None] * q[:, :, None]  # orthogonal to q
    logit = 1.0 + 4.0 * torch.rand(batch, kv_heads, slots, generator=generator, dtype=torch.float64)
    keys = (noise + (logit / (scale * (q * q).sum(-1)[..., None]))[..., None] * q[:, :, None]).to(dtype)
    values = torch.randn(batch, kv_heads, slots, head_dim, generator=generator, dtype=torch.float64).to(dtype)
    votes = (0.5 + 2.5 * torch.rand(batch, kv_heads, slots, generator=generator)).to(torch.float64)
    votes = votes.to(torch.float32).to(dtype if dtype == torch.float64 else torch.float32)
    log_scores = scale * (keys.double() @ q[..., None]).squeeze(-1)
    log_scores = log_scores.to(torch.float64 if dtype == torch.float64 else torch.float32)
    return query.to(dtype), keys, values, votes, log_scores, targets.expand(batch, kv_heads, slots).clone(), scale


def attention(query, keys, values, votes, scale):
    """float64 softmax(q·k·scale + ln p)·v with votes 0 for dropped slots: (B, Hq, 1, d) and probs (B, Hq, 1, T)."""
    votes = votes.double()
    bias = torch.where(votes > 0, votes.log(), float("-inf"))  # ln p in float64 (merge_count_bias is float32)
    out, probs = reference.decode_attention(query.double(), keys.double(), values.double(), bias, scale)
    return out.double(), probs


TARGET_CASES = {  # slots 0..11
    "single": [-1, -1, 0, -1, -1, -1, -1, -1, -1, -1, -1, -1],
    "set": [-1, 0, 0, 0, -1, 0, -1, -1, -1, -1, -1, -1],
    "several": [-1, 0, -1, 2, 2, -1, 5, 0, -2, -1, 9, 9],
    "all_into_last": [11] * 11 + [-1],
}


def dropped_votes(votes, targets):
    """votes with every non-retained slot dropped (the compacted cache, by bias -inf) ..."""
    return torch.where(targets == -1, votes, 0)


@pytest.mark.parametrize("case", list(TARGET_CASES))
@pytest.mark.parametrize("group", [1, 4])
def test_theorem3_float64_reference(case, group):
    targets = torch.tensor(TARGET_CASES[case])
    query, keys, values, votes, log_scores, targets, scale = theorem_setup(2, 2, group, 12, 16, torch.float64, 0,
                                                                           targets, query_in_group=group - 1)
    out_k, out_v, out_p = reference.keepkv_zip_merge(keys, values, votes, log_scores, targets)
    head = slice(group - 1, None, group)
    after, _ = attention(query, out_k, out_v, dropped_votes(out_p, targets), scale)
    before, _ = attention(query, keys, values, torch.where(targets == -2, 0, votes), scale)
    torch.testing.assert_close(after[:, head], before[:, head], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(TARGET_CASES))
@pytest.mark.parametrize("group", [1, 4])
def test_theorem3_float32_op(device, case, group):
    """Over the merged-and-compacted cache the scoring query's output equals the one over the unmerged cache (minus
    the slots evicted without merge); other query heads of a group generally differ."""
    targets = torch.tensor(TARGET_CASES[case])
    query, keys, values, votes, log_scores, targets, scale = theorem_setup(2, 3, group, 12, 32, torch.float32, 1,
                                                                           targets, query_in_group=group - 1)
    out_k, out_v, out_p = ops.keepkv_zip_merge(*(t.to(device) for t in (keys, values, votes, log_scores, targets)))
    out_k, out_v, out_p = out_k.cpu(), out_v.cpu(), out_p.cpu()
    head = slice(group - 1, None, group)
    after, after_probs = attention(query, out_k, out_v, dropped_votes(out_p, targets), scale)
    before, before_probs = attention(query, keys, values, torch.where(targets == -2, 0, votes), scale)
    torch.testing.assert_close(after[:, head], before[:, head], rtol=1e-4, atol=1e-4)
    # the merged slot's probability is the sum of the probabilities of its set
    group_of = torch.where(targets >= 0, targets, torch.arange(12))
    summed = torch.zeros_like(before_probs).scatter_add_(-1, group_of.repeat_interleave(group, 1)[:, :, None],
                                                         before_probs)
    torch.testing.assert_close(after_probs[:, head], summed[:, head], rtol=1e-4, atol=1e-5)
    # the same through the library's float32 decode attention
    got, _ = ops.decode_attention(query.to(device), out_k.to(device), out_v.to(device),
                                  ops.merge_count_bias(dropped_votes(out_p, targets).to(device), 1.0), scale)
    torch.testing.assert_close(got.cpu()[:, head].double(), before[:, head], rtol=1e-4, atol=1e-4)


def masses(query, keys, votes, scale):
    """Unnormalised attention masses p·exp(q·k·scale) of every slot, float64: (B, H, T) for MHA."""
    return votes.double() * torch.exp(scale * (keys.double() @ query.double()[:, :, 0, :, None]).squeeze(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_convex_merge_attention_sag_and_jensen(device):
    """Theorem 2 (attention sag): a convex merge whose merged pair counts once (vote 1, as in the convex-merging
    methods the paper criticises) gets less attention mass than the sum of the slots it replaced. With electoral
    votes (p_r = Σ p) the convex key errs the other way, p_r exp(Σ w ℓ / Σ w) >= Σ p s (Jensen on x ln x); the ZIP
    key is exact (theorem 3)."""
    targets = torch.tensor(TARGET_CASES["several"])
    query, keys, values, votes, log_scores, targets, scale = theorem_setup(2, 2, 1, 12, 32, torch.float32, 2,
                                                                           targets)
    merged_slots = [0, 2, 5, 9]
    group_of = torch.where(targets >= 0, targets, torch.arange(12))

    def replaced(vote_input):
        before = masses(query, keys, torch.where(targets == -2, 0, vote_input), scale)
        return torch.zeros_like(before).scatter_add_(-1, group_of, before)[..., merged_slots]

    ones = torch.ones_like(votes)
    out_k = ops.keepkv_zip_merge(*(t.to(device) for t in (keys, values, ones, log_scores, targets)), True)[0].cpu()
    sag = masses(query, out_k, ones, scale)[..., merged_slots]
    assert (sag < replaced(ones)).all()
    out_k, _, out_p = (t.cpu() for t in ops.keepkv_zip_merge(
        *(t.to(device) for t in (keys, values, votes, log_scores, targets)), True))
    assert (masses(query, out_k, out_p, scale)[..., merged_slots] > replaced(votes)).all()
    out_k, _, out_p = (t.cpu() for t in ops.keepkv_zip_merge(
        *(t.to(device) for t in (keys, values, votes, log_scores, targets)), False))
    torch.testing.assert_close(masses(query, out_k, out_p, scale)[..., merged_slots], replaced(votes),
                               rtol=1e-4, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pattern", ["random", "many_evicted", "mixed_rows"])
@pytest.mark.parametrize("convex", [False, True])
def test_votes_are_conserved(device, pattern, convex):
    keys, values, votes, log_scores, _ = merge_inputs(2, 3, 40, 8, torch.float32, seed=7, pattern=pattern)
    keep = keep_pattern(pattern, 2, 3, 40, torch.Generator().manual_seed(8))
    targets = ops.keepkv_match(keys.to(device), keep.to(device), 0.5)
    _, _, out_p = ops.keepkv_zip_merge(keys.to(device), values.to(device), votes.to(device), log_scores.to(device),
                                       targets, convex)
    targets, out_p = targets.cpu(), out_p.cpu()
    kept = torch.where(targets == -1, out_p, 0).sum(-1)
    expected = votes.sum(-1) - torch.where(targets == -2, votes, 0).sum(-1)
    torch.testing.assert_close(kept, expected, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# the guard, NaN / inf / zero votes


@pytest.mark.parametrize("device", DEVICES)
def test_guard_falls_back_to_the_convex_key(device):
    """ℓ = (+1, -1) with equal w: Σ w ℓ = 0 (near-zero denominator) -> convex key; ℓ = (-0.2, -0.1) with votes 1:
    Σ w ℓ < 0 but m + ln(Σ w / Σ p) ... > 0? (checked below) -> sign test; ℓ = (2, 3): the ZIP key."""
    keys = torch.randn(1, 3, 2, 8, generator=torch.Generator().manual_seed(9))
    values = torch.randn(1, 3, 2, 8)
    votes = torch.tensor([[[math.e ** 2, 1.0], [1.0, 1.0], [1.0, 2.0]]])  # p s = e^2 e^-1 = e and 1 e^1: equal
    log_scores = torch.tensor([[[-1.0, 1.0], [-1.0, 1.0], [2.0, 3.0]]])
    targets = torch.tensor([[[-1, 0], [-1, 0], [-1, 0]]])
    out_k, _, _ = ops.keepkv_zip_merge(*(t.to(device) for t in (keys, values, votes, log_scores, targets)))
    out_k = out_k.cpu()
    convex_k, _, _ = ops.keepkv_zip_merge(*(t.to(device) for t in (keys, values, votes, log_scores, targets)), True)
    convex_k = convex_k.cpu()
    # head 0: equal weights, ℓ = ±1: Σ w ℓ = 0 -> the convex key (the mean of the two keys)
    torch.testing.assert_close(out_k[0, 0, 0], keys[0, 0].mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_k[0, 0, 0], convex_k[0, 0, 0])
    # head 1: votes 1, ℓ = ±1: Σ w ℓ = e - 1/e > 0 but ln((e + 1/e)/2) > 0 too: ZIP (same sign), not convex
    w = torch.tensor([math.exp(-1), math.exp(1)])
    zip_key = (w[:, None] * keys[0, 1].double()).sum(0) * math.log(w.sum() / 2) / float((w * torch.tensor([-1.0, 1.0])).sum())
    torch.testing.assert_close(out_k[0, 1, 0].double(), zip_key, rtol=1e-5, atol=1e-6)
    # head 2: all positive, the ZIP key differs from the convex one
    assert not torch.allclose(out_k[0, 2, 0], convex_k[0, 2, 0])


@pytest.mark.parametrize("device", DEVICES)
def test_guard_sign_mismatch(device):
    """Σ w ℓ > 0 while m + ln(Σ w / Σ p) < 0 (mean score below 1, its s-weighted mean log above 0): ℓ = (1, -0.5),
    p = (1, 6): Σ p s ℓ = e - 3 e^-0.5 ≈ 0.90 > 0, ln((e + 6 e^-0.5) / 7) ≈ -0.10 < 0 -> the convex key."""
    keys = torch.randn(1, 1, 2, 8, generator=torch.Generator().manual_seed(10))
    values = torch.randn(1, 1, 2, 8)
    votes = torch.tensor([[[1.0, 6.0]]])
    log_scores = torch.tensor([[[1.0, -0.5]]])
    assert math.log((math.e + 6 * math.exp(-0.5)) / 7) < 0 < math.e - 3 * math.exp(-0.5)
    targets = torch.tensor([[[-1, 0]]])
    inputs = [t.to(device) for t in (keys, values, votes, log_scores, targets)]
    out_k = ops.keepkv_zip_merge(*inputs)[0].cpu()
    convex_k = ops.keepkv_zip_merge(*inputs, True)[0].cpu()
    torch.testing.assert_close(out_k, convex_k)
    torch.testing.assert_close(out_k, reference.keepkv_zip_merge(keys, values, votes, log_scores, targets)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_nan_inf_and_zero_votes_do_not_crash(device):
    keys, values, votes, log_scores, _ = merge_inputs(2, 2, 12, 8, torch.float32, seed=11)
    targets = torch.tensor([-1, 0, 0, -1, 3, 3, -1, 6, -1, 8, 8, -2]).expand(2, 2, 12).clone()
    votes[0, 0, [0, 1, 2]] = 0.0  # a whole set with zero votes: c unchanged, vote 0
    log_scores[0, 1, [3, 4, 5]] = float("-inf")  # all w = 0: c unchanged, votes add
    log_scores[1, 0, 7] = float("nan")  # a NaN member: w = 0, the rest merge
    log_scores[1, 1, 9] = float("inf")  # +inf: Σ w NaN -> c unchanged
    votes[1, 1, 6] = float("nan")
    keys[1, 1, 10] = float("nan")
    inputs = [t.to(device) for t in (keys, values, votes, log_scores, targets)]
    for convex in (False, True):
        out_k, out_v, out_p = (t.cpu() for t in ops.keepkv_zip_merge(*inputs, convex))
        expected = reference.keepkv_zip_merge(keys, values, votes, log_scores, targets, convex)
        assert_merge_close((out_k, out_v, out_p), expected, torch.float32)
        assert torch.equal(out_k[0, 0, 0], keys[0, 0, 0]) and out_p[0, 0, 0] == 0
        assert torch.equal(out_k[0, 1, 3], keys[0, 1, 3])
        assert out_p[0, 1, 3].item() == pytest.approx(votes[0, 1, 3:6].sum().item(), rel=1e-6)
        assert torch.isfinite(out_k[1, 0, 6]).all()
        assert torch.equal(out_k[1, 1, 8], keys[1, 1, 8])


# ----------------------------------------------------------------------------------------------------------------
# dispatcher, opcheck, torch.compile


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for dtype, pattern in ((torch.float32, "random"), (torch.bfloat16, "many_evicted"), (torch.float16, "one_evicted")):
        keys, values, votes, log_scores, targets = (t.to(device) for t in merge_inputs(2, 3, 20, 8, dtype,
                                                                                        pattern=pattern))
        keep = targets == -1
        torch.library.opcheck(torch.ops.kvcomp.keepkv_match.default, (keys, keep, 0.8))
        for convex in (False, True):
            torch.library.opcheck(torch.ops.kvcomp.keepkv_zip_merge.default,
                                  (keys, values, votes, log_scores, targets, convex))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    def step(keys, values, votes, log_scores, keep):
        targets = ops.keepkv_match(keys, keep, 0.3)
        keys, values, votes = ops.keepkv_zip_merge(keys, values, votes, log_scores, targets)
        return keys, values, votes, ops.merge_count_bias(torch.where(targets == -1, votes, 0.0), 1.0)

    keys, values, votes, log_scores, targets = (t.to(device) for t in merge_inputs(2, 2, 24, 8, torch.float32))
    inputs = (keys, values, votes, log_scores, targets == -1)
    compiled = torch.compile(step, fullgraph=True)
    for got, expected in zip(compiled(*inputs), step(*inputs)):
        torch.testing.assert_close(got, expected)


# ----------------------------------------------------------------------------------------------------------------
# bad input

MATCH_BAD_INPUTS = [
    (lambda k, m: (k[0], m, 0.8), r"expected keys of shape \(B, H, T, d\), got a 3-d tensor"),
    (lambda k, m: (k.double(), m, 0.8), r"expected keys of dtype float32, float16 or bfloat16, got Double"),
    (lambda k, m: (k, m[0], 0.8), r"expected keep of shape \(B, H, T\), got a 2-d tensor"),
    (lambda k, m: (k, m.float(), 0.8), r"expected keep of dtype Bool, got Float"),
    (lambda k, m: (k, m[:1], 0.8), r"expected keep.size\(0\) == 2 \(batch of keys\)"),
    (lambda k, m: (k, m[:, :1], 0.8), r"expected keep.size\(1\) == 3 \(kv heads of keys\)"),
    (lambda k, m: (k, m[..., :-1], 0.8), r"expected keep.size\(2\) == 20 \(slots of keys\)"),
    (lambda k, m: (k, m, 1.5), r"expected threshold in \[-1, 1\], got 1.5"),
    (lambda k, m: (k, m, -1.01), r"expected threshold in \[-1, 1\], got -1.01"),
    (lambda k, m: (k, m, -1.0000001), r"expected threshold in \[-1, 1\], got -1.0000001"),  # (not rounded to -1)
    (lambda k, m: (k, m, float("nan")), r"expected threshold in \[-1, 1\], got nan"),
]


@pytest.mark.parametrize("make_args,message", MATCH_BAD_INPUTS)
def test_match_bad_input_names_op_and_value(make_args, message):
    keys, _, _, _, targets = merge_inputs(2, 3, 20, 8, torch.float32)
    with pytest.raises(RuntimeError, match=r"kvcomp::keepkv_match: " + message):
        torch.ops.kvcomp.keepkv_match(*make_args(keys, targets == -1))


def with_target(t, slot, value):
    t = t.clone()
    t[1, 2, slot] = value
    return t


MERGE_BAD_INPUTS = [
    (lambda k, v, p, l, t: (k[0], v, p, l, t), r"expected keys of shape \(B, H, T, d\), got a 3-d tensor"),
    (lambda k, v, p, l, t: (k, v[0], p, l, t), r"expected values of shape \(B, H, T, d\), got a 3-d tensor"),
    (lambda k, v, p, l, t: (k.int(), v.int(), p, l, t), r"expected keys of dtype float32, float16 or bfloat16, got Int"),
    (lambda k, v, p, l, t: (k, v.half(), p, l, t), r"expected values of the dtype of keys \(Float\), got Half"),
    (lambda k, v, p, l, t: (k, v[..., :4], p, l, t), r"expected values of the shape of keys"),
    (lambda k, v, p, l, t: (k, v, p.double(), l, t), r"expected votes of dtype Float, got Double"),
    (lambda k, v, p, l, t: (k, v, p, l.half(), t), r"expected log_scores of dtype Float, got Half"),
    (lambda k, v, p, l, t: (k, v, p, l, t.int()), r"expected targets of dtype Long, got Int"),
    (lambda k, v, p, l, t: (k, v, p[0], l, t), r"expected votes of shape \(B, H, T\), got a 2-d tensor"),
    (lambda k, v, p, l, t: (k, v, p, l[..., :-1], t), r"expected log_scores.size\(2\) == 20 \(slots of keys\)"),
    (lambda k, v, p, l, t: (k, v, p, l, t[:1]), r"expected targets.size\(0\) == 2 \(batch of keys\)"),
    (lambda k, v, p, l, t: (k, v, p, l, with_target(t, 5, 20)), r"expected every target to be -1 .* got targets\[1, 2, 5\] = 20"),
    (lambda k, v, p, l, t: (k, v, p, l, with_target(t, 5, -3)), r"expected every target to be -1 .* got targets\[1, 2, 5\] = -3"),
    (lambda k, v, p, l, t: (k, v, p, l, with_target(with_target(t, 5, 6), 6, -2)), r"expected every target to be -1 .* got targets\[1, 2, 5\] = 6"),
    (lambda k, v, p, l, t: (k, v, p, l, with_target(with_target(t, 5, 6), 6, 7)), r"expected every target to be -1 .* got targets\[1, 2, [56]\] = [67]"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make_args,message", MERGE_BAD_INPUTS)
def test_merge_bad_input_names_op_and_value(device, make_args, message):
    inputs = merge_inputs(2, 3, 20, 8, torch.float32, seed=12)
    targets = inputs[4].clone()
    targets[1, 2, :8] = -1
    args = make_args(*(t.to(device) for t in (*inputs[:4], targets)))
    with pytest.raises(RuntimeError, match=r"kvcomp::keepkv_zip_merge: " + message):
        torch.ops.kvcomp.keepkv_zip_merge(*args, False)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_without_target_check_equals_checked(device):
    inputs = [t.to(device) for t in merge_inputs(2, 3, 40, 8, torch.float32, seed=13)]
    checked = ops.keepkv_zip_merge(*inputs)
    unchecked = ops.keepkv_zip_merge(*inputs, check_targets=False)
    for got, want in zip(unchecked, checked):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_merge_unchecked_invalid_target_merges_nowhere_on_cuda():
    """Without the check (no host sync), CUDA turns an invalid target into -2 rather than reading out of its row."""
    keys, values, votes, log_scores, targets = merge_inputs(2, 3, 20, 8, torch.float32, seed=12)
    batch, head, evicted = torch.nonzero(targets >= 0)[0].tolist()
    bad, dropped = targets.clone(), targets.clone()
    bad[batch, head, evicted], dropped[batch, head, evicted] = 10_000, -2
    got = ops.keepkv_zip_merge(keys.cuda(), values.cuda(), votes.cuda(), log_scores.cuda(), bad.cuda(),
                               check_targets=False)
    assert_merge_close(got, reference.keepkv_zip_merge(keys, values, votes, log_scores, dropped), torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_mixed_devices_rejected():
    keys, values, votes, log_scores, targets = merge_inputs(2, 3, 20, 8, torch.float32)
    with pytest.raises(RuntimeError, match=r"kvcomp::keepkv_match: expected keep on the device of keys"):
        torch.ops.kvcomp.keepkv_match(keys.cuda(), targets == -1, 0.8)
    with pytest.raises(RuntimeError, match=r"kvcomp::keepkv_zip_merge: expected targets on the device of keys"):
        torch.ops.kvcomp.keepkv_zip_merge(keys.cuda(), values.cuda(), votes.cuda(), log_scores.cuda(), targets, False)
    with pytest.raises(RuntimeError, match=r"kvcomp::keepkv_zip_merge: expected values on the device of keys"):
        torch.ops.kvcomp.keepkv_zip_merge(keys.cuda(), values, votes, log_scores, targets, False)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    keys, values, votes, log_scores, targets = (t[:0].to(device) for t in merge_inputs(2, 2, 10, 8, torch.float32))
    assert ops.keepkv_match(keys, targets == -1, 0.8).shape == (0, 2, 10)
    assert [tuple(t.shape) for t in ops.keepkv_zip_merge(keys, values, votes, log_scores, targets)] == \
        [(0, 2, 10, 8)] * 2 + [(0, 2, 10)]


@pytest.mark.parametrize("seed", range(4))
def test_decode_step_reads_strided_rows_where_they_lie(seed):
    """keys, values and the per-slot tensors in rows at their own strides inside larger buffers (a PagedKVCache's view
    over its block pools: keys and values updated there, the others read without a copy on CPU) give the result of
    the same inputs laid out contiguously, which the fuzz test compares with the float64 reference; nothing outside
    the rows is written."""
    import random

    from tests.layouts import in_strided_rows, outside
    from tests.test_fuzz_ops import _keepkv_step_build, _keepkv_step_sizes

    r = random.Random(f"strided-rows:{seed}")
    args = _keepkv_step_build(r, _keepkv_step_sizes(r, {"S": 12, "q": 1 + seed % 2, "H": 2, "Hq": 4}), torch.float32)
    strided, buffers = list(args), {}
    for index in (0, 1, 4, 5, 6, 7):  # keys, values, log_weights, log_ema, age, votes
        buffers[index], strided[index] = in_strided_rows(args[index])
        assert not strided[index].is_contiguous()
    for got, expected in zip(ops.keepkv_decode_step(*strided), ops.keepkv_decode_step(*args)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    for index, buffer in buffers.items():
        assert bool((outside(buffer, strided[index]) == 7.0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new_tokens, over_budget", [(1, 0), (1, 1), (3, 3), (2, 12)])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "paged-view"])
def test_decode_step_at_a_real_head_size_matches_reference(device, dtype, new_tokens, over_budget, strided):
    """A decoding step at d = 128, G = 4 against the float64 reference, E = T - budget slots evicted: on the GPU 0, 1
    and 3 take the fused kernel (16-byte moves for contiguous rows, element moves for a paged view's unaligned ones),
    12 the ATen path. Keys and values are packed in place; nothing outside a view's rows is written."""
    import random

    from tests.layouts import in_strided_rows, outside
    from tests.test_fuzz_ops import FUZZ, _keepkv_step_build, _keepkv_step_sizes

    r = random.Random(f"cuda-step:{new_tokens}:{over_budget}")
    sizes = _keepkv_step_sizes(r, {"B": 2, "H": 2, "Hq": 8, "q": new_tokens, "d": 128, "S": 60})
    args = list(_keepkv_step_build(r, sizes, dtype))
    args[10:13] = [60 + new_tokens - over_budget, 4, 8]  # budget, sinks, recent
    expected = reference.keepkv_decode_step(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
    on_device, buffers = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args], {}
    if strided:
        for index in (0, 1):  # keys, values
            buffers[index], on_device[index] = in_strided_rows(on_device[index])
    got = ops.keepkv_decode_step(*on_device)
    atol, rtol = FUZZ["keepkv_decode_step"].tolerance(dtype)  # the fuzz's, for the same op
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.cpu().float(), e.float(), atol=atol, rtol=rtol, equal_nan=True)
    for index, buffer in buffers.items():
        assert bool((outside(buffer, on_device[index]) == 7.0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_decode_step_scores_are_the_logits_q_k_scale(device, seed):
    """The op recovers each logit from the attention's probabilities (ln p - b + the row's LSE) rather than recompute
    q·k over the keys; the reference above recovers them the same way. Here the reference takes ℓ = q·k·scale from
    the queries and keys instead, eq. 8's own input: for probabilities the softmax of q·k·scale + b gave, the step's
    EMA, ages, evictions and merges are the same (a sign of b or an LSE off by a constant would not be)."""
    import random

    from tests.test_fuzz_ops import FUZZ, _keepkv_step_build, _keepkv_step_sizes

    r = random.Random(f"logits-from-queries:{seed}")
    sizes = _keepkv_step_sizes(r, {"B": 2, "H": 2, "Hq": 6, "q": 1 + seed % 3, "d": 32, "S": 40})
    args = list(_keepkv_step_build(r, sizes, torch.float32))
    args[10:13] = [40 + sizes["q"] - 1 - seed % 4, 2, 6]  # budget (1 to 4 slots evicted), sinks, recent
    args[13] = 0.0  # merge every evicted slot whose cosine reaches 0: merges with their b and votes in play
    expected = reference.keepkv_decode_step(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args),
                                            logits_from="queries")
    got = ops.keepkv_decode_step(*(a.to(device) if isinstance(a, torch.Tensor) else a for a in args))
    atol, rtol = FUZZ["keepkv_decode_step"].tolerance(torch.float32)
    for name, g, e in zip(("keys", "values", "log_ema", "age", "votes", "log_weights", "dropped"), got, expected):
        torch.testing.assert_close(g.cpu().float(), e.float(), atol=atol, rtol=rtol, equal_nan=True,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("evicted", [1, 12], ids=["fused", "aten"])  # the two CUDA paths
def test_decode_step_a_nan_probability_poisons_only_its_own_slot(device, evicted):
    """A NaN in the attention's probabilities (an overflow upstream, say) makes that slot's logit NaN, nothing more:
    the row's LSE comes from its largest non-NaN probability. A NaN at slot 0 once chose slot 0 as the CPU op's
    anchor, and every logit of the row became NaN. Compared with the float64 reference, which skips NaN the same
    way, and checked directly: every other slot's EMA stays finite."""
    import random

    from tests.test_fuzz_ops import FUZZ, _keepkv_step_build, _keepkv_step_sizes

    r = random.Random(f"nan-probability:{evicted}")
    sizes = _keepkv_step_sizes(r, {"B": 2, "H": 2, "Hq": 4, "q": 2, "d": 16, "S": 40})
    args = list(_keepkv_step_build(r, sizes, torch.float32))
    args[4].fill_(0.0)  # log-weights: every slot seen, so that a -inf EMA can only come from a NaN
    args[3] = reference.decode_attention(args[2], args[0], args[1], args[4], args[8])[1]
    poisoned = [(0, 0, 0, 0), (1, 3, 1, 17)]  # (batch, query head, new token, slot)
    for index in poisoned:
        args[3][index] = float("nan")
    args[10:13] = [42 - evicted, 2, 6]  # budget, sinks, recent
    args[14] = False
    expected = reference.keepkv_decode_step(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
    stepped = ops.keepkv_decode_step(*(a.to(device) if isinstance(a, torch.Tensor) else a for a in args))
    atol, rtol = FUZZ["keepkv_decode_step"].tolerance(torch.float32)
    for name, g, e in zip(("keys", "values", "log_ema", "age", "votes", "log_weights", "dropped"), stepped, expected):
        torch.testing.assert_close(g.cpu().float(), e.float(), atol=atol, rtol=rtol, equal_nan=True,
                                   msg=lambda m, name=name: f"{name}: {m}")
    log_ema = stepped[2].cpu()
    assert int(log_ema.isnan().sum()) <= len(poisoned)  # the poisoned slots, where they were kept
    assert bool(log_ema.nan_to_num(nan=0.0).isfinite().all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("edge", ["first recent slot", "last sink"])
def test_decode_step_never_evicts_the_protected_slot_with_the_lowest_score(device, edge):
    """The slot at the edge of the recent window (or the last sink) holds the lowest ŝ of the row, by far: the step
    keeps it, as the reference does, and evicts the lowest unprotected slots instead (random scores rarely put the
    minimum on an edge, where a window one slot short passed every test but the fuzz)."""
    import random

    from tests.test_fuzz_ops import _keepkv_step_build, _keepkv_step_sizes

    r = random.Random(f"protected-edge:{edge}")
    args = list(_keepkv_step_build(r, _keepkv_step_sizes(r, {"B": 1, "H": 2, "Hq": 4, "q": 1, "d": 16, "S": 40}),
                                   torch.float32))
    slots = args[0].shape[2]
    args[10:13] = [slots - 3, 2, 8]  # budget (3 evicted), sinks, recent
    slot = slots - 8 if edge == "first recent slot" else 1
    args[5][..., slot] = -40.0  # ln ŝ before the step
    args[3][..., slot] = 0.0  # no attention from the new query
    expected = reference.keepkv_decode_step(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
    got = ops.keepkv_decode_step(*(a.to(device) if isinstance(a, torch.Tensor) else a for a in args))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.cpu().float(), e.float(), atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new_tokens", [1, 8])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "paged-view"])
@pytest.mark.parametrize("head_dim, old_slots", [(128, 700), (1100, 90), (128, 4500)])
def test_decode_step_on_cuda_packs_long_rows_as_the_cpu_op(dtype, new_tokens, strided, head_dim, old_slots):
    """Rows evicting E = 1 or 8 slots (the fused kernel's most), packed in place over tiles: at d = 128, 700 slots in
    11 to 88 tiles (16-byte moves, or element moves for a paged view's rows), every tile after the first evicted slot
    reading its last sources from the copy of the next tile's first slots; at d = 1100 tiles of 3 slots (float32,
    16-byte moves) or of one slot in two parts (element moves): fewer slots than E. 4 rows of 4500 slots are too few
    and too long for the fused kernel (launch::keepkv_fused_step_pays): the ATen composition with E <= 8. The CUDA
    op gives the CPU op's cache, which the test above and the fuzz compare with the float64 reference (too slow for
    rows this long)."""
    import random

    from tests.layouts import in_strided_rows
    from tests.test_fuzz_ops import FUZZ, _keepkv_step_build, _keepkv_step_sizes

    r = random.Random(f"cuda-pack:{new_tokens}:{head_dim}")
    sizes = _keepkv_step_sizes(r, {"B": 2, "H": 2, "Hq": 8, "q": new_tokens, "d": head_dim, "S": old_slots})
    args = list(_keepkv_step_build(r, sizes, dtype))
    args[10:13] = [old_slots, 4, 8]  # budget, sinks, recent: E = q
    expected = ops.keepkv_decode_step(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
    on_cuda = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    if strided:  # keys and values in views over larger buffers
        on_cuda[0] = in_strided_rows(on_cuda[0])[1]
        on_cuda[1] = in_strided_rows(on_cuda[1])[1]
    got = ops.keepkv_decode_step(*on_cuda)
    atol, rtol = FUZZ["keepkv_decode_step"].tolerance(dtype)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.cpu().float(), e.float(), atol=atol, rtol=rtol, equal_nan=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_step_with_many_evictions_replays_in_a_cuda_graph():
    """A pass of 12 tokens at the budget evicts 12 slots a row, more than the fused kernel takes: the ATen fallback,
    whose match once read its rows' extents back to the host. Capture fails on any host sync; the replay must give
    the eager step's results."""
    import random

    from tests.test_fuzz_ops import _keepkv_step_build, _keepkv_step_sizes

    r = random.Random("graph-fallback")
    sizes = _keepkv_step_sizes(r, {"B": 2, "H": 2, "Hq": 8, "q": 12, "d": 64, "S": 40})
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in _keepkv_step_build(r, sizes, torch.float32)]
    args[10:13] = [40, 4, 8]  # budget, sinks, recent: 12 evictions a row

    def fresh():  # keys and values are updated in place
        return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]

    side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graphs asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.keepkv_decode_step(*fresh())
    torch.cuda.current_stream().wait_stream(side)
    captured, graph = fresh(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = ops.keepkv_decode_step(*captured)
    graph.replay()
    eager = fresh()
    expected = ops.keepkv_decode_step(*eager)
    torch.cuda.synchronize()
    for g, e in zip([*captured[:2], *got], [*eager[:2], *expected], strict=True):  # keys, values, then the outputs
        torch.testing.assert_close(g, e, equal_nan=True)


@pytest.mark.parametrize("index, name", [(2, "queries"), (3, "probabilities"), (4, "log_weights"), (5, "log_ema"),
                                         (6, "age"), (7, "votes")])
def test_decode_step_refuses_read_inputs_that_require_grad(index, name):
    """The step updates keys and values in place and has no backward: an input that requires grad is refused by name
    (its gradient would otherwise be silently lost), before anything is written."""
    import random

    from tests.test_fuzz_ops import _keepkv_step_build, _keepkv_step_sizes

    r = random.Random("requires-grad")
    args = list(_keepkv_step_build(r, _keepkv_step_sizes(r, {"S": 12, "q": 1}), torch.float32))
    keys = args[0].clone()
    args[index] = args[index].clone().requires_grad_()
    with pytest.raises(RuntimeError, match=f"kvcomp::keepkv_decode_step: expected {name} not to require grad"):
        ops.keepkv_decode_step(*args)
    torch.testing.assert_close(args[0], keys, rtol=0, atol=0)
