"""kvpress's press contract, for every press we ship, in the flows where kvpress's own tests return early for presses
that are not a ScorerPress: ComposedPress (alone, before and after a kvpress press, with another of ours),
PrefillDecodingPress (ours as prefilling press, as decoding press, with kvpress's DecodingPress), the wrappers of
ScorerPresses (DecodingPress, AdaKV, Chunk, DMS, ...), one press reused across sequences, kvpress's pipeline with
several questions; ``compression_ratio``, ``reset()``, ``post_init_from_model``; and left-
padded batches, each row equal to its run alone. A press either acts where it is placed or raises naming itself."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from kvpress import (AdaKVPress, BlockPress, ChunkKVPress, ChunkPress, ComposedPress, CriticalAdaKVPress,
                     CriticalKVPress, DecodingPress, ExpectedAttentionPress,
                     DMSPress, KeyRerotationPress, KnormPress, PerLayerCompressionPress, PrefillDecodingPress,
                     ScorerPress, SnapKVPress, ThinKPress)
from transformers import DynamicCache, pipeline

from kvpress_cpp.cache import get_state
from kvpress_cpp.kvpress_adapters import kvpress_transformers_mismatch
from kvpress_cpp.paged_cache import PagedKVCache
from kvpress_cpp.presses import (GVotePress, KeepKVPress, KVzapPress, KVzapThresholdPress, WeightedKVPress,
                                 ZSMergePress)
from tests import kvpress_hooks
from tests.generation import greedy, prompt_ids
from tests.models import make_tiny_gemma3_sliding_and_full_twin, make_tiny_llama, make_tiny_qwen3
from tests.test_kvzap_press import write_surrogate

BUDGET = 16
PRESSES = {
    "ZSMergePress": lambda surrogate: ZSMergePress(budget=BUDGET),
    "WeightedKVPress": lambda surrogate: WeightedKVPress(cache_size=BUDGET),
    "KeepKVPress": lambda surrogate: KeepKVPress(budget=BUDGET, recent=4),
    "GVotePress": lambda surrogate: GVotePress(nucleus_p=0.9),
    "KVzapThresholdPress": lambda surrogate: KVzapThresholdPress(threshold=0.0, sliding_window=8,
                                                                  surrogate_dir=surrogate),
}
DECODING_PRESSES = {"ZSMergePress", "WeightedKVPress", "KeepKVPress", "KVzapThresholdPress"}
NAMES = list(PRESSES)
CONTEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune " * 3


@pytest.fixture(scope="module")
def llama():
    return make_tiny_llama()


@pytest.fixture(scope="module")
def surrogate(llama, tmp_path_factory):
    """A random KVzap MLP surrogate for the tiny models, on disk."""
    return write_surrogate(tmp_path_factory.mktemp("surrogate") / "mlp", llama[0], "mlp", scale=4.0)


@pytest.fixture(scope="module")
def make_press(surrogate):
    return lambda name: PRESSES[name](surrogate)


def held_slots(cache) -> list[int]:
    """Per layer, the slots a row attends to (finite log-weights), summed over batch and kv heads."""
    return [int(torch.isfinite(get_state(layer).log_weights).sum()) for layer in cache.layers]


def run_alone(llama, make_press, name, ids, max_new_tokens=8):
    return greedy(llama[0], ids, press=make_press(name), max_new_tokens=max_new_tokens)


# --- compression_ratio, reset, post_init_from_model ------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_compression_ratio_is_the_fraction_of_the_prompt_removed(llama, make_press, name):
    model, tokenizer = llama
    prompt = 64
    press = make_press(name)
    _, cache = greedy(model, prompt_ids(tokenizer, prompt), press=press, max_new_tokens=1)
    heads = model.config.num_key_value_heads
    if name in ("GVotePress", "KVzapThresholdPress"):  # they choose: the prompt's slots held after the prefill
        expected = [1 - held / (heads * prompt) for held in held_slots(cache)]
    else:  # a budget of 16 slots per kv head
        expected = [1 - BUDGET / prompt] * len(cache.layers)
    assert press.compression_ratio == pytest.approx(sum(expected) / len(expected))
    assert 0 < press.compression_ratio < 1
    press.reset()  # kvpress's PrefillDecodingPress resets its decoding press after each use: the ratio stays readable
    assert press.compression_ratio == pytest.approx(sum(expected) / len(expected))


@pytest.mark.parametrize("name", ["ZSMergePress", "WeightedKVPress", "KeepKVPress"])
def test_compression_ratio_while_decoding_counts_every_row(llama, make_press, name):
    """A press that compresses while decoding holds its budget of 16 slots per kv head over the prompt's 40 tokens and
    the 9 generated tokens fed back: 1 - 16/49 removed, in a batch of two as alone (each row sees 49 tokens)."""
    model, tokenizer = llama
    for batch in (1, 2):
        press = make_press(name)
        greedy(model, prompt_ids(tokenizer, 40, batch=batch), press=press, max_new_tokens=10)
        assert press.compression_ratio == pytest.approx(1 - BUDGET / 49), f"batch {batch}"


@pytest.mark.parametrize("name", ["ZSMergePress", "WeightedKVPress", "KeepKVPress"])
def test_compression_ratio_of_a_budget_press_is_settable_as_in_kvpress(make_press, name):
    press = make_press(name)
    press.compression_ratio = 0.75  # what kvpress's evaluate.py and its wrappers do
    assert press.compression_ratio == 0.75
    assert getattr(press, press.budget_field) == 0.25
    for refused in (1.0, "0.5"):  # a string failed in a comparison, naming no press
        with pytest.raises(ValueError, match=rf"{name}: compression_ratio must be a number in \[0, 1\), got {refused!r}"):
            press.compression_ratio = refused
    # Inside [0, 1), but 1 - ratio rounds to a budget of 0 slots: refused naming the ratio, and the budget unchanged.
    with pytest.raises(ValueError, match=rf"{name}: compression_ratio 0.9999999999 leaves a budget of 0.0"):
        press.compression_ratio = 0.9999999999
    assert getattr(press, press.budget_field) == 0.25


@pytest.mark.parametrize("name", ["ZSMergePress", "WeightedKVPress", "KeepKVPress"])
def test_a_compression_ratio_of_zero_keeps_the_whole_context(llama, make_press, name):
    """kvpress's uncompressed baseline, compression_ratio = 0, is the budget 1.0 (a fraction in (0, 1]): accepted,
    and the press keeps every prompt token as it is (the cache equals the run without a press)."""
    model, tokenizer = llama
    press = make_press(name)
    press.compression_ratio = 0.0
    assert getattr(press, press.budget_field) == 1.0 and press.compression_ratio == 0.0
    ids = prompt_ids(tokenizer, 40)
    _, cache = greedy(model, ids, press=press, max_new_tokens=1)
    _, full = greedy(model, ids, max_new_tokens=1)
    for layer, uncompressed in zip(cache.layers, full.layers, strict=True):
        torch.testing.assert_close(layer.keys, uncompressed.keys)
        torch.testing.assert_close(layer.values, uncompressed.values)


@pytest.mark.parametrize("name", ["ZSMergePress", "WeightedKVPress", "KeepKVPress"])
def test_compression_ratio_of_a_padded_batch_leaves_the_padding_out(llama, make_press, name):
    """Rows of 40 and 34 tokens, left-padded: padding is not counted as seen, so a budget of 16 slots per kv head
    and row removes 1 - 2·16 / (40 + 34) of the prompt (not of the 2·40 columns)."""
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 40, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    ids[1, :6] = tokenizer.pad_token_id
    press = make_press(name)
    greedy(model, ids, press=press, max_new_tokens=1, attention_mask=mask)
    assert press.compression_ratio == pytest.approx(1 - 2 * BUDGET / (40 + 34))


@pytest.mark.parametrize("name", ["GVotePress", "KVzapThresholdPress"])
def test_compression_ratio_of_a_threshold_press_is_read_only(make_press, name):
    with pytest.raises(AttributeError, match=f"cannot be set for {name}"):
        make_press(name).compression_ratio = 0.5


def test_keepkv_passes_post_init_from_model_to_its_scorer(llama, surrogate):
    class LoadedScorer(ScorerPress):
        """A scorer that, like QFilterPress or KVzap's, only works once post_init_from_model has loaded it."""

        def post_init_from_model(self, model):
            self.loaded_for = model

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            return keys.norm(dim=-1) if getattr(self, "loaded_for", None) is not None else None

    model, tokenizer = llama
    scorer = LoadedScorer()
    _, cache = greedy(model, prompt_ids(tokenizer, 48), press=KeepKVPress(budget=BUDGET, recent=4, scorer=scorer),
                      max_new_tokens=2)
    assert scorer.loaded_for is model
    assert all(layer.keys.shape[-2] <= BUDGET for layer in cache.layers)
    # KVzap's scorer loads its surrogate in post_init_from_model ("no surrogate loaded" otherwise).
    press = KeepKVPress(budget=BUDGET, recent=4, scorer=KVzapPress(model_type="mlp", surrogate_dir=surrogate))
    _, cache = greedy(model, prompt_ids(tokenizer, 48), press=press, max_new_tokens=2)
    assert all(layer.keys.shape[-2] <= BUDGET for layer in cache.layers)


