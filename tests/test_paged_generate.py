"""PagedKVCache in what users run: greedy ``generate`` gives the rectangular cache's tokens for every press (ours and
kvpress's, head-wise ones included) on the tiny models and SmolLM2, ours in float16 and bfloat16 models too; kvpress's
pipeline answers several questions on one paged context; padded batches; and the memory held is each head's own
slots."""

from __future__ import annotations

import re
import subprocess
import sys
from contextlib import ExitStack, nullcontext
from pathlib import Path

import pytest
import torch
from kvpress import (AdaKVPress, BlockPress, ChunkPress, ComposedPress, CriticalAdaKVPress, DecodingPress, DMSPress,
                     KnormPress, PrefillDecodingPress, PyramidKVPress, SnapKVPress, ThinKPress, TOVAPress)
from transformers import DynamicCache, pipeline
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_cpp.attention import patch_eager_attention
from kvpress_cpp.cache import cache_bytes, get_state
from kvpress_cpp.paged_cache import PagedKVCache, PagedLayer
from kvpress_cpp.presses import (GVotePress, KeepKVPress, KVzapPress, KVzapThresholdPress, WeightedKVPress,
                                 ZSMergePress)
from tests import generation, kvpress_hooks
from tests.generation import TINY_MODELS, prompt_ids
from tests.models import make_tiny_llama, make_tiny_qwen3
from tests.test_kvzap_press import write_surrogate
from tests.test_paged_cache import check_allocator


def write_tiny_surrogate(tmp_path_factory, make_model) -> Path:
    model, _ = make_model()
    return write_surrogate(tmp_path_factory.mktemp("surrogate") / "mlp", model, "mlp", seed=0, scale=4.0)


@pytest.fixture(scope="module")
def surrogate_dir(tmp_path_factory):
    return write_tiny_surrogate(tmp_path_factory, make_tiny_llama)


@pytest.fixture(scope="module")
def qwen3_surrogate_dir(tmp_path_factory):
    return write_tiny_surrogate(tmp_path_factory, make_tiny_qwen3)


# Every press we ship, and kvpress's head-wise ones (which only mask on a rectangular cache).
PRESSES = {
    "none": lambda d: None,
    "zsmerge": lambda d: ZSMergePress(budget=24),
    "weightedkv": lambda d: WeightedKVPress(cache_size=24),
    "keepkv": lambda d: KeepKVPress(budget=24, recent=8),
    "kvzap": lambda d: KVzapThresholdPress(threshold=0.0, sliding_window=8, surrogate_dir=d),
    "gvote": lambda d: GVotePress(),
    "snapkv": lambda d: SnapKVPress(compression_ratio=0.5),
    "pyramidkv": lambda d: PyramidKVPress(compression_ratio=0.5),
    "adakv-snapkv": lambda d: AdaKVPress(SnapKVPress(compression_ratio=0.6)),
    "dms-kvzap": lambda d: DMSPress(KVzapPress(surrogate_dir=d), threshold=0.0, sliding_window_size=8, decoding=True),
}
HEAD_WISE_MASKING = ("adakv-snapkv", "dms-kvzap")
KVPRESS_PRESSES = ("snapkv", "pyramidkv", *HEAD_WISE_MASKING)


def greedy(model, input_ids, cache, press=None, max_new_tokens=12, **kwargs):
    """generation.greedy's tokens, into `cache` (each test here compares two caches)."""
    return generation.greedy(model, input_ids, press, max_new_tokens, cache, **kwargs)[0]


@pytest.mark.parametrize("make_model,attn", TINY_MODELS)
@pytest.mark.parametrize("name", kvpress_hooks.cases(PRESSES, KVPRESS_PRESSES))
def test_generate_equals_the_rectangular_cache(make_model, attn, name, surrogate_dir, qwen3_surrogate_dir):
    if name in HEAD_WISE_MASKING and attn == "eager":
        pytest.skip("kvpress's head-wise presses refuse eager attention")
    surrogate_dir = surrogate_dir if make_model is make_tiny_llama else qwen3_surrogate_dir
    model, tokenizer = make_model()
    model.set_attn_implementation(attn)
    patch_eager_attention(model)
    ids = prompt_ids(tokenizer, 96)
    rectangular_cache, paged_cache = DynamicCache(), PagedKVCache(block_size=4)
    expected = greedy(model, ids, rectangular_cache, PRESSES[name](surrogate_dir))
    got = greedy(model, ids, paged_cache, PRESSES[name](surrogate_dir))
    assert torch.equal(got, expected)
    assert paged_cache.bytes_held() <= cache_bytes(rectangular_cache) * 1.1 + 4096


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["zsmerge", "weightedkv", "keepkv", "kvzap", "gvote"])
def test_generate_in_half_precision(name, dtype, surrogate_dir):
    """Each of our presses in a bfloat16 / float16 model (as users run them on GPUs): both caches hold keys and
    values in the model's dtype (a float32 copy would double the memory), finite, the press's per-slot state stays
    float32, and the paged cache gives the rectangular cache's tokens."""
    model, tokenizer = make_tiny_llama()
    model.to(dtype)
    ids = prompt_ids(tokenizer, 96)
    rectangular_cache, paged_cache = DynamicCache(), PagedKVCache(block_size=4)
    expected = greedy(model, ids, rectangular_cache, PRESSES[name](surrogate_dir))
    got = greedy(model, ids, paged_cache, PRESSES[name](surrogate_dir))
    assert torch.equal(got, expected)
    for cache in (rectangular_cache, paged_cache):
        for layer in cache.layers:
            if isinstance(layer, PagedLayer):
                layer.flush()
                assert (layer.key_blocks.dtype, layer.value_blocks.dtype) == (dtype, dtype)
            assert (layer.keys.dtype, layer.values.dtype) == (dtype, dtype)
            assert bool(torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all())
            state = get_state(layer)
            assert state is not None and state.log_weights.dtype == torch.float32
            assert all(t.dtype == torch.float32 for t in state.per_slot.values() if t.is_floating_point())


def test_a_prefill_only_press_state_covers_the_whole_layer_on_both_caches():
    """get_state after GVote (no decoding step) and decoding, as paged_cache documents: the paged layer's log-weights
    are the DynamicCache's, the prefill's columns padded with 0 for each decoded token."""
    model, tokenizer = make_tiny_llama()
    ids, new_tokens = prompt_ids(tokenizer, 120), 4
    rectangular_cache, paged_cache = DynamicCache(), PagedKVCache(block_size=4)
    greedy(model, ids, rectangular_cache, GVotePress(nucleus_p=0.6), max_new_tokens=new_tokens)
    greedy(model, ids, paged_cache, GVotePress(nucleus_p=0.6), max_new_tokens=new_tokens)
    for rectangular, paged in zip(rectangular_cache.layers, paged_cache.layers):
        whole = get_state(rectangular).log_weights
        prefill = whole.shape[-1] - (new_tokens - 1)  # (the last token generated is never attended)
        assert whole.shape[-1] == rectangular.keys.shape[-2]
        assert torch.equal(whole[..., prefill:], torch.zeros_like(whole[..., prefill:]))
        assert torch.equal(get_state(paged).log_weights, whole)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["none", "zsmerge", "weightedkv", "keepkv", "gvote"])
