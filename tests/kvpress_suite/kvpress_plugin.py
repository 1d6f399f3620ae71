"""pytest plugin that runs kvpress's own test suite (``tests/`` of its sdist, unchanged) offline on our presses.

Loaded with ``-p kvpress_plugin`` by ``tests/kvpress_suite/test_kvpress_suite.py``, in a pytest whose rootdir is the
sdist folder (so that kvpress's ``tests`` package is the one its modules import). Before kvpress's modules are
collected it:

* answers the hub ids kvpress's fixtures and tests load (``from_pretrained``, ``pipeline(model="...")``,
  ``AutoTokenizer``) with the tiny random models and offline tokenizer of ``tests/models.py``;
* appends our presses to ``tests.default_presses.default_presses``, the list kvpress parametrizes its press tests
  over, so every such test runs on them too;
* skips, by test id and with the reason, the tests that need the network or the real hub checkpoints (they fail
  the same way for kvpress's own presses here).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

KVPRESS_SOURCE = Path(os.environ["KVPRESS_SOURCE_DIR"])
OUR_TESTS = Path(__file__).resolve().parent.parent


def _load_tiny_models():
    spec = importlib.util.spec_from_file_location("kvpress_cpp_tiny_models", OUR_TESTS / "models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny_models = _load_tiny_models()

#: kvpress's unit tests feed random ids up to 3000 to the "unit test model": the stand-ins have that many embeddings,
#: and their lm_head rows beyond the tokenizer's vocabulary are zero so that greedy answers decode to text.
VOCAB_SIZE = 3072
#: The shape of kvpress's unit-test checkpoint (its tests assert head_dim 6), a plain Llama without chat template.
UNIT_TEST_SHAPE = dict(hidden_size=24, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=6)
#: hub id → (factory of the stand-in model, its arguments, whether its tokenizer has a chat template).
STAND_INS = {
    "maxjeblick/llama2-0b-unit-test": (tiny_models.make_tiny_llama, UNIT_TEST_SHAPE, False),
    "h2oai/h2o-danube3-500m-chat": (tiny_models.make_tiny_llama, {}, True),
    "meta-llama/llama-3.2-1b-instruct": (tiny_models.make_tiny_llama, {}, True),
    "meta-llama/llama-3.1-8b-instruct": (tiny_models.make_tiny_llama, {}, True),
    "qwen/qwen3-4b-instruct-2507": (tiny_models.make_tiny_qwen3, {}, True),
}

#: Tests skipped here (a test with all its parameters, or a folder), with the reason. Each fails for kvpress's own
#: presses as well.
SKIPPED = {
    "tests/presses/test_ea_with_stats.py::test_load_stats":
        "downloads ExpectedAttention statistics from the hub (network)",
    "tests/integration/": "RULER from the hub and 4B-8B checkpoints on a GPU (network)",
    "tests/test_pipeline.py::test_pipeline_answer_is_correct": "needs the trained checkpoint's answer",
    "tests/test_generate.py::test_generate": "slices the decoded text by characters, which the byte-level stand-in "
                                             "tokenizer does not keep aligned with the tokens",
    **{f"tests/test_pipeline.py::{name}": "asserts context lengths of the Llama-2 tokenizer (23 and 13 tokens); the "
       "offline stand-in tokenizes otherwise" for name in ("test_pipeline", "test_pipeline_single_or_no_question",
                                                          "test_pipeline_compresses_context")},
    "tests/presses/test_duo_attention_press.py::test_load_attention_pattern":
        "downloads DuoAttention's patterns from GitHub (network)",
    "tests/presses/test_qfilters_press.py::test_load_qfilters": "downloads Q-filters from the hub (network)",
}
#: Press classes (parametrize ids) whose post_init_from_model downloads weights from the hub.
HUB_PRESSES = {"QFilterPress": "downloads its Q-filters from the hub (network)",
               "ExpectedAttentionStatsPress": "downloads its query statistics from the hub (network)"}


def stand_in_tokenizer(name: str):
    tokenizer = tiny_models.make_tokenizer()
    if not STAND_INS[name.lower()][2]:
        tokenizer.chat_template = None
    return tokenizer


def stand_in(name: str, attn_implementation: str | None = None):
    factory, shape, _ = STAND_INS[name.lower()]
    tokenizer = stand_in_tokenizer(name)
    model, _ = factory(attn_implementation=attn_implementation or "sdpa", vocab_size=VOCAB_SIZE, tokenizer=tokenizer,
                       **shape)
    with torch.no_grad():
        model.lm_head.weight[len(tokenizer):] = 0.0
    model.config.name_or_path = name
    return model, tokenizer


def _patch_transformers() -> None:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original_model, original_tokenizer = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained
    original_pipeline = transformers.pipeline

    def model_from_pretrained(name, *args, **kwargs):
        if isinstance(name, str) and name.lower() in STAND_INS:
            return stand_in(name, kwargs.get("attn_implementation"))[0]
        return original_model(name, *args, **kwargs)

    def tokenizer_from_pretrained(name, *args, **kwargs):
        if isinstance(name, str) and name.lower() in STAND_INS:
            return stand_in_tokenizer(name)
        return original_tokenizer(name, *args, **kwargs)

    def pipeline(task=None, model=None, *args, **kwargs):
        if isinstance(model, str) and model.lower() in STAND_INS:
            model_kwargs = kwargs.pop("model_kwargs", None) or {}
            model, tokenizer = stand_in(model, model_kwargs.get("attn_implementation"))
            kwargs.pop("dtype", None)
            kwargs.setdefault("tokenizer", tokenizer)
        return original_pipeline(task, model, *args, **kwargs)

    AutoModelForCausalLM.from_pretrained = model_from_pretrained
    AutoTokenizer.from_pretrained = tokenizer_from_pretrained
    transformers.pipeline = pipeline


def _our_presses() -> list[dict]:
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

    from kvpress_cpp.presses import (GVotePress, KeepKVPress, KVzapPress, KVzapThresholdPress, WeightedKVPress,
                                     ZSMergePress)

    def random_surrogate(model) -> KVzapModel:
        config = KVzapConfig(input_dim=model.config.hidden_size, output_dim=model.config.num_key_value_heads,
                             hidden_dim=None, n_modules=model.config.num_hidden_layers)
        return KVzapModel(config)

    class TestKVzapScorer(KVzapPress):
        """Our KVzap scorer with a random linear surrogate (as kvpress's TestKVzapPress), nothing loaded."""

        def post_init_from_model(self, model):
            self.kvzap_model = random_surrogate(model)

    class TestKVzapThresholdPress(KVzapThresholdPress):
        """Our thresholded KVzap with a random linear surrogate, nothing loaded."""

        def post_init_from_model(self, model):
            self.scorer.kvzap_model = random_surrogate(model)

    return [
        {"cls": ZSMergePress, "kwargs": [{"budget": 0.8}, {"budget": 0.2}]},
        {"cls": WeightedKVPress, "kwargs": [{"cache_size": 0.8}, {"cache_size": 0.2}]},
        {"cls": KeepKVPress, "kwargs": [{"budget": 0.8, "recent": 8}, {"budget": 0.2, "recent": 8}]},
        {"cls": GVotePress, "kwargs": [{"nucleus_p": 0.99}, {"nucleus_p": 0.5}]},
        {"cls": TestKVzapThresholdPress, "kwargs": [{"threshold": -0.5, "sliding_window": 16},
                                                    {"threshold": 0.5, "sliding_window": 16}]},
        {"cls": TestKVzapScorer, "kwargs": [{"compression_ratio": 0.2}, {"compression_ratio": 0.8}]},
    ]


def pytest_configure(config):
    sys.path.insert(0, str(KVPRESS_SOURCE))
    _patch_transformers()
    from tests import default_presses

    default_presses.default_presses.extend(_our_presses())


def pytest_make_parametrize_id(config, val, argname):
    """Name the entries of ``default_presses`` by their press class (kvpress's ids are list positions)."""
    if isinstance(val, dict) and "cls" in val:
        return val["cls"].__name__
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = next((why for test, why in SKIPPED.items() if item.nodeid == test or item.nodeid.startswith(
            test + "[") or (test.endswith("/") and item.nodeid.startswith(test))), None)
        params = getattr(item, "callspec", None).params.values() if hasattr(item, "callspec") else ()
        presses = {value["cls"].__name__ for value in params if isinstance(value, dict) and "cls" in value}
        reason = reason or next((why for name, why in HUB_PRESSES.items() if name in presses), None)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"offline run: {reason}"))
