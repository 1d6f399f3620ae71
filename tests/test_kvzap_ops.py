"""The kvzap family (kvcomp::kvzap_score, kvzap_threshold, kvzap_decode_step) against the plain-PyTorch references (nn.Linear / nn.GELU
modules, the keep rule slot by slot), the rule's properties (decided once, window never evicted, lower τ keeps
more), opcheck, torch.compile and bad input."""

import pytest
import torch

from kvpress_cpp import ops
from tests import reference

pytestmark = pytest.mark.independent_of_transformers

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NAN, INF = float("nan"), float("inf")


def surrogate(input_dim, heads, hidden_dim=None, dtype=torch.float32, device="cpu", seed=0):
    """Random surrogate tensors, (w1, b1) or (w1, b1, w2, b2), at nn.Linear's init scale."""
    generator = torch.Generator().manual_seed(seed)

    def linear(out_dim, in_dim):
        bound = in_dim ** -0.5
        weight = (torch.rand(out_dim, in_dim, generator=generator) * 2 - 1) * bound
        bias = (torch.rand(out_dim, generator=generator) * 2 - 1) * bound
        return weight.to(device, dtype), bias.to(device, dtype)

    if hidden_dim is None:
        return linear(heads, input_dim)
    return (*linear(hidden_dim, input_dim), *linear(heads, hidden_dim))


def hidden_states(batch, length, dim, dtype=torch.float32, device="cpu", seed=1):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, length, dim, generator=generator) * 2).to(device, dtype)


SCORE_TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
    torch.bfloat16: dict(rtol=5e-2, atol=5e-2),
}


