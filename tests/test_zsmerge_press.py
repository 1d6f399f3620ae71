"""ZSMergePress end to end: the paper's invariants during long generations, its degenerate cases, and the demo
question on SmolLM2."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import DynamicCache

from kvpress_cpp.cache import get_state
from kvpress_cpp.paged_cache import PagedKVCache
from kvpress_cpp.presses.streaming import CHUNKED_PREFILL_IGNORES_PADDING, CHUNKED_PREFILL_REPEATS_LAST_POSITIONS
from kvpress_cpp.presses.weightedkv import WeightedKVPress
from kvpress_cpp.presses.zsmerge import ZSMergePress
from tests.generation import (TINY_MODELS, answers_hidden_fact, feed_in_passes, greedy, needs_chunked_prefill,
                              prompt_ids)
from tests.models import make_tiny_llama


@dataclass
class CheckedZSMergePress(ZSMergePress):
    """Asserts after every decoding step what the paper guarantees for every (batch, kv head)."""

    steps_checked: int = 0

    def compress_decoding(self, module, hidden_states, keys, values, attentions, state, kwargs):
        keys, values, state = super().compress_decoding(module, hidden_states, keys, values, attentions, state,
                                                        kwargs)
        budget = sum(state.counters[name] for name in ("recent", "context", "residual"))
        assert keys.shape[-2] <= budget, f"{keys.shape[-2]} slots held for a budget of {budget}"
        counts = state.per_slot.get("counts")
        represented = counts.sum(-1) if counts is not None else torch.full(keys.shape[:2], keys.shape[-2])
        assert torch.all(represented == state.counters["tokens_seen"]), "Σ w differs from the tokens seen"
        self.steps_checked += 1
        return keys, values, state


@pytest.mark.parametrize("make_model,attn_implementation", TINY_MODELS[:2])
@pytest.mark.parametrize("prefill_merge,eviction_order", [("contiguous", "authors"), ("similarity", "authors"),
                                                           ("contiguous", "paper")])
def test_budget_and_merge_count_invariants_over_long_generation(make_model, attn_implementation, prefill_merge,
                                                                eviction_order):
    model, tokenizer = make_model(attn_implementation=attn_implementation)
    press = CheckedZSMergePress(budget=32, residual_slots=2, prefill_merge=prefill_merge, eviction_order=eviction_order)
    tokens, cache = greedy(model, prompt_ids(tokenizer, 96, batch=2), press=press, max_new_tokens=320)
    assert tokens.shape == (2, 320)
    assert press.steps_checked == 319 * model.config.num_hidden_layers
    for layer in cache.layers:
        assert layer.keys.shape[-2] == 32
        assert bool((get_state(layer).per_slot["counts"][..., :2] > 1).all()), "the residual slots never merged"


def test_streaming_prefill_is_refused_where_transformers_repeats_positions():
    """CHUNKED_PREFILL_REPEATS_LAST_POSITIONS says what the installed transformers does: its chunked prefill, without a
    press, gives other logits than one forward of the whole prompt exactly where it is set; there the streaming
    prefill is refused with the version named."""
    model, tokenizer = make_tiny_llama()
    input_ids = prompt_ids(tokenizer, 48)
    logits = [model.generate(input_ids, prefill_chunk_size=chunk, max_new_tokens=1, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, past_key_values=DynamicCache()).logits[0]
              for chunk in (None, 8)]
    assert (not torch.allclose(logits[0], logits[1], atol=1e-4)) == CHUNKED_PREFILL_REPEATS_LAST_POSITIONS
    if CHUNKED_PREFILL_REPEATS_LAST_POSITIONS:
        with pytest.raises(ValueError, match=r"ZSMergePress: prefill_chunk_size .* transformers 5\.2"):
            greedy(model, input_ids, press=ZSMergePress(budget=24, prefill_chunk_size=8), max_new_tokens=1)


@needs_chunked_prefill
def test_streaming_prefill_of_a_left_padded_batch():
    """CHUNKED_PREFILL_IGNORES_PADDING says what the installed transformers does: without a press, its chunked
    prefill changes a left-padded row's tokens exactly where it is set. There a streamed prefill of a padded batch is
    refused, with the version named; elsewhere each row equals its run alone, and a first chunk (the press's
    prefill) holding only padding for a row is refused, naming the row."""
    model, tokenizer = make_tiny_llama()
    rows = [prompt_ids(tokenizer, 40), prompt_ids(tokenizer, 52)[:, 40:]]  # 40 tokens, 12 others
    input_ids = torch.cat([rows[0], torch.nn.functional.pad(rows[1], (28, 0), value=tokenizer.pad_token_id)])
    attention_mask = (torch.arange(40) >= torch.tensor([[0], [28]])).long()
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    plain, chunked = (greedy(model, press=None, max_new_tokens=4, prefill_chunk_size=chunk, **batch)[0]
                      for chunk in (None, 30))
    assert (not torch.equal(plain[1], chunked[1])) == CHUNKED_PREFILL_IGNORES_PADDING
    if CHUNKED_PREFILL_IGNORES_PADDING:
        with pytest.raises(ValueError, match=r"ZSMergePress: prefill_chunk_size .* transformers 4\..*batch rows \[1\] "
                                             r"are padded"):
            greedy(model, press=ZSMergePress(budget=16, prefill_chunk_size=30), max_new_tokens=4, **batch)
        return
    with pytest.warns(UserWarning, match=r"ZSMergePress: batch rows \[1\] are left-padded by \[28\] of the first "
                                         r"chunk's 30 columns"):
        tokens, _ = greedy(model, press=ZSMergePress(budget=16, prefill_chunk_size=30), max_new_tokens=4, **batch)
    for row, alone in enumerate(rows):
        assert torch.equal(tokens[row], greedy(model, alone, ZSMergePress(budget=16, prefill_chunk_size=30),
                                               max_new_tokens=4)[0][0])
    with pytest.raises(ValueError, match=r"ZSMergePress: the first chunk of prefill_chunk_size=8 tokens, .* holds only "
                                         r"padding for batch rows \[1\]"):
        greedy(model, press=ZSMergePress(budget=16, prefill_chunk_size=8), max_new_tokens=4, **batch)


@needs_chunked_prefill
@pytest.mark.skipif(CHUNKED_PREFILL_IGNORES_PADDING, reason="this transformers refuses a padded batch's stream")
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("name", ["zsmerge", "weightedkv"])
def test_a_streamed_padded_row_is_its_run_alone_in_the_batch_chunks(name, paged):
    """A batch whose every row is left-padded (3 columns shared, as pad_to_multiple_of leaves them), streamed in
    chunks of 12: generate cuts every row at the same columns, so a row padded by p streams as the row alone fed in
    passes of 12 - p, 12, 12, ... tokens (the paper's stream, chunked from another first token), and its greedy tokens
    are those of that run by hand, on either cache (a paged one drops the shared padding). The padding shared by
    every row made the count of positions the cache stands for (columns) exceed the rows' positions, and the second
    chunk was refused as tokens fed again."""

    def make_press():
        return (ZSMergePress(budget=12, prefill_chunk_size=12) if name == "zsmerge"
                else WeightedKVPress(cache_size=12, prefill_chunk_size=12))

    model, tokenizer = make_tiny_llama()
    text = prompt_ids(tokenizer, 30)
    rows, width = [text, text[:, 6:]], 33
    batch = {"input_ids": torch.cat([torch.nn.functional.pad(row, (width - row.shape[1], 0),
                                                             value=tokenizer.pad_token_id) for row in rows]),
             "attention_mask": torch.cat([torch.arange(width).ge(width - row.shape[1]).long().view(1, -1)
                                          for row in rows])}
    with pytest.warns(UserWarning, match=r"batch rows \[0, 1\] are left-padded by \[3, 9\]"):
        tokens, _ = greedy(model, press=make_press(), max_new_tokens=4,
                           cache=PagedKVCache(block_size=4) if paged else None, **batch)
    for row, ids in enumerate(rows):
        padding, length = width - ids.shape[1], ids.shape[1]
        sizes = [12 - padding] + [min(12, length - start) for start in range(12 - padding, length, 12)]
        cache, alone, start = DynamicCache(), [], 0
        with torch.no_grad(), make_press()(model):
            for size in sizes + [1] * 3:  # the prompt in the batch's chunks, then the first 3 tokens generated
                if start >= length:
                    ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=-1)
                    alone.append(int(ids[0, -1]))
                logits = model(ids[:, start:start + size], past_key_values=cache,
                               position_ids=torch.arange(start, start + size).view(1, -1),
                               cache_position=torch.arange(start, start + size)).logits
                start += size
        alone.append(int(logits[0, -1].argmax()))
        assert tokens[row].tolist() == alone, (row, sizes)


@needs_chunked_prefill
@pytest.mark.parametrize("eviction_order", ["authors", "paper"])
def test_streaming_prefill_keeps_the_invariants_while_the_prompt_streams_in(eviction_order):
    """prefill_chunk_size: generate feeds the prompt in chunks of ≤ 8 (the first one is the prefill; transformers 4
    keeps the last prompt token for the first decoding pass, transformers 5 does not), then 3 generated tokens; the
    press compresses every pass after the first, the budget and Σ w = tokens seen hold after each, and generate's
    configuration is restored afterwards."""
    model, tokenizer = make_tiny_llama()
    press = CheckedZSMergePress(budget=24, residual_slots=2, eviction_order=eviction_order, prefill_chunk_size=8)
    passes = []  # the tokens of each forward
    hook = model.model.register_forward_pre_hook(lambda _, args, kwargs: passes.append(kwargs["input_ids"].shape[1]),
                                                 with_kwargs=True)
    try:
        _, cache = greedy(model, prompt_ids(tokenizer, 96), press=press, max_new_tokens=4)
    finally:
        hook.remove()
    assert sum(passes) == 96 + 3 and max(passes) <= 8 and passes[-3:] == [1, 1, 1], passes
    assert press.steps_checked == (len(passes) - 1) * model.config.num_hidden_layers
    assert model.generation_config.prefill_chunk_size is None
    assert all(layer.keys.shape[-2] == 24 for layer in cache.layers)


@pytest.mark.parametrize("eviction_order", ["authors", "paper"])
def test_passes_of_several_tokens_keep_the_recent_window_unmerged(eviction_order):
    """The recent window holds the last Bp tokens as they are (Algorithm 1: a token is merged only once it leaves the
    window), also after a pass of several tokens (kvpress's question pass, a streamed prefill's chunks). Layer 0's
    keys depend on the tokens and positions alone, so the window's keys must be the uncompressed run's, for the
    last Bp tokens, in every head; a ring that advanced one slot per pass lost recent tokens and kept stale ones."""
    model, tokenizer = make_tiny_llama()
    ids, sizes = prompt_ids(tokenizer, 60), [40, 8, 1, 8, 1, 1, 1]
    press = ZSMergePress(budget=24, residual_slots=2, eviction_order=eviction_order)
    recent = press.split(40)[0]
    held = feed_in_passes(model, ids, sizes, press).layers[0].keys[0]  # (H, 24, d)
    full = feed_in_passes(model, ids, sizes).layers[0].keys[0]  # (H, 60, d)
    for head in range(held.shape[0]):
        distance = torch.cdist(full[head, -recent:], held[head], compute_mode="donot_use_mm_for_euclid_dist")
        assert bool((distance.min(-1).values <= 1e-6).all()), f"head {head}: the recent tokens held {distance.min(-1)}"


def test_merge_count_bias_is_alpha_log_w():
    model, tokenizer = make_tiny_llama()
    _, cache = greedy(model, prompt_ids(tokenizer, 96), press=ZSMergePress(budget=24, alpha=0.6), max_new_tokens=8)
    for layer in cache.layers:
        state = get_state(layer)
        torch.testing.assert_close(state.log_weights, 0.6 * state.per_slot["counts"].log())


def test_alpha_zero_is_pure_eviction_attention():
    """α = 0 (paper §3.5): no compensation, every kept slot is attended as a single token."""
    model, tokenizer = make_tiny_llama()
    _, cache = greedy(model, prompt_ids(tokenizer, 96), press=ZSMergePress(budget=24, alpha=0.0), max_new_tokens=8)
    for layer in cache.layers:
        state = get_state(layer)
        assert bool((state.per_slot["counts"] > 1).any()) and bool((state.log_weights == 0).all())


@pytest.mark.parametrize("make_model,attn_implementation", TINY_MODELS)
def test_budget_above_sequence_changes_nothing(make_model, attn_implementation):
    model, tokenizer = make_model(attn_implementation=attn_implementation)
    input_ids = prompt_ids(tokenizer, 40, batch=2)
    expected, _ = greedy(model, input_ids, max_new_tokens=24)
    got, cache = greedy(model, input_ids, press=ZSMergePress(budget=1000), max_new_tokens=24)
    assert cache.layers[0].keys.shape[-2] == 40 + 23
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kwargs,message", [
    ({"budget": 0}, "budget must be a token count"), ({"budget": 1.5}, "budget must be a token count"),
    ({"decay": 1.2}, r"decay \(λ\) must be a number in \(0, 1\], got 1.2"),
    ({"decay": 0.0}, r"decay \(λ\) must be a number in \(0, 1\]"), ({"alpha": -0.1}, r"alpha must be a number in \[0, 1\]"),
    ({"prefill_merge": "mean"}, "prefill_merge must be"), ({"residual_slots": -1}, "residual_slots must be"),
    ({"eviction_order": "code"}, "eviction_order must be .authors. or .paper."),
    ({"budget": 0.5, "prefill_chunk_size": 8}, "prefill_chunk_size needs a budget in tokens"),
])
def test_bad_hyperparameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZSMergePress(**kwargs)


@pytest.mark.default_model_answers
def test_smollm2_answers_the_demo_question_with_a_generous_budget(default_model):
    """At 75% of the prompt. (At 50% one digit of the needle is lost: SmolLM2 answers 7291.)"""
    model, tokenizer = default_model
    found, answer = answers_hidden_fact(model, tokenizer, ZSMergePress(budget=0.75))
    assert found, answer
