"""The Makefile rebuilds the extension when, and only when, what it is built from changes.

pip's editable build compiles from scratch (5-11 minutes on two cores), so a target that rebuilt on every run made each
`make demo` pay it. Run on a copy of the Makefile beside stand-in files whose times the test sets (`make -n` prints the
commands it would run and runs none), so nothing is compiled here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.independent_of_transformers

ROOT = Path(__file__).resolve().parents[1]
BUILD_COMMAND = "pip install --quiet --no-build-isolation --no-deps -e ."
EXTENSION = "kvpress_cpp/_C.abi3.so"


@pytest.fixture
def project(tmp_path):
    """A tree holding the Makefile, a source, setup.py, a venv marked installed and an extension newer than all."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    shutil.copy(ROOT / "Makefile", tmp_path)
    for name in ("requirements.txt", "setup.py", "csrc/cpu/scores.cpp", ".venv/.installed", EXTENSION):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    dry_run(tmp_path)  # the first make writes the build settings it compares later runs against
    for age, name in enumerate(("requirements.txt", "setup.py", "csrc/cpu/scores.cpp", "build/extension-settings",
                                ".venv/.installed", EXTENSION)):
        os.utime(tmp_path / name, (1_000_000 + age, 1_000_000 + age))
    return tmp_path


def dry_run(tree: Path, *arguments: str, **environment: str) -> str:
    done = subprocess.run(["make", "-n", *arguments, "demo"], cwd=tree, capture_output=True, text=True,
                          env={**os.environ, **environment}, check=True)
    return done.stdout


def test_an_extension_newer_than_its_inputs_is_not_rebuilt(project):
    assert BUILD_COMMAND not in dry_run(project)
    assert BUILD_COMMAND not in dry_run(project)  # and the settings file, rewritten only on a change, stays older


@pytest.mark.parametrize("changed", ["csrc/cpu/scores.cpp", "setup.py", ".venv/.installed"])
def test_a_changed_input_rebuilds_it(project, changed):
    os.utime(project / changed, None)
    assert BUILD_COMMAND in dry_run(project)


@pytest.mark.parametrize("setting", ["TORCH_CUDA_ARCH_LIST=8.0", "KVCOMP_FORCE_CPU=1", "KVCOMP_CPU_ARCH=x86-64-v3"])
def test_a_changed_build_setting_rebuilds_it(project, setting):
    name, value = setting.split("=")
    assert BUILD_COMMAND in dry_run(project, **{name: value})


def test_a_missing_extension_is_built(project):
    (project / EXTENSION).unlink()
    assert BUILD_COMMAND in dry_run(project)
