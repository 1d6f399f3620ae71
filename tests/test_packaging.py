"""What `pip install .` declares against what the code imports and what the tests ran.

setup.py's INSTALL_REQUIRES and EXTRAS_REQUIRE are read from its source (running setup.py would build). A user who
installs the package gets every distribution the package imports; the pins of requirements.txt, which the tests run
under, fall inside the declared ranges.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvpress_cpp"


def declared() -> tuple[list[Requirement], dict[str, list[Requirement]]]:
    """(INSTALL_REQUIRES, EXTRAS_REQUIRE) of setup.py, as requirements."""
    values = {}
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("INSTALL_REQUIRES", "EXTRAS_REQUIRE"):
                values[node.targets[0].id] = ast.literal_eval(node.value)
    install = [Requirement(text) for text in values["INSTALL_REQUIRES"]]
    extras = {extra: [Requirement(text) for text in texts] for extra, texts in values["EXTRAS_REQUIRE"].items()}
    return install, extras


def pins() -> dict[str, str]:
    """Distribution (canonical name) -> version pinned in requirements.txt."""
    pinned = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pinned[canonicalize_name(name)] = version
    return pinned


def third_party_imports(files: list[Path]) -> set[str]:
    """Top-level modules imported anywhere in `files` (lazily inside functions too) that are neither the standard
    library nor this package."""
    modules = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return {m for m in modules if m not in sys.stdlib_module_names and m not in ("kvpress_cpp", "__future__")}


def distributions_of(modules: set[str]) -> dict[str, set[str]]:
    """Module -> canonical names of the installed distributions that provide it."""
    providers = importlib.metadata.packages_distributions()
    return {module: {canonicalize_name(d) for d in providers.get(module, [])} for module in modules}


def names(requirements: list[Requirement]) -> set[str]:
    return {canonicalize_name(r.name) for r in requirements}


@pytest.mark.parametrize("part", ["library", "evaluation"])
def test_every_imported_distribution_is_declared(part):
    install, extras = declared()
    library = [p for p in PACKAGE.rglob("*.py") if "evaluation" not in p.relative_to(PACKAGE).parts]
    files = library if part == "library" else sorted((PACKAGE / "evaluation").rglob("*.py"))
    allowed = names(install) | (names(extras["evaluation"]) if part == "evaluation" else set())
    undeclared = {module: providers for module, providers in distributions_of(third_party_imports(files)).items()
                  if not providers & allowed}
    assert not undeclared, f"kvpress_cpp ({part}) imports modules no declared requirement provides: {undeclared}"


def test_pins_fall_inside_the_declared_ranges():
    install, extras = declared()
    pinned = pins()
    outside = [f"{r} (pinned {pinned[canonicalize_name(r.name)]})"
               for r in install + [r for group in extras.values() for r in group]
               if canonicalize_name(r.name) in pinned and pinned[canonicalize_name(r.name)] not in r.specifier]
    assert not outside, f"requirements.txt pins versions setup.py excludes: {outside}"


def test_installed_versions_satisfy_install_requires():
    """The environment the tests run in is one a user's `pip install .` could have produced (torch's local
    version, e.g. +cu130, is ignored by the specifier as pip ignores it)."""
    install, _ = declared()
    unmet = [f"{r} (installed {importlib.metadata.version(r.name)})" for r in install
             if not r.specifier.contains(importlib.metadata.version(r.name).split("+")[0], prereleases=True)]
    assert not unmet, f"installed versions outside setup.py's ranges: {unmet}"


def test_the_installed_version_is_kvpress_cpp_version():
    """kvpress_cpp.__version__, written once in the package, is the version pip installed it as (setup.py's)."""
    import kvpress_cpp

    assert kvpress_cpp.__version__ == importlib.metadata.version("kvpress_cpp")


def test_an_unbuilt_extension_is_named_with_how_to_build_it(tmp_path):
    """Without the compiled extension, `import kvpress_cpp` said only "cannot import name '_C' from partially
    initialized module 'kvpress_cpp' (most likely due to a circular import)"."""
    shutil.copytree(PACKAGE, tmp_path / "kvpress_cpp", ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    # The copy is found first; the editable install's finder, which would hand it the built extension, is removed.
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
            "import kvpress_cpp")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=120)
    assert run.returncode == 1
    assert (f"ImportError: kvpress_cpp: its compiled extension (kvpress_cpp._C) is not built in "
            f"{tmp_path / 'kvpress_cpp'}. Build it against the torch you run: `make build`") in run.stderr, run.stderr


