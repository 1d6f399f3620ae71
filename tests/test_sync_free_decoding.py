"""A decoding step with each decoding press calls no operator that makes the host wait for the device, checked on the
CPU at every CI run (the CUDA-graph replay in ``test_cuda_graphs.py`` proves the same on a GPU, where one is lent).

A sync in a decoding step costs a round trip per layer and token and rules out capturing the step in a CUDA graph
(issue 20). On the CPU nothing waits, so the step runs under a dispatch mode that records every ATen operator whose
CUDA implementation copies a result to the host: ``.item()``, ``int()``/``bool()``/``float()`` of a tensor
(``_local_scalar_dense``), ``nonzero``, ``torch.where(condition)``, ``torch.equal``, indexing by a boolean mask,
``unique``, ``repeat_interleave`` without an output size; and the copies to the host no operator shows on a CPU
(``.tolist()``, ``.cpu()``, ``.numpy()``, ``.to("cpu")``). It sees what the Python side of a press and of the
attention path calls, and each kvcomp op as one call; what a kvcomp op's CUDA kernel does inside it, and a copy by
``.to(torch.device("cpu"))`` (on a CPU run indistinguishable from ``.to(x.device)``), are the graph test's to check.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.decoding_step import PRESSES, compressed_prompt, make_model, step, visible

aten = torch.ops.aten
# Operators whose CUDA kernels read a device value on the host (to size their output or to answer a Python scalar).
# Under inference mode some composites reach the mode whole rather than as the operators they call: .item() as
# aten.item, torch.where(condition) as where.default, nonzero(as_tuple=True) as nonzero_numpy.
SYNCING = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.nonzero, aten.nonzero_numpy, aten.argwhere,
           aten.equal, aten.allclose, aten.masked_select, aten.unique_dim, aten._unique, aten._unique2,
           aten.unique_consecutive, aten.repeat_interleave, aten.bincount, aten.histc}
# Overloads that sync where their siblings do not: where with a condition only, narrow with a tensor start.
SYNCING_OVERLOADS = {aten.where.default, aten.narrow.Tensor}
# Operators that sync only when one of their indices is a boolean mask (turned into positions with nonzero).
SYNCING_WITH_BOOLEAN_INDEX = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
# Copies to the host, which no operator shows on a CPU (the tensors are there already): the Tensor methods are watched.
HOST_COPIES = ("tolist", "cpu", "numpy")


def _has_boolean_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in indices or ())


class RecordSyncs(TorchDispatchMode):
    """Records the operators called inside it that would sync on a GPU, and the copies to the host."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []
        self._patched: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if (packet in SYNCING or func in SYNCING_OVERLOADS
                or (packet in SYNCING_WITH_BOOLEAN_INDEX and _has_boolean_index(args))):
            if not (packet is aten.repeat_interleave and (kwargs or {}).get("output_size") is not None):
                self.calls.append(str(func))
        return func(*args, **(kwargs or {}))

    def _watch(self, name: str, copies_to_host=lambda *args, **kwargs: True):
        method = getattr(torch.Tensor, name)

        def watched(tensor, *args, **kwargs):
            if copies_to_host(*args, **kwargs):
                self.calls.append(f"Tensor.{name}")
            return method(tensor, *args, **kwargs)

        self._patched[name] = method
        setattr(torch.Tensor, name, watched)

    def __enter__(self):
        for name in HOST_COPIES:
            self._watch(name)
        self._watch("to", lambda *args, **kwargs: _to_host(args, kwargs))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._patched.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)


def _to_host(args, kwargs) -> bool:
    """Whether Tensor.to(*args, **kwargs) names the CPU by a string ("cpu"). A torch.device is left alone: on a CPU
    run, ``.to(x.device)`` (transformers' rotary tables, for one) names the CPU too, and on a GPU names the GPU."""
    device = kwargs.get("device", next((a for a in args if isinstance(a, str)), None))
    return isinstance(device, str) and torch.device(device).type == "cpu"


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
        torch.where(x > 2), torch.nonzero(x, as_tuple=True), x.narrow(0, torch.tensor(1), 2)
        x.tolist(), x.cpu(), x.numpy(), x.to("cpu"), x.to(device="cpu")
    assert len(syncs.calls) == 17, syncs.calls
    with torch.inference_mode(inference_mode), RecordSyncs() as syncs:
        torch.topk(x, 2), x.masked_fill(x > 2, 0.0), x[torch.tensor([0, 2])], torch.where(x > 1, x, 0.0)
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3), x.narrow(0, 1, 2), x.to(torch.float64)
        x.to(x.device)
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
