"""A decoding step with each decoding press calls no operator that makes the host wait for the device, checked on the
CPU at every CI run (the CUDA-graph replay in ``test_cuda_graphs.py`` proves the same on a GPU, where one is lent).

A sync in a decoding step costs a round trip per layer and token and rules out capturing the step in a CUDA graph
(issue 20). On the CPU nothing waits, so the step runs under a dispatch mode that records every ATen operator whose
CUDA implementation copies a result to the host: ``.item()``, ``int()``/``bool()``/``float()`` of a tensor
(``_local_scalar_dense``), ``nonzero``, ``torch.where(condition)``, ``torch.equal``, indexing by a boolean mask,
``unique``, ``repeat_interleave`` without an output size; the copies to the host no operator shows on a CPU
(``.tolist()``, ``.cpu()``, ``.numpy()``, ``.to("cpu")``); and a copy to the device without ``non_blocking=True``,
which waits for all the work queued there.

Such a call syncs only when it reads a tensor that lives on the device. On a CPU both kinds share one memory, so the
mode follows where each tensor would live on a GPU: a tensor made with a ``device`` argument, or computed from one
that lives on the device, or made before the mode (the model's weights), is a device tensor; one made without a
device (a PagedKVCache's block tables and lengths, kept on the host by design) and what is computed from such tensors
alone is a host tensor, which Python reads for free. ``.to(device)``, a no-op on a CPU, makes a device tensor.

The mode sees what the Python side of a press and of the attention path calls, and each kvcomp op as one call; what
a kvcomp op's CUDA kernel does inside it is the graph test's to check.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary
from transformers import DynamicCache

from kvpress_cpp.paged_cache import PagedKVCache
from kvpress_cpp.presses import GVotePress, KeepKVPress, WeightedKVPress, ZSMergePress
from tests.decoding_step import PRESSES, PROMPT, compressed_prompt, make_model, step, visible

aten = torch.ops.aten
# Operators whose CUDA kernels read a device value on the host (to size their output or to answer a Python scalar).
# Under inference mode some composites reach the mode whole rather than as the operators they call: .item() as
# aten.item, torch.where(condition) as where.default, nonzero(as_tuple=True) as nonzero_numpy.
SYNCING = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.nonzero, aten.nonzero_numpy, aten.argwhere,
           aten.equal, aten.allclose, aten.masked_select, aten.unique_dim, aten._unique, aten._unique2,
           aten.unique_consecutive, aten.repeat_interleave, aten.bincount, aten.histc}
# Overloads that sync where their siblings do not: where with a condition only, narrow with a tensor start.
SYNCING_OVERLOADS = {aten.where.default, aten.narrow.Tensor}
# Operators that sync only when one of their indices is a boolean mask on the device (turned into positions with
# nonzero there; a mask on the host is turned into positions on the host and copied over).
SYNCING_WITH_BOOLEAN_INDEX = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
# Copies to the host, which no operator shows on a CPU (the tensors are there already): the Tensor methods are watched.
HOST_COPIES = ("tolist", "cpu", "numpy")


class RecordSyncs(TorchDispatchMode):
    """Records the calls inside it that would read a device tensor back to the host, while ``recording`` is set;
    follows where each tensor would live from the moment it is entered."""

    def __init__(self, recording: bool = True):
        super().__init__()
        self.calls: list[str] = []
        self.recording = recording
        self._on_host = WeakTensorKeyDictionary()
        self._patched: dict[str, object] = {}
        self._in_method = False

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor not in self._on_host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if self.recording and self._syncs(func, args, kwargs, inputs):
            self.calls.append(str(func))
        result = func(*args, **kwargs)
        if kwargs.get("device") is None and not any(self.on_device(tensor) for tensor in inputs):
            self.place_on_host(result)
        return result

    def place_on_host(self, result) -> None:
        for tensor in tree_leaves(result):
            if isinstance(tensor, torch.Tensor):
                self._on_host[tensor] = True

    def _syncs(self, func, args, kwargs, inputs) -> bool:
        packet = func.overloadpacket
        if packet in SYNCING_WITH_BOOLEAN_INDEX:
            indices = args[1] if len(args) > 1 else ()
            return any(isinstance(index, torch.Tensor) and index.dtype == torch.bool and self.on_device(index)
                       for index in indices or ())
        if packet is aten.repeat_interleave and kwargs.get("output_size") is not None:
            return False
        if packet is aten.copy_:  # into a host tensor from a device one (``host[...] = x``, ``host.copy_(x)``)
            return (len(args) > 1 and isinstance(args[1], torch.Tensor) and not self.on_device(args[0])
                    and self.on_device(args[1]))
        return (packet in SYNCING or func in SYNCING_OVERLOADS) and any(self.on_device(tensor) for tensor in inputs)

    def _watch(self, name: str, replacement):
        self._patched[name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, replacement)

    def __enter__(self):
        for name in HOST_COPIES:
            self._watch(name, self._watched(getattr(torch.Tensor, name), lambda *args, **kwargs: True, name))
        self._watch("to", self._watched(torch.Tensor.to, _names_the_host, "to"))
        self._factories = _FactoriesWithoutDevice(self)
        self._factories.__enter__()
        return super().__enter__()

    def _watched(self, method, copies_to_host, name: str):
        """`method` recording a copy of a device tensor to the host where copies_to_host(*args, **kwargs); what it
        returns is placed where the call names (on a CPU, ``.cpu()`` and ``.to(device)`` return the tensor itself)."""
        def watched(tensor, *args, **kwargs):
            if self._in_method:  # the function mode hands the call back to the patched method
                return method(tensor, *args, **kwargs)
            to_host = copies_to_host(*args, **kwargs)
            if to_host and self.recording and self.on_device(tensor):
                self.calls.append(f"Tensor.{name}")
            self._in_method = True
            try:
                result = method(tensor, *args, **kwargs)
            finally:
                self._in_method = False
            if not isinstance(result, torch.Tensor):
                return result
            if to_host or (name == "to" and _device(args, kwargs) is not None and not self.on_device(tensor)):
                if not to_host and self.recording and not kwargs.get("non_blocking", False):
                    self.calls.append("Tensor.to(device) without non_blocking")  # a copy that waits for the stream
                if result is tensor:  # no copy on a CPU: a tensor of its own, so that it can be placed apart
                    result = tensor.clone(memory_format=torch.preserve_format)
                if to_host:
                    self._on_host[result] = True
                else:
                    self._on_host.pop(result, None)
            return result
        return watched

    def __exit__(self, *exc):
        for name, method in self._patched.items():
            setattr(torch.Tensor, name, method)
        result = super().__exit__(*exc)
        self._factories.__exit__(*exc)
        return result


def _device(args, kwargs):
    """The device a Tensor.to(*args, **kwargs) call names, None when it names none."""
    return kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))


def _names_the_host(*args, **kwargs) -> bool:
    """Whether Tensor.to(*args, **kwargs) names the CPU by a string ("cpu"), a copy to the host on a GPU too. A
    torch.device is read as the device: on a CPU run ``.to(x.device)`` names the CPU too."""
    device = _device(args, kwargs)
    return isinstance(device, str) and torch.device(device).type == "cpu"


class _FactoriesWithoutDevice(TorchFunctionMode):
    """Marks what a factory call made without naming a device (``torch.arange(n)``, ``torch.tensor(data)``) as a host
    tensor: dispatch sees the default device filled in, the same as a device named."""

    def __init__(self, recorder: RecordSyncs):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if kwargs.get("device") is None and not any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(args)):
            self.recorder.place_on_host(result)
        return result


@pytest.fixture(scope="module")
def model():
    return make_model("cpu", torch.float32)


@pytest.mark.parametrize("inference_mode", [False, True])
def test_the_recorder_sees_each_kind_of_sync(inference_mode):
    """The detector itself: each way Python code reads a device value back is recorded, sync-free code is not, and
    neither is any read of a host tensor."""
    with torch.inference_mode(inference_mode), RecordSyncs() as syncs:
        x = torch.arange(6.0, device="cpu")
        x.sum().item(), int(x[0]), bool(x[1] > 0), torch.equal(x, x), x[x > 2], x.nonzero(), x.unique()
        torch.repeat_interleave(torch.tensor([1, 2]).to(x.device, non_blocking=True))
        y = x.clone()
        # values, not a number: torch 2.15 fills ``y[mask] = 0.0`` with masked_fill_ (sync-free); 2.14 ran index_put_
        y[x > 3] = x[:2]
        torch.where(x > 2), torch.nonzero(x, as_tuple=True), x.narrow(0, torch.ones((), dtype=torch.long, device="cpu"), 2)
        x.tolist(), x.cpu(), x.numpy(), x.to("cpu"), x.to(device="cpu")
        on_host = torch.zeros(6)
        on_host.copy_(x), on_host.__setitem__(slice(0, 2), x[:2])
    assert len(syncs.calls) == 19, syncs.calls
    with torch.inference_mode(inference_mode), RecordSyncs() as syncs:
        x = torch.arange(6.0, device="cpu")
        torch.topk(x, 2), x.masked_fill(x > 2, 0.0), x[torch.tensor([0, 2])], torch.where(x > 1, x, 0.0)
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3), x.narrow(0, 1, 2), x.to(torch.float64)
        x.to(x.device)
        on_host = torch.arange(6) * 2
        on_host.sum().item(), int(on_host[0]), bool((on_host > 0).all()), on_host.nonzero(), on_host.tolist()
        x[on_host > 4], torch.tensor([1, 2]).tolist(), torch.full((2,), 3).max().item()
        x.copy_(on_host), on_host.copy_(on_host * 2), on_host.to(x.device, non_blocking=True).copy_(x)
    assert syncs.calls == []
    with RecordSyncs() as syncs:
        moved = (torch.arange(6) * 2).to(torch.device("cpu"), non_blocking=True)
        int(moved[0]), moved.tolist()
        torch.arange(6).to(torch.device("cpu"))  # a blocking copy to the device waits for the work queued there
    assert syncs.calls == ["aten._local_scalar_dense.default", "Tensor.tolist",
                           "Tensor.to(device) without non_blocking"], syncs.calls


# Every decoding press on both caches. On a PagedKVCache the presses that merge down to a fixed budget keep every
# slot they are given, so the layer stores their step without looking for slots to drop; KVzap's step reads back
# whether it found its slots only until a pass finds every row's last slots in order (the first decoding pass here).
CASES = [(name, kind) for kind in (DynamicCache, PagedKVCache) for name in sorted(PRESSES)]


def record_a_step(model, name: str, cache, tmp_path, press=None) -> list[str]:
    """The syncs of one decoding step of the press (PRESSES[name] unless given) over a prompt it compressed into
    `cache`, after two steps."""
    press = press or PRESSES[name](model, tmp_path)
    with torch.inference_mode(), press(model), RecordSyncs(recording=False) as syncs:
        cache = compressed_prompt(model, name, cache)
        step(model, torch.tensor([[3], [4]], device=model.device), cache, visible(model, cache.get_seq_length() + 1))
        slots = cache.get_seq_length()
        syncs.recording = True
        step(model, torch.tensor([[5], [7]], device=model.device), cache, visible(model, slots + 1))
    return syncs.calls


@pytest.mark.parametrize("name,cache_type", CASES, ids=[f"{name}-{kind.__name__}" for name, kind in CASES])
def test_a_decoding_step_waits_on_nothing(model, name, cache_type, tmp_path):
    calls = record_a_step(model, name, cache_type(), tmp_path)
    assert calls == [], f"{name}'s decoding step syncs the host: {calls}"


# KVzap's compacting step (one in compaction_slack) reads back one thing per layer, as README lists: its longest head
# on a DynamicCache, the mask of its dead slots on a PagedKVCache (whose blocks are handed back on the host).
COMPACTION_READ_BACK = {DynamicCache: "aten.item.default", PagedKVCache: "Tensor.cpu"}


@pytest.mark.parametrize("cache_type", list(COMPACTION_READ_BACK), ids=lambda kind: kind.__name__)
def test_kvzaps_compacting_step_reads_back_one_value_per_layer(model, cache_type, tmp_path):
    press = PRESSES["KVzap"](model, tmp_path)
    press.compaction_slack = 1
    calls = record_a_step(model, "KVzap", cache_type(), tmp_path, press)
    assert calls == [COMPACTION_READ_BACK[cache_type]] * model.config.num_hidden_layers, calls


# A prompt shorter than the budget: the merging presses' steps append without merging (ZSMerge and WeightedKV hand back
# the view's own keys and values), on a PagedKVCache as on a DynamicCache without a read back.
UNDER_BUDGET = {
    "ZSMerge": lambda: ZSMergePress(budget=200),
    "WeightedKV": lambda: WeightedKVPress(cache_size=200, recent=8),
    "KeepKV": lambda: KeepKVPress(budget=200, recent=8),
}
UNDER_BUDGET_CASES = [(name, kind) for kind in (DynamicCache, PagedKVCache) for name in sorted(UNDER_BUDGET)]


@pytest.mark.parametrize("name,cache_type", UNDER_BUDGET_CASES,
                         ids=[f"{name}-{kind.__name__}" for name, kind in UNDER_BUDGET_CASES])
def test_a_step_under_the_budget_waits_on_nothing(model, name, cache_type):
    press, cache = UNDER_BUDGET[name](), cache_type()
    prompt = torch.randint(2, model.config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), press(model), RecordSyncs(recording=False) as syncs:
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        for token in ([[3], [4]], [[5], [7]]):
            slots = cache.get_seq_length()
            syncs.recording = token == [[5], [7]]  # the second step, over what the first one stored
            step(model, torch.tensor(token, device=model.device), cache, visible(model, slots + 1))
    assert cache.get_seq_length() == PROMPT + 2  # nothing merged
    assert syncs.calls == [], f"{name}'s decoding step under its budget syncs the host: {syncs.calls}"


@pytest.mark.parametrize("cache_type", [DynamicCache, PagedKVCache], ids=lambda kind: kind.__name__)
def test_a_prefill_only_press_step_waits_on_nothing(model, cache_type):
    """GVote compresses the prompt only, each head to its own length: a decoding step reads its state (on a paged
    layer, a view of heads of different lengths) and compresses nothing, without a read back."""
    cache = cache_type()
    prompt = torch.randint(2, model.config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    # (the random model attends almost evenly: a small nucleus leaves its heads of different lengths)
    with torch.inference_mode(), GVotePress(nucleus_p=0.3)(model), RecordSyncs(recording=False) as syncs:
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        for token in ([[3], [4]], [[5], [7]]):
            slots = cache.get_seq_length()
            syncs.recording = token == [[5], [7]]
            step(model, torch.tensor(token, device=model.device), cache, visible(model, slots + 1))
    if cache_type is PagedKVCache:
        assert any(len(set(layer.lengths.flatten().tolist())) > 1 for layer in cache.layers)  # heads of their own
    assert syncs.calls == [], f"GVote's decoding step syncs the host: {syncs.calls}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("name", sorted(PRESSES))
def test_a_paged_decoding_step_waits_on_nothing_on_cuda(name, tmp_path):
    """On a GPU, PyTorch's sync debug mode raises at any wait for the device, inside a kvcomp op too (which the
    recorder above cannot see). A paged step cannot be replayed from a CUDA graph (the cache uploads its tables when
    they change), so this is its check on the device."""
    model = make_model("cuda", torch.float32)
    press = PRESSES[name](model, tmp_path)
    with torch.inference_mode(), press(model):
        cache = compressed_prompt(model, name, PagedKVCache())
        step(model, torch.tensor([[3], [4]], device="cuda"), cache, visible(model, cache.get_seq_length() + 1))
        token, mask = torch.tensor([[5], [7]], device="cuda"), visible(model, cache.get_seq_length() + 1)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(model, token, cache, mask)
        finally:
            torch.cuda.set_sync_debug_mode("default")
