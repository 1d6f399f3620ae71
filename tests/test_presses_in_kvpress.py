"""Every press of kvpress_cpp inside kvpress's own machinery: the kv-press-text-generation pipeline (with
compression during its decoding, not only under `generate`) and equal-length batches."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, pipeline

from kvpress_cpp.presses.keepkv import KeepKVPress
from kvpress_cpp.presses.weightedkv import WeightedKVPress
from kvpress_cpp.presses.zsmerge import ZSMergePress
from tests.generation import greedy, prompt_ids
from tests.models import make_tiny_llama

# Presses that compress during decoding, each with a budget of 16 slots per layer and kv head.
DECODING_PRESSES = [
    pytest.param(lambda: ZSMergePress(budget=16), id="zsmerge"),
    pytest.param(lambda: WeightedKVPress(cache_size=16), id="weightedkv"),
    pytest.param(lambda: KeepKVPress(budget=16, recent=8), id="keepkv"),
]
CONTEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune " * 4


def count_decoding_calls(press):
    calls = []
    original = press.compress_decoding

    def counted(module, hidden_states, keys, values, attentions, state, kwargs):
        result = original(module, hidden_states, keys, values, attentions, state, kwargs)
        calls.append(result[0].shape[-2] if result is not None else keys.shape[-2])
        return result

    press.compress_decoding = counted
    return calls


@pytest.mark.parametrize("make_press", DECODING_PRESSES)
def test_pipeline_compresses_during_decoding(make_press):
    model, tokenizer = make_tiny_llama()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    press = make_press()
    slots_after_each_step = count_decoding_calls(press)
    cache = DynamicCache()
    pipe(CONTEXT, question="who is in want of a wife?", press=press, max_new_tokens=20, cache=cache)
    assert slots_after_each_step, "the press never ran during the pipeline's decoding"
    assert max(slots_after_each_step) <= 16
    assert all(layer.keys.shape[-2] <= 16 for layer in cache.layers)


@pytest.mark.parametrize("make_press", DECODING_PRESSES)
def test_batch_rows_are_compressed_independently(make_press):
    """A batch of two different prompts decodes as each prompt alone."""
    model, tokenizer = make_tiny_llama()
    ids = torch.cat([prompt_ids(tokenizer, 48), prompt_ids(tokenizer, 60)[:, 12:]], dim=0)
    together, _ = greedy(model, ids, press=make_press(), max_new_tokens=12)
    alone = torch.cat([greedy(model, row[None], press=make_press(), max_new_tokens=12)[0] for row in ids])
    assert torch.equal(together, alone)
