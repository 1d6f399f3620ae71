"""The README's Python snippets and its first command (`make demo`) run as written, on the embedded default model: a
renamed argument, a press that refuses a placement the README shows, or a cache the snippet cannot save fails here
instead of in a user's first minute. The model is the default one cut to its first two layers (its config, which
KVzap's surrogates are checked against, unchanged), and the new tokens to 8 (from 256): the snippets then run in
seconds, and every call they make is the one the README shows."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

import kvpress_cpp.models

README = Path(__file__).resolve().parent.parent / "README.md"
DEMO = README.parent / "examples" / "demo.py"
NEW_TOKENS = "max_new_tokens=8"
LAYERS = 2


def python_snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.MULTILINE | re.DOTALL)


def test_the_readme_shows_the_snippets_this_test_runs():
    snippets = python_snippets()
    assert len(snippets) == 4, "a snippet was added or removed: run it here too"
    assert all("max_new_tokens=256" in snippet for snippet in snippets[:3])


@pytest.fixture
def two_layer_default_model(default_model):
    """The session's default model with its first LAYERS decoder layers only, all of them back afterwards (pytest's
    monkeypatch would delete the attribute on undo: nn.Module keeps submodules outside the instance's __dict__)."""
    model, _ = default_model
    layers = model.model.layers
    model.model.layers = layers[:LAYERS]
    try:
        yield default_model
    finally:
        model.model.layers = layers


def test_the_press_snippets_run_in_order(two_layer_default_model, monkeypatch, tmp_path):
    """The first three snippets share their names (the second and third say so), as a user pasting them would."""
    monkeypatch.setattr(kvpress_cpp.models, "load_default_model", lambda: two_layer_default_model)
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    for snippet in python_snippets()[:3]:
        exec(compile(snippet.replace("max_new_tokens=256", NEW_TOKENS), str(README), "exec"), names)

    press, cache = names["press"], names["cache"]
    # The last snippet ran KVzap on a DynamicCache: it evicted slots (the ratio is measured, not set).
    assert len(cache.layers) == LAYERS and set(press.layer_compression_ratios) == set(range(LAYERS))
    assert 0 < press.compression_ratio < 1
    # The saved prefix loads back as the compressed cache it was.
    prefix, loaded = names["prefix"], torch.load(tmp_path / "prefix.pt", weights_only=False)
    for saved, original in zip(loaded.layers, prefix.layers, strict=True):
        assert torch.equal(saved.keys, original.keys) and torch.equal(saved.values, original.values)


def test_the_op_snippet_runs():
    names: dict = {}
    exec(compile(python_snippets()[3], str(README), "exec"), names)
    assert names["scores"].shape == (1, 3, 5)


def test_the_demo_prints_a_row_for_every_press(two_layer_default_model, monkeypatch, capsys):
    """`make demo` on a short prompt: a row per press of its list, in order, each with the KV bytes it held; the 25%
    budgets hold less than the full cache."""
    spec = importlib.util.spec_from_file_location("demo", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    monkeypatch.setattr(demo, "load_default_model", lambda device: two_layer_default_model)
    monkeypatch.setattr(sys, "argv", ["demo.py", "--context-tokens", "200", "--max-new-tokens", "2", "--device", "cpu"])
    demo.main()
    lines = capsys.readouterr().out.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if set(line) == {"-"}) + 1:]
    names = [name for name, _, _ in demo.presses()]
    assert [line[:24].strip() for line in table] == names
    held = {name: float(re.search(r"([0-9.]+)MiB", line).group(1)) for name, line in zip(names, table)}
    assert all(mebibytes > 0 for mebibytes in held.values())
    assert held["ZSMerge 25%"] < held["full cache"] and held["KeepKV 25%"] < held["full cache"]
