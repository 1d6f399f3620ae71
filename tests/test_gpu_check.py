"""make gpu-check reads compute-sanitizer's own summaries (the lines below are copied from its logs on an H100)."""

from benchmarks.gpu_check import sanitizer_errors


def test_memcheck_and_synccheck_summaries():
    assert sanitizer_errors("19 passed in 5.53s\n========= ERROR SUMMARY: 0 errors\n") == 0
    assert sanitizer_errors("========= ERROR SUMMARY: 3 errors\n========= ERROR SUMMARY: 1 error\n") == 4


def test_racecheck_summary():
    line = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    assert sanitizer_errors(line) == 0
    assert sanitizer_errors(line.replace("(0 errors", "(2 errors")) == 2


def test_a_log_without_a_summary_is_not_a_pass():
    assert sanitizer_errors("Traceback (most recent call last):\n") is None
