"""The gvote family (kvcomp::nucleus_budget, averaged_rope, gvote_union_mask) against the plain-PyTorch references,
the properties GVote relies on (monotone budgets, unions that only grow, sinks, chunking), opcheck, torch.compile
and bad input."""

import pytest
import torch

from kvpress_cpp import ops
from tests import reference

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NAN, INF = float("nan"), float("inf")


def attention_rows(batch, heads, total_len, device, seed=0, temperature=3.0):
    """Softmax rows of varied peakedness (a few heavy slots and a long tail), as the last prompt query's."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, heads, total_len, generator=generator) * temperature
    return logits.softmax(-1).to(device)


# ---------------------------------------------------------------------------------------------------------------
# nucleus_budget


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("total_len", [1, 7, 64, 300, 1000])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.95, 0.999, 1.0])
def test_nucleus_budget_matches_reference(device, total_len, p):
    probs = attention_rows(2, 9, total_len, device, seed=total_len)
    got = ops.nucleus_budget(probs, p)
    assert got.dtype == torch.int64 and got.shape == (2, 9) and got.device == probs.device
    assert torch.equal(got.cpu(), reference.nucleus_budget(probs.cpu(), p))


@pytest.mark.parametrize("device", DEVICES)
def test_nucleus_budget_by_hand(device):
    probs = torch.tensor([[[0.1, 0.5, 0.0, 0.3, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]]], device=device)
    # sorted: .5 .3 .1 .1 0 -> cumsum .5 .8 .9 1.0; uniform: .2 .4 .6 .8 1.0 (p off the boundaries: the float32
    # masses sum to slightly more than 1)
    assert ops.nucleus_budget(probs, 0.45).tolist() == [[1, 3]]
    assert ops.nucleus_budget(probs, 0.55).tolist() == [[2, 3]]
    assert ops.nucleus_budget(probs, 0.85).tolist() == [[3, 5]]
    assert ops.nucleus_budget(probs, 1.0).tolist() == [[4, 5]]  # the support: the zero is never needed
    # All of the mass takes every positive one, even those below double resolution against the total (a running sum
    # in double reaches it after the first).
    tiny_masses = torch.tensor([[[1.0, 1e-30, 0.0, 1e-20]]], device=device)
    assert ops.nucleus_budget(tiny_masses, 1.0).tolist() == [[3]]


@pytest.mark.parametrize("device", DEVICES)
def test_nucleus_budget_is_relative_to_the_row_sum(device):
    """Unnormalised rows behave as their normalisation: a row times 7 (or 1e-3) gives the same budget."""
    probs = attention_rows(1, 4, 200, device, seed=3)
    for factor in (7.0, 1e-3, 1.0 + 1e-6):
        for p in (0.5, 0.9, 0.95):
            assert torch.equal(ops.nucleus_budget(probs * factor, p), reference.nucleus_budget(probs.cpu() * factor, p).to(device))
    # a power-of-two factor is exact, so the budget is bit for bit the same
    assert torch.equal(ops.nucleus_budget(probs * 8, 0.95), ops.nucleus_budget(probs, 0.95))


@pytest.mark.parametrize("device", DEVICES)
def test_nucleus_budget_monotone_in_p(device):
    """A higher p never gives a smaller budget, and p = 1 gives the support."""
    probs = attention_rows(2, 6, 500, device, seed=5)
    previous = torch.ones(2, 6, dtype=torch.int64, device=device)
    for p in torch.linspace(0.01, 1.0, 60).tolist():
        budget = ops.nucleus_budget(probs, p)
        assert (budget >= previous).all()
        previous = budget
    assert torch.equal(previous, (probs > 0).sum(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_nucleus_budget_nan_zero_and_special_rows(device):
    probs = attention_rows(1, 6, 50, device, seed=9)
    probs[0, 0, [3, 10]] = NAN  # NaN counts as 0 mass
    probs[0, 1] = 0.0  # no mass: 1
    probs[0, 2] = NAN  # only NaN: 1
    probs[0, 3, 7] = INF  # +inf takes the whole mass
    probs[0, 4, :5] = -1.0  # negatives count as 0
    probs[0, 5, 20] = -0.0
    got = ops.nucleus_budget(probs, 0.9)
    assert torch.equal(got.cpu(), reference.nucleus_budget(probs.cpu(), 0.9))
    assert got[0, 1] == 1 and got[0, 2] == 1 and got[0, 3] == 1
    clean = probs[0, 0].nan_to_num(0.0)
    assert got[0, 0] == ops.nucleus_budget(clean.view(1, 1, -1), 0.9)[0, 0]
    assert (got >= 1).all() and (got <= 50).all()


@pytest.mark.parametrize("device", DEVICES)
def test_nucleus_budget_empty(device):
    assert ops.nucleus_budget(torch.rand(2, 3, 0, device=device), 0.9).tolist() == [[0] * 3] * 2
    assert ops.nucleus_budget(torch.rand(0, 3, 5, device=device), 0.9).shape == (0, 3)


@CUDA
@pytest.mark.parametrize("total_len", [255, 256, 257, 4096, 8193])
def test_nucleus_budget_cuda_matches_cpu_at_scale(total_len):
    """Several tiles per row, many rows; ties (repeated masses) included."""
    probs = attention_rows(3, 32, total_len, "cuda", seed=total_len, temperature=4.0)
    probs[:, :4] = probs[:, :4].mul(64).round().div(64)  # many exact ties, zeros
    for p in (0.5, 0.9, 0.95, 0.99, 1.0):
        assert torch.equal(ops.nucleus_budget(probs, p).cpu(), ops.nucleus_budget(probs.cpu(), p))


# ---------------------------------------------------------------------------------------------------------------
# averaged_rope


def rope_tables(positions, dim, dtype, device, base=10000.0):
    """transformers' Llama rotary tables (n_f, d) for the given positions."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.as_tensor(positions, dtype=torch.float64), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


