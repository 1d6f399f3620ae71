"""Presses on a tensor-parallel model (transformers' ``from_pretrained(..., tp_plan="auto")`` under ``torchrun``).

transformers shards the q/k/v projections of every attention layer column-wise over the ranks of its tensor-parallel
mesh: with N ranks, rank r computes query heads [r·Hq/N, (r+1)·Hq/N) and kv heads [r·H/N, (r+1)·H/N), and its cache
holds only those kv heads. The attention input (hidden states) is replicated on every rank. Our presses act per kv
head, so each rank compresses its own heads; what they must not do is read a head count from ``module.config``
(global) and apply it to the keys (local), or report a figure that covers only one rank's heads. This module says
which heads a layer holds and gathers per-head figures over the ranks.

The shard is read from the layer's weights, not from the process group, so a model loaded without ``tp_plan`` in a
distributed job is treated as unsharded. transformers 4.5x and >= 5.3 keep a sharded weight as a ``DTensor``, which
carries its mesh; 5.0-5.2 (kvpress's range includes them) keep a plain local tensor, whose rows are a fraction of
the configured heads', and the mesh on the model (``model._device_mesh``), which a press notes for each attention
layer when it enters its context (:func:`check_tensor_parallel`).
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
from kvpress.utils import get_prerope_query_states
from torch import nn

__all__ = ["kv_head_shard", "gather_kv_heads", "query_group_size", "prerope_query_states", "check_tensor_parallel",
           "model_tensor_parallel_mesh"]


#: An attention layer's key projection: separate, or packed with the queries and values (Phi-3).
_KEY_PROJECTIONS = ("k_proj", "qkv_proj")

#: attention layer → its model's tensor-parallel mesh, noted by :func:`check_tensor_parallel` for the transformers
#: versions whose sharded weights are plain local tensors.
_LAYER_MESHES: WeakKeyDictionary = WeakKeyDictionary()


def _tensor_parallel_mesh(module: nn.Module):
    """The tensor-parallel mesh over which attention layer `module`'s projections are column-sharded, or None when
    the layer is unsharded."""
    from torch.distributed.tensor import DTensor, Shard

    # Read through the modules' dicts where they have them (kvpress's tests pass stand-ins that do not):
    # nn.Module.__getattr__ costs 1 µs a lookup and 2-3 µs a missing name (a raised AttributeError), twice per layer
    # and decoding step.
    submodules = getattr(module, "_modules", None)
    for name in _KEY_PROJECTIONS:
        projection = submodules.get(name) if submodules is not None else getattr(module, name, None)
        if projection is None:
            continue
        parameters = getattr(projection, "_parameters", None) or {}
        weight = parameters["weight"] if "weight" in parameters else getattr(projection, "weight", None)
        if isinstance(weight, DTensor):
            return weight.device_mesh if any(isinstance(p, Shard) for p in weight.placements) else None
        mesh = _LAYER_MESHES.get(module) if _LAYER_MESHES else None
        if mesh is None or weight is None:
            return None
        config, packed = module.config, name == "qkv_proj"  # a packed projection's rows: q, k and v heads
        heads = config.num_key_value_heads + (config.num_attention_heads + config.num_key_value_heads if packed else 0)
        return mesh if weight.shape[0] < heads * module.head_dim else None
    return None


def kv_head_shard(module: nn.Module) -> tuple[int, int] | None:
    """(first, stop): the model's kv heads that this process holds for attention layer `module`, or None when the
    layer is not sharded (it holds every head)."""
    mesh = _tensor_parallel_mesh(module)
    if mesh is None:
        return None
    per_rank = module.config.num_key_value_heads // mesh.size()
    first = mesh.get_local_rank() * per_rank
    return first, first + per_rank


def gather_kv_heads(tensor: torch.Tensor, module: nn.Module, dim: int) -> torch.Tensor:
    """`tensor`'s per-head figures of every rank, in model head order along `dim` (one all-gather over the layer's
    tensor-parallel group); `tensor` itself when the layer is not sharded. Every rank must call it."""
    mesh = _tensor_parallel_mesh(module)
    if mesh is None:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(mesh.size())]
    dist.all_gather(parts, tensor.contiguous(), group=mesh.get_group())
    return torch.cat(parts, dim=dim)


def query_group_size(module: nn.Module) -> int:
    """Query heads per kv head, from the model's configuration: the same on every rank, since each holds H/N kv heads
    and Hq/N query heads (a count of local kv heads against the global query heads would be N times too large)."""
    return module.config.num_attention_heads // module.config.num_key_value_heads


def prerope_query_states(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """kvpress's ``get_prerope_query_states`` (B, Hq, T, d) for the query heads this process holds: kvpress reshapes
    the projection to ``config.num_attention_heads`` heads, while a sharded ``q_proj`` returns Hq/N of them."""
    if _tensor_parallel_mesh(module) is None:
        return get_prerope_query_states(module, hidden_states)
    if not hasattr(module, "q_proj"):
        raise NotImplementedError(f"kvpress_cpp: no query projection to read on a sharded {type(module).__name__}")
    queries = module.q_proj(hidden_states).view(*hidden_states.shape[:2], -1, module.head_dim).transpose(1, 2)
    q_norm = getattr(module, "q_norm", None)  # Qwen3, Gemma3: per-head norm, replicated on every rank
    return q_norm(queries) if q_norm is not None else queries


def model_tensor_parallel_mesh(model: nn.Module):
    """The tensor-parallel mesh of `model` (one dimension, its ranks the kv head shards), or None. transformers
    before 5.24 keeps it as ``model._device_mesh``; 5.24 keeps there the model's whole ("pp", "fsdp", "tp") mesh,
    whose "tp" dimension it is (its sharded weights are ``DTensor``s on that one)."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is not None and mesh.ndim > 1:
        names = mesh.mesh_dim_names or ()
        mesh = mesh["tp"] if "tp" in names else None
    return mesh


def check_tensor_parallel(press_name: str, model: nn.Module, unsupported: str | None = None) -> None:
    """Raise a ValueError naming the press when `model` is tensor-parallel and the press cannot run on it: the kv or
    query heads do not split evenly over the ranks, or `unsupported` gives the press's own reason. Otherwise note the
    model's mesh for its attention layers, where their weights do not carry it."""
    ranks = getattr(model, "tp_size", None) or 1
    if ranks == 1:
        return
    config = model.config.get_text_config()
    for what in ("num_key_value_heads", "num_attention_heads"):
        heads = getattr(config, what)
        if heads % ranks:
            raise ValueError(f"{press_name}: the model has {heads} {what.removeprefix('num_').replace('_', ' ')}, "
                             f"which do not split evenly over {ranks} tensor-parallel ranks; run it on a number of "
                             f"ranks that divides {heads}")
    if unsupported is not None:
        raise ValueError(f"{press_name} cannot run on a tensor-parallel model ({ranks} ranks): {unsupported}")
    mesh = model_tensor_parallel_mesh(model)
    if mesh is not None:
        for module in model.modules():
            if any(name in module._modules for name in _KEY_PROJECTIONS):
                _LAYER_MESHES[module] = mesh
