"""The arithmetic behind the figures the benchmarks report (bandwidth fractions, speedups, tokens/s, ratios), on the CPU
and without timing anything: each benchmark's timer is replaced by given seconds, and its figures are checked against
the bytes, times and ratios written out here by hand."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch


def scripted(values):
    """A stand-in for median_seconds returning `values` in turn (the timed callables are not run)."""
    values = iter(values)
    return lambda *args, **kwargs: next(values)


class CpuTorch:
    """torch with every device="cuda" argument turned into "cpu": a GPU-only benchmark's bookkeeping run here."""

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if not callable(attr) or isinstance(attr, type):
            return attr

        def call(*args, **kwargs):
            if kwargs.get("device") == "cuda":
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        return call


def test_copy_bandwidth_counts_the_bytes_read_and_written(monkeypatch):
    from benchmarks import common

    monkeypatch.setattr(common, "median_seconds", scripted([2e-6]))
    # 4096 bytes read and 4096 written in 2 µs: 4.096 GB/s
    assert common.copy_bandwidth_gbs("cpu", nbytes=4096) == pytest.approx(2 * 4096 / 2e-6 / 1e9)


def test_median_seconds_reports_the_median(monkeypatch):
    from benchmarks import common

    class Timer:
        def __init__(self, **kwargs):
            pass

        def blocked_autorange(self, min_run_time):
            return SimpleNamespace(median=1.0, mean=5.0)  # one slow block: the mean is pulled up, the median not

    monkeypatch.setattr(common.tbench, "Timer", Timer)
    assert common.median_seconds(lambda: None) == 1.0


def test_decode_attention_row_on_the_gpu_path_counts_its_bytes_by_hand(monkeypatch):
    """bench_attention's GPU row at B = 2, Hq = 4, H = 2, d = 8, T = 32 in bfloat16: the op reads keys and values
    (2 x 2 x 2 x 32 x 8 x 2 bytes), the float32 log-weights (2 x 2 x 32 x 4), the query and writes the output
    (2 x 2 x 4 x 8 x 2), and writes the float32 probabilities (2 x 4 x 32 x 4): 5888 bytes."""
    from benchmarks import bench_attention

    batch, query_heads, kv_heads, head_dim, length = 2, 4, 2, 8, 32
    moved = (2 * batch * kv_heads * length * head_dim * 2 + batch * kv_heads * length * 4
             + 2 * batch * query_heads * head_dim * 2 + batch * query_heads * length * 4)
    assert moved == 5888
    make_inputs = bench_attention.make_inputs
    monkeypatch.setattr(bench_attention, "make_inputs", lambda *args: make_inputs(*args[:-1], "cpu"))
    monkeypatch.setattr(bench_attention, "configurations", lambda: [("cuda", 1)])
    monkeypatch.setattr(bench_attention, "CUDA_SHAPES", [(batch, query_heads, kv_heads, head_dim)])
    monkeypatch.setattr(bench_attention, "CUDA_LENGTHS", [length])
    copy_gbs = 4.0
    monkeypatch.setattr(bench_attention, "copy_bandwidth_gbs", lambda device: copy_gbs)
    op, sdpa, eager, gqa, split_k, tensor_cores = 4e-6, 10e-6, 30e-6, 6e-6, 5e-6, 3.2e-6
    monkeypatch.setattr(bench_attention, "median_seconds", scripted([op, sdpa, eager, gqa, split_k, tensor_cores]))
    written = {}
    monkeypatch.setattr(bench_attention, "write_results", lambda name, rows: written.update(rows=rows))
    monkeypatch.setattr(bench_attention, "plot", lambda rows: None)
    monkeypatch.setattr(sys, "argv", ["bench_attention"])
    bench_attention.main()
    (row,) = written["rows"]
    assert row["op_us"] == 4.0 and (row["split_k_us"], row["tensor_cores_us"]) == (5.0, 3.2)
    assert row["speedup_vs_sdpa"] == 2.5 and row["speedup_vs_eager"] == 7.5 and row["speedup_vs_sdpa_gqa"] == 1.5
    assert row["op_GBps"] == round(moved / op / 1e9, 1)
    assert row["fraction_of_copy_bw"] == round(moved / op / 1e9 / copy_gbs, 2)
    assert row["routing_cost"] == round(4.0 / 3.2, 2)  # the routed call over the faster of the two kernels


