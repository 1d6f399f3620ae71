"""Presses placed where they cannot act, or given what they cannot take, say so: by name, with the value, before
anything is computed wrongly. And the places that look unusual but are supported (beam search, a model the press
does not touch) give the results a reference gives.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from contextlib import nullcontext
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
import transformers
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import Cache, QuantizedLayer

import kvpress_cpp.attention
import kvpress_cpp.presses  # noqa: F401  (wraps transformers' attention functions, as any use of a press does)
from kvpress_cpp.cache import get_state
from kvpress_cpp.paged_cache import PagedKVCache
from kvpress_cpp.presses import (GVotePress, KeepKVPress, KVCompDecodingPress, KVCompPress, KVzapPress,
                                 KVzapThresholdPress, WeightedKVPress, ZSMergePress)
from tests import kvpress_hooks
from tests.generation import greedy, needs_chunked_prefill
from tests.models import make_tiny_llama
from tests.test_kvzap_press import write_surrogate

PROMPT = 40


def tiny(architecture: str, **config):
    """A 2-layer random model of `architecture` (Mistral, Gemma2, ...), GQA 4 / 2 heads."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{architecture}Config")(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256, pad_token_id=0, **config)
    return getattr(transformers, f"{architecture}ForCausalLM")(config).eval()


def prompt(seed: int = 1, length: int = PROMPT) -> torch.Tensor:
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama():
    return make_tiny_llama(query_offset=0.0)[0]


def test_importing_the_presses_leaves_other_models_alone():
    """The attention registry is wrapped for every model; GPT-2's attention has no `scaling` and must run as
    transformers runs it: its sdpa logits equal its eager logits (the same weights)."""
    def gpt2(attention: str):
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, attn_pdrop=0.0,
                                         attn_implementation=attention)
        return transformers.GPT2LMHeadModel(config).eval()

    sdpa, eager = gpt2("sdpa"), gpt2("eager")
    eager.load_state_dict(sdpa.state_dict())
    ids = prompt(length=10) % 256
    with torch.no_grad():
        torch.testing.assert_close(sdpa(ids).logits, eager(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make_press", [
    lambda model, path: ZSMergePress(budget=0.5), lambda model, path: WeightedKVPress(cache_size=0.5),
    lambda model, path: KeepKVPress(budget=0.5), lambda model, path: GVotePress(),
    lambda model, path: KVzapThresholdPress(surrogate_dir=write_surrogate(path, model, "mlp")),
    lambda model, path: None], ids=["ZSMerge", "WeightedKV", "KeepKV", "GVote", "KVzap", "no press"])
def test_a_float64_model_is_refused_by_the_press_and_the_paged_cache_before_anything_is_written(make_press, tmp_path):
    """The ops compute in float32, float16 or bfloat16: a float64 model stopped mid-forward on the error of an op the
    user never called (prompt_attention_with_scores, decode_attention, kvzap_score, paged_decode_attention)."""
    model = tiny("Llama").double()
    press = make_press(model, tmp_path / "surrogate")
    if press is None:
        cache = PagedKVCache()
        with pytest.raises(ValueError, match=r"PagedKVCache: holds float32, float16 or bfloat16 keys and values .*"
                                             r"got torch.float64 key states"), torch.no_grad():
            model(prompt(length=8), past_key_values=cache)
        assert cache.get_seq_length() == 0
        return
    cache = DynamicCache()
    with pytest.raises(ValueError, match=rf"{type(press).__name__}: compresses float32, float16 or bfloat16 models .*"
                                         r"got a torch.float64 LlamaForCausalLM"), torch.no_grad(), press(model):
        model(prompt(length=8), past_key_values=cache)
    assert cache.get_seq_length() == 0
    with torch.no_grad(), press(model.float()):  # the advice works
        model(prompt(length=48), past_key_values=cache)


@pytest.mark.parametrize("press", [ZSMergePress(budget=10_000), GVotePress()], ids=["ZSMerge", "GVote"])
def test_sliding_window_layers_are_refused(press):
    model = tiny("Mistral", sliding_window=16)
    with pytest.raises(ValueError, match=rf"{type(press).__name__}: layer 0 \(MistralAttention\) runs its attention "
                                         r"with sliding_window=16"), torch.no_grad(), press(model):
        model.generate(prompt(), max_new_tokens=2, past_key_values=DynamicCache())


@pytest.mark.parametrize("name", ["ZSMerge", "KeepKV", "WeightedKV", "GVote", "KVzap"])
def test_the_sliding_window_cache_generate_builds_is_refused_with_what_to_pass(name, tmp_path):
    """Given no cache, generate builds one from the config, whose layers for a model with a sliding window (Mistral
    7B's 4096, Phi-3's 2047) are DynamicSlidingWindowLayers, even for a prompt far shorter than the window: they keep
    their own copy of the keys, so the press's state went unread. ZSMerge, KeepKV and WeightedKV stopped on a bare
    op error at the first decoding step, GVote and KVzap gave other tokens than over a DynamicCache, silently."""
    model = tiny("Mistral", sliding_window=4096)
    press = {"ZSMerge": lambda: ZSMergePress(budget=16), "KeepKV": lambda: KeepKVPress(budget=16, recent=4),
             "WeightedKV": lambda: WeightedKVPress(cache_size=16), "GVote": lambda: GVotePress(nucleus_p=0.5),
             "KVzap": lambda: KVzapThresholdPress(threshold=0.0, sliding_window=8, surrogate_dir=write_surrogate(
                 tmp_path / "mlp", model, "mlp", scale=4.0))}[name]()
    with pytest.raises(TypeError, match=rf"{type(press).__name__}: needs a DynamicCache or a PagedKVCache, got a "
                                        r"DynamicSlidingWindowLayer layer, which generate builds from the model's "
                                        r"config \(sliding_window=4096\) when no cache is given: pass "
                                        r"past_key_values=DynamicCache\(\)"), torch.no_grad(), press(model):
        model.generate(prompt(), max_new_tokens=4, do_sample=False)
    for cache in (DynamicCache(), PagedKVCache()):  # as the refusal says
        with torch.no_grad(), press(model):
            model.generate(prompt(), max_new_tokens=4, do_sample=False, past_key_values=cache)


def test_paged_cache_refuses_a_sliding_window_layer_without_a_press():
    model = tiny("Mistral", sliding_window=16)
    with pytest.raises(ValueError, match=r"PagedKVCache: layer 0 .* sliding_window=16"), torch.no_grad():
        model.generate(prompt(), max_new_tokens=2, past_key_values=PagedKVCache())


@pytest.mark.parametrize("window", [None, 4096])
def test_a_window_the_sequence_never_reaches_runs_unchanged(window):
    """Not refused for being Mistral: with no window, or one longer than the sequence (Mistral's default 4096 on a
    short prompt), a press that keeps every token gives the model's logits, on either cache."""
    model = tiny("Mistral", sliding_window=window)
    kwargs = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        plain = torch.stack(model.generate(prompt(), past_key_values=DynamicCache(), **kwargs).scores)
        paged = torch.stack(model.generate(prompt(), past_key_values=PagedKVCache(), **kwargs).scores)
        with ZSMergePress(budget=10_000)(model):
            pressed = torch.stack(model.generate(prompt(), past_key_values=DynamicCache(), **kwargs).scores)
    torch.testing.assert_close(pressed, plain, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(paged, plain, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("new_tokens,refused", [(3, False), (4, True)])
def test_a_window_the_decoding_outgrows_is_refused_at_that_pass(new_tokens, refused):
    """40-token prompt, window 42: generate's passes hold 40, 41, 42 tokens for 3 new tokens (fits), and 43 for the
    4th token's pass, refused then, not a pass later."""
    model = tiny("Mistral", sliding_window=42)
    with torch.no_grad(), ZSMergePress(budget=16)(model), pytest.raises(
            ValueError, match=r"sliding_window=42 over 43 tokens") if refused else nullcontext():
        model.generate(prompt(), max_new_tokens=new_tokens, do_sample=False, past_key_values=DynamicCache())


def tiny_gemma3(layer_types: list[str], sliding_window: int) -> transformers.Gemma3ForConditionalGeneration:
    text = transformers.Gemma3TextConfig(
        hidden_size=64, num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=300, sliding_window=sliding_window, pad_token_id=0, layer_types=layer_types)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=8)
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4, image_token_index=299,
        boi_token_index=297, eoi_token_index=298)).eval()


def test_gemma3_sliding_layers_kvpress_leaves_alone_are_not_refused():
    """kvpress hooks only Gemma 3's full-attention layers; its sliding layers keep every token, under the model's own
    window. A press that keeps every token gives the model's tokens."""
    model = tiny_gemma3(["sliding_attention", "full_attention"] * 2, sliding_window=16)
    ids = prompt(length=60) % 290
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=DynamicCache())
        with ZSMergePress(budget=10_000)(model):
            pressed = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=DynamicCache())
    assert torch.equal(pressed, plain)


def test_gvote_reports_the_memory_held_when_the_last_layer_is_one_kvpress_leaves_alone():
    """Gemma 3 4B and 27B end on a sliding layer, which kvpress does not hook: GVote gathered its memory ratios at
    the model's last layer, so it reported a memory_compression_ratio of 0 and no layer's. Each hooked layer's ratio
    is the share of the prompt's columns its longest head gave up."""
    model = tiny_gemma3(["sliding_attention", "full_attention", "full_attention", "sliding_attention"], 512)
    ids, press, cache = prompt(length=60) % 290, GVotePress(nucleus_p=0.5), DynamicCache()
    with torch.no_grad(), press(model):
        model.generate(ids, max_new_tokens=3, do_sample=False, past_key_values=cache)
    held = {layer: cache.layers[layer].keys.shape[-2] - 2 for layer in (1, 2)}  # two tokens appended after the prompt
    assert press.layer_memory_compression_ratios == pytest.approx({layer: 1 - columns / 60
                                                                   for layer, columns in held.items()})
    assert 0 < press.memory_compression_ratio <= press.compression_ratio


