"""Every benchmark's command line: ``--help`` explains and exits before any work (seven of them ignored their
arguments, so ``--help`` ran the whole benchmark and overwrote its committed results), and a count of 0 is refused
by argparse, naming the option, instead of failing later in a statistic over no runs."""

from __future__ import annotations

import importlib
import signal
import sys
from pathlib import Path

import pytest

import benchmarks.common

MODULES = sorted(path.stem for path in Path(benchmarks.common.__file__).parent.glob("*.py")
                 if path.stem not in ("__init__", "common"))


class RanPastTheCommandLine(Exception):
    pass


def run_main(monkeypatch, module_name: str, *arguments: str) -> SystemExit:
    """`module_name`'s main() under these arguments, which must stop in argparse (SystemExit): a benchmark that
    starts measuring or writes a result file fails the test instead."""
    module = importlib.import_module(f"benchmarks.{module_name}")
    monkeypatch.setattr(sys, "argv", [module_name, *arguments])

    def refuse_writing(*args, **kwargs):
        raise RanPastTheCommandLine(f"{module_name} {' '.join(arguments)} went on to write results")

    monkeypatch.setattr(module, "write_results", refuse_writing, raising=False)

    def out_of_time(signum, frame):
        raise RanPastTheCommandLine(f"{module_name} {' '.join(arguments)} was still running after 30 s")

    previous = signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(30)
    try:
        with pytest.raises(SystemExit) as stopped:
            module.main()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return stopped.value


@pytest.mark.parametrize("module_name", MODULES)
def test_help_explains_and_exits(monkeypatch, capsys, module_name):
    assert run_main(monkeypatch, module_name, "--help").code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("module_name,arguments,option", [
    ("bench_decode", ["--repeats", "0"], "--repeats"),
    ("bench_decode", ["--lengths", "0"], "--lengths"),
    ("bench_prefill_overhead", ["--repeats", "0"], "--repeats"),
    ("bench_step_profile", ["--steps", "0"], "--steps"),
    ("bench_streaming_ppl", ["--cache-sizes", "0"], "--cache-sizes"),
    ("bench_streaming_ppl", ["--prefill", "64", "--tokens", "32"], "--prefill"),
    ("bench_streaming_ppl", ["--tokens", "40", "--cache-sizes", "64"], "--cache-sizes [64]"),  # nothing beyond m
    ("bench_streaming_ppl", ["--tokens", "40", "--cache-sizes", "16"], "--cache-sizes [16]"),  # one block beyond
    ("bench_cache", ["--bogus"], "--bogus"),
    ("bench_paged", ["--decode-presses", "TOVA"], "--decode-presses"),  # always there: every row is compared with it
])
def test_bad_arguments_are_refused_naming_the_option(monkeypatch, capsys, module_name, arguments, option):
    assert run_main(monkeypatch, module_name, *arguments).code == 2
    assert option in capsys.readouterr().err


@pytest.mark.parametrize("module_name,arguments", [
    ("bench_decode", ["--budgets", "0.25", "2"]),
    ("bench_decode", ["--budgets", "-0.5"]),
    ("bench_step_profile", ["--budget", "0"]),
    ("bench_step_profile", ["--budget", "1.5"]),
    ("bench_needle_digits", ["--kept", "2"]),
])
def test_a_kept_fraction_outside_zero_to_one_is_refused_before_the_model_is_built(monkeypatch, capsys, module_name,
                                                                                  arguments):
    """The presses take a fraction of the prompt in (0, 1]; these values were refused by the press only after the
    model was built (and, in bench_decode, after the rows already measured), in a traceback."""
    assert run_main(monkeypatch, module_name, *arguments).code == 2
    assert f"{arguments[0]}: must be a fraction of the prompt in (0, 1], got {arguments[-1]}" in capsys.readouterr().err


def test_a_budget_too_small_for_a_press_is_refused_in_the_warm_up_naming_the_options(monkeypatch, capsys):
    """5% of 32 tokens is 2 slots, fewer than ZSMerge's recent and residual slots need: the press refuses it. That
    refusal came as a traceback from the warm-up, or, for a budget not warmed up, after rows were measured."""
    arguments = ["--model", "random-llama-tiny", "--lengths", "64", "32", "--budgets", "0.25", "0.05",
                 "--methods", "ZSMerge", "--new-tokens", "2", "--repeats", "1"]
    assert run_main(monkeypatch, "bench_decode", *arguments).code == 2
    error = capsys.readouterr().err
    assert "--methods ZSMerge at --budgets 0.05 of --lengths 32: ZSMergePress: a budget of 2 slots" in error


def test_the_decode_part_runs_the_presses_named_beside_tova():
    from benchmarks.bench_paged import DECODE_PRESSES, decode_presses

    rows = list(decode_presses())
    assert rows[0] == "TOVA (prefill only)" and len(rows) == 1 + len(DECODE_PRESSES)
    assert list(decode_presses(["KeepKV", "ZSMerge"])) == ["TOVA (prefill only)", "ZSMerge", "KeepKV"]
    assert [type(make()).__name__ for make in decode_presses(["KVzap"]).values()] == ["TOVAPress",
                                                                                     "KVzapThresholdPress"]
