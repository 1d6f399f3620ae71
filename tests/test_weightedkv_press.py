"""WeightedKVPress end to end: the cache bound during long generations, the budget above the sequence, and the
demo question on SmolLM2."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from transformers import DynamicCache

from kvpress_cpp.cache import get_state
from kvpress_cpp.presses.weightedkv import WeightedKVPress
from tests.generation import (TINY_MODELS, answers_hidden_fact, feed_in_passes, greedy, needs_chunked_prefill,
                              prompt_ids)
from tests.models import make_tiny_llama


@dataclass
class CheckedWeightedKVPress(WeightedKVPress):
    steps_checked: int = 0

    def compress_decoding(self, module, hidden_states, keys, values, attentions, state, kwargs):
        keys, values, state = super().compress_decoding(module, hidden_states, keys, values, attentions, state,
                                                        kwargs)
        assert keys.shape[-2] <= state.counters["size"]
        assert state.per_slot["sums"].shape[-1] == state.per_slot["counts"].shape[-1] == keys.shape[-2]
        self.steps_checked += 1
        return keys, values, state


@pytest.mark.parametrize("make_model,attn_implementation", TINY_MODELS[:2])
@pytest.mark.parametrize("evict_only", [False, True])
def test_cache_bounded_over_long_generation(make_model, attn_implementation, evict_only):
    model, tokenizer = make_model(attn_implementation=attn_implementation)
    press = CheckedWeightedKVPress(cache_size=32, evict_only=evict_only)
    tokens, cache = greedy(model, prompt_ids(tokenizer, 96, batch=2), press=press, max_new_tokens=320)
    assert tokens.shape == (2, 320) and press.steps_checked == 319 * model.config.num_hidden_layers
    assert all(layer.keys.shape[-2] == 32 for layer in cache.layers)
    assert all(bool((get_state(layer).log_weights == 0).all()) for layer in cache.layers), "WeightedKV has no bias"


def test_merging_and_evict_only_differ_only_in_values():
    """After the prompt's reduction (one generated token: no decoding step yet) both variants evicted the same
    keys, chosen from the same attention; evict-only kept each key's own value, as the full cache holds it, and only
    the merge changed the kept values."""
    model, tokenizer = make_tiny_llama()
    input_ids = prompt_ids(tokenizer, 96)
    _, full = greedy(model, input_ids, max_new_tokens=1)
    _, merged = greedy(model, input_ids, press=WeightedKVPress(cache_size=24), max_new_tokens=1)
    _, evicted = greedy(model, input_ids, press=WeightedKVPress(cache_size=24, evict_only=True), max_new_tokens=1)
    assert torch.equal(merged.layers[0].keys, evicted.layers[0].keys), "the same keys must be evicted"
    for b, h in itertools.product(range(full.layers[0].keys.shape[0]), range(full.layers[0].keys.shape[1])):
        kept_keys, all_keys = evicted.layers[0].keys[b, h], full.layers[0].keys[b, h]
        slots = (kept_keys[:, None] == all_keys[None]).all(-1).int().argmax(-1)  # each kept key's token
        assert torch.equal(all_keys[slots], kept_keys)
        assert torch.equal(evicted.layers[0].values[b, h], full.layers[0].values[b, h, slots]), (b, h)
    assert not torch.equal(merged.layers[0].values, evicted.layers[0].values), "values were not merged"


@pytest.mark.parametrize("make_model,attn_implementation", TINY_MODELS)
def test_cache_size_above_sequence_changes_nothing(make_model, attn_implementation):
    model, tokenizer = make_model(attn_implementation=attn_implementation)
    input_ids = prompt_ids(tokenizer, 40, batch=2)
    expected, _ = greedy(model, input_ids, max_new_tokens=24)
    got, _ = greedy(model, input_ids, press=WeightedKVPress(cache_size=1000), max_new_tokens=24)
    assert torch.equal(got, expected)


@needs_chunked_prefill
def test_streaming_prefill_of_one_token_is_the_token_by_token_stream():
    """prefill_chunk_size=1 streams the prompt through generate one token per forward (the paper's setting), compressing
    at every token: the cache equals feeding the prompt by hand one token per forward under the press, and
    generate's configuration is restored afterwards."""
    model, tokenizer = make_tiny_llama()
    input_ids = prompt_ids(tokenizer, 64)
    _, streamed = greedy(model, input_ids, press=WeightedKVPress(cache_size=24, prefill_chunk_size=1), max_new_tokens=1)
    assert model.generation_config.prefill_chunk_size is None
    by_hand = DynamicCache()
    with torch.no_grad(), WeightedKVPress(cache_size=24)(model):
        for position in range(64):
            model(input_ids[:, position:position + 1], past_key_values=by_hand,
                  position_ids=torch.tensor([[position]]), cache_position=torch.tensor([position]))
    for layer, expected in zip(streamed.layers, by_hand.layers):
        torch.testing.assert_close(layer.keys, expected.keys)
        torch.testing.assert_close(layer.values, expected.values)
        torch.testing.assert_close(get_state(layer).per_slot["sums"], get_state(expected).per_slot["sums"])


def test_counts_are_the_queries_each_slot_has_seen_after_passes_of_several_tokens():
    """n_j, the count that turns the attention sum into Algorithm 1's average ā_j = a_j / n_j, is the number of
    queries that attended slot j: the tokens seen since token j, itself included. A pass of q tokens (kvpress's
    question pass, a streamed prefill's chunk) adds q; counting 1 per pass skewed every average after one. WeightedKV
    never changes a key, so layer 0's slots are found among the uncompressed run's keys, which gives their tokens."""
    model, tokenizer = make_tiny_llama()
    ids, sizes = prompt_ids(tokenizer, 60), [40, 8, 1, 8, 1, 1, 1]
    layer = feed_in_passes(model, ids, sizes, WeightedKVPress(cache_size=24)).layers[0]
    full = feed_in_passes(model, ids, sizes).layers[0].keys[0]  # (H, 60, d)
    counts = get_state(layer).per_slot["counts"][0]  # (H, 24)
    for head in range(counts.shape[0]):
        distance = torch.cdist(layer.keys[0, head], full[head], compute_mode="donot_use_mm_for_euclid_dist")
        assert bool((distance.min(-1).values <= 1e-6).all()), f"head {head}: a slot is no token's key"
        token = distance.argmin(-1)
        assert torch.equal(counts[head], (60 - token).to(counts.dtype)), f"head {head}, tokens {token.tolist()}"


@pytest.mark.parametrize("kwargs,message", [
    ({"cache_size": 0}, "cache_size must be a token count"), ({"cache_size": 2.0}, "cache_size must be"),
    ({"sinks": -1}, "sinks must be"), ({"recent": 0}, "recent must be"),
    ({"prefill_chunk_size": 0}, "prefill_chunk_size must be None or an int"),
    ({"cache_size": 0.5, "prefill_chunk_size": 8}, "prefill_chunk_size needs a budget in tokens"),
])
def test_bad_hyperparameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WeightedKVPress(**kwargs)


def test_too_small_a_fraction_of_a_short_prompt_is_refused_clearly():
    """(A count is refused where it is given: test_misplaced_presses.)"""
    model, tokenizer = make_tiny_llama()
    with pytest.raises(ValueError, match=r"WeightedKVPress: a cache of 4 slots has no middle region .*; raise "
                                         r"cache_size or give it in tokens \(0.1 of this 40-token prompt is 4 slots"):
        greedy(model, prompt_ids(tokenizer, 40), press=WeightedKVPress(cache_size=0.1, recent=4), max_new_tokens=2)


@pytest.mark.default_model_answers
def test_smollm2_answers_the_demo_question_with_a_generous_budget(default_model):
    """At 90% of the prompt. (At 60-75% the needle's digits have the lowest average attention of the prompt's own
    queries and are evicted: SmolLM2 then answers a wrong number, with and without the value merge.)"""
    model, tokenizer = default_model
    found, answer = answers_hidden_fact(model, tokenizer, WeightedKVPress(cache_size=0.9))
    assert found, answer
