"""kvpress's own test suite (``tests/`` of its sdist, unchanged), run offline with our presses added to its press
lists (see ``kvpress_plugin.py``), as one test of ours: every test it runs must pass."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from kvpress_cpp.evaluation.launch import kvpress_source_dir
from tests import kvpress_hooks

HERE = Path(__file__).resolve().parent
OUR_PRESSES = ["ZSMergePress", "WeightedKVPress", "KeepKVPress", "GVotePress", "TestKVzapThresholdPress",
               "TestKVzapScorer"]


def run_kvpress_suite(report: Path) -> subprocess.CompletedProcess:
    source = kvpress_source_dir()
    path = [str(HERE.parent.parent), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, KVPRESS_SOURCE_DIR=str(source), PYTHONPATH=os.pathsep.join(path), HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "pytest", "tests", "-p", "kvpress_plugin", "-p", "no:cacheprovider", "-q",
               "-rfE", f"--junitxml={report}"]
    return subprocess.run(command, cwd=source, env=env, capture_output=True, text=True, timeout=1800)


@kvpress_hooks.mark
def test_kvpress_suite_passes_with_our_presses(tmp_path):
    report = tmp_path / "kvpress-suite.xml"
    result = run_kvpress_suite(report)
    assert report.is_file(), result.stdout[-3000:] + result.stderr[-3000:]
    cases = list(ElementTree.parse(report).iter("testcase"))
    outcome = {f"{case.get('classname')}::{case.get('name')}":
               next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
               for case in cases}
    failed = [name for name, status in outcome.items() if status in ("failure", "error")]
    assert not failed, f"{len(failed)} of kvpress's tests failed:\n" + "\n".join(failed) + "\n" + result.stdout[-6000:]
    assert result.returncode == 0, result.stdout[-3000:]
    for press in OUR_PRESSES:  # each of ours went through kvpress's parametrized tests
        passed = [name for name, status in outcome.items() if status == "passed" and f"{press}]" in name]
        assert passed, f"none of kvpress's tests ran {press}"
