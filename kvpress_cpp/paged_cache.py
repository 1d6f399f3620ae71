"""A paged KV cache: per layer, a pool of fixed-size blocks and a block table per (sequence, kv head).

Each (batch, kv head) of a layer holds its own number of slots, in blocks of ``block_size`` slots taken from the
layer's pool (vLLM's paged attention, with KV-Compress's refinement of one block table per head rather than per
sequence). Head-wise eviction returns the blocks a head no longer needs to the pool's free list, so the memory held
follows the slots each head keeps: no head is padded to the longest one, and no sequence of a batch to the longest
prompt. Next to keys and values, every slot carries a float32 log-weight (the bias the attention adds, see
:mod:`kvpress_cpp.cache`), its absolute token position, and whatever per-slot tensors a press keeps in its
:class:`~kvpress_cpp.cache.LayerState`, all in blocks of the same tables.

The attention over a paged layer runs ``kvcomp::paged_decode_attention`` (:mod:`kvpress_cpp.attention` routes it).
Presses and kvpress see the layer through its rectangular *view* (``layer.keys``, ``layer.values``,
``get_state(layer)``), laid out exactly as a :class:`~transformers.DynamicCache` compacted with
:func:`~kvpress_cpp.cache.compact_to_longest_head` would be: each head's *base* slots (those written at its last
rewrite) left-aligned from column 0, the tokens appended since right-aligned at the end, -inf log-weights and zeros
between. On a regular layout (every head the same number of consecutive blocks at a fixed stride, as a prefill into
an empty pool lays out and a press keeping M slots per head keeps while decoding) the view is a strided tensor over
the pools, not a copy. Whatever a press or kvpress writes back through that view is stored per head:

* a press's keys, values and state: each head keeps its columns whose log-weight is not -inf (the padding of a
  compaction to the longest head is dropped, not stored); a press that hands back the view's own keys and values
  (KVzap between its compactions) has only its state stored, and the slots it marked -inf stay as dead slots until
  it rewrites the layer or a head holds more than two blocks of them;
* kvpress's pipeline's cut back to the context (``keys[:, :, :n]``): each head keeps its columns before n;
* other keys and values (a kvpress press's compression): every column, as plain tokens; where the view had holes
  (columns showing no slot of their head), only a selection that says which columns it took
  (:meth:`PagedLayer.select_columns`, which kvpress's ``ScorerPress.compress`` does once kvpress_cpp is imported):
  its holes are dropped and its tokens keep their positions; any other write is refused rather than holding the holes'
  zeros as tokens.

kvpress's head-wise presses (AdaKVPress, DMSPress, ...) only mark slots in ``module.masked_key_indices`` for its
attention patch to hide; on a paged layer those slots are evicted for real, the next time the layer is used. The
rectangular cache keeps a masked slot's column, so the view keeps the columns those evictions empty (as padding between
each head's base and appended slots): it stays as wide as the tokens the sequence stands for.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import operator
import weakref
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpress_cpp import ops
from kvpress_cpp.cache import (LayerState, UnsavedRef, beam_rows, forget_tokens_held, head_wise_marks_error,
                               pass_cache, repeated_rows, route_attention_through_kvpress_cpp, selected_rows,
                               slots_rearranged_error)

__all__ = ["PagedKVCache", "PagedLayer", "paged_layer_of", "settle_marks"]


class _Unset:
    """The marker of a part of the view not written since the last flush. Layers test it by identity, so a copy of a
    layer (copy.deepcopy of a cache, to branch a generation) must keep this very object, not a new one."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return "_UNSET"


_UNSET = _Unset()
_LOG_WEIGHTS, _POSITIONS = "log_weights", "token_positions"
_NO_COLUMN = torch.iinfo(torch.long).max  # past every width: an entry of PagedLayer._base_columns for no slot
# On an attention module: a weak reference to the paged layer its last pass read, whose slots the marks of kvpress's
# head-wise presses (module.masked_key_indices) then index, and one to the first tensor of the marks already there
# when that pass began (another cache's, left by a pass over a layer not paged), which are not that layer's.
_MARKED_LAYER_ATTR, _FOREIGN_MARKS_ATTR = "_kvcomp_marked_layer", "_kvcomp_foreign_marks"


# Layers by the id of the key pool their update returned, for the attention path (weak: a dropped cache leaves nothing).
_LAYERS_BY_POOL: "weakref.WeakValueDictionary[int, PagedLayer]" = weakref.WeakValueDictionary()


def _crop_zero_removes_nothing() -> bool:
    """Whether the installed transformers reads ``crop(0)`` as "remove no token" (5.17 on: a non-positive argument
    counts the tokens to remove, and assisted generation calls crop(0) after a round with nothing rejected), rather
    than "keep no token" (4.x, 5.2). Read from its own DynamicLayer, once."""
    from transformers.cache_utils import DynamicLayer

    layer = DynamicLayer()
    layer.update(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))
    layer.crop(0)
    return layer.get_seq_length() == 1


_CROP_ZERO_REMOVES_NOTHING = _crop_zero_removes_nothing()


def pass_paged_layer(module, kwargs: dict) -> PagedLayer | None:
    """The paged layer of `module` in the pass whose hook sees `kwargs`, None on any other cache."""
    layers = getattr(pass_cache(kwargs), "layers", None)
    layer = layers[module.layer_idx] if layers is not None and module.layer_idx < len(layers) else None
    return layer if isinstance(layer, PagedLayer) else None


def shared_padding_dropped(module, kwargs: dict) -> int:
    """The columns of padding every row of the prompt shares that `module`'s cache layer does not hold: a paged
    layer's ``padding_dropped`` (its keys start that many tokens after the prompt's hidden states), 0 on a
    DynamicCache."""
    layer = pass_paged_layer(module, kwargs)
    return layer.padding_dropped if layer is not None else 0


def settle_marks(module: torch.nn.Module, layer: PagedLayer | None) -> None:
    """Before a pass over `layer` (None: a layer not paged) reads `module`: the marks kvpress's head-wise presses left
    there for another paged layer become that layer's evictions now, and the marks a pass over a layer not paged left
    (which kvpress's attention applies, as with two DynamicCaches) are kept from `layer`, which will take only the marks
    its own pass leaves. Otherwise a paged layer evicted another cache's marks from its slots and cleared them."""
    reference = module.__dict__.get(_MARKED_LAYER_ATTR)
    if reference is None and layer is None:  # no paged layer reads this module: nothing to settle, nothing written
        return
    reader = reference() if reference is not None else None
    if reader is not None and reader is not layer and getattr(module, "masked_key_indices", None) is not None:
        reader.flush()
    marked = getattr(module, "masked_key_indices", None)
    # (a model saved with torch.save saves None for both)
    module.__dict__[_FOREIGN_MARKS_ATTR] = UnsavedRef(marked[0]) if marked is not None else None
    module.__dict__[_MARKED_LAYER_ATTR] = UnsavedRef(layer) if layer is not None else None


def _foreign_marks(module: torch.nn.Module, marked: tuple) -> bool:
    reference = module.__dict__.get(_FOREIGN_MARKS_ATTR)
    return reference is not None and reference() is marked[0]


def paged_layer_of(key: torch.Tensor) -> PagedLayer | None:
    """The paged layer whose ``update`` returned `key` (its key pool), or None for any other tensor."""
    layer = _LAYERS_BY_POOL.get(id(key))
    return layer if layer is not None and layer.key_blocks is key else None