def test_generate_under_autocast(name, attn, surrogate_dir):
    """A float32 model under torch.autocast leaves float32 keys (the rotary's float32 tables) beside values in the
    autocast dtype: the paged layer refused the values as "another model's pass", and the presses that recompute the
    prompt's queries (GVote; the others under eager attention) passed them in the projection's bfloat16 beside the
    float32 keys, on either cache. Both pools hold the wider dtype; the tokens are the rectangular cache's."""
    model, tokenizer = make_tiny_llama()
    model.set_attn_implementation(attn)
    patch_eager_attention(model)
    ids = prompt_ids(tokenizer, 96)
    rectangular_cache, paged_cache = DynamicCache(), PagedKVCache(block_size=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = greedy(model, ids, rectangular_cache, PRESSES[name](surrogate_dir))
        got = greedy(model, ids, paged_cache, PRESSES[name](surrogate_dir))
    assert torch.equal(got, expected)
    assert {layer.key_blocks.dtype for layer in paged_cache.layers} == {torch.float32}
    assert {layer.value_blocks.dtype for layer in paged_cache.layers} == {torch.float32}


@kvpress_hooks.mark
def test_kvpress_imported_after_us_leaves_the_paged_path_outermost():
    """A user who imports kvpress_cpp before kvpress (a fresh process): kvpress's masking wrapper must not end up
    around ours, where it wrote the masked slots an earlier generate left on the modules into a paged layer's key
    pool (a shape error at the next paged prefill). AdaKV on the rectangular cache, then on the paged one."""
    code = """
import kvpress_cpp.attention  # first, before anything imports kvpress
import torch
from kvpress import AdaKVPress, SnapKVPress
from transformers import DynamicCache
from kvpress_cpp.paged_cache import PagedKVCache
from tests.generation import prompt_ids
from tests.models import make_tiny_llama
from tests.test_paged_generate import greedy

model, tokenizer = make_tiny_llama()
model.set_attn_implementation("sdpa")
ids = prompt_ids(tokenizer, 96)
expected = greedy(model, ids, DynamicCache(), AdaKVPress(SnapKVPress(compression_ratio=0.6)))
got = greedy(model, ids, PagedKVCache(block_size=4), AdaKVPress(SnapKVPress(compression_ratio=0.6)))
assert torch.equal(got, expected), (got, expected)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("name", kvpress_hooks.cases(HEAD_WISE_MASKING + ("kvzap", "gvote"), KVPRESS_PRESSES))
def test_head_wise_presses_free_memory(name, surrogate_dir):
    """The slots each head drops are gone from the paged cache: it holds its kept slots, within a block per head
    (plus the slots' log-weights and positions), where the rectangular cache holds at least its longest head."""
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 96)
    cache = PagedKVCache(block_size=4)
    with torch.no_grad(), PRESSES[name](surrogate_dir)(model):
        model(ids, past_key_values=cache)
    full = 0
    for layer in cache.layers:
        layer.flush()
        heads = layer.lengths.numel()
        full += heads * 96 * (layer.key_blocks[0, 0].nbytes + layer.value_blocks[0, 0].nbytes)
        slots = int(layer.lengths.sum())
        assert layer.blocks_in_use() <= slots // 4 + heads
    assert cache.bytes_held() < 0.9 * full


@kvpress_hooks.mark
def test_pipeline_answers_several_questions_on_one_paged_context():
    model, tokenizer = make_tiny_llama()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    context = "It is a truth universally acknowledged, that a single man in possession of a good fortune " * 6
    questions = ["who is in want of a wife?", "what is universally acknowledged?", "how much fortune?"]
    for press in (AdaKVPress(SnapKVPress(compression_ratio=0.5)), GVotePress(), TOVAPress(compression_ratio=0.5)):
        paged = PagedKVCache(block_size=4)
        expected = pipe(context, questions=questions, press=press, max_new_tokens=6, cache=DynamicCache())
        got = pipe(context, questions=questions, press=press, max_new_tokens=6, cache=paged)
        assert got == expected, type(press).__name__
        context_lengths = [layer.lengths.clone() for layer in paged.layers]
        if isinstance(press, GVotePress):
            # The pipeline feeds a new context from the slot count (no positions): over our compressed context, whose
            # tokens reach further, that would place it among them, so it is refused as a re-feed.
            with pytest.raises(ValueError, match=r"GVotePress \(its context closed\): this pass feeds \d+ tokens"):
                pipe(context, questions=questions[:1], press=None, max_new_tokens=6, cache=paged)
            continue
        pipe(context, questions=questions[:1], press=None, max_new_tokens=6, cache=paged)  # appends a new context
        assert all(bool((layer.lengths >= before).all()) for layer, before in zip(paged.layers, context_lengths))


@kvpress_hooks.mark
@pytest.mark.parametrize("cache_type", [PagedKVCache, DynamicCache])
@pytest.mark.parametrize("cut", ["pipeline", "prompt-lookup"])
def test_a_decoding_dms_press_over_a_cut_cache_is_refused(cut, cache_type, surrogate_dir):
    """DMSPress(decoding=True) keeps the scores of the last tokens it saw, and decides each token as it leaves its
    window. A cut (the pipeline back to the context after each answer; prompt lookup's crop of rejected candidates)
    leaves the scores of the tokens cut in that buffer, so the next pass's marks land on other tokens (a paged cache
    evicted context tokens the first question kept; past a DynamicCache's end, kvpress's attention raises an
    IndexError), and tokens the cut tokens pushed out of the window were decided early. One question runs, and prompt
    lookup with marks at prefill only (test_head_wise_masks_are_counted_as_generate_counts_them); the cut is refused,
    naming the press."""
    model, tokenizer = make_tiny_llama()
    press = DMSPress(KVzapPress(surrogate_dir=surrogate_dir), threshold=-3.0, sliding_window_size=8, decoding=True)
    refused = pytest.raises(ValueError, match=r"DMSPress\(decoding=True\): a pass from position \d+ on layer 0, "
                                              r"which it has scored up to position \d+: the cache was cut back")
    if cut == "prompt-lookup":
        ids = prompt_ids(tokenizer, 96)
        with refused:
            greedy(model, torch.cat([ids, ids[:, :10]], dim=1), cache_type(), press, prompt_lookup_num_tokens=3)
        return
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    context = "It is a truth universally acknowledged, that a single man in possession of a good fortune " * 6
    pipe(context, question="who is in want of a wife?", press=press, max_new_tokens=3, cache=cache_type())
    with refused:
        pipe(context, questions=["who is in want of a wife?", "what is universally acknowledged?"], press=press,
             max_new_tokens=3, cache=cache_type())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padded_batch(attn):
    """Prompts of different lengths, left-padded: the same tokens as the rectangular cache, and each row holds only
    the blocks of its own tokens."""
    model, tokenizer = make_tiny_llama()
    model.set_attn_implementation(attn)
    patch_eager_attention(model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = ["It is a truth universally acknowledged, that a single man " * 4, "a good fortune " * 2]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    cache = PagedKVCache(block_size=4)
    expected = greedy(model, inputs.input_ids, DynamicCache(), attention_mask=inputs.attention_mask)
    got = greedy(model, inputs.input_ids, cache, attention_mask=inputs.attention_mask)
    assert torch.equal(got, expected)
    real = inputs.attention_mask.sum(-1) + 12 - 1  # the last generated token is not cached
    for layer in cache.layers:
        assert layer.lengths.tolist() == [[int(n)] * layer.lengths.shape[1] for n in real]


@pytest.mark.parametrize("scorer", [lambda d: SnapKVPress(compression_ratio=0.6, window_size=8),
                                    lambda d: KnormPress(compression_ratio=0.5),
                                    lambda d: KVzapPress(compression_ratio=0.5, surrogate_dir=d)],
                         ids=["snapkv", "knorm", "kvzap"])
@kvpress_hooks.mark
def test_adakv_on_a_padded_prompt_evicts_what_it_evicts_unpadded(scorer, surrogate_dir):
    """AdaKVPress marks columns of the keys it scores. A paged prefill holds no column of the padding every row shares
    (7 here), and evicted the marks as token positions: every eviction landed 7 tokens early. The padded prompt now
    keeps the unpadded prompt's tokens (kvpress's AdaKV on a DynamicCache, which holds no padding there). KVzap's
    scorer, which scores hidden states, scores those of the tokens held (it refused the 7 extra ones, naming a
    ComposedPress that was not there)."""
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 80)
    padded, mask = torch.nn.functional.pad(ids, (7, 0)), torch.nn.functional.pad(torch.ones_like(ids), (7, 0))
    cache = PagedKVCache(block_size=4)
    got = greedy(model, padded, cache, lambda m: AdaKVPress(scorer(surrogate_dir))(m), attention_mask=mask)
    unpadded_cache = DynamicCache()
    expected = greedy(model, ids, unpadded_cache, lambda m: AdaKVPress(scorer(surrogate_dir))(m))
    assert torch.equal(got, expected)
    held = sum(int(layer.lengths.sum()) for layer in cache.layers)
    assert held < sum(layer.keys.shape[1] * layer.keys.shape[2] for layer in unpadded_cache.layers)  # it evicted


def test_a_chunked_prefill_of_a_padded_batch_holds_each_row_alone_or_is_refused():
    """A prefill in chunks (generate's prefill_chunk_size, or by hand) of a batch whose row 1 is left-padded by 20:
    the paged layer drops the padding it sees in the first chunk only, and later passes attend through the block
    tables without the mask, so padding in a later chunk was held and attended as tokens (row 1's next token then
    differed from its run alone). A first chunk reaching every row's first token gives row 1 its own logits; one
    that is all padding for a row is refused, and leaves the cache empty."""
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 40)
    batch = torch.cat([ids, torch.nn.functional.pad(ids[:, :20], (20, 0))])
    mask = torch.cat([torch.ones(1, 40, dtype=torch.long), torch.arange(40).view(1, -1).ge(20).long()])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        alone = model(ids[:, :20]).logits[0, -1]

        def last_logits(cache, first_chunk):
            for start, end in ((0, first_chunk), (first_chunk, 40)):
                out = model(batch[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end],
                            past_key_values=cache, use_cache=True)
            return out.logits[1, -1]

        torch.testing.assert_close(last_logits(PagedKVCache(block_size=4), 24), alone, atol=1e-4, rtol=1e-4)
        cache = PagedKVCache(block_size=4)
        with pytest.raises(ValueError, match=r"PagedKVCache: a prefill of 8 tokens holds only padding for batch rows "
                                             r"\[1\]: generate's prefill_chunk_size"):
            last_logits(cache, 8)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("name", ["zsmerge", "weightedkv", "keepkv"])
def test_padded_batch_with_a_row_under_the_budget(name, block_size, surrogate_dir):
    """A left-padded batch under a press that compresses each row alone (RowStates), one row shorter than the budget:
    every row gets the tokens it gets alone on a DynamicCache. The press lays such a row out after -inf padding, which
    the paged layer does not store; its view showed the row's slots first and the padding after, so the press's next
    pass read padding as the row's slots and the short row's tokens went wrong, silently."""
    model, tokenizer = make_tiny_llama()
    long, short = prompt_ids(tokenizer, 40), prompt_ids(tokenizer, 10)
    ids = torch.cat([long, torch.nn.functional.pad(short, (30, 0))])
    mask = torch.cat([torch.ones_like(long), torch.nn.functional.pad(torch.ones_like(short), (30, 0))])
    expected = torch.cat([greedy(model, row, DynamicCache(), PRESSES[name](surrogate_dir)) for row in (long, short)])
    got = greedy(model, ids, PagedKVCache(block_size=block_size), PRESSES[name](surrogate_dir), attention_mask=mask)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", ["zsmerge", "weightedkv", "keepkv", "kvzap", "gvote"])
def test_a_batch_whose_every_row_is_padded_under_a_press(name, surrogate_dir):
    """A batch whose every row is left-padded (padded to a multiple, say), under each press: every row gets the
    tokens it gets alone, on both caches. A paged prefill drops the padding every row has, so the layer held fewer
    columns than the prompt's tokens: ZSMerge, WeightedKV, KeepKV and KVzap refused it as compressed by a press
    before them, and GVote compressed the shorter row from the wrong columns, silently."""
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 96)
    rows = [ids[:, :96], ids[:, 10:80]]
    batch = torch.cat([torch.nn.functional.pad(row, (101 - row.shape[1], 0)) for row in rows])
    mask = torch.cat([torch.nn.functional.pad(torch.ones_like(row), (101 - row.shape[1], 0)) for row in rows])
    expected = torch.cat([greedy(model, row, DynamicCache(), PRESSES[name](surrogate_dir)) for row in rows])
    for cache in (DynamicCache(), PagedKVCache(block_size=4)):
        assert torch.equal(greedy(model, batch, cache, PRESSES[name](surrogate_dir), attention_mask=mask), expected)


