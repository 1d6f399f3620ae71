"""A press's per-slot state on a DynamicCache's layer follows transformers' batch rearrangements (beam search's
reorder_cache, batch_repeat_interleave, batch_select_indices) row for row, as the layer's keys and values do."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvpress_cpp.cache import LayerState, get_state, rearrange_batch, set_state


def _cache_with_state(batch: int, heads: int = 2, slots: int = 5, dim: int = 3):
    """A one-layer cache whose row b is filled with b (keys, values) and whose state tensors say b too."""
    cache = DynamicCache()
    rows = torch.arange(batch, dtype=torch.float32).view(batch, 1, 1, 1)
    keys = rows.expand(batch, heads, slots, dim).clone()
    cache.update(keys, keys.clone(), 0)
    layer = cache.layers[0]
    marks = rows.view(batch, 1, 1).expand(batch, heads, slots).clone()
    set_state(layer, LayerState(marks.clone(), {"scores": marks.clone()},
                                {"tokens": torch.arange(batch) * 10, "step": 7}, value_probe=keys[..., 0].clone()))
    return cache, layer


@pytest.mark.parametrize("how, argument, rows", [
    ("batch_repeat_interleave", 2, [0, 0, 1, 1, 2, 2]),
    ("batch_repeat_interleave", 3, [0, 0, 0, 1, 1, 1, 2, 2, 2]),
    ("reorder_cache", torch.tensor([2, 0, 0]), [2, 0, 0]),
    ("batch_select_indices", torch.tensor([0, 2]), [0, 2]),
])
def test_the_state_follows_the_rows_the_layer_keeps(how, argument, rows):
    cache, layer = _cache_with_state(batch=3)
    getattr(cache, how)(argument)
    state = get_state(layer)
    expected_rows = torch.tensor(rows, dtype=torch.float32)
    assert torch.equal(layer.keys[:, 0, 0, 0], expected_rows)  # transformers' own rearrangement of the keys
    for tensor in (state.log_weights, state.per_slot["scores"], state.value_probe):
        assert torch.equal(tensor[:, 0, 0], expected_rows)
        assert tensor.shape[0] == len(rows)
    assert torch.equal(state.counters["tokens"], expected_rows.long() * 10)
    assert state.counters["step"] == 7


def test_cache_bytes_counts_values_of_their_own_head_dim():
    """Keys and values of different head dims (d_v != d, as weightedkv_evict allows): each counted at its size."""
    from kvpress_cpp.cache import cache_bytes

    cache = DynamicCache()
    cache.update(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 16), 0)
    layer = cache.layers[0]
    set_state(layer, LayerState(torch.zeros(1, 2, 5)))
    assert cache_bytes(cache) == 4 * (1 * 2 * 5 * 4 + 1 * 2 * 5 * 16 + 1 * 2 * 5)


def test_slots_append_by_copy_onto_a_tensor_that_requires_grad():
    """append_slots leaves autograd's tensors alone: the cat's copy, the held tensor's allocation untouched."""
    from kvpress_cpp.cache import append_slots

    allocation = torch.zeros(1, 2, 8, 4)
    held = allocation[:, :, :3].requires_grad_()  # room after it, but autograd's
    new = torch.randn(1, 2, 2, 4)
    grown = append_slots(held, new)
    assert torch.equal(grown, torch.cat([held, new], dim=-2))
    assert torch.equal(allocation[:, :, 3:], torch.zeros(1, 2, 5, 4))
    assert grown.untyped_storage().data_ptr() != allocation.untyped_storage().data_ptr()


def test_a_new_prefill_over_a_layer_forgets_the_tokens_a_closed_context_held():
    """state_for_attention on a pass with as many queries as keys (a new prompt over the emptied layer): the state
    and the resume point of the press context that closed over the old prompt both go."""
    from kvpress_cpp.cache import attach, remember_tokens_held, state_for_attention, tokens_held_at_close

    cache, layer = _cache_with_state(batch=1)
    remember_tokens_held(cache, 40)
    assert tokens_held_at_close(layer) == (40, layer.get_seq_length())
    module = torch.nn.Module()
    attach(module, layer)
    slots = layer.keys.shape[-2]
    assert state_for_attention(module, torch.zeros(1, 4, slots, 3), layer.keys) is None
    assert get_state(layer) is None and tokens_held_at_close(layer) is None


def test_batch_rearrangements_run_the_layer_class_s_own_method():
    """A layer's batch method stood in for (our state's rows, kvpress's marks) calls the layer's class's own
    method, not DynamicLayer's: transformers 5.17's DynamicIndexedLayer rearranges its indexer keys in its own."""
    class Tagged(DynamicLayer):
        def batch_repeat_interleave(self, repeats):
            super().batch_repeat_interleave(repeats)
            self.repeated = repeats

    layer = Tagged()
    layer.update(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4))
    rearrange_batch(layer, "batch_repeat_interleave", 3)
    assert layer.repeated == 3 and layer.keys.shape[0] == 6
