"""Per-slot state of a compressed KV cache, kept on transformers' cache layers.

Every slot of a layer carries a float32 log-weight ``b`` (B, H, T) that the attention path adds to the logits of
every query head of the group: 0 for a plain token, ``α·ln w`` for a slot standing for w merged tokens, ``-inf`` for
an evicted or padding slot (``../shared/docs/methods.md``). Presses may keep more per-slot tensors beside it (scores,
merge counts, votes), all (B, H, T) and aligned with the slots.

The state lives on the cache layer, not on the press, so a compressed context keeps its log-weights when the press's
context manager has exited (kvpress's pipeline answers questions outside it) and disappears with the cache.
Head-wise eviction compacts each layer to its longest head (:func:`compact_to_longest_head`): the memory held
shrinks for real, where kvpress only masks evicted keys.
"""

from __future__ import annotations

import copy
import functools
import weakref
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

__all__ = ["LayerState", "pass_cache", "pass_inputs", "output_cache", "check_cache_layer", "get_state", "set_state",
           "attach", "state_for_attention", "compact_to_longest_head", "cache_bytes", "slots_rearranged_error",
           "attached_layer", "slots_appended_since_written", "remember_tokens_held", "tokens_held_at_close",
           "forget_tokens_held", "MethodOf", "UnsavedRef", "beam_rows", "repeated_rows", "selected_rows", "ROWS_KEPT",
           "rearrange_batch"]

_STATE_ATTR = "kvcomp_state"
_LAYER_ATTR = "_kvcomp_cache_layer"
# Where a press's context closed on a layer (remember_tokens_held): (tokens the cache stood for, its slots).
_RESUME_POINT_ATTR = "_kvcomp_resume_point"


class UnsavedRef(weakref.ref):
    """A weak reference that ``copy.deepcopy`` keeps as it is and that pickling (``torch.save`` of a cache) saves as
    None: what it points to (the press that wrote a state, the attention module reading a layer, a tensor a state
    left) belongs to this process's model, not to the cache saved."""

    __slots__ = ()

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return _loaded_as_none, ()


def _loaded_as_none() -> None:
    return None