class PagedLayer(CacheLayerMixin):
    """One layer of a :class:`PagedKVCache`.

    Attributes:
        key_blocks, value_blocks: (N, S, d) pools of N blocks of S = block_size slots.
        slot_blocks: per-slot pools (N, S): "log_weights" float32, "token_positions" int32 (-1 where unknown), and
            the per-slot tensors of the press's state under their own names.
        block_tables: (B, H, max_blocks) int64 on the host, -1 for an entry not in use.
        lengths: (B, H) int64 on the host: the slots each (batch, kv head) holds.
        bases: (B, H) int64: the slots of each head written at its last rewrite (the left-aligned part of the view).
    """

    is_sliding = False
    is_compileable = False
    # crop cuts slots from the right (assisted generation's rollback). transformers 5.24's generate refuses assisted
    # decoding over a cache whose layers do not say so (CacheLayerMixin's default is False).
    is_croppable = True
    holds_kvcomp_state = True  # kvpress_cpp.cache accepts it next to DynamicLayer
    # A write through the view without a state drops the press's state, so no value probe is needed to notice
    # another press rearranging the slots (kvcomp_state hands back none).
    moves_state_with_slots = True

    def __init__(self, block_size: int = 16):
        # Token positions are int32: a head never holds more slots than that, so a larger block could never fill
        # (2**62 got as far as the first forward, then stopped on a stride overflow naming neither).
        if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or not 1 <= block_size < 2**31:
            raise ValueError(f"PagedKVCache: block_size must be an integer in [1, 2**31), got {block_size!r}")
        self.block_size = int(block_size)  # (numpy's integers too, as the presses take them)
        self.is_initialized = False
        self.key_blocks = self.value_blocks = None
        self.slot_blocks: dict[str, torch.Tensor] = {}
        self.free_blocks: list[int] = []
        self.counters: dict[str, Any] = {}
        self.has_state = False
        self._prompt_states: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending_keys = self._pending_values = self._pending_state = _UNSET
        self._state_written: LayerState | None = None  # the last state a press wrote, for its own fields
        # The press whose state a write without one (another press's selection of slots) displaced: the next pass is
        # refused, as a DynamicLayer's state probe refuses it, where the layer would otherwise go on as plain tokens.
        self._state_displaced_from: str | None = None
        # (keys, the columns of the view they are) of a kvpress press's selection, until written (select_columns).
        self._selection: tuple[torch.Tensor, torch.Tensor] | None = None
        # Whether a real slot may hold a log-weight of -inf (a press's dead slot, stored in place rather than dropped):
        # only where none can is a write that keeps every slot it was given known to hold every slot, unread.
        self._may_hold_dead_slots = False
        # Whether the view shows each head's base slots at its right, after the padding, rather than from column 0:
        # the layout of a press that left-pads (LayerState.left_padded), as long as its state is the layer's.
        self._bases_at_right = False
        # The padding every row of the prefill had, which it dropped: generate counts it among the tokens held (the
        # rectangular cache's width), where a second call resumes and what a rejected candidate is cropped to. Until
        # something rewrites the layer, whose width is then what it wrote.
        self.padding_dropped = 0
        # The tokens appended since the prompt, padding included, less those cut (holds_every_token).
        self.tokens_appended = 0
        # The columns of the view that the evictions of kvpress's head-wise marks emptied (no head holds a slot there),
        # which the view keeps as padding: generate resumes a second call and crops at the view's width, and kvpress's
        # pipeline cuts each answer at it (keys[:, :, :n]), all counted as the rectangular cache, whose masked slots
        # keep their columns, counts them. Until something rewrites the layer, whose width is then what it wrote. So
        # are the columns only the rows a batch rearrangement dropped held (_take_rows), which the rectangular cache
        # keeps too, and which a press's state covers (part of the base, at its left for a press that left-pads).
        self.evicted_columns = 0
        # Whether marks evicted slots since the layer was last written: a head's appended slots after one it lost sit
        # further right in the view than their tokens' columns in the rectangular cache, so a cut counts them by
        # position (_appended_before).
        self._marks_evicted = False
        # The column of the rectangular cache at which each head's base slots stand once marks evicted some of them
        # (B, H, most base slots) on the host, past a head's base _NO_COLUMN; None while base slot i stands at its own
        # column. The view closes the columns those evictions emptied (a head's later base slots sit further left than
        # their tokens' columns), so a cut counts the base slots it keeps by these columns (_note_base_columns). Only
        # slots whose positions the layer knows are marked: a press's base slots are so after KVzap stored its state
        # in place over tokens appended since its write.
        self._base_columns: torch.Tensor | None = None
        # How many times slots were moved, dropped or rewritten other than by appending tokens: a press that reads
        # its own slots in the pools learns from it that nothing but appends happened since it last looked.
        self.rearrangements = 0
        # The position of the next token appended without a cache_position (a host integer, so that no append reads
        # the device), None where positions were last given on the device: then the last cache_position given and the
        # columns cut since tell it, read only by an append that needs it.
        self._next_position: int | None = 0
        self._positions_given: torch.Tensor | None = None
        self._cut_since_positions_given = 0
        self._view = self._device_tables = self._layout = self._rows = self._columns = None
        # The gathered view's version counters (None: a view of the pools, or one made in inference mode).
        self._view_versions: tuple[int, ...] | None = None
        self._widest = self._state_index = self._slot_index = self._region = None
        self._even = self._even_blocks = None
        self._region_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # (widths, pools, per-slot views, log-weights view) of _state_views, on a layout that views the pools.
        self._state_view_cache: tuple | None = None
        self._even_lengths: dict[int, torch.Tensor] = {}
        self._module = None

    # ------------------------------------------------------------------------------------------------------------
    # transformers' layer interface

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None):
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads = key_states.shape[:2]
        value_dim = (value_states if value_states is not None else key_states).shape[-1]
        self.key_blocks = key_states.new_empty(0, self.block_size, key_states.shape[-1])
        self.value_blocks = key_states.new_empty(0, self.block_size, value_dim)
        self.slot_blocks = {_LOG_WEIGHTS: self._new_slot_pool(0, torch.float32),
                            _POSITIONS: self._new_slot_pool(0, torch.int32)}
        self.block_tables = torch.full((batch, heads, 0), -1, dtype=torch.long)
        self.lengths = torch.zeros(batch, heads, dtype=torch.long)
        self.bases = torch.zeros(batch, heads, dtype=torch.long)
        self._owned_slots = torch.zeros(batch, heads, dtype=torch.long)
        self._forget_region()
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: dict[str, Any] | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append q tokens (B, H, q, d) to every (batch, kv head); returns the key and value pools, which only the
        attention path of :mod:`kvpress_cpp.attention` reads (through :func:`paged_layer_of`). `cache_kwargs`: what
        transformers 4 passes (the pass's ``cache_position``); `kwargs`: transformers 5.24 on passes the attention
        layer's keyword arguments as ``kwargs=`` (no ``cache_position`` there), which a DynamicLayer ignores too."""
        for name, states in (("key", key_states), ("value", value_states)):
            if states.dim() != 4 or not states.shape[-1]:  # (the pools hold slots of one head dim ≥ 1)
                raise ValueError(f"PagedKVCache: expected {name} states of (batch, kv heads, tokens, head dim ≥ 1), "
                                 f"got {tuple(states.shape)}")
        if key_states.dtype != value_states.dtype and all(s.is_floating_point() for s in (key_states, value_states)):
            # Under torch.autocast the rotary embedding's float32 cos/sin leave the keys float32 and the values in the
            # autocast dtype. The pools hold slots of one dtype: the wider (a DynamicLayer ends up holding both so),
            # into which the narrower is cast; a state wider than the pools is refused below as it came.
            pools = self.key_blocks.dtype if self.is_initialized else torch.promote_types(key_states.dtype,
                                                                                          value_states.dtype)
            key_states, value_states = (states.to(pools) if torch.promote_types(states.dtype, pools) == pools
                                        else states for states in (key_states, value_states))
        if not self.is_initialized:
            from kvpress_cpp.attention import refuse_attention_outside_the_registry  # (it imports this module)

            if key_states.dtype not in ops.CACHE_DTYPES:  # else a bare error of the attention op, after this write
                raise ValueError(f"PagedKVCache: holds float32, float16 or bfloat16 keys and values (the dtypes its "
                                 f"attention ops compute in), got {key_states.dtype} key states: load the model in "
                                 f"one of those (model.float())")

            refuse_attention_outside_the_registry(inspect.currentframe().f_back)
            self.lazy_initialization(key_states, value_states)
        route_attention_through_kvpress_cpp()  # the attention must read this layer through its block tables
        self.flush()
        batch, heads, new_tokens = key_states.shape[:3]
        if (batch, heads) != tuple(self.lengths.shape):
            raise ValueError(f"PagedKVCache: expected key states of {tuple(self.lengths.shape)} (batch, kv heads), "
                             f"got {tuple(key_states.shape)}")
        if value_states.shape[:3] != key_states.shape[:3]:
            raise ValueError(f"PagedKVCache: expected value states of the keys' (batch, kv heads, tokens) "
                             f"{tuple(key_states.shape[:3])}, got {tuple(value_states.shape)}")
        for name, states, pool in (("key", key_states, self.key_blocks), ("value", value_states, self.value_blocks)):
            # Checked before the lengths grow: a refused write must leave the layer as it was.
            if (states.shape[-1], states.dtype, states.device) != (pool.shape[-1], pool.dtype, pool.device):
                raise ValueError(f"PagedKVCache: expected {name} states of head dim {pool.shape[-1]}, {pool.dtype} on "
                                 f"{pool.device} (the layer's pool), got {tuple(states.shape)}, {states.dtype} on "
                                 f"{states.device}: another model's pass over this cache?")
        before, even, width = self.lengths, self._evenness(), self._width()
        if even and even[0] + new_tokens <= self._blocks_of_every_head() * self.block_size:
            # The usual decoding step: heads of one length, none needing a new block (decided on host integers).
            is_prefill = even[0] == 0
            self.lengths = self._lengths_of_every_head(even[0] + new_tokens)
            self._changed()
            self._even = (even[0] + new_tokens, even[1])
        else:
            # (a layer whose every slot the marks evicted still stands for its tokens: not a new prompt)
            is_prefill = bool((before == 0).all()) and not self.evicted_columns
            after = before + new_tokens
            if bool((after <= self._owned_slots).all()):  # no head needs a new block
                self.lengths = after
                self._changed()
            else:
                self._resize(after)
            if even is False and new_tokens:  # heads of different lengths stay so, each q slots longer
                self._even, self._widest = False, width + new_tokens
        self._prompt_states = (key_states, value_states) if is_prefill else None
        if is_prefill:  # a new prompt over an emptied layer: nothing of the old one is left, nor displaced (as
            # state_for_attention drops a DynamicLayer's), and the old one's token count is no longer this one's
            self._forget_prompt()
            self.rearrangements += 1
            forget_tokens_held(self)
        self.tokens_appended += new_tokens
        # store(pool, tensor or number): the new tokens' slots of `pool` (B, H, q, ...) set to it, broadcast.
        if even and self._regular_region() is not None:  # every head appends at column even[0] of the pools' view
            def store(pool, tensor):
                appended = self._region_view(pool, even[0] + new_tokens)[:, :, even[0]:]
                appended.copy_(tensor) if isinstance(tensor, torch.Tensor) else appended.fill_(tensor)
        else:
            if even:
                slots = self._owned_slot_index()[..., even[0]:even[0] + new_tokens].flatten()
            else:
                slots = self._flat_slots(before.unsqueeze(-1) + torch.arange(new_tokens)).flatten()

            def store(pool, tensor):
                flat = pool.view(-1, *pool.shape[2:])
                if not isinstance(tensor, torch.Tensor):
                    flat.index_fill_(0, slots, tensor)
                else:
                    tensor = tensor.to(pool.device, pool.dtype).expand(batch, heads, new_tokens, *pool.shape[2:])
                    flat.index_copy_(0, slots, tensor.flatten(0, 2))
        store(self.key_blocks, key_states)
        store(self.value_blocks, value_states)
        positions = (cache_kwargs or {}).get("cache_position")
        if positions is None:  # (transformers 5.17 passes none) the tokens follow the last one appended
            if is_prefill:
                self._next_position = 0
            elif self._next_position is None:  # positions were given before, on the device: one read
                self._next_position = int(self._positions_given.max()) + 1 - self._cut_since_positions_given
            positions = torch.arange(self._next_position, self._next_position + new_tokens, device=self.device)
            self._next_position += new_tokens
        else:
            self._next_position, self._positions_given, self._cut_since_positions_given = None, positions, 0
        # The press's own per-slot pools are left as they are: a press reads a slot's state only once it has
        # written it (get_state's per-slot tensors cover the columns of its last write). The log-weights are b = 0.
        store(self.slot_blocks[_LOG_WEIGHTS], 0)
        store(self.slot_blocks[_POSITIONS], positions)
        if _LAYERS_BY_POOL.get(id(self.key_blocks)) is not self:  # a lookup: setting makes a weak reference each step
            _LAYERS_BY_POOL[id(self.key_blocks)] = self
        return self.key_blocks, self.value_blocks

    def get_seq_length(self) -> int:
        """The width of the rectangular view (a DynamicLayer's keys.shape[-2] for the same history)."""
        if not self.is_initialized:
            return 0
        self.flush()
        return self._width()

    def tokens_counted(self) -> int:
        """The tokens generate counts the layer as holding: the view's width plus the left padding every row of the
        prefill had, which the prefill dropped (``padding_dropped``), as a DynamicLayer's width holds it."""
        return self.get_seq_length() + self.padding_dropped

    def get_mask_sizes(self, query: torch.Tensor | int) -> tuple[int, int]:
        """(kv length, kv offset) of a pass of `query` tokens: transformers 4 passes the pass's cache_position,
        transformers 5 its length. The length is counted as generate counts (``tokens_counted``): the mask then has
        the columns of the attention mask generate passes (the prompt's padding included), and the pass's tokens
        are its last columns."""
        return self.tokens_counted() + (query if isinstance(query, int) else query.shape[0]), 0

    def get_max_length(self) -> int:
        return -1  # no maximum: the pool grows

    get_max_cache_shape = get_max_length  # transformers 4's name

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` slots of the view, or drop the last -`max_length` when it is negative (the
        meaning transformers 5 gives a negative argument); 0 drops nothing where transformers reads it so (5.17 on)."""
        try:
            max_length = operator.index(max_length)
        except TypeError:
            raise TypeError(f"PagedKVCache.crop: expected an integer max_length, got {max_length!r}") from None
        if max_length == 0 and _CROP_ZERO_REMOVES_NOTHING:
            return
        # Counted as generate counts, with the padding the prefill dropped (a DynamicLayer holds it): a cache emptied
        # for the next prompt counts no token.
        held = self.tokens_counted()
        max_length = max(held + max_length, 0) if max_length < 0 else max_length  # past all of it: emptied
        if max_length >= held:
            return
        if 0 < max_length <= self.padding_dropped:
            # A DynamicLayer would hold padding alone, which the next pass attends under its own mask; this layer
            # holds none, and would take that pass for a new prompt.
            raise ValueError(f"PagedKVCache.crop: keeping {max_length} of the {self.padding_dropped} columns of left "
                             f"padding the prefill dropped, and no token: a paged layer holds no padding. Crop to 0 "
                             f"(empty) or past the padding")
        if max_length == 0:
            self.padding_dropped = 0
        width = max_length - self.padding_dropped  # the view's columns kept
        if self.get_seq_length() > width:
            self._cut(width)

    def reset(self) -> None:
        if self.is_initialized:
            self._pending_keys = self._pending_values = self._pending_state = _UNSET
            self._resize(torch.zeros_like(self.lengths))
            self.bases = torch.zeros_like(self.lengths)
            self._forget_prompt()

    def _forget_prompt(self) -> None:
        """What the layer knew of the prompt it held, once emptied: a press's state (and the pools of its per-slot
        tensors, which would grow with every block for nobody), its layout, the padding its prefill dropped and the
        columns marks emptied."""
        self.has_state, self.counters, self._state_displaced_from = False, {}, None
        self.slot_blocks = {name: self.slot_blocks[name] for name in (_LOG_WEIGHTS, _POSITIONS)}
        self._may_hold_dead_slots = self._bases_at_right = False
        self.padding_dropped = self.tokens_appended = 0
        self._forget_marks()

    def _forget_marks(self) -> None:
        """The columns kvpress's marks emptied, and that they evicted at all: the layer is as wide as what was last
        written, its slots where it wrote them."""
        self.evicted_columns, self._marks_evicted, self._base_columns = 0, False, None

    # Beam search's reorder (every step), n samples from one compressed prompt, and keeping some rows of a batch:
    # each keeps batch rows in a given order, as on a DynamicLayer holding a press's state (kvpress_cpp.cache).
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._take_rows(beam_rows(self.lengths.shape[0], beam_idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._take_rows(repeated_rows(self.lengths.shape[0], repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._take_rows(selected_rows(self.lengths.shape[0], indices))

    def offload(self):
        raise NotImplementedError("PagedKVCache: offloading is not supported")

    # ------------------------------------------------------------------------------------------------------------
    # The rectangular view presses and kvpress read and write

    @property
    def keys(self) -> torch.Tensor | None:
        if not self.is_initialized:
            return None
        return self._view_part(0)

    @keys.setter
    def keys(self, tensor: torch.Tensor) -> None:
        self._pending_keys = tensor

    @property
    def values(self) -> torch.Tensor | None:
        if not self.is_initialized:
            return None
        return self._view_part(1)

    def _view_part(self, part: int) -> torch.Tensor:
        """Keys (0) or values (1) of the view. Between the writes of a pair (``layer.keys = k`` then
        ``layer.values = layer.values[...]``, as kvpress's pipeline does) the written one reads back as written and the
        other as before; the pair is stored once both are written. Once a state is written too (a press's whole
        write), the view is read after storing it, so that it lines up with the state ``get_state`` reads."""
        pending = (self._pending_keys, self._pending_values)
        if self._pending_state is _UNSET:
            if pending[part] is not _UNSET:
                return pending[part]
            if pending[1 - part] is not _UNSET and self._view is not None:
                return self._view[part]
        return self._current_view()[part]

    @values.setter
    def values(self, tensor: torch.Tensor) -> None:
        self._pending_values = tensor

    @property
    def kvcomp_state(self) -> LayerState | None:
        """The press's state (:func:`kvpress_cpp.cache.get_state`), None without one. Its per-slot tensors cover the
        view's columns up to the press's last write (the base part): the tokens appended since are the press's to add.
        Its log-weights cover the whole view (-inf in its holes), aligned for the pass, as a DynamicLayer's are once
        the attention has padded them: the appended slots hold b = 0 in the pool (update), so the press's align
        copies nothing."""
        if not self.is_initialized:
            return None
        self.flush()
        if not self.has_state:
            return None
        even = self._evenness()
        # The base part, with the columns only rows a rearrangement dropped held (marks evict nothing under a state).
        width = even[1] if even else int(self.bases.max()) + self.evicted_columns
        per_slot, log_weights = self._state_views(width)
        if self._state_written is None:
            state = LayerState(log_weights, per_slot, self.counters)
        else:
            # The press's own fields (its owner, a padded batch's rows) come back as written, in the object it wrote (as
            # a DynamicLayer hands back its state); the tensors from the blocks. No value probe: the blocks move slots
            # by design (masked evictions, cuts), which the probe would report.
            state = self._state_written
            state.log_weights, state.per_slot, state.counters, state.value_probe = (log_weights, per_slot,
                                                                                    self.counters, None)
        state.mark_aligned(width, log_weights.shape[-1] - width)
        return state

    def _state_views(self, width: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The press's per-slot tensors over the view's first `width` columns, by name, and the log-weights over the
        whole view (-inf in its holes). On an even, regular layout they view the pools, and are kept while the pools
        and the tables stay: a decoding step of a press keeping M slots reads the same ones every time."""
        pools, widths = self.slot_blocks, (width, self._width())
        cached = self._state_view_cache
        if (cached is not None and cached[0] == widths and self._evenness() and len(cached[1]) == len(pools)
                and all(cached[1].get(name) is pool for name, pool in pools.items())):
            return dict(cached[2]), cached[3]
        per_slot = {name: self._gather_view(pool, 0, width) for name, pool in pools.items()
                    if name not in (_LOG_WEIGHTS, _POSITIONS)}
        # The width named: the holes are filled through a mask, not at positions a nonzero would read back to the host.
        log_weights = self._gather_view(pools[_LOG_WEIGHTS], float("-inf"), self._width())
        shares_pools = self._evenness() and self._regular_region() is not None
        self._state_view_cache = (widths, dict(pools), per_slot, log_weights) if shares_pools else None
        return dict(per_slot), log_weights

    @kvcomp_state.setter
    def kvcomp_state(self, state: LayerState | None) -> None:
        self._pending_state = state
        self._state_written = state

    def flush(self) -> None:
        """Store what was written through the view since the last call, and evict the slots kvpress's head-wise
        presses marked on the attention module. Every other method calls it first."""
        keys, values, state = self._pending_keys, self._pending_values, self._pending_state
        if self.is_initialized and self.key_blocks.is_inference() and not torch.is_inference_mode_enabled():
            view = self._view
            self._leave_inference_mode()
            if keys is not _UNSET or values is not _UNSET:  # written over that view, whose layout did not change
                self._view = view
        if keys is not _UNSET or values is not _UNSET or state is not _UNSET:
            self._pending_keys = self._pending_values = self._pending_state = _UNSET
            self._write_back(keys, values, state)
        elif self._view is not None and self._view_versions is not None and self._view_edited_in_place():
            self._store_view()  # edited in place through layer.keys / layer.values, as a DynamicLayer's can be
        module = self._module() if self._module is not None else None
        marked = getattr(module, "masked_key_indices", None)
        # The marks index the slots of the layer the module last attended: another layer it read before (the cache a
        # copy was made from, say) would evict the wrong tokens, and leave its owner without its evictions.
        reader = module.__dict__.get(_MARKED_LAYER_ATTR) if marked is not None else None
        if reader is not None and reader() is self and not _foreign_marks(module, marked):
            module.masked_key_indices = None
            owner = self._state_written.owner_type if self.has_state and self._state_written is not None else None
            if owner is not None:  # a press's slots, which the marks index, not token positions (head_wise_marks_error)
                raise head_wise_marks_error(owner.__name__)
            self._evict_marked(*marked)

    def _leave_inference_mode(self) -> None:
        """Copy the pools and the bookkeeping made under torch.inference_mode() once, on the first call outside it:
        inference tensors take no in-place write there, where a DynamicLayer's cat makes new tensors."""
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor) and value.is_inference():
                setattr(self, name, value.clone())
        self.slot_blocks = {name: pool.clone() if pool.is_inference() else pool
                            for name, pool in self.slot_blocks.items()}
        self._even_lengths.clear()
        self._forget_region()
        self._changed()

    def take_prompt_states(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys and values (B, H, q, d) of this pass if it was the layer's first (a prefill: the layer holds exactly
        these tokens), once; None otherwise. The attention path runs the model's own attention on them, a GEMM-based
        kernel, where reading them back through the block tables row by row cost 5x the prompt's sdpa on CPU."""
        states, self._prompt_states = self._prompt_states, None
        return states

    def attended_by(self, module: torch.nn.Module) -> None:
        """Remember the attention module that reads this layer, for its ``masked_key_indices``, and tell the module
        that the marks its presses leave in this pass are this layer's."""
        self._module = UnsavedRef(module)
        settle_marks(module, self)

    def __getstate__(self) -> dict:
        """A copy (copy.deepcopy of the cache, to branch a generation) or a save holds the marks' evictions: they wait
        on the module, which neither carries, until this layer is next read."""
        self.flush()
        return self.__dict__

    # ------------------------------------------------------------------------------------------------------------
    # A press that steps the layer in its pools, reading no view (KVzap while decoding)

    def written_state(self) -> LayerState | None:
        """The last state a press wrote, for its own fields (owner, counters) only: its tensors are not gathered
        from the blocks (``kvcomp_state`` does that). None when the layer holds no press state."""
        self.flush()
        return self._state_written if self.has_state else None

    def slots_appended_since_written(self) -> int:
        """The columns at the right of the view that every head appended since a press last wrote the layer (through
        the view or in its pools): tokens its compression took no part in."""
        self.flush()
        return int((self.lengths - self.bases).min()) if self.is_initialized else 0

    def own_appended_slots(self) -> None:
        """The press wrote the state of the slots appended since its last write into its pools itself: they are
        its base slots now, as after a write through the view (``kvcomp_state`` covers them)."""
        self.bases = self.lengths.clone()
        self._changed()
        self._may_hold_dead_slots = True

    def last_slots(self, name: str, count: int) -> torch.Tensor | None:
        """The per-slot pool `name` at each head's last `count` slots, (B, H, count) on the device; None when a head
        holds fewer (decided on the host)."""
        if not self.lengths.numel() or count > int(self.lengths.min()):
            return None
        slot = self.lengths.unsqueeze(-1) - count + torch.arange(count)
        return _gather(self.slot_blocks[name], self._flat_slots(slot), None, 0)

    def drop_dead_slots(self) -> None:
        """Evict the slots whose log-weight is -inf (a press's dead slots) from every head, as a compaction of the
        rectangular cache to its longest head does: the view is then as wide as that cache (a forward without
        cache_position places its token at the same position on both)."""
        self.flush()
        slot = torch.arange(self.longest_length()).expand(*self.lengths.shape, -1)
        index, real = self._pool_index(torch.where(slot < self.lengths.unsqueeze(-1), slot, -1))
        dead = (_gather(self.slot_blocks[_LOG_WEIGHTS], index, real, 0.0) == float("-inf")).cpu()
        if bool(dead.any()):
            self._evict(dead)
        if self.evicted_columns:  # the compaction drops the columns no head holds (of rows a rearrangement dropped)
            self.evicted_columns = 0
            self._changed()
        self._may_hold_dead_slots = False

    # ------------------------------------------------------------------------------------------------------------
    # Memory

    def blocks_in_use(self) -> int:
        return int((self.block_tables >= 0).sum()) if self.is_initialized else 0

    def bytes_held(self) -> int:
        """Bytes of the blocks in use: keys, values and every per-slot pool."""
        self.flush()
        return self.blocks_in_use() * self._block_bytes()

    def bytes_reserved(self) -> int:
        """Bytes of the whole pool, free blocks included."""
        return self.key_blocks.shape[0] * self._block_bytes() if self.is_initialized else 0

    def trim(self) -> None:
        """Give the free blocks back: the blocks in use move to the front of new pools of exactly their number (one
        copy of what is held), so bytes_reserved() == bytes_held()."""
        self.flush()
        if not self.is_initialized:
            return
        in_use = self.block_tables >= 0
        used = self.block_tables[in_use]
        self.block_tables[in_use] = torch.arange(used.numel())
        self._forget_region()
        index = self._uploaded(used)
        self.key_blocks, self.value_blocks = self.key_blocks[index], self.value_blocks[index]
        self.slot_blocks = {name: pool[index] for name, pool in self.slot_blocks.items()}
        self.free_blocks = []
        self._changed()

    def _block_bytes(self) -> int:
        pools = [self.key_blocks, self.value_blocks, *self.slot_blocks.values()]
        return sum(pool.element_size() * math.prod(pool.shape[1:]) for pool in pools)

    # ------------------------------------------------------------------------------------------------------------
    # Inputs of the attention op

    def attention_inputs(self) -> tuple[torch.Tensor, ...]:
        """(key_blocks, value_blocks, log_weight_blocks, block_tables, lengths) for ``ops.paged_decode_attention``."""
        if self._device_tables is None:
            self._device_tables = (self._uploaded(self.block_tables), self._uploaded(self.lengths))
        return (self.key_blocks, self.value_blocks, self.slot_blocks[_LOG_WEIGHTS], *self._device_tables)

    def probs_to_view(self, probs: torch.Tensor) -> torch.Tensor:
        """Attention probabilities (B, Hq, q, max length) over each head's slots → over the view's columns."""
        if self._evenness():
            return probs  # no padding: column t is slot t of every head
        width = self._width()
        columns = self._view_columns()
        batch, heads, width = columns.shape
        padded = torch.nn.functional.pad(probs, (0, 1))  # column -1 reads the extra 0
        index = self._uploaded(torch.where(columns >= 0, columns, probs.shape[-1]))
        group_rows = probs.shape[1] // heads * probs.shape[2]
        gathered = padded.reshape(batch, heads, group_rows, -1).gather(
            -1, index.unsqueeze(2).expand(batch, heads, group_rows, width))
        return gathered.reshape(*probs.shape[:3], width)

    def drop_padding(self, log_weights: torch.Tensor) -> None:
        """Evict the columns of the view whose log-weight (B, H, W) is -inf (the padding of a prefill). A prefill
        that is all padding for a row is refused: it is the first chunk of a chunked prefill whose later chunks hold
        padding, which a later pass, attending through the block tables without the mask, would store and attend."""
        columns = self._view_columns()
        padding = (log_weights.cpu() == float("-inf")) & (columns >= 0)
        only_padding = (padding.sum(-1) == (columns >= 0).sum(-1)).all(-1)
        if bool(only_padding.any()):
            tokens = self.get_seq_length()
            self.reset()  # the layer holds only this pass: the cache is left as it was before it
            raise ValueError(f"PagedKVCache: a prefill of {tokens} tokens holds only padding for batch rows "
                             f"{only_padding.nonzero().flatten().tolist()}: generate's prefill_chunk_size (or a "
                             f"hand-written chunked prefill) whose first chunk ends before a row's first token; the "
                             f"padding in later chunks would be held and attended as tokens. Use a first chunk that "
                             f"reaches every row's first token (a prefill_chunk_size above the longest left padding)")
        self.padding_dropped = int(padding.sum(-1).min()) if padding.numel() else 0
        if bool(padding.any()):
            evicted = torch.zeros(*self.lengths.shape, self.longest_length(), dtype=torch.bool)
            b, h, c = padding.nonzero(as_tuple=True)
            evicted[b, h, columns[b, h, c]] = True
            self._evict(evicted)

    def holds_every_token(self) -> bool:
        """Whether the view has a column for every token appended since the prompt, padding included (the left
        padding every row has, which the prefill dropped, counted as held), as a DynamicLayer that nothing compressed:
        transformers' mask, built for that width (get_mask_sizes), then describes it."""
        return self.tokens_appended == self._width() + self.padding_dropped

    def hide_new_tokens(self, padding: torch.Tensor) -> None:
        """Give the last pass's new tokens that `padding` (B, q) bool marks the log-weight -inf in every head, so that
        no query attends to them, then or later: the padding a later pass's mask hides (a batched next turn whose rows
        differ in length), which a DynamicCache's mask hides from every later query too."""
        new_tokens = padding.shape[-1]
        slot = self.lengths.unsqueeze(-1) - new_tokens + torch.arange(new_tokens)
        hidden = self._uploaded(padding.cpu().unsqueeze(1).expand_as(slot))
        self.slot_blocks[_LOG_WEIGHTS].view(-1)[self._flat_slots(slot)[hidden]] = float("-inf")

    # ------------------------------------------------------------------------------------------------------------
    # Allocation

    def _new_slot_pool(self, blocks: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(blocks, self.block_size, dtype=dtype, device=self.device)

    def _release_and_reserve(self, released: list[int], count: int) -> None:
        """Give the blocks `released` back to the free list and grow the pools until it holds at least `count`
        blocks. The grown pools are allocated before any block changes hands, so that a pool that cannot grow leaves
        the layer as it was."""
        needed = count - len(self.free_blocks) - len(released)
        pools = self._grown_pools(needed) if needed > 0 else None
        self.free_blocks.extend(released[::-1])  # lowest ids last, so that they are handed out first
        if pools is None:
            return
        capacity, grown = self.key_blocks.shape[0], pools[0].shape[0]
        self.key_blocks, self.value_blocks = pools[:2]
        self.slot_blocks = dict(zip(self.slot_blocks, pools[2:]))
        self._region_views.clear()  # views of the old pools
        self.free_blocks.extend(range(grown - 1, capacity - 1, -1))
        self._changed()

    def _grown_pools(self, needed: int) -> list[torch.Tensor]:
        """The key, value and slot pools with at least `needed` more blocks (they double, or grow by `needed` if that
        is more), not yet the layer's."""
        extra = max(needed, self.key_blocks.shape[0])
        try:
            return [torch.cat([pool, pool.new_zeros(extra, *pool.shape[1:])])
                    for pool in (self.key_blocks, self.value_blocks, *self.slot_blocks.values())]
        except RuntimeError as error:  # (torch.OutOfMemoryError is one)
            raise RuntimeError(f"PagedKVCache: cannot add {extra} blocks of block_size={self.block_size} slots "
                               f"({extra * self._block_bytes()} bytes) to the layer's pools on {self.device}: "
                               f"{str(error).splitlines()[0]}") from error

    def _resize(self, new_lengths: torch.Tensor) -> None:
        """Give each (batch, kv head) the blocks new_lengths (B, H) need: new blocks from the free list (growing the
        pool when it runs dry), blocks beyond the new length back to it, except that a head shortened by less than a
        block keeps one emptied block (a decoding press takes a head from M + 1 slots back to M at every step: its
        next token needs that block again). Slots below both lengths keep their data."""
        size = self.block_size
        if (self._evenness() and self._blocks_of_every_head()
                and bool((new_lengths == new_lengths.flatten()[0]).all())
                and self._resize_evenly(int(new_lengths.flatten()[0]))):
            return
        owned = self._owned_slots // size
        needed = (new_lengths + size - 1) // size
        spare = (self.lengths - new_lengths < size) & (owned > needed) & (new_lengths > 0)
        new_blocks = torch.where(spare, needed + 1, needed)
        if not torch.equal(owned, new_blocks):  # (a decoding step's usual resize keeps every head's blocks)
            self._hand_over_blocks(owned, new_blocks)
        self.lengths = new_lengths.clone()
        self.bases = torch.minimum(self.bases, self.lengths)
        self._changed()

    def _hand_over_blocks(self, owned: torch.Tensor, new_blocks: torch.Tensor) -> None:
        """Give each (batch, kv head) new_blocks (B, H) blocks where it owns `owned`: the entries beyond its new
        count go back to the free list, the missing ones are taken from it (grown first if it runs dry)."""
        width = int(new_blocks.max()) if new_blocks.numel() else 0
        if width > self.block_tables.shape[-1]:
            self.block_tables = torch.nn.functional.pad(self.block_tables, (0, width - self.block_tables.shape[-1]),
                                                        value=-1)
        entry = torch.arange(self.block_tables.shape[-1])
        released = (entry >= new_blocks.unsqueeze(-1)) & (entry < owned.unsqueeze(-1))
        taken = (entry >= owned.unsqueeze(-1)) & (entry < new_blocks.unsqueeze(-1))
        count = int(taken.sum())
        self._release_and_reserve(self.block_tables[released].tolist(), count)
        self._forget_region()
        self.block_tables[released] = -1
        if count:
            self.block_tables[taken] = self._take(taken, fresh_heads=bool((owned[new_blocks > owned] == 0).all()))
        self._owned_slots = new_blocks * self.block_size

    def _resize_evenly(self, length: int) -> bool:
        """:meth:`_resize` of a layer whose heads are all of one length and own one number of blocks to `length`
        slots per head, when that keeps every head's blocks (a decoding press's M + 1 -> M): decided and done on host
        integers and one small tensor. Returns False (nothing done) when blocks must change hands."""
        even, blocks, size = self._evenness(), self._blocks_of_every_head(), self.block_size
        if not even or not blocks:
            return False
        needed = -(-length // size)
        if blocks != (needed + 1 if even[0] - length < size and blocks > needed and length else needed):
            return False
        self.lengths = self._lengths_of_every_head(length)
        self.bases = self._lengths_of_every_head(min(even[1], length))
        self._changed()
        self._even = (length, min(even[1], length))
        return True

    def _take(self, taken: torch.Tensor, fresh_heads: bool) -> torch.Tensor:
        """Free blocks for the table entries marked in taken (B, H, entries) bool, in row-major order, each the
        block after its head's previous one when that is free, else the free list's last: a head's blocks stay
        consecutive where they can, which keeps a regular layout regular (:meth:`_regular_region`) when a decoding
        head grows by a block. When every head taking blocks held none (a prefill) and the free list ends with a
        run of consecutive ids (a fresh or grown pool), that is the run itself, taken without a loop per entry."""
        count = int(taken.sum())
        if fresh_heads:
            first = self.free_blocks[-1]
            if self.free_blocks[-count:] == list(range(first + count - 1, first - 1, -1)):
                del self.free_blocks[-count:]
                return torch.arange(first, first + count)
        return torch.tensor(self._take_each(taken.nonzero().tolist()), dtype=torch.long)

    def _take_each(self, entries: list[list[int]]) -> list[int]:
        """:meth:`_take` entry by entry, for the entries [b, h, e] (row-major)."""
        free = set(self.free_blocks)
        blocks, previous_entry = [], None
        for b, h, e in entries:
            if e == 0:
                wanted = None
            elif previous_entry == (b, h, e - 1):
                wanted = blocks[-1] + 1
            else:
                wanted = int(self.block_tables[b, h, e - 1]) + 1
            if wanted not in free:
                wanted = self.free_blocks.pop()
                while wanted not in free:  # taken out of order earlier in this call
                    wanted = self.free_blocks.pop()
            free.remove(wanted)
            blocks.append(wanted)
            previous_entry = (b, h, e)
        self.free_blocks = [block for block in self.free_blocks if block in free]
        return blocks

    def _take_rows(self, rows: torch.Tensor) -> None:
        """Keep the batch rows `rows` (B',) names, in its order, repeats allowed. A row kept once keeps its blocks;
        every further copy of a row gets blocks of its own, copied, since a later eviction or merge in one copy must
        not touch the other's slots; the blocks of the rows not kept go back to the free list. The press's state
        follows: its per-slot pools with the blocks, its counters with a batch dimension and a padded batch's rows
        (LayerState.take_rows). The view stays as wide as before, as the rectangular cache keeps its columns: those
        only the dropped rows held are kept empty (``evicted_columns``)."""
        if rows.dtype == torch.bool or rows.dtype.is_floating_point or rows.dtype.is_complex:
            raise TypeError(f"PagedKVCache: expected integer batch rows (a beam index), got {rows.dtype} {rows}")
        if rows.dim() != 1:  # a DynamicLayer's keys[rows] would grow a dimension, not select rows
            raise IndexError(f"PagedKVCache: expected batch rows as a 1-D index, got shape {tuple(rows.shape)}")
        self.flush()  # what was written through the view, and kvpress's marks, name the rows as they were
        rows = rows.to("cpu", torch.long)
        order = rows.tolist()
        batch = self.lengths.shape[0]
        if any(not 0 <= row < batch for row in order):  # refused before any block changes hands
            raise IndexError(f"PagedKVCache: batch rows {order} asked of a batch of {batch}")
        if order == list(range(batch)):  # beam search keeping every beam where it is
            return
        width = self._width()
        seen, copies = set(), []
        for row in order:
            copies.append(row in seen)
            seen.add(row)
        dropped = torch.ones(batch, dtype=torch.bool)
        dropped[rows] = False
        released = self.block_tables[dropped]
        released = released[released >= 0]
        tables = self.block_tables.index_select(0, rows)
        copied = (tables >= 0) & torch.tensor(copies, dtype=torch.bool).view(-1, 1, 1)
        count = int(copied.sum())
        self._release_and_reserve(released.tolist(), count)
        self.block_tables = tables
        if count:
            sources = self.block_tables[copied]
            # Every copy's head takes all its blocks afresh (as a prefill's do): a run where the free list ends in one.
            self.block_tables[copied] = self._take(copied, fresh_heads=True)
            source, target = self._uploaded(sources), self._uploaded(self.block_tables[copied])
            for pool in (self.key_blocks, self.value_blocks, *self.slot_blocks.values()):
                pool.index_copy_(0, target, pool.index_select(0, source))
        self.lengths, self.bases = self.lengths.index_select(0, rows), self.bases.index_select(0, rows)
        self._owned_slots = self._owned_slots.index_select(0, rows)
        if self._base_columns is not None:
            self._base_columns = self._base_columns.index_select(0, rows)
        self._even_lengths.clear()  # of the old batch size
        self._forget_region()
        self._changed()
        self.rearrangements += 1
        self.evicted_columns += width - self._width()
        self._changed()
        if self.has_state:
            state = self._state_written
            state.counters = self.counters
            state.take_rows(rows)
            self.counters = state.counters

    def _forget_region(self) -> None:
        """Forget what was derived from the block tables (their layout changed)."""
        self._slot_index = self._region = self._even_blocks = self._state_view_cache = None
        self._region_views.clear()

    def _changed(self) -> None:
        """Forget what was derived from the tables, lengths and bases."""
        self._view = self._device_tables = self._layout = self._rows = self._columns = self._even = None
        self._widest = self._state_index = None

    def _evenness(self) -> tuple[int, int] | bool:
        """(length, base) when every head has the same length and the same base and the view keeps no column for
        evicted marks (no padding in the view: column t is slot t), False otherwise; on host integers, kept until the
        lengths change, so that a decoding step of a press keeping M slots per head decides its path without a tensor
        op."""
        if self._even is None:
            length, base = self.lengths.flatten()[:1], self.bases.flatten()[:1]
            same = (bool(length.numel()) and not self.evicted_columns
                    and bool(((self.lengths == length) & (self.bases == base)).all()))
            self._even = (int(length), int(base)) if same else False
        return self._even

    def _lengths_of_every_head(self, length: int) -> torch.Tensor:
        """A (B, H) int64 tensor of `length`, shared between calls, so that a decoding step of heads of one length
        sets its lengths and bases without a tensor op. The layer never writes lengths or bases in place (they may be
        one tensor)."""
        tensor = self._even_lengths.get(length)
        if tensor is None:
            if len(self._even_lengths) >= 8:  # lengths that keep growing (a press that does not compress)
                self._even_lengths.clear()
            tensor = self._even_lengths[length] = torch.full(self.lengths.shape, length, dtype=torch.long)
        return tensor

    def _blocks_of_every_head(self) -> int:
        """The blocks each head owns when all own as many (0 otherwise), kept until the tables change."""
        if self._even_blocks is None:
            owned = (self._owned_slots // self.block_size).flatten()
            self._even_blocks = int(owned[0]) if owned.numel() and bool((owned == owned[0]).all()) else 0
        return self._even_blocks

    def _flat_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Indices into the pools viewed as (N * S, ...) of the slots (B, H, X) of each (batch, kv head)."""
        return self._owned_slot_index().gather(-1, self._uploaded(slots))

    def _pool_slots(self, batch_index: torch.Tensor, head_index: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Indices into the pools viewed as (N * S, ...) of the slots listed by three host tensors of one length."""
        return self._owned_slot_index()[tuple(self._uploaded(index) for index in (batch_index, head_index, slot))]

    def _uploaded(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor of the layer's bookkeeping on the pools' device. non_blocking: from pageable memory the copy is
        staged before it returns, without waiting for the work queued on the device (a blocking copy waits for all of
        it), so the host tensor may be edited in place afterwards (not so were it pinned)."""
        return tensor.to(self.device, non_blocking=True)

    def _owned_slot_index(self) -> torch.Tensor:
        """(B, H, entries * S) on the device: the pool index of every slot of every block table entry, kept until the
        tables change (a decoding step that stays within its blocks reuses it). A -1 entry (a slot beyond the head's
        length, read only under a mask) reads block 0."""
        if self._slot_index is None:
            blocks = self._uploaded(self.block_tables.clamp(min=0)) * self.block_size
            self._slot_index = (blocks.unsqueeze(-1) + torch.arange(self.block_size, device=self.device)).flatten(2)
        return self._slot_index

    # ------------------------------------------------------------------------------------------------------------
    # The view's layout

    def _width(self) -> int:
        """The view's width (host integer), kept until the lengths change."""
        if self._widest is None:
            even = self._evenness()
            if not self.lengths.numel():
                self._widest = 0
            elif even:
                self._widest = even[0]
            else:
                self._widest = (int(self.bases.max()) + int((self.lengths - self.bases).max())
                                + self.evicted_columns)
        return self._widest

    def longest_length(self) -> int:
        """The most slots any (batch, kv head) holds, a host integer (the lengths live on the host): the attention op's
        max_len, so that it reads nothing back from the device."""
        even = self._evenness()
        if even:
            return even[0]
        return int(self.lengths.max()) if self.lengths.numel() else 0

    def _view_columns(self) -> torch.Tensor:
        """(B, H, W) int64: the slot each column of the view shows, -1 for padding. Base slots sit at their own column
        (for a press that left-pads, shifted to end where the longest head's end), the slots appended since at the end.
        Kept until the layout changes (the attention's probabilities and the view of a step both need it)."""
        if self._columns is None:
            self._columns = self._layout_columns()
        return self._columns

    def _layout_columns(self) -> torch.Tensor:
        width = self._width()
        column = torch.arange(width)
        if bool((self.lengths == width).all()):  # no padding (heads of equal length): column t is slot t
            return column.expand(*self.lengths.shape, width)
        bases = self.bases.unsqueeze(-1)
        appended = self.lengths.unsqueeze(-1) - bases
        start = width - appended  # first column of the appended slots
        # The first column of each head's base slots; a press that left-pads has the empty columns before them.
        first = (int(self.bases.max()) + self.evicted_columns - bases if self._bases_at_right
                 else torch.zeros_like(bases))
        in_base = (column >= first) & (column < first + bases)
        slot = torch.where(in_base, column - first, self.lengths.unsqueeze(-1) - (width - column))
        real = in_base | (column >= start)
        return torch.where(real, slot, -1)

    def _pool_index(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool index (B, H, X) on the device of each head's slots (B, H, X) (block 0 where -1) and where it is real."""
        real = slots >= 0
        return self._flat_slots(torch.where(real, slots, 0)), self._uploaded(real)

    def _view_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_pool_index` of the view's columns (None for "all real" when no head is padded), kept until the
        layout changes."""
        if self._layout is None:
            if self._evenness():  # no padding: column t is slot t of every head
                self._layout = self._owned_slot_index()[..., :self._width()], None
            else:
                self._layout = self._pool_index(self._view_columns())
        return self._layout

    def _view_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices into the view flattened to (B·H·W) of its real columns and of its padding (a padded layout), kept
        until the layout changes."""
        if self._rows is None:
            real = self._view_layout()[1].reshape(-1)
            self._rows = real.nonzero().squeeze(1), (~real).nonzero().squeeze(1)
        return self._rows

    def _regular_region(self) -> tuple[int, int] | None:
        """(first block, blocks between heads) when every head owns the same number of blocks, in order and
        consecutive, and head (b, h) starts `b·H + h` strides after the first (what a prefill into an empty pool, or
        a trim, lays out, and decoding keeps): each pool is then a strided (B, H, slots, ...) tensor, which the view
        reads and a press's write-back writes without an index. None otherwise; kept until the tables change."""
        if self._region is None:
            self._region = False
            owned = self._owned_slots // self.block_size
            blocks = int(owned.flatten()[0]) if owned.numel() else 0
            if blocks and bool((owned == blocks).all()):
                tables = self.block_tables[..., :blocks]
                first = tables[..., :1]
                heads = first.flatten()
                stride = int(heads[1] - heads[0]) if heads.numel() > 1 else blocks
                start = int(heads[0])
                if (stride >= blocks and torch.equal(tables, first + torch.arange(blocks))
                        and torch.equal(heads, start + stride * torch.arange(heads.numel()))):
                    self._region = (start, stride)
        return self._region or None

    def _region_view(self, pool: torch.Tensor, width: int) -> torch.Tensor:
        """The first `width` slots of every head of `pool` (N, S, ...) as a (B, H, width, ...) tensor sharing its
        memory (the layout must be :meth:`_regular_region`'s). Kept until the tables or the pools change: a decoding
        step reads and writes the same few views (M + 1 slots after the append, M after the press) in every pool."""
        cached = self._region_views.get((id(pool), width))
        if cached is not None and cached[0] is pool:
            return cached[1]
        start, stride = self._region
        batch, heads = self.lengths.shape
        head_stride = stride * pool.stride(0)
        view = pool.as_strided((batch, heads, width, *pool.shape[2:]),
                               (heads * head_stride, head_stride, *pool.stride()[1:]), start * pool.stride(0))
        if len(self._region_views) >= 32:  # widths that keep growing (a press that does not compress while decoding)
            self._region_views.clear()
        self._region_views[id(pool), width] = (pool, view)
        return view

    def _gather_view(self, pool: torch.Tensor, fill, width: int | None = None) -> torch.Tensor:
        """pool (N, S, ...) at the view's first `width` columns (all by default) → (B, H, width, ...), `fill` on
        padding; without padding, on a regular layout, a tensor sharing the pool's memory (as a DynamicLayer's keys
        are the cache's own: what is written into it is in the cache)."""
        if self._evenness() and self._regular_region() is not None:  # no padding: the pools' strided view
            return self._region_view(pool, self._width() if width is None else width)
        index, real = self._view_layout()
        if width is None and real is not None:  # the whole view: fill only the padding rows, not every element
            gathered = _gather(pool, index, None, fill)
            gathered.view(-1, *pool.shape[2:]).index_fill_(0, self._view_rows()[1], fill)
            return gathered
        if width is not None and width != index.shape[-1]:
            if self._state_index is None or self._state_index[0].shape[-1] != width:
                self._state_index = (index[..., :width].contiguous(),
                                     real[..., :width].contiguous() if real is not None else None)
            index, real = self._state_index
        return _gather(pool, index, real, fill)

    def _current_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.flush()
        if self._view is None:
            self._view = (self._gather_view(self.key_blocks, 0), self._gather_view(self.value_blocks, 0))
            # A view of the pools' memory holds every edit made through it already: nothing to track.
            self._view_versions = None if self._view_shares_pools() else _versions(self._view)
        return self._view

    # ------------------------------------------------------------------------------------------------------------
    # Writes

    def view_holes(self, keys: torch.Tensor) -> torch.Tensor | None:
        """(B, H, W) bool on the pools' device when `keys` is the view's keys: its columns that show no slot of their
        head (a batch row's padding the prefill dropped, slots kvpress's head-wise marks evicted, the gap of a head
        shorter than the longest), filled with zeros; None where every column shows a slot, as every column of
        kvpress's own cache does, or for other keys. For keys a kvpress press selected from the view and wrote, not
        stored yet (what the next press of a ComposedPress reads), the holes among them. A kvpress press ranks them
        below every token."""
        if self._view is None or self._evenness() or not bool((self._view_columns() < 0).any()):
            return None
        holes = ~self._view_layout()[1]
        if keys is self._view[0]:
            return holes
        selected = self._selection_of(keys)
        return None if selected is None else holes.gather(-1, selected.to(holes.device))

    def _selection_of(self, keys: torch.Tensor) -> torch.Tensor | None:
        """The columns (B, H, W') of the view that `keys` are, where a kvpress press selected them (select_columns)."""
        return self._selection[1] if self._selection is not None and keys is self._selection[0] else None

    def view_positions(self, keys: torch.Tensor) -> torch.Tensor | None:
        """(B, H, W) int64 on the host when `keys` is the view's keys: the token position of the slot each column
        shows, -1 for a hole or a slot whose position is unknown; None for other keys. Column c is position c plus
        the padding the prefill dropped until slots move (marks evicted, a head grew shorter than another). For keys a
        kvpress press selected from the view, not stored yet, the positions of the columns it selected."""
        selected = None if self._view is None or keys is self._view[0] else self._selection_of(keys)
        if self._view is None or (keys is not self._view[0] and selected is None):
            return None
        columns = self._view_columns()
        positions = self._slot_positions()
        if not positions.shape[-1]:
            positions = torch.full(columns.shape, -1, dtype=torch.long)
        else:
            positions = torch.where(columns >= 0, positions.gather(-1, columns.clamp(min=0)), -1)
        return positions if selected is None else positions.gather(-1, selected.cpu())

    def select_columns(self, source: torch.Tensor, columns: torch.Tensor, selected: torch.Tensor) -> None:
        """Say that `selected`, the keys a kvpress press is about to write, are the columns (B, H, W') of `source`: the
        view's keys, or keys another press selected from them and wrote, not stored yet (a ComposedPress). The write
        drops those that were holes of the view (:meth:`view_holes`) and keeps the others' token positions."""
        earlier = self._selection_of(source)
        if earlier is None and (self._view is None or source is not self._view[0]):
            return  # keys the layer did not hand out: their columns say nothing of its slots
        self._selection = selected, columns if earlier is None else earlier.gather(-1, columns.to(earlier.device))

    def _write_back(self, keys, values, state) -> None:
        view = self._view
        selection, self._selection = self._selection, None
        keys = view[0] if keys is _UNSET and view is not None else keys
        values = view[1] if values is _UNSET and view is not None else values
        if keys is _UNSET or values is _UNSET:
            current = self._current_view()
            keys = current[0] if keys is _UNSET else keys
            values = current[1] if values is _UNSET else values
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"PagedKVCache: keys of shape {tuple(keys.shape)} and values of shape "
                             f"{tuple(values.shape)} were written to a layer: write both, over the same slots")
        for name, tensor, pool in (("keys", keys, self.key_blocks), ("values", values, self.value_blocks)):
            if tensor.dim() != 4 or tensor.shape[-1] != pool.shape[-1]:
                raise ValueError(f"PagedKVCache: {name} of shape {tuple(tensor.shape)} were written to a layer whose "
                                 f"pool holds (batch, kv heads, tokens, {pool.shape[-1]}) {name}")
        if state is _UNSET:
            if view is not None and keys is view[0] and values is view[1]:
                # kvpress's hook after a press that only masks, or that edited the view in place (ThinK zeroes key
                # channels), which only a view over the pools' memory has stored already
                if self._view_edited_in_place():
                    self._store_view()
                return
            if view is not None and _is_prefix(keys, view[0]) and _is_prefix(values, view[1]):
                self._cut(keys.shape[-2])
                return
            if self.has_state:
                self._state_displaced_from = (self._state_written.owner_name() if self._state_written is not None
                                              else "a kvpress_cpp press")
            selected = selection[1] if selection is not None and keys is selection[0] else None
            if self._unnamed_columns_over_holes(keys, values, view, selected):
                raise _selection_over_holes_error("a kvpress press", keys, view[0])
            self._rewrite(keys, values, None, *self._selection_written(view, selected))
            return
        self._state_displaced_from = None
        self._rewrite(keys, values, state)

    def _unnamed_columns_over_holes(self, keys, values, view, selected: torch.Tensor | None) -> bool:
        """Whether `keys` and `values`, written without a state, are columns of a view with holes that their writer did
        not name (`selected`, from select_columns): neither the view nor a prefix of it. Stored, the holes' zeros
        would be attended as tokens, so such a write is refused."""
        return (view is not None and selected is None and bool(keys.shape[2])
                and not (_is_prefix(keys, view[0]) and _is_prefix(values, view[1]))
                and self.view_holes(view[0]) is not None)

    def _selection_written(self, view, selected: torch.Tensor | None):
        """(dropped, positions) for keys written without a state, from the columns of `view` their writer said they
        are (select_columns): the columns (B, H, W') that were holes (None where none was) and the token positions of
        the others; (None, None) without a selection (a kvpress press's plain tokens over a view without holes)."""
        if selected is None or view is None:
            return None, None
        holes = self.view_holes(view[0])
        positions = self.view_positions(view[0]).gather(-1, selected.cpu())  # (view[0] is never a selection)
        dropped = None if holes is None else holes.gather(-1, selected.to(holes.device))
        return (dropped if dropped is not None and bool(dropped.any()) else None), positions

    def refuse_unknown_selection(self, press_name: str, layer_idx: int) -> None:
        """Refuse, naming the press and the layer, the keys `press_name` (a kvpress press, whose hook has just run)
        wrote without saying which columns of a view with holes they are, as the write itself would when stored
        (:meth:`_unnamed_columns_over_holes`); nothing of the write is stored."""
        keys, view = self._pending_keys, self._view
        if keys is _UNSET or self._pending_state is not _UNSET or view is None:
            return
        values = view[1] if self._pending_values is _UNSET else self._pending_values
        if not self._unnamed_columns_over_holes(keys, values, view, self._selection_of(keys)):
            return
        self._pending_keys = self._pending_values = _UNSET
        self._selection = None
        raise _selection_over_holes_error(f"{press_name} on layer {layer_idx}", keys, view[0])

    def check_state_in_place(self) -> None:
        """Raise if another press's write displaced a press's per-slot state (see ``_state_displaced_from``); a pass
        calls it after its update, which stored every pending write."""
        if self._state_displaced_from is not None:
            raise slots_rearranged_error(self._state_displaced_from)

    def _cut(self, width: int) -> None:
        """Keep each head's columns of the view before `width` (kvpress's pipeline dropping an answer)."""
        self.tokens_appended -= self._width() - width
        if self._next_position is not None:  # the tokens counted on the host: the cut ones are no longer held
            self._next_position -= self._width() - width
        else:
            self._cut_since_positions_given += self._width() - width
        appended = self.lengths - self.bases
        if self._marks_evicted:
            kept_appended = self._appended_before(width)
        else:
            start = self._width() - appended
            kept_appended = (width - start).clamp(min=0).minimum(appended)
        if self._base_columns is not None:  # marks evicted base slots: those before `width` in the rectangular cache
            bases = (self._base_columns < width).sum(-1)
            self._base_columns = self._base_columns.masked_fill(self._base_columns >= width, _NO_COLUMN)
        elif self._bases_at_right:  # each head's base ends where the longest one's does
            bases = (self.bases - max(int(self.bases.max()) + self.evicted_columns - width, 0)).clamp(min=0)
        else:
            bases = self.bases.clamp(max=width)
        self._resize(bases + kept_appended)
        self.bases = bases
        if self._marks_evicted or self.evicted_columns:  # as wide as the rectangular cache cut to `width`
            self.evicted_columns = width - int(bases.max()) - int(kept_appended.max())
        self._changed()
        self.rearrangements += 1

    def _appended_before(self, width: int) -> torch.Tensor:
        """(B, H): each head's appended slots that the rectangular cache holds before column `width`, once marks
        evicted some: a head's appended slots sit at the right of the view, so one that lost a slot shows its earlier
        ones a column further right than the rectangular cache, and its columns no longer tell which tokens a cut
        removes. Their positions do: the appended tokens follow one another up to the last one held (the marks spare
        the latest tokens: DMSPress's sliding window, AdaKVPress's prompt-only marks). One read of the device."""
        positions = self._slot_positions()
        slot = torch.arange(positions.shape[-1])
        appended = (slot >= self.bases.unsqueeze(-1)) & (slot < self.lengths.unsqueeze(-1))
        last = int(positions.max()) if positions.numel() else -1
        first_cut = last + 1 - (self._width() - width)
        return (appended & (positions < first_cut)).sum(-1)

    def _rewrite(self, keys: torch.Tensor, values: torch.Tensor, state: LayerState | None,
                 dropped: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> None:
        """Store rectangular keys, values (B, H, T, d) and their state: each head keeps its columns whose log-weight
        is not -inf, in order; without a state, every column is a plain token except those `dropped` (B, H, T), at
        its `positions` (B, H, T) where given, else at an unknown position."""
        batch, heads, width = keys.shape[:3]
        if (batch, heads) != tuple(self.lengths.shape):
            raise ValueError(f"PagedKVCache: a press wrote keys of shape {tuple(keys.shape)} to a layer of "
                             f"{tuple(self.lengths.shape)} (batch, kv heads)")
        self.rearrangements += 1
        self.padding_dropped = 0
        if state is None:
            log_weights = torch.zeros(batch, heads, width, device=keys.device)
            if dropped is not None:
                log_weights.masked_fill_(dropped, float("-inf"))
            all_kept = dropped is None
        elif self._store_state_in_place(keys, values, state):
            return
        else:
            log_weights = state.log_weights
            # A decoding step usually keeps every slot: known on the host, or the minimum (two tensor ops and a read
            # back) decides, the mask only if needed.
            all_kept = (not log_weights.numel() or self._known_to_hold_every_slot(state)
                        or log_weights.min().item() != float("-inf"))
        self._forget_marks()  # once all_kept read the view the press was given
        if all_kept:  # every column kept (presses that keep equal lengths): no selection
            if not self._resize_evenly(width):
                self._resize(torch.full((batch, heads), width, dtype=torch.long))
            self.bases = self.lengths
            self._changed()
            self._even = (width, width)
            if self._regular_region() is not None:  # one strided copy per pool, none where the press wrote in place
                def store(pool, tensor):
                    _copy_into(self._region_view(pool, width), tensor)
            else:
                flat = self._view_layout()[0].reshape(-1)

                def store(pool, tensor):
                    # What the press wrote may share the pool's memory (the view of a regular layout before a resize).
                    tensor = _unshared(tensor, pool)
                    pool.view(-1, *pool.shape[2:]).index_copy_(0, flat, tensor.reshape(-1, *pool.shape[2:]))
        else:
            keep = log_weights != float("-inf")
            counts = keep.sum(-1).cpu()
            self._resize(counts)
            self.bases = counts.clone()
            self._changed()
            slot = (keep.cumsum(-1) - 1).cpu()
            flat = self._flat_slots(slot.clamp(min=0))[self._uploaded(keep)]

            def store(pool, tensor):
                pool.view(-1, *pool.shape[2:]).index_copy_(0, flat, tensor[keep].reshape(-1, *pool.shape[2:]))
        store(self.key_blocks, keys.to(self.dtype))
        store(self.value_blocks, values.to(self.dtype))
        per_slot = {} if state is None else state.per_slot
        pools = {_LOG_WEIGHTS: self.slot_blocks[_LOG_WEIGHTS], _POSITIONS: self.slot_blocks[_POSITIONS]}
        for name, tensor in per_slot.items():
            pool = self.slot_blocks.get(name)
            if pool is None or pool.dtype != tensor.dtype:
                pool = self._new_slot_pool(self.key_blocks.shape[0], tensor.dtype)
            pools[name] = pool
            store(pool, tensor)
        store(pools[_LOG_WEIGHTS], log_weights.float())
        # A press may reorder or merge slots: their positions are unknown, unless a selection said which they are.
        if positions is not None:
            store(pools[_POSITIONS], positions.to(self.device, torch.int32))
        elif all_kept and self._regular_region() is not None:
            self._region_view(pools[_POSITIONS], width).fill_(-1)
        else:
            store(pools[_POSITIONS], torch.full(log_weights.shape, -1, dtype=torch.int32, device=self.device))
        if any(pools[name] is not self.slot_blocks.get(name) for name in pools):
            self._region_views.clear()  # views of pools no longer used
        self.slot_blocks = pools
        self.has_state = state is not None
        self.counters = state.counters if state is not None else {}
        self._may_hold_dead_slots = False  # a slot of -inf was dropped, or (keeps_held_slots) none was given
        left_padded = state is not None and state.left_padded
        if self._bases_at_right != left_padded:
            self._bases_at_right = left_padded
            self._changed()  # the layout moved

    def _known_to_hold_every_slot(self, state: LayerState) -> bool:
        """Whether a write of `state` holds every slot, known on the host: its press keeps every slot it is given
        (``keeps_held_slots``), and every column of the view it was given held one (no head padded to another's
        length, no dead slot stored)."""
        return state.keeps_held_slots and bool(self._evenness()) and not self._may_hold_dead_slots

    def _store_state_in_place(self, keys: torch.Tensor, values: torch.Tensor, state: LayerState) -> bool:
        """Store only the state when a press hands back the view's own keys and values (KVzap between its
        compactions: it marks the tokens it evicts -inf and moves nothing): every slot stays where it is, those whose
        log-weight became -inf as dead slots, attended as the rectangular cache attends them, until the press
        rewrites the layer (its compaction) or a head holds more than two blocks of them. Returns whether it stored
        the state (False: the caller rewrites the layer, dropping the dead slots)."""
        view = self._view
        if view is None or keys is not view[0] or values is not view[1] or not self.has_state:
            return False
        log_weights = state.log_weights
        own_pools = set(self.slot_blocks) - {_LOG_WEIGHTS, _POSITIONS}
        if (log_weights.shape != keys.shape[:3] or set(state.per_slot) != own_pools
                or any(self.slot_blocks[name].dtype != tensor.dtype or tensor.shape != log_weights.shape
                       for name, tensor in state.per_slot.items())):
            return False
        real = self._view_layout()[1]
        # A press that keeps every slot it is given, over a view of held slots only (a merging press's step under its
        # budget), stores no dead slot: nothing to count, and nothing read back.
        all_held = self._known_to_hold_every_slot(state)
        if not all_held:
            dead = log_weights == float("-inf")
            if real is not None:
                dead &= real
            if bool((dead.sum(-1) > 2 * self.block_size).any()):
                return False
        tensors = {**state.per_slot, _LOG_WEIGHTS: log_weights.float()}
        self._store_over_view([(self.slot_blocks[name], tensor) for name, tensor in tensors.items()])
        # Every slot is now the press's: the view shows each head's slots from column 0 (no appended part), and
        # keeps no column for evicted marks (as wide as the press's layout, as after a rewrite). The columns of rows a
        # batch rearrangement dropped stay: the press wrote them back, as the rectangular cache keeps them.
        self.bases = self.lengths.clone()
        if self._marks_evicted:
            self._forget_marks()
        self._bases_at_right = state.left_padded
        self._changed()
        self.counters = state.counters
        self._may_hold_dead_slots = not all_held
        return True

    def _store_over_view(self, stores: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store each (pool, tensor laid out as the view (B, H, W, ...)) at the view's slots in the pool, its padding
        columns left out."""
        index, real = self._view_layout()
        if real is None and self._regular_region() is not None:
            for pool, tensor in stores:
                _copy_into(self._region_view(pool, tensor.shape[2]), tensor)
            return
        rows = self._view_rows()[0] if real is not None else None
        flat = index.reshape(-1) if rows is None else index.reshape(-1).index_select(0, rows)
        for pool, tensor in stores:
            tensor = tensor.reshape(-1, *pool.shape[2:])
            tensor = tensor if rows is None else tensor.index_select(0, rows)
            pool.view(-1, *pool.shape[2:]).index_copy_(0, flat, tensor)

    def _store_view(self) -> None:
        self._store_over_view([(self.key_blocks, self._view[0]), (self.value_blocks, self._view[1])])
        self._view_versions = _versions(self._view)

    def _view_edited_in_place(self) -> bool:
        """Whether the view, handed back as it was read, may hold edits made in place that the pools lack: a gathered
        copy (not the pools' memory) whose version counters moved since, or that keeps none (inference mode)."""
        if self._view_shares_pools():
            return False
        return self._view_versions is None or self._view_versions != _versions(self._view)

    def _view_shares_pools(self) -> bool:
        return self._view[0].untyped_storage().data_ptr() == self.key_blocks.untyped_storage().data_ptr()

    def _evict(self, evicted: torch.Tensor) -> None:
        """Remove the slots evicted (B, H, max length) bool of each head, keeping the others in order; the view
        keeps each head's base and appended parts (minus what left them)."""
        self.rearrangements += 1
        batch, heads = self.lengths.shape
        slot = torch.arange(evicted.shape[-1])
        real = slot < self.lengths.unsqueeze(-1)
        keep = real & ~evicted
        in_base = slot < self.bases.unsqueeze(-1)
        new_bases = (keep & in_base).sum(-1)
        new_lengths = keep.sum(-1)
        # The kept slots are listed on the host, where the mask is: a boolean index on the device would wait for it.
        batch_index, head_index, kept_slot = keep.nonzero(as_tuple=True)
        source = self._pool_slots(batch_index, head_index, kept_slot)
        saved = [pool.reshape(-1, *pool.shape[2:]).index_select(0, source)
                 for pool in (self.key_blocks, self.value_blocks, *self.slot_blocks.values())]
        self._resize(new_lengths)
        self.bases = new_bases
        self._changed()
        target = self._pool_slots(batch_index, head_index, keep.cumsum(-1)[keep] - 1)
        for pool, data in zip((self.key_blocks, self.value_blocks, *self.slot_blocks.values()), saved):
            pool.view(-1, *pool.shape[2:])[target] = data

    def _evict_marked(self, batch_index, head_index, positions) -> None:
        """Evict the slots of absolute token positions kvpress's masked_key_indices name, per (batch, kv head)."""
        slot_positions = self._slot_positions()
        if not len(positions) or not slot_positions.numel():
            return
        batch, heads, width = slot_positions.shape
        horizon = int(max(int(positions.max()), int(slot_positions.max()))) + 1
        marks = torch.zeros(batch, heads, horizon, dtype=torch.bool)
        marks[batch_index.cpu(), head_index.cpu(), positions.cpu()] = True
        known = slot_positions >= 0
        evicted = marks.gather(-1, slot_positions.clamp(min=0)) & known
        if bool(evicted.any()):
            width = self._width()
            self._note_base_columns(evicted)
            self._evict(evicted)
            self.evicted_columns += width - self._width()
            self._marks_evicted = True
            self._changed()

    def _note_base_columns(self, evicted: torch.Tensor) -> None:
        """Before marks evict the slots `evicted` (B, H, max length): the rectangular cache's columns of each head's
        base slots that stay (``_base_columns``), where any base slot goes."""
        base = int(self.bases.max()) if self.bases.numel() else 0
        in_base = torch.arange(base) < self.bases.unsqueeze(-1)
        if not bool((evicted[..., :base] & in_base).any()):
            return
        columns = self._base_columns
        if columns is None:  # base slot i at column i (for a press that left-pads, after the empty columns)
            first = base + self.evicted_columns - self.bases if self._bases_at_right else torch.zeros_like(self.bases)
            columns = first.unsqueeze(-1) + torch.arange(base)
        kept = in_base & ~evicted[..., :base]
        order = torch.sort((~kept).to(torch.uint8), dim=-1, stable=True).indices  # each head's kept slots first
        self._base_columns = columns[..., :base].gather(-1, order).masked_fill(~kept.gather(-1, order), _NO_COLUMN)

    def _slot_positions(self) -> torch.Tensor:
        """(B, H, max length) int64 token position of each head's slots in slot order, -1 beyond its length."""
        slot = torch.arange(self.longest_length()).expand(*self.lengths.shape, -1)
        index, real = self._pool_index(torch.where(slot < self.lengths.unsqueeze(-1), slot, -1))
        return _gather(self.slot_blocks[_POSITIONS], index, real, -1).long().cpu()


def _gather(pool: torch.Tensor, index: torch.Tensor, real: torch.Tensor | None, fill) -> torch.Tensor:
    """pool (N, S, ...) at the pool indices (B, H, X) → (B, H, X, ...), `fill` where not real (None: all real)."""
    gathered = pool.reshape(-1, *pool.shape[2:]).index_select(0, index.reshape(-1)).view(*index.shape, *pool.shape[2:])
    if real is None:
        return gathered
    return gathered.masked_fill(~real.view(*real.shape, *([1] * (pool.dim() - 2))), fill)


def _versions(tensors: tuple[torch.Tensor, ...]) -> tuple[int, ...] | None:
    """The tensors' version counters (bumped by every in-place op), None where they keep none (inference mode)."""
    if any(torch.is_inference(tensor) for tensor in tensors):
        return None
    return tuple(tensor._version for tensor in tensors)


def _copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """target[...] = source, skipped when source already is target's memory (an in-place op on the view)."""
    if source.data_ptr() == target.data_ptr() and source.stride() == target.stride() and source.dtype == target.dtype:
        return
    target.copy_(_unshared(source, target))


def _unshared(tensor: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """tensor, or a copy of it when it shares pool's memory (an index_copy_ into pool may not read pool)."""
    shared = tensor.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
    return tensor.clone() if shared else tensor


def _selection_over_holes_error(writer: str, keys: torch.Tensor, view: torch.Tensor) -> RuntimeError:
    return RuntimeError(
        f"PagedKVCache: {writer} wrote {tuple(keys.shape[:3])} (batch, kv heads, slots) of keys selected from a view "
        f"{tuple(view.shape[:3])} with holes, columns that hold no slot of their head (a batch row's padding dropped "
        f"at prefill, slots AdaKVPress or DMSPress evicted, a head shorter than the longest). ScorerPress's own "
        f"selection leaves them out; a press that selects columns its own way (ChunkPress, BlockPress, "
        f"KeyRerotationPress, ...) may keep their zeros as tokens. Use a DynamicCache for it, or an unpadded batch "
        f"without a head-wise press before it")


def _is_prefix(tensor: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether `tensor` is view[:, :, :n] for some n (the same storage, offset and strides)."""
    return (tensor.data_ptr() == view.data_ptr() and tensor.shape[:2] == view.shape[:2]
            and tensor.shape[2] <= view.shape[2] and tensor.shape[3:] == view.shape[3:]
            and tensor.stride() == view.stride())


class PagedKVCache(Cache):
    """A transformers Cache of :class:`PagedLayer`: pass it as ``past_key_values`` to ``generate``, a model's forward
    or kvpress's pipeline (``pipe(context, question=..., press=press, cache=PagedKVCache())``).

    The attention over it runs through :mod:`kvpress_cpp.attention`, which wraps transformers' sdpa and flash
    attention when kvpress_cpp is imported, and the eager attention of the model files imported by the time a layer
    receives keys.

    Args:
        block_size: slots per block (≥ 1; 16 as vLLM).
    """

    def __init__(self, block_size: int = 16):
        # The attention path that reads paged layers wraps transformers' attention functions when it is imported
        # (it imports this module, hence here); kvpress_adapters adapts kvpress's DMSPress and AdaKVPress.
        from kvpress_cpp import attention, kvpress_adapters  # noqa: F401

        self.block_size = PagedLayer(block_size).block_size  # validated (and an int) before any layer exists
        super().__init__(layer_class_to_replicate=functools.partial(PagedLayer, self.block_size))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        first = self.layers[0] if self.layers else None
        if (layer_idx > 0 and (layer_idx >= len(self.layers) or not self.layers[layer_idx].is_initialized)
                and first is not None and first.is_initialized and first.tokens_appended > key_states.shape[-2]):
            # Layer 0 held tokens before this pass, which a layer written for the first time never received: it
            # would start empty in the middle of the text (and its attention read none of it).
            earlier = first.tokens_appended - key_states.shape[-2]
            raise ValueError(f"PagedKVCache: layer {layer_idx} is first written by a pass of {key_states.shape[-2]} "
                             f"tokens, while layer 0 holds {earlier} earlier tokens it never received: a model with "
                             f"more layers than the one that filled this cache? Use one cache per model, or "
                             f"cache.reset() before a new prompt")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The tokens generate counts as held: the view's width, plus the padding every row of the prefill had (see
        ``PagedLayer.padding_dropped``), as a DynamicCache's width holds it."""
        return self.layers[layer_idx].tokens_counted() if layer_idx < len(self.layers) else 0

    def bytes_held(self) -> int:
        """Bytes of the blocks in use over all layers (keys, values, log-weights, positions, press state)."""
        return sum(layer.bytes_held() for layer in self.layers)

    def bytes_reserved(self) -> int:
        """Bytes of every layer's pool, free blocks included."""
        return sum(layer.bytes_reserved() for layer in self.layers)

    def trim(self) -> None:
        """Release every layer's free blocks (e.g. after a prompt's compression, when nothing will reuse them)."""
        for layer in self.layers:
            layer.trim()
