"""A decoding step with each decoding press calls no operator that makes the host wait for the device, checked on the
CPU at every CI run (the CUDA-graph replay in ``test_cuda_graphs.py`` proves the same on a GPU, where one is lent).

A sync in a decoding step costs a round trip per layer and token and rules out capturing the step in a CUDA graph
(issue 20). On the CPU nothing waits, so the step runs under a dispatch mode that records every ATen operator whose
CUDA implementation copies a result to the host: ``.item()``, ``int()``/``bool()``/``float()`` of a tensor
(``_local_scalar_dense``), ``nonzero``, ``torch.equal``, indexing by a boolean mask, ``unique``, ``repeat_interleave``
without an output size. It sees what the Python side of a press and of the attention path calls, and each kvcomp op as
one call; what a kvcomp op's CUDA kernel does inside it is the graph test's to check.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.decoding_step import PRESSES, compressed_prompt, make_model, step, visible

aten = torch.ops.aten
# Operators whose CUDA kernels read a device value on the host (to size their output or to answer a Python scalar).
# Under inference mode, .item() reaches the mode as aten.item, outside it as _local_scalar_dense.
SYNCING = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.nonzero, aten.argwhere, aten.equal, aten.allclose,
           aten.masked_select, aten.unique_dim, aten._unique, aten._unique2, aten.unique_consecutive,
           aten.repeat_interleave, aten.bincount, aten.histc}
# Operators that sync only when one of their indices is a boolean mask (turned into positions with nonzero).
SYNCING_WITH_BOOLEAN_INDEX = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _has_boolean_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in indices or ())


class RecordSyncs(TorchDispatchMode):
    """Records the operators called inside it that would sync on a GPU."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in SYNCING or (packet in SYNCING_WITH_BOOLEAN_INDEX and _has_boolean_index(args)):
            if not (packet is aten.repeat_interleave and (kwargs or {}).get("output_size") is not None):
                self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model():
    return make_model("cpu", torch.float32)


@pytest.mark.parametrize("inference_mode", [False, True])
def test_the_recorder_sees_each_kind_of_sync(inference_mode):
    """The detector itself: each way Python code reads a device value back is recorded, sync-free code is not."""
    with torch.inference_mode(inference_mode), RecordSyncs() as syncs:
        x = torch.arange(6.0)
        x.sum().item(), int(x[0]), bool(x[1] > 0), torch.equal(x, x), x[x > 2], x.nonzero(), x.unique()
        torch.repeat_interleave(torch.tensor([1, 2]))
        y = x.clone()
        y[x > 3] = 0.0
    assert len(syncs.calls) == 9, syncs.calls
    with torch.inference_mode(inference_mode), RecordSyncs() as syncs:
        torch.topk(x, 2), x.masked_fill(x > 2, 0.0), x[torch.tensor([0, 2])], torch.where(x > 1, x, 0.0)
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)
    assert syncs.calls == []


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_a_decoding_step_waits_on_nothing(model, name, tmp_path):
    press = PRESSES[name](model, tmp_path)
    with torch.inference_mode(), press(model):
        cache = compressed_prompt(model, name)
        slots = cache.get_seq_length()
        with RecordSyncs() as syncs:
            step(model, torch.tensor([[5], [7]]), cache, visible(model, slots + 1))
    assert syncs.calls == [], f"{name}'s decoding step syncs the host: {syncs.calls}"