def test_decode_tokens_per_second_count_the_steps_after_the_first_token(monkeypatch):
    """generate(): 5 new tokens, the prompt's forward taking 0.5 s and each of the 4 decoding forwards after it 0.1 s:
    4 tokens in 0.4 s, 10 tokens/s; the prefill 0.5 s."""
    from benchmarks import bench_decode

    model = bench_decode.build_model("random-llama-tiny", "cpu", torch.float32)[0]
    calls = []

    def clock():  # generate reads it once before the prompt's forward, then once after every forward
        calls.append(None)
        return 0.0 if len(calls) == 1 else 0.5 + 0.1 * (len(calls) - 2)

    monkeypatch.setattr(bench_decode, "time", SimpleNamespace(perf_counter=clock))
    ids = bench_decode.prompt_ids(None, 16, model.config.vocab_size, "cpu")
    result, generated = bench_decode.generate(model, ids, None, 5, "cpu", 0)
    assert len(calls) == 1 + 5 and len(generated) == 5
    assert result["prefill_s"] == pytest.approx(0.5) and result["decode_tok_s"] == pytest.approx(4 / 0.4)


def test_decode_rows_keep_the_best_repeat_and_compare_with_the_full_cache(monkeypatch):
    """bench_decode's table: each case's tokens/s is the best of its repeats, prefill the shortest, and
    decode_speedup_vs_full the case's tokens/s over the full cache's at the same prompt."""
    from benchmarks import bench_decode

    figures = {None: [(0.30, 8.0), (0.20, 10.0)], "KeepKV": [(0.50, 25.0), (0.40, 20.0)]}  # (prefill_s, tok/s)
    bytes_held = {None: 4000, "KeepKV": 1000}
    seen = {}

    def generate(model, ids, press, new_tokens, device, pad_token_id):
        key = None if press is None else type(press).__name__.removesuffix("Press")
        if new_tokens != 6:  # the warm-up
            return {"prefill_s": 9.0, "decode_tok_s": 0.1, "peak_kv_bytes": 1, "max_slots": 1, "generated": 4}, [0]
        index = seen[key] = seen.get(key, -1) + 1
        prefill_s, tok_s = figures[key][index]
        return {"prefill_s": prefill_s, "decode_tok_s": tok_s, "peak_kv_bytes": bytes_held[key], "max_slots": 8,
                "generated": 6}, [1, 2, 3, 4, 5, 6]

    written = {}
    monkeypatch.setattr(bench_decode, "generate", generate)
    monkeypatch.setattr(bench_decode, "write_results", lambda name, rows: written.update(rows=rows))
    monkeypatch.setattr(bench_decode, "plot", lambda *args: None)
    monkeypatch.setattr(sys, "argv", ["bench_decode", "--model", "random-llama-tiny", "--lengths", "32", "--budgets",
                                      "0.5", "--methods", "KeepKV", "--repeats", "2", "--new-tokens", "6"])
    bench_decode.main()
    rows = {row["method"]: row for row in written["rows"]}
    assert set(rows) == {"full", "KeepKV 50%"}
    assert (rows["full"]["decode_tok_s"], rows["full"]["prefill_s"]) == (10.0, 0.2)
    assert (rows["KeepKV 50%"]["decode_tok_s"], rows["KeepKV 50%"]["prefill_s"]) == (25.0, 0.4)
    assert rows["KeepKV 50%"]["decode_speedup_vs_full"] == 2.5 and rows["full"]["decode_speedup_vs_full"] == 1.0
    assert rows["KeepKV 50%"]["kv_fraction_of_full"] == 0.25


def test_paired_ratio_is_the_median_of_each_rounds_step_over_the_references():
    from benchmarks.bench_paged import paired_ratio

    # rounds: 2 / 1, 3 / 1, 10 / 4 -> 2, 3, 2.5
    assert paired_ratio([2.0, 3.0, 10.0], [1.0, 1.0, 4.0]) == 2.5


def test_paged_decode_step_is_timed_up_to_its_write_back(monkeypatch):
    """bench_paged's decode step on a PagedKVCache under KeepKV: every layer stores what the press wrote to it (which
    generate pays at the next step) between the step's two clock reads, not after them."""
    from benchmarks import bench_paged
    from kvpress_cpp.paged_cache import PagedKVCache, PagedLayer
    from kvpress_cpp.presses import KeepKVPress
    from tests.models import make_tiny_llama

    model, _ = make_tiny_llama(num_hidden_layers=3)
    cache, press = PagedKVCache(), KeepKVPress(budget=8, recent=2)
    with torch.no_grad(), press(model):
        token = model(torch.arange(5, 25)[None], past_key_values=cache).logits[:, -1:].argmax(-1)
    clock_reads, write_backs = [], []
    monkeypatch.setattr(bench_paged, "time", SimpleNamespace(perf_counter=lambda: clock_reads.append(0) or 0.0))
    write_back = PagedLayer._write_back
    monkeypatch.setattr(PagedLayer, "_write_back",
                        lambda layer, *args: write_backs.append(len(clock_reads)) or write_back(layer, *args))
    with torch.no_grad(), press(model):
        next_token, seconds = bench_paged.timed_step(model, token, cache)
    assert next_token.shape == (1, 1) and seconds == 0.0
    # The step's own write-backs, one a layer, all after the first clock read and before the second.
    assert write_backs[:3] == [1, 1, 1] and len(clock_reads) == 2