@pytest.mark.parametrize("case", ["prompt-lookup", "second-turn"])
def test_padding_every_row_has_is_counted_as_generate_counts_it(case):
    """A batch whose every row is left-padded (a batch of one padded to a multiple, say): generate counts the cache's
    width (get_seq_length) as its tokens, where it resumes a second call and what it crops after rejected
    prompt-lookup candidates, so the paged cache counts the padding its prefill dropped, as the rectangular cache's
    width holds it. It did not: the second call re-fed tokens the cache held, at other positions, and the crop kept
    the rejected candidates, silently."""
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 24)
    ids = torch.cat([ids, ids[:, :10]], dim=1)  # a repeat, so that prompt lookup proposes candidates
    padded = torch.nn.functional.pad(ids, (5, 0))
    mask = torch.nn.functional.pad(torch.ones_like(ids), (5, 0))

    def tokens(cache):
        if case == "prompt-lookup":
            return greedy(model, padded, cache, attention_mask=mask, prompt_lookup_num_tokens=3)
        first = torch.cat([padded, greedy(model, padded, cache, attention_mask=mask)], dim=1)
        follow_up = torch.cat([first, prompt_ids(tokenizer, 7)], dim=1)
        return greedy(model, follow_up, cache, attention_mask=torch.nn.functional.pad(
            torch.ones_like(follow_up[:, 5:]), (5, 0)))

    assert torch.equal(tokens(PagedKVCache(block_size=4)), tokens(DynamicCache()))


@pytest.mark.parametrize("case", ["prompt-lookup", "second-turn"])
@pytest.mark.parametrize("name", kvpress_hooks.cases(HEAD_WISE_MASKING, KVPRESS_PRESSES))
def test_head_wise_masks_are_counted_as_generate_counts_them(name, case, surrogate_dir):
    """kvpress's head-wise presses mask slots per head, and a paged layer evicts them: a column every head's mark
    emptied left its view. generate counts the cache's width as its tokens, where it resumes a second call and what it
    crops rejected prompt-lookup candidates to, so the paged view keeps those columns, as the rectangular cache keeps
    its masked ones. It did not: the second call re-fed tokens the cache held, at other positions, and the crop cut
    other tokens than the candidates, silently."""
    if name == "adakv-snapkv" and case == "prompt-lookup":
        pytest.skip("no reference: AdaKVPress marks the candidates of the first pass on a DynamicCache, which the crop "
                    "then removes, and kvpress's attention patch indexes past the cropped keys (an IndexError)")
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 96)
    ids = torch.cat([ids, ids[:, :10]], dim=1)  # a repeat, so that prompt lookup proposes candidates

    def tokens(cache):
        press = PRESSES[name](surrogate_dir)
        if case == "prompt-lookup":
            if isinstance(press, DMSPress):  # marks at prefill; a decoding one refuses the crop
                press.decoding = False  # (test_a_decoding_dms_press_over_a_cut_cache_is_refused)
            return greedy(model, ids, cache, press, prompt_lookup_num_tokens=3)
        first = torch.cat([ids, greedy(model, ids, cache, press)], dim=1)
        return greedy(model, torch.cat([first, prompt_ids(tokenizer, 7)], dim=1), cache, press)

    assert torch.equal(tokens(PagedKVCache(block_size=4)), tokens(DynamicCache()))


PRESSES_ON_SMOLLM2 = {
    "zsmerge": lambda: ZSMergePress(budget=0.25),
    "weightedkv": lambda: WeightedKVPress(cache_size=0.25),
    "keepkv": lambda: KeepKVPress(budget=0.25),
    "kvzap": lambda: KVzapThresholdPress(),
    "gvote": lambda: GVotePress(),
    "adakv-snapkv": lambda: AdaKVPress(SnapKVPress(compression_ratio=0.75)),
}


@pytest.mark.parametrize("name", kvpress_hooks.cases(PRESSES_ON_SMOLLM2, KVPRESS_PRESSES))
def test_smollm2_generate_equals_the_rectangular_cache(default_model, name):
    model, tokenizer = default_model
    ids = prompt_ids(tokenizer, 400)
    expected = greedy(model, ids, DynamicCache(), PRESSES_ON_SMOLLM2[name](), max_new_tokens=16)
    got = greedy(model, ids, PagedKVCache(), PRESSES_ON_SMOLLM2[name](), max_new_tokens=16)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_chunked_prefill(attn):
    """A prompt fed in chunks of several tokens (multi-token passes over a non-empty paged cache): the logits of the
    rectangular cache's."""
    model, tokenizer = make_tiny_llama()
    model.set_attn_implementation(attn)
    patch_eager_attention(model)
    ids = prompt_ids(tokenizer, 90)
    logits = {}
    for name, cache in (("rectangular", DynamicCache()), ("paged", PagedKVCache(block_size=8))):
        with torch.no_grad():
            logits[name] = torch.cat([model(ids[:, start:start + 37], past_key_values=cache).logits
                                      for start in range(0, 90, 37)], dim=1)
    torch.testing.assert_close(logits["paged"], logits["rectangular"], rtol=1e-4, atol=1e-4)


def test_paged_cache_alone_routes_attention():
    """A user who imports nothing but PagedKVCache (no press, sdpa): generate runs and matches the DynamicCache."""
    import subprocess
    import sys

    script = ("import torch; from kvpress_cpp.paged_cache import PagedKVCache; from transformers import DynamicCache;"
              "from tests.models import make_tiny_llama; from tests.generation import prompt_ids;"
              "m, t = make_tiny_llama(); ids = prompt_ids(t, 40);"
              "run = lambda c: m.generate(ids, past_key_values=c, max_new_tokens=5, do_sample=False);"
              "assert torch.equal(run(PagedKVCache()), run(DynamicCache()))")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)


def tiny_model(architecture: str, **config):
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{architecture}Config")(vocab_size=256, pad_token_id=0, **config)
    model_class = (getattr(transformers, f"{architecture}ForCausalLM", None)
                   or getattr(transformers, f"{architecture}LMHeadModel"))
    return model_class(config).eval()


@pytest.mark.parametrize("architecture,config", [
    ("Falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True,
                    num_kv_heads=2)),
    ("Bloom", dict(hidden_size=64, n_layer=2, n_head=4)),
])
def test_a_model_whose_attention_skips_the_registry_is_refused_before_it_reads_the_pools(architecture, config):
    """Falcon (up to transformers 5.24) and Bloom compute their attention themselves (no transformers attention
    registry): on a PagedKVCache Falcon took the block pools for its keys (different greedy tokens from the second
    step on, no error). Their first append is refused, naming the layer, before any output is computed from the
    pools; their DynamicCache run is left alone. Where the model's file dispatches through the registry (Falcon from
    transformers 5.25), the paged cache gives the DynamicCache's tokens."""
    model = tiny_model(architecture, **config)
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(5))
    run = lambda cache: model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)  # noqa: E731
    with torch.no_grad():
        if "ALL_ATTENTION_FUNCTIONS" in vars(sys.modules[type(model).__module__]):
            assert torch.equal(run(PagedKVCache()), run(DynamicCache()))
            return
        run(DynamicCache())
        with pytest.raises(ValueError, match=rf"PagedKVCache: layer 0 \({architecture}Attention\) computes its "
                                             r"attention itself, not through transformers' attention registry"):
            model(ids, past_key_values=PagedKVCache())


def test_a_model_whose_attention_has_no_scale_is_refused_on_our_paths():
    """GPT-2's attention goes through the registry, under transformers 4 without giving it a `scaling` (a kwarg or
    attribute): our paths over a paged or compressed cache refuse it, naming the layer, instead of an
    AttributeError. Where it gives one (transformers 5), the paged cache gives the DynamicCache's tokens."""
    model = tiny_model("GPT2", n_embd=64, n_layer=2, n_head=4)
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    run = lambda cache: model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)  # noqa: E731
    with torch.no_grad():
        if hasattr(model.transformer.h[0].attn, "scaling"):
            assert torch.equal(run(PagedKVCache()), run(DynamicCache()))
            return
        with pytest.raises(ValueError, match=r"kvpress_cpp: layer 0 \(GPT2Attention\) gives its attention no scale"):
            run(PagedKVCache())


@kvpress_hooks.mark
@pytest.mark.parametrize("inference_mode", [False, True])
@pytest.mark.parametrize("before", [None, "gvote"])
def test_think_prunes_the_blocks_where_the_view_is_a_gathered_copy(before, inference_mode):
    """kvpress's ThinK zeroes key channels in place in the keys it is handed and hands them back. Where the view is
    gathered from the blocks (a left-padded batch; heads GVote left at different lengths) and not the pools' own
    memory, the zeroed channels never reached the blocks: the paged cache gave the tokens of no ThinK at all. The
    rectangular cache's tokens, on a padded batch, with or without GVote first, also under inference mode (where the
    view keeps no version counter)."""
    model, tokenizer = make_tiny_llama()
    long, short = prompt_ids(tokenizer, 52), prompt_ids(tokenizer, 40)
    ids = torch.cat([long, torch.nn.functional.pad(short, (12, 0), value=tokenizer.pad_token_id)])
    mask = torch.cat([torch.ones_like(long), torch.nn.functional.pad(torch.ones_like(short), (12, 0))])

    def press():
        think = ThinKPress(0.5, window_size=2)
        return think if before is None else ComposedPress([GVotePress(), think])

    with torch.inference_mode() if inference_mode else nullcontext():
        expected = greedy(model, ids, DynamicCache(), press(), max_new_tokens=6, attention_mask=mask)
        cache = PagedKVCache(block_size=4)
        got = greedy(model, ids, cache, press(), max_new_tokens=6, attention_mask=mask)
    assert torch.equal(got, expected)
    assert not torch.equal(got, greedy(model, ids, PagedKVCache(block_size=4), GVotePress() if before else None,
                                       max_new_tokens=6, attention_mask=mask))  # ThinK changes them
    prompt_keys = cache.layers[0].keys[:, :, :-5]  # (the 5 tokens generated after the prefill last, not pruned)
    assert bool(((prompt_keys == 0).all(dim=-2).sum(-1) >= 8).all())  # half of the 16 channels zero on every head