def test_soft_capped_attention_is_refused():
    model = tiny("Gemma2", head_dim=16, layer_types=["full_attention"] * 2, attn_implementation="eager")
    with pytest.raises(ValueError, match=r"KeepKVPress: layer 0 \(Gemma2Attention\) runs its attention with "
                                         r"softcap=50.0"), torch.no_grad(), KeepKVPress(budget=24, recent=8)(model):
        model.generate(prompt(), max_new_tokens=2, past_key_values=DynamicCache())


QUERY_PRESSES = {  # the presses that score the prompt with queries recomputed from the layer's input
    "ZSMerge": lambda: ZSMergePress(budget=16),
    "WeightedKV": lambda: WeightedKVPress(cache_size=24, recent=8),
    "KeepKV": lambda: KeepKVPress(budget=24, recent=8),
    "GVote": lambda: GVotePress(),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(QUERY_PRESSES))
def test_a_half_precision_model_with_float32_rotary_tables_is_compressed(name, dtype):
    """OLMo's rotary tables are float32 in a half-precision model (its attention casts the turned queries back): the
    queries the presses recompute came out float32 and the ops refused them beside half-precision keys, naming
    neither the press nor the cause ("kvcomp::decode_attention: expected keys of dtype Float, got BFloat16"). The
    press must compress: under the budget (GVote, whose p = 0.95 keeps all of this flat attention: fewer slots at
    p = 0.05 than tokens)."""
    model = tiny("Olmo", attn_implementation="eager").to(dtype)
    cache, press = DynamicCache(), GVotePress(nucleus_p=0.05) if name == "GVote" else QUERY_PRESSES[name]()
    with torch.no_grad(), press(model):
        model(prompt(), past_key_values=cache, use_cache=True)
    held = [int(torch.isfinite(get_state(layer).log_weights).sum(-1).max()) for layer in cache.layers]
    assert all(slots < PROMPT for slots in held), held


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("architecture", ["Olmo2", "Cohere"])  # q_norm over all heads; interleaved rotary embedding
@pytest.mark.parametrize("name", sorted(QUERY_PRESSES))
def test_models_whose_queries_the_presses_cannot_recompute_are_refused(name, architecture, attention):
    """Scored with other queries than the attention used, the prompt would be compressed by the wrong attention: a
    padded row differed from its run alone, and eager from sdpa, with nothing said."""
    model, press = tiny(architecture, attn_implementation=attention), QUERY_PRESSES[name]()
    with pytest.raises(ValueError, match=rf"{type(press).__name__}: layer 0 \({architecture}Attention\): the queries "
                                         rf".* are not those the model's attention used"), torch.no_grad(), press(model):
        model.generate(prompt(), max_new_tokens=2, past_key_values=DynamicCache())


@pytest.mark.parametrize("name", sorted(QUERY_PRESSES))
def test_a_nan_reaching_a_layer_is_not_taken_for_another_architecture(name):
    """A NaN weight in layer 0's v_proj reaches layer 1's input: the recomputed queries' comparison was NaN, and the
    press refused the model as one that "forms its queries another way". The model's output is garbage with or
    without the press; the press now runs to the end as the model alone does."""
    model = tiny("Llama")
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight[1, 2] = float("nan")
        alone = model.generate(prompt(), max_new_tokens=3, do_sample=False, past_key_values=DynamicCache())
        with QUERY_PRESSES[name]()(model):
            pressed = model.generate(prompt(), max_new_tokens=3, do_sample=False, past_key_values=DynamicCache())
    assert pressed.shape == alone.shape


@pytest.mark.parametrize("architecture,config", [("Mistral", {}), ("Qwen2", {}), ("Phi3", {}), ("Granite", {}),
                                                 ("Gemma", {"head_dim": 16}), ("Phi", {})])
@pytest.mark.parametrize("name", ["ZSMerge", "KeepKV", "GVote"])
def test_llama_like_models_run_alike_whether_the_queries_are_recomputed_or_kept(name, architecture, config):
    """Eager attention leaves the press to recompute the prompt's queries; sdpa's pass keeps them for ZSMerge. The
    recomputation passes the check and both give the same tokens. Phi turns only half of each head's dims (partial
    rotary), which the recomputation and GVote's averaged RoPE failed to shape before."""
    tokens = []
    for attention in ("eager", "sdpa"):
        model = tiny(architecture, attn_implementation=attention, **config)
        with torch.no_grad(), QUERY_PRESSES[name]()(model):
            tokens.append(model.generate(prompt(), max_new_tokens=6, do_sample=False, past_key_values=DynamicCache()))
    assert torch.equal(tokens[0], tokens[1])


BEAM_PRESSES = {
    "ZSMerge": lambda path, model: ZSMergePress(budget=16),
    "WeightedKV": lambda path, model: WeightedKVPress(cache_size=24, recent=8),
    "KeepKV": lambda path, model: KeepKVPress(budget=24, recent=8),
    "KVzap": lambda path, model: KVzapThresholdPress(sliding_window=4, threshold=0.0, compaction_slack=1,
                                                     surrogate_dir=write_surrogate(path, model, "mlp", scale=3.0)),
}


