"""kvcomp::prompt_log_sum_exp and kvcomp::prompt_scores against a float64 plain-PyTorch reference written from the
formula (full softmax, explicit weights), the skip of negligible old queries, determinism, opcheck, torch.compile and
bad input; kvcomp::prompt_log_unnormalised_scores (KeepKV's EMA) likewise, compared in the log domain; then the
presses that score their prompt with them (ZSMerge, WeightedKV) against the folding they did before
(decode_attention's probabilities of 512-query chunks folded by update_scores), re-implemented here in plain PyTorch,
and KeepKV against its former PyTorch fold, on SmolLM2. CUDA cases run when a GPU is present."""

import math

import pytest
import torch

import kvpress_cpp  # noqa: F401  (registers torch.ops.kvcomp)
from kvpress_cpp import attention, ops
from kvpress_cpp.cache import get_state
from kvpress_cpp.presses import base as press_base
from kvpress_cpp.presses.base import query_states
from kvpress_cpp.presses.weightedkv import WeightedKVPress
from kvpress_cpp.presses.zsmerge import ZSMergePress
from tests import reference
from tests.generation import greedy, prompt_ids
from tests.layouts import in_strided_rows
from tests.models import make_tiny_llama
from tests.threads import at_one_and_two_threads

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The kernels and the float64 reference see the same rounded inputs; the kernels' logits are float32 (products of
# |scale q·k| up to ~20 here, so ~2e-6 absolute, which a probability carries as a relative error), and on CUDA the
# half-precision products accumulate in float32 on tensor cores.
SCORE_TOL = dict(rtol=5e-5, atol=1e-6)
LSE_TOL = dict(rtol=1e-5, atol=2e-5)