def distinct_token_prompt(model, length: int, seed: int = 0) -> torch.Tensor:
    """A prompt of `length` different token ids: Knorm scores a layer-0 key by its token alone (the rotary embedding
    keeps norms), so distinct tokens never tie."""
    return torch.randperm(model.config.vocab_size - 3, generator=torch.Generator().manual_seed(seed))[:length][None] + 3


def layer0_keys(model, sequence: torch.Tensor) -> torch.Tensor:
    """The first layer's keys (B, H, T, d) of `sequence` uncompressed: they depend on the tokens and positions only."""
    cache = DynamicCache()
    with torch.no_grad():
        model(sequence, past_key_values=cache)
    return cache.layers[0].keys


def held_positions(layer: PagedLayer) -> list[list[list[int]]]:
    """Each (batch, kv head)'s token positions, in view order, checking that every slot held knows its position."""
    layer.flush()  # a press's last write, stored
    positions = layer.view_positions(layer.keys)
    assert ((positions >= 0).sum(-1) == layer.lengths).all(), "a held slot lost its position"
    return [[[p for p in head.tolist() if p >= 0] for head in row] for row in positions]


@kvpress_hooks.mark
def test_adakv_while_decoding_evicts_the_tokens_it_masks_on_the_rectangular_cache():
    """DecodingPress(AdaKVPress(Knorm)) scores the paged view again at every compression. Once marks had evicted
    slots, the view's columns no longer were token positions, and its empty columns (zeros, the top Knorm score) were
    scored as tokens: the marks evicted other tokens and each head kept 2-10 slots of a target of 40. On a
    DynamicCache kvpress scores the tokens it masked again with the rest; Knorm's scores do not change, so it masks
    the tokens it would evict: each head must hold exactly its unmasked tokens, and give the same tokens."""
    model, _ = make_tiny_llama()
    ids = distinct_token_prompt(model, 150)

    def press():
        return DecodingPress(AdaKVPress(KnormPress()), compression_interval=3, target_size=40,
                             hidden_states_buffer_size=3)

    dynamic, paged = DynamicCache(), PagedKVCache(block_size=4)
    expected = greedy(model, ids, dynamic, press())
    masks = [layer.self_attn.masked_key_indices for layer in model.model.layers]
    assert torch.equal(greedy(model, ids, paged, press()), expected)
    for layer, (batch, head, column), rectangular in zip(paged.layers, masks, dynamic.layers):
        masked = {(int(b), int(h), int(c)) for b, h, c in zip(batch, head, column)}
        unmasked = [[[c for c in range(rectangular.keys.shape[2]) if (0, h, c) not in masked]
                     for h in range(rectangular.keys.shape[1])]]
        assert [[sorted(head) for head in row] for row in held_positions(layer)] == unmasked


@kvpress_hooks.mark
def test_a_selection_after_head_wise_eviction_holds_no_empty_column():
    """AdaKVPress at prefill, then DecodingPress(Knorm) while decoding: Knorm ranked the view's empty columns (zero
    keys: its top score) first and the layer stored 60 of a head's 62 slots as zero keys, attended as tokens
    (kvpress itself fails on a DynamicCache here). Every slot held is now a token: its key that token's key, and each
    head keeps the best-scored of the tokens it held."""
    model, _ = make_tiny_llama()
    ids = distinct_token_prompt(model, 150)
    press = PrefillDecodingPress(prefilling_press=AdaKVPress(KnormPress(0.5)),
                                 decoding_press=DecodingPress(KnormPress(), compression_interval=4, target_size=30,
                                                              hidden_states_buffer_size=4))
    cache = PagedKVCache(block_size=4)
    generated = greedy(model, ids, cache, press, max_new_tokens=9)
    layer = cache.layers[0]
    expected_keys = layer0_keys(model, torch.cat([ids, generated[:, :-1]], -1))[0]
    positions = held_positions(layer)[0]
    assert layer.lengths.tolist() == [[30] * len(positions)]  # the last compression was the last pass
    for head, held in enumerate(positions):
        torch.testing.assert_close(layer.keys[0, head, :30], expected_keys[head, held], rtol=0, atol=1e-6)


def padded_pair(model) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Rows of 28 and 52 distinct tokens, and the batch left-padded to 52 with its attention mask."""
    rows = [distinct_token_prompt(model, 28, seed=1), distinct_token_prompt(model, 52, seed=2)]
    padded = torch.cat([torch.nn.functional.pad(rows[0], (24, 0)), rows[1]])
    mask = torch.cat([torch.nn.functional.pad(torch.ones_like(rows[0]), (24, 0)), torch.ones_like(rows[1])])
    return rows, padded, mask


@kvpress_hooks.mark
@pytest.mark.parametrize("inference_mode", [False, True])
def test_a_scorer_press_on_a_padded_batch_keeps_each_rows_best_tokens(inference_mode):
    """A padded prefill drops the padding of the shorter rows, which the view shows as empty columns. KnormPress
    ranked those zero keys first: a row of 28 tokens held 39 slots of which 11 were zero keys. Each head of each row
    now holds the best-scored of its own tokens: ScorerPress keeps int(52 * 0.75) = 39 columns of the batch, so the
    short row keeps all 28, the long one its 39 best by Knorm (one layer-0 key per token). A prefill under
    inference_mode is stored when the layer is next read outside it, which forgot the view the selection was from."""
    model, _ = make_tiny_llama()
    rows, padded, mask = padded_pair(model)
    cache = PagedKVCache(block_size=4)
    with torch.inference_mode(inference_mode), KnormPress(compression_ratio=0.25)(model):
        model(padded, attention_mask=mask, past_key_values=cache)
    for row, (ids, padding) in enumerate(zip(rows, (24, 0))):
        norms = layer0_keys(model, ids)[0].norm(dim=-1)  # (H, T)
        best = (-norms).topk(min(39, ids.shape[1]), dim=-1).indices
        expected = [sorted((best[head] + padding).tolist()) for head in range(norms.shape[0])]
        assert [sorted(head) for head in held_positions(cache.layers[0])[row]] == expected


@kvpress_hooks.mark
def test_blockpress_where_every_row_starts_with_padding_is_refused_naming_it():
    """The paged cache holds no slots for the padding every row shares, so BlockPress's hidden states no longer line up
    with the layer's keys: it stopped on "shape '[2, 54, 2, -1]' is invalid" (where one row is unpadded, the cache
    refuses the selection over the view's holes, naming BlockPress)."""
    model, _ = make_tiny_llama()
    _, padded, mask = padded_pair(model)
    ids, attention_mask = torch.nn.functional.pad(padded, (4, 0)), torch.nn.functional.pad(mask, (4, 0))
    with pytest.raises(RuntimeError, match="BlockPress: layer 0's PagedKVCache holds no slots for the 4 columns of "
                                           "padding every row of this batch starts with"):
        greedy(model, ids, PagedKVCache(block_size=4), BlockPress(KnormPress(0.5), block_size=16),
               max_new_tokens=1, attention_mask=attention_mask)


@kvpress_hooks.mark
def test_pyramidkv_on_a_padded_batch_holds_tokens_only():
    """PyramidKVPress selects as ScorerPress does with a budget per layer: the holes of the shorter row are scored
    below its tokens, and a slot held is a token (its layer-0 key that token's), at a position of that row."""
    model, _ = make_tiny_llama()
    rows, padded, mask = padded_pair(model)
    cache = PagedKVCache(block_size=4)
    greedy(model, padded, cache, PyramidKVPress(compression_ratio=0.25, window_size=8), max_new_tokens=1,
           attention_mask=mask)
    layer = cache.layers[0]
    for row, (ids, padding) in enumerate(zip(rows, (24, 0))):
        expected_keys = layer0_keys(model, ids)[0]
        for head, held in enumerate(held_positions(layer)[row]):
            assert min(held) >= padding
            torch.testing.assert_close(layer.keys[row, head, :len(held)],
                                       expected_keys[head, [p - padding for p in held]], rtol=0, atol=1e-6)


@kvpress_hooks.mark
def test_critical_adakv_marks_after_a_selection_evict_the_tokens_kvpress_masks():
    """CriticalAdaKVPress after a ScorerPress in a ComposedPress marks columns of the keys the selection kept, which
    are in score order. Its marks were evicted as token positions (other tokens: the heads held 46 and 48 tokens
    where kvpress attends 28 and 32); each head now holds what kvpress leaves unmasked, and gives its greedy tokens
    (kvpress's ComposedPress takes no AdaKVPress)."""
    model, _ = make_tiny_llama()
    ids = distinct_token_prompt(model, 90)

    def press():
        return ComposedPress([KnormPress(0.3), CriticalAdaKVPress(KnormPress(0.5))])

    dynamic, paged = DynamicCache(), PagedKVCache(block_size=4)
    expected = greedy(model, ids, dynamic, press(), max_new_tokens=2)
    batch, head, _ = model.model.layers[0].self_attn.masked_key_indices
    unmasked = [dynamic.layers[0].keys.shape[2] - int((head == h).sum()) for h in range(2)]
    assert torch.equal(greedy(model, ids, paged, press(), max_new_tokens=2), expected)
    assert [len(held) for held in held_positions(paged.layers[0])[0]] == unmasked


@kvpress_hooks.mark
def test_head_wise_marks_on_slots_of_unknown_positions_are_refused():
    """ChunkPress selects its own way: the paged layer stores its slots without their positions. AdaKVPress's marks,
    read as the positions of the tokens their columns show, then evicted nothing (60 slots held of a target of 20):
    refused, naming the press."""
    model, _ = make_tiny_llama()
    press = PrefillDecodingPress(prefilling_press=ChunkPress(KnormPress(0.5), chunk_length=16),
                                 decoding_press=DecodingPress(AdaKVPress(KnormPress()), compression_interval=2,
                                                              target_size=20, hidden_states_buffer_size=2))
    with pytest.raises(RuntimeError, match="AdaKVPress marked .* slots of layer 0 of a PagedKVCache whose token "
                                           "positions it does not know"):
        greedy(model, distinct_token_prompt(model, 120), PagedKVCache(block_size=4), press, max_new_tokens=4)