@pytest.mark.parametrize("name", sorted(BEAM_PRESSES))
@pytest.mark.parametrize("order", [[1, 0], [1, 1]])
def test_beam_search_reorder_moves_the_press_state(llama, name, order, tmp_path):
    """Beam search calls Cache.reorder_cache after every step. Prefilling rows (a, b) and reordering them to `order`
    must leave the cache that prefilling the rows in that order leaves: the next step's logits and its keys are equal
    (a state left behind would bias the rows with each other's merge weights)."""
    rows, first_steps = [prompt(1), prompt(2)], [[5], [7]]

    def steps(cache: DynamicCache, tokens: list[list[int]], position: int):
        """One decoding step at its logical position (a compressed layer's length is not its position)."""
        return llama(torch.tensor(tokens), past_key_values=cache, position_ids=torch.tensor([[position]] * 2)).logits

    with torch.no_grad(), BEAM_PRESSES[name](tmp_path, llama)(llama):
        reordered = DynamicCache()
        llama(torch.cat(rows), past_key_values=reordered)
        steps(reordered, first_steps, PROMPT)
        reordered.reorder_cache(torch.tensor(order))
        got = steps(reordered, [[9], [9]], PROMPT + 1)
        steps(reordered, [[11], [11]], PROMPT + 2)
        # The reference: the rows prefilled in the new order, each with the step it took before the reorder.
        reference = DynamicCache()
        llama(torch.cat([rows[i] for i in order]), past_key_values=reference)
        steps(reference, [first_steps[i] for i in order], PROMPT)
        want = steps(reference, [[9], [9]], PROMPT + 1)
        steps(reference, [[11], [11]], PROMPT + 2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for layer, reference_layer in zip(reordered.layers, reference.layers, strict=True):
        # Each (row, head)'s held slots in order: a duplicated row may sit in a layer as wide as its longest row was.
        def held(cache_layer):
            real = get_state(cache_layer).log_weights.isfinite()
            return [cache_layer.keys[b, h][real[b, h]] for b in range(2) for h in range(real.shape[1])]

        for got_keys, want_keys in zip(held(layer), held(reference_layer), strict=True):
            torch.testing.assert_close(got_keys, want_keys)


@pytest.mark.parametrize("name", ["ZSMerge", "WeightedKV", "KeepKV"])
def test_a_reorder_repeating_a_row_of_a_padded_batch_gives_each_copy_its_own_state(llama, name, tmp_path):
    """A left-padded batch is compressed row by row (each row its own state); a reorder that repeats a row ([1, 1],
    beam search keeping two copies of one beam) leaves two copies that decode on independently: the next steps'
    logits equal those of that row prefilled twice in a batch of the same padding (a state shared by the copies
    would take the first copy's step as the second's), and the compression ratios are those of that batch (its
    rows' prompt tokens, not the rows' before the reorder)."""
    pad = 6
    rows = [prompt(1), torch.nn.functional.pad(prompt(2)[:, pad:], (pad, 0), value=0)]
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[1, :pad] = 0

    def run(order: list[int], reorder: list[int] | None) -> tuple[list[torch.Tensor], float]:
        cache, step_mask, press = DynamicCache(), mask[order], BEAM_PRESSES[name](tmp_path, llama)
        with torch.no_grad(), press(llama):
            logits = list(steps(cache, order, reorder, step_mask))
        return logits, press.compression_ratio

    def steps(cache, order, reorder, step_mask):
        llama(torch.cat([rows[i] for i in order]), attention_mask=step_mask, past_key_values=cache,
              position_ids=(step_mask.cumsum(-1) - 1).clamp(min=0))
        for tokens in ([[5], [7]], [[9], [9]], [[11], [11]]):
            if tokens[0] == [9] and reorder is not None:
                cache.reorder_cache(torch.tensor(reorder))
                step_mask = step_mask[reorder]
            step_mask = torch.cat([step_mask, torch.ones(2, 1, dtype=torch.long)], dim=-1)
            positions = step_mask.sum(-1, keepdim=True) - 1
            tokens = tokens if reorder is not None or order[0] == 0 else [tokens[1]] * 2
            yield llama(torch.tensor(tokens), attention_mask=step_mask, position_ids=positions,
                        past_key_values=cache).logits[:, -1]

    (got, got_ratio), (want, want_ratio) = run([0, 1], [1, 1]), run([1, 1], None)
    for got_step, want_step in zip(got[1:], want[1:]):
        torch.testing.assert_close(got_step, want_step, atol=1e-5, rtol=1e-5)
    assert got_ratio == pytest.approx(want_ratio)


def test_beam_search_runs_under_a_press(llama):
    with torch.no_grad(), KeepKVPress(budget=24, recent=8)(llama):
        out = llama.generate(prompt(), num_beams=2, max_new_tokens=4, do_sample=False,
                             past_key_values=DynamicCache())
    assert out.shape == (1, PROMPT + 4)


def test_a_second_generate_on_a_compressed_cache_is_refused(llama):
    """generate resumes from get_seq_length(), the slots a compressed layer holds: the next turn of a chat would feed
    the tokens between the slots and the tokens seen again."""
    cache = DynamicCache()
    press = ZSMergePress(budget=16)
    with torch.no_grad(), press(llama):
        first = llama.generate(prompt(), past_key_values=cache, max_new_tokens=3, do_sample=False)
    second_turn = torch.cat([first, prompt(3, 5)], dim=1)
    with pytest.raises(ValueError, match=r"ZSMergePress: this pass feeds 32 tokens from position 16, but the cache "
                                         r"already holds the tokens up to position 41, compressed to 16 slots"), \
            torch.no_grad(), press(llama):
        llama.generate(second_turn, past_key_values=cache, max_new_tokens=1, do_sample=False)
    # What the message advises runs: the new tokens only, at the positions after the ones held.
    with torch.no_grad(), press(llama):
        llama(prompt(3, 5), past_key_values=cache, position_ids=torch.arange(42, 47).unsqueeze(0))


@pytest.mark.parametrize("tokens", [2, 3])
@pytest.mark.parametrize("start", [PROMPT - 2, PROMPT - 1, PROMPT])
def test_after_the_context_closed_a_pass_is_refused_exactly_when_it_starts_before_the_next_position(llama, tokens,
                                                                                                    start):
    """Outside the press's context, over 40 tokens compressed to 16 slots: a pass of several tokens from a position
    the cache already stands for is a re-feed, refused; one from position 40 on is the continuation, which runs."""
    cache = DynamicCache()
    with torch.no_grad():
        with ZSMergePress(budget=16)(llama):
            llama(prompt(), past_key_values=cache)
        positions = torch.arange(start, start + tokens).unsqueeze(0)
        if start < PROMPT:
            with pytest.raises(ValueError, match=rf"ZSMergePress \(its context closed\): this pass feeds {tokens} "
                                                 rf"tokens from position {start}"):
                llama(prompt(3, tokens), past_key_values=cache, position_ids=positions)
            assert cache.get_seq_length() == 16
        else:
            llama(prompt(3, tokens), past_key_values=cache, position_ids=positions)
            assert cache.get_seq_length() == 16 + tokens


@pytest.mark.parametrize("keep", [1, 15, 16, 39, 40, -1])
def test_a_crop_of_a_compressed_cache_is_refused_exactly_when_it_would_drop_merged_tokens(llama, keep, monkeypatch):
    """40 tokens compressed to 16 slots: crop(n) keeps n tokens. Any n from 1 up to the 39th token asks for tokens
    merged into (or scored against) the slots kept, refused; n = 40 drops nothing, and is not passed on (transformers
    from 5.24 refuses a positive crop, which it was asked); crop(-1) (transformers 5.17's count of tokens to remove)
    drops the last token, merged. Below the slots, crop cut the last slots, which in ZSMerge's recent ring are not
    the last tokens, and the cache then stood for fewer tokens than it held."""
    cache = DynamicCache()
    with torch.no_grad(), ZSMergePress(budget=16)(llama):
        llama(prompt(), past_key_values=cache)
    if 0 < keep < PROMPT or keep < 0:
        with pytest.raises(ValueError, match=rf"ZSMergePress: crop\({keep}\) asks a cache ZSMergePress compressed "
                                             rf"to drop {PROMPT - keep if keep > 0 else -keep} of the {PROMPT} "
                                             r"tokens it stands for, in 16 slots"):
            cache.crop(keep)
        assert cache.get_seq_length() == 16
    else:
        original = DynamicCache.crop

        def refusing_a_positive_crop(self, max_length, *args, **kwargs):  # as transformers from 5.24
            if max_length > 0:
                raise ValueError(f"Calling crop with a positive value ({max_length}) is not supported")
            return original(self, max_length, *args, **kwargs)

        monkeypatch.setattr(DynamicCache, "crop", refusing_a_positive_crop)
        cache.crop(keep)
        assert cache.get_seq_length() == min(keep, 16)


PREFILL_ONLY = {"GVote": lambda path, model: GVotePress(nucleus_p=0.5)}
POSITION_PRESSES = {**BEAM_PRESSES, **PREFILL_ONLY}


@pytest.mark.parametrize("cache_type", [DynamicCache, PagedKVCache])
@pytest.mark.parametrize("name", sorted(POSITION_PRESSES))
def test_a_second_generate_after_the_press_context_closed_is_refused(llama, name, cache_type, tmp_path):
    """The next turn of a chat without the press: no press hook counts positions any more, so generate's re-feeding
    (it resumes from the slots) went through silently (50 slots where 24 were expected). A pass at the positions
    after the tokens held still runs, as kvpress's pipeline asks its questions, and the refused pass left nothing
    behind. It had appended its tokens to layer 0 before its attention refused them: the pass the message advises was
    refused in turn, as if they were tokens held, and one at the positions that second message gave attended to
    them."""
    press, cache = POSITION_PRESSES[name](tmp_path, llama), cache_type()
    with torch.no_grad():
        with press(llama):
            first = llama.generate(prompt(), past_key_values=cache, max_new_tokens=3, do_sample=False)
        slots = cache.get_seq_length()
        assert slots < PROMPT + 2, "the press must have compressed the cache for this test"
        untouched = copy.deepcopy(cache)
        with pytest.raises(ValueError, match=rf"{type(press).__name__} \(its context closed\): this pass feeds "
                                             rf"{PROMPT + 3 + 5 - slots} tokens from position {slots}, but the cache "
                                             rf"already holds the tokens up to position {PROMPT + 1}"):
            llama.generate(torch.cat([first, prompt(3, 5)], dim=1), past_key_values=cache, max_new_tokens=1,
                           do_sample=False)
        lengths = [layer.get_seq_length() for layer in cache.layers]
        assert lengths == [layer.get_seq_length() for layer in untouched.layers]
        positions = torch.arange(PROMPT + 2, PROMPT + 7).unsqueeze(0)
        got = llama(prompt(3, 5), past_key_values=cache, position_ids=positions).logits
        want = llama(prompt(3, 5), past_key_values=untouched, position_ids=positions).logits
        assert cache.get_seq_length() == slots + 5
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_type", [DynamicCache, PagedKVCache])
def test_a_pad_id_among_the_held_ids_is_named_as_what_put_a_second_generate_behind(llama, cache_type):
    """An uncompressed cache (a budget above the prompt) continued by a second generate once the press's context
    closed, over ids holding the pad id after the prompt (as a turn that generated it): generate infers a mask that
    hides it and gives the new tokens positions one short. The refusal said the pass fed a token again and that
    get_seq_length counts a compressed cache's slots, of a cache nothing had compressed and a pass that fed nothing
    again. It now names the positions and the inferred mask; the mask it advises runs."""
    pad = llama.generation_config.pad_token_id
    cache = cache_type()
    with torch.no_grad():
        with ZSMergePress(budget=200)(llama):
            first = llama.generate(prompt(), past_key_values=cache, max_new_tokens=3, do_sample=False)
        first[0, PROMPT] = pad
        second = torch.cat([first, prompt(3, 5)], dim=1)
        with pytest.raises(ValueError, match=rf"ZSMergePress \(its context closed\): this pass's 6 tokens start at "
                                             rf"position {PROMPT + 1}, but the cache holds {PROMPT + 2} tokens, none "
                                             r"compressed.*infers one from pad_token_id"):
            llama.generate(second, past_key_values=cache, max_new_tokens=1, do_sample=False, pad_token_id=pad)
        llama.generate(second, attention_mask=torch.ones_like(second), past_key_values=cache, max_new_tokens=1,
                       do_sample=False, pad_token_id=pad)
    assert cache.get_seq_length() == second.shape[1]


@pytest.mark.parametrize("refill", ["plain", "same press", "composed"])
@pytest.mark.parametrize("cache_type", [DynamicCache, PagedKVCache])
@pytest.mark.parametrize("name", sorted(POSITION_PRESSES))
def test_a_cache_emptied_and_refilled_acts_as_a_new_one(llama, name, cache_type, refill, tmp_path):
    """Cut to nothing, then a new prompt: the cache must hold what a new cache holds after the same prompt, and take the
    prompt's continuation. The paged cache kept the old prompt's state (a press then read the new prompt as a decoding
    pass: ZSMerge failed in update_scores, GVote kept every token), and the tokens counted when the old press's
    context closed refused the new prompt's continuation as a re-feed."""
    from kvpress import ComposedPress

    def run(cache, press):
        ctx = {"plain": nullcontext(), "same press": press(llama), "composed": ComposedPress([press])(llama)}[refill]
        with torch.no_grad():
            with ctx:
                llama(prompt(2, 30), past_key_values=cache)
            slots = cache.get_seq_length()
            logits = llama(prompt(3, 5), past_key_values=cache, position_ids=torch.arange(30, 35).unsqueeze(0)).logits
        return slots, logits

    press, cache = POSITION_PRESSES[name](tmp_path, llama), cache_type()
    with torch.no_grad(), press(llama):
        llama(prompt(), past_key_values=cache)
    assert cache.get_seq_length() < PROMPT, "the press must have compressed the cache for this test"
    for layer in cache.layers:  # cut to nothing (crop(0) removes nothing from transformers 5.17 on)
        layer.keys, layer.values = layer.keys[:, :, :0], layer.values[:, :, :0]
    assert cache.get_seq_length() == 0
    slots, logits = run(cache, press)
    want_slots, want_logits = run(cache_type(), POSITION_PRESSES[name](tmp_path / "fresh", llama))
    assert slots == want_slots
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:GVotePress. a pass of 2 tokens")
@pytest.mark.parametrize("cache_type", [DynamicCache, PagedKVCache, None])
@pytest.mark.parametrize("name", sorted(POSITION_PRESSES))
def test_passes_without_positions_continue_after_the_tokens_held(llama, name, cache_type, tmp_path):
    """A hand-written loop that passes no positions (``model(token, past_key_values=cache)``) is placed after the
    tokens the compressed cache stands for, as over an uncompressed cache, not at its slot count: every pass, one
    token or several, gives the logits of the same pass at its logical positions; tokens fed between two contexts
    of a press that compresses the prompt only (at their positions) count too."""
    press = POSITION_PRESSES[name](tmp_path, llama)
    passes = [[5], [7], [9, 11], [13]]

    def run(with_positions: bool) -> list[torch.Tensor]:
        cache, logits, position = cache_type() if cache_type else None, [], PROMPT

        def forward(tokens: list[int], given: bool):
            nonlocal position
            positions = torch.arange(position, position + len(tokens)).unsqueeze(0) if given else None
            logits.append(llama(torch.tensor([tokens]), past_key_values=cache, position_ids=positions).logits)
            position += len(tokens)

        with torch.no_grad():
            with press(llama):
                if cache_type is None:  # the model makes the cache at the first forward (use_cache=True)
                    cache = llama(prompt(), use_cache=True).past_key_values
                else:
                    llama(prompt(), past_key_values=cache)
                for tokens in passes:
                    forward(tokens, with_positions)
                assert cache.get_seq_length() < position, "the press must have compressed the cache for this test"
            if name in PREFILL_ONLY:
                forward([17, 19], True)  # outside the press's context the model is on its own: positions given
                with press(llama):
                    for tokens in passes:
                        forward(tokens, with_positions)
        return logits

    for got, want in zip(run(with_positions=False), run(with_positions=True), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_type", [DynamicCache, PagedKVCache])
@pytest.mark.parametrize("name", sorted(BEAM_PRESSES))
def test_a_decoding_press_refuses_tokens_fed_outside_its_context(llama, name, cache_type, tmp_path):
    """A press that compresses while decoding keeps scores for every slot; tokens fed while its context was closed
    have none, so its next pass is refused by name instead of failing inside an op."""
    press = BEAM_PRESSES[name](tmp_path, llama)
    cache = cache_type()
    with torch.no_grad():
        with press(llama):
            llama(prompt(), past_key_values=cache)
        llama(torch.tensor([[5, 7]]), past_key_values=cache, position_ids=torch.tensor([[PROMPT, PROMPT + 1]]))
        with pytest.raises(ValueError, match=rf"{press.__class__.__name__}: layer 0 holds \d+ slots before this pass, "
                                             rf"but .* covers \d+: tokens were fed over the cache while"), \
                press(llama):
            llama(torch.tensor([[9]]), past_key_values=cache, position_ids=torch.tensor([[PROMPT + 2]]))


def test_an_emptied_cache_counts_its_positions_from_zero(llama):
    """A cache cut to nothing and prefilled again stands for the new prompt's positions only, not fewer: the second
    generate on it is refused with the new prompt's count (the slots cut are not taken off an emptied cache)."""
    cache = DynamicCache()
    with torch.no_grad(), ZSMergePress(budget=16)(llama):
        llama.generate(prompt(), past_key_values=cache, max_new_tokens=3, do_sample=False)
        for layer in cache.layers:  # cut to nothing, as kvpress's pipeline cuts (crop(0) differs between versions)
            layer.keys, layer.values = layer.keys[..., :0, :], layer.values[..., :0, :]
        llama.generate(prompt(4), past_key_values=cache, max_new_tokens=1, do_sample=False)
        with pytest.raises(ValueError, match=r"already holds the tokens up to position 39, compressed to 16 slots"):
            llama.generate(torch.cat([prompt(4), prompt(5, 5)], dim=1), past_key_values=cache, max_new_tokens=1,
                           do_sample=False)


def test_a_press_without_a_cache_says_it_did_nothing(llama):
    press = ZSMergePress(budget=8)
    with pytest.warns(UserWarning, match=r"ZSMergePress: the model ran without a KV cache"), torch.no_grad(), \
            press(llama):
        llama.generate(prompt(), use_cache=False, max_new_tokens=2, do_sample=False)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), press(llama):
        warnings.simplefilter("always")
        llama(prompt(), use_cache=False)
        llama(prompt(), use_cache=False)
    assert [str(w.message)[:40] for w in caught] == ["ZSMergePress: the model ran without a KV"]  # once a context


def test_use_cache_false_with_a_cache_is_refused_naming_use_cache(llama):
    """With use_cache=False, generate feeds the whole sequence at every step, into a cache passed as
    past_key_values too: the press refused it as a second generate call on the cache, which it was not."""
    with pytest.raises(ValueError, match=r"ZSMergePress: this pass feeds .* Here the pass runs with use_cache=False"), \
            torch.no_grad(), ZSMergePress(budget=8)(llama):
        llama.generate(prompt(), use_cache=False, past_key_values=DynamicCache(), max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("make_press", [lambda: ZSMergePress(budget=0.5), lambda: WeightedKVPress(cache_size=0.5),
                                        lambda: KeepKVPress(budget=0.5, recent=8)],
                         ids=["ZSMerge", "WeightedKV", "KeepKV"])
def test_generate_s_own_chunked_prefill_under_a_fractional_budget_is_refused(llama, make_press):
    """generate(prefill_chunk_size=16) makes the first chunk the press's prefill: a fractional budget kept half of
    16 tokens, not of the 64-token prompt, and held every later chunk to those 8 slots, while compression_ratio still
    said 0.5. The press's own prefill_chunk_size refuses a fraction; generate's now does too (and transformers 5.2's
    chunks, positioned as the last one, are refused as with the press's own option)."""
    press = make_press()
    refused = (rf"{type(press).__name__}: generate\(prefill_chunk_size=16\) streams the prompt (in chunks, the "
               r"first of which is .*(budget|cache_size)=0\.5|through generate's chunked prefill, which in "
               r"transformers 5\.2)")
    with pytest.raises(ValueError, match=refused), torch.no_grad(), press(llama):
        llama.generate(prompt(length=64), prefill_chunk_size=16, max_new_tokens=2, past_key_values=DynamicCache())
    assert "generate" not in llama.__dict__  # the context put generate back


@needs_chunked_prefill
def test_generate_s_own_chunked_prefill_under_a_budget_in_tokens_streams_the_prompt(llama):
    press = KeepKVPress(budget=24, recent=8)
    with torch.no_grad(), press(llama):
        llama.generate(prompt(length=64), prefill_chunk_size=16, max_new_tokens=2, past_key_values=DynamicCache(),
                       do_sample=False)
    assert press.compression_ratio == pytest.approx(1 - 24 / 65)  # 64 prompt tokens and a decoded one, 24 held


@needs_chunked_prefill
def test_a_prefill_press_says_a_chunked_prompt_stays_partly_uncompressed(llama):
    with pytest.warns(UserWarning, match=r"GVotePress: a pass of 16 tokens over layers GVotePress compressed earlier"), \
            torch.no_grad(), GVotePress()(llama):
        llama.generate(prompt(length=48), prefill_chunk_size=16, max_new_tokens=2, past_key_values=DynamicCache())


@needs_chunked_prefill
@pytest.mark.parametrize("make_press", [lambda: ZSMergePress(budget=16, prefill_chunk_size=8),
                                        lambda: WeightedKVPress(cache_size=16, prefill_chunk_size=8)],
                         ids=["ZSMerge", "WeightedKV"])
def test_a_streaming_press_refuses_a_prompt_given_in_one_forward(llama, make_press):
    """prefill_chunk_size streams the prompt only through generate's chunked prefill. A forward of the whole prompt
    (a hand-written one, kvpress's pipeline, or transformers 4's beam search, which does not chunk) was compressed
    in one shot, as without the option, and nothing said so."""
    press = make_press()
    name = type(press).__name__
    refused = rf"{name}: a prompt of 48 tokens reached the press in one forward, where prefill_chunk_size=8"
    with pytest.raises(ValueError, match=refused), torch.no_grad(), press(llama):
        llama(prompt(length=48), past_key_values=DynamicCache())
    beams = dict(num_beams=2, max_new_tokens=2, do_sample=False, past_key_values=DynamicCache())
    if transformers.__version__.startswith("4."):
        with pytest.raises(ValueError, match=refused), torch.no_grad(), press(llama):
            llama.generate(prompt(length=48), **beams)
    else:  # transformers 5 chunks beam search's prompt too
        with torch.no_grad(), press(llama):
            llama.generate(prompt(length=48), **beams)
    with torch.no_grad(), press(llama):  # a prompt no longer than a chunk is its own first chunk
        llama(prompt(length=8), past_key_values=DynamicCache())
    # One token more than a chunk is already a prompt in one forward; and so is a forward that lets the model create
    # its cache (no past_key_values, use_cache=True: a hand-written loop's first pass).
    with pytest.raises(ValueError, match=rf"{name}: a prompt of 9 tokens"), torch.no_grad(), press(llama):
        llama(prompt(length=9), past_key_values=DynamicCache())
    with pytest.raises(ValueError, match=refused), torch.no_grad(), press(llama):
        llama(prompt(length=48), use_cache=True)


@needs_chunked_prefill
@kvpress_hooks.mark
@pytest.mark.parametrize("make_press", [lambda: ZSMergePress(budget=16, prefill_chunk_size=8),
                                        lambda: WeightedKVPress(cache_size=16, prefill_chunk_size=8)],
                         ids=["ZSMerge", "WeightedKV"])
def test_a_streaming_press_streams_in_a_composed_press_and_is_refused_by_prefill_decoding_press(llama, make_press):
    """kvpress's wrappers open the press without its own __call__, where prefill_chunk_size was handed to generate:
    inside ComposedPress the same generate was refused as "a prompt in one forward". ComposedPress passes every chunk
    to the press, so it streams as the press alone; PrefillDecodingPress would give every chunk after the first to
    its decoding_press, which leaves those chunks uncompressed: refused, naming both."""
    from kvpress import ComposedPress, PrefillDecodingPress

    ids = prompt(length=48)
    alone, alone_cache = greedy(llama, ids, press=make_press(), max_new_tokens=4)
    composed, composed_cache = greedy(llama, ids, press=ComposedPress([make_press()]), max_new_tokens=4)
    assert torch.equal(composed, alone)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(composed_cache.layers, alone_cache.layers))
    assert llama.generation_config.prefill_chunk_size is None  # restored
    press = make_press()
    with pytest.raises(ValueError, match=rf"{type(press).__name__}: prefill_chunk_size streams the prompt .* which "
                                         r"PrefillDecodingPress hands to its decoding_press"):
        greedy(llama, ids, press=PrefillDecodingPress(prefilling_press=press), max_new_tokens=1)


def test_speculative_decoding_rolls_back_the_position_count(llama):
    """Prompt-lookup decoding crops rejected draft tokens and feeds several tokens at once: the positions the cache
    stands for follow the crop, so nothing is refused, and a press that keeps every token gives the plain tokens."""
    ids = torch.cat([prompt(), prompt()], dim=1)  # a repeated prompt, so the lookup proposes drafts
    kwargs = dict(max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=3)
    with torch.no_grad():
        plain = llama.generate(ids, past_key_values=DynamicCache(), **kwargs)
        with ZSMergePress(budget=1000)(llama):
            pressed = llama.generate(ids, past_key_values=DynamicCache(), **kwargs)
    assert torch.equal(pressed, plain)


@pytest.mark.parametrize("make_cache", [DynamicCache, lambda: PagedKVCache(block_size=4)], ids=["dynamic", "paged"])
@pytest.mark.parametrize("make", [lambda: ZSMergePress(budget=1000), lambda: KeepKVPress(budget=1000),
                                  lambda: WeightedKVPress(cache_size=1000)], ids=["ZSMerge", "KeepKV", "WeightedKV"])
def test_rejected_draft_tokens_are_not_counted_as_compressed(llama, make, make_cache):
    """Prompt-lookup decoding under a budget the sequence never reaches: nothing is evicted (a slot per token), so
    the fraction removed is 0. The rejected drafts, cropped away, had stayed counted as seen: 0.04."""
    ids = torch.cat([prompt(), prompt()], dim=1)
    press, cache = make(), make_cache()
    with torch.no_grad(), press(llama):
        out = llama.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False,
                             prompt_lookup_num_tokens=3)
    assert cache.get_seq_length() == out.shape[1] - 1  # every token held, the last one not fed yet
    assert press.layer_compression_ratios == {layer: 0.0 for layer in range(len(cache.layers))}


