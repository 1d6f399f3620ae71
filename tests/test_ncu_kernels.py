"""benchmarks/ncu_kernels.py reads Nsight Compute's CSV (``ncu --csv --page details``) without a GPU: a sample in that
format (its header as ncu 2023+ prints it, thousands separators, units, rule rows, launches out of order) against
values written out by hand."""

import pytest
import torch

import kvpress_cpp  # noqa: F401  (registers torch.ops.kvcomp)

from benchmarks.ncu_kernels import launches, main, markdown, parse_details, short_name

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value","Rule Name","Rule Type",'
          '"Rule Description","Estimated Speedup Type","Estimated Speedup"')
SCORES = "void kvcomp::(anonymous namespace)::scores_kernel<c10::BFloat16>(kvcomp::(anonymous namespace)::Layout, float)"
FLASH = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>(pytorch_flash::Params)"


def row(launch, kernel, section, metric, unit, value, rule=""):
    fields = [launch, "4242", "python3", "127.0.0.1", kernel, "1", "7", "(128, 1, 1)", "(128, 8, 1)", "0", "9.0",
              section, metric, unit, value, "Rule" if rule else "", "OPT" if rule else "", rule, "", ""]
    return ",".join(f'"{f}"' for f in fields)


SAMPLE = "\n".join([
    "==PROF== Connected to process 4242 (/usr/bin/python3)",
    "==PROF== Profiling \"scores_kernel\" - 0: 0%....50%....100% - 38 passes",
    HEADER,
    row("1", FLASH, "GPU Speed Of Light Throughput", "Duration", "usecond", "812.32"),
    row("0", SCORES, "GPU Speed Of Light Throughput", "Duration", "msecond", "1,234.50"),
    row("0", SCORES, "GPU Speed Of Light Throughput", "DRAM Throughput", "%", "3.21"),
    row("0", SCORES, "GPU Speed Of Light Throughput", "Compute (SM) Throughput", "%", "41.07"),
    row("0", SCORES, "Occupancy", "Achieved Occupancy", "%", "11.90"),
    row("0", SCORES, "Occupancy", "Block Limit Shared Mem", "block", "n/a"),
    row("0", SCORES, "Occupancy", "", "", "", rule="Theoretical occupancy is limited by shared memory."),
    row("0", SCORES, "Launch Statistics", "Registers Per Thread", "register/thread", "96"),
])


def test_every_launch_is_read_in_launch_order_with_numbers_units_and_rules():
    scores, flash = parse_details(SAMPLE)
    assert scores["kernel"] == SCORES and flash["kernel"] == FLASH
    assert (scores["duration"], scores["duration_unit"]) == (1234.5, "msecond")
    assert (flash["duration"], flash["duration_unit"]) == (812.32, "usecond")
    assert scores["dram_throughput_pct"] == 3.21 and "dram_throughput_pct_unit" not in scores
    assert scores["sm_throughput_pct"] == 41.07 and scores["achieved_occupancy_pct"] == 11.9
    assert scores["registers_per_thread"] == 96.0 and scores["block_limit_shared_memory"] == "n/a"
    assert scores["grid_size"] == "(128, 8, 1)" and scores["block_size"] == "(128, 1, 1)"
    assert scores["metrics"]["Occupancy"]["Achieved Occupancy"] == [11.9, "%"]
    assert scores["rules"] == ["Occupancy: Theoretical occupancy is limited by shared memory."]
    assert "" not in scores["metrics"]["Occupancy"]
    table = markdown([scores, flash])
    assert "| `scores_kernel<c10::BFloat16>` | 1234.5 msecond |" in table
    assert "- Occupancy: Theoretical occupancy is limited by shared memory." in table


def test_kernel_names_are_shortened_past_namespaces_and_parameters():
    assert short_name(SCORES) == "scores_kernel<c10::BFloat16>"
    assert short_name(FLASH) == "flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>"
    assert short_name("attend_chunk_kernel") == "attend_chunk_kernel"


def test_output_without_a_table_is_an_error():
    with pytest.raises(ValueError, match="no ncu CSV table"):
        parse_details("==ERROR== the application returned an error code (1)\n")


def test_an_ncu_that_is_not_there_is_named_before_anything_runs(monkeypatch, tmp_path):
    missing = str(tmp_path / "no-ncu")
    monkeypatch.setattr("sys.argv", ["ncu_kernels", "--ncu", missing])
    with pytest.raises(SystemExit, match=f"ncu_kernels: --ncu '{missing}' is not an executable"):
        main()


def test_the_profiled_paged_cache_holds_the_same_slots_as_the_rectangular_one():
    """The workload's paged decode attention reads the rectangular cache's keys and values through shuffled block
    tables: both attentions agree (small shapes on CPU)."""
    calls = launches("cpu", prompt_length=32, cached=64, batch=2)
    rectangular, _ = calls["decode_attention"]()
    paged, _ = calls["paged_decode_attention"]()
    torch.testing.assert_close(paged.float(), rectangular.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(calls["decode sdpa"]().float(), rectangular.float(), rtol=2e-2, atol=2e-2)
    assert calls["prompt_scores"]().shape == (1, 8, 32)
    # KeepKV's step over 16 slots: one eviction a row, 15 slots kept and their state.
    calls = launches("cpu", prompt_length=32, cached=64, batch=2, keepkv_slots=16)
    keys, values, log_ema, age, votes, log_weights, dropped = calls["keepkv_decode_step"]()
    assert keys.shape == values.shape == (2, 8, 15, 128)
    assert log_ema.shape == age.shape == votes.shape == log_weights.shape == (2, 8, 15) and dropped.shape == (2, 8)


def test_launches_past_ten_stay_in_launch_order_and_each_throughput_under_its_own_name():
    """ncu numbers launches 0, 1, ..., 10, 11: launch 10 comes after launch 9, not after launch 1 (the workload
    launches more than ten kernels). Memory and DRAM throughput are two figures; a metric without a unit gets no
    unit beside it."""
    ids = [2, 10, 9, 1]
    lines = [HEADER] + [row(str(i), f"kernel_{i}", "GPU Speed Of Light Throughput", "Duration", "usecond", str(i))
                        for i in ids]
    lines += [row("2", "kernel_2", "GPU Speed Of Light Throughput", "Memory Throughput", "%", "80.5"),
              row("2", "kernel_2", "GPU Speed Of Light Throughput", "DRAM Throughput", "%", "60.25"),
              row("2", "kernel_2", "Launch Statistics", "Registers Per Thread", "", "64")]
    parsed = parse_details("\n".join(lines))
    assert [launch["kernel"] for launch in parsed] == [f"kernel_{i}" for i in sorted(ids)]
    second = parsed[1]
    assert second["memory_throughput_pct"] == 80.5 and second["dram_throughput_pct"] == 60.25
    assert second["registers_per_thread"] == 64.0 and "registers_per_thread_unit" not in second
    assert "| `kernel_2` | 2.0 usecond | 80.5 | 60.25 |" in markdown(parsed)