@kvpress_hooks.mark
def test_a_selection_of_its_own_over_empty_columns_is_refused_naming_them():
    """ChunkPress selects in each chunk of the view: over a padded batch's empty columns it can keep them as tokens,
    which the layer cannot tell apart. Refused at once, naming the press and the layer; a DynamicCache runs it."""
    model, _ = make_tiny_llama()
    _, padded, mask = padded_pair(model)
    with pytest.raises(RuntimeError, match="ChunkPress on layer 0 wrote .* holes, columns that hold no slot"):
        greedy(model, padded, PagedKVCache(block_size=4), ChunkPress(KnormPress(0.5), chunk_length=16),
               max_new_tokens=2, attention_mask=mask)
    greedy(model, padded, DynamicCache(), ChunkPress(KnormPress(0.5), chunk_length=16), max_new_tokens=2,
           attention_mask=mask)


@kvpress_hooks.mark
def test_head_wise_marks_on_tokens_a_crop_cut_do_not_hide_the_tokens_appended_there():
    """AdaKVPress marks prompt columns of the DynamicCache; a crop into the prompt, then a token, three times. The
    marks of the cut columns stayed on the attention module and hid the token appended at the same column next (the
    logits off by 1.35 from the paged cache's, which evicts the marks before a cut), then reached past the layer's end
    (an IndexError in kvpress's attention wrapper)."""
    model, tokenizer = make_tiny_llama()
    prompt = prompt_ids(tokenizer, 200)[:, 88:137]

    def cropped_steps(cache):
        logits = []
        with torch.no_grad(), AdaKVPress(KnormPress(compression_ratio=0.6))(model):
            model(prompt, past_key_values=cache)
            marks = model.model.layers[0].self_attn.masked_key_indices
            for token in (123, 45, 67):
                cache.crop(-2)
                logits.append(model(torch.tensor([[token]]), past_key_values=cache).logits[0, -1])
        return marks, logits

    marks, rectangular = cropped_steps(DynamicCache())
    assert bool((marks[2] >= prompt.shape[1] - 2).any()), "the case needs marks on the columns the first crop cuts"
    _, paged = cropped_steps(PagedKVCache(block_size=4))
    for got, expected in zip(rectangular, paged):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@kvpress_hooks.mark
@pytest.mark.parametrize("second", ["paged", "dynamic"])
def test_head_wise_marks_stay_with_their_cache_when_two_caches_take_turns(second):
    """kvpress's AdaKVPress leaves its marks on the attention module. Prefill a paged cache A, prefill cache B, then
    decode on A and on B: each gives the logits it gives alone. A's next pass took B's marks (left by B's prefill)
    for its own, evicted them from its slots and cleared them, so both decoded wrong (with two DynamicCaches kvpress
    itself gets only the first one wrong)."""
    model, tokenizer = make_tiny_llama()
    prompts = [prompt_ids(tokenizer, 40), prompt_ids(tokenizer, 80)[:, 40:]]
    kinds = {"paged": lambda: PagedKVCache(block_size=4), "dynamic": DynamicCache}
    press, token = AdaKVPress(KnormPress(0.5)), torch.full((1, 1), 12)

    def decoded(runs):  # [(prompt, cache)]: every prefill, then one token on each cache
        with torch.no_grad(), press(model):
            for prompt, cache in runs:
                model(prompt, past_key_values=cache)
            return [model(token, past_key_values=cache).logits[:, -1] for _, cache in runs]

    together = decoded([(prompts[0], kinds["paged"]()), (prompts[1], kinds[second]())])
    alone = [decoded([(prompts[0], kinds["paged"]())])[0], decoded([(prompts[1], kinds[second]())])[0]]
    torch.testing.assert_close(together[0], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(together[1], alone[1], rtol=0, atol=1e-5)


def test_an_edit_in_place_through_a_gathered_view_reaches_the_blocks():
    """A DynamicLayer's keys and values can be edited in place (layer.values.mul_(0)) without being assigned back. On
    a paged layer whose heads GVote left at different lengths the view is a gathered copy: the edit read back as made,
    but the next pass attended the blocks unedited. The next token's logits are the DynamicCache's after the same
    edit, and differ from those without it."""
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 40)

    def next_logits(cache, edit):
        with torch.no_grad():
            with GVotePress()(model):
                model(ids, past_key_values=cache)
            if edit:
                cache.layers[1].values.mul_(0)
            return model(torch.full((1, 1), 7), past_key_values=cache, position_ids=torch.tensor([[40]])).logits

    paged = PagedKVCache(block_size=4)
    edited = next_logits(paged, edit=True)
    assert not bool((paged.layers[1].lengths == paged.layers[1].lengths[0, 0]).all()), "heads of one length"
    torch.testing.assert_close(edited, next_logits(DynamicCache(), edit=True), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(edited, next_logits(PagedKVCache(block_size=4), edit=False), atol=1e-2)


@pytest.mark.parametrize("press", [None, "zsmerge"])
def test_a_cache_filled_under_inference_mode_goes_on_outside_it(press):
    """A prefix prefilled under torch.inference_mode() (as many servers do), then decoded under no_grad: a
    DynamicLayer's cat makes new tensors, while a paged layer writes its pools in place, which inference tensors
    refuse outside inference mode (torch's raw error, where the next token fitted in a block already held). The next
    tokens are the DynamicCache's."""
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 18)

    def decoded(cache):
        context = ZSMergePress(budget=12)(model) if press else nullcontext()
        with context:
            with torch.inference_mode():
                logits = model(ids, past_key_values=cache).logits
            tokens = []
            with torch.no_grad():
                for position in range(18, 22):
                    tokens.append(logits[:, -1:].argmax(-1))
                    logits = model(tokens[-1], past_key_values=cache, position_ids=torch.tensor([[position]])).logits
        return torch.cat(tokens, dim=-1)

    assert torch.equal(decoded(PagedKVCache(block_size=4)), decoded(DynamicCache()))


def test_flex_attention_on_a_paged_cache_is_refused_naming_it():
    """Flex attention hands the attention a BlockMask, not a mask tensor: the paged path read its padding from it and
    failed with an AttributeError naming neither the cache nor the attention. It is refused, naming both, before
    anything is appended."""
    model, tokenizer = make_tiny_llama(attn_implementation="flex_attention")
    cache = PagedKVCache()
    with torch.no_grad(), pytest.raises(ValueError, match=r"PagedKVCache: layer 0 runs its attention "
                                                          r"\(flex_attention\) with a BlockMask mask"):
        model.generate(prompt_ids(tokenizer, 20), past_key_values=cache, max_new_tokens=2, do_sample=False)


#: transformers' continuous-batching attentions (4.57: paged_attention, sdpa_paged, eager_paged; 5.x: paged|sdpa, ...),
#: whose cache is its own PagedAttentionCache (generate_batch); those over flash attention need its package to load.
CONTINUOUS_BATCHING = [name for name in ALL_ATTENTION_FUNCTIONS if "paged" in name and "flash" not in name]


@pytest.mark.parametrize("paged", [False, True], ids=["ZSMerge on a DynamicCache", "PagedKVCache"])
@pytest.mark.parametrize("implementation", CONTINUOUS_BATCHING)
def test_continuous_batching_attention_is_refused_naming_it(implementation, paged):
    """They read the cache their own way: under a press sdpa_paged ran and left the compressed cache's log-weights
    out (other tokens, silently), eager_paged on a paged cache was refused as a layer holding tokens the press did
    not compress, paged_attention stopped on "'float' object has no attribute 'update'"."""
    model, tokenizer = make_tiny_llama(attn_implementation=implementation)
    cache, press = (PagedKVCache(), nullcontext()) if paged else (DynamicCache(), ZSMergePress(budget=8)(model))
    message = rf"{'PagedKVCache' if paged else 'ZSMergePress'}: layer 0 runs transformers' continuous-batching " \
              rf"attention \('{re.escape(implementation)}'\)"
    with torch.no_grad(), press, pytest.raises(ValueError, match=message):
        model.generate(prompt_ids(tokenizer, 20), past_key_values=cache, max_new_tokens=2, do_sample=False)


def held_slots(layer):
    """Per (batch, kv head): the keys, values and log-weights of the slots attended (finite log-weight), in order."""
    keys, values = layer.keys, layer.values
    state = get_state(layer)
    log_weights = state.align(keys.shape[-2], 0) if state is not None else torch.zeros(keys.shape[:3])
    held = torch.isfinite(log_weights)
    return [(keys[b, h][held[b, h]], values[b, h][held[b, h]], log_weights[b, h][held[b, h]])
            for b in range(keys.shape[0]) for h in range(keys.shape[1])]


# Budgets the 96-token prompt reaches only after a few steps: the steps before append without merging (ZSMerge and
# WeightedKV hand back the view's own keys and values, a paged layer stores only their state).
FILLING_UP = {
    "zsmerge-filling-up": lambda d: ZSMergePress(budget=100),
    "weightedkv-filling-up": lambda d: WeightedKVPress(cache_size=100, recent=8),
    "keepkv-filling-up": lambda d: KeepKVPress(budget=100, recent=8),
}


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("name", ["zsmerge", "weightedkv", "keepkv", "kvzap", *FILLING_UP])
def test_decoding_presses_hold_the_rectangular_cache_slots(name, block_size, surrogate_dir):
    """After every decoding step of a press that compresses while decoding, each head of the paged cache holds the
    slots the rectangular cache attends (keys, values, log-weights, in order): the paged write-back of a step (a
    strided store on a regular layout, a block kept across the M + 1 -> M step, KVzap's evicted slots kept dead until
    its compaction) loses and moves nothing. (The greedy tokens' equality is
    test_generate_equals_the_rectangular_cache's.)"""
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 96)
    caches = {"rectangular": DynamicCache(), "paged": PagedKVCache(block_size=block_size)}
    tokens, widths = {}, {}
    for cache_name, cache in caches.items():
        press = {**PRESSES, **FILLING_UP}[name](surrogate_dir)
        with torch.no_grad(), press(model):
            token, steps = ids, []
            for _ in range(10):
                token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
                steps.append([held_slots(layer) for layer in cache.layers])
                widths.setdefault(cache_name, []).append([layer.get_seq_length() for layer in cache.layers])
        tokens[cache_name] = steps
    # The view is as wide as the rectangular cache (KVzap's dead slots stay until its compaction on both), so a
    # forward without cache_position places its token at the same position on both.
    assert widths["paged"] == widths["rectangular"]
    for step, (rectangular, paged) in enumerate(zip(tokens["rectangular"], tokens["paged"])):
        for layer, (expected, got) in enumerate(zip(rectangular, paged)):
            for head, (want, have) in enumerate(zip(expected, got)):
                for part, a, b in zip(("keys", "values", "log-weights"), want, have):
                    # The paged attention op and sdpa round differently: later layers' keys differ in the last bits.
                    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4,
                                               msg=lambda m: f"step {step} layer {layer} head {head} {part}: {m}")