def make_inputs(batch, query_heads, kv_heads, num_queries, total_len, head_dim, dtype=torch.float32, device="cpu",
                seed=0, padding=0.1):
    """query (B, Hq, q, d), keys (B, H, T, d), log_weights (B, H, T): merged slots (b = 0.6 ln w) and a fraction of
    -inf (padding or evicted) slots."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, query_heads, num_queries, head_dim, generator=generator)
    keys = torch.randn(batch, kv_heads, total_len, head_dim, generator=generator)
    counts = 1 + 4 * torch.rand(batch, kv_heads, total_len, generator=generator)
    counts[torch.rand(batch, kv_heads, total_len, generator=generator) < padding] = 0
    log_weights = reference.merge_count_bias(counts, 0.6)
    return query.to(device, dtype), keys.to(device, dtype), log_weights.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,query_heads,kv_heads", [(1, 9, 3), (2, 4, 4)], ids=["gqa", "mha-b2"])
@pytest.mark.parametrize("num_queries,total_len", [(1, 1), (1, 37), (37, 37), (130, 300), (45, 300)])
@pytest.mark.parametrize("decay,input_scale", [(1.0, 1 / 3), (0.98, 1.0), (0.5, 0.05)])
def test_matches_reference(device, dtype, batch, query_heads, kv_heads, num_queries, total_len, decay, input_scale):
    """T not a multiple of the key tile (128), q across query tiles (64), q < T (a prompt's last queries), padding."""
    query, keys, log_weights = make_inputs(batch, query_heads, kv_heads, num_queries, total_len, 24, dtype, device)
    scale = 24 ** -0.5
    lse = ops.prompt_log_sum_exp(query, keys, log_weights, scale)
    assert lse.dtype == torch.float32 and lse.shape == query.shape[:3]
    torch.testing.assert_close(lse.double(), reference.prompt_log_sum_exp(query, keys, log_weights, scale),
                               **LSE_TOL)
    scores = ops.prompt_scores(query, keys, log_weights, scale, decay, input_scale)
    assert scores.dtype == torch.float32 and scores.shape == log_weights.shape
    expected = reference.prompt_scores(query, keys, log_weights, scale, decay, input_scale)
    torch.testing.assert_close(scores.double(), expected, **SCORE_TOL)
    assert bool((scores[log_weights == -math.inf] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_head_dim_128_and_strided_views(device):
    """d = 128 (Llama-3-shaped), keys a view of a longer buffer, queries transposed from (B, T, Hq, d)."""
    query, keys, log_weights = make_inputs(1, 8, 2, 200, 333, 128, device=device, padding=0.0)
    buffer = torch.zeros(1, 2, 400, 128, device=device)
    buffer[:, :, :333] = keys
    strided_query = query.transpose(1, 2).contiguous().transpose(1, 2)
    scores = ops.prompt_scores(strided_query, buffer[:, :, :333], log_weights, 0.09, 0.98, 1.0)
    torch.testing.assert_close(scores.double(), reference.prompt_scores(query, keys, log_weights, 0.09, 0.98, 1.0),
                               **SCORE_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("batch,query_heads,kv_heads,num_queries,total_len", [
    (1, 9, 3, 130, 300),  # G = 3: a tile of 64 rows splits a query's heads
    (2, 8, 2, 300, 300),  # q = T over several query and key tiles, B = 2
    (1, 4, 4, 1, 37),  # one query, one partial key tile
    (1, 8, 2, 1000, 1100),  # many tiles: old queries skipped once negligible (decay < 1)
], ids=["gqa3", "b2-q=T", "one-query", "long"])
@pytest.mark.parametrize("decay,input_scale", [(1.0, 0.25), (0.9, 1.0), (0.5, 0.05)])
def test_half_precision_head_dims_64_and_128(device, dtype, head_dim, batch, query_heads, kv_heads, num_queries,
                                             total_len, decay, input_scale):
    """Half precision at d = 64 and 128 with rows in 16-byte pieces: on CUDA the tensor-core kernels (logits in
    mma.sync registers, tiles streamed by cp.async, base-2 softmax), on CPU the vectorised loops, both against the
    float64 formula; -inf slots score exactly 0."""
    query, keys, log_weights = make_inputs(batch, query_heads, kv_heads, num_queries, total_len, head_dim, dtype,
                                           device)
    scale = head_dim ** -0.5
    lse = ops.prompt_log_sum_exp(query, keys, log_weights, scale)
    torch.testing.assert_close(lse.double(), reference.prompt_log_sum_exp(query, keys, log_weights, scale),
                               **LSE_TOL)
    scores = ops.prompt_scores(query, keys, log_weights, scale, decay, input_scale)
    expected = reference.prompt_scores(query, keys, log_weights, scale, decay, input_scale)
    torch.testing.assert_close(scores.double(), expected, **SCORE_TOL)
    assert bool((scores[log_weights == -math.inf] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_old_queries_are_skipped_only_below_float32_resolution(device):
    """The old queries all attend one key, and strongly, while the recent ones spread thin: their weights decay to
    below 1e-9 of the newest (decay 0.85), yet what they add to that key's score is above float32 resolution.
    Skipping a tile's older queries must wait until their weights cannot reach half an ulp of its smallest partial
    score (random inputs stayed within tolerance with a bound 2^20 too loose)."""
    query, keys, log_weights = make_inputs(1, 4, 2, 200, 300, 16, padding=0.0)
    query[:, :, 136:] *= 0.3
    for head in range(4):
        query[0, head, :136] = 3 * keys[0, head // 2, 5]
    query, keys, log_weights = query.to(device), keys.to(device), log_weights.to(device)
    scores = ops.prompt_scores(query, keys, log_weights, 0.25, 0.85, 1.0)
    expected = reference.prompt_scores(query.cpu(), keys.cpu(), log_weights.cpu(), 0.25, 0.85, 1.0)
    torch.testing.assert_close(scores.double().cpu(), expected, **SCORE_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [20, 64])
@pytest.mark.parametrize("views", ["query", "keys", "both"])
def test_rows_off_16_byte_boundaries(device, dtype, head_dim, views):
    """Views whose rows start off a 16-byte boundary (3 elements into a buffer, 5 between (batch, head) rows, as a
    paged cache's view; the CUDA kernels then read them an element at a time instead of 16 bytes) and a head dim that
    is no whole number of 16-byte pieces in half precision (20), against the same inputs made contiguous."""
    query, keys, log_weights = make_inputs(2, 4, 2, 70, 150, head_dim, dtype, device)
    query_in = in_strided_rows(query)[1] if views in ("query", "both") else query
    keys_in = in_strided_rows(keys)[1] if views in ("keys", "both") else keys
    scale = head_dim ** -0.5
    torch.testing.assert_close(ops.prompt_log_sum_exp(query_in, keys_in, log_weights, scale).double(),
                               reference.prompt_log_sum_exp(query, keys, log_weights, scale), **LSE_TOL)
    torch.testing.assert_close(ops.prompt_scores(query_in, keys_in, log_weights, scale, 0.98, 0.5).double(),
                               reference.prompt_scores(query, keys, log_weights, scale, 0.98, 0.5), **SCORE_TOL)
    expected = reference.prompt_log_unnormalised_scores(query, keys, log_weights, scale, 0.9, 0.1)
    seen = expected > -math.inf
    got = ops.prompt_log_unnormalised_scores(query_in, keys_in, log_weights, scale, 0.9, 0.1)
    torch.testing.assert_close(got.double()[seen], expected[seen], **LOG_SCORE_TOL)


def test_given_log_sum_exp_skips_the_first_pass():
    """With the log-sum-exp handed in, the scores are the same (the pass that computes it is then not run)."""
    query, keys, log_weights = make_inputs(1, 4, 2, 90, 90, 16)
    lse = ops.prompt_log_sum_exp(query, keys, log_weights, 0.25)
    torch.testing.assert_close(ops.prompt_scores(query, keys, log_weights, 0.25, 0.9, 1.0, log_sum_exp=lse),
                               ops.prompt_scores(query, keys, log_weights, 0.25, 0.9, 1.0), rtol=0, atol=0)


def test_negligible_old_queries_are_never_read():
    """decay = 0.5: after the newest 64 queries, all older ones weigh < 2 · 0.5^64 < 2^-26 of any score here, so they
    are skipped (older_queries_negligible): NaN planted in their queries cannot reach the scores, which equal the
    formula over the clean queries to float32 resolution."""
    query, keys, log_weights = make_inputs(1, 4, 2, 500, 500, 16, padding=0.0)
    poisoned = query.clone()
    poisoned[:, :, :300] = float("nan")
    scores = ops.prompt_scores(poisoned, keys, log_weights, 0.25, 0.5, 1.0,
                               log_sum_exp=ops.prompt_log_sum_exp(query, keys, log_weights, 0.25))
    expected = reference.prompt_scores(query, keys, log_weights, 0.25, 0.5, 1.0)
    assert bool(torch.isfinite(scores).all())
    torch.testing.assert_close(scores.double(), expected, **SCORE_TOL)


def test_plain_sums_skip_nothing():
    """decay = 1 never fades: NaN in an old query reaches every key it sees, while the other kv head stays finite."""
    query, keys, log_weights = make_inputs(1, 4, 2, 200, 200, 16, padding=0.0)
    query[:, 0, 10] = float("nan")
    scores = ops.prompt_scores(query, keys, log_weights, 0.25, 1.0, 0.5)
    assert bool(scores[:, 0, :11].isnan().all()) and bool(torch.isfinite(scores[:, 1]).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nan_slot", [0, 32, 70])
@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 16), (torch.bfloat16, 64)])
def test_nan_key_reaches_the_log_sum_exp_of_every_query_that_sees_it(device, nan_slot, dtype, head_dim):
    """A NaN key makes the log-sum-exp of every query that sees it NaN, whatever else its tile holds (slot 32 with
    q = T: query 32 sees slots 0..32, a tile's second half holds that slot alone), and leaves the others exact; in
    bfloat16 at d = 64 through the tensor-core kernel on CUDA."""
    query, keys, log_weights = make_inputs(1, 4, 2, 100, 100, head_dim, dtype, device, padding=0.0)
    keys[:, 0, nan_slot] = float("nan")
    lse = ops.prompt_log_sum_exp(query, keys, log_weights, 0.25).cpu()
    sees = torch.arange(100) >= nan_slot
    assert bool(lse[:, :2, sees].isnan().all())
    clean = keys.clone()
    clean[:, 0, nan_slot] = 0.0
    expected = reference.prompt_log_sum_exp(query, clean, log_weights, 0.25).cpu()
    torch.testing.assert_close(lse[:, :2, ~sees].double(), expected[:, :2, ~sees], **LSE_TOL)
    torch.testing.assert_close(lse[:, 2:].double(), expected[:, 2:], **LSE_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 8), (torch.float16, 128)])
def test_row_with_nothing_to_attend_adds_nothing(device, dtype, head_dim):
    """A query whose visible slots are all -inf has lse -inf and contributes 0, never NaN."""
    query, keys, log_weights = make_inputs(1, 2, 1, 10, 10, head_dim, dtype, device, padding=0.0)
    log_weights[..., :3] = -math.inf
    lse = ops.prompt_log_sum_exp(query, keys, log_weights, 0.3)
    assert bool((lse[..., :3] == -math.inf).all())
    scores = ops.prompt_scores(query, keys, log_weights, 0.3, 1.0, 1.0, log_sum_exp=lse)
    torch.testing.assert_close(scores.double(), reference.prompt_scores(query, keys, log_weights, 0.3, 1.0, 1.0),
                               **SCORE_TOL)


@pytest.mark.parametrize("score", [
    lambda query, keys, log_weights: ops.prompt_scores(query, keys, log_weights, 0.2, 0.98, 1.0),
    lambda query, keys, log_weights: ops.prompt_log_unnormalised_scores(query, keys, log_weights, 0.2, 0.9, 0.25),
], ids=["prompt_scores", "prompt_log_unnormalised_scores"])
def test_deterministic_whatever_the_thread_count(score):
    query, keys, log_weights = make_inputs(2, 8, 2, 300, 300, 32)
    one, two = at_one_and_two_threads(lambda: score(query, keys, log_weights))
    assert torch.equal(one, two)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    query, keys, log_weights = make_inputs(1, 4, 2, 20, 33, 16, device=device)
    lse = ops.prompt_log_sum_exp(query, keys, log_weights, 0.25)
    torch.library.opcheck(torch.ops.kvcomp.prompt_log_sum_exp.default, (query, keys, log_weights, 0.25))
    torch.library.opcheck(torch.ops.kvcomp.prompt_scores.default, (query, keys, log_weights, lse, 0.25, 0.9, 0.5))


def test_compile_fullgraph():
    query, keys, log_weights = make_inputs(1, 4, 2, 20, 33, 16)

    def scores(q, k, b):
        return ops.prompt_scores(q, k, b, 0.25, 0.98, 1.0) * 2

    compiled = torch.compile(scores, fullgraph=True)
    torch.testing.assert_close(compiled(query, keys, log_weights), scores(query, keys, log_weights))


@pytest.mark.parametrize("change,message", [
    (dict(query=torch.zeros(4, 20, 16)), "kvcomp::prompt_scores: expected query of shape (B, Hq, q, d), got a 3-d"),
    (dict(keys=torch.zeros(1, 2, 33, 16, dtype=torch.float64)), "expected keys of dtype Float, got Double"),
    (dict(query=torch.zeros(1, 4, 20, 16, dtype=torch.float64), keys=torch.zeros(1, 2, 33, 16, dtype=torch.float64)),
     "expected query of dtype float32, float16 or bfloat16, got Double"),
    (dict(log_weights=torch.zeros(1, 2, 33, dtype=torch.float16)), "expected log_weights of dtype Float"),
    (dict(decay=0.0), "kvcomp::prompt_scores: expected decay in (0, 1], got 0"),
    (dict(decay=1.5), "expected decay in (0, 1], got 1.5"),
    (dict(decay=1.0000001), "expected decay in (0, 1], got 1.0000001"),  # (not rounded to 1)
    (dict(decay=math.nan), "expected decay in (0, 1], got nan"),
    (dict(input_scale=-1.0), "expected a finite float32 input_scale >= 0, got -1"),
    (dict(scale=0.0), "expected a finite float32 scale > 0, got 0"),
    (dict(query=torch.zeros(1, 4, 34, 16)), "expected 1 <= q <= T (the q queries are the last q of the T prompt "
     "tokens), got q = query.size(2) = 34 and T = keys.size(2) = 33"),
    (dict(query=torch.zeros(1, 3, 20, 16)), "the 3 query heads of query to be a positive multiple of the 2 kv heads"),
    (dict(keys=torch.zeros(1, 2, 33, 8)), "expected keys.size(3) == 16 (head dim d of query)"),
    (dict(log_sum_exp=torch.zeros(1, 4, 19)), "expected log_sum_exp.size(2) == 20"),
])
def test_bad_input_names_the_op_and_value(change, message):
    args = dict(query=torch.zeros(1, 4, 20, 16), keys=torch.zeros(1, 2, 33, 16), log_weights=torch.zeros(1, 2, 33),
                log_sum_exp=torch.zeros(1, 4, 20), scale=0.25, decay=0.9, input_scale=1.0)
    args.update(change)
    with pytest.raises(RuntimeError, match="kvcomp::prompt_scores") as error:
        torch.ops.kvcomp.prompt_scores(*args.values())
    assert message in str(error.value)


def test_empty_prompt_is_refused():
    with pytest.raises(RuntimeError, match=r"kvcomp::prompt_log_sum_exp: expected a prompt of T >= 1 tokens"):
        ops.prompt_log_sum_exp(torch.zeros(1, 4, 0, 16), torch.zeros(1, 2, 0, 16), torch.zeros(1, 2, 0))


@CUDA
def test_wrong_device_is_refused():
    query, keys, log_weights = make_inputs(1, 4, 2, 20, 33, 16)
    with pytest.raises(RuntimeError, match="kvcomp::prompt_log_sum_exp: expected keys on the device of query"):
        ops.prompt_log_sum_exp(query.cuda(), keys, log_weights.cuda())


@CUDA
def test_cuda_grid_limit_names_the_op_and_value():
    """gridDim.y holds the (batch, kv head) pairs: past 65535 a clear error, not a failed launch."""
    query, keys, log_weights = make_inputs(65536, 1, 1, 1, 1, 8, device="cuda", padding=0.0)
    with pytest.raises(RuntimeError, match=r"kvcomp::prompt_log_sum_exp: .*at most 65535 .*got B·H = 65536"):
        ops.prompt_log_sum_exp(query, keys, log_weights)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 16), (torch.bfloat16, 64)])
