"""kvcomp::prompt_attention_with_scores (the prompt's attention output, log-sum-exp and scores from one QKᵀ) against a
float64 plain-PyTorch reference written from the formulas (softmax attention, log-sum-exp, weighted column sums),
NaN, determinism, opcheck, torch.compile and bad input; then the prefill path that runs it for the presses that score
their prompt: the model's logits as with sdpa, and the sdpa + prompt_scores fallback past the workspace limit."""

import math

import pytest
import torch

import kvpress_cpp  # noqa: F401  (registers torch.ops.kvcomp)
from kvpress_cpp import attention, ops
from kvpress_cpp.presses.weightedkv import WeightedKVPress
from kvpress_cpp.presses.zsmerge import ZSMergePress
from tests import reference
from tests.test_prompt_scores import LSE_TOL, SCORE_TOL, make_inputs
from tests.threads import at_one_and_two_threads

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The output is rounded to the query dtype; its float32 accumulation of probabilities (relative error ~1e-6) times
# values of magnitude ~1.
OUTPUT_TOL = {torch.float32: dict(rtol=1e-4, atol=2e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
              torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def make_values(keys, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(keys.shape, generator=generator).to(keys.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,query_heads,kv_heads", [(1, 9, 3), (2, 4, 4)], ids=["gqa", "mha-b2"])
@pytest.mark.parametrize("num_queries,total_len", [(1, 1), (37, 37), (130, 300), (45, 300), (300, 300)])
@pytest.mark.parametrize("decay,input_scale", [(1.0, 1 / 3), (0.98, 1.0), (0.5, 0.05)])
def test_matches_reference(dtype, batch, query_heads, kv_heads, num_queries, total_len, decay, input_scale):
    """T not a multiple of the key tile (128), q across query tiles (64) and score chunks, q < T, padding (-inf b),
    merged slots (b > 0), d = 24 (not a multiple of the vector width)."""
    query, keys, log_weights = make_inputs(batch, query_heads, kv_heads, num_queries, total_len, 24, dtype)
    values = make_values(keys)
    scale = 24 ** -0.5
    output, lse, scores = ops.prompt_attention_with_scores(query, keys, values, log_weights, scale, decay,
                                                           input_scale)
    expected_output, expected_lse, expected_scores = reference.prompt_attention_with_scores(
        query, keys, values, log_weights, scale, decay, input_scale)
    assert output.dtype == dtype and output.shape == (batch, num_queries, query_heads, 24)
    assert lse.dtype == scores.dtype == torch.float32
    torch.testing.assert_close(output.double(), expected_output, **OUTPUT_TOL[dtype])
    torch.testing.assert_close(lse.double(), expected_lse, **LSE_TOL)
    torch.testing.assert_close(scores.double(), expected_scores, **SCORE_TOL)
    assert bool((scores[log_weights == -math.inf] == 0).all())


def test_head_dim_128_and_strided_views():
    """d = 128, keys and values views of a longer buffer, queries transposed from (B, T, Hq, d)."""
    query, keys, log_weights = make_inputs(1, 8, 2, 200, 333, 128, padding=0.0)
    values = make_values(keys)
    buffer = torch.zeros(2, 1, 2, 400, 128)
    buffer[0, :, :, :333], buffer[1, :, :, :333] = keys, values
    strided_query = query.transpose(1, 2).contiguous().transpose(1, 2)
    got = ops.prompt_attention_with_scores(strided_query, buffer[0, :, :, :333], buffer[1, :, :, :333], log_weights,
                                           0.09, 0.98, 1.0)
    expected = reference.prompt_attention_with_scores(query, keys, values, log_weights, 0.09, 0.98, 1.0)
    for g, e, tol in zip(got, expected, (OUTPUT_TOL[torch.float32], LSE_TOL, SCORE_TOL)):
        torch.testing.assert_close(g.double(), e, **tol)


def test_same_scores_and_log_sum_exp_as_the_separate_ops():
    """What the press got before (prompt_log_sum_exp + prompt_scores) and the model's sdpa output, to float32
    rounding."""
    query, keys, log_weights = make_inputs(1, 9, 3, 500, 500, 64, padding=0.0)
    log_weights.zero_()
    values = make_values(keys)
    output, lse, scores = ops.prompt_attention_with_scores(query, keys, values, log_weights, 0.125, 1.0, 1 / 3)
    torch.testing.assert_close(lse, ops.prompt_log_sum_exp(query, keys, log_weights, 0.125), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(scores, ops.prompt_scores(query, keys, log_weights, 0.125, 1.0, 1 / 3), rtol=2e-5,
                               atol=1e-6)
    sdpa = torch.nn.functional.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=0.125,
                                                            enable_gqa=True)
    torch.testing.assert_close(output, sdpa.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_row_with_nothing_to_attend():
    """A query whose visible slots are all -inf: output 0, log-sum-exp -inf, and it adds nothing to the scores."""
    query, keys, log_weights = make_inputs(1, 2, 1, 10, 10, 8, padding=0.0)
    log_weights[..., :3] = -math.inf
    output, lse, scores = ops.prompt_attention_with_scores(query, keys, make_values(keys), log_weights, 0.3)
    assert bool((lse[..., :3] == -math.inf).all()) and bool((output[:, :3] == 0).all())
    torch.testing.assert_close(scores.double(), reference.prompt_scores(query, keys, log_weights, 0.3, 1.0, 1.0),
                               **SCORE_TOL)


def test_nan_query_reaches_its_row_and_its_kv_head_only():
    """A NaN query row: its output and log-sum-exp are NaN and so are the scores of the slots it sees (plain sums),
    while the other rows, the later slots and the other kv head stay finite."""
    query, keys, log_weights = make_inputs(1, 4, 2, 200, 200, 16, padding=0.0)
    query[:, 0, 150] = float("nan")
    output, lse, scores = ops.prompt_attention_with_scores(query, keys, make_values(keys), log_weights, 0.25, 1.0,
                                                           0.5)
    assert bool(output[:, 150, 0].isnan().all()) and bool(lse[:, 0, 150].isnan())
    assert bool(scores[:, 0, :151].isnan().all()) and bool(torch.isfinite(scores[:, 0, 151:]).all())
    assert bool(torch.isfinite(scores[:, 1]).all())
    finite = torch.ones(output.shape[:3], dtype=torch.bool)
    finite[:, 150, 0] = False
    assert bool(torch.isfinite(output[finite]).all())


def test_deterministic_whatever_the_thread_count():
    query, keys, log_weights = make_inputs(2, 8, 2, 300, 300, 32)
    values = make_values(keys)
    one, two = at_one_and_two_threads(
        lambda: ops.prompt_attention_with_scores(query, keys, values, log_weights, 0.2, 0.98, 1.0))
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_opcheck():
    query, keys, log_weights = make_inputs(1, 4, 2, 20, 33, 16)
    torch.library.opcheck(torch.ops.kvcomp.prompt_attention_with_scores.default,
                          (query, keys, make_values(keys), log_weights, 0.25, 0.9, 0.5))


def test_compile_fullgraph():
    query, keys, log_weights = make_inputs(1, 4, 2, 20, 33, 16)
    values = make_values(keys)

    def attend(q, k, v, b):
        output, _, scores = ops.prompt_attention_with_scores(q, k, v, b, 0.25, 0.98, 1.0)
        return output * 2, scores + 1

    compiled = torch.compile(attend, fullgraph=True)
    for got, expected in zip(compiled(query, keys, values, log_weights), attend(query, keys, values, log_weights)):
        torch.testing.assert_close(got, expected)


def test_autograd_is_refused():
    query, keys, log_weights = make_inputs(1, 4, 2, 20, 33, 16)
    query.requires_grad_(True)
    output, _, _ = ops.prompt_attention_with_scores(query, keys, make_values(keys), log_weights, 0.25)
    with pytest.raises(RuntimeError, match="kvcomp::prompt_attention_with_scores"):
        output.sum().backward()


@pytest.mark.parametrize("change,message", [
    (dict(query=torch.zeros(4, 20, 16)),
     "kvcomp::prompt_attention_with_scores: expected query of shape (B, Hq, q, d), got a 3-d"),
    (dict(values=torch.zeros(1, 2, 33)), "expected values of shape (B, H, T, d), got a 3-d"),
    (dict(values=torch.zeros(1, 2, 33, 16, dtype=torch.float16)), "expected values of dtype Float, got Half"),
    (dict(values=torch.zeros(1, 2, 32, 16)), "expected values.size(2) == 33"),
    (dict(values=torch.zeros(1, 2, 33, 8)), "expected values.size(3) == 16"),
    (dict(keys=torch.zeros(1, 2, 33, 16, dtype=torch.float64)), "expected keys of dtype Float, got Double"),
    (dict(log_weights=torch.zeros(1, 2, 33, dtype=torch.float16)), "expected log_weights of dtype Float"),
    (dict(decay=0.0), "kvcomp::prompt_attention_with_scores: expected decay in (0, 1], got 0"),
    (dict(decay=math.nan), "expected decay in (0, 1], got nan"),
    (dict(input_scale=-1.0), "expected a finite float32 input_scale >= 0, got -1"),
    (dict(scale=math.inf), "expected a finite float32 scale > 0, got inf"),
    (dict(query=torch.zeros(1, 4, 34, 16)), "expected 1 <= q <= T (the q queries are the last q of the T prompt "
     "tokens), got q = query.size(2) = 34 and T = keys.size(2) = 33"),
    (dict(query=torch.zeros(1, 3, 20, 16)), "the 3 query heads of query to be a positive multiple of the 2 kv heads"),
    (dict(query=torch.zeros(1, 4, 0, 16), keys=torch.zeros(1, 2, 0, 16), values=torch.zeros(1, 2, 0, 16),
          log_weights=torch.zeros(1, 2, 0)), "expected a prompt of T >= 1 tokens"),
])
def test_bad_input_names_the_op_and_value(change, message):
    args = dict(query=torch.zeros(1, 4, 20, 16), keys=torch.zeros(1, 2, 33, 16), values=torch.zeros(1, 2, 33, 16),
                log_weights=torch.zeros(1, 2, 33), scale=0.25, decay=0.9, input_scale=1.0)
    args.update(change)
    with pytest.raises(RuntimeError, match="kvcomp::prompt_attention_with_scores") as error:
        torch.ops.kvcomp.prompt_attention_with_scores(*args.values())
    assert message in str(error.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_is_refused_by_name():
    """No CUDA kernel (the prefill path runs sdpa + prompt_scores there): the dispatcher's error names the op."""
    query, keys, log_weights = make_inputs(1, 4, 2, 20, 33, 16, device="cuda")
    with pytest.raises(NotImplementedError, match="prompt_attention_with_scores"):
        ops.prompt_attention_with_scores(query, keys, keys, log_weights, 0.25)


def test_workspace_bytes_follow_the_tiles():
    """G x 64 query rows (rounded to 4) x T rounded to 128, float32, per thread, and the partial sums of
    ceil(64 / (B x H)) chunks of query tiles per (batch, kv head), at most 16 and at most one per tile."""
    query, keys = torch.empty(2, 9, 8192, 64), torch.empty(2, 3, 8192, 64)
    assert ops.prompt_attention_workspace_bytes(query, keys, threads=1) == 4 * 8192 * (192 + 11 * 2 * 3)
    assert ops.prompt_attention_workspace_bytes(query[:1], keys[:1], threads=1) == 4 * 8192 * (192 + 16 * 3)
    assert ops.prompt_attention_workspace_bytes(query[:, :, :100], keys[:, :, :300], threads=8) == \
        4 * 384 * (8 * 192 + 2 * 2 * 3)


# ---------------------------------------------------------------------------------------------------------------
# The prefill path


@pytest.fixture(scope="module")
def austen_ids(default_model):
    from kvpress_cpp.texts import austen_text

    _, tokenizer = default_model
    return tokenizer(austen_text()[:6000], return_tensors="pt").input_ids[:, :300]


@pytest.mark.parametrize("press", [ZSMergePress(budget=0.25), WeightedKVPress(cache_size=0.25)],
                         ids=["zsmerge", "weightedkv"])
def test_prefill_runs_the_fused_op_with_the_press_weights(default_model, austen_ids, press, monkeypatch):
    """Under a press that scores its prompt, every layer's prompt pass runs the fused op with the press's weights,
    the model's logits are sdpa's (to float32 rounding), and the press takes the op's scores as they are."""
    model, _ = default_model
    calls, taken = [], []
    fused = ops.prompt_attention_with_scores

    def recording(*args):
        calls.append(args[5:])
        return fused(*args)

    monkeypatch.setattr(ops, "prompt_attention_with_scores", recording)
    take = attention.take_prefill_attention

    def recording_take(module, length):
        kept = take(module, length)
        taken.append(kept is not None and kept.scores is not None)
        return kept

    monkeypatch.setattr("kvpress_cpp.presses.base.take_prefill_attention", recording_take)
    with torch.no_grad():
        plain = model(austen_ids).logits
        with press(model):
            pressed = model(austen_ids, use_cache=True).logits
    layers = model.config.num_hidden_layers
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    weights = (press.decay, 1.0) if isinstance(press, ZSMergePress) else (1.0, 1.0 / group)
    assert calls == [weights] * layers and taken == [True] * layers
    torch.testing.assert_close(pressed, plain, rtol=1e-4, atol=1e-4)


def test_prefill_past_the_workspace_limit_runs_sdpa_and_prompt_scores(default_model, austen_ids, monkeypatch):
    """With a workspace limit below the prompt's, the prompt pass runs sdpa and keeps its log-sum-exp; the press
    scores with prompt_scores and keeps the same cache as with the fused op."""
    from tests.generation import greedy
    from kvpress_cpp.cache import get_state

    model, _ = default_model
    press = WeightedKVPress(cache_size=0.25)
    tokens, cache = greedy(model, austen_ids, press=press, max_new_tokens=2)
    monkeypatch.setattr(ops, "FUSED_PROMPT_WORKSPACE_LIMIT", 0)
    monkeypatch.setattr(ops, "prompt_attention_with_scores", None)  # must not be called
    before_tokens, before = greedy(model, austen_ids, press=press, max_new_tokens=2)
    assert torch.equal(tokens, before_tokens)
    for layer, before_layer in zip(cache.layers, before.layers):
        torch.testing.assert_close(layer.keys, before_layer.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer.values, before_layer.values, rtol=1e-4, atol=1e-5)
        for name, per_slot in get_state(layer).per_slot.items():
            torch.testing.assert_close(per_slot, get_state(before_layer).per_slot[name], rtol=1e-4, atol=1e-7)