def test_output_attentions_of_an_eager_model_on_a_paged_cache():
    """output_attentions=True on an eager model reports every step's attention probabilities: a PagedKVCache (no
    press, nothing compressed) reports those a DynamicCache reports. Under transformers 4.57, which records them by
    wrapping the attention module's forward rather than by a hook, the paged decoding steps reported none."""
    model, tokenizer = make_tiny_llama("eager")
    ids = prompt_ids(tokenizer, 24)

    def attentions(cache):
        with torch.no_grad():
            out = model.generate(ids, past_key_values=cache, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                                 return_dict_in_generate=True, output_attentions=True)
        return out.attentions

    want, got = attentions(DynamicCache()), attentions(PagedKVCache())
    assert len(got) == len(want) == 3
    for got_step, want_step in zip(got, want, strict=True):
        assert got_step is not None and len(got_step) == len(want_step) == model.config.num_hidden_layers
        for got_layer, want_layer in zip(got_step, want_step, strict=True):
            torch.testing.assert_close(got_layer, want_layer, atol=1e-5, rtol=1e-5)


def test_crop_reads_zero_as_transformers_dynamic_layer_does():
    """crop(0) means what the installed transformers' DynamicLayer makes of it: "keep none" in 4.x and 5.2, "remove
    none" from 5.17 on, where assisted generation calls crop(0) after a round that rejected no candidate; the paged
    cache emptied itself there and prompt-lookup decoding went on over nothing (other tokens than a DynamicCache's)."""
    from transformers.cache_utils import DynamicLayer

    keys = torch.randn(1, 2, 5, 8)
    dynamic = DynamicLayer()
    dynamic.update(keys, keys)
    cache = PagedKVCache()
    cache.update(keys, keys, 0)
    dynamic.crop(0)
    cache.layers[0].crop(0)
    assert cache.get_seq_length(0) == dynamic.get_seq_length()


def test_crop_of_more_than_the_layer_holds_empties_it_as_a_dynamic_layer():
    """A negative count past the layer's length left negative lengths, and the next append failed inside torch."""
    from transformers.cache_utils import DynamicLayer

    keys = torch.randn(1, 2, 5, 8)
    dynamic, cache = DynamicLayer(), PagedKVCache(block_size=4)
    dynamic.update(keys, keys)
    cache.update(keys, keys, 0)
    dynamic.crop(-100)
    cache.layers[0].crop(-100)
    assert cache.get_seq_length(0) == dynamic.get_seq_length() == 0
    assert torch.equal(cache.layers[0].lengths, torch.zeros(1, 2, dtype=cache.layers[0].lengths.dtype))
    cache.update(keys[:, :, :2], keys[:, :, :2], 0)
    assert torch.equal(cache.layers[0].keys, keys[:, :, :2])


def test_a_crop_into_the_dropped_padding_empties_the_cache_or_is_refused():
    """A prefill whose every row is left-padded drops the padding (5 columns) but counts it, as a DynamicCache holds
    it. A crop emptying the cache for the next prompt kept counting all 5: generate then took the next prompt's first
    5 tokens for cached and skipped them. A crop keeping some padding and no token (3 of 5, or -45 of 47) left a
    layer that took its next pass for a new prompt: refused."""
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 40)
    padded = torch.nn.functional.pad(ids, (5, 0), value=tokenizer.pad_token_id)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones_like(ids)], 1)
    next_prompt = prompt_ids(tokenizer, 80)[:, 50:]
    dynamic, paged = DynamicCache(), PagedKVCache(block_size=4)
    for cache in (dynamic, paged):
        greedy(model, padded, cache, attention_mask=mask, max_new_tokens=3)
    for kept in (3, -45, 5):
        with pytest.raises(ValueError, match=r"PagedKVCache.crop: keeping \d of the 5 columns of left padding"):
            paged.crop(kept)
    assert paged.get_seq_length() == dynamic.get_seq_length() > 5  # a refused crop leaves the cache as it was
    for cache in (dynamic, paged):
        cache.crop(-100)
    assert paged.get_seq_length() == dynamic.get_seq_length() == 0
    answer = greedy(model, next_prompt, paged, max_new_tokens=6)
    assert torch.equal(answer, greedy(model, next_prompt, dynamic, max_new_tokens=6))
    assert torch.equal(answer, greedy(model, next_prompt, DynamicCache(), max_new_tokens=6))


def test_a_reset_cache_drops_the_pools_of_the_press_state_it_held(surrogate_dir):
    """After reset() a new prompt without a press held KeepKV's per-slot pools (age, log-EMA, votes), growing with
    every block and counted in bytes_held(): the reused cache now holds what a new one holds."""
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 80)
    reused, fresh = PagedKVCache(block_size=4), PagedKVCache(block_size=4)
    greedy(model, ids, reused, press=PRESSES["keepkv"](surrogate_dir), max_new_tokens=2)
    reused.reset()
    greedy(model, ids, reused, max_new_tokens=2)
    greedy(model, ids, fresh, max_new_tokens=2)
    assert set(reused.layers[0].slot_blocks) == set(fresh.layers[0].slot_blocks)
    assert reused.bytes_held() == fresh.bytes_held()


def test_prompt_lookup_decoding_on_a_paged_cache_gives_the_dynamic_caches_tokens():
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 24)
    ids = torch.cat([ids, ids[:, :10]], dim=1)  # a repeat, so that prompt lookup proposes (and keeps) candidates

    def tokens(cache):
        with torch.no_grad():
            return model.generate(ids, past_key_values=cache, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                  prompt_lookup_num_tokens=3)

    torch.testing.assert_close(tokens(PagedKVCache()), tokens(DynamicCache()), rtol=0, atol=0)


@pytest.mark.parametrize("assisted", [dict(prompt_lookup_num_tokens=3), "assistant_model"])
@pytest.mark.parametrize("name", ["zsmerge", "weightedkv", "keepkv", "kvzap", "gvote"])
@pytest.mark.parametrize("make_cache", [DynamicCache, lambda: PagedKVCache(block_size=4)], ids=["dynamic", "paged"])
def test_assisted_generation_under_a_press_is_refused_naming_it(make_cache, name, assisted, surrogate_dir):
    """generate(prompt_lookup_num_tokens=3) or generate(assistant_model=...) under a press: assisted generation rolls
    rejected candidates back with crop(tokens kept), which a compressed cache, holding fewer slots than tokens, read as
    nothing to cut. The candidates merged into its slots stayed: KeepKV gave other tokens silently, the other presses
    failed later with an error about a second generate call (4.57, 5.2). From 5.17, crop(-rejected) cut the last slots,
    not the candidates merged into them: other tokens, silently, under every press. The crop is now refused."""
    model, tokenizer = make_tiny_llama()
    ids = torch.cat([prompt_ids(tokenizer, 48), prompt_ids(tokenizer, 16)], dim=1)  # a repeat: candidates proposed
    if assisted == "assistant_model":
        assisted = dict(assistant_model=make_tiny_llama(seed=1)[0])
    with torch.no_grad(), PRESSES[name](surrogate_dir)(model), pytest.raises(ValueError, match=(
            rf"{type(PRESSES[name](surrogate_dir)).__name__}: crop\(-?\d+\) asks .* Assisted generation")):
        model.generate(ids, past_key_values=make_cache(), max_new_tokens=12, do_sample=False, **assisted)


@pytest.mark.parametrize("make_cache", [DynamicCache, lambda: PagedKVCache(block_size=4)], ids=["dynamic", "paged"])
def test_assisted_generation_is_refused_where_a_head_wise_press_narrowed_no_layer(make_cache):
    """GVote at nucleus_p=0.999 evicts in some heads while each layer's longest head keeps every slot, so no layer
    holds fewer slots than tokens. Prompt lookup's first pass is the prompt and its candidates, which GVote compressed
    together (its budget from a candidate's query); the crop of the rejected candidates was accepted, and the tokens
    differed from generate without candidates under the same press, silently (a tiny Phi-3, 4.57 and 5.17)."""
    model, tokenizer = make_tiny_llama()
    ids = torch.cat([prompt_ids(tokenizer, 48), prompt_ids(tokenizer, 16)], dim=1)  # a repeat: candidates proposed
    press, cache = GVotePress(nucleus_p=0.999), make_cache()
    with pytest.raises(ValueError, match=r"GVotePress: crop\(-?\d+\) asks .* some evicted in place .* Assisted "):
        greedy(model, ids, cache, press, prompt_lookup_num_tokens=3)
    layers = range(len(cache.layers))
    assert [cache.get_seq_length(layer) for layer in layers] == [cache.get_seq_length()] * len(layers), (
        "the case needs every layer as wide as the tokens fed")
    assert press.compression_ratio > 0, "the case needs GVote to have evicted slots in place"


def steps(model, token, cache, count=5):
    """`count` greedy tokens (B, count) fed one by one from `token` (B, 1), as generate's decoding steps."""
    tokens = []
    for _ in range(count):
        token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        tokens.append(token)
    return torch.cat(tokens, dim=1)


