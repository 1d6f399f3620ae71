"""kvcomp::zsmerge_prefill and kvcomp::zsmerge_decode_step against their plain-PyTorch references, the paper's
invariants, a hand-built walk-through with the budgets of the paper's Figure 2, ties and NaN, opcheck,
torch.compile and bad input.

Cache layout per (batch, kv head), M = Br + Bc + Bp: [residual merge slots | context (top score) | recent ring].
Budgets below are written (recent, context, residual) = (Bp, Bc, Br), the order of the op arguments.
"""

import pytest
import torch

from kvpress_cpp import ops
from tests import reference
from tests.layouts import in_strided_rows, outside

pytestmark = pytest.mark.independent_of_transformers

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BUDGETS = [(3, 4, 2), (2, 3, 0), (4, 5, 1), (3, 4, 5), (1, 1, 3)]  # (recent, context, residual)
BUDGET_IDS = ["Bp3-Bc4-Br2", "Bp2-Bc3-Br0", "Bp4-Bc5-Br1", "Bp3-Bc4-Br5", "Bp1-Bc1-Br3"]


def tolerances(dtype):
    """Merged rows are computed in float32 and rounded to the cache dtype; allow one rounding step of it."""
    return {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}


def make_prefill_inputs(batch, heads, tokens, head_dim, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, tokens, head_dim, generator=generator)
    values = torch.randn(batch, heads, tokens, head_dim, generator=generator)
    scores = torch.rand(batch, heads, tokens, generator=generator)
    return keys.to(device, dtype), values.to(device, dtype), scores.to(device)


def make_decode_inputs(batch, heads, budget, num_new, head_dim, dtype, device, seed=0):
    """A full cache of M slots plus num_new appended tokens; residual slots carry counts > 1 as after merges."""
    recent, context, residual = budget
    slots = recent + context + residual + num_new
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, slots, head_dim, generator=generator)
    values = torch.randn(batch, heads, slots, head_dim, generator=generator)
    scores = torch.rand(batch, heads, slots, generator=generator)
    counts = torch.ones(batch, heads, slots)
    counts[:, :, :residual] = torch.randint(1, 7, (batch, heads, residual), generator=generator).float()
    return [keys.to(device, dtype), values.to(device, dtype), scores.to(device), counts.to(device)]


def run_decode(step, cache, ring_position, budget, paper_order=False):
    """Applies a decode step (op or reference) to clones; returns the M result slots of each tensor."""
    cache = [t.clone() for t in cache]
    step(*cache, ring_position, *budget, paper_order=paper_order) if paper_order else step(*cache, ring_position,
                                                                                             *budget)
    slots = sum(budget)
    return [t[:, :, :slots] for t in cache]


def assert_caches_close(got, expected, dtype):
    for name, a, b in zip(("keys", "values", "scores", "counts"), got, expected):
        torch.testing.assert_close(a, b, equal_nan=True, msg=lambda m, name=name: f"{name}: {m}",
                                   **(tolerances(dtype) if name in ("keys", "values") else {"rtol": 0, "atol": 0}))


