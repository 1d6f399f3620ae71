"""Presses on a model whose layers sit on different devices (``device_map``): each layer's cache and press state stay on
that layer's device, and the tokens and cache equal a run on one device.

Runs where two CUDA devices exist (layer 0 on cuda:0, layer 1 on cuda:1) and, with one, across cuda:0 and the CPU;
skips on a machine without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from accelerate import dispatch_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests import kvpress_hooks
from tests.tp_worker import CASES, KVPRESS_HOOK_CASES, run_case, write_assets

DEVICE_PAIRS = ([("cuda:0", "cuda:1")] if torch.cuda.device_count() >= 2 else []) + \
    ([("cuda:0", "cpu")] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return write_assets(tmp_path_factory.mktemp("device_map"))


@pytest.mark.skipif(not DEVICE_PAIRS, reason="needs CUDA (two devices, or one beside the CPU)")
@pytest.mark.parametrize("devices", DEVICE_PAIRS or [None], ids=lambda pair: "-".join(pair) if pair else "none")
@pytest.mark.parametrize("case", kvpress_hooks.cases(CASES, KVPRESS_HOOK_CASES))
def test_layer_state_stays_on_its_layers_device(assets, devices, case):
    model_dir, surrogates = assets
    first, second = devices
    device_map = {"model.embed_tokens": first, "model.rotary_emb": first, "model.layers.0": first,
                  "model.layers.1": second, "model.norm": second, "lm_head": second}
    # accelerate reads "cpu" beside a GPU as offloading (weights kept on the CPU, the layer run on the GPU) unless the
    # main device is the CPU: then every module runs where the map puts it.
    split = dispatch_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), device_map,
                           main_device="cpu" if "cpu" in devices else None)
    whole = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(first).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        got, expected = run_case(split, tokenizer, case, surrogates), run_case(whole, tokenizer, case, surrogates)
    assert [layer["devices"] for layer in got["layers"]] == [[first], [second]]
    assert got["tokens"].tolist() == expected["tokens"].tolist()
    for layer, reference in zip(got["layers"], expected["layers"]):
        for name in ("keys", "values", "log_weights"):
            if reference[name] is not None:
                torch.testing.assert_close(layer[name], reference[name], atol=2e-4, rtol=2e-4)