def steps_after_prefill(model, prompt, cache, press, answered, branches):
    """The greedy steps (:func:`steps`) from each branch of a prefill of `prompt` into `cache` under `press`, one
    branch after the other, taken in the press's context or after it closed (`answered`). A branch takes the cache
    and the prefill's token and returns the (token, cache) to step from: the cache itself, a copy, its rows
    rearranged."""
    with torch.no_grad(), ExitStack() as press_context:
        if press is not None:
            press_context.enter_context(press(model))
        token = model(prompt, past_key_values=cache).logits[:, -1:].argmax(-1)
        if answered == "after it":
            press_context.close()
        return [steps(model, *branch(cache, token)) for branch in branches]


def as_it_is(cache, token):
    return token, cache


@pytest.mark.parametrize("answered", ["in the context", "after it"])
@pytest.mark.parametrize("name", kvpress_hooks.cases(["none", "zsmerge", "weightedkv", "keepkv", "kvzap", "gvote",
                                                      *HEAD_WISE_MASKING], KVPRESS_PRESSES))
@pytest.mark.parametrize("make_cache", [DynamicCache, lambda: PagedKVCache(block_size=4)], ids=["dynamic", "paged"])
@pytest.mark.parametrize("copy_of", ["deepcopy", "torch.save"])
def test_a_copy_of_a_cache_continues_as_the_original(make_cache, copy_of, name, answered, surrogate_dir):
    """copy.deepcopy of a compressed cache (to answer several questions from one prefix, as transformers' docs reuse
    a prompt cache), or torch.save and torch.load of it (a compressed context kept on disk), and the original each
    continue as a DynamicCache does without a copy, in the press's context or after it closed. A paged copy's layers
    lost the marker of "nothing written through the view" (a sentinel object, which deepcopy copied into a new one:
    an AttributeError); a DynamicCache's copied layers were never attached to the attention modules, so the attention
    ignored their state (ZSMerge and KeepKV gave other tokens after the context, and failed in it). Saving any
    compressed cache, and a PagedKVCache without a press, failed on the weak references it held (to the press, the
    attention modules). The evictions kvpress's head-wise presses mark on the attention module went to whichever paged
    layer was read first, the copy, and the original (or a loaded copy) attended the marked slots."""
    if name == "dms-kvzap" and answered == "in the context":
        pytest.skip("DMSPress(decoding=True) marks while decoding from counts it keeps itself, which two branches "
                    "stepped in one context share (a DynamicCache's branches differ too)")
    import copy
    import io

    def saved_and_loaded(cache):
        file = io.BytesIO()
        torch.save(cache, file)
        file.seek(0)
        return torch.load(file, weights_only=False)

    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 96)  # longer than SnapKV's window of 64

    def continued(cache, branches):
        return steps_after_prefill(model, ids, cache, PRESSES[name](surrogate_dir), answered, branches)

    [expected] = continued(DynamicCache(), [as_it_is])
    copied = copy.deepcopy if copy_of == "deepcopy" else saved_and_loaded
    from_copy, from_original = continued(make_cache(), [lambda cache, token: (token, copied(cache)), as_it_is])
    assert torch.equal(from_copy, expected)
    assert torch.equal(from_original, expected)


LOAD_AND_CONTINUE = """
import sys, torch
from tests.models import make_tiny_llama
folder, attn = sys.argv[1], sys.argv[2]
model, _ = make_tiny_llama(attn)
cache = torch.load(f"{folder}/cache.pt", weights_only=False)
with torch.no_grad():
    logits = model(torch.tensor([[17]]), past_key_values=cache, position_ids=torch.tensor([[60]])).logits
torch.save(logits, f"{folder}/logits.pt")
"""


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["paged", "zsmerge"])
def test_a_cache_saved_to_disk_continues_in_a_fresh_process(tmp_path, name, attn):
    """A PagedKVCache and a compressed DynamicCache (ZSMerge) saved with torch.save and continued by a process that
    imports nothing of kvpress_cpp itself (torch.load imports the cache's modules): the next token's logits are the
    saving process's. Eager attention ignored the merged slots' log-weights (logits off by 0.04), and the paged
    cache's block pools reached the model's own eager attention (a shape error)."""
    model, tokenizer = make_tiny_llama(attn)
    cache, press = (PagedKVCache(block_size=4), None) if name == "paged" else (DynamicCache(), ZSMergePress(budget=24))
    with torch.no_grad(), press(model) if press is not None else nullcontext():
        model(prompt_ids(tokenizer, 60), past_key_values=cache)
    torch.save(cache, tmp_path / "cache.pt")
    with torch.no_grad():
        expected = model(torch.tensor([[17]]), past_key_values=cache, position_ids=torch.tensor([[60]])).logits
    subprocess.run([sys.executable, "-c", LOAD_AND_CONTINUE, str(tmp_path), attn], check=True, timeout=300)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("answered", ["in the context", "after it"])
@pytest.mark.parametrize("name", ["zsmerge", "weightedkv", "keepkv", "kvzap", "gvote"])
@pytest.mark.parametrize("make_cache", [DynamicCache, lambda: PagedKVCache(block_size=4)], ids=["dynamic", "paged"])
def test_repeating_or_selecting_batch_rows_carries_the_press_state(make_cache, name, answered, surrogate_dir):
    """cache.batch_repeat_interleave(n) of a compressed DynamicCache (n samples from one compressed prompt) and
    cache.batch_select_indices (keeping some rows of a batch) rearranged the keys and values but not the press's
    per-slot state: the next attention failed on log-weights of the old batch size. A PagedKVCache refused both. Each
    row now continues as the row it came from would have, on either cache, as it does on a DynamicCache."""
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 64)
    batch = torch.cat([ids, ids.roll(3, dims=-1)])

    def continued(prompt, rearrange=as_it_is, cache_type=make_cache):
        [tokens] = steps_after_prefill(model, prompt, cache_type(), PRESSES[name](surrogate_dir), answered, [rearrange])
        return tokens

    def repeat_twice(cache, token):
        cache.batch_repeat_interleave(2)
        return token.repeat_interleave(2, dim=0), cache

    def keep_the_second(cache, token):
        cache.batch_select_indices(torch.tensor([1]))
        return token[1:], cache

    # Two different rows repeated: row r's copies are rows 2r and 2r + 1 (a batch of one would not tell the order).
    repeated, selected = continued(batch, repeat_twice), continued(batch, keep_the_second)
    for reference_cache in {make_cache, DynamicCache}:  # the same cache's run, and the rectangular cache's
        assert torch.equal(repeated, continued(batch, cache_type=reference_cache).repeat_interleave(2, dim=0))
        assert torch.equal(selected, continued(batch, cache_type=reference_cache)[1:])


@pytest.mark.parametrize("beams", [2, 3])
@pytest.mark.parametrize("name", ["none", "zsmerge", "weightedkv", "keepkv", "kvzap", "gvote"])
def test_beam_search_on_a_paged_cache_gives_the_dynamic_caches_tokens(name, beams, surrogate_dir):
    """Beam search reorders the cache's rows after every step (reorder_cache), repeating some beams and dropping
    others: on a PagedKVCache, without a press and under each of ours, it gives the DynamicCache's tokens. The paged
    cache refused it."""
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 64)

    def beam_search(cache):
        press = PRESSES[name](surrogate_dir)
        with torch.no_grad(), press(model) if press is not None else nullcontext():
            return model.generate(ids, num_beams=beams, do_sample=False, max_new_tokens=8, past_key_values=cache)

    assert torch.equal(beam_search(PagedKVCache(block_size=4)), beam_search(DynamicCache()))


# KVzap compacting its layers at every step: the rectangular cache then drops the columns only a dropped row held.
COMPACTING = {"kvzap-compacting": lambda d: KVzapThresholdPress(threshold=0.0, sliding_window=8, surrogate_dir=d,
                                                                compaction_slack=1)}