def test_a_question_cropped_after_the_context_closed_leaves_the_compression_ratio(llama):
    """A question asked over the compressed context after the press's context closed, then cut with crop(-tokens):
    tokens the press never counted, which the cut must not take from its counts either."""
    press, cache = ZSMergePress(budget=16), DynamicCache()
    with torch.no_grad():
        with press(llama):
            llama(prompt(), past_key_values=cache)
        ratios = press.layer_compression_ratios
        llama(prompt(3, 5), past_key_values=cache, position_ids=torch.arange(PROMPT, PROMPT + 5).unsqueeze(0))
        cache.crop(-5)
    assert cache.get_seq_length() == 16
    assert press.layer_compression_ratios == ratios == {layer: 1 - 16 / PROMPT for layer in range(len(cache.layers))}


def test_a_press_used_on_another_model_before_reports_this_model_s_layers_only(llama):
    """A press reused on a one-layer model after the two-layer tiny Llama averaged the larger model's layer 1 into
    its compression_ratio."""
    small = make_tiny_llama(query_offset=0.0, num_hidden_layers=1)[0]
    press = ZSMergePress(budget=16)
    with torch.no_grad():
        with press(llama):
            llama(prompt(), past_key_values=DynamicCache())
        with press(small):
            small(prompt(length=30), past_key_values=DynamicCache())
    assert press.layer_compression_ratios == {0: 1 - 16 / 30}
    assert press.compression_ratio == pytest.approx(1 - 16 / 30)


