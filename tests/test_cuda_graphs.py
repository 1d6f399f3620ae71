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

from tests.decoding_step import PRESSES, compressed_prompt, layer_tensors, make_model, step, visible

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture(scope="module")
def model():
    return make_model("cuda", torch.bfloat16)


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_decoding_step_replays_as_eager(model, name, tmp_path):
    press = PRESSES[name](model, tmp_path)
    with torch.inference_mode(), press(model):
        prefilled = compressed_prompt(model, name)
        length = prefilled.get_seq_length()
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