def test_paged_kernel_row_counts_the_blocks_it_reads_by_hand(monkeypatch):
    """bench_paged's kernel row at B = 2, H = 2, T = 32, d = 8, blocks of 16, bfloat16: the kernel reads 8 key blocks
    and 8 value blocks of 16 x 8 x 2 bytes and their 8 float32 log-weight blocks of 16 x 4: 4608 bytes, in the time
    of the call as PagedKVCache makes it (max_len given), not the host-checked one."""
    from benchmarks import bench_paged

    batch, kv_heads, length, head_dim, block = 2, 2, 32, 8, 16
    blocks = batch * kv_heads * length // block
    read = 2 * blocks * block * head_dim * 2 + blocks * block * 4
    assert read == 4608
    paged, host_checked, rectangular, copy_gbs = 1e-6, 3e-6, 2e-6, 8.0
    monkeypatch.setattr(bench_paged, "torch", CpuTorch())
    monkeypatch.setattr(bench_paged, "median_seconds", scripted([paged, host_checked, rectangular]))
    monkeypatch.setattr(bench_paged, "copy_bandwidth_gbs", lambda device: copy_gbs)
    rows = bench_paged.kernel_rows(lengths=(length,), batch=batch, kv_heads=kv_heads, group=2, head_dim=head_dim,
                                   block_size=block)
    row = next(r for r in rows if "peer" not in r)
    assert (row["paged_us"], row["paged_host_checked_us"], row["rectangular_decode_attention_us"]) == (1.0, 3.0, 2.0)
    assert row["paged_gbs"] == round(read / paged / 1e9, 1)
    assert row["fraction_of_copy"] == round(read / paged / 1e9 / copy_gbs, 3)


def test_decode_rows_compare_medians_and_pair_rounds(monkeypatch):
    """bench_paged's decode part on given step times (the first round untimed): a press's step_ms is the median of
    its timed steps, vs_<reference> the ratio of the two medians, and _paired the median over rounds of their ratio."""
    from benchmarks import bench_paged
    from kvpress_cpp.presses import KeepKVPress
    from tests.models import make_tiny_llama

    model, tokenizer = make_tiny_llama()
    # Milliseconds per step, in the order each round runs them: (A, rectangular), (A, paged), (REF, rectangular),
    # (REF, paged).
    rounds = [(9.0, 9.0, 9.0, 9.0), (1.0, 1.0, 1.0, 1.0), (2.0, 2.0, 1.0, 1.0), (6.0, 6.0, 4.0, 4.0)]
    durations = iter(d / 1000 for one_round in rounds for d in one_round)
    now, calls = [0.0], [0]

    def clock():  # a step's start, then its end
        calls[0] += 1
        if calls[0] % 2 == 0:
            now[0] += next(durations)
        return now[0]

    monkeypatch.setattr(bench_paged, "time", SimpleNamespace(perf_counter=clock))
    rows = bench_paged.decode_rows(model, tokenizer, prompt_lengths=(24,), steps=len(rounds),
                                   presses={"A": lambda: KeepKVPress(budget=16, recent=4),
                                            "REF": lambda: KeepKVPress(budget=16, recent=4)},
                                   references={"vs_ref": "REF"})
    a = next(r for r in rows if r["press"] == "A" and r["cache"] == "rectangular")
    # A's timed steps 1, 2, 6 ms (median 2, mean 3); REF's 1, 1, 4 ms (median 1, mean 2); per round 1, 2, 1.5
    assert (a["step_ms"], a["fastest_ms"], a["steps"]) == (2.0, 1.0, 3)
    assert a["vs_ref"] == 2.0 and a["vs_ref_paired"] == 1.5


def test_prefill_ratios_are_medians_of_the_rounds_over_the_forward_without_press(monkeypatch):
    """bench_prefill_overhead's presses part on given prefill times, 3 rounds: ratio = the press's median CPU seconds
    over the bare forward's median, wall_ratio the same in wall seconds."""
    from benchmarks import bench_prefill_overhead

    # (CPU s, wall s) in call order: the warm-up, then per round the forward without a press and the press's.
    calls = iter([(99.0, 99.0),
                  (1.0, 2.0), (1.2, 3.0),
                  (1.0, 2.0), (1.1, 3.0),
                  (4.0, 2.0), (1.3, 3.0)])
    monkeypatch.setattr(bench_prefill_overhead, "prefill", lambda model, ids, press=None: next(calls))
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=50))
    (row,) = bench_prefill_overhead.press_rows(model, None, [16], 3, "cpu", ["KeepKV"], lambda rows: None)
    assert (row["forward_s"], row["with_press_s"], row["forward_wall_s"], row["with_press_wall_s"]) == (
        1.0, 1.2, 2.0, 3.0)
    assert row["ratio"] == round(1.2 / 1.0, 3) and row["wall_ratio"] == round(3.0 / 2.0, 3)