@dataclass
class LayerState:
    """log_weights (B, H, T) float32, the press's own per-slot tensors (B, H, T) aligned with the slots, and its
    counters (e.g. a ring position, the tokens seen).

    ``owner`` (a weak reference to the press that wrote the state) and its class ``owner_type`` keep another press
    from reading the state as its own; ``value_probe`` (B, H, T) (the first channel of the values it wrote) lets the
    attention path notice when another press has since rearranged the slots, which would leave the state describing
    other slots than the cache holds.
    """

    log_weights: torch.Tensor
    per_slot: dict[str, torch.Tensor] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    owner: UnsavedRef | None = None
    owner_type: type | None = None
    value_probe: torch.Tensor | None = None
    # Set by the press for a write that holds every slot wherever every slot it was given held one (no log-weight
    # -inf: a decoding step that merges or evicts to a fixed budget): a paged layer then stores it without reading
    # the log-weights back to look for slots to drop, a device sync per layer and step.
    keeps_held_slots: bool = field(default=False, compare=False)
    # The layer's slots when the press wrote the state: the slots after them were appended since, a token each in
    # every batch row and kv head, which a crop may take back (slots_appended_since_written). None: not known.
    slots_written: int | None = field(default=None, compare=False)
    # Whether the press lays each head's slots out at the right end of the cache, after -inf padding (a left-padded
    # batch compressed row by row, which slices each row's slots from its padding on): a paged layer, which stores no
    # padding, then shows each head's slots at the right of its view.
    left_padded: ClassVar[bool] = False
    # The last align call's arguments and the tensors it left, weakly (a paged layer's state views its pools, which
    # must not outlive a trim): (slots_before, new_tokens, log_weights, value_probe, *per_slot tensors).
    _aligned: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def align(self, slots_before: int, new_tokens: int) -> torch.Tensor:
        """Log-weights for a layer that held `slots_before` slots before this forward appended `new_tokens`.

        Someone else may have cut the cache since the state was written (kvpress's pipeline drops each answer with
        keys[:, :, :length]), so the state is cut to match; the new tokens are plain (b = 0) and are kept, so the
        state's length follows the layer's even through passes the press does not compress (a prefill-only press
        while decoding), and a layer shortened by someone else shows up as a state longer than the layer.

        Aligning is idempotent, and a decoding pass aligns twice (the attention path, then the press): the second
        call on the tensors the first returned is answered without cutting and padding again.
        """
        if self._is_aligned(slots_before, new_tokens):
            return self.log_weights
        if self.log_weights.shape[-1] > slots_before:
            self.log_weights = self.log_weights[..., :slots_before]
            self.per_slot = {name: tensor[..., :slots_before] for name, tensor in self.per_slot.items()}
            if self.value_probe is not None:
                self.value_probe = self.value_probe[..., :slots_before]
        missing = slots_before + new_tokens - self.log_weights.shape[-1]
        if missing:
            self.log_weights = torch.nn.functional.pad(self.log_weights, (0, missing))
        self.mark_aligned(slots_before, new_tokens)
        return self.log_weights

    def mark_aligned(self, slots_before: int, new_tokens: int) -> None:
        """Say that the log-weights already cover `new_tokens` plain slots (b = 0) after `slots_before`, with the
        per-slot tensors covering those before: the next ``align(slots_before, new_tokens)`` copies nothing."""
        self._aligned = self._alignment(slots_before, new_tokens)

    def _tensors(self) -> tuple:
        return self.log_weights, self.value_probe, *self.per_slot.values()

    def _alignment(self, slots_before: int, new_tokens: int) -> tuple:
        return slots_before, new_tokens, *(UnsavedRef(t) if t is not None else None for t in self._tensors())

    def _is_aligned(self, slots_before: int, new_tokens: int) -> bool:
        """Whether the last align call had these arguments and left the tensors the state holds now."""
        aligned, tensors = self._aligned, self._tensors()
        return (aligned is not None and aligned[:2] == (slots_before, new_tokens) and len(aligned) == 2 + len(tensors)
                and all((ref() if ref is not None else None) is t for ref, t in zip(aligned[2:], tensors)))

    def take_rows(self, rows: torch.Tensor) -> None:
        """Keep the batch rows `rows` names, in its order (repeats allowed), as the layer's keys and values just did:
        beam search's ``reorder_cache``, ``batch_repeat_interleave`` (n samples from one compressed prompt) and
        ``batch_select_indices`` are each this. Every per-slot tensor, and every counter with a batch dimension,
        follows."""
        def taken(tensor):
            return tensor.index_select(0, rows.to(tensor.device))

        self.log_weights = taken(self.log_weights)
        self.per_slot = {name: taken(tensor) for name, tensor in self.per_slot.items()}
        self.counters = {name: taken(value) if isinstance(value, torch.Tensor) and value.dim() else value
                         for name, value in self.counters.items()}
        if self.value_probe is not None:
            self.value_probe = taken(self.value_probe)
        self._aligned = None
        owner = self.owner() if self.owner is not None else None
        if owner is not None:
            owner.rows_taken(self, rows)

    def nbytes(self) -> int:
        probe = self.value_probe.nbytes if self.value_probe is not None else 0
        per_row = sum(count.nbytes for count in self.counters.values() if isinstance(count, torch.Tensor))
        return self.log_weights.nbytes + sum(tensor.nbytes for tensor in self.per_slot.values()) + probe + per_row

    def owner_name(self) -> str:
        return self.owner_type.__name__ if self.owner_type is not None else "a kvpress_cpp press"

    def probe_slots(self, values: torch.Tensor, unchanged: int) -> None:
        """Take the probe of `values` (B, H, T, d_v), the slots the state now describes. Its first `unchanged` slots
        (0: none known) are those the probe read before, as they were: only the slots after them are read (for a press
        that appends, q values instead of a strided gather of one cache line a slot: 103 of the 310 µs KVzap spent on a
        4k layer)."""
        if self.value_probe is not None and 0 < unchanged <= self.value_probe.shape[-1]:
            self.value_probe = torch.cat([self.value_probe[..., :unchanged], values[..., unchanged:, 0]], dim=-1)
        else:
            self.value_probe = values[..., 0].clone()

    def check_slots(self, values: torch.Tensor, slots_before: int) -> None:
        """Raise if the first `slots_before` slots of `values` are not (a prefix of) the slots this state describes:
        a cut from the right (kvpress's pipeline dropping an answer) keeps them, another press's selection does not.
        Only checked when the cache holds fewer slots than the state (no host sync on the usual path)."""
        if self.value_probe is None or self.log_weights.shape[-1] <= slots_before:
            return
        # Tokens appended after the probe (plain, b = 0) have nothing to compare: a cut among them kept the probed ones.
        probed = min(slots_before, self.value_probe.shape[-1])
        if not torch.equal(values[..., :probed, 0], self.value_probe[..., :probed]):
            raise slots_rearranged_error(self.owner_name())