# --- composition: every placement either acts or raises naming the press -------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_composed_alone_acts_as_the_press(llama, make_press, name):
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 48)
    alone, alone_cache = run_alone(llama, make_press, name, ids)
    press = make_press(name)
    composed = ComposedPress([press])
    tokens, cache = greedy(model, ids, press=composed, max_new_tokens=8)
    assert torch.equal(tokens, alone)
    assert held_slots(cache) == held_slots(alone_cache)
    assert composed.compression_ratio == pytest.approx(press.compression_ratio)
    assert composed.compression_ratio > 0


@pytest.mark.parametrize("cache_type", [DynamicCache, PagedKVCache])
@pytest.mark.parametrize("name", sorted(DECODING_PRESSES))
def test_a_decoding_step_compressed_right_after_its_attention_equals_the_hooks(llama, make_press, name, cache_type,
                                                                                monkeypatch):
    """A press hooking the model itself compresses each decoding pass from the attention path, before the output
    projection; inside a ComposedPress, from its forward hook. The same tokens and the same cache, slot for slot."""
    from kvpress_cpp.presses.base import KVCompPress

    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 48)
    calls = []
    compress_after_attention = KVCompPress.compress_after_attention
    monkeypatch.setattr(KVCompPress, "compress_after_attention",
                        lambda press, module, *args: calls.append(module.layer_idx)
                        or compress_after_attention(press, module, *args))
    runs = {}
    for how, wrap in (("alone", lambda press: press), ("composed", lambda press: ComposedPress([press]))):
        calls.clear()
        runs[how] = greedy(model, ids, press=wrap(make_press(name)), max_new_tokens=6, cache=cache_type())
        runs[how + " calls"] = list(calls)
    layers = model.config.num_hidden_layers
    assert runs["alone calls"] == list(range(layers)) * 5 and runs["composed calls"] == []  # 5 passes after the prompt
    (tokens, cache), (composed_tokens, composed_cache) = runs["alone"], runs["composed"]
    assert torch.equal(tokens, composed_tokens)
    for layer, composed_layer in zip(cache.layers, composed_cache.layers):
        assert torch.equal(layer.keys, composed_layer.keys) and torch.equal(layer.values, composed_layer.values)
        assert torch.equal(get_state(layer).log_weights, get_state(composed_layer).log_weights)


WRAPPERS = {"ComposedPress": lambda press: ComposedPress([press]),
            "PrefillDecodingPress": lambda press: PrefillDecodingPress(prefilling_press=press),
            "nested": lambda press: PrefillDecodingPress(prefilling_press=ComposedPress([press]))}


