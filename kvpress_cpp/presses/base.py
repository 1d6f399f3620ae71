"""The base of kvpress_cpp's presses: kvpress press classes that own a per-slot cache state.

A press hooks every attention layer (kvpress's ``BasePress.__call__``) and, after each forward, may rewrite the
layer's keys, values and :class:`~kvpress_cpp.cache.LayerState`:

* ``compress_prefill`` runs on the first pass over a layer: the layer holds no state of ours and no more slots than
  this pass's tokens (fewer when a press before ours in a ``ComposedPress`` has already compressed the prompt). This
  needs neither ``cache_position`` (which newer transformers drop) nor a host sync.
* ``compress_decoding`` runs on every later pass (one generated token, or several such as kvpress's question pass),
  for presses that compress during decoding.

kvpress's contract, kept by every press: ``compression_ratio`` is the fraction of the context removed (set from
the budget, or measured for presses that choose it), ``post_init_from_model`` prepares the model (and inner
scorers), ``reset()`` exists for kvpress's ``PrefillDecodingPress``. A press that cannot act where it is placed
raises an error naming itself: a decoding pass over a layer it did not prefill, a layer another kvpress_cpp press
owns, a prompt already shrunk by another press (except GVote, which only needs the surviving slots), a wrapper that
calls ``compress()`` and so would drop the per-slot state (ValueError); and, from the attention path, a cache whose
slots another press rearranged after ours (RuntimeError, :meth:`~kvpress_cpp.cache.LayerState.check_slots`).

Left-padded batches: presses whose ops cannot take padding slots (``handles_padding = False``) compress each row's
real tokens alone, at prefill and at every later pass, and the rows are stacked again, left-padded with b = -inf
(:class:`RowStates`); so padding never enters a merge or a statistic and each row equals its run alone.

Presses that compress during decoding derive from :class:`KVCompDecodingPress`, which is also a kvpress
``PrefillDecodingPress``: kvpress's pipeline then keeps the press active while it generates, as ``generate`` does
under ``with press(model):``. Prefill-only presses derive from :class:`KVCompPress`, a plain ``BasePress``, so the
pipeline can reuse one compressed context for several questions.
"""

from __future__ import annotations

import copy
import functools
import numbers
import threading
import warnings
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch
import transformers
from kvpress.presses.base_press import BasePress
from kvpress.presses.prefill_decoding_press import PrefillDecodingPress
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvpress_cpp import ops

from kvpress_cpp.attention import (active_presses, count_hook_without_probabilities, hold_pass_for_attention,
                                   mark_press_active, new_token_padding, padding_after_prefill_error,
                                   padding_log_weights, patch_eager_attention, request_prefill_scores,
                                   set_positions_end, take_prefill_attention, take_prompt_last_query,
                                   tokens_fed_again_error)
from kvpress_cpp.cache import (LayerState, MethodOf, UnsavedRef, attach, check_cache_layer, forget_tokens_held,
                               get_state, in_one_dtype, output_cache, pass_cache, pass_inputs, remember_tokens_held,
                               set_state, slots_appended_since_written)
from kvpress_cpp.distributed import check_tensor_parallel, gather_kv_heads, kv_head_shard, prerope_query_states
from kvpress_cpp.presses.streaming import CHUNKED_PREFILL_REPEATS_LAST_POSITIONS, check_chunk_positions

__all__ = ["KVCompPress", "KVCompDecodingPress", "RowStates", "query_states", "score_prompt", "require_bool",
           "require_int", "require_real"]


# Guards the check-and-set of a press's forward thread (KVCompPress._claim_forward); a lock on the press itself would
# not survive copy.deepcopy or pickling of it.
_FORWARD_CLAIM_LOCK = threading.Lock()

# The positions a cache holds (one past the last token fed) and its slots after the last pass, kept on the cache by
# KVCompPress._check_resumed_positions and _record_slots.
_POSITIONS_ATTR, _SLOTS_ATTR = "_kvcomp_positions", "_kvcomp_slots"

# Set on an attention module whose pass its press compressed right after the attention (compress_after_attention), for
# the forward hook of the same pass.
_COMPRESSED_AFTER_ATTENTION_ATTR = "_kvcomp_compressed_after_attention"


def _tokens_stood_for(cache, slots: int) -> int:
    """The tokens `cache`, now holding `slots` slots, stands for: the count at its last pass in a press's context,
    less the slots cut from the right since (they were tokens), plus those appended by passes outside it (one per
    token: no press of ours compressed them)."""
    return getattr(cache, _POSITIONS_ATTR, 0) + slots - getattr(cache, _SLOTS_ATTR, slots)


def _crop_counting_tokens(cache, max_length: int, *args, **kwargs):
    """``cache.crop`` on a cache a press of ours compressed: cut only tokens its compressed layers hold a slot each
    for, the ones appended since the press last wrote them. Assisted generation (``prompt_lookup_num_tokens``,
    ``assistant_model``) rolls rejected candidates back with crop(tokens kept) (crop(-tokens rejected) from
    transformers 5.17 on), a count of tokens; a compressed layer holds fewer slots than that, so transformers' crop
    cut nothing (or the last slots, not the candidates) and the rejected candidates, merged or scored into the slots
    by the pass that compressed them, stayed: the next tokens were silently others (KeepKV; every press from 5.17),
    or an error about a second generate call came. That crop is refused, and so is one reaching below the slots
    appended (ZSMerge's recent ring, GVote's layers holding other tokens each). A layer a head-wise press evicted from
    without narrowing it (GVote, KVzap: the longest head kept every slot) is compressed too: the candidates took part
    in deciding what the other heads evicted. Tokens fed after a prefill-only press compressed the prompt (GVote's
    decoding, rejected candidates of later rounds) or outside a press's context (a question kvpress's pipeline asks
    over the compressed context) are cut as any cache's. crop(0) empties the cache (before transformers 5.17, from
    which it removes nothing)."""
    tokens = _tokens_stood_for(cache, cache.get_seq_length())
    dropped = -max_length if max_length < 0 else tokens - max_length
    cuts = max_length < 0 or 0 < max_length < tokens
    # Every layer is asked, not the first alone: a head-wise press may keep all of layer 0 (GVote on SmolLM2), which
    # then cropped as any cache's while the layers it compressed kept the rejected candidates, silently.
    states = [_written_state(layer) for layer in cache.layers]  # a paged layer's tensors not gathered
    compressed = False
    for layer_idx, (layer, state) in enumerate(zip(cache.layers, states)):
        slots = cache.get_seq_length(layer_idx)
        layer_compressed = state is not None and (slots < tokens or _evicted_in_place(state, layer_idx))
        compressed = compressed or layer_compressed
        if layer_compressed and cuts and dropped > slots_appended_since_written(layer, state):
            owner, in_place = state.owner_name(), ", some evicted in place" if slots >= tokens else ""
            raise ValueError(
                f"{owner}: crop({max_length}) asks a cache {owner} compressed to drop {dropped} of the {tokens} "
                f"tokens it stands for, in {slots} slots{in_place} (layer {layer_idx}): the tokens to drop are merged "
                f"into (or scored against) the slots it keeps and cannot be taken back. Assisted generation "
                f"(prompt_lookup_num_tokens, assistant_model) rolls its rejected candidates back this way: generate "
                f"without it under {owner}")
    if max_length > 0 and not cuts:
        return None  # nothing to cut, which transformers from 5.24 refuses to be asked for (a positive crop)
    if compressed and 0 < max_length < tokens:
        # A count of tokens to keep would read as slots on each layer: the last `dropped` slots are those tokens.
        max_length = -dropped
    result = type(cache).crop(cache, max_length, *args, **kwargs)
    if not compressed:
        # A slot a token in every layer (the rejected candidates of assisted generation before anything was
        # compressed): the tokens cut leave the counts of the press that counted them. A compressed cache's crop cuts
        # tokens the press never counted (appended outside its context, or after a prefill-only press's prompt) or
        # slots of a cache being emptied, whose last ratios stay readable.
        kept = _tokens_stood_for(cache, cache.get_seq_length())
        for layer_idx, state in enumerate(states):
            owner = state.owner() if state is not None and state.owner is not None else None
            if isinstance(owner, KVCompPress):
                owner.tokens_cropped(layer_idx, state, kept)
    return result


def _evicted_in_place(state: LayerState, layer_idx: int) -> bool:
    """Whether the press that wrote `state` evicted tokens from the layer without narrowing it (GVote and KVzap mask
    a head's slots with -inf and compact to the longest head, which may have kept every one)."""
    owner = state.owner() if state.owner is not None else None
    return isinstance(owner, KVCompPress) and owner.holds_every_token_seen(layer_idx, state) is False