def slots_rearranged_error(owner: str) -> RuntimeError:
    """What a pass over a layer gets when another press moved the slots `owner`'s per-slot state describes (found
    by the state's value probe on a DynamicLayer, by the write that displaced the state on a paged layer)."""
    return RuntimeError(
        f"{owner}: another press rearranged the slots of a layer {owner} compressed (e.g. a press after it in a "
        f"ComposedPress, or a kvpress decoding press): its per-slot state (merge weights, evicted slots) no longer "
        f"lines up with the cache. Place {owner} last, or alone")


def head_wise_marks_error(owner: str) -> RuntimeError:
    """What a pass over a layer `owner` compressed gets when a kvpress head-wise press (DMSPress, DuoAttentionPress,
    CriticalAdaKVPress, ...) marked slots of it in ``module.masked_key_indices``: kvpress's attention wrapper hides
    them, but the attention over a per-slot state (and a paged layer, which reads the marks as token positions) does
    not see them as the slot indices they are, so they would silently do nothing (or evict other slots)."""
    return RuntimeError(
        f"{owner}: a kvpress press marked slots of a layer {owner} compressed for head-wise eviction "
        f"(module.masked_key_indices, e.g. DMSPress, DuoAttentionPress or CriticalAdaKVPress after {owner} in a "
        f"ComposedPress): the attention over {owner}'s per-slot state cannot honour those marks. Head-wise masking "
        f"presses cannot be composed with {owner}")


def pass_cache(kwargs: dict):
    """The cache a forward pass was given, read from the keyword arguments a hook sees (those of an attention layer or
    of the decoder stack): ``cache`` from transformers 5.24 on, which renamed ``past_key_values`` (still accepted, from
    a caller, until 5.40), and ``past_key_value`` before 4.56."""
    for name in ("cache", "past_key_values", "past_key_value"):
        cache = kwargs.get(name)
        if cache is not None:
            return cache
    return None