def loop_tokens(model, ids, press, explicit_positions: bool) -> torch.Tensor:
    """Six greedy tokens of a hand-written decoding loop under `press`, each step's position given or left to the
    model (which counts a compressed cache's slots: the press's context must place the token after its tokens)."""
    cache, tokens = DynamicCache(), []
    with torch.no_grad(), press(model):
        logits = model(ids, past_key_values=cache).logits
        for step in range(6):
            tokens.append(logits[:, -1:].argmax(-1))
            positions = {"position_ids": torch.tensor([[ids.shape[1] + step]])} if explicit_positions else {}
            logits = model(tokens[-1], past_key_values=cache, **positions).logits
    return torch.cat(tokens, dim=1)


# PrefillDecodingPress's forward hook is kvpress's own (it reads the cache_position transformers 5.17 drops).
WRAPPER_CASES = kvpress_hooks.cases(list(WRAPPERS), {"PrefillDecodingPress", "nested"})


@pytest.mark.parametrize("wrapper", WRAPPER_CASES)
@pytest.mark.parametrize("name", NAMES)
def test_a_wrapped_press_places_a_loops_tokens_after_the_tokens_held(llama, make_press, name, wrapper):
    """kvpress's wrappers enter their own context only: inside one, ours never counted the tokens its cache stands
    for, and a loop that gives no positions had each new token placed at the compressed cache's slot count."""
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 48)
    placed = loop_tokens(model, ids, WRAPPERS[wrapper](make_press(name)), explicit_positions=False)
    assert torch.equal(placed, loop_tokens(model, ids, WRAPPERS[wrapper](make_press(name)), explicit_positions=True))


@pytest.mark.parametrize("wrapper", WRAPPER_CASES)
@pytest.mark.parametrize("name", NAMES)
def test_a_second_generate_through_a_wrapper_is_refused_as_through_the_press(llama, make_press, name, wrapper):
    """A chat's next turn over a compressed cache feeds the context again (generate resumes from the slot count): the
    bare press refuses it, and so must the press inside a wrapper, where it went through silently."""
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 48)
    cache = DynamicCache()
    with torch.no_grad(), WRAPPERS[wrapper](make_press(name))(model), pytest.raises(
            ValueError, match=f"{name}: this pass feeds .* tokens from position .*, but the cache already holds"):
        first = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        model.generate(torch.cat([first, ids[:, :5]], dim=1), past_key_values=cache, max_new_tokens=4,
                       do_sample=False)


@kvpress_hooks.mark
@pytest.mark.parametrize("cache", [DynamicCache, PagedKVCache])
@pytest.mark.parametrize("name", NAMES)
def test_kvpress_press_after_ours_is_refused(llama, make_press, name, cache):
    """Knorm after ours would select among our slots and leave our per-slot state describing other slots (the paged
    cache dropped the state instead: a misleading refusal of a decoding press, none at all for a prefill press)."""
    model, tokenizer = llama
    with pytest.raises(RuntimeError, match=f"{name}: another press rearranged the slots"):
        greedy(model, prompt_ids(tokenizer, 48), press=ComposedPress([make_press(name), KnormPress(0.5)]),
               max_new_tokens=2, cache=cache())


@kvpress_hooks.mark
@pytest.mark.parametrize("cache", [DynamicCache, PagedKVCache])
@pytest.mark.parametrize("after", ["SnapKVPress", "DMSPress"])
@pytest.mark.parametrize("name", ["ZSMergePress", "WeightedKVPress", "KeepKVPress"])
def test_kvpress_press_failing_on_our_slots_is_refused_naming_both(llama, make_press, name, after, cache):
    """SnapKV after ours, with a window wider than the slots ours kept (BUDGET), took our slots for the prompt's
    tokens and failed in avg_pool1d over an empty tensor, naming neither press: GVote on a short prompt met it."""
    model, tokenizer = llama
    snapkv = SnapKVPress(compression_ratio=0.5, window_size=BUDGET + 8)
    kvpress_press = snapkv if after == "SnapKVPress" else DMSPress(snapkv, threshold=0.5)
    with pytest.raises(RuntimeError, match=rf"{after} failed on layer 0, where {name} before it \(in a ComposedPress\) "
                                           rf"left {BUDGET} slots of the pass's 48 tokens: .* Place {name} last"):
        greedy(model, prompt_ids(tokenizer, 48), press=ComposedPress([make_press(name), kvpress_press]),
               max_new_tokens=2, cache=cache())


@kvpress_hooks.mark
@pytest.mark.parametrize("name", NAMES)
def test_think_after_ours_prunes_key_channels_of_our_slots(llama, make_press, name):
    """ThinK zeroes key channels without moving slots, so our per-slot state still lines up."""
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 48)
    def composed():
        return ComposedPress([make_press(name), ThinKPress(0.5, window_size=2)])

    _, alone_cache = run_alone(llama, make_press, name, ids, max_new_tokens=1)
    _, cache = greedy(model, ids, press=composed(), max_new_tokens=1)  # the prefill only
    assert held_slots(cache) == held_slots(alone_cache)
    zeroed_channels = (cache.layers[0].keys == 0).all(dim=-2).sum(-1)  # (B, H): channels zero in every slot
    assert bool((zeroed_channels >= 8).all())
    tokens, _ = greedy(model, ids, press=composed(), max_new_tokens=6)  # decoding goes on over the pruned keys
    assert tokens.shape == (1, 6)


@kvpress_hooks.mark
@pytest.mark.parametrize("name", NAMES)
def test_ours_after_a_kvpress_press(llama, make_press, name):
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 48)
    press = make_press(name)
    composed = ComposedPress([KnormPress(0.5), press])
    if name != "GVotePress":
        with pytest.raises(ValueError, match=f"{name}: layer 0 holds 24 slots for this prompt's 48 tokens"):
            greedy(model, ids, press=composed, max_new_tokens=2)
        return
    # GVote only needs the surviving slots: it removes more of what Knorm kept.
    _, cache = greedy(model, ids, press=composed, max_new_tokens=1)
    heads = model.config.num_key_value_heads
    assert all(held < heads * 24 for held in held_slots(cache))
    assert 0 < press.compression_ratio < 1
    assert composed.compression_ratio == pytest.approx(1 - 0.5 * (1 - press.compression_ratio))