@pytest.mark.parametrize("padded", [False, True], ids=["two-prompts", "left-padded"])
@pytest.mark.parametrize("name", ["none", "zsmerge", "weightedkv", "keepkv", "kvzap", "gvote", *COMPACTING])
def test_rearranged_rows_of_a_paged_cache_hold_blocks_of_their_own(name, padded, surrogate_dir):
    """A batch of two prompts (of different lengths, left-padded: a press then compresses each row alone), its rows
    repeated, reordered with a row repeated and one dropped (beam search's reorder_cache([1, 1]), say) and selected,
    with decoding steps between that feed every row its own tokens. After each rearrangement the paged cache holds,
    row by row and head by head, the slots the DynamicCache holds, in a view as wide as that cache (generate counts
    the tokens held by it, and a row dropped may have held the longest head), no block is owned twice or lost and the
    dropped rows' blocks are free; every step's logits are the DynamicCache's. A repeated row's copies share no
    block: the merge or eviction one copy's step makes leaves the other's slots alone. On both caches the press's
    compression ratios are those of the rows the cache now holds: of their tokens seen, the share no longer held (they
    mixed the counts of the batch before and after, up to a negative ratio)."""
    if padded and name == "none":
        pytest.skip("without a press the steps after a padded prefill need the attention mask")
    model, tokenizer = make_tiny_llama()
    long = prompt_ids(tokenizer, 48)
    short = long.roll(5, dims=-1)[:, :12 if padded else 48]
    prompts = torch.cat([long, torch.nn.functional.pad(short, (long.shape[1] - short.shape[1], 0))])
    mask = torch.cat([torch.ones_like(long), torch.nn.functional.pad(torch.ones_like(short),
                                                                     (long.shape[1] - short.shape[1], 0))])
    rearrangements = [lambda cache: cache.batch_repeat_interleave(2),  # 2 -> 4 rows: 0, 0, 1, 1
                      lambda cache: cache.reorder_cache(torch.tensor([3, 1, 1, 2])),
                      lambda cache: cache.batch_select_indices(torch.tensor([2, 3])),
                      lambda cache: cache.reorder_cache(torch.tensor([1, 1]))]  # only the second prompt's rows left
    rows_kept = [[0, 0, 1, 1], [3, 1, 1, 2], [2, 3], [1, 1]]
    caches = {"dynamic": DynamicCache(), "paged": PagedKVCache(block_size=4)}
    logits, held, widths, ratios = {}, {}, {}, {}
    for cache_name, cache in caches.items():
        press = {**PRESSES, **COMPACTING}[name](surrogate_dir)
        with torch.no_grad(), press(model) if press is not None else nullcontext():
            logits[cache_name] = [model(prompts, attention_mask=mask, past_key_values=cache).logits[:, -1]]
            for step, rearrange in enumerate(rearrangements):
                rearrange(cache)
                if cache_name == "paged":
                    for layer in cache.layers:
                        check_allocator(layer)
                held.setdefault(cache_name, []).append([held_slots(layer) for layer in cache.layers])
                widths.setdefault(cache_name, []).append(cache.get_seq_length())
                ratios.setdefault(cache_name, []).append(dict(press.layer_compression_ratios) if press else {})
                rows = cache.layers[0].keys.shape[0]
                for offset in range(2):  # each row its own token
                    tokens = (torch.arange(rows) * 37 + 11 * (2 * step + offset)) % 400 + 3
                    logits[cache_name].append(model(tokens.view(-1, 1), past_key_values=cache).logits[:, -1])
                    widths[cache_name].append(cache.get_seq_length())
    assert widths["paged"] == widths["dynamic"]
    # Each row's tokens seen: its prompt's (padding aside), then one a pass; GVote counts only the prompt's, held or
    # not (it compresses no later token). The slots held are the DynamicCache's.
    prompt_tokens, passes = mask.sum(-1), 0
    for step, rows in enumerate(rows_kept):
        prompt_tokens, passes = prompt_tokens[rows], passes + (2 if step else 1)
        later = passes - 1  # the prefill's pass fed the prompt
        for layer, slots in enumerate(held["dynamic"][step]):
            held_count = sum(len(keys) for keys, _, _ in slots)
            heads = len(slots) // len(rows)
            if name == "gvote":
                held_count, seen = held_count - later * len(slots), prompt_tokens.sum()
            else:
                seen = prompt_tokens.sum() + later * len(rows)
            expected = 1 - held_count / float(heads * seen)
            for cache_name in caches:
                got = ratios[cache_name][step].get(layer)
                assert (got is None) == (name == "none")
                assert got is None or got == pytest.approx(expected, abs=1e-9), (step, layer, cache_name)
    for step, (want, got) in enumerate(zip(logits["dynamic"], logits["paged"], strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"pass {step}: {m}")
    for step, (dynamic, paged) in enumerate(zip(held["dynamic"], held["paged"], strict=True)):
        for layer, (expected, got) in enumerate(zip(dynamic, paged, strict=True)):
            for head, (want, have) in enumerate(zip(expected, got, strict=True)):
                for part, a, b in zip(("keys", "values", "log-weights"), want, have):
                    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4,
                                               msg=lambda m: f"after rearrangement {step}, layer {layer}, (row, head) "
                                                             f"{head}, {part}: {m}")


@pytest.mark.skipif(not hasattr(DynamicCache, "to_legacy_cache"), reason="this transformers has no legacy cache")
@pytest.mark.parametrize("answered", ["in the context", "after it"])
@pytest.mark.parametrize("name", ["zsmerge", "weightedkv", "keepkv", "kvzap", "gvote"])
def test_a_legacy_cache_of_a_compressed_cache_is_refused_naming_the_press(name, answered, surrogate_dir):
    """cache.to_legacy_cache() of a compressed DynamicCache, and DynamicCache.from_legacy_cache of it to continue: the
    tuple cannot hold the press's per-slot state, so the rebuilt cache attended as if nothing had been merged (after
    the context ZSMerge and KeepKV gave other tokens silently; in it, an error saying the press was not active at the
    prompt). to_legacy_cache now refuses, naming the press."""
    model, tokenizer = make_tiny_llama()
    cache, press = DynamicCache(), PRESSES[name](surrogate_dir)
    with torch.no_grad():
        with press(model):
            model(prompt_ids(tokenizer, 64), past_key_values=cache)
            if answered == "in the context":
                with pytest.raises(ValueError, match=rf"{type(press).__name__}: to_legacy_cache\(\) of a cache"):
                    cache.to_legacy_cache()
                return
        with pytest.raises(ValueError, match=rf"{type(press).__name__}: to_legacy_cache\(\) of a cache"):
            cache.to_legacy_cache()


@pytest.mark.parametrize("name", ["zsmerge", "keepkv", "gvote"])
@pytest.mark.parametrize("make_cache", [DynamicCache, PagedKVCache], ids=["dynamic", "paged"])
def test_a_dropped_compressed_cache_frees_its_layers_at_once(make_cache, name, surrogate_dir):
    """A cache a press compressed, once dropped, frees its layers (their keys and values) at once, as an uncompressed
    one does, not when Python's cycle collector next runs: an evaluation loop makes one cache per example, and on a GPU
    the dropped ones would stay beside the next. The methods our presses put on a layer or a cache (the in-place
    update, beam search's reorder, the crop and legacy-cache guards) were bound methods, each a reference cycle."""
    import gc
    import weakref

    model, tokenizer = make_tiny_llama()
    cache = make_cache()
    greedy(model, prompt_ids(tokenizer, 64), cache, PRESSES[name](surrogate_dir), max_new_tokens=4)
    layers = [weakref.ref(layer) for layer in cache.layers]
    collecting = gc.isenabled()
    gc.disable()
    try:
        del cache
        assert all(layer() is None for layer in layers)
    finally:
        if collecting:
            gc.enable()



@kvpress_hooks.mark
def test_a_paged_cache_kept_from_an_earlier_press_leaves_a_later_passs_marks_alone(surrogate_dir):
    """A paged cache GVote compressed, still held (a user keeping an earlier answer's cache), then kvpress's AdaKV on
    another paged cache of the same model: the attention looked for the layer of its keys among every layer attached
    to the module, reading each one's keys, and the held paged layer's view took the module's marks, which were the
    new pass's: a refusal naming GVote (or, for a layer without a press's state, AdaKV doing nothing)."""
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 96)
    held = PagedKVCache(block_size=4)
    greedy(model, ids, held, PRESSES["gvote"](surrogate_dir))
    # AdaKV on a rectangular cache leaves its marks on the modules (kvpress's wrapper hides them at every pass)
    expected = greedy(model, ids, DynamicCache(), PRESSES["adakv-snapkv"](surrogate_dir))
    got = greedy(model, ids, PagedKVCache(block_size=4), PRESSES["adakv-snapkv"](surrogate_dir))
    assert torch.equal(got, expected)
    assert held.get_seq_length() > 0


@pytest.mark.parametrize("cut", [
    lambda cache: cache.crop(2.5),
    lambda cache: cache.reorder_cache(torch.tensor([1.0, 0.0])),
    lambda cache: cache.reorder_cache(torch.tensor([True, False])),
], ids=["crop of a float", "beam index of floats", "beam index of bools"])
def test_a_cut_or_reorder_of_non_integer_indices_is_refused_as_a_dynamic_cache_refuses_it(cut):
    """crop(2.5) kept 2 slots and reorder_cache(tensor([1., 0.])) was cast to rows [1, 0], where a DynamicCache raises:
    a caller's bug passed as a cache change. Refused, naming the cache, with the layer as it was."""
    keys = torch.randn(2, 2, 5, 8)
    dynamic, cache = DynamicCache(), PagedKVCache(block_size=4)
    dynamic.update(keys, -keys, 0)
    cache.update(keys, -keys, 0)
    with pytest.raises((TypeError, RuntimeError, IndexError, ValueError)):  # (5.24 on: "a positive crop")
        cut(dynamic)
    with pytest.raises(TypeError, match=r"PagedKVCache"):
        cut(cache)
    assert torch.equal(cache.layers[0].keys, keys) and torch.equal(cache.layers[0].values, -keys)


def _next_turn_padded_inside(first_turn: torch.Tensor, row_0: torch.Tensor, row_1: torch.Tensor):
    """The input ids and mask of a batch's next turn whose row 1 is shorter: padded inside the sequence, where the
    cached tokens end (a batched chat's second generate)."""
    padding = row_0.shape[-1] - row_1.shape[-1]
    new = torch.cat([row_0, torch.cat([torch.zeros(1, padding, dtype=torch.long), row_1], 1)])
    mask = torch.ones(2, first_turn.shape[1] + new.shape[1], dtype=torch.long)
    mask[1, first_turn.shape[1]:first_turn.shape[1] + padding] = 0
    return torch.cat([first_turn, new], 1), mask


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("prompt_padding", [0, 3])
def test_a_next_turn_padded_inside_the_sequence_is_generated_as_on_a_dynamic_cache(attn_implementation,
                                                                                   prompt_padding):
    """A later pass's padding (a batch's next turn whose rows differ in length) was attended on a PagedKVCache, which
    reads padding at prefill only: row 1's tokens differed from the DynamicCache's, silently. The paged layer now gives
    the padding its mask hides the log-weight -inf, for that pass and every later one. With left padding on every
    row of the prompt (which the prefill drops) the layer built transformers' mask that many columns short, and read
    the next turn's padding off the wrong columns: it attended it again (scores 0.32 from the DynamicCache's)."""
    model, _ = make_tiny_llama()
    model.set_attn_implementation(attn_implementation)
    patch_eager_attention(model)
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    ids[:, :prompt_padding] = 0
    prompt_mask = (torch.arange(40) >= prompt_padding).long().expand(2, 40)
    turns = torch.randint(3, 256, (2, 8), generator=torch.Generator().manual_seed(1))

    def two_turns(cache):
        with torch.no_grad():
            first = model.generate(ids, attention_mask=prompt_mask, past_key_values=cache, max_new_tokens=4,
                                   do_sample=False, suppress_tokens=[0])
            second, mask = _next_turn_padded_inside(first, turns[:1], turns[1:, 3:])
            mask[:, :prompt_padding] = 0
            out = model.generate(second, attention_mask=mask, past_key_values=cache, max_new_tokens=8,
                                 do_sample=False, suppress_tokens=[0], output_scores=True, return_dict_in_generate=True)
        return out.sequences[:, second.shape[1]:], torch.stack(out.scores)

    expected_tokens, expected_scores = two_turns(DynamicCache())
    tokens, scores = two_turns(PagedKVCache(block_size=4))
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(scores, expected_scores, rtol=1e-4, atol=1e-4)