@pytest.mark.parametrize("crop", [-2, 0], ids=["last two", "all or none"])
@pytest.mark.parametrize("make", [GVotePress, lambda: ZSMergePress(budget=16)], ids=["GVote", "ZSMerge"])
def test_a_crop_leaves_the_ratios_of_tokens_the_press_counted(llama, make, crop):
    """crop(-2) cuts two of the tokens fed after the prompt, which GVote (compressing the prompt only) never counted
    and ZSMerge has merged (refused); crop(0) empties the cache before transformers 5.17 (removes nothing from it
    on), whose last ratios stay readable until the next prefill. Neither changes the ratios the prompt left."""
    press, cache = make(), DynamicCache()
    with torch.no_grad(), press(llama):
        token = llama(prompt(), past_key_values=cache).logits[:, -1:].argmax(-1)
        for _ in range(4):
            token = llama(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        ratios = press.layer_compression_ratios
        assert any(ratio > 0 for ratio in ratios.values()), "the press must have compressed the prompt"
        if crop < 0 and isinstance(press, ZSMergePress):
            with pytest.raises(ValueError, match=r"ZSMergePress: crop\(-2\) asks"):
                cache.crop(crop)
        else:
            cache.crop(crop)
    assert press.layer_compression_ratios == ratios


@pytest.mark.parametrize("make_cache", [DynamicCache, lambda: PagedKVCache(block_size=4)], ids=["dynamic", "paged"])
@pytest.mark.parametrize("argument", ["tokens removed", "tokens kept"])
def test_a_crop_of_tokens_decoded_after_gvote_takes_them_back(llama, make_cache, argument):
    """GVote compresses the prompt only: each token decoded after it is a slot at the right end of every layer,
    narrowed or not, and a crop takes them back as from any cache (assisted generation's rejected candidates after
    its first round). The cache then holds what a run that never fed them holds, and the next token sees the same.
    Where GVote had narrowed a layer, the crop was refused."""
    decoded = prompt(seed=2, length=4)

    def run(fed: int, crop: int | None = None):
        cache = make_cache()
        with torch.no_grad(), GVotePress(nucleus_p=0.9)(llama):
            llama(prompt(), past_key_values=cache)
            for column in range(fed):
                llama(decoded[:, column:column + 1], past_key_values=cache)
            narrowed = [cache.get_seq_length(layer) < PROMPT + fed for layer in range(len(cache.layers))]
            if crop is not None:
                cache.crop(-crop if argument == "tokens removed" else PROMPT + fed - crop)
            logits = llama(decoded[:, -1:], past_key_values=cache).logits
        return cache, logits, narrowed

    cropped, cropped_logits, narrowed = run(4, crop=2)
    uncropped, logits, _ = run(2)
    assert any(narrowed), "the case needs a layer GVote narrowed"
    for layer, expected in zip(cropped.layers, uncropped.layers):
        torch.testing.assert_close(layer.keys, expected.keys, rtol=0, atol=0)
        torch.testing.assert_close(layer.values, expected.values, rtol=0, atol=0)
        torch.testing.assert_close(get_state(layer).log_weights, get_state(expected).log_weights, rtol=0, atol=0)
    torch.testing.assert_close(cropped_logits, logits, rtol=0, atol=0)


@pytest.mark.parametrize("make_cache", [DynamicCache, lambda: PagedKVCache(block_size=4)], ids=["dynamic", "paged"])
@pytest.mark.parametrize("make", [lambda: GVotePress(nucleus_p=0.9), lambda: ZSMergePress(budget=64),
                                  lambda: WeightedKVPress(cache_size=64), lambda: KeepKVPress(budget=64, recent=8)],
                         ids=["GVote", "ZSMerge under budget", "WeightedKV under budget", "KeepKV under budget"])
def test_a_crop_of_a_padded_batchs_tokens_held_one_to_a_slot_takes_them_back(llama, make_cache, make):
    """A left-padded batch, compressed row by row: a crop of the tokens decoded after the prompt, each still a slot of
    its own (GVote's decoding; a budget no row has reached), takes them back from every row. The rectangular cache
    refused the next pass ("its rows cannot follow the cut"); the paged one blamed tokens fed outside the press's
    context, which was never closed."""
    short, long = prompt(seed=3, length=PROMPT - 12), prompt(seed=4)
    batch = torch.cat([torch.nn.functional.pad(short, (12, 0)), long])
    mask = torch.cat([torch.nn.functional.pad(torch.ones_like(short), (12, 0)), torch.ones_like(long)])
    decoded = prompt(seed=2, length=8).view(2, 4)

    def run(fed: int, crop: int | None = None):
        cache = make_cache()
        with torch.no_grad(), make()(llama):
            llama(batch, attention_mask=mask, past_key_values=cache)
            for column in range(fed):
                llama(decoded[:, column:column + 1], past_key_values=cache,
                      attention_mask=torch.nn.functional.pad(mask, (0, column + 1), value=1))
            if crop is not None:
                cache.crop(-crop)
            attention_mask = torch.nn.functional.pad(mask, (0, fed - (crop or 0) + 1), value=1)
            return llama(decoded[:, -1:], past_key_values=cache, attention_mask=attention_mask).logits

    torch.testing.assert_close(run(4, crop=2), run(2), rtol=0, atol=0)


@pytest.mark.parametrize("make", [lambda: ZSMergePress(budget=16), lambda: WeightedKVPress(cache_size=20)],
                         ids=["ZSMerge", "WeightedKV"])
def test_the_ratios_are_the_last_prefilled_caches_while_another_one_steps_in_turn(llama, make):
    """A serving loop: two requests prefilled, then a decoding step of each in turn, under one press. The press
    counted every step into the counts of the last prefill (ZSMerge's 1 - 16/(30 + 8) for the first request's steps
    too). Its ratios are those of the cache it last prefilled, read off that cache's log-weights."""
    press, first, second = make(), DynamicCache(), DynamicCache()
    with torch.no_grad(), press(llama):
        tokens = [llama(prompt(1), past_key_values=first).logits[:, -1:].argmax(-1),
                  llama(prompt(2, 30), past_key_values=second).logits[:, -1:].argmax(-1)]
        for _ in range(4):
            tokens = [llama(token, past_key_values=cache).logits[:, -1:].argmax(-1)
                      for token, cache in zip(tokens, (first, second))]
    heads, seen = llama.config.num_key_value_heads, 30 + 4
    held = {layer: int(torch.isfinite(get_state(cache_layer).log_weights).sum())
            for layer, cache_layer in enumerate(second.layers)}
    assert press.layer_compression_ratios == pytest.approx({layer: 1 - count / (heads * seen)
                                                            for layer, count in held.items()}, abs=1e-12)


def test_a_forward_from_another_thread_while_one_runs_is_refused(llama):
    """Threads serving requests from one model under one open press context: the attention hands the press each
    layer's scores through the model's modules, and two forwards at once overwrote them for each other (1-3 of 24
    requests gave other tokens, silently, or a refusal blaming the model's queries). A forward starting while another
    thread's runs is refused, naming the press; the running one gives its tokens as alone, and once it is done (or
    failed) a forward from any thread runs."""
    press, held, resume, logits = ZSMergePress(budget=16), threading.Event(), threading.Event(), {}

    def hold_the_first_layer(module, args, output):
        if threading.current_thread() is not threading.main_thread():
            held.set()
            resume.wait(timeout=60)

    def forward(name: str, seed: int, grad: bool = False):
        try:
            with torch.set_grad_enabled(grad):
                logits[name] = llama(prompt(seed), past_key_values=DynamicCache()).logits
        except RuntimeError as error:
            logits[name] = error

    with press(llama):
        forward("alone", 1)
        hook = llama.model.layers[0].register_forward_hook(hold_the_first_layer)
        worker = threading.Thread(target=forward, args=("held", 1))
        worker.start()
        try:
            assert held.wait(timeout=60), "the worker's forward never reached the first layer"
            with pytest.raises(RuntimeError, match=r"ZSMergePress: a forward of LlamaModel started in thread \d+ "
                                                   r"while one of thread \d+ runs under the same `with press"):
                with torch.no_grad():
                    llama(prompt(2), past_key_values=DynamicCache())
        finally:
            resume.set()
            worker.join(timeout=60)
            hook.remove()
        failing = threading.Thread(target=forward, args=("failed", 1, True))  # refused by the press: gradients on
        failing.start()
        failing.join(timeout=60)
        forward("after", 1)
    assert isinstance(logits["failed"], RuntimeError) and "outside autograd" in str(logits["failed"])
    assert torch.equal(logits["held"], logits["alone"]) and torch.equal(logits["after"], logits["alone"])


def test_a_static_cache_is_refused_by_the_press(llama):
    cache = StaticCache(config=llama.config, max_cache_len=64)
    with pytest.raises(TypeError, match=r"ZSMergePress: needs a DynamicCache or a PagedKVCache, got a StaticLayer"), \
            torch.no_grad(), ZSMergePress(budget=16)(llama):
        llama.generate(prompt(), past_key_values=cache, max_new_tokens=2)


def test_a_static_cache_is_refused_before_any_layer_writes_it(llama):
    """The layers' hooks refused a static cache after the layer had written it, inside transformers 4.57's
    check_model_inputs, which runs the forward again after a TypeError: with a prompt over half the cache's length
    the second run overflowed it first, and kvpress's pipeline stopped on a bare IndexError from index_copy_."""
    ids = prompt()
    cache = StaticCache(config=llama.config, max_cache_len=ids.shape[1] + 4)
    with pytest.raises(TypeError, match=r"ZSMergePress: needs a DynamicCache or a PagedKVCache, got a StaticLayer"), \
            torch.no_grad(), ZSMergePress(budget=16)(llama):
        llama(ids, past_key_values=cache)
    assert all(layer.keys is None or not layer.keys.any() for layer in cache.layers)


class IdentityQuantizedLayer(QuantizedLayer):
    """A QuantizedLayer as quanto's and HQQ's are (keys and values held elsewhere, `keys` left empty), with the
    identity for a quantizer: neither backend is installed here."""

    def _quantize(self, tensor, axis):
        return tensor.clone()

    def _dequantize(self, quantized):
        return quantized


@pytest.mark.parametrize("press", [ZSMergePress(budget=16), GVotePress()], ids=["ZSMerge", "GVote"])
def test_a_quantized_cache_is_refused_by_the_press(llama, press):
    """QuantizedLayer subclasses DynamicLayer, so the cache check let it through, and the press stopped on a bare
    IndexError reading the empty `keys` of its layers."""
    cache = Cache(layers=[IdentityQuantizedLayer(residual_length=8) for _ in range(llama.config.num_hidden_layers)])
    with pytest.raises(TypeError, match=rf"{type(press).__name__}: needs a DynamicCache or a PagedKVCache, got an? "
                                        r"IdentityQuantizedLayer layer: quantized"), torch.no_grad(), press(llama):
        llama.generate(prompt(), past_key_values=cache, max_new_tokens=2)


def test_the_static_cache_generate_keeps_on_the_model_still_works_after_the_refusal():
    """generate(cache_implementation="static") keeps its cache on the model for the next call; refused after layer 0
    had written into it, the half-written cache broke every later static generate of the model, press or not
    (transformers 4.57 and 5.2: 'StaticLayer' object has no attribute 'max_batch_size')."""
    model = make_tiny_llama(query_offset=0.0)[0]
    with pytest.raises(TypeError, match=r"ZSMergePress: needs a DynamicCache or a PagedKVCache, got a Static"), \
            torch.no_grad(), ZSMergePress(budget=16)(model):
        model.generate(prompt(), cache_implementation="static", max_new_tokens=2, do_sample=False)
    with torch.no_grad():
        static = model.generate(prompt(), cache_implementation="static", max_new_tokens=4, do_sample=False)
        dynamic = model.generate(prompt(), past_key_values=DynamicCache(), max_new_tokens=4, do_sample=False)
    assert torch.equal(static, dynamic)


@pytest.mark.parametrize("same_object", [True, False])
def test_two_of_our_presses_on_one_model_are_refused(llama, same_object):
    first = ZSMergePress(budget=16)
    second = first if same_object else ZSMergePress(budget=16)
    with pytest.raises(ValueError, match=r"ZSMergePress: ZSMergePress is already active on this LlamaForCausalLM"):
        with first(llama), second(llama):
            pass
    with torch.no_grad(), first(llama):  # the refused context left nothing behind
        llama(prompt(), past_key_values=DynamicCache())


def test_one_press_object_on_two_models_at_once_is_refused():
    """A press object's open context lives on the press (the modules it marked active, the layers it compressed, the
    surrogate KVzap loaded for its model): entering it on a second model while it is active on a first must be refused,
    and must leave both models as they were: any press can then be entered on either (before the refusal, the inner
    context's exit cleared the outer model's marks' bookkeeping and left that model refusing every press for good)."""
    first, other = make_tiny_llama()[0], make_tiny_llama(seed=1)[0]  # not the module's model: a failure leaks marks
    press = ZSMergePress(budget=16)
    with pytest.raises(ValueError, match=r"ZSMergePress: this press object is already active on another model"):
        with press(first), press(other):
            pass
    for model in (first, other):
        assert all(not kvpress_cpp.attention.active_presses(module) for module in model.modules())
        for fresh in (press, ZSMergePress(budget=16)):
            with torch.no_grad(), fresh(model):
                model.generate(prompt(), past_key_values=DynamicCache(), max_new_tokens=2, do_sample=False)


def test_models_kvpress_cannot_hook_are_refused(llama):
    """A bare decoder, GPT-2, and a decoder without one rotary_emb for kvpress to hand every layer (Olmo3 under
    transformers 4 has one per layer type: kvpress's bare AttributeError came before)."""
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256))
    rotary_per_layer = make_tiny_llama()[0]
    del rotary_per_layer.model.rotary_emb
    for model in (llama.model, gpt2, rotary_per_layer):
        with pytest.raises(ValueError, match=rf"ZSMergePress: kvpress's hooks take a causal language model .* got "
                                             rf"{type(model).__name__}"):
            with ZSMergePress(budget=16)(model):
                pass