# kvpress's head-wise presses only mark slots (module.masked_key_indices) for its attention wrapper to hide; a threshold
# no score reaches marks every token that leaves DMS's window.
HEAD_WISE_PRESSES = {
    "DMSPress": lambda: DMSPress(KnormPress(), threshold=1e9, sliding_window_size=4),
    "CriticalAdaKVPress": lambda: CriticalAdaKVPress(KnormPress(0.5)),
}


@kvpress_hooks.mark
@pytest.mark.parametrize("cache", [DynamicCache, PagedKVCache])
@pytest.mark.parametrize("head_wise", list(HEAD_WISE_PRESSES))
@pytest.mark.parametrize("ours_first", [True, False], ids=["ours-first", "head-wise-first"])
@pytest.mark.parametrize("name", NAMES)
def test_head_wise_press_composed_with_ours_is_refused(llama, make_press, name, ours_first, head_wise, cache):
    """Our attention over a layer with state never applied the marks (the generation equalled ours alone, while
    ComposedPress reported the head-wise press's ratio too), and marks made before ours indexed tokens our
    compression then moved."""
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 48)
    assert not torch.equal(greedy(model, ids, press=HEAD_WISE_PRESSES[head_wise](), max_new_tokens=6)[0],
                           greedy(model, ids, max_new_tokens=6)[0])  # alone, its marks change the generation
    presses = [make_press(name), HEAD_WISE_PRESSES[head_wise]()]
    error = (RuntimeError, f"{name}: a kvpress press marked slots of a layer {name} compressed") if ours_first else (
        ValueError, f"{name}: layer 0: a kvpress press before {name} marked tokens")
    with pytest.raises(error[0], match=error[1]):
        greedy(model, ids, press=ComposedPress(presses if ours_first else presses[::-1]), max_new_tokens=6,
               cache=cache())


@kvpress_hooks.mark
@pytest.mark.parametrize("name", NAMES)
def test_marks_left_by_an_earlier_head_wise_run_are_not_taken_for_ours(llama, make_press, name):
    """kvpress clears a module's marks only at its next prefill; ours must not read an earlier run's as its own."""
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 48)
    expected, _ = greedy(model, ids, press=make_press(name), max_new_tokens=6)
    greedy(model, ids, press=HEAD_WISE_PRESSES["DMSPress"](), max_new_tokens=6)
    assert torch.equal(greedy(model, ids, press=make_press(name), max_new_tokens=6)[0], expected)


@pytest.mark.parametrize("first, second", [("ZSMergePress", "GVotePress"), ("GVotePress", "KeepKVPress"),
                                           ("KVzapThresholdPress", "WeightedKVPress")])
def test_two_of_ours_on_one_cache_are_refused(llama, make_press, first, second):
    model, tokenizer = llama
    with pytest.raises(ValueError, match=f"{second}: {first} is already active on this LlamaForCausalLM; two "
                                         f"kvpress_cpp presses cannot compress one cache"):
        greedy(model, prompt_ids(tokenizer, 48), press=ComposedPress([make_press(first), make_press(second)]),
               max_new_tokens=2)


def test_a_cache_left_by_a_press_that_is_gone_is_refused_by_another(llama, make_press):
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 48)
    _, cache = greedy(model, ids, press=make_press("ZSMergePress"), max_new_tokens=2)  # the press is dropped
    with torch.no_grad(), make_press("KeepKVPress")(model), pytest.raises(
            ValueError, match="KeepKVPress: layer 0 holds the state of ZSMergePress"):
        model(ids[:, :1], past_key_values=cache)


def test_a_cache_of_a_live_press_is_refused_by_another_of_its_class(llama, make_press):
    """Two ZSMergePress objects, the first still alive: the second cannot continue the first's cache (its state, its
    budget and its positions are the first's), whatever their class shares."""
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 48)
    first = make_press("ZSMergePress")
    _, cache = greedy(model, ids, press=first, max_new_tokens=2)
    with torch.no_grad(), make_press("ZSMergePress")(model), pytest.raises(
            ValueError, match="ZSMergePress: layer 0 holds the state of ZSMergePress"):
        model(ids[:, :1], past_key_values=cache)
    assert first is not None  # alive until here


@pytest.mark.parametrize("name", NAMES)
def test_compress_entry_point_is_refused(llama, make_press, name):
    """kvpress's keys-and-values entry point (used by ChunkPress, DecodingPress, PrefillDecodingPress.compress) has
    no room for our per-slot state."""
    keys = torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match=f"{name}: keeps a per-slot state"):
        make_press(name).compress(None, torch.zeros(1, 8, 64), keys, keys, None, {})


SCORER_WRAPPERS = {
    "DecodingPress": lambda press: DecodingPress(base_press=press, compression_interval=2, target_size=BUDGET),
    "AdaKVPress": AdaKVPress,
    "ChunkPress": lambda press: ChunkPress(press, chunk_length=8),
    "ChunkKVPress": lambda press: ChunkKVPress(press, chunk_length=8),
    "BlockPress": BlockPress,
    "KeyRerotationPress": KeyRerotationPress,
    "CriticalKVPress": CriticalKVPress,
    "CriticalAdaKVPress": CriticalAdaKVPress,
}


@pytest.mark.parametrize("scorer", ["KnormPress", "KVzapPress"])
def test_a_scorer_as_prefill_decoding_press_decoding_press_is_refused_naming_it(llama, surrogate, scorer):
    """A ScorerPress compresses nothing while decoding, and PrefillDecodingPress calls its decoding press's reset()
    at the end: it stopped on "'KVzapPress' object has no attribute 'reset'" after a generation left uncompressed."""
    model, tokenizer = llama
    press = {"KnormPress": lambda: KnormPress(compression_ratio=0.5),
             "KVzapPress": lambda: KVzapPress(compression_ratio=0.5, surrogate_dir=surrogate)}[scorer]()
    with pytest.raises(ValueError, match=f"PrefillDecodingPress: its decoding_press {scorer} is not a decoding press"):
        greedy(model, prompt_ids(tokenizer, 48), press=PrefillDecodingPress(decoding_press=press), max_new_tokens=2)