# ---------------------------------------------------------------------------------------------------------------
# kvzap_score


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_dim", [None, 72, 9])
@pytest.mark.parametrize("batch,length,dim,heads", [(1, 37, 576, 3), (2, 130, 64, 2), (3, 1, 16, 8)])
def test_score_matches_module(device, dtype, hidden_dim, batch, length, dim, heads):
    weights = surrogate(dim, heads, hidden_dim, dtype, device)
    hidden = hidden_states(batch, length, dim, dtype, device)
    got = ops.kvzap_score(hidden, *weights)
    assert got.dtype == torch.float32 and got.shape == (batch, heads, length) and got.device == hidden.device
    expected = reference.kvzap_score(hidden, *weights)
    torch.testing.assert_close(got.cpu(), expected, **SCORE_TOLERANCE[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_score_matches_module_in_its_own_dtype(device, dtype):
    """What kvpress's KVzapPress.score computes (the module cast to the hidden dtype) up to that dtype's rounding."""
    weights = surrogate(64, 4, 8, dtype, device, seed=3)
    hidden = hidden_states(2, 50, 64, dtype, device)
    module = reference.kvzap_surrogate_module(*weights).to(device, dtype)
    with torch.no_grad():
        expected = module(hidden).transpose(1, 2).float()
    torch.testing.assert_close(ops.kvzap_score(hidden, *weights), expected, **SCORE_TOLERANCE[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_score_gelu_is_exact_not_tanh(device):
    """A 1-d hidden layer with identity weights exposes the activation: exact erf GELU, not the tanh approximation."""
    x = torch.linspace(-6, 6, 241, device=device).view(1, -1, 1)
    one, zero = torch.ones(1, 1, device=device), torch.zeros(1, device=device)
    got = ops.kvzap_score(x, one, zero, one, zero)[0, 0]
    torch.testing.assert_close(got, torch.nn.functional.gelu(x.view(-1)), rtol=1e-6, atol=1e-6)
    assert (got - torch.nn.functional.gelu(x.view(-1), approximate="tanh")).abs().max() > 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_score_non_contiguous_hidden(device):
    weights = surrogate(32, 3, 16, device=device)
    hidden = hidden_states(2, 40, 64, device=device)[..., ::2]  # strided
    torch.testing.assert_close(ops.kvzap_score(hidden, *weights), ops.kvzap_score(hidden.contiguous(), *weights))
    transposed = hidden_states(40, 2, 32, device=device).transpose(0, 1)
    torch.testing.assert_close(ops.kvzap_score(transposed, *weights),
                               reference.kvzap_score(transposed, *weights).to(device), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_score_empty(device):
    weights = surrogate(16, 3, 4, device=device)
    assert ops.kvzap_score(hidden_states(2, 0, 16, device=device), *weights).shape == (2, 3, 0)
    assert ops.kvzap_score(hidden_states(0, 5, 16, device=device), *weights[:2]).shape == (0, 4, 5)


@CUDA
@pytest.mark.parametrize("dtype", DTYPES)
def test_score_cuda_matches_cpu(dtype):
    weights = surrogate(576, 3, 72, dtype, "cuda")
    hidden = hidden_states(2, 4096, 576, dtype, "cuda")
    torch.testing.assert_close(ops.kvzap_score(hidden, *weights).cpu(),
                               ops.kvzap_score(hidden.cpu(), *(w.cpu() for w in weights)), **SCORE_TOLERANCE[dtype])


# ---------------------------------------------------------------------------------------------------------------
# kvzap_threshold


def threshold_inputs(batch, heads, length, device="cpu", seed=0, first_position=0, evicted_fraction=0.2):
    """Random log-weights (some already -inf), scores, and positions: each row a random increasing run of absolute
    positions (as after earlier evictions and compaction)."""
    generator = torch.Generator().manual_seed(seed)
    log_weights = torch.zeros(batch, heads, length)
    log_weights[torch.rand(batch, heads, length, generator=generator) < evicted_fraction] = -INF
    scores = torch.randn(batch, heads, length, generator=generator) * 3 - 4
    steps = torch.randint(1, 4, (batch, heads, length), generator=generator)
    positions = first_position + steps.cumsum(-1) - 1
    return log_weights.to(device), scores.to(device), positions.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [0, 1, 16, 128, 10_000])
@pytest.mark.parametrize("threshold", [-4.0, -7.0, -INF, INF])
@pytest.mark.parametrize("before_after", [(0, 300), (250, 251), (250, 270), (0, 0), (400, 400)])
def test_threshold_matches_reference(device, window, threshold, before_after):
    log_weights, scores, positions = threshold_inputs(2, 3, 150, device, seed=window)
    args = (threshold, window, *before_after)
    got_lw, got_held = ops.kvzap_threshold(log_weights, scores, positions, *args)
    expected_lw, expected_held = reference.kvzap_threshold(log_weights.cpu(), scores.cpu(), positions.cpu(), *args)
    assert got_lw.dtype == torch.float32 and got_held.dtype == torch.int64 and got_held.shape == (2, 3)
    assert torch.equal(got_lw.cpu(), expected_lw)
    assert torch.equal(got_held.cpu(), expected_held)


@pytest.mark.parametrize("device", DEVICES)
def test_threshold_by_hand(device):
    lw = torch.tensor([[[0.0, 0.0, 0.0, -INF, 0.0, 0.0, 0.0]]], device=device)
    scores = torch.tensor([[[-5.0, -3.0, NAN, -9.0, -4.0, -9.0, -9.0]]], device=device)
    positions = torch.arange(7, device=device).view(1, 1, 7)
    # prefill of 7 tokens, window 2: positions 0..4 are decided; -5 < -4 evicted, -3 kept, NaN kept, already -inf
    # stays, -4 is not below -4: kept; 5 and 6 (the window) kept whatever their score.
    out, held = ops.kvzap_threshold(lw, scores, positions, -4.0, 2, 0, 7)
    assert out.tolist() == [[[-INF, 0.0, 0.0, -INF, 0.0, 0.0, 0.0]]]
    assert held.tolist() == [[5]]
    # one more token (7 -> 8): only position 5 leaves the window now
    out, held = ops.kvzap_threshold(out, scores, positions, -4.0, 2, 7, 8)
    assert out.tolist() == [[[-INF, 0.0, 0.0, -INF, 0.0, -INF, 0.0]]] and held.tolist() == [[4]]


@pytest.mark.parametrize("device", DEVICES)
def test_threshold_decides_each_token_once(device):
    """Step-by-step passes (0 -> T0, then one or several tokens at a time) evict exactly what one pass over the
    whole sequence evicts: the window slides, every position is decided in exactly one pass."""
    total, window, threshold = 300, 32, -4.0
    log_weights, scores, _ = threshold_inputs(2, 4, total, device, seed=5, evicted_fraction=0.0)
    positions = torch.arange(total, device=device).expand(2, 4, total)
    at_once, _ = ops.kvzap_threshold(log_weights, scores, positions, threshold, window, 0, total)
    stepwise, before = log_weights.clone(), 0
    for after in [100, 101, 102, 140, 141, 200, 299, 300]:
        stepwise, _ = ops.kvzap_threshold(stepwise, scores, positions, threshold, window, before, after)
        before = after
    assert torch.equal(stepwise, at_once)
    keep = reference.dms_keep(scores.cpu(), threshold, window)
    assert torch.equal(at_once.cpu() == 0, keep)


@pytest.mark.parametrize("device", DEVICES)
def test_threshold_never_evicts_the_window_and_lower_tau_keeps_more(device):
    log_weights, scores, positions = threshold_inputs(1, 3, 500, device, seed=7, evicted_fraction=0.0)
    total = int(positions.max()) + 1
    previous = None
    for threshold in [4.0, 0.0, -4.0, -7.0, -20.0]:
        out, held = ops.kvzap_threshold(log_weights, scores, positions, threshold, 64, 0, total)
        assert (out[positions >= total - 64] == 0).all()
        if previous is not None:
            assert (held >= previous).all() and (out[previous_out == 0] == 0).all()
        previous, previous_out = held, out
    assert torch.equal(held, (log_weights == 0).sum(-1))  # τ below every score keeps everything


@pytest.mark.parametrize("device", DEVICES)
def test_threshold_non_contiguous_and_empty(device):
    log_weights, scores, positions = threshold_inputs(3, 4, 60, device, seed=2)
    got = ops.kvzap_threshold(log_weights.transpose(0, 1), scores.transpose(0, 1), positions.transpose(0, 1), -4.0,
                              8, 0, 90)
    expected = ops.kvzap_threshold(log_weights.transpose(0, 1).contiguous(), scores.transpose(0, 1).contiguous(),
                                   positions.transpose(0, 1).contiguous(), -4.0, 8, 0, 90)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    out, held = ops.kvzap_threshold(log_weights[..., :0], scores[..., :0], positions[..., :0], -4.0, 8, 0, 90)
    assert out.shape == (3, 4, 0) and held.tolist() == [[0] * 4] * 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch,heads,length", [(4, 8, 20_000), (1, 2, 50_001), (1, 1, 1025)])
def test_threshold_at_scale_matches_reference(device, batch, heads, length):
    """Rows long enough to be split over several blocks on CUDA (few rows: batch 1), each adding its held count."""
    log_weights, scores, positions = threshold_inputs(batch, heads, length, "cpu", seed=11)
    total = int(positions.max()) + 1
    for before, after in [(0, total), (total - 5, total)]:
        got = ops.kvzap_threshold(log_weights.to(device), scores.to(device), positions.to(device), -4.0, 128, before,
                                  after)
        expected = reference.kvzap_threshold(log_weights, scores, positions, -4.0, 128, before, after)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, expected))


@CUDA
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_dim", [None, 512])
@pytest.mark.parametrize("batch,length", [(1, 1), (16, 1), (4, 4), (17, 1)])
def test_score_cuda_decoding_pass_matches_cpu(dtype, hidden_dim, batch, length):
    """A decoding pass at a Llama-3-8B layer's shape: up to 16 tokens take the small-rows kernels (one warp per
    output unit), 17 the GEMM path; both against the CPU op and the module."""
    weights = surrogate(4096, 8, hidden_dim, dtype, "cuda", seed=batch)
    hidden = hidden_states(batch, length, 4096, dtype, "cuda", seed=length)
    got = ops.kvzap_score(hidden, *weights).cpu()
    torch.testing.assert_close(got, ops.kvzap_score(hidden.cpu(), *(w.cpu() for w in weights)),
                               **SCORE_TOLERANCE[dtype])
    torch.testing.assert_close(got, reference.kvzap_score(hidden, *weights), **SCORE_TOLERANCE[dtype])


@CUDA
@pytest.mark.parametrize("dtype,dim,hidden_dim", [(torch.float32, 4100, 36), (torch.float16, 264, 40),
                                                  (torch.bfloat16, 8, 8)])
def test_score_cuda_small_rows_when_a_row_is_not_a_whole_warp_step(dtype, dim, hidden_dim):
    """Rows of whole 16-byte pieces but not of whole warp steps (32 pieces): the last step's lanes past the row."""
    weights = surrogate(dim, 8, hidden_dim, dtype, "cuda")
    hidden = hidden_states(3, 5, dim, dtype, "cuda")
    torch.testing.assert_close(ops.kvzap_score(hidden, *weights).cpu(), reference.kvzap_score(hidden, *weights),
                               **SCORE_TOLERANCE[dtype])


@CUDA
def test_score_cuda_small_rows_unaligned_take_the_gemm_path():
    """Rows that are not whole 16-byte pieces (Dh = 4099), a hidden view starting one element in, and a transposed
    weight all fall back to the GEMM path and still score."""
    weights = surrogate(4099, 8, 40, torch.bfloat16, "cuda")
    hidden = hidden_states(1, 1, 4100, torch.bfloat16, "cuda")[..., 1:]
    torch.testing.assert_close(ops.kvzap_score(hidden, *weights).cpu(),
                               reference.kvzap_score(hidden, *weights), **SCORE_TOLERANCE[torch.bfloat16])
    w1, b1, w2, b2 = surrogate(4096, 8, 512, torch.bfloat16, "cuda")
    w1_transposed = w1.t().contiguous().t()
    hidden = hidden_states(2, 1, 4096, torch.bfloat16, "cuda")
    torch.testing.assert_close(ops.kvzap_score(hidden, w1_transposed, b1, w2, b2).cpu(),
                               reference.kvzap_score(hidden, w1, b1, w2, b2), **SCORE_TOLERANCE[torch.bfloat16])


# ---------------------------------------------------------------------------------------------------------------
# kvzap_decode_step


def decode_step_inputs(batch, heads, slots, new_tokens, dim, hidden_dim, dtype=torch.float32, device="cpu", seed=0):
    """The surrogate, the new tokens' hidden states, and a state of `slots` slots as decoding leaves it (increasing
    positions, some evicted) with the layer's log-weights grown by the new tokens (0)."""
    weights = surrogate(dim, heads, hidden_dim, dtype, device, seed=seed)
    hidden = hidden_states(batch, new_tokens, dim, dtype, device, seed=seed + 1)
    log_weights, scores, positions = threshold_inputs(batch, heads, slots, device, seed=seed)
    log_weights = torch.nn.functional.pad(log_weights, (0, new_tokens))
    return (hidden, *weights, *((None, None) if hidden_dim is None else ()), log_weights, scores, positions)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_dim", [None, 24])
@pytest.mark.parametrize("batch,heads,slots,new_tokens,window", [
    (1, 3, 300, 1, 128),   # a decoding step: one token leaves the window
    (2, 2, 40, 3, 1),      # q > window: new tokens are decided in the pass that brings them
    (3, 1, 0, 2, 0),       # an empty state, window 0
    (2, 4, 50, 1, 10_000),  # nothing leaves the window
    (4, 2, 30, 4, 2),      # B * q = 16 tokens, the most the CUDA small-rows kernels take; new tokens decided at once
])
def test_decode_step_matches_reference(device, dtype, hidden_dim, batch, heads, slots, new_tokens, window):
    args = decode_step_inputs(batch, heads, slots, new_tokens, 32, hidden_dim, dtype, device, seed=slots)
    tokens_before = int(args[-1].max()) + 1 if slots else 0
    # τ where the decided state slots fall on both sides of it, and 0.1 from any new score (low precision moves them)
    new_scores = reference.kvzap_score(*args[:5])
    threshold = -4.0
    while bool(((new_scores - threshold).abs() < 0.1).any()):
        threshold += 0.1
    got = ops.kvzap_decode_step(*args, threshold, window, tokens_before)
    expected = reference.kvzap_decode_step(*args, threshold, window, tokens_before)
    grown = (batch, heads, slots + new_tokens)
    assert [t.shape for t in got] == [grown] * 3 + [(batch, heads)]
    assert [t.dtype for t in got] == [torch.float32, torch.float32, torch.int64, torch.int64]
    assert all(t.device == args[0].device for t in got)
    assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[2].cpu(), expected[2])
    assert torch.equal(got[3].cpu(), expected[3])
    assert torch.equal(got[1][..., :slots].cpu(), expected[1][..., :slots])
    torch.testing.assert_close(got[1].cpu(), expected[1], **SCORE_TOLERANCE[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hidden_dim", [None, 64])
def test_decode_step_is_score_cat_threshold(device, hidden_dim):
    """The op is exactly the composition it replaces in the press (same surrogate kernels, same rule)."""
    args = decode_step_inputs(2, 8, 700, 1, 256, hidden_dim, torch.bfloat16, device, seed=5)
    hidden, weights, (log_weights, scores, positions) = args[0], args[1:5], args[5:]
    before = int(positions.max()) + 1
    new = ops.kvzap_score(hidden, *weights)
    grown_scores = torch.cat([scores, new], -1)
    grown_positions = torch.cat([positions, torch.full_like(positions[..., :1], before)], -1)
    expected_lw, expected_held = ops.kvzap_threshold(log_weights, grown_scores, grown_positions, -4.0, 128, before,
                                                     before + 1)
    got = ops.kvzap_decode_step(*args, -4.0, 128, before)
    for g, e in zip(got, (expected_lw, grown_scores, grown_positions, expected_held)):
        assert torch.equal(g, e)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_step_non_contiguous_and_empty(device):
    args = list(decode_step_inputs(2, 3, 30, 2, 16, 8, device=device))
    expected = ops.kvzap_decode_step(*args, -4.0, 4, 40)
    args[0] = torch.stack([args[0], args[0]], -1)[..., 0]  # every other element
    args[6] = args[6].transpose(0, 1).contiguous().transpose(0, 1)
    for g, e in zip(ops.kvzap_decode_step(*args, -4.0, 4, 40), expected):
        assert torch.equal(g, e)
    empty = decode_step_inputs(0, 3, 0, 1, 16, 8, device=device)
    assert [t.shape for t in ops.kvzap_decode_step(*empty, -4.0, 4, 0)] == [(0, 3, 1)] * 3 + [(0, 3)]


@CUDA
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_dim", [None, 512])
@pytest.mark.parametrize("batch", [1, 16, 17])
def test_decode_step_cuda_matches_cpu(dtype, hidden_dim, batch):
    """A Llama-3-8B layer's shape over 4k slots: the decided slots and the state as the CPU op gives them, the new
    scores within the dtype's tolerance (16 tokens take the small-rows kernels, 17 the GEMM path)."""
    args = decode_step_inputs(batch, 8, 4096, 1, 4096, hidden_dim, dtype, "cpu", seed=batch)
    before = int(args[-1].max()) + 1
    got = ops.kvzap_decode_step(*(a.cuda() if a is not None else None for a in args), -4.0, 128, before)
    expected = ops.kvzap_decode_step(*args, -4.0, 128, before)
    for index in (0, 2, 3):
        assert torch.equal(got[index].cpu(), expected[index])
    torch.testing.assert_close(got[1].cpu(), expected[1], **SCORE_TOLERANCE[dtype])


# ---------------------------------------------------------------------------------------------------------------
# dispatcher, opcheck, torch.compile


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for dtype in (torch.float32, torch.bfloat16):
        hidden = hidden_states(2, 7, 16, dtype, device)
        torch.library.opcheck(torch.ops.kvcomp.kvzap_score.default, (hidden, *surrogate(16, 3, 5, dtype, device)))
        torch.library.opcheck(torch.ops.kvcomp.kvzap_score.default, (hidden, *surrogate(16, 3, None, dtype, device)))
    log_weights, scores, positions = threshold_inputs(2, 3, 20, device)
    torch.library.opcheck(torch.ops.kvcomp.kvzap_threshold.default, (log_weights, scores, positions, -4.0, 4, 3, 50))
    for hidden_dim in (None, 8):
        torch.library.opcheck(torch.ops.kvcomp.kvzap_decode_step.default,
                              (*decode_step_inputs(2, 3, 20, 2, 16, hidden_dim, device=device), -4.0, 4, 60))


def test_compile_fullgraph():
    weights = surrogate(32, 3, 8)

    def score_and_threshold(hidden, log_weights, positions):
        scores = ops.kvzap_score(hidden, *weights)
        out, held = ops.kvzap_threshold(log_weights, scores, positions, -0.5, 4, 0, hidden.shape[1])
        return out, held * 2

    compiled = torch.compile(score_and_threshold, fullgraph=True)
    hidden = hidden_states(2, 40, 32)
    log_weights = torch.zeros(2, 3, 40)
    positions = torch.arange(40).expand(2, 3, 40)
    for got, expected in zip(compiled(hidden, log_weights, positions),
                             score_and_threshold(hidden, log_weights, positions)):
        assert torch.equal(got, expected)


# ---------------------------------------------------------------------------------------------------------------
# bad input


def bad_score_cases():
    h = hidden_states(2, 5, 16)
    w1, b1, w2, b2 = surrogate(16, 3, 8)
    return [
        ((h[0], w1, b1, w2, b2), r"expected hidden of shape \(B, T, Dh\), got a 2-d tensor"),
        ((h.int(), w1, b1, w2, b2), r"expected hidden of dtype float32, float16 or bfloat16, got Int"),
        ((h, w1, b1, w2, None), r"expected weight2 and bias2 both given \(MLP surrogate\) or both None"),
        ((h, w1, b1, None, b2), r"expected weight2 and bias2 both given"),
        ((h, w1[0], b1, w2, b2), r"expected weight1 of shape \(Dh', Dh\), got a 1-d tensor"),
        ((h, w1, b1[None], w2, b2), r"expected bias1 of shape \(Dh'\), got a 2-d tensor"),
        ((h, w1.half(), b1, w2, b2), r"expected weight1 of the dtype of hidden \(Float\), got Half"),
        ((h, w1, b1.double(), w2, b2), r"expected bias1 of the dtype of hidden \(Float\), got Double"),
        ((h, w1, b1, w2.bfloat16(), b2), r"expected weight2 of the dtype of hidden \(Float\), got BFloat16"),
        ((h, w1[:, :7], b1, w2, b2), r"expected weight1.size\(1\) == 16 \(hidden size Dh of hidden\)"),
        ((h, w1, b1[:3], w2, b2), r"expected bias1.size\(0\) == 8 \(output size of weight1\)"),
        ((h, w1, b1, w2[:, :3], b2), r"expected weight2.size\(1\) == 8 \(output size of weight1\)"),
        ((h, w1, b1, w2, b2[:2]), r"expected bias2.size\(0\) == 3 \(output size of weight2\)"),
        ((h, w1[:0], b1[:0], w2[:, :0], b2), r"expected a hidden layer of at least one unit"),
        ((h, w1[:0], b1[:0]), r"expected at least one output head, got weight1 of shape \[0, 16\]"),
        ((h, w2, b2), r"expected weight1.size\(1\) == 16 \(hidden size Dh of hidden\), got weight1 of shape \[3, 8\]"),
    ]


@pytest.mark.parametrize("case", range(16))
def test_bad_score_input_names_op_and_value(case):
    args, message = bad_score_cases()[case]
    with pytest.raises(RuntimeError, match=r"kvcomp::kvzap_score: " + message):
        torch.ops.kvcomp.kvzap_score(*args)


def bad_threshold_cases():
    lw, s, p = threshold_inputs(2, 3, 10)
    return [
        ((lw[0], s, p, -4.0, 4, 0, 10), r"expected log_weights of shape \(B, H, T\), got a 2-d tensor"),
        ((lw, s[..., None], p, -4.0, 4, 0, 10), r"expected scores of shape \(B, H, T\), got a 4-d tensor"),
        ((lw, s, p[0], -4.0, 4, 0, 10), r"expected positions of shape \(B, H, T\), got a 2-d tensor"),
        ((lw.half(), s, p, -4.0, 4, 0, 10), r"expected log_weights of dtype Float, got Half"),
        ((lw, s.bfloat16(), p, -4.0, 4, 0, 10), r"expected scores of dtype Float, got BFloat16"),
        ((lw, s, p.int(), -4.0, 4, 0, 10), r"expected positions of dtype Long, got Int"),
        ((lw, s[:, :2], p, -4.0, 4, 0, 10), r"expected scores.size\(1\) == 3 \(shape of log_weights\)"),
        ((lw, s, p[..., :9], -4.0, 4, 0, 10), r"expected positions.size\(2\) == 10 \(shape of log_weights\)"),
        ((lw, s, p, NAN, 4, 0, 10), r"expected a threshold that is not NaN, got threshold = nan"),
        ((lw, s, p, -4.0, -1, 0, 10), r"expected window >= 0, got -1"),
        ((lw, s, p, -4.0, 4, -2, 10), r"expected tokens_before >= 0, got -2"),
        ((lw, s, p, -4.0, 4, 11, 10), r"expected tokens_after >= tokens_before \(11\), got tokens_after = 10"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_bad_threshold_input_names_op_and_value(case):
    args, message = bad_threshold_cases()[case]
    with pytest.raises(RuntimeError, match=r"kvcomp::kvzap_threshold: " + message):
        torch.ops.kvcomp.kvzap_threshold(*args)


@CUDA
def test_mixed_devices_rejected():
    h = hidden_states(1, 5, 16, device="cuda")
    w1, b1 = surrogate(16, 3, None, device="cuda")
    with pytest.raises(RuntimeError, match=r"kvcomp::kvzap_score: expected bias1 on the device of hidden"):
        torch.ops.kvcomp.kvzap_score(h, w1, b1.cpu())
    lw, s, p = threshold_inputs(1, 2, 5, "cuda")
    with pytest.raises(RuntimeError, match=r"kvcomp::kvzap_threshold: expected positions on the device of"):
        torch.ops.kvcomp.kvzap_threshold(lw, s, p.cpu(), -4.0, 2, 0, 5)
