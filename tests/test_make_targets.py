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
# What make reads from its environment that would change the copy's build settings or paths: a `make test` running
# this test passes its own command-line variables down in MAKEFLAGS.
MAKE_INPUTS = ("MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "MAKELEVEL", "VENV", "PYTHON", "CUDA_HOME",
               "TORCH_CUDA_ARCH_LIST", "KVCOMP_FORCE_CPU", "KVCOMP_CPU_ARCH")


def make(tree: Path, *arguments: str, check: bool = True, **settings: str) -> str:
    environment = {name: value for name, value in os.environ.items() if name not in MAKE_INPUTS}
    return subprocess.run(["make", *arguments], cwd=tree, capture_output=True, text=True, check=check,
                          env={**environment, **settings}).stdout


def dry_run(tree: Path, **settings: str) -> str:
    """What `make demo` would run (printed by -n, not run)."""
    return make(tree, "-n", "demo", **settings)


def settings_file(tree: Path, **settings: str) -> str:
    """The file under build/ that these build settings name (read from make's printed database)."""
    database = make(tree, "-p", "-q", "build", check=False, **settings).splitlines()
    return next(line.split(" := ")[1] for line in database if line.startswith("EXTENSION_SETTINGS := "))


def build_with(tree: Path, at: int, **settings: str) -> None:
    """What a real build with these settings leaves, at time `at`: their settings file (written by its rule), and the
    extension, a second later."""
    written = settings_file(tree, **settings)
    make(tree, written, **settings)
    (tree / EXTENSION).touch()
    os.utime(tree / written, (at, at))
    os.utime(tree / EXTENSION, (at + 1, at + 1))


@pytest.fixture
def project(tmp_path):
    """A tree holding the Makefile, a source, setup.py, the package's version, a venv marked installed, and an
    extension built with the default settings, newer than all."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    shutil.copy(ROOT / "Makefile", tmp_path)
    (tmp_path / "kvpress_cpp").mkdir()
    (tmp_path / "kvpress_cpp/__init__.py").write_text('__version__ = "1.0"\n')
    for age, name in enumerate(("requirements.txt", "setup.py", "csrc/cpu/scores.cpp", ".venv/.installed")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
        os.utime(tmp_path / name, (1_000_000 + age,) * 2)
    build_with(tmp_path, at=1_000_010)
    return tmp_path


def test_an_extension_newer_than_its_inputs_is_not_rebuilt(project):
    assert BUILD_COMMAND not in dry_run(project)


@pytest.mark.parametrize("changed", ["csrc/cpu/scores.cpp", "setup.py", ".venv/.installed"])
def test_a_changed_input_rebuilds_it(project, changed):
    os.utime(project / changed, None)
    assert BUILD_COMMAND in dry_run(project)


def test_a_new_version_reinstalls_it(project):
    """pip records the package's version when it installs it: kvpress_cpp.__version__ must then be what it says."""
    (project / "kvpress_cpp/__init__.py").write_text('__version__ = "1.1"\n')
    assert BUILD_COMMAND in dry_run(project)


@pytest.mark.parametrize("setting", ["TORCH_CUDA_ARCH_LIST=8.0", "KVCOMP_FORCE_CPU=1", "KVCOMP_CPU_ARCH=x86-64-v3"])
def test_a_changed_build_setting_rebuilds_it(project, setting):
    name, value = setting.split("=")
    assert BUILD_COMMAND in dry_run(project, **{name: value})
    assert BUILD_COMMAND not in dry_run(project)  # a dry run leaves nothing behind that a later make reads


def test_settings_changed_and_changed_back_rebuild_it(project):
    build_with(project, at=1_000_020, KVCOMP_FORCE_CPU="1")
    assert BUILD_COMMAND not in dry_run(project, KVCOMP_FORCE_CPU="1")
    assert BUILD_COMMAND in dry_run(project)


def test_a_missing_extension_or_settings_file_rebuilds_it(project):
    """`make clean demo` deletes both after make has read the Makefile: the settings' file has a rule of its own."""
    shutil.rmtree(project / "build")
    assert BUILD_COMMAND in dry_run(project)
    (project / EXTENSION).unlink()
    assert BUILD_COMMAND in dry_run(project)