@kvpress_hooks.mark
@pytest.mark.parametrize("name", sorted(DECODING_PRESSES))
def test_one_press_given_for_both_phases_runs_as_itself(llama, make_press, name):
    """PrefillDecodingPress(prefilling_press=p, decoding_press=p) prefills and decodes with p: the press alone. Its
    context was entered twice, refused as "already active ... two kvpress_cpp presses cannot compress one cache"."""
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 48)
    press = make_press(name)
    tokens, cache = greedy(model, ids, press=PrefillDecodingPress(prefilling_press=press, decoding_press=press))
    alone_tokens, alone_cache = run_alone(llama, make_press, name, ids, max_new_tokens=24)
    assert torch.equal(tokens, alone_tokens)
    assert held_slots(cache) == held_slots(alone_cache)


def test_blockpress_refuses_kvzap_whose_hidden_states_it_splices(llama, surrogate):
    """BlockPress hands its scorer each block's hidden states spliced across kv heads (a head's slice from its own kept
    tokens): KVzap scored states of no token, and kept other slots than alone, with nothing said."""
    with pytest.raises(ValueError, match="BlockPress: its scorer KVzapPress scores each token from its whole hidden "
                                         "state"):
        greedy(llama[0], prompt_ids(llama[1], 48), max_new_tokens=1,
               press=BlockPress(KVzapPress(compression_ratio=0.5, surrogate_dir=surrogate), block_size=16))


@pytest.mark.parametrize("wrapper", list(SCORER_WRAPPERS))
@pytest.mark.parametrize("name", NAMES)
def test_wrappers_of_scorer_presses_refuse_ours_naming_both(make_press, name, wrapper):
    """kvpress's wrappers that re-rank a ScorerPress's scores assert they get one: KeyRerotationPress with a bare
    AssertionError, and none of them under ``python -O``. Ours are refused naming the wrapper and the press."""
    with pytest.raises(ValueError, match=f"{wrapper}: its (base_)?press {name} is a kvpress_cpp press, not a kvpress "
                                         f"ScorerPress"):
        SCORER_WRAPPERS[wrapper](make_press(name))


@pytest.mark.parametrize("name", NAMES)
def test_per_layer_compression_refuses_ours(make_press, name):
    """PerLayerCompressionPress sets each layer's compression_ratio, which our presses take as a budget field."""
    with pytest.raises(AssertionError, match=f"compression_ratio can't be set in the provided press: .*{name}"):
        PerLayerCompressionPress(make_press(name), compression_ratios=[0.5, 0.5])


@kvpress_hooks.mark
@pytest.mark.parametrize("name", NAMES)
def test_dms_press_over_ours_fails_naming_it(llama, make_press, name):
    """DMSPress does not check its press up front; it calls our `score` at the first forward, which refuses, naming
    ours."""
    model, tokenizer = llama
    with pytest.raises(ValueError, match=f"{name}: is not a kvpress ScorerPress"):
        greedy(model, prompt_ids(tokenizer, 48), press=DMSPress(make_press(name), threshold=0.0), max_new_tokens=1)


@pytest.mark.parametrize("name", NAMES)
def test_one_press_reused_across_sequences(llama, make_press, name):
    """As kvpress's test_decoding_press_reuse_across_sequences: one press, two prompts of very different lengths in
    one ``with press(model)``; the second run equals a fresh press's."""
    model, tokenizer = llama
    long_ids, short_ids = prompt_ids(tokenizer, 80), prompt_ids(tokenizer, 30)
    press = make_press(name)
    with torch.no_grad(), press(model):
        model.generate(long_ids, max_new_tokens=6, do_sample=False, past_key_values=DynamicCache())
        second = model.generate(short_ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                past_key_values=DynamicCache())[:, short_ids.shape[1]:]
    assert torch.equal(second, run_alone(llama, make_press, name, short_ids, max_new_tokens=6)[0])


# --- PrefillDecodingPress and the pipeline --------------------------------------------------------------------


def pipe_answer(llama, press, questions, **kwargs):
    model, tokenizer = llama
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    cache = DynamicCache()
    key = "question" if isinstance(questions, str) else "questions"
    out = pipe(CONTEXT, press=press, max_new_tokens=12, cache=cache, **{key: questions}, **kwargs)
    return out["answer" if isinstance(questions, str) else "answers"], cache


@kvpress_hooks.mark
@pytest.mark.parametrize("name", NAMES)
def test_prefill_decoding_press_with_ours_in_either_phase(llama, make_press, name):
    question = "who is in want of a wife?"
    alone, alone_cache = pipe_answer(llama, make_press(name), question)
    # Ours as the decoding press: kvpress's PrefillDecodingPress hands it the prefill too (no prefilling press).
    press = make_press(name)
    answer, cache = pipe_answer(llama, PrefillDecodingPress(decoding_press=press), question)
    assert answer == alone
    assert held_slots(cache) == held_slots(alone_cache)
    assert press.compression_ratio > 0
    # Ours as the prefilling press: it compresses the context, the answer is decoded without compression.
    press = make_press(name)
    answer, cache = pipe_answer(llama, PrefillDecodingPress(prefilling_press=press), question)
    composed, composed_cache = pipe_answer(llama, ComposedPress([make_press(name)]), question)
    assert answer == composed
    assert held_slots(cache) == held_slots(composed_cache)
    assert press.compression_ratio > 0


@kvpress_hooks.mark
@pytest.mark.parametrize("name", NAMES)
def test_prefill_decoding_press_follows_the_pipelines_cut_of_the_answer(llama, make_press, name):
    """kvpress's pipeline keeps a PrefillDecodingPress's context open over the question and answer, and cuts them off
    inside it after the last pass. The count of the tokens the cache stands for, recorded as the context closed, kept
    them: the next tokens, fed right after the context, were refused as fed again (the message advising positions past
    the answer). They are accepted, and attend as over the cache ComposedPress([press]) leaves."""
    model, tokenizer = llama
    question = "who is in want of a wife?"
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    context_ids = pipe.preprocess(CONTEXT, questions=[question], answer_prefix="", max_context_length=10**6)[
        "context_ids"]
    next_ids = tokenizer(question, return_tensors="pt", add_special_tokens=False).input_ids
    positions = torch.arange(context_ids.shape[1], context_ids.shape[1] + next_ids.shape[1]).unsqueeze(0)
    logits = {}
    for wrapper in ("ComposedPress", "PrefillDecodingPress"):
        _, cache = pipe_answer(llama, WRAPPERS[wrapper](make_press(name)), question)
        with torch.no_grad():
            logits[wrapper] = model(next_ids, past_key_values=cache, position_ids=positions).logits
    assert torch.equal(logits["PrefillDecodingPress"], logits["ComposedPress"])