def test_readme_press_signatures_are_the_constructors():
    """The Presses table shows each press's constructor with its defaults: the same parameters, in the same order,
    with the same defaults as the class (a parameter the table omits or names wrongly fails here)."""
    import inspect
    import re

    import kvpress_cpp.presses as presses

    rows = re.findall(r"^\| `(\w+Press)\((.*?)\)` \|", (ROOT / "README.md").read_text(), flags=re.MULTILINE)
    assert {name for name, _ in rows} == set(presses.__all__) - {"KVCompPress", "KVCompDecodingPress"}
    for name, arguments in rows:
        documented = [(key.strip(), ast.literal_eval(default))
                      for key, default in (part.split("=", 1) for part in arguments.split(","))]
        actual = [(parameter.name, parameter.default)
                  for parameter in inspect.signature(getattr(presses, name)).parameters.values()]
        assert documented == actual, f"README's {name} differs from the constructor"


def test_the_ops_doc_lists_every_op_with_its_signature():
    """docs/ops.md's Ops table has a row for every op kvpress_cpp.ops wraps, with the wrapper's parameters and
    defaults."""
    import inspect
    import re

    import torch

    from kvpress_cpp import ops

    text = (ROOT / "docs" / "ops.md").read_text()
    table = text[text.index("## Ops"):text.index("## Architecture")]
    rows = dict(re.findall(r"^\| `(\w+)\((.*?)\)` \|", table, flags=re.MULTILINE))
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("kvcomp::")}
    assert set(rows) == registered
    for name, arguments in rows.items():
        documented = [(part.split("=")[0].strip(), ast.literal_eval(part.split("=")[1]) if "=" in part else
                       inspect.Parameter.empty) for part in arguments.split(",")]
        actual = [(parameter.name, parameter.default)
                  for parameter in inspect.signature(getattr(ops, name)).parameters.values()]
        assert documented == actual, f"docs/ops.md's {name} differs from kvpress_cpp.ops.{name}"


@pytest.mark.skipif("ATen parallel backend: OpenMP" not in torch.__config__.parallel_info(),
                    reason="torch's ATen parallel backend is not OpenMP")
@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("readelf") is None,
                    reason="reads the ELF dynamic section (readelf) and /proc/self/maps")
def test_cpu_kernels_run_on_torchs_openmp_threads():
    """ATen's at::parallel_for is a `#pragma omp parallel` in its headers: built without OpenMP the extension ran every
    CPU kernel on one thread whatever torch.set_num_threads said. Built with it, it needs an OpenMP runtime, and that
    must be the one torch loaded (one pool, sized by torch.set_num_threads), not a second one."""
    import kvpress_cpp

    needed = subprocess.run(["readelf", "--dynamic", kvpress_cpp._C.__file__], capture_output=True, text=True,
                            check=True).stdout
    assert "[libgomp" in needed
    runtimes = ("libgomp", "libiomp5", "libomp")
    loaded = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
              if any(name in line.split()[-1] for name in runtimes)}
    assert len(loaded) == 1, loaded


def test_the_sdist_holds_everything_its_build_and_tests_read(tmp_path):
    """setuptools alone packed only the .cpp files setup.py lists and the tests' test_*.py files: the sdist had no
    header (its build stopped on cpu/attention_rows.h), no .cu file (a CUDA build from it would have been silently
    CPU-only), no CMakeLists.txt and none of the tests' helpers. MANIFEST.in grafts them."""
    done = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path), "sdist",
                           "--dist-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KVCOMP_FORCE_CPU": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    (archive,) = tmp_path.glob("kvpress_cpp-*.tar.gz")
    with tarfile.open(archive) as sdist:
        packed = {Path(*Path(name).parts[1:]) for name in sdist.getnames()}
    needed = {path.relative_to(ROOT) for folder in ("csrc", "tests", "docs") for path in (ROOT / folder).rglob("*")
              if path.is_file() and "__pycache__" not in path.parts}
    needed |= {Path("CMakeLists.txt"), Path("setup.py"), Path("README.md"), Path("requirements.txt")}
    assert needed - packed == set()
    assert not [path for path in packed if path.suffix in (".so", ".pyc")]