# ----------------------------------------------------------------------------------------------------------------
# prefill


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("budget", BUDGETS, ids=BUDGET_IDS)
@pytest.mark.parametrize("heads", [2, 3])
# 0: as many tokens as slots (a residual slot per evicted token, Algorithm 1's cache when it first fills up);
# 1: one token more than the budget
@pytest.mark.parametrize("tokens", [0, 1, 31])
def test_prefill_matches_reference(device, dtype, budget, heads, tokens):
    tokens = tokens if tokens > sum(budget) else sum(budget) + tokens
    keys, values, scores = make_prefill_inputs(2, heads, tokens, 16, dtype, device)
    got = ops.zsmerge_prefill(keys, values, scores, *budget)
    expected = reference.zsmerge_prefill(keys, values, scores, *budget)
    slots = sum(budget)
    assert [tuple(t.shape) for t in got] == [(2, heads, slots, 16)] * 2 + [(2, heads, slots)] * 2
    assert [t.dtype for t in got] == [dtype, dtype, torch.float32, torch.float32]
    assert all(t.device.type == device for t in got)
    assert_caches_close(got, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", BUDGETS, ids=BUDGET_IDS)
def test_prefill_counts_recent_and_context(device, budget):
    recent, context, residual = budget
    tokens = 29
    keys, values, scores = make_prefill_inputs(2, 3, tokens, 8, torch.float32, device, seed=1)
    out_keys, out_values, out_scores, counts = ops.zsmerge_prefill(keys, values, scores, recent, context, residual)
    # Σ w over the slots = the tokens represented: all T of them, or T minus the evicted ones with Br = 0.
    represented = tokens if residual > 0 else recent + context
    assert (counts.sum(-1) == represented).all()
    assert (counts[:, :, residual:] == 1).all()
    # the recent ring holds the last Bp tokens in order, oldest first (ring_position 0), untouched.
    torch.testing.assert_close(out_keys[:, :, -recent:], keys[:, :, -recent:], rtol=0, atol=0)
    torch.testing.assert_close(out_values[:, :, -recent:], values[:, :, -recent:], rtol=0, atol=0)
    torch.testing.assert_close(out_scores[:, :, -recent:], scores[:, :, -recent:], rtol=0, atol=0)
    # the context region holds the top-Bc of the older tokens, in position order, with their scores.
    candidates = scores[:, :, : tokens - recent]
    top = candidates.topk(context, -1).indices.sort(-1).values
    torch.testing.assert_close(out_scores[:, :, residual : residual + context], candidates.gather(-1, top))
    expected_keys = keys.gather(2, top.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
    torch.testing.assert_close(out_keys[:, :, residual : residual + context], expected_keys, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_groups_are_contiguous_means(device):
    """n = 7 residual tokens into Br = 3 groups: sizes 3, 2, 2 (the first n mod Br one longer), in position order."""
    recent, context, residual = 2, 2, 3
    tokens = recent + context + 7
    keys, values, _ = make_prefill_inputs(1, 1, tokens, 4, torch.float32, device, seed=2)
    scores = torch.zeros(1, 1, tokens, device=device)
    scores[0, 0, [3, 6]] = 1.0  # context = tokens 3 and 6; residual tokens 0 1 2 4 | 5 7 | 8
    out_keys, out_values, out_scores, counts = ops.zsmerge_prefill(keys, values, scores, recent, context, residual)
    assert counts[0, 0].tolist() == [3, 2, 2, 1, 1, 1, 1]
    for slot, members in enumerate([[0, 1, 2], [4, 5], [7, 8]]):
        torch.testing.assert_close(out_keys[0, 0, slot], keys[0, 0, members].mean(0))
        torch.testing.assert_close(out_values[0, 0, slot], values[0, 0, members].mean(0))
    torch.testing.assert_close(out_keys[0, 0, 3:5], keys[0, 0, [3, 6]], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_group_score_is_group_max(device):
    recent, context, residual = 1, 1, 2
    scores = torch.tensor([[[0.2, 0.7, 0.1, 0.9, 0.3, 0.5]]], device=device)  # context = token 3 (0.9)
    keys, values, _ = make_prefill_inputs(1, 1, 6, 4, torch.float32, device)
    _, _, out_scores, counts = ops.zsmerge_prefill(keys, values, scores, recent, context, residual)
    # residual tokens 0 1 2 4 -> groups [0, 1] and [2, 4]
    assert out_scores[0, 0].tolist() == pytest.approx([0.7, 0.3, 0.9, 0.5])
    assert counts[0, 0].tolist() == [2, 2, 1, 1]


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_ties_go_to_the_lower_position(device):
    recent, context, residual = 2, 3, 1
    tokens = 12
    keys, values, _ = make_prefill_inputs(2, 2, tokens, 4, torch.float32, device)
    scores = torch.full((2, 2, tokens), 0.5, device=device)
    scores[1, 1, ::2] = -0.0  # -0.0 ties with +0.0
    scores[1, 1, 1::2] = 0.0
    out_keys, _, _, _ = ops.zsmerge_prefill(keys, values, scores, recent, context, residual)
    torch.testing.assert_close(out_keys[:, :, residual : residual + context], keys[:, :, :context], rtol=0, atol=0)
    assert_caches_close(ops.zsmerge_prefill(keys, values, scores, recent, context, residual),
                        reference.zsmerge_prefill(keys, values, scores, recent, context, residual), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_nan_ranks_below_every_number(device):
    recent, context, residual = 1, 3, 1
    nan, inf = float("nan"), float("inf")
    scores = torch.tensor([[[nan, -inf, nan, 0.1, nan, -inf, nan, 0.0]]], device=device)
    keys, values, _ = make_prefill_inputs(1, 1, 8, 4, torch.float32, device)
    out_keys, _, out_scores, counts = ops.zsmerge_prefill(keys, values, scores, recent, context, residual)
    # candidates 0..6: 0.1 (3), then -inf (1) and -inf (5); the NaNs 0 2 4 6 go to the residual slot.
    torch.testing.assert_close(out_keys[0, 0, 1:4], keys[0, 0, [1, 3, 5]], rtol=0, atol=0)
    assert counts[0, 0].tolist() == [4, 1, 1, 1, 1]
    assert torch.isnan(out_scores[0, 0, 0])  # the group max propagates NaN


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("residual", [0, 2])
def test_prefill_all_nan_scores_still_valid(device, residual):
    recent, context = 2, 3
    keys, values, _ = make_prefill_inputs(2, 2, 15, 8, torch.float32, device)
    scores = torch.full((2, 2, 15), float("nan"), device=device)
    out_keys, out_values, out_scores, counts = ops.zsmerge_prefill(keys, values, scores, recent, context, residual)
    torch.testing.assert_close(out_keys[:, :, residual : residual + context], keys[:, :, :context], rtol=0, atol=0)
    assert torch.isfinite(out_keys).all() and torch.isfinite(out_values).all() and torch.isnan(out_scores).all()
    assert (counts.sum(-1) == (15 if residual else recent + context)).all()


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_residual_zero_is_eviction(device):
    """Br = 0: the non-selected tokens are evicted, the rest is copied bit for bit."""
    recent, context = 3, 4
    keys, values, scores = make_prefill_inputs(2, 2, 20, 8, torch.bfloat16, device, seed=4)
    out_keys, out_values, out_scores, counts = ops.zsmerge_prefill(keys, values, scores, recent, context, 0)
    top = scores[:, :, :-recent].topk(context, -1).indices.sort(-1).values
    kept = torch.cat([top, torch.arange(17, 20, device=device).expand(2, 2, 3)], -1)
    rows = kept.unsqueeze(-1).expand(-1, -1, -1, 8)
    assert torch.equal(out_keys, keys.gather(2, rows)) and torch.equal(out_values, values.gather(2, rows))
    assert torch.equal(out_scores, scores.gather(2, kept)) and (counts == 1).all()


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_accepts_non_contiguous_inputs(device):
    keys, values, scores = make_prefill_inputs(2, 3, 20, 8, torch.float32, device, seed=5)
    as_views = [keys.transpose(1, 2).contiguous().transpose(1, 2), values[..., ::1], scores.transpose(0, 1).contiguous().transpose(0, 1)]
    assert not as_views[0].is_contiguous()
    assert_caches_close(ops.zsmerge_prefill(*as_views, 3, 4, 2), ops.zsmerge_prefill(keys, values, scores, 3, 4, 2),
                        torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_large_groups_and_head_dim(device, dtype):
    """More group members than the CUDA block's 128 threads (strided score max) and d above the block size."""
    keys, values, scores = make_prefill_inputs(1, 2, 400, 160, dtype, device, seed=6)
    scores[0, 1, 250] = float("nan")
    got = ops.zsmerge_prefill(keys, values, scores, 8, 16, 1)
    assert_caches_close(got, reference.zsmerge_prefill(keys, values, scores, 8, 16, 1), dtype)
    assert got[3][0, 0, 0] == 400 - 24 and torch.isnan(got[2][0, 1, 0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", BUDGETS, ids=BUDGET_IDS)
def test_prefill_vectorised_baseline_matches_reference(device, budget):
    keys, values, scores = make_prefill_inputs(2, 3, 27, 8, torch.bfloat16, device, seed=20)
    scores[0, 0, ::3] = float("nan")
    scores[0, 1, ::2] = 0.5
    scores[1, 1] = float("nan")
    assert_caches_close(reference.zsmerge_prefill_vectorised(keys, values, scores, *budget),
                        reference.zsmerge_prefill(keys, values, scores, *budget), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_empty_batch(device):
    keys, values, scores = make_prefill_inputs(0, 2, 12, 8, torch.float32, device)
    out = ops.zsmerge_prefill(keys, values, scores, 2, 3, 1)
    assert [tuple(t.shape) for t in out] == [(0, 2, 6, 8)] * 2 + [(0, 2, 6)] * 2


# ----------------------------------------------------------------------------------------------------------------
# decode step


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("budget", BUDGETS, ids=BUDGET_IDS)
@pytest.mark.parametrize("heads", [2, 3])
@pytest.mark.parametrize("num_new", [1, 3])
@pytest.mark.parametrize("paper_order", [False, True], ids=["authors", "paper"])
def test_decode_matches_reference(device, dtype, budget, heads, num_new, paper_order):
    ring_position = budget[0] - 1  # the ring wraps within the q steps whenever q > 1
    cache = make_decode_inputs(2, heads, budget, num_new, 16, dtype, device)
    got = run_decode(ops.zsmerge_decode_step, cache, ring_position, budget, paper_order)
    expected = run_decode(reference.zsmerge_decode_step, cache, ring_position, budget, paper_order)
    assert_caches_close(got, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ring_position", [0, 1, 3])
@pytest.mark.parametrize("paper_order", [False, True], ids=["authors", "paper"])
def test_decode_every_ring_position(device, ring_position, paper_order):
    budget = (4, 3, 2)
    cache = make_decode_inputs(2, 2, budget, 5, 8, torch.float32, device, seed=7)
    assert_caches_close(run_decode(ops.zsmerge_decode_step, cache, ring_position, budget, paper_order),
                        run_decode(reference.zsmerge_decode_step, cache, ring_position, budget, paper_order),
                        torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_paper_order_evicts_the_leaving_recent_token_when_it_scores_lowest(device):
    """Algorithm 1 of the paper: the token leaving the recent window joins the context before the argmin. With the
    lowest score of all it is merged itself (the context stays as it was); the authors' order evicts the context's
    lowest instead and keeps the leaving token. A tie keeps the leaving token in both orders."""
    budget = (3, 4, 1)  # recent, context, residual: slots [0] residual, [1, 5) context, [5, 8) ring, [8] new
    keys, values, scores, counts = make_decode_inputs(1, 1, budget, 1, 8, torch.float32, device, seed=3)
    scores[0, 0, 1:5] = torch.tensor([0.5, 0.2, 0.7, 0.9])
    scores[0, 0, 5] = 0.1  # the oldest recent token at ring_position 0
    cache = [keys, values, scores, counts]
    paper = run_decode(ops.zsmerge_decode_step, cache, 0, budget, paper_order=True)
    authors = run_decode(ops.zsmerge_decode_step, cache, 0, budget)
    merged = (keys[0, 0, 0] * counts[0, 0, 0] + keys[0, 0, 5]) / (counts[0, 0, 0] + 1)
    torch.testing.assert_close(paper[0][0, 0, 0], merged)
    torch.testing.assert_close(paper[0][0, 0, 1:5], keys[0, 0, 1:5])  # the context is untouched
    torch.testing.assert_close(paper[0][0, 0, 5], keys[0, 0, 8])  # the new token took the leaving one's ring slot
    torch.testing.assert_close(authors[0][0, 0, 2], keys[0, 0, 5])  # the leaving token replaced the context's 0.2
    scores[0, 0, 5] = 0.2  # a tie with the context's lowest: the context token goes, in the paper's order too
    tied = run_decode(ops.zsmerge_decode_step, cache, 0, budget, paper_order=True)
    torch.testing.assert_close(tied[0][0, 0, 2], keys[0, 0, 5])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_large_regions(device, dtype):
    """Context wider than the CUDA block (strided argmin), more residual slots than its 8 warps, d above 256."""
    budget = (5, 300, 20)
    cache = make_decode_inputs(2, 2, budget, 3, 300, dtype, device, seed=8)
    cache[2][0, :, 20:320:7] = float("nan")  # NaN inside the SIMD / strided part of the argmin
    cache[2][1, 1, 20:320] = float("nan")  # a whole context of NaN
    assert_caches_close(run_decode(ops.zsmerge_decode_step, cache, 2, budget),
                        run_decode(reference.zsmerge_decode_step, cache, 2, budget), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_on_strided_rows_updates_them_where_they_lie(device, dtype):
    """Rows at their own strides inside larger buffers (a paged cache's view over its block pools: each (batch, kv
    head) row contiguous, a gap after it) are updated in place as the contiguous cache would be, the gaps untouched."""
    budget = (3, 4, 2)
    cache = make_decode_inputs(2, 3, budget, 2, 8, dtype, device, seed=11)
    strided = [in_strided_rows(t) for t in cache]
    ops.zsmerge_decode_step(*(view for _, view in strided), 1, *budget)
    assert_caches_close([view[:, :, :sum(budget)] for _, view in strided],
                        run_decode(reference.zsmerge_decode_step, cache, 1, budget), dtype)
    for buffer, view in strided:
        assert bool((outside(buffer, view) == 7.0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", BUDGETS, ids=BUDGET_IDS)
def test_decode_vectorised_baseline_matches_reference(device, budget):
    cache = make_decode_inputs(2, 3, budget, 3, 8, torch.float32, device, seed=9)
    assert_caches_close(run_decode(reference.zsmerge_decode_step_vectorised, cache, 0, budget),
                        run_decode(reference.zsmerge_decode_step, cache, 0, budget), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", BUDGETS, ids=BUDGET_IDS)
@pytest.mark.parametrize("num_new", [1, 3])
def test_decode_counts_add_up(device, budget, num_new):
    """Σ w over the M slots grows by q (with Br = 0 it stays M: every step evicts one token)."""
    cache = make_decode_inputs(2, 3, budget, num_new, 8, torch.float32, device, seed=10)
    slots = sum(budget)
    before = cache[3][:, :, :slots].sum(-1)
    after = run_decode(ops.zsmerge_decode_step, cache, 0, budget)[3].sum(-1)
    torch.testing.assert_close(after, before + (num_new if budget[2] > 0 else 0), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_one_call_equals_token_by_token_calls(device):
    """q tokens in one call = q calls of one token each, narrowing to M and advancing ring_position in between."""
    budget = (3, 4, 2)
    slots = sum(budget)
    cache = make_decode_inputs(2, 3, budget, 4, 8, torch.float32, device, seed=11)
    at_once = run_decode(ops.zsmerge_decode_step, cache, 2, budget)
    state, ring_position = [t[:, :, :slots] for t in cache], 2
    for step in range(4):
        appended = [torch.cat([s, t[:, :, slots + step : slots + step + 1]], 2) for s, t in zip(state, cache)]
        state = run_decode(ops.zsmerge_decode_step, appended, ring_position, budget)
        ring_position = (ring_position + 1) % budget[0]
    assert_caches_close(at_once, state, torch.float32)


def token_identity_cache(batch, heads, budget, num_new, device, seed=12):
    """Values are one-hot token ids (a merged slot's value is the mean of its members' one-hots); keys random;
d = the number of tokens."""
    slots = sum(budget) + num_new
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, slots, slots, generator=generator)
    values = torch.eye(slots).expand(batch, heads, slots, slots).contiguous()
    scores = torch.rand(batch, heads, slots, generator=generator)
    return [keys.to(device), values.to(device), scores.to(device), torch.ones(batch, heads, slots, device=device)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_new", [1, 3])
def test_decode_residual_zero_is_pure_eviction(device, num_new):
    """Br = 0: each step evicts the lowest-score context token; its key and value appear nowhere afterwards, and
    every other token (old or new) appears exactly once, unchanged."""
    budget = (3, 5, 0)
    slots = sum(budget)
    cache = token_identity_cache(2, 2, budget, num_new, device)
    keys, values, scores, counts = run_decode(ops.zsmerge_decode_step, cache, 1, budget)
    for b in range(2):
        for h in range(2):
            score = cache[2][b, h].tolist()
            context, ring, evicted = list(range(0, 5)), [5, 6, 7], []  # slots = token ids at the start
            ring_position = 1
            for step in range(num_new):  # token ids, as the paper's Algorithm 1 moves them
                victim = min(context, key=lambda token: score[token])
                evicted.append(victim)
                context[context.index(victim)] = ring[ring_position]
                ring[ring_position] = slots + step
                ring_position = (ring_position + 1) % 3
            present = values[b, h].argmax(-1).tolist()
            assert sorted(present) == sorted(set(range(slots + num_new)) - set(evicted))
            assert (values[b, h].sum(-1) == 1).all() and (counts == 1).all()
            for victim in evicted:
                assert not (keys[b, h] == cache[0][b, h, victim]).all(-1).any()
            torch.testing.assert_close(keys[b, h], cache[0][b, h, present], rtol=0, atol=0)
            torch.testing.assert_close(scores[b, h], cache[2][b, h, present], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_merged_value_is_the_mean_of_its_tokens(device):
    """With one-hot values and counts, a residual slot always holds the exact mean of the tokens merged into it."""
    budget = (2, 3, 2)
    cache = token_identity_cache(1, 3, budget, 4, device, seed=13)
    _, values, _, counts = run_decode(ops.zsmerge_decode_step, cache, 0, budget)
    for slot in range(2):
        members = values[0, :, slot] > 0
        torch.testing.assert_close(members.sum(-1).float(), counts[0, :, slot], rtol=0, atol=0)
        torch.testing.assert_close(values[0, :, slot][members], (1 / counts[0, :, slot]).repeat_interleave(
            members.sum(-1)), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# The budgets of the paper's Figure 2 (Br = 2, Bc = 4, Bp = 3, T = 12 -> 17). The figure itself is an image that is
# not in the text, so its token values cannot be read off; this is a hand-built scenario with those budgets whose
# every slot is worked out below from Algorithm 1. Values are one-hot token ids (a slot's value names its tokens),
# keys are e0 ("A") or e1 ("B") for the tokens that get merged, so the argmax of eq. 6 is unambiguous.

FIG2_BUDGET = (3, 4, 2)  # (recent, context, residual)
FIG2_SCORES = [0.9, 0.1, 0.5, 0.7, 0.2, 0.8, 0.3, 0.05, 0.6, 0.4, 0.95, 0.15,  # prompt tokens 0..11
               0.3, 0.85, 0.75, 0.65, 0.99]  # generated tokens 12..16
FIG2_KEY_A, FIG2_KEY_B = [1, 2, 4, 9, 11], [3, 6, 7, 8, 12]


def figure2_tokens(device):
    keys = torch.zeros(17, 17)
    keys[:, 2] = 1.0  # tokens that never merge: e2
    keys[FIG2_KEY_A] = torch.eye(17)[0]
    keys[FIG2_KEY_B] = torch.eye(17)[1]
    values = torch.eye(17)
    scores = torch.tensor(FIG2_SCORES)
    return keys.view(1, 1, 17, 17).to(device), values.view(1, 1, 17, 17).to(device), scores.view(1, 1, 17).to(device)


def members(value_row):
    return sorted(torch.nonzero(value_row > 0).flatten().tolist())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens_per_call", [1, 5])
def test_figure2_budgets_walk_through(device, tokens_per_call):
    keys, values, scores = figure2_tokens(device)
    cache = list(ops.zsmerge_prefill(keys[:, :, :12], values[:, :, :12], scores[:, :, :12], *FIG2_BUDGET))
    # T = 12: recent = 9 10 11; context = top-4 of 0..8 = 0 (.9) 3 (.7) 5 (.8) 8 (.6); residual = 1 2 4 6 7 in two
    # contiguous groups, the first one longer: {1 2 4} (max score .5) and {6 7} (max .3).
    assert [members(v) for v in cache[1][0, 0]] == [[1, 2, 4], [6, 7], [0], [3], [5], [8], [9], [10], [11]]
    assert cache[3][0, 0].tolist() == [3, 2, 1, 1, 1, 1, 1, 1, 1]
    assert cache[2][0, 0].tolist() == pytest.approx([0.5, 0.3, 0.9, 0.7, 0.8, 0.6, 0.4, 0.95, 0.15])

    ring_position = 0
    for first in range(12, 17, tokens_per_call):
        new = slice(first, first + tokens_per_call)
        appended = [torch.cat([cache[0], keys[:, :, new]], 2), torch.cat([cache[1], values[:, :, new]], 2),
                    torch.cat([cache[2], scores[:, :, new]], 2),
                    torch.cat([cache[3], torch.ones(1, 1, tokens_per_call, device=device)], 2)]
        cache = run_decode(ops.zsmerge_decode_step, appended, ring_position, FIG2_BUDGET)
        ring_position = (ring_position + tokens_per_call) % 3
    # T = 13: evict 8 (.6, key B) into {6 7}; 9 leaves the ring into its slot; 12 takes ring slot 0.
    # T = 14: evict 9 (.4, A) into {1 2 4}; 10 -> context; 13 -> ring slot 1.
    # T = 15: evict 3 (.7, B) into {6 7 8}; 11 -> context; 14 -> ring slot 2.
    # T = 16: evict 11 (.15, A) into {1 2 4 9}; 12 -> context; 15 -> ring slot 0.
    # T = 17: evict 12 (.3, B) into {3 6 7 8}; 13 -> context; 16 -> ring slot 1.
    keys_out, values_out, scores_out, counts_out = (t[0, 0] for t in cache)
    assert [members(v) for v in values_out] == [[1, 2, 4, 9, 11], [3, 6, 7, 8, 12], [0], [13], [5], [10], [15], [16],
                                               [14]]
    assert ring_position == 2
    assert counts_out.tolist() == [5, 5, 1, 1, 1, 1, 1, 1, 1] and counts_out.sum() == 17
    assert scores_out.tolist() == pytest.approx([0.5, 0.7, 0.9, 0.85, 0.8, 0.95, 0.65, 0.99, 0.75])
    torch.testing.assert_close(values_out[:2], torch.tensor(  # each residual slot is the mean of its 5 tokens
        [[0.2 if i in FIG2_KEY_A else 0.0 for i in range(17)], [0.2 if i in FIG2_KEY_B else 0.0 for i in range(17)]],
        device=device))
    torch.testing.assert_close(keys_out[:2], torch.eye(17, device=device)[:2])  # merged keys stay A and B


# ----------------------------------------------------------------------------------------------------------------
# ties and NaN


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_ties_go_to_the_lower_slot(device, dtype):
    budget = (2, 4, 3)
    cache = make_decode_inputs(2, 2, budget, 1, 8, dtype, device, seed=14)
    cache[2][:, :, 3:7] = 0.25  # all context scores equal: i* = the first context slot (3)
    cache[0][:, :, 3] = 0.0  # k_i* = 0: every residual similarity is 0, j* = residual slot 0
    before = [t.clone() for t in cache]
    keys, values, scores, counts = run_decode(ops.zsmerge_decode_step, cache, 0, budget)
    w = before[3][:, :, 0]
    torch.testing.assert_close(counts[:, :, 0], w + 1, rtol=0, atol=0)
    merged = (before[1][:, :, 3].float() + w[..., None] * before[1][:, :, 0].float()) / (w + 1)[..., None]
    torch.testing.assert_close(values[:, :, 0], merged.to(dtype))
    torch.testing.assert_close(keys[:, :, 3], before[0][:, :, 7], rtol=0, atol=0)  # the oldest recent token moved in
    assert_caches_close([keys, values, scores, counts], run_decode(reference.zsmerge_decode_step, before, 0, budget),
                        dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_nan_scores_count_as_infinity(device):
    budget = (2, 4, 2)
    cache = make_decode_inputs(1, 2, budget, 1, 8, torch.float32, device, seed=15)
    cache[2][0, 0, 2:6] = torch.tensor([float("nan"), 0.5, float("nan"), 0.7])  # i* = slot 3, not a NaN one
    cache[2][0, 1, 2:6] = float("nan")  # all NaN: i* = the first context slot, 2
    keys, _, _, _ = run_decode(ops.zsmerge_decode_step, cache, 0, budget)
    torch.testing.assert_close(keys[0, 0, 3], cache[0][0, 0, 6], rtol=0, atol=0)
    torch.testing.assert_close(keys[0, 1, 2], cache[0][0, 1, 6], rtol=0, atol=0)
    assert_caches_close([keys, *run_decode(ops.zsmerge_decode_step, cache, 0, budget)[1:]],
                        run_decode(reference.zsmerge_decode_step, cache, 0, budget), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_nan_everywhere_stays_in_bounds(device, dtype):
    """NaN keys (every similarity NaN: j* = 0), NaN scores (i* = first context slot), NaN values: no crash, valid
    slots, counts still add up."""
    budget = (3, 4, 3)
    cache = make_decode_inputs(2, 2, budget, 3, 8, dtype, device, seed=16)
    cache[0][:, 1] = float("nan")
    cache[1][:, 1] = float("nan")
    cache[2][:, 1] = float("nan")
    cache[2][:, 0, :3] = float("nan")  # NaN residual scores propagate through max, harmlessly
    got = run_decode(ops.zsmerge_decode_step, cache, 2, budget)
    assert_caches_close(got, run_decode(reference.zsmerge_decode_step, cache, 2, budget), dtype)
    torch.testing.assert_close(got[3].sum(-1), cache[3][:, :, :10].sum(-1) + 3, rtol=0, atol=0)
    counts_head1 = got[3][:, 1]
    assert (counts_head1[:, 1:3] == cache[3][:, 1, 1:3]).all()  # all three merges went into residual slot 0


@pytest.mark.parametrize("device", DEVICES)
def test_decode_nan_similarity_counts_as_minus_infinity(device):
    """A NaN in residual slot 0's key makes k_i*·k_0 NaN: the merge goes to the best finite similarity instead."""
    budget = (2, 3, 3)
    cache = make_decode_inputs(2, 2, budget, 1, 8, torch.float32, device, seed=18)
    cache[0][:, :, 0, 5] = float("nan")
    got = run_decode(ops.zsmerge_decode_step, cache, 0, budget)
    assert (got[3][:, :, 0] == cache[3][:, :, 0]).all()  # slot 0 received nothing
    assert_caches_close(got, run_decode(reference.zsmerge_decode_step, cache, 0, budget), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_new_token_moves_with_its_count(device):
    """The new token moves into the ring with its own count (1 when the cache appends plain tokens)."""
    budget = (2, 3, 1)
    cache = make_decode_inputs(1, 2, budget, 1, 8, torch.float32, device, seed=19)
    cache[3][:, :, -1] = 2.0
    got = run_decode(ops.zsmerge_decode_step, cache, 1, budget)
    assert (got[3][:, :, 5] == 2.0).all()  # ring slot residual + context + 1


@pytest.mark.parametrize("device", DEVICES)
def test_decode_infinite_keys_do_not_crash(device):
    budget = (2, 3, 2)
    cache = make_decode_inputs(1, 1, budget, 2, 8, torch.float32, device, seed=17)
    cache[0][0, 0, 0] = float("inf")
    cache[0][0, 0, 1] = -float("inf")
    got = run_decode(ops.zsmerge_decode_step, cache, 0, budget)
    assert_caches_close(got, run_decode(reference.zsmerge_decode_step, cache, 0, budget), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_empty_batch(device):
    cache = make_decode_inputs(0, 2, (2, 3, 1), 1, 8, torch.float32, device)
    ops.zsmerge_decode_step(*cache, 0, 2, 3, 1)


# ----------------------------------------------------------------------------------------------------------------
# dispatcher, opcheck, torch.compile


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_prefill(device):
    for dtype, budget in ((torch.float32, (3, 4, 2)), (torch.bfloat16, (2, 3, 0))):
        keys, values, scores = make_prefill_inputs(2, 3, 17, 8, dtype, device)
        torch.library.opcheck(torch.ops.kvcomp.zsmerge_prefill.default, (keys, values, scores, *budget))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_decode_step(device):
    for dtype, budget, num_new in ((torch.float32, (3, 4, 2), 1), (torch.float16, (2, 3, 0), 3)):
        cache = make_decode_inputs(2, 3, budget, num_new, 8, dtype, device)
        torch.library.opcheck(torch.ops.kvcomp.zsmerge_decode_step.default, (*cache, 1, *budget))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_prefill(device):
    def prefill_and_bias(keys, values, scores):
        keys, values, scores, counts = ops.zsmerge_prefill(keys, values, scores, 3, 4, 2)
        return keys, values, scores, 0.6 * counts.log()

    compiled = torch.compile(prefill_and_bias, fullgraph=True)
    inputs = make_prefill_inputs(2, 2, 19, 8, torch.float32, device)
    for got, expected in zip(compiled(*inputs), prefill_and_bias(*inputs)):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_decode_step(device):
    budget = (3, 4, 2)

    def step(keys, values, scores, counts):
        ops.zsmerge_decode_step(keys, values, scores, counts, 2, *budget)
        return keys[:, :, :9] * 1.0, 0.6 * counts[:, :, :9].log()

    compiled = torch.compile(step, fullgraph=True)
    cache = make_decode_inputs(2, 2, budget, 2, 8, torch.float32, device)
    eager_cache, compiled_cache = [t.clone() for t in cache], [t.clone() for t in cache]
    for got, expected in zip(compiled(*compiled_cache), step(*eager_cache)):
        torch.testing.assert_close(got, expected)
    for got, expected in zip(compiled_cache, eager_cache):  # the mutation reached the caller's tensors
        torch.testing.assert_close(got, expected)


# ----------------------------------------------------------------------------------------------------------------
# bad input

PREFILL_BAD_INPUTS = [
    (lambda k, v, s: (k[0], v, s, 3, 4, 2), r"expected keys of shape \(B, H, T, d\), got a 3-d tensor"),
    (lambda k, v, s: (k, v[0], s, 3, 4, 2), r"expected values of shape \(B, H, T, d\), got a 3-d tensor"),
    (lambda k, v, s: (k, v, s[0], 3, 4, 2), r"expected scores of shape \(B, H, T\), got a 2-d tensor"),
    (lambda k, v, s: (k.int(), v.int(), s, 3, 4, 2), r"expected keys of dtype float32, float16 or bfloat16, got Int"),
    (lambda k, v, s: (k, v.half(), s, 3, 4, 2), r"expected values of the dtype of keys \(Float\), got Half"),
    (lambda k, v, s: (k, v, s.double(), 3, 4, 2), r"expected scores of dtype Float, got Double"),
    (lambda k, v, s: (k, v[..., :4], s, 3, 4, 2), r"expected values of the shape of keys \(\[2, 3, 20, 8\]\), got \[2, 3, 20, 4\]"),
    (lambda k, v, s: (k, v, s[:1], 3, 4, 2), r"expected scores.size\(0\) == 2 \(batch of keys\)"),
    (lambda k, v, s: (k, v, s[:, :2], 3, 4, 2), r"expected scores.size\(1\) == 3 \(kv heads of keys\)"),
    (lambda k, v, s: (k, v, s[..., :-1], 3, 4, 2), r"expected scores.size\(2\) == 20 \(slots of keys\)"),
    (lambda k, v, s: (k, v, s, 0, 4, 2), r"expected recent >= 1, got 0"),
    (lambda k, v, s: (k, v, s, 3, 0, 2), r"expected context >= 1, got 0"),
    (lambda k, v, s: (k, v, s, 3, 4, -1), r"expected residual >= 0, got -1"),
    (lambda k, v, s: (k, v, s, 10, 8, 3),
     r"expected at least as many tokens as slots, T = keys.size\(2\) >= M = .* = 21, got T = 20"),
]


@pytest.mark.parametrize("make_args,message", PREFILL_BAD_INPUTS)
def test_prefill_bad_input_names_op_and_value(make_args, message):
    keys, values, scores = make_prefill_inputs(2, 3, 20, 8, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"kvcomp::zsmerge_prefill: " + message):
        torch.ops.kvcomp.zsmerge_prefill(*make_args(keys, values, scores))


def non_contiguous(t):
    return t.transpose(0, 1).contiguous().transpose(0, 1)


DECODE_BAD_INPUTS = [  # cache of M = 9 slots + q = 2 new tokens, (recent, context, residual) = (3, 4, 2)
    (lambda k, v, s, c: (k[0], v, s, c, 0, 3, 4, 2), r"expected keys of shape \(B, H, M \+ q, d\), got a 3-d tensor"),
    (lambda k, v, s, c: (k, v, s[0], c, 0, 3, 4, 2), r"expected scores of shape \(B, H, M \+ q\), got a 2-d tensor"),
    (lambda k, v, s, c: (k, v, s, c[0], 0, 3, 4, 2), r"expected counts of shape \(B, H, M \+ q\), got a 2-d tensor"),
    (lambda k, v, s, c: (k.double(), v.double(), s, c, 0, 3, 4, 2), r"expected keys of dtype float32, float16 or bfloat16, got Double"),
    (lambda k, v, s, c: (k, v.bfloat16(), s, c, 0, 3, 4, 2), r"expected values of the dtype of keys \(Float\), got BFloat16"),
    (lambda k, v, s, c: (k, v, s.half(), c, 0, 3, 4, 2), r"expected scores of dtype Float, got Half"),
    (lambda k, v, s, c: (k, v, s, c.long(), 0, 3, 4, 2), r"expected counts of dtype Float, got Long"),
    (lambda k, v, s, c: (k, v[:, :, :-1], s, c, 0, 3, 4, 2), r"expected values of the shape of keys"),
    (lambda k, v, s, c: (k, v, s[:, :, :-1], c, 0, 3, 4, 2), r"expected scores.size\(2\) == 11 \(slots of keys\)"),
    (lambda k, v, s, c: (k, v, s, c[:, :, :-1], 0, 3, 4, 2), r"expected counts of the shape of scores \(\[2, 3, 11\]\), got \[2, 3, 10\]"),
    (lambda k, v, s, c: (non_contiguous(k), v, s, c, 0, 3, 4, 2), r"expected keys with contiguous \(batch, kv head\) rows in order \(it is updated in place row by row\), got strides"),
    (lambda k, v, s, c: (k, non_contiguous(v), s, c, 0, 3, 4, 2), r"expected values with contiguous \(batch, kv head\) rows in order"),
    (lambda k, v, s, c: (k, v, non_contiguous(s), c, 0, 3, 4, 2), r"expected scores with contiguous \(batch, kv head\) rows in order"),
    (lambda k, v, s, c: (k, v, s, non_contiguous(c), 0, 3, 4, 2), r"expected counts with contiguous \(batch, kv head\) rows in order"),
    (lambda k, v, s, c: (k, v.transpose(2, 3).contiguous().transpose(2, 3), s, c, 0, 3, 4, 2), r"expected values with contiguous \(batch, kv head\) rows in order"),
    (lambda k, v, s, c: (k, v, s, c, 3, 3, 4, 2), r"expected ring_position in \[0, recent\) = \[0, 3\), got 3"),
    (lambda k, v, s, c: (k, v, s, c, -1, 3, 4, 2), r"expected ring_position in \[0, recent\) = \[0, 3\), got -1"),
    (lambda k, v, s, c: (k, v, s, c, 0, 0, 4, 2), r"expected recent >= 1, got 0"),
    (lambda k, v, s, c: (k, v, s, c, 0, 3, 0, 2), r"expected context >= 1, got 0"),
    (lambda k, v, s, c: (k, v, s, c, 0, 3, 4, -2), r"expected residual >= 0, got -2"),
    (lambda k, v, s, c: (k, v, s, c, 0, 3, 4, 4), r"expected keys.size\(2\) = M \+ q with q >= 1 new tokens after the M = .* = 11 slots, got keys of shape \[2, 3, 11, 8\]"),
    (lambda k, v, s, c: (k, v, s, c, 0, 3, 6, 4), r"expected keys.size\(2\) = M \+ q with q >= 1 new tokens after the M = .* = 13 slots"),
]


@pytest.mark.parametrize("make_args,message", DECODE_BAD_INPUTS)
def test_decode_bad_input_names_op_and_value(make_args, message):
    cache = make_decode_inputs(2, 3, (3, 4, 2), 2, 8, torch.float32, "cpu")
    snapshot = [t.clone() for t in cache]
    with pytest.raises(RuntimeError, match=r"kvcomp::zsmerge_decode_step: " + message):
        torch.ops.kvcomp.zsmerge_decode_step(*make_args(*cache))
    for t, before in zip(cache, snapshot):  # nothing was touched
        assert torch.equal(t, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_mixed_devices_rejected():
    keys, values, scores = make_prefill_inputs(2, 3, 20, 8, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"kvcomp::zsmerge_prefill: expected scores on the device of keys"):
        torch.ops.kvcomp.zsmerge_prefill(keys.cuda(), values.cuda(), scores, 3, 4, 2)
    cache = make_decode_inputs(2, 3, (3, 4, 2), 1, 8, torch.float32, "cuda")
    with pytest.raises(RuntimeError, match=r"kvcomp::zsmerge_decode_step: expected counts on the device of keys"):
        torch.ops.kvcomp.zsmerge_decode_step(*cache[:3], cache[3].cpu(), 0, 3, 4, 2)
    with pytest.raises(RuntimeError, match=r"kvcomp::zsmerge_decode_step: expected values on the device of keys"):
        torch.ops.kvcomp.zsmerge_decode_step(cache[0], cache[1].cpu(), *cache[2:], 0, 3, 4, 2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_runs_on_a_non_default_gpu():
    budget = (3, 4, 2)
    cache = make_decode_inputs(2, 3, budget, 2, 8, torch.float32, "cuda:1")
    assert_caches_close(run_decode(ops.zsmerge_decode_step, cache, 0, budget),
                        run_decode(reference.zsmerge_decode_step, cache, 0, budget), torch.float32)
    inputs = make_prefill_inputs(2, 3, 20, 8, torch.float32, "cuda:1")
    assert_caches_close(ops.zsmerge_prefill(*inputs, *budget), reference.zsmerge_prefill(*inputs, *budget),
                        torch.float32)