@kvpress_hooks.mark
@pytest.mark.parametrize("name", NAMES)
def test_prefill_decoding_press_refuses_ours_where_it_cannot_act(llama, make_press, name):
    question = "who is in want of a wife?"
    # Ours only in decoding, after Knorm compressed the context: ours never saw the prompt.
    with pytest.raises(ValueError, match=f"{name}: layer 0 already held .* tokens that {name} did not compress"):
        pipe_answer(llama, PrefillDecodingPress(prefilling_press=KnormPress(0.5), decoding_press=make_press(name)),
                    question)
    # kvpress's DecodingPress after ours: it selects among our slots, so our state would no longer line up.
    decoding = DecodingPress(base_press=KnormPress(), compression_interval=2, target_size=BUDGET)
    with pytest.raises(RuntimeError, match=f"{name}: another press rearranged the slots"):
        pipe_answer(llama, PrefillDecodingPress(prefilling_press=make_press(name), decoding_press=decoding), question)


@pytest.mark.parametrize("name", NAMES)
def test_pipeline_with_several_questions(llama, make_press, name):
    """The context is compressed once; each question is answered on it as if asked alone."""
    questions = ["who is in want of a wife?", "what does he possess?", "is it universally acknowledged?"]
    press = ComposedPress([make_press(name)]) if name in DECODING_PRESSES else make_press(name)
    answers, _ = pipe_answer(llama, press, questions)
    single = [pipe_answer(llama, ComposedPress([make_press(name)]), [question])[0][0] for question in questions]
    assert answers == single
    if name in DECODING_PRESSES:  # its answers change the context, which the pipeline cuts back to between questions
        # kvpress refused it as a "DecodingPress", naming neither the press nor why.
        with pytest.raises(ValueError, match=f"{name}: compresses while decoding, .* the pipeline takes one question "
                                             f"with {name} \\(got 3\\)"):
            pipe_answer(llama, make_press(name), questions)


# kvpress presses whose own hooks read each pass's cache_position: our KVzapPress scorer (kvpress's ScorerPress hook),
# and kvpress's wrappers around ours.
HOOK_READERS = [
    ("KVzapPress", lambda make_press, surrogate: KVzapPress(compression_ratio=0.5, surrogate_dir=surrogate)),
    ("AdaKVPress", lambda make_press, surrogate: AdaKVPress(KVzapPress(compression_ratio=0.5,
                                                                       surrogate_dir=surrogate))),
    ("ComposedPress", lambda make_press, surrogate: ComposedPress([make_press("ZSMergePress"), ThinKPress(0.5)])),
    ("ComposedPress", lambda make_press, surrogate: ComposedPress([KnormPress(0.5), make_press("GVotePress")])),
    ("PrefillDecodingPress", lambda make_press, surrogate: PrefillDecodingPress(
        prefilling_press=make_press("ZSMergePress"))),
]


@pytest.mark.skipif(kvpress_transformers_mismatch() is None, reason="kvpress's hooks run with this transformers")
@pytest.mark.parametrize("flow", ["generate", "pipeline"])
@pytest.mark.parametrize("name, make", HOOK_READERS, ids=["KVzap", "AdaKV", "Composed-ours-ThinK",
                                                          "Composed-Knorm-ours", "PrefillDecoding"])
def test_kvpress_hooks_that_cannot_run_are_refused_naming_the_press(llama, make_press, surrogate, name, make, flow):
    """Where transformers no longer gives the attention its cache_position (5.3 on), a press whose kvpress hooks read
    it is refused naming itself and the version mismatch; it raised a bare KeyError('cache_position') from kvpress
    (only DMSPress, which kvpress_cpp's adapter wraps, said why)."""
    model, tokenizer = llama
    press = make(make_press, surrogate)
    with pytest.raises(RuntimeError, match=f"{name}: kvpress's hooks read each pass's cache_position, .*"
                                           f"{re.escape(kvpress_transformers_mismatch())}"):
        if flow == "generate":
            greedy(model, prompt_ids(tokenizer, 48), press=press, max_new_tokens=2)
        else:
            pipe_answer(llama, press, "who is in want of a wife?")


# --- left-padded batches ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_eager():
    return make_tiny_qwen3("eager")


@pytest.mark.parametrize("model_name", ["llama", "qwen3_eager"])
@pytest.mark.parametrize("name", NAMES + ["ZSMergePress-fraction"])
def test_padded_batch_rows_equal_their_runs_alone(request, make_press, name, model_name):
    """Four prompts of different lengths, left-padded: each row gets the greedy tokens it gets alone (sdpa and eager
    attention, Llama and Qwen3)."""
    model, tokenizer = request.getfixturevalue(model_name)
    lengths = [40, 28, 52, 33]
    rows = [prompt_ids(tokenizer, 60)[:, 60 - length:] for length in lengths]
    ids = torch.full((4, max(lengths)), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, ids.shape[1] - row.shape[1]:], mask[i, ids.shape[1] - row.shape[1]:] = row[0], 1

    def fresh():
        return ZSMergePress(budget=0.4) if name == "ZSMergePress-fraction" else make_press(name)

    together, _ = greedy(model, ids, press=fresh(), max_new_tokens=12, attention_mask=mask)
    alone = torch.cat([greedy(model, row, press=fresh(), max_new_tokens=12)[0] for row in rows])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("name", ["ZSMergePress", "WeightedKVPress", "KeepKVPress"])
