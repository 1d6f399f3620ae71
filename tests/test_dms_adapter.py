"""kvpress's DMSPress adapted by ``kvpress_cpp.kvpress_adapters``.

On a left-padded batch each row keeps what it keeps alone: scorers that relate tokens to each other (SnapKV's window
attention, ExpectedAttention's softmax over the keys) would otherwise score a short row together with its padding.
Per scorer, on the paged cache (which evicts DMSPress's marks for real) and on the rectangular one (where they stay
marks): the greedy tokens of every row and the token positions each (layer, kv head) keeps, or does not mark, equal
those of the row's prompt run alone. And ``compression_ratio`` on the paged cache is the fraction of slots it evicted,
as on the rectangular cache the fraction marked.
"""

from __future__ import annotations

import pytest
import torch
from kvpress import (AdaKVPress, ComposedPress, CriticalAdaKVPress, DMSPress, ExpectedAttentionPress, KnormPress,
                     SnapKVPress)
from transformers import DynamicCache

from kvpress_cpp.paged_cache import PagedKVCache
from kvpress_cpp.presses import KVzapPress
from tests import kvpress_hooks
from tests.models import make_tiny_llama
from tests.reference import gather_paged
from tests.test_kvzap_press import write_surrogate

pytestmark = kvpress_hooks.mark

NEW_TOKENS = 8
LENGTHS = (64, 37, 50)  # the rows' prompt lengths: the first is unpadded, the others left-padded

#: scorer name → DMSPress factory (surrogate dir). Thresholds evict part of every head; SnapKV and ExpectedAttention
#: score only prompts (their scores need more than one token), the others every decoding step too.
PRESSES = {
    "snapkv": lambda d: DMSPress(SnapKVPress(window_size=8), threshold=0.02, sliding_window_size=8),
    "expected-attention": lambda d: DMSPress(ExpectedAttentionPress(), threshold=0.02, sliding_window_size=8),
    "knorm": lambda d: DMSPress(KnormPress(), threshold=-4.0, sliding_window_size=8, decoding=True),
    "kvzap": lambda d: DMSPress(KVzapPress(surrogate_dir=d), threshold=0.0, sliding_window_size=8, decoding=True),
}


@pytest.fixture(scope="module")
def model_and_prompts(tmp_path_factory):
    model, tokenizer = make_tiny_llama()
    model.set_attn_implementation("sdpa")
    text = "The old lighthouse keeper had lived on the island for nearly forty years, and he never missed a night. "
    ids = tokenizer(text * 4, return_tensors="pt").input_ids[0]
    prompts = [ids[row * 3:row * 3 + length] for row, length in enumerate(LENGTHS)]  # different tokens per row
    surrogate = write_surrogate(tmp_path_factory.mktemp("surrogate") / "mlp", model, "mlp", seed=0, scale=4.0)
    return model, prompts, surrogate


