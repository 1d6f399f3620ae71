"""Presses on a tensor-parallel model (transformers' ``from_pretrained(..., tp_plan="auto")`` under ``torchrun``).

transformers shards the q/k/v projections of every attention layer column-wise over the ranks of its tensor-parallel
mesh: with N ranks, rank r computes query heads [r·Hq/N, (r+1)·Hq/N) and kv heads [r·H/N, (r+1)·H/N), and its cache
holds only those kv heads. The attention input (hidden states) is replicated on every rank. Our presses act per kv
head, so each rank compresses its own heads; what they must not do is read a head count from ``module.config``
(global) and apply it to the keys (local), or report a figure that covers only one rank's heads. This module says
which heads a layer holds and gathers per-head figures over the ranks.

Some plans shard the weights but gather the projection's output on every rank (Phi-3's packed q/k/v, sliced after
the projection, and OLMo-2's q/k norms over all heads: "colwise_rep", "colwise_gather_output"): there every rank holds
every kv head, and the layer counts as unsharded. So the shard is read from what the key projection returns, once per
layer when a press enters its context (:func:`check_tensor_parallel`); a model loaded without ``tp_plan`` in a
distributed job is unsharded. The model's mesh is ``model._device_mesh`` (:func:`model_tensor_parallel_mesh`).
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

#: attention layer → its model's tensor-parallel mesh where the layer's kv heads are split over its ranks, None where
#: every rank holds them all: noted by :func:`check_tensor_parallel` (once a layer: it runs the key projection).
_LAYER_MESHES: WeakKeyDictionary = WeakKeyDictionary()


def _tensor_parallel_mesh(module: nn.Module):
    """The tensor-parallel mesh over whose ranks attention layer `module`'s kv heads are split, or None when every
    rank holds all of them (noted by :func:`check_tensor_parallel`)."""
    return _LAYER_MESHES.get(module) if _LAYER_MESHES else None


def _key_projection_shards_heads(module: nn.Module, projection: nn.Module, packed: bool, model: nn.Module) -> bool:
    """Whether attention layer `module`'s key `projection` returns fewer heads than the model has: its output stays
    column-sharded. One token through it on every rank (a plan gathering the output all-gathers in it)."""
    config = module.config
    heads = config.num_key_value_heads + (config.num_attention_heads + config.num_key_value_heads if packed else 0)
    probe = torch.zeros(1, 1, config.hidden_size, dtype=model.dtype, device=model.device)
    with torch.no_grad():
        return projection(probe).shape[-1] < heads * module.head_dim


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
    """Note which attention layers of `model` split their kv heads over its tensor-parallel ranks; where some do,
    raise a ValueError naming the press when it cannot run so: the kv or query heads do not split evenly over the
    ranks, or `unsupported` gives the press's own reason. Every rank must call it (the first call runs each key
    projection once)."""
    mesh = model_tensor_parallel_mesh(model) if (getattr(model, "tp_size", None) or 1) > 1 else None
    if mesh is None:
        return
    split = False
    for module in model.modules():
        name = next((name for name in _KEY_PROJECTIONS if name in module._modules), None)
        # Only a decoder's attention layers, the ones presses hook: not a vision tower's (Gemma 3's SigLIP), whose
        # configuration has no kv heads.
        if name is None or not hasattr(getattr(module, "config", None), "num_key_value_heads"):
            continue
        if module not in _LAYER_MESHES:
            shards = _key_projection_shards_heads(module, module._modules[name], name == "qkv_proj", model)
            _LAYER_MESHES[module] = mesh if shards else None
        split = split or _LAYER_MESHES[module] is not None
    if not split:
        return
    ranks, config = mesh.size(), model.config.get_text_config()
    for what in ("num_key_value_heads", "num_attention_heads"):
        heads = getattr(config, what)
        if heads % ranks:
            raise ValueError(f"{press_name}: the model has {heads} {what.removeprefix('num_').replace('_', ' ')}, "
                             f"which do not split evenly over {ranks} tensor-parallel ranks; run it on a number of "
                             f"ranks that divides {heads}")
    if unsupported is not None:
        raise ValueError(f"{press_name} cannot run on a tensor-parallel model ({ranks} ranks): {unsupported}")
