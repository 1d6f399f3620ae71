"""One decoding step of each decoding press over a compressed cache, as the CUDA-graph test replays it and the CPU
sync test watches it: a random GQA Llama, a prompt compressed by the press, and one forward of one new token with a
prepared 4-D mask (transformers' own mask building copies a host scalar to the device, transformers 5's eager_mask,
which a capture refuses and which is not the press's doing)."""

from __future__ import annotations

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import Cache

from kvpress_cpp.cache import attach, get_state
from kvpress_cpp.presses.keepkv import KeepKVPress
from kvpress_cpp.presses.kvzap import KVzapThresholdPress
from kvpress_cpp.presses.weightedkv import WeightedKVPress
from kvpress_cpp.presses.zsmerge import ZSMergePress
from tests.test_kvzap_press import write_surrogate

PROMPT = 96
PRESSES = {  # name -> press for (model, a scratch directory)
    "ZSMerge": lambda model, path: ZSMergePress(budget=32),
    "WeightedKV": lambda model, path: WeightedKVPress(cache_size=32, recent=8),
    "KeepKV": lambda model, path: KeepKVPress(budget=32, recent=8),
    # The step is one of the many that do not compact (those read the longest head back).
    "KVzap": lambda model, path: KVzapThresholdPress(threshold=0.0, sliding_window=16, model_type="linear",
                                                     surrogate_dir=write_surrogate(path, model, "linear", scale=4.0),
                                                     compaction_slack=1000),
}


def make_model(device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
                         attn_implementation="eager", bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device, dtype).eval()


def layer_tensors(cache: DynamicCache) -> list[torch.Tensor]:
    """Every tensor a decoding step reads or leaves: keys, values and, under a press, log-weights and per-slot state of
    each layer."""
    tensors = []
    for layer in cache.layers:
        tensors += [layer.keys, layer.values]
        state = get_state(layer)
        if state is None:  # a full cache's layer
            continue
        tensors += [state.log_weights, *state.per_slot.values()]
        tensors += [value for value in state.counters.values() if isinstance(value, torch.Tensor)]
    return tensors


def step(model, token: torch.Tensor, cache: Cache, mask: torch.Tensor) -> torch.Tensor:
    """One forward of `token` over `cache`. The attention layers are pointed at this cache's layers first: they
    honour the state of the cache the press last wrote, and the tests hold several copies."""
    for decoder_layer, cache_layer in zip(model.model.layers, cache.layers, strict=True):
        attach(decoder_layer.self_attn, cache_layer)
    return model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True).logits


def visible(model, slots: int) -> torch.Tensor:
    """The additive 4-D mask (B=2, 1, 1, slots) of a decoding step that sees every slot."""
    return torch.zeros(2, 1, 1, slots, dtype=model.dtype, device=model.device)


def compressed_prompt(model, name: str, cache: Cache | None = None) -> Cache:
    """A batch of two random prompts compressed by the press (inside its context) into `cache` (a new DynamicCache by
    default), then one decoding step: the cache then holds the press's decoding layout (ZSMerge's regions), the
    shapes every later step keeps."""
    prompt = torch.randint(2, model.config.vocab_size, (2, PROMPT), device=model.device,
                           generator=torch.Generator(device=model.device).manual_seed(1))
    cache = DynamicCache() if cache is None else cache
    model(input_ids=prompt, past_key_values=cache, use_cache=True)
    step(model, prompt[:, -1:], cache, visible(model, PROMPT + 1))
    assert cache.get_seq_length() < PROMPT, f"{name} did not compress the prompt"
    return cache