def pass_inputs(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The token ids (B, q) or embeddings (B, q, D) of a decoder-stack forward, as its pre-hook sees them."""
    inputs = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    return inputs if inputs is not None or not args else args[0]


def output_cache(output):
    """The cache a decoder stack returned: its output's ``cache`` from transformers 5.24 on (``past_key_values``
    there is a deprecated alias, which warns), ``past_key_values`` before."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def in_one_dtype(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values in the wider of their dtypes, which the ops take one of. Under torch.autocast the rotary's
    float32 tables leave the keys float32 beside values in the autocast dtype; a DynamicLayer up to transformers 5.17
    held both as float32 (its first tensor was the keys' dtype), from 5.24 it keeps the values narrower (a paged
    layer's pools hold the wider)."""
    if keys.dtype == values.dtype or not (keys.is_floating_point() and values.is_floating_point()):
        return keys, values
    common = torch.promote_types(keys.dtype, values.dtype)
    return keys.to(common), values.to(common)


def check_cache_layer(layer, user: str = "kvpress_cpp presses") -> None:
    """Raise unless `layer` can hold a press's per-slot state: a DynamicCache's layer, whose update the press replaces
    with one in place (:func:`set_state`), or a PagedKVCache's."""
    # DynamicLayer's subclasses keep their keys and values, or more per token, their own way: a QuantizedLayer
    # elsewhere (its `keys` stay empty), a DynamicSlidingWindowLayer in a copy cut to the window, transformers 5.17's
    # DynamicIndexedLayer an indexer's keys beside them; a press compressing `keys` would leave those out of step.
    if getattr(layer, "holds_kvcomp_state", False) or type(layer) is DynamicLayer:
        return
    if isinstance(layer, DynamicSlidingWindowLayer):
        raise TypeError(
            f"{user}: needs a DynamicCache or a PagedKVCache, got a {type(layer).__name__} layer, which generate "
            f"builds from the model's config (sliding_window={getattr(layer, 'sliding_window', None)}) when no cache "
            f"is given: pass past_key_values=DynamicCache() (or PagedKVCache()) to generate; a sequence that outgrows "
            f"the window is then refused at that pass")
    raise TypeError(
        f"{user}: needs a DynamicCache or a PagedKVCache, got a {type(layer).__name__} layer: quantized, static, "
        f"offloaded and sliding-window caches are not supported"
    )


def get_state(layer) -> LayerState | None:
    return getattr(layer, _STATE_ATTR, None)


def set_state(layer, state: LayerState | None) -> None:
    check_cache_layer(layer)
    setattr(layer, _STATE_ATTR, state)
    if isinstance(layer, DynamicLayer):
        for name, method in _BATCH_METHODS.items():
            if name not in layer.__dict__:
                setattr(layer, name, MethodOf(method, layer))
    if type(layer).update is DynamicLayer.update and "update" not in layer.__dict__:
        layer.update = MethodOf(_update_in_place, layer)


class MethodOf:
    """`function` bound to `owner` through a weak reference, to stand for one of its methods as an instance
    attribute. A bound method there (``types.MethodType``) would make a reference cycle (owner -> method -> owner),
    and a dropped cache's keys and values would then stay in memory until Python's cycle collector ran, not freed
    when the cache goes (on a GPU, with the next example's cache beside them). ``copy.deepcopy`` of the owner binds
    the copy's to the owner's copy."""

    def __init__(self, function, owner):
        self.function, self.owner = function, weakref.ref(owner)

    def __call__(self, *args, **kwargs):
        return self.function(self.owner(), *args, **kwargs)

    def __deepcopy__(self, memo):
        return _method_of_copy(self.function, copy.deepcopy(self.owner(), memo))

    def __reduce__(self):
        return _method_of_copy, (self.function, self.owner())


# Copies of layers holding a state (copy.deepcopy, torch.load), until the attention first reads one: never attached to
# a module, they would be attended as if nothing had been compressed (attached_layer finds them here).
_COPIES_NOT_ATTACHED: weakref.WeakSet = weakref.WeakSet()


def _method_of_copy(function, owner) -> MethodOf:
    """A MethodOf bound to `owner`, a copy of the original's owner (a cache or a layer)."""
    if isinstance(owner, DynamicLayer):
        _COPIES_NOT_ATTACHED.add(owner)
    return MethodOf(function, owner)


def route_attention_through_kvpress_cpp() -> None:
    """Make the attention of the model appending to a layer that needs kvpress_cpp's (one holding a press's state, or
    a paged one) go through kvpress_cpp.attention: its import wraps the registry's functions, and every transformers
    model file imported since the last call gets its eager attention wrapped. A press's context or a new cache does
    this too, but a cache loaded by torch.load in a fresh process passes through neither, and was attended as if
    nothing had been compressed (eager) or failed on its block pools. Called at each append: nothing imported since,
    it costs a lookup and a length comparison."""
    from kvpress_cpp.attention import patch_loaded_eager_attention  # (it imports this module)

    patch_loaded_eager_attention()


def _update_in_place(layer: DynamicLayer, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
    """DynamicLayer.update for a layer holding a press's state: the new tokens are written after the held slots in
    place where the allocation behind them has room (:func:`append_slots`), instead of torch.cat copying the whole
    layer every step. A press keeping M slots leaves M of the M + 1 slots the step before appended, so every later
    step appends in place: each decoding step then moves the layer's bytes once (the attention's read) rather than
    three times (cat's read and write too)."""
    if get_state(layer) is None or not layer.is_initialized:
        return DynamicLayer.update(layer, key_states, value_states, *args, **kwargs)
    route_attention_through_kvpress_cpp()
    layer.keys = append_slots(layer.keys, key_states)
    layer.values = append_slots(layer.values, value_states)
    return layer.keys, layer.values


def append_slots(held: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """torch.cat([held, new], dim=-2) for (B, H, n, d) and (B, H, q, d), written in place when `held` is columns
    [c, c + n) of one contiguous (B, H, C, d) allocation with c + n + q <= C: columns no row of `held` shows, and which
    only a longer view of the same allocation could (a press's own business: its layer's tensors are its own). The
    returned tensor is then a view of that allocation; else (no room, another layout, autograd, an inference tensor
    outside inference mode) the cat's copy."""
    if _room_after(held, new):
        grown = held.as_strided((*held.shape[:2], held.shape[2] + new.shape[2], held.shape[3]), held.stride(),
                                held.storage_offset())
        grown[:, :, held.shape[2]:].copy_(new)
        return grown
    return torch.cat([held, new], dim=-2)


def _room_after(held: torch.Tensor, new: torch.Tensor) -> bool:
    if held.dim() != 4 or new.dim() != 4 or held.shape[:2] != new.shape[:2] or held.shape[3] != new.shape[3]:
        return False
    if held.dtype != new.dtype or held.device != new.device or held.requires_grad or held.numel() == 0:
        return False
    if held.is_inference() and not torch.is_inference_mode_enabled():
        return False
    batch, heads, slots, dim = held.shape
    row = held.stride(1)  # one (b, h)'s allocation: C slots of d
    if held.stride(3) != 1 or held.stride(2) != dim or row % dim or held.stride(0) != heads * row:
        return False
    capacity, first_column = row // dim, held.storage_offset() // dim
    # The storage is that one allocation, row (0, 0) first: the view's columns start at first_column in every row.
    allocation = batch * heads * row
    if held.untyped_storage().nbytes() != allocation * held.element_size() or held.storage_offset() % dim:
        return False
    return first_column + slots + new.shape[2] <= capacity


def _with_state_rows(name: str, rows_kept, layer: DynamicLayer, argument) -> None:
    """The layer class's batch method `name` (its own, not an instance's stand-in), followed on the layer's state:
    `rows_kept` (batch size, the method's argument) names the rows the method keeps, in order."""
    state = get_state(layer)
    rows = rows_kept(state.log_weights.shape[0], argument) if state is not None else None
    getattr(type(layer), name)(layer, argument)
    if state is not None:
        state.take_rows(rows)


# The rows of a batch of `batch` that each batch rearrangement keeps, in order (what LayerState.take_rows takes).
def beam_rows(batch: int, beam_idx: torch.Tensor) -> torch.Tensor:
    return beam_idx


def repeated_rows(batch: int, repeats: int) -> torch.Tensor:
    return torch.arange(batch).repeat_interleave(repeats)


def selected_rows(batch: int, indices) -> torch.Tensor:
    """Any index transformers' ``keys[indices, ...]`` takes (rows, a mask, a slice), on any device."""
    device = indices.device if isinstance(indices, torch.Tensor) else None
    return torch.arange(batch, device=device)[indices]


#: The cache layer methods that rearrange the batch rows, and the rows each keeps.
ROWS_KEPT = {"reorder_cache": beam_rows, "batch_repeat_interleave": repeated_rows,
             "batch_select_indices": selected_rows}
# The DynamicLayer methods that rearrange the batch rows, as a layer holding a state answers them (module-level
# functions, so that a cache holding them can be saved).
_BATCH_METHODS = {name: functools.partial(_with_state_rows, name, rows_kept) for name, rows_kept in ROWS_KEPT.items()}


def rearrange_batch(layer, name: str, argument) -> None:
    """`layer`'s batch method `name` (a key of :data:`ROWS_KEPT`), its state's rows taken along on a DynamicLayer as
    :func:`set_state` has it (a PagedLayer's own methods take them)."""
    if isinstance(layer, DynamicLayer):
        _BATCH_METHODS[name](layer, argument)
    else:
        getattr(type(layer), name)(layer, argument)


def attach(module: torch.nn.Module, layer) -> None:
    """Tell the attention path that `module` attends over `layer`, whose state it must honour.

    Weak references, the latest first: the cache owns its state, and a dropped cache leaves nothing behind on the
    model. Every layer attached stays known while its cache lives, so a context compressed in one cache is still
    read with its state after another cache was compressed on the same model. Every decoding step re-attaches its
    layer: the latest one is recognised without ``nn.Module.__setattr__`` (weakref.ref hands back the layer's one
    reference).
    """
    ref = weakref.ref(layer)
    refs = module.__dict__.get(_LAYER_ATTR, ())
    if not refs or refs[0] is not ref:
        setattr(module, _LAYER_ATTR, (ref, *(other for other in refs if other is not ref and other() is not None)))


def slots_appended_since_written(layer, state: LayerState) -> int:
    """The slots at the right end of `layer` that passes appended, a token each in every batch row and kv head, since
    a press wrote `state` to it: those tokens took no part in its compression, and a crop can take them back."""
    if hasattr(layer, "slots_appended_since_written"):  # a paged layer counts each head's own
        return layer.slots_appended_since_written()
    return max(layer.get_seq_length() - state.slots_written, 0) if state.slots_written is not None else 0


def remember_tokens_held(cache, tokens: int) -> None:
    """When a press's context closes: each layer of `cache` records the tokens the cache stands for and its own slots
    then, so that a pass outside any press can tell where those tokens end (tokens appended later add to both, a cut
    from the right takes from both)."""
    for layer in getattr(cache, "layers", ()):
        layer.__dict__[_RESUME_POINT_ATTR] = (tokens, layer.get_seq_length())


def tokens_held_at_close(layer) -> tuple[int, int] | None:
    """(tokens the cache stood for, the layer's slots) when a press's context last closed over it, None if none."""
    return layer.__dict__.get(_RESUME_POINT_ATTR)


def forget_tokens_held(layer) -> None:
    """Drop the tokens a closed press context recorded on `layer`: a new prompt over the emptied layer starts its
    own count (a resume point left there would refuse the new prompt's continuation as a re-feed)."""
    layer.__dict__.pop(_RESUME_POINT_ATTR, None)


def attached_layer(module: torch.nn.Module, key: torch.Tensor):
    """The cache layer attached to `module` (:func:`attach`) whose keys tensor is `key`, None if none (another cache
    than the ones compressed, or one gone). A copy of a compressed layer (``copy.deepcopy`` of a prefilled cache, to
    answer several questions from one compressed prefix; ``torch.load`` of a saved one) is attached here, the first
    time the attention reads it."""
    for ref in module.__dict__.get(_LAYER_ATTR, ()):
        layer = ref()
        # The keys a DynamicLayer holds, read without a property: a PagedLayer's builds its view, storing what was
        # written through it and taking the module's kvpress marks, which belong to the pass of another cache
        # (the attention path finds a paged layer by its pool instead).
        if layer is not None and layer.__dict__.get("keys") is key:
            return layer
    for layer in list(_COPIES_NOT_ATTACHED):
        if layer.__dict__.get("keys") is key:
            _COPIES_NOT_ATTACHED.discard(layer)
            attach(module, layer)
            return layer
    return None


def state_for_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """The log-weights (B, H, T) the attention over `key` must add, or None when this forward has no state.

    The state applies only when `key` is the keys tensor of the cache layer it was written for (DynamicLayer.update
    returns its own tensor), so another cache on the same model is never biased. A pass with as many queries as
    keys is a new prefill over an emptied cache: the old state is dropped.
    """
    layer = attached_layer(module, key)
    if layer is None:
        return None
    state = get_state(layer)
    if state is None:
        return None
    new_tokens, total = query.shape[-2], key.shape[-2]
    if new_tokens == total:
        set_state(layer, None)
        forget_tokens_held(layer)
        return None
    state.check_slots(layer.values, total - new_tokens)
    return state.align(total - new_tokens, new_tokens)


def compact_to_longest_head(
    keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, log_weights: torch.Tensor,
    per_slot: dict[str, torch.Tensor] | None = None, longest: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, LayerState]:
    """Apply a per-head keep mask and shrink the layer to its longest head.

    Args:
        keys, values: (B, H, T, d).
        keep: (B, H, T) bool, the slots each head keeps.
        log_weights: (B, H, T) float32 of the slots before eviction.
        per_slot: other (B, H, T) tensors to carry along.
        longest: the largest kept count of any (batch, head), or a bound above it, when the caller knows it (e.g. a
            press that keeps exactly M slots per head): nothing then waits on the device, so the call can be captured
            in a CUDA graph. None reads it from `keep` (one host sync on CUDA).

    Returns:
        keys and values (B, H, T', d) with T' the largest kept count of any (batch, head) (or `longest`); each
        head's kept slots come first, in their original order, and the rest is padding with b = -inf (and zero keys
        and values).
        The state holds the gathered log-weights and per-slot tensors.
    """
    kept_counts = keep.sum(-1)
    if longest is not None:
        new_len = min(longest, keep.shape[-1])
    else:
        new_len = int(kept_counts.max()) if keep.numel() else 0
    # A stable sort of "evicted" flags puts each head's kept slots first, in order, without a host loop per head.
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :new_len]
    is_real = torch.arange(new_len, device=keep.device) < kept_counts.unsqueeze(-1)

    def gather_slots(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.gather(2, order)

    def gather_vectors(tensor: torch.Tensor) -> torch.Tensor:
        index = order.unsqueeze(-1).expand(*order.shape, tensor.shape[-1])
        return tensor.gather(2, index) * is_real.unsqueeze(-1).to(tensor.dtype)

    new_log_weights = gather_slots(log_weights).masked_fill(~is_real, float("-inf"))
    new_per_slot = {name: gather_slots(tensor) for name, tensor in (per_slot or {}).items()}
    return gather_vectors(keys), gather_vectors(values), LayerState(new_log_weights, new_per_slot)


def cache_bytes(cache) -> int:
    """Bytes a cache holds: keys, values and every per-slot state tensor."""
    if hasattr(cache, "bytes_held"):  # a PagedKVCache: the blocks in use
        return cache.bytes_held()
    total = 0
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            total += layer.keys.nbytes + layer.values.nbytes
        state = get_state(layer)
        if state is not None:
            total += state.nbytes()
    return total