def _written_state(layer) -> LayerState | None:
    """The state a press last wrote to `layer`, for its owner and fields (a paged layer's tensors not gathered)."""
    return layer.written_state() if hasattr(layer, "written_state") else get_state(layer)


def _legacy_cache_without_state(cache, *args, **kwargs):
    """``cache.to_legacy_cache`` on a cache a press of ours compressed: refuse it, naming the press. The tuple of
    (keys, values) has no room for the per-slot state (merge weights, evicted slots), so the cache rebuilt from it
    (``DynamicCache.from_legacy_cache``) was attended as if nothing had been merged: ZSMerge and KeepKV gave other
    tokens silently after the context closed."""
    for layer in cache.layers:
        state = get_state(layer)
        if state is not None:
            owner = state.owner_name()
            raise ValueError(
                f"{owner}: to_legacy_cache() of a cache {owner} compressed would drop its per-slot state (merge "
                f"weights, evicted slots), which a tuple of keys and values cannot hold: the cache rebuilt from it "
                f"would attend differently. Keep the DynamicCache itself (copy.deepcopy it to branch)")
    return type(cache).to_legacy_cache(cache, *args, **kwargs)


# Constructor checks shared by the presses: a value of the wrong type or out of range is refused where it is given,
# with the press and the parameter named, not later inside an op (or, for NaN, never).
_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1  # the ops take int64 arguments, torch's generators int64 seeds


def require_int(press: str, name: str, value, minimum: int | None = None, maximum: int | None = None) -> None:
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        bounds = ("" if minimum is None and maximum is None else f" ≥ {minimum}" if maximum is None
                  else f" ≤ {maximum}" if minimum is None else f" in [{minimum}, {maximum}]")
        raise ValueError(f"{press}: {name} must be an int{bounds}, got {value!r}")
    _require_int64(press, name, value)


def _require_int64(press: str, name: str, value: numbers.Integral) -> None:
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"{press}: {name} must fit int64 ([-2^63, 2^63 - 1]), got {value!r}")


def require_real(press: str, name: str, value, interval: str) -> None:
    """`interval` as written in the message, e.g. "(0, 1]": its brackets say which ends are allowed."""
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    inside = (isinstance(value, numbers.Real) and not isinstance(value, bool)
              and (value >= low if interval[0] == "[" else value > low)
              and (value <= high if interval[-1] == "]" else value < high))
    if not inside:  # NaN compares false: refused too
        raise ValueError(f"{press}: {name} must be a number in {interval}, got {value!r}")


def budget_value(press: str, name: str, value) -> int | float:
    """A budget as the presses read it: a token count (any integer, numpy's too, as an int ≥ 1) or a fraction of
    the prompt (any other real number, as a float in (0, 1])."""
    if not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= 1:
        _require_int64(press, name, value)
        return int(value)
    if not isinstance(value, (bool, numbers.Integral)) and isinstance(value, numbers.Real) and 0 < value <= 1:
        return float(value)
    raise ValueError(f"{press}: {name} must be a token count ≥ 1 or a fraction in (0, 1], got {value!r}")


