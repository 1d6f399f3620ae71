"""bench_step_profile's decoding step as it replays it from a CUDA graph, where issue 20's "3x the full cache's tokens/s
at 32k" is measured: the full cache held with one free slot computes what a DynamicCache's step computes, and no
case's step waits on the device, which a capture would refuse (checked on the CPU with the sync recorder; the
replays themselves need a GPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from benchmarks.bench_decode import PRESSES, build_model, prompt_ids
from benchmarks.bench_step_profile import PreallocatedLayer, decoding_step
from tests.test_sync_free_decoding import RecordSyncs

PROMPT = 128


@pytest.fixture(scope="module")
def model():
    return build_model("random-llama-tiny", "cpu", torch.float32)[0]


def prompts(model) -> torch.Tensor:
    return prompt_ids(None, PROMPT, model.config.vocab_size, "cpu", batch=2)


def test_every_step_over_the_preallocated_full_cache_is_a_dynamic_cache_step(model):
    ids = prompts(model)
    with decoding_step(model, ids, None, graphs=True) as (step, cache):
        first, again = step(), step()
        assert all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
        assert cache.get_seq_length() == PROMPT
    with torch.inference_mode():
        reference = DynamicCache()
        token = model(ids, past_key_values=reference, use_cache=True).logits[:, -1:].argmax(-1)
        expected = model(token, past_key_values=reference, use_cache=True).logits
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(again, expected)  # a replay repeats the step at position T, over the same slots


def test_the_preallocated_layer_refuses_a_pass_of_several_tokens(model):
    with decoding_step(model, prompts(model), None, graphs=True) as (step, cache):
        with pytest.raises(ValueError, match="PreallocatedLayer holds one free slot: a decoding step of 2 tokens"):
            model(torch.tensor([[3, 4], [5, 6]]), past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("method", ["full", *PRESSES])
def test_the_step_replayed_from_a_graph_waits_on_nothing(model, method):
    press = None if method == "full" else PRESSES[method](0.25)
    ids = prompts(model)
    with RecordSyncs(recording=False) as syncs, decoding_step(model, ids, press, graphs=True) as (step, cache):
        step()  # the press's decoding layout, the shapes every later step keeps
        syncs.recording = True
        step()
    assert syncs.calls == [], f"{method}'s step syncs the host, which a CUDA graph capture refuses: {syncs.calls}"


@pytest.mark.parametrize("replayed_ms", [1e6, 1e-3])
def test_a_case_is_compared_at_its_faster_of_launched_and_replayed(model, monkeypatch, replayed_ms):
    """tok_s, which the press-over-full ratios read, comes from the faster of the launched and the replayed step: the
    full cache's replay ran 10x slower than its launched step on an H200, which would have flattered the presses."""
    from benchmarks import bench_step_profile

    monkeypatch.setattr(bench_step_profile, "replayed_step",
                        lambda step, cache, replays, device, top: (replayed_ms, []))
    row = bench_step_profile.profile_case(model, prompts(model), None, "cpu", steps=2, top=0, graphs=True, replays=1)
    assert row["graph_step_ms"] == round(replayed_ms, 3)
    assert row["best_step_ms"] == min(row["step_ms"], row["graph_step_ms"])
    assert row["tok_s"] == round(2 * 1e3 / row["best_step_ms"], 1)


def test_the_replayed_steps_operators_are_listed_beside_the_launched_ones(model, monkeypatch):
    """With --top and --graphs a row lists the replayed step's operators too (graph_top_ops), from the profile of the
    replays the capture made: the launched step's kernels need not be the replay's."""
    from benchmarks import bench_step_profile

    asked = []

    def replayed_step(step, cache, replays, device, top):
        asked.append(top)
        return 1.0, [{"op": "replayed_kernel", "ms": 0.5, "calls": 3}]

    monkeypatch.setattr(bench_step_profile, "replayed_step", replayed_step)
    row = bench_step_profile.profile_case(model, prompts(model), None, "cpu", steps=1, top=2, graphs=True, replays=1)
    assert asked == [2]
    assert row["graph_top_ops"] == [{"op": "replayed_kernel", "ms": 0.5, "calls": 3}]
    assert len(row["top_ops"]) == 2 and row["top_ops"] != row["graph_top_ops"]
