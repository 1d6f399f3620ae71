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


def test_step_ms_is_the_mean_of_the_timed_steps_and_tokens_per_second_count_the_batch(model, monkeypatch):
    """Every step on a clock that moves 7 ms a step: step_ms 7 (the warm-up and profiled steps not in it), the replayed
    step's 14 ms gives graph_tok_s = 2 prompts / 14 ms, tok_s = 2 prompts / 7 ms (the faster)."""
    import contextlib
    from types import SimpleNamespace

    from benchmarks import bench_step_profile

    clock = [0.0]
    real_decoding_step = bench_step_profile.decoding_step

    @contextlib.contextmanager
    def timed_decoding_step(*args, **kwargs):
        with real_decoding_step(*args, **kwargs) as (step, cache):
            def step_taking_7_ms():
                clock[0] += 0.007
                return step()
            yield step_taking_7_ms, cache

    monkeypatch.setattr(bench_step_profile, "decoding_step", timed_decoding_step)
    monkeypatch.setattr(bench_step_profile, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(bench_step_profile, "replayed_step", lambda step, cache, replays, device, top: (14.0, []))
    row = bench_step_profile.profile_case(model, prompts(model), None, "cpu", steps=4, top=0, graphs=True, replays=1)
    assert row["step_ms"] == pytest.approx(7.0)
    assert row["graph_tok_s"] == round(2 / 0.014, 1) and row["tok_s"] == round(2 / 0.007, 1)


def test_speedup_vs_full_is_the_press_tokens_per_second_over_the_full_caches(monkeypatch):
    import sys

    from benchmarks import bench_step_profile

    tok_s = {"full": 40.0, "KeepKV 10%": 100.0}
    written = {}
    monkeypatch.setattr(bench_step_profile, "profile_case", lambda model, ids, press, *args: {
        "tok_s": tok_s["full" if press is None else "KeepKV 10%"]})
    monkeypatch.setattr(bench_step_profile, "write_results", lambda name, rows: written.update(rows=rows))
    monkeypatch.setattr(sys, "argv", ["bench_step_profile", "--model", "random-llama-tiny", "--lengths", "16",
                                      "--methods", "KeepKV", "--top", "0"])
    bench_step_profile.main()
    speedups = {row["method"]: row["speedup_vs_full"] for row in written["rows"]}
    assert speedups == {"full": 1.0, "KeepKV 10%": 100.0 / 40.0}


def test_replayed_step_ms_is_the_timed_replays_over_their_count(monkeypatch):
    """replayed_step on a stand-in for torch.cuda whose graph replay takes 2 ms on the events' clock: the capture's
    warm-up and its first (untimed) replay aside, 5 replays timed between two events are 10 ms, 2 ms each."""
    import contextlib
    from types import SimpleNamespace

    from benchmarks import bench_step_profile

    clock, replays = [0.0], []

    class Graph:
        def replay(self):
            replays.append(None)
            clock[0] += 2.0

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            self.at = clock[0]

        def elapsed_time(self, end):
            return end.at - self.at

    stream = SimpleNamespace(wait_stream=lambda other: None)
    cuda = SimpleNamespace(Stream=lambda: stream, current_stream=lambda: stream,
                           stream=lambda s: contextlib.nullcontext(), CUDAGraph=Graph,
                           graph=lambda g: contextlib.nullcontext(), Event=Event, synchronize=lambda: None)
    monkeypatch.setattr(bench_step_profile, "torch", SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(bench_step_profile, "layer_tensors", lambda cache: [])
    milliseconds, ops = bench_step_profile.replayed_step(lambda: None, None, 5, "cuda", 0)
    assert len(replays) == 1 + 5 and ops == []
    assert milliseconds == pytest.approx(2.0)