def test_rows_of_weight_zero_add_nothing_even_nan(device, dtype, head_dim):
    """A query row whose weight is 0 (input_scale 0, or decay^age below float32's range) adds nothing to any score,
    even with a NaN query: it is skipped, never multiplied by 0. With q < T its tile lies wholly inside the causal
    limit of the first keys (the tensor-core kernel's unmasked path on CUDA), and a key of log-weight -1e4 keeps a
    partial score of 0, so no block stops early before reaching it."""
    query, keys, log_weights = make_inputs(1, 4, 2, 200, 400, head_dim, dtype, device, padding=0.0)
    log_weights[..., 3] = -1e4
    clean = query.clone()
    query[:, 0, 5] = float("nan")
    scale = head_dim ** -0.5
    lse = ops.prompt_log_sum_exp(clean, keys, log_weights, scale)
    unweighted = ops.prompt_scores(query, keys, log_weights, scale, 1.0, 0.0, log_sum_exp=lse)
    assert bool((unweighted == 0).all())
    clean[:, 0, 5] = 0.0
    # Query 5 is 194 steps old: 0.5^194 is 0 in float32.
    scores = ops.prompt_scores(query, keys, log_weights, scale, 0.5, 1.0, log_sum_exp=lse)
    torch.testing.assert_close(scores.double(), reference.prompt_scores(clean, keys, log_weights, scale, 0.5, 1.0),
                               **SCORE_TOL)