def test_a_pass_of_several_tokens_after_a_padded_prefill_runs_at_each_rows_positions(llama, make_press, name):
    """A left-padded batch (rows of 40 and 35 tokens) compressed, then 3 more tokens per row at the positions the
    mask gives (40-42 and 35-37), as a question pass of kvpress's pipeline or generate's next turn: no row's pass is
    a re-feed (the latest first position counts, not the earliest), and each row's logits are its run alone's."""
    model, tokenizer = llama
    rows = [prompt_ids(tokenizer, 60)[:, 20:], prompt_ids(tokenizer, 60)[:, 25:]]
    ids = torch.cat([rows[0], torch.nn.functional.pad(rows[1], (5, 0), value=tokenizer.pad_token_id)])
    mask = torch.cat([torch.ones(1, 40, dtype=torch.long), torch.arange(40).ge(5).long().view(1, -1)])
    more = torch.randint(3, 256, (2, 3), generator=torch.Generator().manual_seed(0))

    def last_logits(prompt, prompt_mask, new):
        cache = DynamicCache()
        with torch.no_grad(), make_press(name)(model):
            positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
            model(prompt, attention_mask=prompt_mask, position_ids=positions, past_key_values=cache)
            following = positions[:, -1:] + torch.arange(1, 4)
            return model(new, attention_mask=torch.cat([prompt_mask, torch.ones_like(new)], dim=-1),
                         position_ids=following, past_key_values=cache).logits[:, -1]

    together = last_logits(ids, mask, more)
    for row, prompt in enumerate(rows):
        alone = last_logits(prompt, torch.ones_like(prompt), more[row:row + 1])
        torch.testing.assert_close(together[row:row + 1], alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["ZSMergePress", "WeightedKVPress", "KeepKVPress"])
def test_a_padded_forward_without_positions_compresses_each_row_at_its_columns(llama, make_press, name):
    """A hand-written forward of a left-padded batch given no position_ids: the model places every row at its columns
    (one row of positions, broadcast over the batch), and each row's compressed cache is the one its run alone at
    those positions leaves (rows of 40 and 34 tokens)."""
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 40, batch=2)
    ids[1, :6] = tokenizer.pad_token_id
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    together = DynamicCache()
    with torch.no_grad(), make_press(name)(model):
        model(ids, attention_mask=mask, past_key_values=together)
    for row, pad in enumerate([0, 6]):
        alone = DynamicCache()
        with torch.no_grad(), make_press(name)(model):
            model(ids[row:row + 1, pad:], position_ids=torch.arange(pad, 40).unsqueeze(0), past_key_values=alone)
        for layer, alone_layer in zip(together.layers, alone.layers, strict=True):
            held = alone_layer.keys.shape[-2]
            torch.testing.assert_close(layer.keys[row:row + 1, :, -held:], alone_layer.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(layer.values[row:row + 1, :, -held:], alone_layer.values, atol=1e-5,
                                       rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_unpadded_batch_rows_equal_their_runs_alone(llama, make_press, name):
    """Three prompts of one length in a batch without padding (and so num_return_sequences' copies of one prompt):
    each row gets the greedy tokens it gets alone. GVote drew each row's samples from its own part of one stream, so
    a prompt was compressed differently in row 1 than alone."""
    model, tokenizer = llama
    ids = torch.cat([prompt_ids(tokenizer, 100)[:, start:start + 40] for start in (0, 30, 60)])
    together, _ = greedy(model, ids, press=make_press(name), max_new_tokens=12)
    alone = torch.cat([greedy(model, row[None], press=make_press(name), max_new_tokens=12)[0] for row in ids])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("name", NAMES)
def test_right_padding_and_empty_rows_are_refused(llama, make_press, name):
    """Right padding would put a row's recent window (which every press protects) on padding; KVzap, which takes
    padding slots in its batch, refuses it as the presses that compress row by row do."""
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 40, batch=2)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    with pytest.raises(ValueError, match=f"{name}: only left padding is supported"):
        greedy(model, ids, press=make_press(name), max_new_tokens=2, attention_mask=mask)
    mask[1] = 0
    with pytest.raises(ValueError, match=rf"{name}: batch rows \[1\] hold padding only"):
        with torch.no_grad(), make_press(name)(model):
            model(ids, attention_mask=mask, past_key_values=DynamicCache())


@kvpress_hooks.mark
@pytest.mark.parametrize("cache", [DynamicCache, PagedKVCache])
def test_gvote_after_a_kvpress_press_on_a_padded_batch(llama, cache):
    """After a kvpress press shrank a left-padded prompt, a DynamicCache no longer says which of the slots kept are
    padding, which GVote would attend as tokens: refused. A PagedKVCache dropped the padding before any press ran:
    there GVote at nucleus_p = 1, which keeps every slot, leaves the kvpress press's tokens as they were."""
    model, tokenizer = llama
    rows = [prompt_ids(tokenizer, 40), prompt_ids(tokenizer, 65)[:, 40:]]  # 40 tokens, 25 others
    ids = torch.cat([rows[0], torch.nn.functional.pad(rows[1], (15, 0), value=tokenizer.pad_token_id)])
    mask = (torch.arange(40) >= torch.tensor([[0], [15]])).long()
    composed = ComposedPress([KnormPress(0.2), GVotePress(nucleus_p=1.0)])
    if cache is DynamicCache:
        with pytest.raises(ValueError, match=r"GVotePress: layer 0 holds 32 slots of a left-padded batch's 40-token "
                                             r"prompt \(batch rows \[1\] are padded\)"):
            greedy(model, ids, press=composed, max_new_tokens=2, cache=cache(), attention_mask=mask)
        return
    knorm_alone, _ = greedy(model, ids, press=KnormPress(0.2), max_new_tokens=8, cache=cache(), attention_mask=mask)
    tokens, _ = greedy(model, ids, press=composed, max_new_tokens=8, cache=cache(), attention_mask=mask)
    assert torch.equal(tokens, knorm_alone)


@pytest.mark.skipif(kvpress_transformers_mismatch() is not None, reason="kvpress's hooks need cache_position")
@pytest.mark.parametrize("make_press", [
    lambda surrogate: KeyRerotationPress(KVzapPress(0.5, model_type="linear", surrogate_dir=surrogate)),
    lambda surrogate: KeyRerotationPress(SnapKVPress(0.5, window_size=8)),
    lambda surrogate: ExpectedAttentionPress(0.5),
], ids=["KeyRerotation(KVzap)", "KeyRerotation(SnapKV)", "ExpectedAttention"])
def test_a_gemma3_sliding_layer_is_given_its_own_rotary_embedding(tmp_path, make_press):
    """kvpress gives every layer the model's rotary_emb, the full layers' (base 10^6), to re-rotate kept keys
    (KeyRerotationPress) or turn expected queries (ExpectedAttention); a Gemma 3 sliding layer turns at 10^4. Under
    transformers 4 its kept keys were re-rotated at the global base, silently; under 5 those presses failed for want
    of the layer's type. The sliding layer's cache must equal the one the same weights leave as a full layer of a
    model whose global base is 10^4 (the window is longer than the prompt)."""
    sliding, full = make_tiny_gemma3_sliding_and_full_twin()
    surrogate = write_surrogate(tmp_path / "linear", full, "linear")
    ids = torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(1))

    def layer_0(model):
        cache = DynamicCache()
        with torch.no_grad(), make_press(surrogate)(model):
            model(ids, past_key_values=cache, use_cache=True)
        return cache.layers[0].keys, cache.layers[0].values

    (keys, values), (expected_keys, expected_values) = layer_0(sliding), layer_0(full)
    assert keys.shape[-2] < ids.shape[1], "the press must compress layer 0 for the test to compare anything"
    torch.testing.assert_close(keys, expected_keys)
    torch.testing.assert_close(values, expected_values)


