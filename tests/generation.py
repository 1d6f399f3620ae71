"""Shared helpers of the end-to-end tests: prompts for the tiny models and greedy generation under a press."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from transformers import DynamicCache

from kvpress_cpp.presses.streaming import CHUNKED_PREFILL_REPEATS_LAST_POSITIONS
from kvpress_cpp.tasks import HiddenFact, hidden_fact_prompt
from tests.models import make_tiny_llama, make_tiny_qwen3

# (model factory, attention implementation): every attention path the log-weights must go through.
TINY_MODELS = [
    pytest.param(make_tiny_llama, "eager", id="llama-eager"),
    pytest.param(make_tiny_llama, "sdpa", id="llama-sdpa"),
    pytest.param(make_tiny_qwen3, "sdpa", id="qwen3-sdpa"),
    pytest.param(make_tiny_qwen3, "eager", id="qwen3-eager"),
]


#: Tests of generate(prefill_chunk_size=...) run where transformers' chunked prefill gives each chunk its positions
#: (tests/test_zsmerge_press.py checks the flag, and the refusal, where it does not).
needs_chunked_prefill = pytest.mark.skipif(CHUNKED_PREFILL_REPEATS_LAST_POSITIONS, reason=(
    "this transformers' chunked prefill gives every chunk the last chunk's positions"))


def prompt_ids(tokenizer, length: int, batch: int = 1) -> torch.Tensor:
    """`length` tokens of English prose, repeated over `batch` rows."""
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune " * 80
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :length]
    assert ids.shape[1] == length
    return ids.repeat(batch, 1)


def greedy(model, input_ids, press=None, max_new_tokens=24, cache=None, **kwargs):
    """Exactly max_new_tokens greedy tokens (B, max_new_tokens) and the cache they leave (a new DynamicCache unless
    `cache` is given)."""
    cache = cache if cache is not None else DynamicCache()
    with torch.no_grad(), press(model) if press is not None else nullcontext():
        out = model.generate(input_ids, past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, **kwargs)
    return out[:, input_ids.shape[1]:], cache


def feed_in_passes(model, input_ids, sizes, press=None, cache=None):
    """Forward `input_ids` (1, T) in passes of `sizes` tokens (summing to T), as kvpress's question pass or a chunked
    prefill feeds several tokens after the first pass, under `press` (None: uncompressed); returns the cache."""
    cache = cache if cache is not None else DynamicCache()
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    assert starts[-1] == input_ids.shape[1], (sizes, input_ids.shape)
    with torch.no_grad(), press(model) if press is not None else nullcontext():
        for start, end in zip(starts, starts[1:]):
            model(input_ids[:, start:end], past_key_values=cache, use_cache=True,
                  position_ids=torch.arange(start, end).view(1, -1), cache_position=torch.arange(start, end))
    return cache


def answers_hidden_fact(model, tokenizer, press, context_tokens: int = 3000) -> tuple[bool, str]:
    """Whether the model, under `press`, answers the demo's hidden-fact question (and what it said)."""
    fact = HiddenFact()
    inputs = tokenizer(hidden_fact_prompt(tokenizer, context_tokens, 0.5, fact), return_tensors="pt")
    cache = DynamicCache()
    with torch.no_grad(), press(model) if press is not None else nullcontext():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)
    return fact.answer in answer, answer