# ---------------------------------------------------------------------------------------------------------------
# prompt_log_unnormalised_scores: KeepKV's EMA from its recent window

# Compared in the log domain: the logits are float32 (products of |scale q·k| up to ~20 here, ~2e-6 absolute) and exp
# is at::vec's exp_u20 (~2.4e-6 relative) on CPU; a log-sum-exp of such terms carries their absolute error.
LOG_SCORE_TOL = dict(rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,query_heads,kv_heads", [(1, 9, 3), (2, 4, 4)], ids=["gqa", "mha-b2"])
@pytest.mark.parametrize("num_queries,total_len", [(1, 1), (1, 37), (37, 37), (130, 300), (45, 300), (300, 300)])
@pytest.mark.parametrize("decay,input_scale", [(0.9, 0.1 / 3), (0.5, 2.0)])
def test_log_unnormalised_scores_match_reference(device, dtype, batch, query_heads, kv_heads, num_queries, total_len,
                                                 decay, input_scale):
    """A window from 1 query to all of them, T not a multiple of the key tile (128), q across query tiles (64),
    padding (b = -inf) and merged slots (b = 0.6 ln w)."""
    query, keys, log_weights = make_inputs(batch, query_heads, kv_heads, num_queries, total_len, 24, dtype, device)
    scale = 24 ** -0.5
    log_scores = ops.prompt_log_unnormalised_scores(query, keys, log_weights, scale, decay, input_scale)
    assert log_scores.dtype == torch.float32 and log_scores.shape == log_weights.shape
    expected = reference.prompt_log_unnormalised_scores(query, keys, log_weights, scale, decay, input_scale)
    unseen = expected == -math.inf
    assert bool(unseen[log_weights == -math.inf].all())
    assert bool((log_scores[unseen] == -math.inf).all())
    torch.testing.assert_close(log_scores.double()[~unseen], expected[~unseen], **LOG_SCORE_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("magnitude", [30.0, 300.0])
def test_log_unnormalised_scores_never_overflow(device, magnitude):
    """Logits of ±magnitude (exp(300) overflows float32 and float64 alike: the reference is a log-sum-exp too) and
    decay^age far below float32's range (0.5^500): finite wherever a query sees the slot, and the formula's."""
    query, keys, log_weights = make_inputs(1, 4, 2, 500, 600, 16, device=device, padding=0.0)
    query = query / query.norm(dim=-1, keepdim=True) * magnitude ** 0.5 * 4
    keys = keys / keys.norm(dim=-1, keepdim=True) * magnitude ** 0.5 * 4
    log_scores = ops.prompt_log_unnormalised_scores(query, keys, log_weights, 1 / 16, 0.5, 1.0)
    expected = reference.prompt_log_unnormalised_scores(query, keys, log_weights, 1 / 16, 0.5, 1.0)
    assert bool(torch.isfinite(log_scores).all())
    assert float(expected.abs().max()) > magnitude / 2
    torch.testing.assert_close(log_scores.double(), expected, rtol=1e-5, atol=1e-3 * magnitude / 30)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nan_query", [0, 1, 6])
def test_log_unnormalised_scores_nan_query_reaches_every_slot_it_sees(device, nan_query):
    """A NaN query makes the log-score of every slot it sees NaN, whichever query it is: the first (each column's
    running max still -inf when it comes, where CUDA's online log-sum-exp once dropped it and later terms hid it), or
    one after finite terms. The other kv head, and the slots after the NaN query, stay as the reference gives them."""
    query, keys, log_weights = make_inputs(1, 4, 2, 7, 7, 8, device=device, padding=0.0)
    query[:, 1, nan_query] = float("nan")
    log_scores = ops.prompt_log_unnormalised_scores(query, keys, log_weights, 0.3, 0.9, 0.5)
    expected = reference.prompt_log_unnormalised_scores(query, keys, log_weights, 0.3, 0.9, 0.5)
    assert bool(expected[:, 0, :nan_query + 1].isnan().all()) and not bool(expected[:, 1].isnan().any())
    assert torch.equal(log_scores.isnan().cpu(), expected.isnan().cpu())
    finite = ~expected.isnan()
    torch.testing.assert_close(log_scores.double()[finite], expected[finite], **LOG_SCORE_TOL)


def test_log_unnormalised_scores_of_a_slot_no_query_sees():
    """-inf for padding (b = -inf, whatever its key holds: NaN here) and, with every query's visible slots -inf, for
    every slot."""
    query, keys, log_weights = make_inputs(1, 2, 1, 10, 10, 8, padding=0.0)
    log_weights[..., :3] = -math.inf
    keys[..., :3, :] = float("nan")
    log_scores = ops.prompt_log_unnormalised_scores(query, keys, log_weights, 0.3, 0.9, 1.0)
    assert bool((log_scores[..., :3] == -math.inf).all()) and bool(torch.isfinite(log_scores[..., 3:]).all())
    all_padding = torch.full_like(log_weights, -math.inf)
    assert bool((ops.prompt_log_unnormalised_scores(query, keys, all_padding, 0.3, 0.9, 1.0) == -math.inf).all())


@pytest.mark.parametrize("device", DEVICES)
def test_log_unnormalised_scores_opcheck(device):
    query, keys, log_weights = make_inputs(1, 4, 2, 20, 33, 16, device=device)
    torch.library.opcheck(torch.ops.kvcomp.prompt_log_unnormalised_scores.default,
                          (query, keys, log_weights, 0.25, 0.9, 0.5))


@pytest.mark.parametrize("change,message", [
    (dict(query=torch.zeros(4, 20, 16)),
     "kvcomp::prompt_log_unnormalised_scores: expected query of shape (B, Hq, q, d), got a 3-d"),
    (dict(keys=torch.zeros(1, 2, 33, 16, dtype=torch.float64)), "expected keys of dtype Float, got Double"),
    (dict(log_weights=torch.zeros(1, 2, 33, dtype=torch.float16)), "expected log_weights of dtype Float"),
    (dict(decay=0.0), "expected decay in (0, 1), got 0"),
    (dict(decay=1.0), "expected decay in (0, 1), got 1"),
    (dict(decay=math.nan), "expected decay in (0, 1), got nan"),
    (dict(input_scale=0.0), "expected a finite float32 input_scale > 0, got 0"),
    (dict(input_scale=math.inf), "expected a finite float32 input_scale > 0, got inf"),
    (dict(scale=-1.0), "expected a finite float32 scale > 0, got -1"),
    (dict(query=torch.zeros(1, 4, 34, 16)), "expected 1 <= q <= T (the q queries are the last q of the T prompt "
     "tokens), got q = query.size(2) = 34 and T = keys.size(2) = 33"),
    (dict(query=torch.zeros(1, 4, 0, 16)), "expected 1 <= q <= T"),
    (dict(query=torch.zeros(1, 4, 0, 16), keys=torch.zeros(1, 2, 0, 16), log_weights=torch.zeros(1, 2, 0)),
     "expected a prompt of T >= 1 tokens"),
])
def test_log_unnormalised_scores_bad_input_names_the_op_and_value(change, message):
    args = dict(query=torch.zeros(1, 4, 20, 16), keys=torch.zeros(1, 2, 33, 16), log_weights=torch.zeros(1, 2, 33),
                scale=0.25, decay=0.9, input_scale=1.0)
    args.update(change)
    with pytest.raises(RuntimeError, match="kvcomp::prompt_log_unnormalised_scores") as error:
        torch.ops.kvcomp.prompt_log_unnormalised_scores(*args.values())
    assert message in str(error.value)


@CUDA
def test_log_unnormalised_scores_wrong_device_is_refused():
    query, keys, log_weights = make_inputs(1, 4, 2, 20, 33, 16)
    with pytest.raises(RuntimeError, match="kvcomp::prompt_log_unnormalised_scores: expected keys on the device"):
        ops.prompt_log_unnormalised_scores(query.cuda(), keys, log_weights.cuda())


# ---------------------------------------------------------------------------------------------------------------
# The presses, before and after: the folding they ran before this op, in plain PyTorch


def folded_prompt_attention(module, hidden_states, keys, log_weights, kwargs, decay, input_scale, chunk_size=512):
    """The presses' former prompt scoring: each 512-query chunk's full attention probabilities (decode_attention's
    reference) folded into the scores one query at a time (update_scores' reference)."""
    queries = query_states(module, hidden_states, kwargs)
    total = keys.shape[-2]
    scores = torch.zeros(*keys.shape[:2], 0, dtype=torch.float32)
    for start in range(0, total, chunk_size):
        end = min(start + chunk_size, total)
        _, probs = reference.decode_attention(queries[:, :, start:end], keys[:, :, :end], keys[:, :, :end],
                                              log_weights[..., :end], module.scaling)
        scores = reference.update_scores(scores, probs, decay, input_scale)
    return scores


@pytest.fixture(scope="module")
def austen_prompt(default_model):
    from kvpress_cpp.texts import austen_text

    _, tokenizer = default_model
    return tokenizer(austen_text()[:6000], return_tensors="pt").input_ids[:, :700]


# KeepKV's EMA is unnormalised (prompt_log_unnormalised_scores): test_keepkv_prefill_state_as_before below.
@pytest.mark.parametrize("press", [ZSMergePress(budget=0.25), WeightedKVPress(cache_size=0.25)],
                         ids=["zsmerge", "weightedkv"])
def test_presses_keep_the_same_cache_as_before(default_model, austen_prompt, press, monkeypatch):
    """SmolLM2, a 700-token Austen prompt, 4 generated tokens. Same slots kept, same counts / sums / EMA and the same
    merged keys and values as with the former folding, and the same tokens. Tolerance: the scores' float32 rounding
    (rtol 1e-4; the two sides differ by ~1e-6 relative); merged values are weighted by those scores (WeightedKV) and
    carry the same relative error (rtol 1e-4); a different slot would differ by O(1). The model's own prompt
    attention now runs kvcomp::prompt_attention_with_scores, before it ran sdpa: their float32 sums differ in order,
    and that rounding, carried through the layers, reaches the later layers' keys and values (up to ~3e-5 absolute
    on this prompt: atol 1e-4)."""
    model, _ = default_model
    tokens, cache = greedy(model, austen_prompt, press=press, max_new_tokens=4)
    # Before: the model's prompt attention by sdpa, keeping nothing for the press.
    monkeypatch.setattr(press_base, "request_prefill_scores",
                        lambda module, weights: attention.request_prefill_scores(module, None))
    for name in ("zsmerge", "weightedkv"):
        monkeypatch.setattr(f"kvpress_cpp.presses.{name}.score_prompt", folded_prompt_attention)
    before_tokens, before = greedy(model, austen_prompt, press=press, max_new_tokens=4)
    assert torch.equal(tokens, before_tokens)
    for layer, before_layer in zip(cache.layers, before.layers):
        torch.testing.assert_close(layer.keys, before_layer.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(layer.values, before_layer.values, rtol=1e-4, atol=1e-4)
        state, before_state = get_state(layer), get_state(before_layer)
        torch.testing.assert_close(state.log_weights, before_state.log_weights, rtol=1e-5, atol=1e-6)
        for name, per_slot in state.per_slot.items():
            torch.testing.assert_close(per_slot, before_state.per_slot[name], rtol=1e-4, atol=1e-7)


def test_prefill_sdpa_hands_its_log_sum_exp_without_changing_the_forward(default_model, austen_prompt,
                                                                          monkeypatch):
    """Past the fused op's workspace limit, the prompt pass that keeps the queries and the log-sum-exp (ATen's flash
    kernel, GQA without repeated keys) gives the model the same logits as sdpa; the queries are the layer's, the
    log-sum-exp the formula's."""
    from kvpress_cpp.attention import request_prefill_scores, take_prefill_attention

    monkeypatch.setattr(ops, "FUSED_PROMPT_WORKSPACE_LIMIT", 0)
    model, _ = default_model
    ids = austen_prompt[:, :200]
    attention = model.model.layers[3].self_attn
    with torch.no_grad():
        plain = model(ids).logits
        seen = {}

        def keep(module, args, kwargs, output):
            seen["hidden"], seen["kwargs"] = kwargs["hidden_states"], kwargs

        handle = attention.register_forward_hook(keep, with_kwargs=True)
        for module in model.modules():
            if hasattr(module, "layer_idx") and hasattr(module, "scaling"):
                request_prefill_scores(module, (1.0, 1.0))
        try:
            kept = model(ids, use_cache=True)
            queries = query_states(attention, seen["hidden"], seen["kwargs"])
            handed = take_prefill_attention(attention, ids.shape[1])
        finally:
            handle.remove()
            for module in model.modules():
                if hasattr(module, "layer_idx") and hasattr(module, "scaling"):
                    request_prefill_scores(module, None)
        assert torch.equal(kept.logits, plain)
        keys = kept.past_key_values.layers[3].keys
        expected = reference.prompt_log_sum_exp(queries, keys, torch.zeros(keys.shape[:3]), attention.scaling)
    assert handed is not None and handed.scores is None
    torch.testing.assert_close(handed.queries, queries)
    torch.testing.assert_close(handed.log_sum_exp.double(), expected, **LSE_TOL)


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_prompt_pass_keeps_cudnn_log_sum_exp(dtype):
    """On CUDA in half precision the prompt pass that keeps the log-sum-exp runs cuDNN's attention on the GQA keys as
    they are and queries laid out as transformers leaves them (B, T, Hq, d transposed): its output is sdpa's within
    half-precision rounding and its log-sum-exp the formula's."""
    module = torch.nn.Module()
    query = torch.randn(2, 200, 9, 64, device="cuda", dtype=dtype).transpose(1, 2)
    keys, values = (torch.randn(2, 3, 200, 64, device="cuda", dtype=dtype) for _ in range(2))
    output, _ = attention._cuda_prompt_attention_keeping_log_sum_exp(module, query, keys, values, 0.125)
    expected = torch.nn.functional.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=0.125,
                                                                enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(output, expected, atol=1e-2, rtol=1e-2)
    kept = attention.take_prefill_attention(module, 200)
    assert kept is not None and kept.queries is query and kept.scores is None
    zeros = torch.zeros(2, 3, 200, device="cuda")
    torch.testing.assert_close(kept.log_sum_exp.double(), reference.prompt_log_sum_exp(query, keys, zeros, 0.125),
                               **LSE_TOL)


def test_cudnn_refusal_is_asked_once_per_device_dtype_and_head_dim(monkeypatch):
    """Where cuDNN's attention refuses a prompt pass (a GPU or build without it), the pass falls back to the op's own
    log-sum-exp and does not ask cuDNN again for the same device, dtype and head dim; other inputs are still asked,
    and running out of memory is not taken for a refusal. (Device-free: cuDNN's op is replaced by one that refuses.)"""
    asked = []

    def refuse(query, *args, **kwargs):
        asked.append((query.dtype, query.shape[-1]))
        raise (torch.OutOfMemoryError if query.shape[-1] == 32 else RuntimeError)("cuDNN: no engine for these inputs")

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", refuse)
    monkeypatch.setattr(attention, "_CUDNN_REFUSED", set())

    def prompt_pass(dtype, head_dim):
        query, keys, values = (torch.zeros(1, 3, 8, head_dim, dtype=dtype) for _ in range(3))
        return attention._cuda_prompt_attention_keeping_log_sum_exp(torch.nn.Module(), query, keys, values, 0.125)

    for dtype, head_dim in [(torch.bfloat16, 64)] * 3 + [(torch.float16, 64), (torch.bfloat16, 128)] + \
            [(torch.bfloat16, 32)] * 2 + [(torch.float32, 64)]:
        assert prompt_pass(dtype, head_dim) is None
    assert asked == [(torch.bfloat16, 64), (torch.float16, 64), (torch.bfloat16, 128), (torch.bfloat16, 32),
                     (torch.bfloat16, 32)]


@CUDA
def test_cuda_press_scores_from_the_prompt_pass_log_sum_exp(monkeypatch):
    """ZSMerge on a random 3-layer Llama (GQA, d = 64) in bfloat16 on CUDA: each layer's prompt pass hands cuDNN's
    log-sum-exp to the press, which keeps the same cache (slots, merged keys and values, log-weights) as when
    kvcomp::prompt_scores computes the log-sum-exp itself from the same prompt pass."""
    model, tokenizer = make_tiny_llama(head_dim=64, num_hidden_layers=3)
    model = model.to("cuda", torch.bfloat16)
    prompt = prompt_ids(tokenizer, 700).cuda()
    handed = []
    take = attention.take_prefill_attention
    monkeypatch.setattr(press_base, "take_prefill_attention",
                        lambda module, length: handed.append(take(module, length)) or handed[-1])
    tokens, cache = greedy(model, prompt, press=ZSMergePress(budget=0.25), max_new_tokens=4)
    assert len(handed) == len(model.model.layers) and all(h is not None and h.scores is None for h in handed)
    # The same prompt pass, its log-sum-exp dropped: the op's own first pass.
    monkeypatch.setattr(press_base, "take_prefill_attention",
                        lambda module, length: take(module, length)._replace(log_sum_exp=None))
    own_tokens, own = greedy(model, prompt, press=ZSMergePress(budget=0.25), max_new_tokens=4)
    assert torch.equal(tokens, own_tokens)
    for layer, own_layer in zip(cache.layers, own.layers):
        torch.testing.assert_close(layer.keys, own_layer.keys)
        torch.testing.assert_close(layer.values, own_layer.values)
        torch.testing.assert_close(get_state(layer).log_weights, get_state(own_layer).log_weights)


@pytest.mark.parametrize("recent", [0.8, 300], ids=["default-window", "window-300"])
def test_keepkv_prefill_state_as_before(default_model, austen_prompt, recent, monkeypatch):
    """SmolLM2, a 700-token Austen prompt, KeepKV at a quarter of it (M = 175; R = 140 by default) or at half of it with
    a 300-query window (over two of the former's 256-query chunks), against the former PyTorch fold.

    The prefill alone, the prompt attention by sdpa on both sides (so every layer sees the same inputs): the same
    votes and ages exactly, ln S within 2e-5 absolute (measured 3e-6: the op's float32 logits and exp_u20 against
    torch's), the same slots kept (an unmerged slot's key bitwise equal; a different slot would differ by O(1)),
    values within 1e-5 (merged as Σ w v / Σ w). A merged key is eq. 7's ZIP key, (Σ w k)·ln(Σ w / Σ p) / Σ w ln ŝ,
    whose denominator may nearly cancel (guarded only below 1e-3 of its terms): it amplifies ln S's 3e-6 to up to
    2e-3 of the key's size (|k| up to ~1e3 here), so merged keys are held to rtol 1e-2 (not a tolerance a wrong slot
    or a wrong weight would pass: those move a key by O(|k|)). Then `generate` as the user runs it (the prompt
    attention by the fused op, its queries reused): the same 4 tokens as the former fold."""
    from transformers import DynamicCache

    from kvpress_cpp.presses.keepkv import KeepKVPress

    model, _ = default_model
    budget = 0.25 if recent == 0.8 else 0.5
    tokens, _ = greedy(model, austen_prompt, press=KeepKVPress(budget=budget, recent=recent), max_new_tokens=4)
    monkeypatch.setattr(press_base, "request_prefill_scores",
                        lambda module, weights: attention.request_prefill_scores(module, None))

    def prefill():
        cache = DynamicCache()
        with torch.no_grad(), KeepKVPress(budget=budget, recent=recent)(model):
            model(austen_prompt, past_key_values=cache)
        return cache

    cache = prefill()
    with monkeypatch.context() as former:
        former.setattr(ops, "prompt_log_unnormalised_scores", reference.keepkv_former_prefill_fold)
        before = prefill()
        before_tokens, _ = greedy(model, austen_prompt, press=KeepKVPress(budget=budget, recent=recent),
                                  max_new_tokens=4)
    assert torch.equal(tokens, before_tokens)
    for layer, before_layer in zip(cache.layers, before.layers):
        state, before_state = get_state(layer), get_state(before_layer)
        assert torch.equal(state.per_slot["votes"], before_state.per_slot["votes"])
        assert torch.equal(state.per_slot["age"], before_state.per_slot["age"])
        assert torch.equal(state.log_weights, before_state.log_weights)
        torch.testing.assert_close(state.per_slot["log_ema"], before_state.per_slot["log_ema"], rtol=0, atol=2e-5)
        unmerged = state.per_slot["votes"] == 1
        assert torch.equal(layer.keys[unmerged], before_layer.keys[unmerged])
        torch.testing.assert_close(layer.keys, before_layer.keys, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(layer.values, before_layer.values, rtol=1e-4, atol=1e-5)


def test_keepkv_prefill_reuses_the_prompt_pass_queries(default_model, austen_prompt, monkeypatch):
    """On CPU without padding every layer's prompt pass runs the fused op with score weights (1, 0) (no score sweep)
    and KeepKV takes the queries it kept: query_states is never called, and the EMA is the op's over exactly those
    queries (the window's, sliced from the pass's)."""
    from transformers import DynamicCache

    from kvpress_cpp.presses import keepkv
    from kvpress_cpp.presses.keepkv import KeepKVPress

    model, _ = default_model
    calls, windows = [], []
    fused, log_scores = ops.prompt_attention_with_scores, ops.prompt_log_unnormalised_scores

    def recording_fused(*args):
        calls.append(args[5:])
        return fused(*args)

    def recording_log_scores(queries, *args):
        windows.append(queries.shape[2])
        return log_scores(queries, *args)

    monkeypatch.setattr(ops, "prompt_attention_with_scores", recording_fused)
    monkeypatch.setattr(ops, "prompt_log_unnormalised_scores", recording_log_scores)
    monkeypatch.setattr(keepkv, "query_states", None)  # must not be called
    press = KeepKVPress(budget=0.25)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(austen_prompt, past_key_values=cache)
    layers = model.config.num_hidden_layers
    assert calls == [(1.0, 0.0)] * layers
    assert windows == [round(0.8 * round(0.25 * austen_prompt.shape[1]))] * layers
    assert all(bool(torch.isfinite(get_state(layer).per_slot["log_ema"]).all()) for layer in cache.layers)


def test_what_a_prompt_pass_kept_is_handed_only_to_a_prompt_of_its_length():
    """A prompt pass keeps its queries and log-sum-exp on the module for its press's hook, which takes them once. A
    kept pass of another length (a forward the press never compressed, refused after its attention ran, say) is not
    this prompt's: handing its 40 rows to a 30-token prompt would score the prompt with another's statistics."""
    from kvpress_cpp import attention

    module = torch.nn.Module()
    kept = attention.PrefillAttention(torch.zeros(1, 2, 40, 8), torch.zeros(1, 2, 40), None, None)
    module._kvcomp_prefill_attention = kept
    assert attention.take_prefill_attention(module, 30) is None
    assert attention.take_prefill_attention(module, 40) is None  # taken (and dropped) by the first call
    module._kvcomp_prefill_attention = kept
    assert attention.take_prefill_attention(module, 40) is kept
    assert attention.take_prefill_attention(module, 40) is None