def left_padded(prompts, shared_padding=0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of the prompts left-padded with 0 into one batch (every row by at least
    `shared_padding`)."""
    width = max(len(prompt) for prompt in prompts) + shared_padding
    input_ids = torch.stack([torch.nn.functional.pad(p, (width - len(p), 0)) for p in prompts])
    return input_ids, torch.stack([torch.arange(width) >= width - len(p) for p in prompts]).long()


def generate(model, press, prompts, cache, shared_padding=0):
    """Greedy tokens (B, NEW_TOKENS) of the prompts, left-padded with 0 into one batch (every row by at least
    `shared_padding`)."""
    input_ids, mask = left_padded(prompts, shared_padding)
    width = input_ids.shape[1]
    with torch.no_grad(), press(model):
        out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[:, width:]


def kept_positions(model, cache, row: int, padding: int) -> list[list[list[int]]]:
    """Per layer and kv head, the token positions (from the row's first real token) row `row` keeps: read from the
    paged cache's blocks, or, on a rectangular cache, every position DMSPress did not mark."""
    kept = []
    for layer, cached in zip(model.model.layers, cache.layers):
        if isinstance(cache, PagedKVCache):
            cached.flush()
            _, _, _, tables, lengths = (t.cpu() for t in cached.attention_inputs())
            positions = gather_paged(cached.slot_blocks["token_positions"].cpu(), tables, lengths, -1)[row]
            kept.append([(p[p >= 0] - padding).tolist() for p in positions])
            continue
        heads, width = cached.keys.shape[1], cached.keys.shape[2]
        position = torch.arange(width)
        held = (position >= padding).expand(heads, width).clone()
        marked = layer.self_attn.masked_key_indices
        if marked is not None:
            mine = marked[0] == row
            held[marked[1][mine], marked[2][mine]] = False
        kept.append([(position[head] - padding).tolist() for head in held])
    return kept


@pytest.mark.parametrize("shared_padding", [0, 5], ids=["first row unpadded", "every row padded"])
@pytest.mark.parametrize("cache_type", [PagedKVCache, DynamicCache])
@pytest.mark.parametrize("name", list(PRESSES))
def test_each_row_equals_its_run_alone(model_and_prompts, name, cache_type, shared_padding):
    """With every row padded, the paged cache holds no column of the padding all rows share: the scorer was handed
    each row's keys that many columns too far on (SnapKV then scored other tokens than the row's own)."""
    model, prompts, surrogate = model_and_prompts
    cache = cache_type()
    tokens = generate(model, PRESSES[name](surrogate), prompts, cache, shared_padding)
    # Read before the runs alone, which replace the marks on the attention modules.
    paddings = [max(LENGTHS) + shared_padding - len(prompt) for prompt in prompts]
    kept = [kept_positions(model, cache, row, padding) for row, padding in enumerate(paddings)]
    for layer in model.model.layers:  # no mark on padding (kept_positions does not see those): they count as evicted
        marked = layer.self_attn.masked_key_indices
        if marked is not None:
            assert bool((marked[2] >= torch.tensor(paddings)[marked[0]]).all()), "DMSPress marked padding"
    evicted = False
    for row, (prompt, batch_kept) in enumerate(zip(prompts, kept)):
        alone_cache = cache_type()
        alone_tokens = generate(model, PRESSES[name](surrogate), [prompt], alone_cache)
        assert tokens[row].tolist() == alone_tokens[0].tolist(), f"row {row}"
        assert batch_kept == kept_positions(model, alone_cache, 0, 0), f"row {row}"
        fed = len(prompt) + NEW_TOKENS - 1
        evicted = evicted or any(len(head) < fed for layer in batch_kept for head in layer)
    assert evicted, "the press evicts nothing"


def test_right_padding_is_refused(model_and_prompts):
    model, prompts, surrogate = model_and_prompts
    width = max(LENGTHS)
    input_ids = torch.stack([torch.nn.functional.pad(p, (0, width - len(p))) for p in prompts])
    mask = torch.stack([torch.arange(width) < len(p) for p in prompts]).long()
    with pytest.raises(ValueError, match="DMSPress: only left padding is supported"):
        with torch.no_grad(), PRESSES["knorm"](surrogate)(model):
            model(input_ids, attention_mask=mask, past_key_values=PagedKVCache())


def test_a_row_of_padding_only_is_refused_naming_it(model_and_prompts):
    model, prompts, surrogate = model_and_prompts
    input_ids = torch.stack([prompts[0], torch.zeros_like(prompts[0])])
    mask = torch.stack([torch.ones_like(prompts[0]), torch.zeros_like(prompts[0])])
    with pytest.raises(ValueError, match=r"DMSPress: batch rows \[1\] hold padding only \(an empty prompt\)"):
        with torch.no_grad(), PRESSES["knorm"](surrogate)(model):
            model(input_ids, attention_mask=mask, past_key_values=DynamicCache())


@pytest.mark.parametrize("rows", [1, 3], ids=["one row", "left-padded batch"])
def test_compression_ratio_is_the_fraction_evicted(model_and_prompts, rows):
    """The ratio DMSPress reports equals the fraction of the tokens fed that the paged cache evicted, as on the
    rectangular cache (where the marks stay). A padded batch's padding is no token: it counted in the batch's width
    once, and the ratio read 0.33 for 0.42 of the tokens removed."""
    model, prompts, surrogate = model_and_prompts
    ratios, paged = {}, None
    for cache_type in (PagedKVCache, DynamicCache):
        press, cache = PRESSES["kvzap"](surrogate), cache_type()
        generate(model, press, prompts[:rows], cache)
        ratios[cache_type], paged = dict(press.compression_ratios), paged or cache
    fed = sum(LENGTHS[:rows]) + rows * (NEW_TOKENS - 1)  # each row's tokens; the last generated one is not cached
    evicted = {}
    for layer_idx, layer in enumerate(paged.layers):
        layer.flush()  # evicts the last pass's marks
        evicted[layer_idx] = 1 - int(layer.lengths.sum()) / (layer.lengths.shape[1] * fed)
    assert 0 < min(evicted.values())
    assert ratios[PagedKVCache] == pytest.approx(evicted, abs=1e-9)
    assert ratios[DynamicCache] == pytest.approx(evicted, abs=1e-9)


@pytest.mark.parametrize("cache_type", [DynamicCache, PagedKVCache])
@pytest.mark.parametrize("decoding", [False, True], ids=["prefill only", "decoding"])
def test_repeated_rows_leave_the_ratio_and_a_prefill_only_ratio_is_the_prompts(model_and_prompts, cache_type,
                                                                                decoding):
    """Rows repeated for num_return_sequences are the same sequences (marks and padding both repeated): the ratio is
    that of the batch decoded unrepeated. Without decoding, DMSPress marks the prompt only, so its ratio stays the
    prompt's: decoding steps add no mark to count and no token to count them against."""
    model, prompts, surrogate = model_and_prompts
    input_ids, prompt_mask = left_padded(prompts)
    width = input_ids.shape[1]

    def ratios(repeats: int) -> tuple[dict, dict]:
        """The ratios after the prompt and after three steps, the rows repeated `repeats` times after the prompt."""
        press = DMSPress(KVzapPress(surrogate_dir=surrogate), threshold=0.0, sliding_window_size=4, decoding=decoding)
        cache, mask = cache_type(), prompt_mask
        with torch.no_grad(), press(model):
            token = model(input_ids, attention_mask=mask, past_key_values=cache).logits[:, -1:].argmax(-1)
            after_prompt = dict(press.compression_ratios)
            cache.batch_repeat_interleave(repeats)
            token, mask = token.repeat_interleave(repeats, 0), mask.repeat_interleave(repeats, 0)
            for position in range(width, width + 3):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                token = model(token, attention_mask=mask, past_key_values=cache,
                              cache_position=torch.tensor([position])).logits[:, -1:].argmax(-1)
        return after_prompt, dict(press.compression_ratios)

    after_prompt, unrepeated = ratios(1)
    assert 0 < min(after_prompt.values())
    assert ratios(2)[1] == pytest.approx(unrepeated, abs=1e-9)
    if not decoding:
        assert unrepeated == pytest.approx(after_prompt, abs=1e-9)


def test_a_decoding_dms_press_refuses_a_pass_after_a_cut_of_one_token(model_and_prompts):
    """Cut back by a single token (a rejected candidate), the next pass starts at the last position DMSPress scored:
    its buffer still holds that token's score, so the pass is refused as after a longer cut."""
    model, prompts, surrogate = model_and_prompts
    press = DMSPress(KVzapPress(surrogate_dir=surrogate), threshold=-3.0, sliding_window_size=8, decoding=True)
    cache = PagedKVCache()
    with torch.no_grad(), press(model):
        token = model(prompts[0][:32].unsqueeze(0), past_key_values=cache).logits[:, -1:].argmax(-1)
        model(token, past_key_values=cache)  # scores position 32
        cache.crop(-1)  # position 32 cut
        with pytest.raises(ValueError, match=r"a pass from position 32 on layer 0, which it has scored up to "
                                             r"position 32: the cache was cut back"):
            model(token, past_key_values=cache)


#: Head-wise kvpress presses that keep their decisions outside the cache: marks on the module (all three) and a score
#: buffer per layer (DMSPress with decoding=True).
REARRANGED_PRESSES = {
    "dms-kvzap decoding": lambda d: DMSPress(KVzapPress(surrogate_dir=d), threshold=0.0, sliding_window_size=4,
                                             decoding=True),
    "dms-kvzap prefill": lambda d: DMSPress(KVzapPress(surrogate_dir=d), threshold=0.0, sliding_window_size=4),
    "adakv-snapkv": lambda d: AdaKVPress(SnapKVPress(compression_ratio=0.5, window_size=8)),
    # two presses marking one layer: the decoding one's buffer follows too
    "two dms decoding": lambda d: ComposedPress([
        DMSPress(KnormPress(), threshold=-4.0, sliding_window_size=6, decoding=True),
        DMSPress(KVzapPress(surrogate_dir=d), threshold=0.0, sliding_window_size=4, decoding=True)]),
}
#: A batch rearrangement on two rows of different prompts, and the prompt rows (of those two) the batch it leaves holds.
REARRANGEMENTS = {
    "reorder_cache (beam search)": (lambda cache: cache.reorder_cache(torch.tensor([1, 0])), [1, 0]),
    "batch_repeat_interleave (num_return_sequences)": (lambda cache: cache.batch_repeat_interleave(2), [0, 0, 1, 1]),
    "batch_select_indices": (lambda cache: cache.batch_select_indices(torch.tensor([1])), [1]),
}


def decode(model, press, input_ids, cache_type, rearrangement=None, decoded_before=0) -> list[torch.Tensor]:
    """Logits (B, V) of 10 greedy steps after the prompt, the batch rearranged (a (rearrange, rows kept) pair as in
    REARRANGEMENTS) after `decoded_before` of them."""
    cache, steps = cache_type(), []
    with torch.no_grad(), press(model):
        token = model(input_ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        for step, position in enumerate(range(input_ids.shape[1], input_ids.shape[1] + 10)):
            if rearrangement is not None and step == decoded_before:
                rearrange, kept = rearrangement
                rearrange(cache)
                token = token[kept]
            logits = model(token, past_key_values=cache, cache_position=torch.tensor([position]),
                           position_ids=torch.full((token.shape[0], 1), position)).logits[:, -1]
            steps.append(logits)
            token = logits.argmax(-1, keepdim=True)
    return steps


@pytest.mark.parametrize("decoded_before", [0, 3])
@pytest.mark.parametrize("cache_type", [DynamicCache, PagedKVCache])
@pytest.mark.parametrize("rearrangement", list(REARRANGEMENTS))
@pytest.mark.parametrize("name", list(REARRANGED_PRESSES))
def test_a_rearranged_batch_decodes_as_that_batch_from_the_start(model_and_prompts, name, rearrangement, cache_type,
                                                                  decoded_before):
    """kvpress keeps a head-wise press's marks on the attention module and DMSPress's recent scores on the press;
    a cache rearranging its rows (beam search, num_return_sequences) left both behind, so rows were masked with
    another sequence's marks, or none (beam scores that no sequence's forced scoring gave). Rearranged after some
    decoding steps too, as beam search does at every step: each pass over a layer must take them along once."""
    model, prompts, surrogate = model_and_prompts
    rows = torch.stack([prompts[0][:36], prompts[2][:36]])
    kept = REARRANGEMENTS[rearrangement][1]
    rearranged = decode(model, REARRANGED_PRESSES[name](surrogate), rows, cache_type, REARRANGEMENTS[rearrangement],
                        decoded_before)
    alone = decode(model, REARRANGED_PRESSES[name](surrogate), rows[kept], cache_type)
    torch.testing.assert_close(torch.stack(rearranged[decoded_before:], 1), torch.stack(alone[decoded_before:], 1),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_type", [DynamicCache, PagedKVCache])
def test_critical_adakv_marks_follow_repeated_rows(model_and_prompts, cache_type):
    """CriticalAdaKVPress marks the prompt's columns as AdaKVPress does, through its own compress. kvpress's
    CriticalAdaKVPress fails on a batch of several prompts, so one prompt's rows are repeated (num_return_sequences):
    each copy decodes as the prompt alone, none unmasked."""
    model, prompts, _ = model_and_prompts
    press = lambda: CriticalAdaKVPress(KnormPress(compression_ratio=0.5))  # noqa: E731
    row = prompts[0][None, :36]
    repeated = decode(model, press(), row, cache_type, (lambda cache: cache.batch_repeat_interleave(2), [0, 0]))
    alone = decode(model, press(), row, cache_type)
    torch.testing.assert_close(torch.stack(repeated, 1), torch.stack(alone, 1).expand(2, -1, -1), atol=1e-4,
                               rtol=1e-4)


def test_a_rearranged_cache_leaves_the_marks_of_a_later_cache_and_a_saved_one_rearranges(model_and_prompts, tmp_path):
    """The marks live on the module, the scores on the press: an earlier cache rearranged after a later one's prefill
    leaves the later cache's marks as they are; a cache saved and loaded (its references to the module and the press
    saved as None) rearranges its own rows and nothing else."""
    model, prompts, surrogate = model_and_prompts
    press = DMSPress(KVzapPress(surrogate_dir=surrogate), threshold=0.0, sliding_window_size=4, decoding=True)
    rows = torch.stack([prompts[0][:36], prompts[2][:36]])
    earlier, later = DynamicCache(), DynamicCache()
    with torch.no_grad(), press(model):
        model(rows, past_key_values=earlier)
        model(rows, past_key_values=later)
        modules = [layer.self_attn for layer in model.model.layers]
        marks = [tuple(t.clone() for t in module.masked_key_indices) for module in modules]
        buffers = {layer: buffer.clone() for layer, buffer in press.scores_buffer.items()}
        earlier.batch_select_indices(torch.tensor([1]))
        assert all(torch.equal(a, b) for module, kept in zip(modules, marks)
                   for a, b in zip(module.masked_key_indices, kept))
        assert all(torch.equal(press.scores_buffer[layer], buffer) for layer, buffer in buffers.items())
        torch.save(later, tmp_path / "cache.pt")
        loaded = torch.load(tmp_path / "cache.pt", weights_only=False)
        loaded.reorder_cache(torch.tensor([1, 0]))
        assert torch.equal(loaded.layers[0].keys, later.layers[0].keys[[1, 0]])
        assert all(torch.equal(press.scores_buffer[layer], buffer) for layer, buffer in buffers.items())