def test_each_gemma3_layer_turns_with_its_own_rotary_embedding_under_a_press():
    """The sliding layer is given the local base's (10^4) rotary embedding and the full layer keeps the decoder's
    (10^6): a full layer given the local one would have its kept keys re-rotated at the wrong base, silently."""
    sliding, _ = make_tiny_gemma3_sliding_and_full_twin()
    head_dim = sliding.config.head_dim
    with KnormPress(compression_ratio=0.5)(sliding):
        for layer, base in zip(sliding.model.layers, (1e4, 1e6)):
            expected = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
            torch.testing.assert_close(layer.self_attn.rotary_emb.inv_freq, expected, msg=f"base {base:g}")


def test_adapting_kvpress_again_wraps_nothing_twice():
    """kvpress_adapters wraps kvpress's methods at import; running its patches again (a module reloaded, a second
    import path) must leave every method as it is: wrapped twice, DMSPress would count its marks twice and every
    kvpress context would open ours twice."""
    from kvpress import BasePress, PyramidKVPress
    from kvpress.pipeline import KVPressTextGenerationPipeline

    from kvpress_cpp import kvpress_adapters

    methods = [(DMSPress, "forward_hook"), (DMSPress, "post_init_from_model"), (AdaKVPress, "compress"),
               (AdaKVPress, "post_init_from_model"), (CriticalAdaKVPress, "compress"), (ScorerPress, "compress"),
               (PyramidKVPress, "compress"), (BasePress, "__call__"), (BasePress, "forward_hook"),
               (ComposedPress, "__call__"), (PrefillDecodingPress, "__call__"),
               (KVPressTextGenerationPipeline, "_forward")]
    adapted = [owner.__dict__[name] for owner, name in methods]
    for patch in kvpress_adapters.__all__:
        if patch.startswith("patch_"):
            getattr(kvpress_adapters, patch)()
    assert [owner.__dict__[name] for owner, name in methods] == adapted


@pytest.mark.parametrize("cache_type", [DynamicCache, PagedKVCache])
@pytest.mark.parametrize("name", NAMES)
def test_a_later_pass_padded_inside_the_sequence_is_refused(llama, make_press, name, cache_type):
    """A batch's next turn whose rows differ in length is padded inside the sequence. Over a cache a press compressed
    (or keeps state for), the model's mask is built for the slots, not the tokens, and the press would decode the
    padding as text: row 1's logits differed from its run alone by up to 0.63, silently. Refused, naming the press."""
    model, _ = llama
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    padding = 3
    new = torch.cat([torch.randint(3, 256, (1, 8)), torch.cat([torch.zeros(1, padding, dtype=torch.long),
                                                             torch.randint(3, 256, (1, 8 - padding))], 1)])
    mask = torch.ones(2, 48, dtype=torch.long)
    mask[1, 40:40 + padding] = 0
    cache = cache_type()
    with torch.no_grad(), make_press(name)(model):
        model(ids, past_key_values=cache)
        with pytest.raises(ValueError, match=rf"{name}: the attention mask hides 3 of this pass's 8 new tokens in "
                                             rf"batch rows \[1\]"):
            model(new, attention_mask=mask, past_key_values=cache)


@pytest.mark.parametrize("name", NAMES)
def test_a_press_copied_inside_its_context_is_a_press_of_its_own(llama, make_press, name):
    """A press deep-copied (or pickled) while its context was open: the copy was refused as active on another model,
    for good, and carried a copy of the model's attention modules; pickle failed on a weak reference."""
    import pickle

    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 48)
    press = make_press(name)
    with press(model):
        copied, pickled = copy.deepcopy(press), pickle.loads(pickle.dumps(press))
    expected = greedy(model, ids, press=make_press(name), max_new_tokens=4)[0]
    for other in (copied, pickled):
        assert other._hooked_modules == []
        assert torch.equal(greedy(model, ids, press=other, max_new_tokens=4)[0], expected)


@kvpress_hooks.mark
def test_a_kvpress_press_around_ours_is_named_as_such(llama, make_press):
    """A kvpress press whose context is opened around ours compresses the prompt first; the refusal said "in a
    ComposedPress", where none was used."""
    model, tokenizer = llama
    with pytest.raises(ValueError, match=r"a press before ZSMergePress \(in a ComposedPress, or a context opened "
                                         r"around ZSMergePress's\) already compressed it"):
        with KnormPress(compression_ratio=0.5)(model):
            greedy(model, prompt_ids(tokenizer, 48), press=make_press("ZSMergePress"), max_new_tokens=2)
