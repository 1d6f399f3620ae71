"""The marks that decide where a test runs say what they claim.

`make test` runs the suite under three transformers versions and leaves the modules marked
``independent_of_transformers`` out of the transformers 5 runs (each run costs CI minutes; these modules would run the
same code three times). A module so marked must therefore run no transformers code: it imports neither transformers
nor kvpress (which drives transformers), not even through what it imports or inside a test, and asks for no model
fixture.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.independent_of_transformers

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
MARK = "independent_of_transformers"
# Packages whose code runs transformers' models or caches, and the conftest fixtures that build models.
TRANSFORMERS_PACKAGES = ("transformers", "kvpress")
MODEL_FIXTURES = {"tiny_llama", "tiny_qwen3", "default_model"}


def _is_mark(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["pytestmark"]
            and MARK in ast.unparse(node.value))


def marked_modules() -> dict[str, ast.Module]:
    """{test module name: its syntax tree} for every module whose ``pytestmark`` carries the mark."""
    trees = {path.stem: ast.parse(path.read_text()) for path in sorted(TESTS.glob("test_*.py"))}
    return {name: tree for name, tree in trees.items() if any(_is_mark(node) for node in tree.body)}


def _imported_packages(tree: ast.Module) -> set[str]:
    """The top-level packages every import statement of the module names, inside functions too."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_transformers_5_runs_leave_out_the_marked_modules_only():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf'-m "not {MARK}\b', makefile), "make test's transformers 5 runs no longer deselect the mark"
    assert len(marked_modules()) >= 5  # the op modules; none marked would mean the mark is no longer found


def test_marked_modules_name_no_transformers_code_nor_model_fixture():
    for name, tree in marked_modules().items():
        assert not _imported_packages(tree) & set(TRANSFORMERS_PACKAGES), name
        arguments = {arg.arg for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) for arg in node.args.args}
        assert not arguments & MODEL_FIXTURES, (name, arguments & MODEL_FIXTURES)


def test_marked_modules_import_no_transformers_code_through_what_they_import():
    # A fresh interpreter (no conftest, which builds tiny models): what importing the marked modules loads.
    modules = [f"tests.{name}" for name in marked_modules()]
    probe = (f"import importlib, json, sys; [importlib.import_module(m) for m in {modules!r}]; "
             f"print(json.dumps([p for p in {TRANSFORMERS_PACKAGES!r} if p in sys.modules]))")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(loaded.stdout.splitlines()[-1]) == []
