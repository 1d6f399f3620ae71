"""kvcomp::update_scores against its plain-PyTorch reference, opcheck, torch.compile and bad input."""

import pytest
import torch

from kvpress_cpp import ops
from tests import reference

pytestmark = pytest.mark.independent_of_transformers

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_inputs(batch, query_heads, kv_heads, num_queries, old_len, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(batch, kv_heads, old_len, generator=generator)
    logits = torch.randn(batch, query_heads, num_queries, old_len + num_queries, generator=generator)
    causal = torch.ones(num_queries, old_len + num_queries, dtype=torch.bool).tril(old_len)
    attn = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    return scores.to(device), attn.to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_heads,kv_heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("num_queries", [1, 7])
@pytest.mark.parametrize("old_len", [0, 37])
@pytest.mark.parametrize("decay,input_scale", [(0.98, 1.0), (1.0, 0.25), (0.0, 0.5)])
def test_matches_reference(device, dtype, query_heads, kv_heads, num_queries, old_len, decay, input_scale):
    scores, attn = make_inputs(2, query_heads, kv_heads, num_queries, old_len, dtype, device)
    got = ops.update_scores(scores, attn, decay, input_scale)
    expected = reference.update_scores(scores, attn, decay, input_scale)
    assert got.dtype == torch.float32 and got.shape == (2, kv_heads, old_len + num_queries)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_one_call_equals_query_by_query_calls(device):
    scores, attn = make_inputs(1, 6, 2, 4, 10, torch.float32, device, seed=3)
    step_by_step = scores
    for query in range(4):
        step_by_step = ops.update_scores(step_by_step, attn[:, :, query : query + 1, : 10 + query + 1], 0.9, 1.0)
    torch.testing.assert_close(ops.update_scores(scores, attn, 0.9, 1.0), step_by_step, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_closed_form(device):
    """methods.md: after a prefill of T tokens the ZSMerge score of key i is Σ_j λ^(T-1-j) Σ_g A[g, j, i]."""
    _, attn = make_inputs(1, 3, 1, 9, 0, torch.float32, device, seed=5)
    decay = 0.98
    weights = decay ** torch.arange(8, -1, -1, dtype=torch.float32, device=device)
    expected = torch.einsum("j,gji->i", weights, attn[0]).view(1, 1, 9)
    torch.testing.assert_close(ops.update_scores(torch.zeros(1, 1, 0, device=device), attn, decay, 1.0), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for dtype in (torch.float32, torch.bfloat16):
        scores, attn = make_inputs(2, 8, 2, 3, 5, dtype, device)
        torch.library.opcheck(torch.ops.kvcomp.update_scores.default, (scores, attn, 0.9, 0.5))


def test_compile_fullgraph():
    def decayed_update(scores, attn):
        return ops.update_scores(scores, attn, 0.98, 1.0) * 2.0

    compiled = torch.compile(decayed_update, fullgraph=True)
    scores, attn = make_inputs(1, 4, 2, 1, 12, torch.float32, "cpu")
    torch.testing.assert_close(compiled(scores, attn), decayed_update(scores, attn))


BAD_INPUTS = [
    (lambda s, a: (s[0], a, 0.9, 1.0), r"expected scores of shape \(B, H, T_old\), got a 2-d tensor"),
    (lambda s, a: (s, a[0], 0.9, 1.0), r"expected attn of shape \(B, Hq, q, T_old \+ q\), got a 3-d tensor"),
    (lambda s, a: (s, a[:1], 0.9, 1.0), r"expected attn.size\(0\) == 2"),
    (lambda s, a: (s, a[:, :7], 0.9, 1.0), r"expected the 7 query heads of attn to be a multiple of the 2 kv heads"),
    (lambda s, a: (s, a[..., :-1], 0.9, 1.0), r"expected attn.size\(3\) == 6"),
    (lambda s, a: (s.half(), a, 0.9, 1.0), r"expected scores of dtype Float, got Half"),
    (lambda s, a: (s, a.to(torch.int32), 0.9, 1.0), r"expected attn of dtype float32, float16 or bfloat16, got Int"),
    (lambda s, a: (s, a, 1.5, 1.0), r"expected decay in \[0, 1\], got 1.5"),
    (lambda s, a: (s, a, -0.1, 1.0), r"expected decay in \[0, 1\], got -0.1"),
    (lambda s, a: (s, a, 1.0000001, 1.0), r"expected decay in \[0, 1\], got 1.0000001"),  # (not rounded to 1)
    (lambda s, a: (s, a, float("nan"), 1.0), r"expected decay in \[0, 1\], got nan"),
    (lambda s, a: (s, a, 0.9, float("inf")), r"expected a finite float32 input_scale, got inf"),
]


@pytest.mark.parametrize("make_args,message", BAD_INPUTS)
def test_bad_input_names_op_and_value(make_args, message):
    scores, attn = make_inputs(2, 8, 2, 1, 5, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"kvcomp::update_scores: " + message):
        torch.ops.kvcomp.update_scores(*make_args(scores, attn))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_mixed_devices_rejected():
    scores, attn = make_inputs(2, 8, 2, 1, 5, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"kvcomp::update_scores: expected attn on the device of scores"):
        torch.ops.kvcomp.update_scores(scores.cuda(), attn, 0.9, 1.0)


def test_nan_attention_propagates_without_crash():
    scores, attn = make_inputs(1, 4, 2, 1, 5, torch.float32, "cpu")
    attn[0, 0, 0, 2] = float("nan")
    out = ops.update_scores(scores, attn, 0.9, 1.0)
    assert torch.isnan(out[0, 0, 2]) and torch.isfinite(out[0, 1]).all()