ROPE_TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim,positions", [(64, 512), (16, 1), (128, 37), (2, 5)])
def test_averaged_rope_matches_reference(device, dtype, dim, positions):
    generator = torch.Generator().manual_seed(dim)
    queries = torch.randn(2, 9, 8, dim, generator=generator).to(device, dtype)
    cos, sin = rope_tables(range(1000, 1000 + positions), dim, dtype, device)
    got = ops.averaged_rope(queries, cos, sin)
    assert got.dtype == dtype and got.shape == queries.shape and got.device == queries.device
    expected = reference.averaged_rope(queries.cpu(), cos.cpu(), sin.cpu())
    torch.testing.assert_close(got.cpu(), expected, **ROPE_TOLERANCE[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_averaged_rope_is_the_mean_of_transformers_rotations(device):
    """Linearity: q * mean(cos) + rotate_half(q) * mean(sin) == mean_f apply_rotary_pos_emb(q, cos_f, sin_f), with
    transformers' own apply_rotary_pos_emb and rotary embedding module (Llama layout)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rope_theta=100000.0, max_position_embeddings=8192)
    rotary = LlamaRotaryEmbedding(config).to(device)
    prompt_len, future = 300, 512
    queries = torch.randn(1, 9, 8, 64, device=device)
    positions = torch.arange(prompt_len, prompt_len + future, device=device)[None]
    cos, sin = rotary(queries, positions)  # (1, n_f, d)
    rotated = [apply_rotary_pos_emb(queries, queries, cos[:, f : f + 1], sin[:, f : f + 1])[0] for f in range(future)]
    expected = torch.stack(rotated).mean(0)
    torch.testing.assert_close(ops.averaged_rope(queries, cos[0], sin[0]), expected, rtol=1e-5, atol=1e-5)
    # One position is plain RoPE at that position.
    torch.testing.assert_close(ops.averaged_rope(queries, cos[0, :1], sin[0, :1]), rotated[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_averaged_rope_non_contiguous_and_mixed_table_dtype(device):
    queries = torch.randn(2, 8, 3, 32, device=device).transpose(1, 2)  # (2, 3, 8, 32) view
    cos, sin = rope_tables(range(10, 20), 32, torch.float32, device)
    got = ops.averaged_rope(queries, cos.bfloat16(), sin.double().float())
    assert got.is_contiguous()
    expected = reference.averaged_rope(queries.cpu(), cos.bfloat16().cpu(), sin.cpu())
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


@CUDA
@pytest.mark.parametrize("dtype", DTYPES)
def test_averaged_rope_cuda_matches_cpu(dtype):
    queries = torch.randn(3, 32, 8, 128, device="cuda").to(dtype)
    cos, sin = rope_tables(range(4000, 4512), 128, torch.float32, "cuda")
    torch.testing.assert_close(ops.averaged_rope(queries, cos, sin).cpu(),
                               ops.averaged_rope(queries.cpu(), cos.cpu(), sin.cpu()), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# gvote_union_mask


def union_inputs(batch, kv_heads, group, samples, total_len, dtype, device, dim=16, seed=0, budget_range=None):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, total_len, dim, generator=generator)
    queries = torch.randn(batch, kv_heads * group, samples, dim, generator=generator)
    low, high = budget_range or (0, total_len + 3)
    budgets = torch.randint(low, high, (batch, kv_heads * group), generator=generator)
    return keys.to(device, dtype), queries.to(device, dtype), budgets.to(device)


def expected_mask(keys, queries, budgets, sinks, scale):
    return reference.gvote_union_mask(keys.cpu(), queries.cpu(), budgets.cpu(), sinks, scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,group", [(3, 3), (4, 1), (1, 4)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("total_len,samples", [(40, 8), (129, 3), (7, 1)])
def test_union_mask_matches_python_set_union(device, dtype, kv_heads, group, total_len, samples):
    keys, queries, budgets = union_inputs(2, kv_heads, group, samples, total_len, dtype, device,
                                          budget_range=(0, total_len // 3 + 2), seed=total_len)
    got = ops.gvote_union_mask(keys, queries, budgets, sinks=4, scale=0.25, chunk_size=5)
    assert got.dtype == torch.bool and got.shape == (2, kv_heads, total_len) and got.device == keys.device
    assert torch.equal(got.cpu(), expected_mask(keys, queries, budgets, 4, 0.25))


@pytest.mark.parametrize("device", DEVICES)
def test_union_mask_equals_topk_union_with_distinct_logits(device):
    """Where no two logits tie, the keep set is literally the union of torch.topk indices."""
    keys, queries, budgets = union_inputs(1, 2, 3, 4, 60, torch.float32, device, seed=1, budget_range=(1, 12))
    got = ops.gvote_union_mask(keys, queries, budgets, sinks=0, scale=1.0)
    logits = queries @ keys.repeat_interleave(3, dim=1).transpose(-1, -2)
    for h in range(2):
        kept = set()
        for g in range(3):
            for s in range(4):
                kept |= set(logits[0, h * 3 + g, s].topk(int(budgets[0, h * 3 + g])).indices.tolist())
        assert set(got[0, h].nonzero().flatten().tolist()) == kept


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_union_mask_chunk_size_independent(device, dtype):
    """Chunks of 1 row, 3 rows (straddling query heads and kv heads), whole kv heads, and everything at once."""
    keys, queries, budgets = union_inputs(2, 3, 3, 8, 90, dtype, device, seed=2, budget_range=(0, 30))
    results = [ops.gvote_union_mask(keys, queries, budgets, 2, 0.125, chunk)
               for chunk in (1, 3, 7, 24, 48, 50, 10_000)]
    for result in results[1:]:
        assert torch.equal(result, results[0])
    assert torch.equal(results[0].cpu(), expected_mask(keys, queries, budgets, 2, 0.125))


@pytest.mark.parametrize("device", DEVICES)
def test_union_mask_grows_with_samples_and_budget(device):
    """More samples (a superset of them) never keep fewer tokens; nor does a larger budget; the count is at least the
    largest budget of the group and at most the sum of the budgets plus the sinks."""
    keys, queries, budgets = union_inputs(1, 3, 3, 12, 200, torch.float32, device, seed=4, budget_range=(5, 40))
    previous = None
    for samples in range(1, 13):
        mask = ops.gvote_union_mask(keys, queries[:, :, :samples].contiguous(), budgets, 0, 0.25)
        if previous is not None:
            assert (mask | previous).equal(mask)  # previous is a subset
        previous = mask
    counts = previous.sum(-1)
    per_group = budgets.view(1, 3, 3)
    assert (counts >= per_group.max(-1).values).all() and (counts <= per_group.sum(-1) * 12).all()
    bigger = ops.gvote_union_mask(keys, queries, budgets + 10, 0, 0.25)
    assert (bigger | previous).equal(bigger)


@pytest.mark.parametrize("device", DEVICES)
def test_union_mask_sinks_and_extreme_budgets(device):
    keys, queries, budgets = union_inputs(2, 2, 2, 4, 30, torch.float32, device, seed=6)
    zero = torch.zeros_like(budgets)
    # budget 0 keeps only the sinks
    only_sinks = ops.gvote_union_mask(keys, queries, zero, 5, 0.25)
    assert only_sinks[..., :5].all() and not only_sinks[..., 5:].any()
    assert not ops.gvote_union_mask(keys, queries, zero, 0, 0.25).any()
    # sinks beyond T keep everything; sinks are always kept whatever the budgets
    assert ops.gvote_union_mask(keys, queries, zero, 100, 0.25).all()
    assert ops.gvote_union_mask(keys, queries, budgets, 3, 0.25)[..., :3].all()
    # budgets >= T (or huge) keep everything, negative budgets keep nothing
    assert ops.gvote_union_mask(keys, queries, torch.full_like(budgets, 30), 0, 0.25).all()
    assert ops.gvote_union_mask(keys, queries, torch.full_like(budgets, 2**62), 0, 0.25).all()
    assert not ops.gvote_union_mask(keys, queries, torch.full_like(budgets, -5), 0, 0.25).any()
    # one head with budget >= T makes its kv head keep everything, the other kv head is unaffected
    one = zero.clone()
    one[1, 2] = 31
    mask = ops.gvote_union_mask(keys, queries, one, 0, 0.25)
    assert mask[1, 1].all() and not mask[1, 0].any() and not mask[0].any()


@pytest.mark.parametrize("device", DEVICES)
def test_union_mask_ties_go_to_the_lower_slot(device):
    keys = torch.ones(1, 1, 12, 4, device=device)  # every logit equal
    queries = torch.ones(1, 2, 3, 4, device=device)
    budgets = torch.tensor([[3, 5]], device=device)
    mask = ops.gvote_union_mask(keys, queries, budgets, 0, 1.0)
    assert mask[0, 0].tolist() == [True] * 5 + [False] * 7
    # -0 and +0 tie as well
    keys = torch.zeros(1, 1, 6, 4, device=device)
    keys[0, 0, ::2] = -0.0
    mask = ops.gvote_union_mask(keys, torch.ones(1, 1, 1, 4, device=device), torch.tensor([[2]], device=device), 0, 1.0)
    assert mask[0, 0].tolist() == [True, True, False, False, False, False]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_union_mask_nan_and_inf_logits(device, dtype):
    """NaN logits rank below everything (-inf included) and are only kept when the budget reaches them; +-inf keys
    are ordinary extremes. Never a crash or an out-of-range slot."""
    keys, queries, budgets = union_inputs(1, 2, 2, 3, 25, dtype, device, seed=8, budget_range=(1, 26))
    keys[0, 0, [2, 5]] = NAN  # NaN logits in every row of kv head 0
    keys[0, 1, 4, 0] = INF  # +-inf logits
    keys[0, 1, 9] = -INF  # -inf or NaN logits (inf * 0 is impossible: queries are nonzero)
    queries[0, 3, 1] = NAN  # a whole row of NaN logits: keeps the first k slots
    got = ops.gvote_union_mask(keys, queries, budgets, 1, 0.5, chunk_size=4)
    assert torch.equal(got.cpu(), expected_mask(keys, queries, budgets, 1, 0.5))
    small = torch.full_like(budgets, 23)
    mask = ops.gvote_union_mask(keys[:, :1], queries[:, :2], small[:, :2], 0, 0.5)
    assert not mask[0, 0, 2] and not mask[0, 0, 5] and mask[0, 0].sum() == 23  # the two NaN slots are last


@pytest.mark.parametrize("device", DEVICES)
def test_union_mask_degenerate_shapes(device):
    keys, queries, budgets = union_inputs(1, 2, 2, 3, 10, torch.float32, device)
    assert ops.gvote_union_mask(keys, queries[:, :, :0], budgets, 2, 1.0).sum() == 2 * 2  # no samples: sinks
    empty = ops.gvote_union_mask(keys[:, :, :0], queries, budgets, 2, 1.0)
    assert empty.shape == (1, 2, 0)
    assert ops.gvote_union_mask(keys[:0], queries[:0], budgets[:0], 2, 1.0).shape == (0, 2, 10)


@pytest.mark.parametrize("device", DEVICES)
def test_union_mask_non_contiguous_inputs(device):
    keys, queries, budgets = union_inputs(2, 3, 2, 4, 33, torch.float32, device, seed=12, budget_range=(0, 12))
    keys_t = keys.transpose(1, 2).contiguous().transpose(1, 2)
    queries_t = queries.transpose(1, 2).contiguous().transpose(1, 2)
    budgets_t = budgets.t().contiguous().t()
    assert not keys_t.is_contiguous() and not budgets_t.is_contiguous()
    assert torch.equal(ops.gvote_union_mask(keys_t, queries_t, budgets_t, 1, 0.3, 5),
                       ops.gvote_union_mask(keys, queries, budgets, 1, 0.3, 5))


def test_pipeline_from_decode_attention():
    """The press's path: A0 from decode_attention, budget, averaged RoPE, union mask: all on device, shapes agree."""
    keys, queries, _ = union_inputs(1, 3, 3, 8, 120, torch.float32, "cpu", dim=64, seed=13)
    last_query = torch.randn(1, 9, 1, 64)
    _, probs = ops.decode_attention(last_query, keys, keys, torch.zeros(1, 3, 120))
    budgets = ops.nucleus_budget(probs[:, :, 0], 0.95)
    assert torch.equal(budgets, reference.nucleus_budget(probs[:, :, 0], 0.95))
    cos, sin = rope_tables(range(120, 632), 64, torch.float32, "cpu")
    sampled = ops.averaged_rope(queries, cos, sin)
    mask = ops.gvote_union_mask(keys, sampled, budgets, 4)
    assert torch.equal(mask, expected_mask(keys, sampled, budgets, 4, 64**-0.5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("total_len", [1000, 4096, 8191])
def test_union_mask_at_scale_matches_python_set_union(device, dtype, total_len):
    """Long rows (on CUDA the skipped and used slot bytes of the radix select), SmolLM2 / Llama-shaped heads, several
    chunkings, against the reference's set union of top-k slots."""
    for kv_heads, group, dim in ((3, 3, 64), (8, 4, 128)):
        keys, queries, budgets = union_inputs(2, kv_heads, group, 8, total_len, dtype, device, dim=dim, seed=total_len,
                                              budget_range=(0, total_len // 4))
        expected = expected_mask(keys, queries, budgets, 4, dim**-0.5)
        for chunk in (5, 64, 10_000):
            assert torch.equal(ops.gvote_union_mask(keys, queries, budgets, 4, dim**-0.5, chunk).cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_union_mask_many_ties(device):
    """Quantised keys: masses of exactly equal logits, where only the slot decides (on CUDA all 8 radix passes)."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randint(-2, 3, (1, 2, 70_000, 8), generator=generator).float().to(device)
    queries = torch.randint(-1, 2, (1, 4, 4, 8), generator=generator).float().to(device)
    budgets = torch.tensor([[5, 1000, 33_333, 69_999]], device=device)
    got = ops.gvote_union_mask(keys, queries, budgets, 0, 1.0, 3)
    assert torch.equal(got.cpu(), expected_mask(keys, queries, budgets, 0, 1.0))


@CUDA
def test_union_mask_cuda_peak_memory_is_chunk_bounded():
    """Extra memory beyond inputs and output: about chunk_size x T float32 logits, far below the S x Hq x T of the
    reference."""
    keys, queries, budgets = union_inputs(1, 3, 3, 8, 65_536, torch.float32, "cuda", dim=64, seed=0,
                                          budget_range=(100, 5000))
    ops.gvote_union_mask(keys, queries, budgets, 4, 0.125, 8)  # warm up CUB / cuBLAS workspaces
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ops.gvote_union_mask(keys, queries, budgets, 4, 0.125, 8)
    extra = torch.cuda.max_memory_allocated() - base
    full_logits = 9 * 8 * 65_536 * 4
    assert extra < 8 * 65_536 * 4 + 3 * 65_536 + (8 << 20), extra  # logits + mask + workspace slack
    assert extra < full_logits / 4


@CUDA
def test_cuda_runs_on_the_current_stream():
    keys, queries, budgets = union_inputs(1, 3, 3, 8, 3000, torch.bfloat16, "cuda", dim=64, seed=3,
                                          budget_range=(0, 500))
    probs = attention_rows(1, 9, 3000, "cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        budget = ops.nucleus_budget(probs, 0.95)
        mask = ops.gvote_union_mask(keys, queries, budgets, 4, 0.125, 7)
    stream.synchronize()
    assert torch.equal(budget.cpu(), ops.nucleus_budget(probs.cpu(), 0.95))
    assert torch.equal(mask.cpu(), ops.gvote_union_mask(keys.cpu(), queries.cpu(), budgets.cpu(), 4, 0.125, 7))


# ---------------------------------------------------------------------------------------------------------------
# dispatcher, opcheck, torch.compile


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    probs = attention_rows(2, 3, 17, device)
    torch.library.opcheck(torch.ops.kvcomp.nucleus_budget.default, (probs, 0.9))
    cos, sin = rope_tables(range(5), 8, torch.float32, device)
    for dtype in (torch.float32, torch.bfloat16):
        queries = torch.randn(2, 3, 4, 8, device=device, dtype=dtype)
        torch.library.opcheck(torch.ops.kvcomp.averaged_rope.default, (queries, cos, sin))
        keys, queries, budgets = union_inputs(2, 3, 2, 4, 19, dtype, device, seed=1)
        torch.library.opcheck(torch.ops.kvcomp.gvote_union_mask.default, (keys, queries, budgets, 2, 0.3, 5))


def test_compile_fullgraph():
    def select(probs, keys, queries, cos, sin):
        budgets = ops.nucleus_budget(probs, 0.95)
        mask = ops.gvote_union_mask(keys, ops.averaged_rope(queries, cos, sin), budgets, 4, 0.25, 16)
        return mask.sum(-1), budgets * 2

    compiled = torch.compile(select, fullgraph=True)
    keys, queries, _ = union_inputs(1, 3, 3, 8, 50, torch.float32, "cpu", dim=16, seed=2)
    cos, sin = rope_tables(range(50, 60), 16, torch.float32, "cpu")
    args = (attention_rows(1, 9, 50, "cpu"), keys, queries, cos, sin)
    for got, expected in zip(compiled(*args), select(*args)):
        assert torch.equal(got, expected)


# ---------------------------------------------------------------------------------------------------------------
# bad input


def bad_union_cases():
    k, q, b = union_inputs(2, 3, 2, 4, 10, torch.float32, "cpu")
    return [
        ((k[0], q, b, 1, 1.0, 4), r"expected keys of shape \(B, H, T, d\), got a 3-d tensor"),
        ((k, q[0], b, 1, 1.0, 4), r"expected queries of shape \(B, Hq, S, d\), got a 3-d tensor"),
        ((k, q, b[0], 1, 1.0, 4), r"expected budgets of shape \(B, Hq\), got a 1-d tensor"),
        ((k.int(), q, b, 1, 1.0, 4), r"expected keys of dtype float32, float16 or bfloat16, got Int"),
        ((k, q.half(), b, 1, 1.0, 4), r"expected queries of the dtype of keys \(Float\), got Half"),
        ((k, q, b.int(), 1, 1.0, 4), r"expected budgets of dtype Long, got Int"),
        ((k, q[:1], b, 1, 1.0, 4), r"expected queries.size\(0\) == 2 \(batch of keys\)"),
        ((k, q[..., :3], b, 1, 1.0, 4), r"expected queries.size\(3\) == 16 \(head dim of keys\)"),
        ((k, q[:, :5], b[:, :5], 1, 1.0, 4),
         r"expected the query heads of queries \(5\) to be a multiple of the kv heads of keys \(3\)"),
        ((k, q, b[:, :3], 1, 1.0, 4), r"expected budgets.size\(1\) == 6 \(query heads of queries\)"),
        ((k, q, b, -1, 1.0, 4), r"expected sinks >= 0, got sinks = -1"),
        ((k, q, b, 1, 0.0, 4), r"expected a finite float32 scale > 0, got scale = 0"),
        ((k, q, b, 1, NAN, 4), r"expected a finite float32 scale > 0, got scale = nan"),
        ((k, q, b, 1, -1.0, 4), r"expected a finite float32 scale > 0, got scale = -1"),
        ((k, q, b, 1, 1.0, 0), r"expected chunk_size >= 1, got chunk_size = 0"),
    ]


@pytest.mark.parametrize("case", range(15))
def test_bad_union_input_names_op_and_value(case):
    args, message = bad_union_cases()[case]
    with pytest.raises(RuntimeError, match=r"kvcomp::gvote_union_mask: " + message):
        torch.ops.kvcomp.gvote_union_mask(*args)


@pytest.mark.parametrize(
    "make_args,message",
    [
        (lambda p: (p[0], 0.9), r"expected probs of shape \(B, Hq, T\), got a 2-d tensor"),
        (lambda p: (p.double(), 0.9), r"expected probs of dtype Float, got Double"),
        (lambda p: (p, 0.0), r"expected p in \(0, 1\], got p = 0"),
        (lambda p: (p, 1.5), r"expected p in \(0, 1\], got p = 1.5"),
        (lambda p: (p, 1.0000001), r"expected p in \(0, 1\], got p = 1.0000001"),  # (not rounded to 1)
        (lambda p: (p, NAN), r"expected p in \(0, 1\], got p = nan"),
    ],
)
def test_bad_budget_input_names_op_and_value(make_args, message):
    with pytest.raises(RuntimeError, match=r"kvcomp::nucleus_budget: " + message):
        torch.ops.kvcomp.nucleus_budget(*make_args(attention_rows(1, 2, 5, "cpu")))


@pytest.mark.parametrize(
    "make_args,message",
    [
        (lambda q, c, s: (q[0], c, s), r"expected queries of shape \(B, Hq, S, d\), got a 3-d tensor"),
        (lambda q, c, s: (q, c[None], s), r"expected cos of shape \(n_f, d\), got a 3-d tensor"),
        (lambda q, c, s: (q.int(), c, s), r"expected queries of dtype float32, float16 or bfloat16, got Int"),
        (lambda q, c, s: (q[..., :7], c[:, :7], s[:, :7]), r"expected an even head dim d"),
        (lambda q, c, s: (q, c[:, :4], s), r"expected cos.size\(1\) == 8 \(head dim of queries\)"),
        (lambda q, c, s: (q, c, s[:2]), r"expected sin.size\(0\) == 3 \(positions of cos\)"),
        (lambda q, c, s: (q, c[:0], s[:0]), r"expected at least one future position"),
    ],
)
def test_bad_rope_input_names_op_and_value(make_args, message):
    cos, sin = rope_tables(range(3), 8, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"kvcomp::averaged_rope: " + message):
        torch.ops.kvcomp.averaged_rope(*make_args(torch.randn(1, 2, 3, 8), cos, sin))


@CUDA
def test_mixed_devices_rejected():
    k, q, b = union_inputs(1, 2, 2, 3, 10, torch.float32, "cuda")
    with pytest.raises(RuntimeError, match=r"kvcomp::gvote_union_mask: expected budgets on the device of keys"):
        torch.ops.kvcomp.gvote_union_mask(k, q, b.cpu(), 1, 1.0, 4)
    cos, sin = rope_tables(range(3), 16, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"kvcomp::averaged_rope: expected cos on the device of queries"):
        torch.ops.kvcomp.averaged_rope(q, cos, sin)