def test_a_forward_with_gradients_is_refused(llama):
    with pytest.raises(RuntimeError, match=r"WeightedKVPress: compresses the cache in place, outside autograd"), \
            WeightedKVPress(cache_size=24, recent=8)(llama):
        llama(prompt(), past_key_values=DynamicCache())


@pytest.mark.parametrize("make,message", [
    (lambda: ZSMergePress(decay=0.0), r"ZSMergePress: decay \(λ\) must be a number in \(0, 1\], got 0.0"),
    (lambda: ZSMergePress(residual_slots=1.5), "ZSMergePress: residual_slots must be an int ≥ 0, got 1.5"),
    (lambda: WeightedKVPress(sinks=float("nan")), "WeightedKVPress: sinks must be an int ≥ 0, got nan"),
    (lambda: WeightedKVPress(evict_only="no"), "WeightedKVPress: evict_only must be True or False, got 'no'"),
    (lambda: KeepKVPress(sinks=2.5), "KeepKVPress: sinks must be an int ≥ 0, got 2.5"),
    (lambda: KeepKVPress(convex="yes"), "KeepKVPress: convex must be True or False, got 'yes'"),
    (lambda: KVzapThresholdPress(threshold="-3"), r"KVzapThresholdPress: threshold \(τ\) must be a number"),
    (lambda: KVzapThresholdPress(compaction_slack=float("nan")), "compaction_slack must be an int ≥ 1, got nan"),
    (lambda: KVzapThresholdPress(sliding_window=1.5), "sliding_window must be an int ≥ 1, got 1.5"),
    # With no window a threshold could empty a layer, whose next pass then read as a new prompt's (counts reset,
    # positions from 0, a padded row refused as empty).
    (lambda: KVzapThresholdPress(sliding_window=0), "sliding_window must be an int ≥ 1, got 0"),
    (lambda: KVzapThresholdPress(model_type="tree"), "KVzapThresholdPress: model_type must be 'linear' or 'mlp'"),
    (lambda: KVzapPress(compression_ratio=1.5), r"KVzapPress: compression_ratio must be a number in \[0, 1\), got 1.5"),
    (lambda: ZSMergePress(budget=np.float64(0)), r"ZSMergePress: budget must be a token count ≥ 1 or a fraction"),
    (lambda: WeightedKVPress(cache_size=True), r"WeightedKVPress: cache_size must be a token count ≥ 1 or a fraction"),
])
def test_parameters_of_the_wrong_type_are_refused_where_given(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("press", [ZSMergePress(), KeepKVPress(), WeightedKVPress()],
                         ids=lambda press: type(press).__name__)
@pytest.mark.parametrize("budget", [1.5, 0.0, -3, True, "0.5"])
def test_a_budget_assigned_after_construction_is_refused_where_given(press, budget):
    """A sweep sets the budget on a built press: 1.5 had kept every token with compression_ratio -0.5, and 0.0 failed
    only inside generate, naming a budget of 1 slot."""
    with pytest.raises(ValueError, match=rf"{type(press).__name__}: {press.budget_field} must be a token count ≥ 1 or "
                                         rf"a fraction in \(0, 1\], got {budget!r}"):
        setattr(press, press.budget_field, budget)


@pytest.mark.parametrize("make,name,value,message", [
    (ZSMergePress, "eviction_order", "Paper", r"ZSMergePress: eviction_order must be 'authors' or 'paper', got 'Pa"),
    (ZSMergePress, "prefill_merge", "similarty", r"ZSMergePress: prefill_merge must be 'contiguous' or 'similarity'"),
    (lambda: ZSMergePress(budget=64), "budget", 0.5, r"ZSMergePress: prefill_chunk_size needs a budget in tokens"),
    (WeightedKVPress, "evict_only", "no", r"WeightedKVPress: evict_only must be True or False, got 'no'"),
    (KeepKVPress, "recent", -0.5, r"KeepKVPress: recent must be a token count ≥ 1 or a fraction of the budget"),
    (GVotePress, "num_samples", 0, r"GVotePress: num_samples must be an int in \[1, 65536\], got 0"),
    (GVotePress, "chunk_size", 2**64, r"GVotePress: chunk_size must fit int64 \(\[-2\^63, 2\^63 - 1\]\)"),
    (GVotePress, "seed", -2**63 - 1, r"GVotePress: seed must fit int64 \(\[-2\^63, 2\^63 - 1\]\), got -92233"),
    (GVotePress, "future_positions", 10**12, r"GVotePress: future_positions must be an int in \[1, 1048576\], got 1"),
    # each sample's attention is materialised: 2^62 overflowed torch's storage sizes
    (GVotePress, "num_samples", 2**62, r"GVotePress: num_samples must be an int in \[1, 65536\], got 4611686018427"),
    # passed to generate as an int64: "Overflow when unpacking long long"
    (lambda: ZSMergePress(budget=64), "prefill_chunk_size", 2**63,
     r"ZSMergePress: prefill_chunk_size must be None or an int in \[1, 2\^63 - 1\], got 9223372036854775808"),
    (lambda: WeightedKVPress(cache_size=64), "prefill_chunk_size", 10**30,
     r"WeightedKVPress: prefill_chunk_size must be None or an int in \[1, 2\^63 - 1\], got 10000"),
    (KVzapThresholdPress, "surrogate_dir", 1.5, r"KVzapThresholdPress: surrogate_dir must be a folder's path"),
], ids=lambda case: case if isinstance(case, str) and case.isidentifier() else None)
def test_a_parameter_assigned_after_construction_is_checked_and_left_as_it_was(make, name, value, message):
    """A sweep sets parameters on a built press; only the budget was checked there: eviction_order="Paper" ran as
    "authors", evict_only="no" as True, KeepKV's recent=-0.5 as 1 and GVote's num_samples=0 emptied every layer,
    silently. Each assignment is checked as the constructor checks it (with the other parameters: a fractional budget
    under prefill_chunk_size), and a refused one leaves the press as it was."""
    press = make()
    if name == "budget":
        press.prefill_chunk_size = 16
    before = copy.deepcopy(press)
    with pytest.raises(ValueError, match=message):
        setattr(press, name, value)
    assert press == before and getattr(press, name) == getattr(before, name)


@pytest.mark.parametrize("make,name,value", [
    (lambda surrogate: KeepKVPress(budget=16), "sinks", 8),  # took effect at once
    (lambda surrogate: KeepKVPress(budget=16), "recent", 2),  # ignored until the next prompt
    (lambda surrogate: ZSMergePress(budget=16), "recent_fraction", 0.5),  # ignored until the next prompt
    (lambda surrogate: WeightedKVPress(cache_size=16), "cache_size", 8),
    # ignored for good: the surrogate was loaded when the context opened
    (lambda surrogate: KVzapThresholdPress(threshold=0.0, sliding_window=8, surrogate_dir=surrogate), "model_type",
     "linear"),
], ids=["KeepKV-sinks", "KeepKV-recent", "ZSMerge-recent_fraction", "WeightedKV-cache_size", "KVzap-model_type"])
def test_a_parameter_changed_inside_the_context_is_refused(llama, tmp_path, make, name, value):
    """Parameters changed inside ``with press(model):`` took effect at once (KeepKV's sinks, failing in the op), at
    the next prompt (windows) or never (KVzap's surrogate): refused, naming the press and both values; the press
    takes them again once the context has closed."""
    press = make(write_surrogate(tmp_path / "mlp", llama, "mlp", scale=4.0))
    before = getattr(press, name)
    cache = DynamicCache()
    with torch.no_grad(), press(llama):
        llama(prompt(), past_key_values=cache)
        with pytest.raises(ValueError, match=rf"{type(press).__name__}: {name} cannot change from {before!r} to "
                                             rf"{value!r} while the press's context is open"):
            setattr(press, name, value)
        assert getattr(press, name) == before
    setattr(press, name, value)
    assert getattr(press, name) == value


@pytest.mark.parametrize("base", [KVCompPress, KVCompDecodingPress], ids=lambda base: base.__name__)
def test_the_base_classes_are_refused_as_presses(base):
    """Exported for subclassing, they ran as presses and stopped at the first prompt on a blank NotImplementedError."""
    with pytest.raises(TypeError, match=rf"{base.__name__} is a base class, with no compression of its own"):
        base()


@pytest.mark.parametrize("make", [ZSMergePress, WeightedKVPress, KeepKVPress], ids=lambda make: make.__name__)
def test_a_fraction_too_few_slots_for_a_short_prompt_is_told_to_be_a_token_count(llama, make):
    """A budget of 1.0 (compression_ratio 0) on a 2-token prompt was refused with "raise the budget", which a fraction
    cannot be raised past; the advice is now a count in tokens, and such a count keeps the prompt whole."""
    field = make.budget_field
    with pytest.raises(ValueError, match=rf"{make.__name__}: .*; give {field} in tokens \(1.0 of this 2-token prompt "
                                         r"is 2 slots; a count above the prompt's length keeps it whole\)"), \
            torch.no_grad(), make(**{field: 1.0})(llama):
        llama(prompt(length=2), past_key_values=DynamicCache())
    cache = DynamicCache()
    with torch.no_grad(), make(**{field: 16})(llama):
        llama.generate(prompt(length=2), past_key_values=cache, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert [layer.keys.shape[-2] for layer in cache.layers] == [16, 16]


REPLACE_ADVICE = r"\(dataclasses.replace\(press, ...\) sets it with the parameters it must fit\)"


@pytest.mark.parametrize("make,valid,field,value,fitting,message", [
    (ZSMergePress, {"budget": 8}, "budget", 2, {"residual_slots": 0},
     r"ZSMergePress: a budget of 2 slots leaves no context slot after 1 recent and 1 residual slots; raise budget "
     rf"{REPLACE_ADVICE} or lower recent_fraction"),
    (WeightedKVPress, {"cache_size": 16, "recent": 4}, "cache_size", 8, {"recent": 3},
     rf"WeightedKVPress: a cache of 8 slots has no middle region after 4 sinks and a recent window of 4; raise "
     rf"cache_size {REPLACE_ADVICE} or lower sinks / recent"),
    (KeepKVPress, {"budget": 16, "recent": 8}, "recent", 12, {"budget": 20},
     rf"KeepKVPress: a budget of 16 slots leaves no heavy hitter after 4 sinks and a recent window of 12; raise budget "
     rf"{REPLACE_ADVICE} or lower sinks / recent"),
], ids=["ZSMerge", "WeightedKV", "KeepKV"])
def test_a_token_count_without_room_is_refused_where_it_is_given(make, valid, field, value, fitting, message):
    """A budget in tokens splits alike for every prompt: ZSMergePress(budget=2) and the others were refused only inside
    the first forward. Constructed or assigned (a sweep), refused at once; a refused assignment changes nothing, and
    dataclasses.replace, which the message names, sets the parameters together."""
    with pytest.raises(ValueError, match=message):
        make(**{**valid, field: value})
    press = make(**valid)
    with pytest.raises(ValueError, match=message):
        setattr(press, field, value)
    assert getattr(press, field) == valid[field]
    replaced = dataclasses.replace(press, **{field: value, **fitting})  # with a parameter that makes room
    assert getattr(replaced, field) == value


def test_the_ends_of_the_int_ranges_are_taken():
    """-2^63 fits int64 (a seed was refused as not fitting it); GVote averages at most 2^20 future positions (10^12
    asked for 8 TB in the first forward, naming neither the press nor the parameter)."""
    assert GVotePress(seed=-2**63, future_positions=2**20).seed == -2**63
    with pytest.raises(ValueError, match=r"GVotePress: future_positions must be an int in \[1, 1048576\]"):
        GVotePress(future_positions=2**20 + 1)


def test_numpy_integers_are_taken_as_ints(llama):
    """GVotePress(seed=np.int64(5)) was accepted and failed inside generate (torch's generator takes a Python int),
    which transformers 4.57 retried as a forward that GVote then refused for a wrong reason ('layer 0 already held 40
    tokens'); KeepKV's recent=np.int64(32) was refused where its budget took numpy's integers."""
    press = GVotePress(seed=np.int64(5), sinks=np.int64(2))
    assert type(press.seed) is int and press == GVotePress(seed=5, sinks=2)
    assert type(KeepKVPress(recent=np.int64(8)).recent) is int
    caches = []
    for made in (press, GVotePress(seed=5, sinks=2)):
        caches.append(DynamicCache())
        with torch.no_grad(), made(llama):
            llama(prompt(), past_key_values=caches[-1])
    assert all(torch.equal(get_state(got).log_weights, get_state(want).log_weights)
               for got, want in zip(*(cache.layers for cache in caches)))


def test_a_type_error_inside_the_press_reaches_the_caller(llama, monkeypatch):
    """transformers 4.57 runs the decoder's forward again after a TypeError in it, and the press then refused that
    second run for tokens it 'did not compress' (GVotePress(seed=np.int64(5)) did this): the TypeError was lost. It
    reaches the caller now, as a RuntimeError naming the press and the layer."""
    def fail(*args, **kwargs):
        raise TypeError("an argument of the wrong type")

    monkeypatch.setattr(kvpress_cpp.presses.gvote.ops, "gvote_union_mask", fail)
    with pytest.raises(RuntimeError, match=r"GVotePress: layer 0: an argument of the wrong type"), torch.no_grad(), \
            GVotePress()(llama):
        llama.generate(prompt(), past_key_values=DynamicCache(), max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("make", [lambda: ZSMergePress(residual_slots=0), KeepKVPress, WeightedKVPress],
                         ids=["ZSMergePress", "KeepKVPress", "WeightedKVPress"])
def test_a_budget_assigned_after_construction_is_the_one_kept(llama, make):
    """The budget a sweep assigns is the one the press keeps in the model: 24 slots a layer and kv head after a prompt
    of PROMPT tokens, as a press built with it."""
    press = make()
    setattr(press, press.budget_field, np.int64(24))
    cache = DynamicCache()
    with torch.no_grad(), press(llama):
        llama(prompt(), past_key_values=cache)
    assert [cache.get_seq_length(layer) for layer in range(len(cache))] == [24] * len(cache)
    assert press.compression_ratio == pytest.approx(1 - 24 / PROMPT)


@pytest.mark.parametrize("fraction,count,slots", [
    (lambda: ZSMergePress(budget=0.3), lambda: ZSMergePress(budget=13), 13),
    (lambda: WeightedKVPress(cache_size=0.3), lambda: WeightedKVPress(cache_size=13), 13),
    (lambda: KeepKVPress(budget=0.3, recent=4), lambda: KeepKVPress(budget=13, recent=4), 13),
    (lambda: KeepKVPress(budget=24, recent=0.7), lambda: KeepKVPress(budget=24, recent=17), 24),
], ids=["ZSMerge", "WeightedKV", "KeepKV", "KeepKV-recent"])
def test_a_fraction_keeps_the_nearest_count(llama, fraction, count, slots):
    """As the README states: 0.3 of a 43-token prompt keeps 13 slots (12.9), and KeepKV's recent=0.7 of 24 is 17
    (16.8): the cache equals the one the press given those counts leaves (truncating would keep 12 and 16)."""
    caches = []
    for make in (fraction, count):
        cache = DynamicCache()
        with torch.no_grad(), make()(llama):
            llama(prompt(length=43), past_key_values=cache)
        caches.append(cache)
    assert caches[0].get_seq_length() == slots
    for got, want in zip(*(cache.layers for cache in caches)):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
        assert torch.equal(get_state(got).log_weights, get_state(want).log_weights)


@pytest.mark.parametrize("make,field,expected", [
    (lambda: ZSMergePress(budget=np.int64(16)), "budget", 16),
    (lambda: KeepKVPress(budget=np.int32(40)), "budget", 40),
    (lambda: WeightedKVPress(cache_size=np.float32(0.5)), "cache_size", 0.5),
])
def test_numpy_budgets_are_read_as_python_numbers(make, field, expected):
    """A budget from a numpy sweep (np.int64) was refused, though the other integer parameters take it; a count must
    stay an int, which the presses tell from a fraction by type."""
    value = getattr(make(), field)
    assert value == expected and type(value) is type(expected)


def test_gvote_on_a_prompt_no_longer_than_its_sinks(llama):
    """The statistics of the sampled queries leave the sinks out; a prompt of 4 tokens with 100 sinks keeps its last
    token for them instead of averaging nothing (NaN samples)."""
    cache = DynamicCache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on a variance over no tokens
        # (not transformers 5.24 on the past_key_values= below, which it renamed cache= and still accepts)
        warnings.filterwarnings("ignore", message=".*past_key_values.* is deprecated", category=FutureWarning)
        with torch.no_grad(), GVotePress(sinks=100)(llama):
            logits = llama(prompt(length=4), past_key_values=cache).logits
            logits = llama(torch.tensor([[5]]), past_key_values=cache).logits
    assert torch.isfinite(logits).all()


def test_a_paged_cache_on_an_eager_model_without_a_press(monkeypatch):
    """The cache wraps the eager attention of the loaded model files itself: the greedy tokens equal the model's on
    a DynamicCache (no press, nothing compressed)."""
    model = tiny("Llama", attn_implementation="eager")
    model_file = sys.modules[type(model).__module__]  # as no press has wrapped it (earlier tests may have)
    monkeypatch.setattr(model_file, "eager_attention_forward", inspect.unwrap(model_file.eager_attention_forward))
    monkeypatch.setattr(kvpress_cpp.attention, "_modules_scanned", 0)  # as in a process where no cache scanned yet
    with torch.no_grad():
        want = model.generate(prompt(), max_new_tokens=4, do_sample=False, past_key_values=DynamicCache())
        got = model.generate(prompt(), max_new_tokens=4, do_sample=False, past_key_values=PagedKVCache())
    assert torch.equal(got, want)

