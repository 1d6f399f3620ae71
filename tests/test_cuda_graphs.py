"""A decoding step with each decoding press, captured in a CUDA graph and replayed, equals the same step run eagerly.

Capture fails on any host sync (``.item()``, ``.cpu()``, ``nonzero``, ``int(tensor)``), so these tests also prove that
the decoding step of every press, and every op it runs, waits on nothing. The step is a whole model forward of one
new token over a compressed cache (attention over the log-weights, the press's forward hook, the compaction), on a
random GQA Llama. The graph is captured with one token and replayed with another copied into the same input buffer;
its logits and the layers it leaves behind must equal an eager step with that token from the same cache. Skipped
without CUDA (the CPU suite checks the same presses' decoding against their references).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvpress_cpp.cache import attach, get_state
from kvpress_cpp.presses.keepkv import KeepKVPress
from kvpress_cpp.presses.kvzap import KVzapThresholdPress
from kvpress_cpp.presses.weightedkv import WeightedKVPress
from kvpress_cpp.presses.zsmerge import ZSMergePress
from tests.test_kvzap_press import write_surrogate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

PROMPT = 96
PRESSES = {  # name -> press for (model, a scratch directory)
    "ZSMerge": lambda model, path: ZSMergePress(budget=32),
    "WeightedKV": lambda model, path: WeightedKVPress(cache_size=32, recent=8),
    "KeepKV": lambda model, path: KeepKVPress(budget=32, recent=8),
    # The captured step is one of the many that do not compact (those read the longest head back).
    "KVzap": lambda model, path: KVzapThresholdPress(threshold=0.0, sliding_window=16, model_type="linear",
                                                     surrogate_dir=write_surrogate(path, model, "linear", scale=4.0),
                                                     compaction_slack=1000),
}


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
                         attn_implementation="eager", bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


def layer_tensors(cache: DynamicCache) -> list[torch.Tensor]:
    """Every tensor a decoding step reads or leaves: keys, values, log-weights and per-slot state of each layer."""
    tensors = []
    for layer in cache.layers:
        state = get_state(layer)
        tensors += [layer.keys, layer.values, state.log_weights, *state.per_slot.values()]
        tensors += [value for value in state.counters.values() if isinstance(value, torch.Tensor)]
    return tensors


def step(model, token: torch.Tensor, cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """One forward of `token` over `cache`. The attention layers are pointed at this cache's layers first: they
    honour the state of the cache the press last wrote, and the tests hold several copies."""
    for decoder_layer, cache_layer in zip(model.model.layers, cache.layers, strict=True):
        attach(decoder_layer.self_attn, cache_layer)
    # A prepared 4-D mask is used as it is: transformers' own mask building copies a host scalar to the device
    # (transformers 5's eager_mask), which a capture refuses.
    return model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True).logits


def visible(model, slots: int) -> torch.Tensor:
    """The additive 4-D mask (B=2, 1, 1, slots) of a decoding step that sees every slot."""
    return torch.zeros(2, 1, 1, slots, dtype=model.dtype, device="cuda")


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_decoding_step_replays_as_eager(model, name, tmp_path):
    press = PRESSES[name](model, tmp_path)
    prompt = torch.randint(2, model.config.vocab_size, (2, PROMPT), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(1))
    with torch.inference_mode(), press(model):
        prefilled = DynamicCache()
        model(input_ids=prompt, past_key_values=prefilled, use_cache=True)
        # One eager decoding step first: the cache then holds the press's decoding layout (ZSMerge's regions), the
        # shapes every later step keeps.
        step(model, prompt[:, -1:], prefilled, visible(model, PROMPT + 1))
        length = prefilled.get_seq_length()
        assert length < PROMPT, f"{name} did not compress the prompt"
        mask = visible(model, length + 1)
        first, second = torch.tensor([[5], [7]], device="cuda"), torch.tensor([[11], [13]], device="cuda")

        # Warm-up on a side stream, as torch.cuda.graphs asks (lazy initialisations stay out of the capture).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(model, first, copy.deepcopy(prefilled), mask)
        torch.cuda.current_stream().wait_stream(side)

        captured = copy.deepcopy(prefilled)
        inputs = layer_tensors(captured)  # the graph reads these buffers: keep them alive past the capture
        token = first.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step(model, token, captured, mask)
        token.copy_(second)
        graph.replay()
        torch.cuda.synchronize()

        eager_cache = copy.deepcopy(prefilled)
        expected = step(model, second, eager_cache, mask)
    assert len(inputs) > 0
    torch.testing.assert_close(logits, expected)
    for got, want in zip(layer_tensors(captured), layer_tensors(eager_cache), strict=True):
        torch.testing.assert_close(got, want)