def require_bool(press: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{press}: {name} must be True or False, got {value!r}")


@functools.cache
def _parameter_names(press_type: type) -> frozenset[str]:
    """The fields a press is constructed with (its parameters), not the ones it keeps for itself."""
    return frozenset(field.name for field in fields(press_type) if field.init)


@functools.cache
def _library_parameter_names(press_type: type) -> frozenset[str]:
    """The parameters of the nearest of kvpress_cpp's presses `press_type` is, or derives from: those its context
    reads (a subclass's own fields are its own to use)."""
    library = next(cls for cls in press_type.__mro__ if cls.__module__.startswith("kvpress_cpp."))
    return _parameter_names(library)


def hooked_decoder(model: nn.Module) -> nn.Module | None:
    """The decoder stack whose layers kvpress hooks: ``model.model``, or its ``language_model`` (a multimodal model
    such as Gemma 3's); None where the model has no ``model``."""
    decoder = getattr(model, "model", None)
    return getattr(decoder, "language_model", decoder)


def query_states(module: nn.Module, hidden_states: torch.Tensor, kwargs: dict,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """The layer's post-RoPE queries (B, Hq, q, d) for `hidden_states`, as its forward computed them (with q_norm
    where the model has one; the local query heads of a tensor-parallel layer), in `dtype`, that of the keys they
    meet (None: the projection's): OLMo's rotary tables are float32 in a half-precision model, whose attention casts
    the turned queries back, while under torch.autocast a Llama's stay float32, as its keys, beside a bfloat16
    projection."""
    queries = prerope_query_states(module, hidden_states)
    cos, sin = kwargs["position_embeddings"]
    dtype = dtype or queries.dtype
    return rotate_leading_dims(queries.to(dtype), cos.shape[-1],
                               lambda turned: apply_rotary_pos_emb(turned, turned, cos, sin)[0].to(dtype))


def last_query_states(module: nn.Module, hidden_states: torch.Tensor, kwargs: dict, count: int,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`query_states` (B, Hq, count, d) of the pass's last `count` tokens only."""
    cos, sin = kwargs["position_embeddings"]
    return query_states(module, hidden_states[:, -count:], {"position_embeddings": (cos[:, -count:], sin[:, -count:])},
                        dtype)


def rotate_leading_dims(queries: torch.Tensor, rotated: int, rotate) -> torch.Tensor:
    """`rotate` applied to the first `rotated` dims of each query head, the others passed through: a model with a
    partial rotary embedding (Phi, GPT-NeoX) turns only those; the others, all of them."""
    if rotated == queries.shape[-1]:
        return rotate(queries)
    return torch.cat([rotate(queries[..., :rotated].contiguous()), queries[..., rotated:]], dim=-1)


#: Relative difference (Frobenius) between recomputed and used queries above which a model forms them otherwise: far
#: above half precision's rounding (~4e-3 per element), far below what a missed norm or rotary layout gives (~1).
QUERY_RECOMPUTATION_TOLERANCE = 2e-2


def check_recomputed_queries(press: str, module: nn.Module, hidden_states: torch.Tensor, kwargs: dict,
                             used: torch.Tensor) -> None:
    """Raise if :func:`query_states` does not give `used`, the queries (B, Hq, 1, d) the layer's attention used for
    the prompt's last token (:func:`~kvpress_cpp.attention.take_prompt_last_query`). A model that forms its queries
    otherwise (OLMo-2's q_norm over all heads at once, Cohere's interleaved rotary embedding) would have its prompt
    scored with the attention of other queries, and its eager and sdpa runs, or a padded row and its run alone,
    compress differently. Entries that are not finite in either (a NaN or inf reaching the layer: the model's output
    is garbage with or without the press) are left out of the comparison, which they would fail whatever the model."""
    recomputed, used = last_query_states(module, hidden_states, kwargs, 1, used.dtype).float(), used.float()
    finite = recomputed.isfinite() & used.isfinite()
    recomputed, used = recomputed[finite], used[finite]
    difference = float((recomputed - used).norm() / used.norm().clamp_min(torch.finfo(torch.float32).tiny))
    if not difference <= QUERY_RECOMPUTATION_TOLERANCE:
        raise ValueError(
            f"{press}: layer {module.layer_idx} ({type(module).__name__}): the queries {press} recomputes from the "
            f"layer's input to score the prompt (kvpress's get_prerope_query_states, then Llama's rotary embedding) "
            f"are not those the model's attention used (relative difference {difference:.3g}): this model forms its "
            f"queries another way (OLMo-2's q_norm over all heads, Cohere's interleaved rotary embedding, ...), so "
            f"{press} would score the prompt with other queries. It supports the Llama-like models kvpress does "
            f"(Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3) and Phi")


def score_prompt(module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, log_weights: torch.Tensor,
                 kwargs: dict, decay: float, input_scale: float) -> torch.Tensor:
    """Scores (B, H, T) of a prompt from all its queries: ``Σ_j input_scale · decay^(T-1-j) Σ_g A[g, j]``
    by ``kvcomp::prompt_scores``, which never materialises the attention nor computes P·V. When the press asked the
    layer's own sdpa prompt pass for them (no padding: :meth:`KVCompPress.prompt_score_weights`), the scores it
    computed with the attention are taken as they are, or its queries and log-sum-exp reused; otherwise the queries
    are recomputed and the op computes the log-sum-exp.
    """
    kept = take_prefill_attention(module, keys.shape[-2])
    if kept is not None and kept.scores is not None and kept.weights == (decay, input_scale):
        return kept.scores
    queries, lse = kept[:2] if kept is not None else (query_states(module, hidden_states, kwargs, keys.dtype), None)
    return ops.prompt_scores(queries, keys, log_weights, module.scaling, decay, input_scale, log_sum_exp=lse)


@dataclass
class RowStates(LayerState):
    """The state of a layer holding a left-padded batch compressed row by row: ``rows[r]`` is row r's own state
    (1, H, L_r), its slots are the last L_r of the layer (``padding[r]`` = T - L_r slots of b = -inf before them),
    and ``log_weights`` (B, H, T) stacks the rows' for the attention path."""

    rows: list[LayerState] = field(default_factory=list)
    padding: list[int] = field(default_factory=list)
    left_padded = True

    def align(self, slots_before: int, new_tokens: int) -> torch.Tensor:
        self.follow_cut(slots_before)
        return super().align(slots_before, new_tokens)

    def follow_cut(self, slots_before: int) -> None:
        """Cut each row's state to the layer's `slots_before` slots, less its padding: a cut from the right (the
        pipeline dropping an answer, assisted generation's rollback: a crop refuses any cut of slots a press merged or
        scored) takes the last slots of every row alike. A paged layer cuts the stacked tensors in its pools; the rows'
        own states follow here."""
        for row, padding in zip(self.rows, self.padding):
            held = slots_before - padding
            if held < 1:
                raise ValueError(f"{self.owner_name()}: a cut left {slots_before} slots of a padded batch's layer, "
                                 f"fewer than a row's {padding} slots of padding: that row would hold no token; crop "
                                 f"fewer tokens, or prefill the batch again")
            if row.log_weights.shape[-1] > held:
                row.align(held, 0)

    def take_rows(self, rows: torch.Tensor) -> None:
        super().take_rows(rows)
        order = rows.tolist()
        self.rows = [copy.deepcopy(self.rows[r]) if order.count(r) > 1 else self.rows[r] for r in order]
        self.padding = [self.padding[r] for r in order]

    def nbytes(self) -> int:
        return super().nbytes() + sum(row.nbytes() for row in self.rows)


def _row_kwargs(kwargs: dict, row: int, start: int) -> dict:
    """The attention kwargs of batch row `row` from token `start` on, as if the row ran alone (no mask)."""
    return _cut_kwargs(kwargs, slice(row, row + 1), start, attention_mask=None)


def _kwargs_from_column(kwargs: dict, start: int) -> dict:
    """The attention kwargs of every row from token `start` on, the mask's columns before it dropped."""
    mask = kwargs.get("attention_mask")
    if mask is not None:
        mask = mask[:, :, start:, start:] if mask.dim() == 4 else mask[:, start:]
    return _cut_kwargs(kwargs, slice(None), start, attention_mask=mask)


def _cut_kwargs(kwargs: dict, rows: slice, start: int, attention_mask: torch.Tensor | None) -> dict:
    def cut(tensor):
        return tensor[rows, start:] if tensor.shape[0] > 1 else tensor[:, start:]

    cos, sin = kwargs["position_embeddings"]
    cut_kwargs = dict(kwargs, position_embeddings=(cut(cos), cut(sin)), attention_mask=attention_mask)
    if kwargs.get("position_ids") is not None:
        cut_kwargs["position_ids"] = cut(kwargs["position_ids"])
    return cut_kwargs


def _stack_rows(results: list[tuple[torch.Tensor, torch.Tensor, LayerState]]):
    """Rows (1, H, L_r, d) with their states → a layer (B, H, max L_r, d) left-padded with zero slots of b = -inf."""
    length = max(keys.shape[-2] for keys, _, _ in results)
    padding = [length - keys.shape[-2] for keys, _, _ in results]

    def stack(tensors, value):
        return torch.cat([torch.nn.functional.pad(t, (0, 0, pad, 0) if t.dim() == 4 else (pad, 0), value=value)
                          for t, pad in zip(tensors, padding)])

    keys = stack([k for k, _, _ in results], 0.0)
    values = stack([v for _, v, _ in results], 0.0)
    log_weights = stack([state.log_weights for _, _, state in results], float("-inf"))
    return keys, values, RowStates(log_weights, rows=[state for _, _, state in results], padding=padding)


@dataclass
class KVCompPress(BasePress):
    """Base of the presses whose compression keeps a per-slot state (log-weights, scores) on the cache."""

    #: The dataclass field holding the budget kept (a token count, or a fraction of the prompt), for presses that
    #: take one; None for presses that choose their ratio (measured after a run).
    budget_field: ClassVar[str | None] = None
    #: Whether compress_prefill takes padding slots (b = -inf) in its batch; otherwise rows are compressed alone.
    handles_padding: ClassVar[bool] = False
    #: Whether the press can compress a prompt another press already shrank (its slots no longer one per token).
    compresses_compressed_prompt: ClassVar[bool] = False
    #: Whether compress_decoding reads the attention's probabilities (a paged pass computes them only for hooks that do).
    reads_decode_probabilities: ClassVar[bool] = True
    #: Whether compress_decoding holds every slot it is given (it merges or evicts down to its budget, never marking a
    #: slot -inf): a paged layer then stores its write without reading the log-weights back.
    decoding_keeps_every_slot: ClassVar[bool] = False
    #: Whether compress_decoding may move or rewrite, in place, the slots it is given (a merge, an eviction). False (a
    #: subclass inherits it): a step that hands back the values and state it was given only appended to them, so their
    #: probe is extended, not read again.
    decoding_rewrites_slots: ClassVar[bool] = True
    #: Whether the press recomputes the prompt's queries from the layer's input (query_states) to score it: checked
    #: against the ones the attention used at each prefill.
    scores_prompt_with_queries: ClassVar[bool] = True

    # Per layer: the tokens each batch row has seen (per kv head) as [the prompt's (B,) (a tensor: counting them on the
    # host would sync), the later passes' (an int, the same for every row: a tensor add per layer and step cost
    # 5 µs)]; the slots held per batch row and kv head (B, H) (or, until :meth:`_held` first reads them, a copy of the
    # log-weights (B, H, T) they are counted from: a decoding step then spends one copy, not a count); the state the
    # press last wrote, whose batch rearrangements the counts follow (:meth:`rows_taken`); and the layers whose counts
    # are this rank's heads only, to be gathered over the tensor-parallel ranks.
    _slots_seen: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # Per layer: the positions [0, n) of the tokens counted in _slots_seen (the prompt's columns, padding included,
    # then the later passes counted), which a crop compares with the tokens it keeps.
    _tokens_counted: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _slots_held: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _states_written: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _held_to_gather: set = field(default_factory=set, init=False, repr=False, compare=False)
    # Whether a forward without a cache was reported in the current context (once per `with press(model):`).
    _warned_without_cache: bool = field(default=False, init=False, repr=False, compare=False)
    # The layers compressed since the press's own context opened (None outside it, e.g. inside kvpress's
    # PrefillDecodingPress, whose decoding context asks the question over what the prefill context compressed).
    _compressed_in_context: set | None = field(default=None, init=False, repr=False, compare=False)
    _caches_in_context: weakref.WeakSet | None = field(default=None, init=False, repr=False, compare=False)
    # The attention modules kvpress hooked for the press's open context.
    _hooked_modules: list = field(default_factory=list, init=False, repr=False, compare=False)
    # The thread whose forward of the model runs under the press's open context, None between forwards.
    _forward_thread: int | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if type(self).compress_prefill is KVCompPress.compress_prefill:
            raise TypeError(f"{type(self).__name__} is a base class, with no compression of its own: use one of "
                            f"kvpress_cpp.presses' presses, or subclass it and implement compress_prefill")
        self.check_parameters()
        self.__dict__["_parameters_checked"] = True

    def __getstate__(self) -> dict:
        """A copy (copy.deepcopy, pickle) is a press with no context open, whatever the original's: the modules,
        caches and thread an open context holds stay with the original (a copy made inside it was refused as active
        on another model for good, and held a copy of the model's attention modules; pickle failed on the caches'
        weak references)."""
        return {**self.__dict__, "_compressed_in_context": None, "_caches_in_context": None, "_hooked_modules": [],
                "_forward_thread": None}

    def check_parameters(self) -> None:
        """Raise a ValueError naming the press, the parameter and its value for a parameter outside its domain: at
        construction and at every later assignment of one."""

    def __setattr__(self, name, value):
        if name not in _parameter_names(type(self)):
            super().__setattr__(name, value)
            return
        # Every parameter is checked at every assignment, not only at construction: a sweep sets them on a built
        # press, where a budget of 1.5 had kept every token while compression_ratio read -0.5, eviction_order="Paper"
        # ran as "authors" and GVote's num_samples=0 emptied every layer, silently.
        if name == self.budget_field:
            value = budget_value(type(self).__name__, name, value)
        elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
            value = int(value)  # numpy's: torch's generators and the ops take Python ints
        if not self.__dict__.get("_parameters_checked"):
            super().__setattr__(name, value)  # (constructing: __post_init__ checks them together)
            return
        if self._hooked_modules and name in _library_parameter_names(type(self)):
            # Parameters are read when the context opens (surrogates loaded), at the prompt (windows, chunk sizes)
            # or at every step: changed inside, some took effect at once, others at the next prompt, others never.
            raise ValueError(f"{type(self).__name__}: {name} cannot change from {self.__dict__[name]!r} to "
                             f"{value!r} while the press's context is open (`with press(model):`): set it before "
                             f"the context opens")
        before = self.__dict__[name]
        super().__setattr__(name, value)
        try:
            self.check_parameters()
        except ValueError:
            super().__setattr__(name, before)
            raise

    def prompt_score_weights(self, module: nn.Module) -> tuple[float, float] | None:
        """(decay, input_scale) of the score_prompt call compress_prefill makes on `module`, or None if it makes
        none: the layer's sdpa prompt pass then computes those scores with its attention (only while the press's own
        context is active)."""
        return None

    def compress_prefill(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor,
                         values: torch.Tensor, attentions: torch.Tensor | None, log_weights: torch.Tensor,
                         kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, LayerState] | None:
        """Compress the prompt of one layer: keys, values (B, H, T, d) and their log-weights (B, H, T) float32
        (0, or -inf on padding) → new keys, values and state, or None to keep the layer as it is (no state)."""
        raise NotImplementedError

    def compress_decoding(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor,
                          values: torch.Tensor, attentions: torch.Tensor | None, state: LayerState,
                          kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, LayerState] | None:
        """Fold the q new tokens of a later pass into one layer (attentions: their probabilities (B, Hq, q, T)
        when the layer has state). Prefill-only presses leave the cache alone."""
        return None

    def post_init_from_model(self, model):
        """kvpress calls this on every press it applies, wrapped or not: refuse a tensor-parallel model the press
        cannot run on, and route the model's eager attention through the path that honours log-weights (sdpa and
        flash attention are wrapped at import)."""
        check_tensor_parallel(type(self).__name__, model, self.tensor_parallel_limitation())
        patch_eager_attention(model)

    def reset(self):
        """kvpress's ``PrefillDecodingPress`` resets its decoding press after each use. Nothing to clear: the
        per-slot state lives on the cache, and the ratios stay readable until the next prefill."""

    @property
    def layer_compression_ratios(self) -> dict[int, float]:
        """Per layer, the fraction of the (batch, kv head, token) slots seen that are no longer held in the cache the
        press last prefilled: the prompt's, plus every later token for presses that compress while decoding (other
        caches stepped in between are not counted). Padding is not counted as seen. Under tensor parallelism every
        rank reports the model's figure (all kv heads)."""
        ratios = {}
        for layer, (prompt, later) in sorted(self._slots_seen.items()):
            held = self._held(layer)
            if held is not None:
                batch, heads = held.shape
                seen = float(prompt.sum() if isinstance(prompt, torch.Tensor) else prompt) + later * batch
                ratios[layer] = 1.0 - float(held.sum()) / (seen * heads) if seen else 0.0
        return ratios

    def budget_slots(self, prompt_length: int) -> int:
        """The slots :attr:`budget_field` keeps for a prompt of this length: the count itself, or the fraction of the
        prompt rounded (at least 1)."""
        budget = getattr(self, self.budget_field)
        return budget if isinstance(budget, int) else max(1, round(budget * prompt_length))

    def larger_budget_advice(self, prompt_length: int) -> str:
        """The advice of a refusal of too few slots: raise the budget; a fraction of a short prompt can also be given
        in tokens (the only way at 1.0, which keeps all of it already). A count is refused where it is assigned, so a
        sweep setting it before the parameters it must fit is told how to set them together."""
        field, budget = self.budget_field, getattr(self, self.budget_field)
        if isinstance(budget, int):
            return f"raise {field} (dataclasses.replace(press, ...) sets it with the parameters it must fit)"
        slots = self.budget_slots(prompt_length)
        in_tokens = (f"in tokens ({budget!r} of this {prompt_length}-token prompt is {slots} slots; a count above the "
                     f"prompt's length keeps it whole)")
        return f"give {field} {in_tokens}" if budget == 1.0 else f"raise {field} or give it {in_tokens}"

    @property
    def compression_ratio(self) -> float:
        """kvpress's meaning: the fraction of the context removed. ``1 - budget`` for a budget given as a fraction;
        otherwise the mean of :attr:`layer_compression_ratios` (0 before any run)."""
        budget = getattr(self, self.budget_field) if self.budget_field else None
        if isinstance(budget, float):
            return round(1.0 - budget, 9)
        ratios = self.layer_compression_ratios
        return sum(ratios.values()) / len(ratios) if ratios else 0.0

    @compression_ratio.setter
    def compression_ratio(self, value: float):
        if not self.budget_field:
            raise AttributeError(f"compression ratio cannot be set for {type(self).__name__}: it depends on its "
                                 f"parameters and the input")
        require_real(type(self).__name__, "compression_ratio", value, "[0, 1)")
        budget = round(1.0 - float(value), 9)
        if budget <= 0:  # 0.9999999999 is inside [0, 1) but leaves no slot: name the value the caller set
            raise ValueError(f"{type(self).__name__}: compression_ratio {value!r} leaves a budget of {budget} of the "
                             f"context, which keeps no token; use a ratio below 1 - 1e-9")
        setattr(self, self.budget_field, budget)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        """kvpress's keys-and-values entry point (ChunkPress, DecodingPress, PrefillDecodingPress.compress): it has
        no room for the per-slot state our compression writes, so it refuses instead of returning a cache whose
        merged or evicted slots would be attended as plain tokens."""
        raise ValueError(f"{type(self).__name__}: keeps a per-slot state on the cache and compresses through its "
                         f"forward hook; a wrapper that calls compress() directly cannot hold it (use it alone, in a "
                         f"ComposedPress or as a PrefillDecodingPress's prefilling_press)")

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        """kvpress's scorer entry point, which wrappers that rank tokens (DMSPress, ...) call on their inner press:
        ours rank and compress in their own hook, so they refuse instead of failing on a missing method."""
        raise ValueError(f"{type(self).__name__}: is not a kvpress ScorerPress (it compresses through its own forward "
                         f"hook, keeping a per-slot state); wrappers that score tokens (DMSPress, AdaKVPress, ...) take "
                         f"a scorer such as kvpress_cpp's KVzapPress or kvpress's SnapKVPress")

    def _compress_prompt(self, module, hidden_states, keys, values, attentions, kwargs):
        """compress_prefill with the prompt's log-weights: 0, or -inf where transformers' mask marks padding; left-
        padded batches row by row unless the press handles padding itself."""
        name, layer_idx = type(self).__name__, module.layer_idx
        if keys.shape[-2] < hidden_states.shape[1]:
            if not self.compresses_compressed_prompt:
                raise ValueError(
                    f"{name}: layer {layer_idx} holds {keys.shape[-2]} slots for this prompt's "
                    f"{hidden_states.shape[1]} tokens: a press before {name} (in a ComposedPress, or a context opened "
                    f"around {name}'s) already compressed it. {name} scores every prompt token from the prompt's "
                    f"causal attention, so it must come first")
            log_weights = torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)
            self._slots_seen[layer_idx] = [torch.full(keys.shape[:1], keys.shape[-2], device=keys.device), 0]
            return self.compress_prefill(module, hidden_states, keys, values, attentions, log_weights, kwargs)
        log_weights = padding_log_weights(kwargs.get("attention_mask"), *keys.shape[:3], keys.device)
        is_real = torch.isfinite(log_weights[:, 0])
        padding = (~is_real).sum(-1)
        self._slots_seen[layer_idx] = [is_real.sum(-1), 0]
        if not bool(padding.any()):
            return self.compress_prefill(module, hidden_states, keys, values, attentions, log_weights, kwargs)
        if not bool(is_real.any(-1).all()):
            raise ValueError(f"{name}: batch rows {(~is_real.any(-1)).nonzero().flatten().tolist()} hold padding only "
                             f"(an empty prompt)")
        if not bool((is_real.int().argmax(-1) == padding).all()):
            # Right padding would also shift each row's recent window (the slots every press protects) onto padding.
            raise ValueError(f"{name}: only left padding is supported (tokenizer padding_side='left'), as "
                             f"`generate` expects of decoder-only models")
        if self.handles_padding:
            return self.compress_prefill(module, hidden_states, keys, values, attentions, log_weights, kwargs)
        results = []
        for row, pad in enumerate(padding.tolist()):
            row_keys, row_values = keys[row:row + 1, :, pad:].contiguous(), values[row:row + 1, :, pad:].contiguous()
            row_attentions = attentions[row:row + 1, :, pad:, pad:] if attentions is not None else None
            result = self.compress_prefill(module, hidden_states[row:row + 1, pad:], row_keys, row_values,
                                           row_attentions, log_weights[row:row + 1, :, pad:],
                                           _row_kwargs(kwargs, row, pad))
            results.append(result or (row_keys, row_values, LayerState(log_weights[row:row + 1, :, pad:])))
        return _stack_rows(results)

    def _compress_rows(self, module, hidden_states, keys, values, attentions, state: RowStates, kwargs):
        """compress_decoding of a padded batch's later pass, row by row (see :class:`RowStates`)."""
        new_tokens = hidden_states.shape[1]
        results, acted = [], False
        for row, (row_state, pad) in enumerate(zip(state.rows, state.padding)):
            row_keys, row_values = keys[row:row + 1, :, pad:].contiguous(), values[row:row + 1, :, pad:].contiguous()
            row_attentions = attentions[row:row + 1, ..., pad:] if attentions is not None else None
            result = self.compress_decoding(module, hidden_states[row:row + 1], row_keys, row_values, row_attentions,
                                            row_state, _row_kwargs(kwargs, row, 0))
            acted = acted or result is not None
            if result is None:
                row_state.log_weights = row_state.align(row_keys.shape[-2] - new_tokens, new_tokens)
                result = (row_keys, row_values, row_state)
            results.append(result)
        return _stack_rows(results) if acted else None

    def forward_hook(self, module: nn.Module, input: list[torch.Tensor], kwargs: dict, output: list):
        if not module.__dict__.pop(_COMPRESSED_AFTER_ATTENTION_ATTR, False):
            hold_pass_for_attention(module, self, None)  # unused: the pass's attention did not compress (a prefill)
            self._compress_checked(module, kwargs, output[1] if len(output) > 1 else None)
        return self._after_layer(module, output)

    def _hold_pass_for_its_attention(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of each attention module, when this press hooks the model itself (no kvpress wrapper runs
        other presses' hooks around it, in an order that must hold): a decoding pass compresses the layer as soon as
        its attention has read it (:func:`~kvpress_cpp.attention.hold_pass_for_attention`), rather than in the forward
        hook. Not where the module has other forward hooks: one registered before the press's reads the layer before
        the press compresses it, as kvpress's hook order promises."""
        module.__dict__[_COMPRESSED_AFTER_ATTENTION_ATTR] = False
        alone = len(module._forward_hooks) == 1
        hold_pass_for_attention(module, self, kwargs if alone and "hidden_states" in kwargs else None)

    def compress_after_attention(self, module: nn.Module, kwargs: dict, probabilities: torch.Tensor | None) -> None:
        """The forward hook's compression of a decoding pass, called by the attention path with the attention's
        probabilities (the module's output projection has not run: nothing the press reads depends on it)."""
        self._compress_checked(module, kwargs, probabilities)
        module.__dict__[_COMPRESSED_AFTER_ATTENTION_ATTR] = True

    def _compress_checked(self, module: nn.Module, kwargs: dict, attentions: torch.Tensor | None) -> None:
        cache = pass_cache(kwargs)
        if cache is not None:  # layers a cache creates during the pass, which the decoder's pre-hook did not see
            check_cache_layer(cache.layers[module.layer_idx], type(self).__name__)
        try:
            self._compress_pass(module, kwargs, attentions)
        except TypeError as error:
            # transformers 4.57 runs a decoder's forward again after a TypeError in it (check_model_inputs, looking
            # for a missing **kwargs), and that run found the layers already written by this one: the error reported
            # was a refusal of tokens the press "did not compress", the TypeError lost.
            raise RuntimeError(f"{type(self).__name__}: layer {module.layer_idx}: {error}") from error

    def _compress_pass(self, module: nn.Module, kwargs: dict, attentions: torch.Tensor | None) -> None:
        """Compress what the pass over `module`'s layer appended, reading the attention's probabilities
        `attentions` where the press asked for them."""
        cache = pass_cache(kwargs)
        name, layer_idx = type(self).__name__, module.layer_idx
        if cache is None:
            if not self._warned_without_cache:
                warnings.warn(f"{name}: the model ran without a KV cache (use_cache=False): nothing to compress, "
                              f"the press did nothing", stacklevel=4)
                self._warned_without_cache = True
            return
        self._refuse_head_wise_marks(module)
        layer = cache.layers[layer_idx]
        hidden_states = kwargs["hidden_states"]
        if hidden_states.requires_grad:
            raise RuntimeError(f"{name}: compresses the cache in place, outside autograd; run the model under "
                               f"torch.no_grad() or torch.inference_mode() (generate does)")
        new_tokens = hidden_states.shape[1]
        state = get_state(layer)
        if state is not None and not isinstance(self, KVCompDecodingPress) and state.owner_type is type(self):
            if new_tokens > 1 and self._compressed_in_context is not None and layer_idx in self._compressed_in_context:
                if layer_idx == min(self._compressed_in_context):  # once a pass
                    warnings.warn(
                        f"{name}: a pass of {new_tokens} tokens over layers {name} compressed earlier in the same "
                        f"context: {name} compresses a prompt once, whole, so these tokens stay uncompressed (a "
                        f"prompt streamed by generate(prefill_chunk_size=...) keeps every chunk after the first so; "
                        f"assisted generation's draft checks are such passes, their tokens kept as decoded ones "
                        f"are)", stacklevel=4)
            return  # a later pass of a prefill-only press: read no keys (a PagedKVCache would gather the layer)
        if state is None:
            result, keeps_held_slots = self._prefill_layer(module, layer, hidden_states, attentions, kwargs), False
            counted, slots_unchanged = True, 0
        else:
            # The counts are those of the cache this press last prefilled: a decoding step of another one (a second
            # request stepped in turn, a copy) is compressed as any, and counted in none of them.
            counted = self._last_written(module.layer_idx) is state
            result, keeps_held_slots, slots_unchanged = self._decode_layer(module, layer, state, hidden_states,
                                                                           attentions, kwargs)
            if result is not None and counted:
                self._count_later_tokens(module.layer_idx, hidden_states.shape[1])
        if result is not None:
            self._store(module, layer, *result, keeps_held_slots, counted, slots_unchanged)

    def _last_written(self, layer_idx: int) -> LayerState | None:
        """The state this press last wrote to layer `layer_idx` and counts the slots of, if it still exists."""
        written = self._states_written.get(layer_idx)
        return written() if written is not None else None

    def _prefill_layer(self, module: nn.Module, layer, hidden_states: torch.Tensor, attentions, kwargs: dict):
        """The prompt pass over a layer holding no state of ours: its compression (keys, values, state), or None."""
        name, layer_idx, new_tokens = type(self).__name__, module.layer_idx, hidden_states.shape[1]
        keys, values = in_one_dtype(layer.keys, layer.values)
        if keys.shape[-2] > new_tokens:
            raise ValueError(
                f"{name}: layer {layer_idx} already held {keys.shape[-2] - new_tokens} tokens that {name} did not "
                f"compress: it keeps a per-slot state from the prompt on, so it must be active when the prompt is "
                f"processed (alone, in a ComposedPress or as prefilling_press, not only as a decoding press)")
        forget_tokens_held(layer)  # a prompt compressed afresh: an earlier context's count is not its own
        self._tokens_counted[layer_idx] = new_tokens  # the prompt's columns, any padding a paged layer dropped too
        if self.compresses_compressed_prompt and keys.shape[-2] < new_tokens and not hasattr(layer, "drop_padding"):
            self._refuse_padding_lost(layer_idx, keys, kwargs, new_tokens)
        dropped = getattr(layer, "padding_dropped", 0)
        if dropped and keys.shape[-2] == new_tokens - dropped:
            # A paged prefill holds no column that every row pads (a batch padded to a multiple, say): the prompt is
            # the tokens after those, as the view shows them.
            hidden_states, kwargs = hidden_states[:, dropped:], _kwargs_from_column(kwargs, dropped)
            attentions = attentions[..., dropped:, dropped:] if attentions is not None else None
        used_queries = take_prompt_last_query(module)
        if self.scores_prompt_with_queries and used_queries is not None:
            check_recomputed_queries(name, module, hidden_states, kwargs, used_queries)
        return self._compress_prompt(module, hidden_states, keys, values, attentions, kwargs)

    def _decode_layer(self, module: nn.Module, layer, state: LayerState, hidden_states: torch.Tensor, attentions,
                      kwargs: dict):
        """A later pass over a layer holding this press's state: (its compression or None, whether every slot held
        before the pass is kept, how many of the layer's first slots the compression left as they were, 0 if not
        known)."""
        name, layer_idx, new_tokens = type(self).__name__, module.layer_idx, hidden_states.shape[1]
        keys, values = in_one_dtype(layer.keys, layer.values)
        owner = state.owner() if state.owner is not None else None
        if state.owner_type is not type(self) or (owner is not None and owner is not self):
            raise ValueError(f"{name}: layer {layer_idx} holds the state of {state.owner_name()}; two kvpress_cpp "
                             f"presses cannot compress one cache (compose {name} with kvpress presses only)")
        if isinstance(state, RowStates):
            state.follow_cut(keys.shape[-2] - new_tokens)
        self._check_state_covers_held_slots(layer_idx, state, keys.shape[-2] - new_tokens)
        if isinstance(state, RowStates):
            return self._compress_rows(module, hidden_states, keys, values, attentions, state, kwargs), False, 0
        result = self.compress_decoding(module, hidden_states, keys, values, attentions, state, kwargs)
        appended_only = (not self.decoding_rewrites_slots and result is not None and result[1] is values
                         and result[2] is state)
        return result, self.decoding_keeps_every_slot, keys.shape[-2] - new_tokens if appended_only else 0

    def _store(self, module: nn.Module, layer, keys: torch.Tensor, values: torch.Tensor, state: LayerState,
               keeps_held_slots: bool, counted: bool, slots_unchanged: int) -> None:
        """Write a compressed layer and its state, owned by this press, and note what the figures read later if the
        state is `counted` (the cache the press last prefilled). The first `slots_unchanged` slots are those the state
        described before the pass, as they were."""
        layer_idx = module.layer_idx
        if self._compressed_in_context is not None:
            self._compressed_in_context.add(layer_idx)
        layer.keys, layer.values = keys, values
        state.owner, state.owner_type = UnsavedRef(self), type(self)
        state.keeps_held_slots, state.slots_written = keeps_held_slots, keys.shape[-2]
        if not getattr(layer, "moves_state_with_slots", False):  # a DynamicLayer: probe for rearranged slots
            state.probe_slots(values, slots_unchanged)
        set_state(layer, state)
        attach(module, layer)
        if counted:
            self._slots_held[layer_idx] = state.log_weights.clone()  # counted when read (_held)
            self._states_written[layer_idx] = UnsavedRef(state)
            self._held_to_gather.add(layer_idx)

    def _refuse_padding_lost(self, layer_idx: int, keys: torch.Tensor, kwargs: dict, prompt_tokens: int) -> None:
        """Raise if a press before this one (in a ComposedPress) shrank a left-padded prompt on a rectangular layer:
        the slots it kept no longer say which are padding (a paged layer dropped the padding before any press ran),
        and this press would attend them as tokens."""
        padding = padding_log_weights(kwargs.get("attention_mask"), keys.shape[0], 1, prompt_tokens, keys.device)
        padded = (padding[:, 0] == float("-inf")).any(-1)
        if bool(padded.any()):
            name = type(self).__name__
            raise ValueError(
                f"{name}: layer {layer_idx} holds {keys.shape[-2]} slots of a left-padded batch's {prompt_tokens}-token "
                f"prompt (batch rows {padded.nonzero().flatten().tolist()} are padded), which a press before {name} "
                f"(in a ComposedPress, or a context opened around {name}'s) already compressed on a DynamicCache: "
                f"which of those slots are padding is lost there, and {name} would attend them as tokens. Use a "
                f"PagedKVCache, which drops the padding before any press runs, or batches without padding")

    def _refuse_head_wise_marks(self, module: nn.Module) -> None:
        """Raise if a kvpress head-wise press before ours in this pass marked tokens (``module.masked_key_indices``;
        the prefill's attention cleared older marks). Checked before the layer is read: a paged layer evicts the marks
        as token positions when it is next read, and our compression would move the tokens they index."""
        if getattr(module, "masked_key_indices", None) is not None:
            name = type(self).__name__
            raise ValueError(
                f"{name}: layer {module.layer_idx}: a kvpress press before {name} marked tokens for head-wise eviction "
                f"(module.masked_key_indices, e.g. DMSPress, DuoAttentionPress or CriticalAdaKVPress in a "
                f"ComposedPress); {name} compresses the cache into slots of its own, which those marks cannot follow. "
                f"Head-wise masking presses cannot be composed with {name}")

    def _check_state_covers_held_slots(self, layer_idx: int, state: LayerState, slots_before: int) -> None:
        """Raise if the layer holds slots the press's per-slot state (scores, merge counts) does not cover: tokens a
        pass appended while the press's context was closed, which it has no scores for."""
        rows = zip(state.rows, state.padding) if isinstance(state, RowStates) else [(state, 0)]
        for row, padding in rows:
            covered = {tensor.shape[-1] for tensor in row.per_slot.values()}
            if covered and covered != {slots_before - padding}:
                name = type(self).__name__
                raise ValueError(
                    f"{name}: layer {layer_idx} holds {slots_before - padding} slots before this pass, but {name}'s "
                    f"per-slot state ({', '.join(row.per_slot)}) covers {max(covered)}: tokens were fed over the cache "
                    f"while {name}'s context was closed, and it has no scores for them. Run every pass over a cache "
                    f"{name} compresses while decoding inside `with press(model):`")

    def _forget_layers_not_hooked(self) -> None:
        """Drop the counts of layers this context does not hook: a press used on another model before would
        otherwise average that model's layers into its ratios."""
        hooked = {module.layer_idx for module in self._hooked_modules}
        for counts in (self._slots_seen, self._tokens_counted, self._slots_held, self._states_written):
            for layer in set(counts) - hooked:
                del counts[layer]
        self._held_to_gather.intersection_update(hooked)

    def _is_first_hooked_layer(self, module: nn.Module) -> bool:
        """Whether `module` is the first attention layer the press hooks in the model (kvpress does not hook Gemma 3's
        sliding layers, the first of which is layer 0)."""
        return module is self._hooked_modules[0] if self._hooked_modules else module.layer_idx == 0

    def _is_last_hooked_layer(self, module: nn.Module) -> bool:
        """Whether `module` is the last attention layer the press hooks in the model (Gemma 3 4B's and 27B's last,
        sliding, is not)."""
        if self._hooked_modules:
            return module is self._hooked_modules[-1]
        return module.layer_idx == module.config.num_hidden_layers - 1

    def _after_layer(self, module: nn.Module, output):
        """The end of every forward hook: after the last layer hooked, the held counts of a tensor-parallel model's
        layers gathered over its ranks."""
        if not self._is_last_hooked_layer(module):
            return output
        if self._held_to_gather and kv_head_shard(module):
            # One all-gather per forward makes every layer's counts the model's on every rank (same layers on all).
            layers = sorted(self._held_to_gather)
            gathered = gather_kv_heads(torch.stack([self._held(layer) for layer in layers]), module, dim=-1)
            self._slots_held.update(zip(layers, gathered))
        self._held_to_gather.clear()
        return output

    def _count_later_tokens(self, layer_idx: int, tokens: int) -> None:
        """Count the `tokens` a later pass fed each batch row as seen (a press taking over a cache another instance
        prefilled starts from 0)."""
        self._slots_seen.setdefault(layer_idx, [0, 0])[1] += tokens
        self._tokens_counted[layer_idx] = self._tokens_counted.get(layer_idx, 0) + tokens

    def holds_every_token_seen(self, layer_idx: int, state: LayerState) -> bool | None:
        """Whether the layer holding `state` keeps a slot per token this press saw there, in every batch row and kv
        head (nothing evicted nor merged): None where `state` is not the one this press last wrote to that layer (a
        copy of the cache, another cache since), whose counts it does not know."""
        held = self._held(layer_idx)
        if self._last_written(layer_idx) is not state or held is None:
            return None
        prompt, later = self._slots_seen[layer_idx]
        seen = (prompt.unsqueeze(-1) if isinstance(prompt, torch.Tensor) else prompt) + later
        return bool((held == seen).all())

    def tokens_cropped(self, layer_idx: int, state: LayerState, kept: int) -> None:
        """A crop left a layer holding `state`, a slot per token, with its first `kept` tokens: if this press wrote
        that state and evicted nothing from it (every batch row and kv head holding each token it saw), the tokens
        it had counted past them are no longer seen nor held. Where it evicted some, a crop cuts slots of a cache being
        emptied (or tokens it never counted), and its last ratios stay readable until the next prefill."""
        removed = self._tokens_counted.get(layer_idx, 0) - kept
        if removed <= 0 or not self.holds_every_token_seen(layer_idx, state):
            return
        prompt, later = self._slots_seen[layer_idx]
        held = self._held(layer_idx)
        from_later = min(later, removed)
        self._slots_seen[layer_idx] = [prompt - (removed - from_later), later - from_later]
        self._tokens_counted[layer_idx] = kept
        self._slots_held[layer_idx] = held - removed

    def _held(self, layer_idx: int) -> torch.Tensor | None:
        """The slots held per batch row and kv head (B, H) of a layer after the last forward: its log-weights above
        -inf, counted the first time they are read."""
        held = self._slots_held.get(layer_idx)
        if held is not None and held.dim() == 3:
            held = self._slots_held[layer_idx] = held.gt(float("-inf")).sum(dim=2)
        return held

    def rows_taken(self, state: LayerState, rows: torch.Tensor) -> None:
        """`state`'s batch rows were rearranged (:meth:`LayerState.take_rows`: beam search's reorder, repeated or
        selected rows). If it is the state this press last wrote to a layer, that layer's counts of the slots seen
        and held follow the rows, so that the compression ratios stay those of the batch the cache now holds (a copy
        of the cache, whose states the press did not write, leaves them alone)."""
        layer_idx = next((idx for idx, written in self._states_written.items() if written() is state), None)
        if layer_idx is None:
            return
        held = self._held(layer_idx)
        if held is not None:
            self._slots_held[layer_idx] = held.index_select(0, rows.to(held.device))
        prompt = self._slots_seen.get(layer_idx, [0])[0]
        if isinstance(prompt, torch.Tensor):
            self._slots_seen[layer_idx][0] = prompt.index_select(0, rows.to(prompt.device))

    def tensor_parallel_limitation(self) -> str | None:
        """Why this press cannot run on a tensor-parallel model (each rank holding H/N kv heads), or None."""
        return None

    def _claim_forward(self, base_model: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the decoder stack, before any other of the press's: refuse a forward that starts while
        another thread's runs under the same context. The attention hands the press each layer's scores and queries
        through attributes of the model's modules, which two forwards at once overwrite for each other: other tokens,
        silently, or a refusal blaming the model. (Released by :meth:`_release_forward`, which runs on errors too.)"""
        thread = threading.get_ident()
        with _FORWARD_CLAIM_LOCK:
            running = self._forward_thread
            if running is None or running == thread:
                self._forward_thread = thread
                return
        name = type(self).__name__
        raise RuntimeError(f"{name}: a forward of {type(base_model).__name__} started in thread {thread} while one of "
                           f"thread {running} runs under the same `with press(model):`. {name} reads each layer's "
                           f"attention through the model's modules, which concurrent forwards overwrite for each "
                           f"other; run one forward at a time per model (a lock around generate), or give each thread "
                           f"its own copy of the model")

    def _release_forward(self, base_model: nn.Module, args: tuple, kwargs: dict, output) -> None:
        """Forward hook of the decoder stack, run when the forward raised too: the next forward may come from any
        thread."""
        if self._forward_thread == threading.get_ident():
            self._forward_thread = None

    def _refuse_cache_of_the_wrong_kind(self, base_model: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the decoder stack: refuse a cache whose hooked layers cannot hold a press's state
        before any layer writes to it. The layers' forward hook refuses too, but after the layer wrote, and inside
        transformers 4.57's check_model_inputs, which runs the forward again after a TypeError: a static cache then
        overflowed first (a bare IndexError)."""
        cache = pass_cache(kwargs)
        layers = getattr(cache, "layers", [])
        for module in self._hooked_modules:
            if module.layer_idx < len(layers):
                check_cache_layer(layers[module.layer_idx], type(self).__name__)

    def _check_resumed_positions(self, base_model: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        """Forward pre-hook of the decoder stack: count the positions the cache stands for, tell the hooked attention
        modules (a sliding window is compared with them), and refuse a pass that feeds again tokens a compressed
        cache already holds. `generate` resumes a cache from ``get_seq_length()``, which counts a compressed layer's
        slots, not the tokens it stands for, so a second ``generate`` call on the same cache (a chat's next turn)
        would re-feed the tokens between the two. The count is a Python int on the cache; a cut from the right
        (speculative decoding's rollback, kvpress's pipeline dropping an answer) lowers it by the slots cut, and
        tokens appended outside the press's context raise it by the slots they added. Only
        passes of several tokens over a filled cache read their positions (a host sync at prefill scale), so a
        decoding step waits on nothing.

        A pass given no positions at all (a hand-written ``model(token, past_key_values=cache)`` loop) would be
        placed by the model at ``get_seq_length()``, the slots, so a compressed cache would rotate every new token
        to a wrong position: it gets the positions that follow the tokens the cache stands for instead, as an
        uncompressed cache would give it (returned as the pass's kwargs)."""
        cache, inputs = pass_cache(kwargs), pass_inputs(args, kwargs)
        if cache is None or inputs is None or not hasattr(cache, "layers"):
            return
        new_tokens, slots = inputs.shape[1], cache.get_seq_length()
        processed = _tokens_stood_for(cache, slots) if slots else 0
        placed = None
        if processed > slots and kwargs.get("position_ids") is None and kwargs.get("cache_position") is None:
            positions = torch.arange(processed, processed + new_tokens, device=inputs.device).unsqueeze(0)
            placed = args, {**kwargs, "position_ids": positions}
        if new_tokens == 1 or not slots or placed is not None:
            after = processed + new_tokens
        else:
            positions = kwargs.get("position_ids")
            positions = positions if positions is not None else kwargs.get("cache_position")
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] >= processed:
                # The mask's columns are what the count counts (padding included); a left-padded batch's positions
                # are each row's tokens, fewer where every row is padded (transformers 5's chunked prefill)
                first, after = mask.shape[-1] - new_tokens, mask.shape[-1]
            elif positions is None:  # the model counts from get_seq_length(), here the tokens held
                first, after = slots, slots + new_tokens
            else:
                positions = positions.reshape(-1, positions.shape[-1])
                first, after = int(positions[:, 0].max()), int(positions[:, -1].max()) + 1
            if first < processed and get_state(cache.layers[0]) is not None:
                if kwargs.get("use_cache") is False:
                    note = (". Here the pass runs with use_cache=False: generate then feeds the whole sequence at "
                            "every step, into the cache it was given as past_key_values (leave out one or the other)")
                elif CHUNKED_PREFILL_REPEATS_LAST_POSITIONS:
                    note = (f". In transformers {transformers.__version__}, generate(prefill_chunk_size=...) does "
                            f"this too: it gives every chunk the positions of the prompt's last chunk")
                else:
                    note = ""
                raise tokens_fed_again_error(type(self).__name__, new_tokens, first, processed, slots, note=note)
        # Padding among a later pass's tokens: the model's mask of the pass is built for the slots (a compressed
        # layer's columns are not the mask's), and the press would decode it as tokens; only this mask tells.
        mask = kwargs.get("attention_mask")
        if (new_tokens > 1 and slots and isinstance(mask, torch.Tensor) and mask.dim() == 2
                and (padding := new_token_padding(mask, new_tokens)) is not None
                and any(get_state(layer) is not None for layer in cache.layers)):
            raise padding_after_prefill_error(type(self).__name__, padding)
        setattr(cache, _POSITIONS_ATTR, after)
        for module in self._hooked_modules:
            set_positions_end(module, after)
        return placed

    def _record_slots(self, base_model: nn.Module, args: tuple, kwargs: dict, output) -> None:
        """Forward hook of the decoder stack: the slots the cache holds after the pass, to recognise a later cut. A
        cache the model created in this pass (``past_key_values=None``, ``use_cache=True``: a hand-written loop's
        first forward) starts its position count here, with the pass's tokens. The caches are remembered until the
        context closes, which records where their tokens end for passes outside it."""
        cache = pass_cache(kwargs)
        if cache is None:
            cache = output_cache(output)
            inputs = pass_inputs(args, kwargs)
            if cache is not None and inputs is not None and not hasattr(cache, _POSITIONS_ATTR):
                setattr(cache, _POSITIONS_ATTR, inputs.shape[1])
        if cache is not None and hasattr(cache, "layers"):
            setattr(cache, _SLOTS_ATTR, cache.get_seq_length())
            self._caches_in_context.add(cache)
            if "crop" not in cache.__dict__:
                cache.crop = MethodOf(_crop_counting_tokens, cache)
            if hasattr(cache, "to_legacy_cache") and "to_legacy_cache" not in cache.__dict__:
                cache.to_legacy_cache = MethodOf(_legacy_cache_without_state, cache)

    @contextmanager
    def __call__(self, model):
        with self.context_under(self, model):
            yield

    @contextmanager
    def _checking_generate_chunks(self, model):
        """`model.generate` refusing, while the context is open, a prompt streamed in chunks
        (``generate(prefill_chunk_size=...)``, or a generation_config holding one) where this press cannot compress
        it so (:meth:`check_generate_chunks`)."""
        generate = model.__dict__.get("generate")
        original = getattr(model, "generate", None)
        if original is None:
            yield
            return

        @functools.wraps(original)
        def checked_generate(*args, **kwargs):
            config = kwargs.get("generation_config")
            chunk = kwargs.get("prefill_chunk_size", getattr(config, "prefill_chunk_size", None))
            if chunk is not None:
                self.check_generate_chunks(chunk)
            return original(*args, **kwargs)

        model.generate = checked_generate
        try:
            yield
        finally:
            if generate is None:
                del model.generate
            else:
                model.generate = generate

    def check_generate_chunks(self, chunk: int) -> None:
        """Raise if generate's chunked prefill of `chunk` tokens cannot stream the prompt into this press: its first
        chunk is the press's prefill and every later one a pass over it, so a press compressing while decoding would
        take a fractional budget of the first chunk alone; and transformers 5.2's chunked prefill positions every
        chunk as the prompt's last."""
        name = type(self).__name__
        check_chunk_positions(name, f"generate(prefill_chunk_size={chunk})", "generate without it")
        budget = getattr(self, self.budget_field) if self.budget_field else None
        if isinstance(self, KVCompDecodingPress) and isinstance(budget, float):
            raise ValueError(f"{name}: generate(prefill_chunk_size={chunk}) streams the prompt in chunks, the first of "
                             f"which is {name}'s prefill: {self.budget_field}={budget!r} would keep that fraction of "
                             f"its {chunk} tokens, not of the prompt's, and hold every later chunk to it. Use a "
                             f"{self.budget_field} in tokens, or leave prefill_chunk_size out")

    @contextmanager
    def context_under(self, hooking_press: BasePress, model):
        """The press's context on `model`, its forward hook run by `hooking_press`: the press itself (``with
        press(model):``, where kvpress registers the hook here), or a kvpress wrapper holding it (``ComposedPress``,
        ``PrefillDecodingPress``), whose own context has registered the wrapper's hooks already and opens this one
        inside it (kvpress_adapters). Either way the press counts the positions its cache stands for, refuses tokens
        fed again and asks the attention for the prompt's scores."""
        name = type(self).__name__
        attention_modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
        decoder = getattr(model, "model", None)
        # kvpress hands every layer the decoder's rotary_emb (Olmo3 under transformers 4 has one per layer type)
        rotary = getattr(hooked_decoder(model), "rotary_emb", None)
        if not attention_modules or not isinstance(decoder, nn.Module) or not isinstance(rotary, nn.Module):
            raise ValueError(f"{name}: kvpress's hooks take a causal language model whose `model` holds the decoder "
                             f"layers and one `rotary_emb`, and whose attention modules have `layer_idx` and "
                             f"`scaling` (LlamaForCausalLM, Mistral, Qwen2/3, Phi-3, Gemma); got "
                             f"{type(model).__name__}")
        dtype = getattr(model, "dtype", None)
        if dtype is not None and dtype not in ops.CACHE_DTYPES:  # else a bare error of an op it calls, mid-forward
            raise ValueError(f"{name}: compresses float32, float16 or bfloat16 models (the dtypes of its ops), got a "
                             f"{dtype} {type(model).__name__}: load it in one of those (model.float())")
        already = next((press for module in attention_modules for press in active_presses(module)), None)
        if already:
            raise ValueError(f"{name}: {already} is already active on this {type(model).__name__}; two kvpress_cpp "
                             f"presses cannot compress one cache: open one of them per model")
        if self._compressed_in_context is not None:
            # The open context's state lives on the press (the modules it marked active, the layers it compressed,
            # KVzap's surrogate loaded for its model): a second model would take it over, and closing either context
            # would leave the other model's modules marked active for good.
            raise ValueError(f"{name}: this press object is already active on another model (a `with press(model):` "
                             f"is open); one press object compresses one model at a time: create one {name} per "
                             f"model")
        self._warned_without_cache, self._compressed_in_context = False, set()
        self._caches_in_context = weakref.WeakSet()
        for module in attention_modules:
            request_prefill_scores(module, self.prompt_score_weights(module))
            if not self.reads_decode_probabilities:
                count_hook_without_probabilities(module, +1)
        self._forward_thread = None
        hooks = [model.model.register_forward_pre_hook(self._claim_forward, with_kwargs=True),
                 model.model.register_forward_pre_hook(self._refuse_cache_of_the_wrong_kind, with_kwargs=True),
                 model.model.register_forward_pre_hook(self._check_resumed_positions, with_kwargs=True),
                 model.model.register_forward_hook(self._record_slots, with_kwargs=True),
                 model.model.register_forward_hook(self._release_forward, with_kwargs=True, always_call=True)]
        try:
            with super().__call__(model) if hooking_press is self else nullcontext(), \
                    self._checking_generate_chunks(model):
                # The modules kvpress hooked (not Gemma 3's sliding layers, for one) are the ones the press acts on.
                self._hooked_modules = [module for module in attention_modules if any(
                    getattr(hook, "__self__", None) is hooking_press for hook in module._forward_hooks.values())]
                self._forget_layers_not_hooked()
                for module in self._hooked_modules:
                    mark_press_active(module, name, True)
                    if hooking_press is self and isinstance(self, KVCompDecodingPress):
                        hooks.append(module.register_forward_pre_hook(self._hold_pass_for_its_attention,
                                                                      with_kwargs=True))
                try:
                    yield
                except BaseException:
                    _forget_unwritten_generation_cache(model)
                    raise
                finally:
                    for module in self._hooked_modules:
                        mark_press_active(module, name, False)
                        hold_pass_for_attention(module, self, None)
                        module.__dict__.pop(_COMPRESSED_AFTER_ATTENTION_ATTR, None)
                    self._hooked_modules = []
        finally:
            for cache in self._caches_in_context:
                if hasattr(cache, _POSITIONS_ATTR):
                    # Slots cut from the right since the last pass were tokens the count still holds: kvpress's
                    # pipeline cuts the question and answer off inside a PrefillDecodingPress's context, and no pass
                    # follows to take them off. Slots added since are a pass's that failed once counted.
                    slots = min(cache.get_seq_length(), getattr(cache, _SLOTS_ATTR))
                    remember_tokens_held(cache, _tokens_stood_for(cache, slots))
            self._compressed_in_context, self._caches_in_context, self._forward_thread = None, None, None
            for hook in hooks:
                hook.remove()
            for module in attention_modules:
                request_prefill_scores(module, None)
                if not self.reads_decode_probabilities:
                    count_hook_without_probabilities(module, -1)


def _forget_unwritten_generation_cache(model: nn.Module) -> None:
    """After a refusal inside a press's context: transformers (4.57 to 5.2) keeps generate's static cache on the
    model (``model._cache``) for the next call, and one with a layer never written (the refused pass stopped before
    it) fails the model's next static generate inside transformers, press or not ('StaticLayer' object has no
    attribute 'max_batch_size'). Dropped, generate makes a new one."""
    cache = model.__dict__.get("_cache")
    if cache is not None and any(getattr(layer, "is_initialized", True) is False
                                 for layer in getattr(cache, "layers", ())):
        del model._cache


@dataclass
class KVCompDecodingPress(KVCompPress, PrefillDecodingPress):
    """Base of the presses that also compress at every decoding step (and in kvpress's pipeline's decoding)."""

    # PrefillDecodingPress delegates to two inner presses; ours does both phases itself.
    prefilling_press: None = field(default=None, init=False, repr=False)
    decoding_press: None = field(default=None, init=False, repr=False)
