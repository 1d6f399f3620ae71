"""kvpress's ``DMSPress`` and ``AdaKVPress`` on our cache, on padded batches and on tensor-parallel ranks; kvpress's
``ComposedPress`` and ``PrefillDecodingPress`` around our presses.

Importing this module (``kvpress_cpp.presses`` and ``kvpress_cpp.paged_cache`` do) wraps ``DMSPress.forward_hook``,
``AdaKVPress.compress``, both presses' ``post_init_from_model``, ``ScorerPress.compress`` (its selection on a paged
layer, and a tensor-parallel rank's heads, :func:`patch_scorer_press`), ``ComposedPress.__call__`` and
``PrefillDecodingPress.__call__`` (which then open the context of each press of ours they hold, as ``with
press(model):`` does, :func:`patch_wrapper_contexts`), ``BasePress.__call__`` (a press that cannot run on a model
splitting its kv heads over tensor-parallel ranks refused naming it, each hooked layer given the rotary embedding it
turns with, and a pass without the ``cache_position`` kvpress's hooks read refused naming the press,
:func:`patch_press_contexts`), ``BasePress.forward_hook`` (a kvpress press failing on slots of ours is refused naming
both, :func:`patch_presses_after_ours`), ``PrefillDecodingPress.__call__`` again and ``BlockPress``'s (presses they
cannot run refused naming both, :func:`patch_wrapper_placements`) and the pipeline's ``_forward`` (several questions
with a press of ours that compresses while decoding are refused naming it, :func:`patch_pipeline_questions`); kvpress
itself is unchanged.

Both wrap a scorer (``press.press``). On a tensor-parallel rank a scorer runs only if it scores each kv head from that
head's own queries and keys (:data:`SHARDABLE_SCORERS`): ours read the layer's shard themselves; kvpress's read the
model's head counts from ``module.config`` to reshape the rank's queries, and score under a copy of it with the rank's
counts (SnapKV's ``score`` is adapted so, wherever it runs). Any other scorer is refused on a tensor-parallel model,
naming the press and the reason.

``DMSPress``:

* **Padded prefills are scored row by row.** ``DMSPress`` scores a prefill's tokens with its ``ScorerPress`` in one
  batched call. A scorer that relates a token to the others (SnapKV's window attention over the keys,
  ExpectedAttention's softmax over the keys, its query statistics and sink tokens) then sees the padding of the
  shorter rows, so a row's scores, and the slots evicted, depend on the batch it was padded into; on a
  :class:`~kvpress_cpp.paged_cache.PagedKVCache`, whose view shows dropped padding as zero keys, they also differ
  from the rectangular cache's. On a padded prefill the scorer now runs on each row's real tokens (hidden states,
  keys, values and the attention kwargs cut as for our own presses' rows) and the padding columns score +inf, so
  ``DMSPress`` never marks them (they hold no slot on a paged cache, and the mask hides them on a rectangular one).
  A scorer that looks at each token alone (KVzap, Knorm) gives the same scores either way.
* **``compression_ratio`` counts the press's own marks.** ``DMSPress`` measures it as the marks left in
  ``module.masked_key_indices`` over the layer's (B, H, T) keys. A paged cache evicts those marks for real and clears
  them, so that read only the last pass's marks (0.007 where the rectangular cache reports 0.487); on a
  tensor-parallel rank it covered the rank's heads only. Each layer's ratio is now the marks ``DMSPress`` added since
  the prefill over B·H·T of the model (H all its kv heads, T the tokens cached), the counts summed over the ranks
  (one all-gather per pass, at the last layer): the same figure on every cache and every rank.

Unpadded passes of one process score as before.

Both keep their decisions outside the cache (the marks on the attention module, DMSPress's recent scores on the
press): a cache layer they marked takes both along when it rearranges its batch (beam search, num_return_sequences;
:func:`_follow_batch_rows`), where kvpress left them on the old rows.

``AdaKVPress`` shares one budget across the heads it sees: a safeguard of the best ``alpha_safeguard`` of each head's
kept tokens, then the bottom-k of all heads' scores. On a tensor-parallel rank it would see only the rank's heads, so
what each head keeps would depend on the number of ranks. There the scorer's (B, H/N, T) scores are now all-gathered
to the model's (B, H, T), kvpress's own ``compress`` selects over them as in one process, and each rank keeps the
marks of its own heads, renumbered to its local heads. Without tensor parallelism, and on a cache other than a paged
one, ``AdaKVPress`` runs exactly as in kvpress. On a paged layer whose view has holes (columns that show no slot of
their head), the scorer's scores there are -inf, and its marks, columns of the view, become the positions of the
tokens those columns show (once marks evicted slots, a head's later slots no longer sit at their tokens' columns).
"""

from __future__ import annotations

import copy
import functools
import inspect
from contextlib import ExitStack, contextmanager, nullcontext

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer
from kvpress import (AdaKVPress, BasePress, BlockPress, ChunkKVPress, ChunkPress, ComposedPress, CriticalAdaKVPress,
                     CriticalKVPress, DecodingPress, DMSPress, FastKVzipPress, KeyRerotationPress, KnormPress,
                     KVComposePress, KVzipPress, PerLayerCompressionPress, PrefillDecodingPress, PyramidKVPress,
                     ScorerPress, SnapKVPress, StreamingLLMPress)
from kvpress import KVzapPress as KVzapScorer
from kvpress.pipeline import KVPressTextGenerationPipeline
from kvpress.presses.base_press import is_prefilling
from kvpress.utils import compute_n_kept

from kvpress_cpp.attention import padding_log_weights
from kvpress_cpp.cache import ROWS_KEPT, MethodOf, UnsavedRef, get_state, pass_cache, rearrange_batch
from kvpress_cpp.distributed import check_tensor_parallel, gather_kv_heads, kv_head_shard
from kvpress_cpp.paged_cache import PagedLayer, pass_paged_layer, shared_padding_dropped
from kvpress_cpp.presses.base import KVCompDecodingPress, KVCompPress, _row_kwargs, hooked_decoder
from kvpress_cpp.presses.kvzap import KVzapPress

__all__ = ["patch_dms_press", "patch_adakv_press", "patch_scorer_press", "patch_wrapper_contexts",
           "patch_press_contexts", "patch_presses_after_ours", "patch_wrapper_placements", "patch_pipeline_questions",
           "SHARDABLE_SCORERS", "CONTEXT_WRAPPERS", "SCORER_WRAPPERS", "HEAD_WISE_WRAPPERS",
           "refuse_unshardable_presses", "kvpress_transformers_mismatch"]

#: The scorers that run on a tensor-parallel rank, alone, inside DMSPress and AdaKVPress, or inside
#: :data:`HEAD_WISE_WRAPPERS`: each scores a kv head from that head's own queries, keys or position. Ours read the
#: layer's shard themselves; SnapKV's ``score`` runs under the rank's head counts (:func:`patch_scorer_press`); Knorm
#: and StreamingLLM read no head count.
SHARDABLE_SCORERS = (KVzapPress, SnapKVPress, KnormPress, StreamingLLMPress)
#: kvpress's wrappers that run each press they hold through its own forward hook (the attributes naming them): they
#: open the context of each press of ours inside (:func:`patch_wrapper_contexts`).
CONTEXT_WRAPPERS = {ComposedPress: ("presses",), PrefillDecodingPress: ("prefilling_press", "decoding_press")}
#: kvpress's wrappers that act on each kv head alone with the presses they hold (the attributes naming them): on a
#: tensor-parallel rank they run where those presses do.
HEAD_WISE_WRAPPERS = {**CONTEXT_WRAPPERS, KeyRerotationPress: ("press",), PerLayerCompressionPress: ("press",),
                      ChunkPress: ("press",)}

#: kvpress's wrappers that re-rank or re-select the tokens a ScorerPress scores (the argument naming it): they assert
#: that they hold one.
SCORER_WRAPPERS = {DecodingPress: "base_press", AdaKVPress: "press", ChunkPress: "press", ChunkKVPress: "press",
                   BlockPress: "press", KeyRerotationPress: "press", CriticalKVPress: "press",
                   CriticalAdaKVPress: "press"}

_PATCHED_ATTR = "_kvcomp_adapted"
# Apart from _PATCHED_ATTR: ComposedPress inherits BasePress.__call__, which patch_wrapper_contexts wraps in turn, and
# PrefillDecodingPress.__call__ is wrapped by patch_wrapper_contexts and patch_wrapper_placements.
_PRESS_CONTEXT_ATTR = "_kvcomp_press_context"
_PLACEMENT_ATTR = "_kvcomp_placement_checked"
_MARKERS = (_PATCHED_ATTR, _PRESS_CONTEXT_ATTR, _PLACEMENT_ATTR)
_LAYER_ROTARY_ATTR = "_kvcomp_layer_rotary"  # on an attention module: its _LayerTypeRotary
# On the press: layer → [each row's marks added since the prefill, tokens cached, each row's left padding]; the per-row
# counts (B,) int64 on the CPU, so that they follow the batch's rows as the cache rearranges them.
_MARKS_ATTR = "_kvcomp_marks"


def _presses_held(press, wrappers: dict) -> list | None:
    """The presses `press` holds, in order, if it is one of `wrappers` (class → the attributes holding them: a press,
    a list of them, or None); None otherwise."""
    attributes = next((names for cls, names in wrappers.items() if isinstance(press, cls)), None)
    if attributes is None:
        return None
    held = [getattr(press, name) for name in attributes]
    return [inner for item in held for inner in (item if isinstance(item, (list, tuple)) else [item])
            if inner is not None]


def _adapt(owner: type, name: str, adapter, marker: str = _PATCHED_ATTR) -> None:
    """Replace ``owner.<name>`` by ``adapter(original)``, marked with `marker`: a method already adapted (by an earlier
    call, or inherited from an adapted class) is left as it is, so that every ``patch_*`` function is idempotent. An
    adapter over another carries its marks too, whatever order the patches run in."""
    original = getattr(owner, name)
    if getattr(original, marker, False):
        return
    adapted = adapter(original)
    for carried in _MARKERS:
        if getattr(original, carried, False):
            setattr(adapted, carried, True)
    setattr(adapted, marker, True)
    setattr(owner, name, adapted)


def kvpress_transformers_mismatch() -> str | None:
    """Why kvpress's own forward hooks cannot run here, or None: the installed transformers is outside the range
    kvpress declares (kvpress 0.5.5: <5.3; later transformers stop passing the ``cache_position`` its hooks read).
    Our pins satisfy it; a GPU machine without network may have only a newer transformers. Tests skip, and
    benchmarks leave out, what runs kvpress's hooks there."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement

    for line in requires("kvpress") or []:
        requirement = Requirement(line)
        if requirement.name == "transformers" and requirement.marker is None:
            installed = version("transformers")
            if not requirement.specifier.contains(installed, prereleases=True):
                return f"kvpress requires {requirement}, this machine has transformers {installed}"
    return None


def _prefill_padding(kwargs: dict) -> list[int] | None:
    """The left padding of each row of a prefill pass, or None for a pass with no padding (or not a prefill)."""
    hidden_states, attention_mask = kwargs["hidden_states"], kwargs.get("attention_mask")
    batch, new_tokens = hidden_states.shape[:2]
    if attention_mask is None or not is_prefilling(kwargs["cache_position"], new_tokens):
        return None
    is_real = torch.isfinite(padding_log_weights(attention_mask, batch, 1, new_tokens, hidden_states.device)[:, 0])
    padding = (~is_real).sum(-1)
    if not bool(padding.any()):
        return None
    if not bool(is_real.any(-1).all()):
        raise ValueError(f"DMSPress: batch rows {(~is_real.any(-1)).nonzero().flatten().tolist()} hold padding only "
                         f"(an empty prompt)")
    if not bool((is_real.int().argmax(-1) == padding).all()):
        raise ValueError("DMSPress: only left padding is supported (tokenizer padding_side='left'), as `generate` "
                         "expects of decoder-only models")
    return padding.tolist()


@contextmanager
def _rank_head_counts(module, shard: tuple[int, int]):
    """``module.config`` says the rank's kv and query head counts inside the block: kvpress's scorers reshape the
    (sharded) query projection and group the query heads by the config's counts, which are the model's."""
    config = module.config
    ranks = config.num_key_value_heads // (shard[1] - shard[0])
    module.config = copy.copy(config)
    module.config.num_key_value_heads //= ranks
    module.config.num_attention_heads //= ranks
    try:
        yield
    finally:
        module.config = config


def _scoring_the_rank_heads(score):
    """SnapKV's `score` of the kv heads this process holds: under the rank's head counts on a tensor-parallel rank
    (:func:`_rank_head_counts`), which it reads to reshape the rank's queries and group them."""

    def adapted_score(self, module, hidden_states, keys, values, attentions, kwargs):
        shard = kv_head_shard(module)
        with nullcontext() if shard is None else _rank_head_counts(module, shard):
            return score(self, module, hidden_states, keys, values, attentions, kwargs)

    return adapted_score


class _ScorerStandIn:
    """Stands in for a kvpress wrapper's scorer while the wrapper runs: ``score`` gives the scorer's scores of the kv
    heads this process holds (a tensor-parallel rank's own, or all of them), -inf at the `holes` of a paged layer's
    view (:func:`_view_holes`) when given."""

    def __init__(self, scorer, holes: torch.Tensor | None = None):
        self.scorer = scorer
        self.holes = holes

    @property
    def compression_ratio(self) -> float:
        return self.scorer.compression_ratio

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        scores = self.scorer.score(module, hidden_states, keys, values, attentions, kwargs)
        return scores if self.holes is None else scores.masked_fill(self.holes, float("-inf"))


class _RowByRowScorer(_ScorerStandIn):
    """Stands in for DMSPress's scorer during a padded prefill: ``score`` runs the scorer on each row's real tokens
    and pads the row's scores with +inf."""

    def __init__(self, scorer, padding: list[int]):
        super().__init__(scorer)
        self.padding = padding

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        # Columns of padding every row shares, which a paged layer's keys do not hold.
        shared_padding = shared_padding_dropped(module, kwargs)
        rows = []
        for row, pad in enumerate(self.padding):
            key_pad = pad - shared_padding
            row_attentions = attentions[row:row + 1, :, pad:, key_pad:] if attentions is not None else None
            scores = super().score(module, hidden_states[row:row + 1, pad:], keys[row:row + 1, :, key_pad:],
                                   values[row:row + 1, :, key_pad:], row_attentions, _row_kwargs(kwargs, row, pad))
            rows.append(torch.nn.functional.pad(scores, (key_pad, 0), value=float("inf")))
        return torch.cat(rows)


class _AllRanksScorer(_ScorerStandIn):
    """Stands in for AdaKVPress's scorer on a tensor-parallel rank: ``score`` returns the scores of every kv head of
    the model (B, H, T), gathered over the ranks."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        return gather_kv_heads(super().score(module, hidden_states, keys, values, attentions, kwargs), module, dim=1)


def _refuse_unshardable_scorer(press, model) -> None:
    """Raise a ValueError naming `press` (a kvpress wrapper) on a tensor-parallel model its scorer cannot score
    per rank, or whose heads do not split over the ranks."""
    scorer = press.press
    limitation = None if isinstance(scorer, SHARDABLE_SCORERS) else (
        f"its scorer {type(scorer).__name__} is not known to score each kv head from that head's own queries and "
        f"keys, all a rank holds; use {' or '.join(f'{cls.__module__}.{cls.__name__}' for cls in SHARDABLE_SCORERS)}")
    check_tensor_parallel(type(press).__name__, model, limitation)


def _refusing_unshardable_scorers(post_init_from_model):
    """A kvpress wrapper's ``post_init_from_model`` that first refuses a scorer it cannot run sharded."""

    def adapted_post_init_from_model(self, model):
        _refuse_unshardable_scorer(self, model)
        post_init_from_model(self, model)

    return adapted_post_init_from_model


@contextmanager
def _scorer_replaced(press, stand_in):
    """`press` (a kvpress wrapper) scores with `stand_in` inside the block, its own scorer again after."""
    scorer = press.press
    press.press = stand_in
    try:
        yield
    finally:
        press.press = scorer


def _mark_count(module) -> int:
    marked = getattr(module, "masked_key_indices", None)
    return 0 if marked is None else len(marked[0])


def _count_marks(press: DMSPress, module, kwargs: dict, marked_before: int, padding: list[int] | None) -> None:
    """Record the marks this pass added on `module`'s layer and set ``press.compression_ratios`` from the counts: the
    fraction of the tokens cached that were removed, a padded prefill's padding (never marked) counted in neither."""
    hidden_states = kwargs["hidden_states"]
    new_tokens, layer_idx = hidden_states.shape[1], module.layer_idx
    prefilling = is_prefilling(kwargs["cache_position"], new_tokens)
    if not prefilling and not press.decoding:
        return  # DMSPress did nothing on this pass
    marks = press.__dict__.setdefault(_MARKS_ATTR, {})
    batch = hidden_states.shape[0]
    added_rows = module.masked_key_indices[0][marked_before:].cpu() if _mark_count(module) else torch.zeros(0).long()
    added = torch.bincount(added_rows, minlength=batch)
    tokens = int(kwargs["cache_position"][-1]) + 1
    if prefilling:
        rows_padding = torch.tensor(padding if padding is not None else [0] * batch)
        marks[layer_idx] = [added, tokens, rows_padding]
    else:
        marks[layer_idx][:2] = [marks[layer_idx][0] + added, tokens]
    kv_heads = module.config.num_key_value_heads
    if kv_head_shard(module) is None:
        count, tokens_cached, rows_padding = marks[layer_idx]
        press.compression_ratios[layer_idx] = int(count.sum()) / (kv_heads * _real_tokens(tokens_cached, rows_padding))
    elif layer_idx == module.config.num_hidden_layers - 1:  # every rank's marks, for every layer, once per pass
        layers = sorted(marks)
        counts = torch.tensor([[int(marks[layer][0].sum())] for layer in layers], device=hidden_states.device)
        totals = gather_kv_heads(counts, module, dim=-1).sum(-1).tolist()
        press.compression_ratios.update({layer: total / (kv_heads * _real_tokens(*marks[layer][1:]))
                                         for layer, total in zip(layers, totals)})


def _real_tokens(tokens: int, padding: torch.Tensor) -> int:
    """The tokens a batch's rows hold in `tokens` columns, their left padding left out."""
    return int(len(padding) * tokens - padding.sum())


def _refuse_scores_of_cut_tokens(press: DMSPress, module, kwargs: dict) -> None:
    """Raise if a decoding ``DMSPress`` runs a pass behind the tokens it has scored on this layer. Its score buffer
    holds the scores of the last ``sliding_window_size`` tokens it saw; after a cut (kvpress's pipeline between two
    questions on one context, a crop) they are scores of tokens no longer there, and its next marks land on other
    tokens, on either cache, or past a DynamicCache's end (an IndexError in kvpress's attention)."""
    positions = kwargs["cache_position"]
    if not press.decoding or is_prefilling(positions, kwargs["hidden_states"].shape[1]):
        return
    seen = press.__dict__.get(_MARKS_ATTR, {}).get(module.layer_idx)
    if seen is not None and int(positions[0]) < seen[1]:
        raise ValueError(f"DMSPress(decoding=True): a pass from position {int(positions[0])} on layer "
                         f"{module.layer_idx}, which it has scored up to position {seen[1] - 1}: the cache was cut "
                         f"back (kvpress's pipeline between two questions on one context, or a crop), and the press's "
                         f"score buffer still holds the tokens cut, so its marks would land on other tokens. Use "
                         f"decoding=False, or one question per context")


# On a cache layer: [(module, press)] whose marks and score buffers its batch methods take along; on a module or a
# press: the layer its marks (per layer index: score buffer) were last written for.
_ROW_FOLLOWERS_ATTR, _MARKED_FOR_ATTR, _BUFFERED_FOR_ATTR = (
    "_kvcomp_row_followers", "_kvcomp_marks_written_for", "_kvcomp_scores_buffered_for")


def _follow_batch_rows(press, module, kwargs: dict) -> None:
    """kvpress keeps what a head-wise press decided outside the cache: its marks on the attention module
    (``masked_key_indices``: batch, head and column of each) and DMSPress's scores of the last tokens of each layer
    (``scores_buffer``, (B, H, w)). A cache rearranging its batch (beam search's ``reorder_cache``,
    ``batch_repeat_interleave`` for num_return_sequences, ``batch_select_indices``) left both behind: each row's marks
    and scores then belonged to another sequence, or to none (the repeated rows ran unmasked). After a pass of `press`
    over `module`'s layer, that layer's batch methods take them along, for every press that marked it (a
    PrefillDecodingPress's two, a ComposedPress's), while the marks and scores are still this layer's."""
    cache = pass_cache(kwargs)
    if cache is None or module.layer_idx >= len(cache.layers):
        return
    layer = cache.layers[module.layer_idx]
    module.__dict__[_MARKED_FOR_ATTR] = UnsavedRef(layer)
    press.__dict__.setdefault(_BUFFERED_FOR_ATTR, {})[module.layer_idx] = UnsavedRef(layer)
    followers = [(m, p) for m, p in layer.__dict__.get(_ROW_FOLLOWERS_ATTR, []) if _alive(m) and _alive(p)]
    if not any(m() is module and p() is press for m, p in followers):
        followers.append((UnsavedRef(module), UnsavedRef(press)))
    layer.__dict__[_ROW_FOLLOWERS_ATTR] = followers
    for name in ROWS_KEPT:
        if not isinstance(layer.__dict__.get(name), MethodOf) or \
                layer.__dict__[name].function.func is not _rearranged_with_kvpress_rows:
            setattr(layer, name, MethodOf(functools.partial(_rearranged_with_kvpress_rows, name), layer))
    if isinstance(layer, DynamicLayer) and not isinstance(layer.__dict__.get("crop"), MethodOf):
        layer.crop = MethodOf(_cropped_with_kvpress_marks, layer)  # a paged layer evicted its marks before a cut


def _alive(reference) -> bool:
    """Whether an UnsavedRef still points somewhere (torch.load gives None for one, a dropped object a dead one)."""
    return reference is not None and reference() is not None


def _written_for(owner, layer, attr: str, layer_idx: int | None = None) -> bool:
    reference = owner.__dict__.get(attr) if layer_idx is None else owner.__dict__.get(attr, {}).get(layer_idx)
    return reference is not None and reference() is layer


def _rearranged_with_kvpress_rows(name: str, layer, argument) -> None:
    """`layer`'s batch method `name` (:func:`~kvpress_cpp.cache.rearrange_batch`), then the marks and score buffers
    its followers last wrote for it (see :func:`_follow_batch_rows`); a follower a saved cache lost (torch.load) or
    that wrote for another cache since is left alone."""
    keys = getattr(layer, "keys", None)
    batch = keys.shape[0] if isinstance(layer, DynamicLayer) and isinstance(keys, torch.Tensor) and keys.dim() == 4 \
        else None
    rearrange_batch(layer, name, argument)
    followers = _followers(layer)
    for module, press in followers:
        if not _written_for(press, layer, _BUFFERED_FOR_ATTR, module.layer_idx):
            continue
        buffers = getattr(press, "scores_buffer", None)
        if buffers and buffers.get(module.layer_idx) is not None:
            buffer = buffers[module.layer_idx]
            buffers[module.layer_idx] = buffer[ROWS_KEPT[name](buffer.shape[0], argument).to(buffer.device)]
        counts = press.__dict__.get(_MARKS_ATTR, {}).get(module.layer_idx)
        if counts is not None:  # each row's marks and padding, for the ratio
            rows = ROWS_KEPT[name](len(counts[2]), argument).cpu()
            counts[0], counts[2] = counts[0][rows], counts[2][rows]
    if batch is not None:  # a paged layer evicted its marks for real

        def rows_kept(marks):
            rows = ROWS_KEPT[name](batch, argument).to(marks[0].device)
            new_row, mark = (marks[0][None, :] == rows[:, None]).nonzero(as_tuple=True)
            return type(marks)((new_row, marks[1][mark], marks[2][mark]))

        _rewrite_marks(layer, followers, rows_kept)


def _cropped_with_kvpress_marks(layer, max_length: int, *args, **kwargs) -> None:
    """A DynamicLayer's ``crop``, then its followers' marks on the columns it cut dropped (and DMSPress's count of
    them): kvpress's attention wrapper read them as marks of the tokens appended there next, and hid those (an
    IndexError once the marks reached past the layer's end)."""
    type(layer).crop(layer, max_length, *args, **kwargs)
    width = layer.keys.shape[-2] if isinstance(layer.keys, torch.Tensor) and layer.keys.dim() == 4 else 0
    _rewrite_marks(layer, _followers(layer), lambda marks: type(marks)(indices[marks[2] < width] for indices in marks))


def _followers(layer) -> list:
    """The (attention module, press) pairs whose marks and score buffers follow `layer` (:func:`_follow_batch_rows`)."""
    return [(m(), p()) for m, p in layer.__dict__.get(_ROW_FOLLOWERS_ATTR, []) if _alive(m) and _alive(p)]


def _rewrite_marks(layer, followers: list, rewrite) -> None:
    """Each follower module's marks, once whichever presses left them, replaced by ``rewrite(marks)`` where they were
    written for `layer`, and DMSPress's count of each row's marks with them (a crop's; a rearrangement has moved the
    counts with the rows already)."""
    for module in {id(module): module for module, _ in followers}.values():
        marks = getattr(module, "masked_key_indices", None)
        if marks is None or not _written_for(module, layer, _MARKED_FOR_ATTR):
            continue
        module.masked_key_indices = rewritten = rewrite(marks)
        for _, press in followers:
            counts = press.__dict__.get(_MARKS_ATTR, {}).get(module.layer_idx)
            if counts is not None and torch.equal(counts[0], torch.bincount(marks[0].cpu(), minlength=len(counts[0]))):
                counts[0] = torch.bincount(rewritten[0].cpu(), minlength=len(counts[0]))  # every mark its own


def patch_dms_press() -> None:
    """Wrap ``DMSPress.forward_hook`` and ``DMSPress.post_init_from_model`` (see the module). Idempotent."""
    _adapt(DMSPress, "forward_hook", _dms_forward_hook)
    _adapt(DMSPress, "post_init_from_model", _refusing_unshardable_scorers)


def _dms_forward_hook(forward_hook):
    def adapted_forward_hook(self, module, input, kwargs, output):
        _refuse_scores_of_cut_tokens(self, module, kwargs)
        marked_before = _mark_count(module)
        padding = _prefill_padding(kwargs)
        stand_in = _ScorerStandIn(self.press) if padding is None else _RowByRowScorer(self.press, padding)
        with _scorer_replaced(self, stand_in), _naming_our_slots(self, module, kwargs):
            output = forward_hook(self, module, input, kwargs, output)
        _count_marks(self, module, kwargs, marked_before, padding)
        _follow_batch_rows(self, module, kwargs)
        return output

    return adapted_forward_hook


def _marked_columns_to_positions(press, module, kwargs: dict, keys: torch.Tensor) -> None:
    """AdaKVPress (and CriticalAdaKVPress) mark columns of the keys they scored, which kvpress's own cache holds from
    position 0 on. A paged layer evicts marks as token positions: those of the slots its view shows at the marked
    columns (:meth:`PagedLayer.view_positions`; a hole's marks, which evict nothing, are dropped). Marks on slots
    whose positions the layer does not know (a kvpress press before selected them its own way) are refused."""
    layer = pass_paged_layer(module, kwargs)
    marks = module.masked_key_indices
    positions = layer.view_positions(keys) if layer is not None and marks is not None else None
    if positions is None:
        return
    batch, head, column = marks
    on_host = batch.cpu(), head.cpu(), column.cpu()
    marked = positions[on_host]
    holes = layer.view_holes(keys)
    unknown = (marked < 0) if holes is None else (marked < 0) & ~holes.cpu()[on_host]
    if bool(unknown.any()):
        raise RuntimeError(f"{type(press).__name__} marked {int(unknown.sum())} slots of layer {module.layer_idx} of a "
                           f"PagedKVCache whose token positions it does not know, by which it evicts marks: a kvpress "
                           f"press before it selected them its own way (ChunkPress, KeyRerotationPress, ...). Use a "
                           f"DynamicCache, or a ScorerPress's own selection before it")
    held = marked >= 0
    module.masked_key_indices = (batch[held.to(batch.device)], head[held.to(head.device)],
                                 marked[held].to(column.device))


def _view_holes(module, kwargs: dict, keys: torch.Tensor) -> tuple[PagedLayer | None, torch.Tensor | None]:
    """The paged layer of `module` in this pass, and the holes of its view when `keys` are the view's keys
    (:meth:`PagedLayer.view_holes`); (None, None) on any other cache. A kvpress scorer scores those columns' zeros as
    tokens (the top score for Knorm, a sink for attention scores), where kvpress's own cache has no such columns."""
    layer = pass_paged_layer(module, kwargs)
    return layer, None if layer is None else layer.view_holes(keys)


def patch_adakv_press() -> None:
    """Wrap ``AdaKVPress.compress`` and ``AdaKVPress.post_init_from_model`` (see the module), and
    ``CriticalAdaKVPress.compress`` (:func:`_marks_read_through_the_view`). Idempotent."""
    _adapt(AdaKVPress, "compress", _adakv_compress)
    _adapt(AdaKVPress, "post_init_from_model", _refusing_unshardable_scorers)
    _adapt(CriticalAdaKVPress, "compress", _marks_read_through_the_view)


def _adakv_compress(compress):
    def adapted_compress(self, module, hidden_states, keys, values, attentions, kwargs):
        shard = kv_head_shard(module)
        holes = _view_holes(module, kwargs, keys)[1]
        if self.compression_ratio == 0 or (shard is None and holes is None):  # kvpress marks nothing at ratio 0
            keys, values = compress(self, module, hidden_states, keys, values, attentions, kwargs)
        elif shard is None:
            with _scorer_replaced(self, _ScorerStandIn(self.press, holes)):
                keys, values = compress(self, module, hidden_states, keys, values, attentions, kwargs)
        else:
            with _scorer_replaced(self, _AllRanksScorer(self.press, holes)):
                keys, values = compress(self, module, hidden_states, keys, values, attentions, kwargs)
            batch, head, position = module.masked_key_indices  # the model's heads
            own = (head >= shard[0]) & (head < shard[1])
            module.masked_key_indices = (batch[own.to(batch.device)], head[own] - shard[0], position[own])
        _marked_columns_to_positions(self, module, kwargs, keys)
        _follow_batch_rows(self, module, kwargs)
        return keys, values

    return adapted_compress


def _marks_read_through_the_view(compress):
    """A head-wise press's ``compress`` whose marks, columns of the keys it scored, a paged layer then evicts as the
    tokens those columns show (:func:`_marked_columns_to_positions`). Its scorer scores the holes of the view as
    tokens (CriticalAdaKVPress weighs scores by the values' norms, which are 0 there): they take no token's place, as
    its marks on them evict nothing, but they take some of its budget."""

    def adapted_compress(self, module, hidden_states, keys, values, attentions, kwargs):
        keys, values = compress(self, module, hidden_states, keys, values, attentions, kwargs)
        _marked_columns_to_positions(self, module, kwargs, keys)
        _follow_batch_rows(self, module, kwargs)
        return keys, values

    return adapted_compress


def patch_scorer_press() -> None:
    """Wrap ``SnapKVPress.score`` (the rank's heads on a tensor-parallel rank, :func:`_scoring_the_rank_heads`), and
    ``ScorerPress.compress`` and ``PyramidKVPress.compress`` (its per-layer budget) for a paged layer: kvpress's
    selection of each head's best-scored columns, with the holes of the view (:func:`_view_holes`) scored -inf so
    that a head keeps its tokens first, and the layer told which columns it took: it drops the holes among them
    (taken where a head holds fewer tokens than the slots kept) and keeps the tokens' positions, which later
    head-wise marks are read by. Anywhere else kvpress's own ``compress`` runs. Idempotent."""
    _adapt(SnapKVPress, "score", _scoring_the_rank_heads)
    _adapt(ScorerPress, "compress", lambda compress: _selecting_on_paged_layers(
        compress, lambda press, module, k_len: compute_n_kept(k_len, press.compression_ratio)))
    _adapt(PyramidKVPress, "compress", lambda compress: _selecting_on_paged_layers(
        compress, lambda press, module, k_len: press.get_layer_budget(module, k_len)))


def _selecting_on_paged_layers(compress, kept_count):
    """`compress`, kvpress's selection of the `kept_count(press, module, k_len)` best-scored columns of each head, made
    again on a paged layer with its holes scored -inf, and the columns taken handed to the layer (select_columns)."""

    def adapted_compress(self, module, hidden_states, keys, values, attentions, kwargs):
        layer, holes = _view_holes(module, kwargs, keys)
        if layer is None or self.compression_ratio == 0:
            return compress(self, module, hidden_states, keys, values, attentions, kwargs)
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        scores = scores if holes is None else scores.masked_fill(holes, float("-inf"))
        kept = scores.topk(kept_count(self, module, keys.shape[2]), dim=-1).indices
        index = kept.unsqueeze(-1)
        kept_keys = keys.gather(2, index.expand(-1, -1, -1, keys.shape[-1])).contiguous()
        layer.select_columns(keys, kept, kept_keys)
        return kept_keys, values.gather(2, index.expand(-1, -1, -1, values.shape[-1])).contiguous()

    return adapted_compress


def _ours_inside(wrapper) -> list[KVCompPress]:
    """The presses of ours a kvpress wrapper runs through its forward hook, nested wrappers included. Our own
    decoding presses are PrefillDecodingPresses too, with neither field set: they open their context themselves."""
    inner = None if isinstance(wrapper, KVCompPress) else _presses_held(wrapper, CONTEXT_WRAPPERS)
    if inner is None:
        return []
    found = [press for press in inner if isinstance(press, KVCompPress)] + [
        ours for press in inner if not isinstance(press, KVCompPress) for ours in _ours_inside(press)]
    return list({id(press): press for press in found}.values())  # one press given for both phases: one context


def patch_wrapper_contexts() -> None:
    """Wrap ``ComposedPress.__call__`` and ``PrefillDecodingPress.__call__`` so that they also open the context of each
    press of ours they hold (:meth:`KVCompPress.context_under`). kvpress's wrappers enter only their own context: ours
    then never counted the positions its cache stands for, so a hand-written decoding loop placed new tokens at the
    slot count (rotated as the wrong positions) and a second ``generate`` fed the context again, silently, where the
    bare press refuses it. Idempotent."""
    for wrapper in CONTEXT_WRAPPERS:
        _adapt(wrapper, "__call__", _with_our_contexts)


def _with_our_contexts(call):
    @contextmanager
    def adapted_call(self, model):
        with call(self, model), ExitStack() as contexts:
            for press in _ours_inside(self):
                contexts.enter_context(press.context_under(self, model))
            yield

    return adapted_call


class _LayerTypeRotary(nn.Module):
    """A decoder's rotary embedding holding a table per layer type (transformers 5's Gemma 3), bound to one layer's
    type, as kvpress's presses use a layer's ``rotary_emb``: called with ``(x, position_ids)``, and ``inv_freq``."""

    def __init__(self, rotary: nn.Module, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self._shared = (rotary,)  # not a submodule: the decoder holds it (its device, its state_dict)

    @property
    def inv_freq(self) -> torch.Tensor:
        return getattr(self._shared[0], f"{self.layer_type}_inv_freq")

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._shared[0](x, position_ids, layer_type or self.layer_type)

    def extra_repr(self) -> str:
        return f"layer_type={self.layer_type!r}"


def give_layers_their_rotary(model) -> None:
    """kvpress gives every layer it hooks the decoder's ``rotary_emb``: KeyRerotationPress re-rotates kept keys with
    its ``inv_freq``, ExpectedAttention (and GVote) turn queries with it. Gemma 3's sliding layers turn with another
    base: under transformers 4 with the decoder's ``rotary_emb_local``, which those presses missed (kept keys
    re-rotated at the global base, silently); from 5 one module holds a table per layer type and wants the layer's
    type, for want of which they failed. Each layer kvpress gave the shared one now gets the one it turns with."""
    decoder = hooked_decoder(model)
    shared = getattr(decoder, "rotary_emb", None)
    if not isinstance(shared, nn.Module):
        return
    local = getattr(decoder, "rotary_emb_local", None)
    layer_types = getattr(getattr(decoder, "config", None), "layer_types", None)
    typed = layer_types is not None and "layer_type" in inspect.signature(shared.forward).parameters
    for layer in getattr(decoder, "layers", ()):
        attention = getattr(layer, "self_attn", None)
        if attention is None or attention._modules.get("rotary_emb") is not shared:
            continue
        if typed:
            layer_type = layer_types[attention.layer_idx]
            # The one of the layer's earlier contexts, kept: a module of its own each time would make torch.compile's
            # guards on it fail at every context.
            bound = attention.__dict__.get(_LAYER_ROTARY_ATTR)
            if bound is None or bound._shared[0] is not shared or bound.layer_type != layer_type:
                bound = attention.__dict__[_LAYER_ROTARY_ATTR] = _LayerTypeRotary(shared, layer_type)
            attention.rotary_emb = bound
        elif local is not None and getattr(attention, "is_sliding", False):
            attention.rotary_emb = local


def patch_press_contexts() -> None:
    """Wrap ``BasePress.__call__``, the context every kvpress press (and wrapper) registers its forward hook in, so that
    a press that cannot run on a model splitting its kv heads over tensor-parallel ranks is refused there
    (:func:`refuse_unshardable_presses`; also where KVzip's family and KVCompose enter their own context instead), that
    each hooked layer's ``rotary_emb`` is the one it turns with (:func:`give_layers_their_rotary`), and that a
    ``KeyError('cache_position')`` out of a pass inside it is raised as a RuntimeError naming the press and why the
    attention was not given it (transformers outside the range kvpress declares). kvpress's hooks read it on every pass;
    ours do not, so ours alone or composed only with ours still run there, and our context lets the error through to the
    kvpress press around it. Idempotent; before :func:`patch_wrapper_contexts`, whose ``ComposedPress.__call__`` is this
    one."""
    _adapt(BasePress, "__call__", _adapted_press_context, marker=_PRESS_CONTEXT_ATTR)
    for own_context in (KVzipPress, KVComposePress, FastKVzipPress):
        _adapt(own_context, "__call__", _refusing_unshardable_presses)


#: Why :func:`refuse_unshardable_presses` refuses a press.
_UNSHARDABLE = (f"it is not known to compress each kv head from that head's own queries and keys, all a rank holds; "
                f"use {', '.join(cls.__name__ for cls in SHARDABLE_SCORERS)} (alone, or in kvpress's AdaKVPress, "
                f"DMSPress, {', '.join(cls.__name__ for cls in HEAD_WISE_WRAPPERS)}), or kvpress_cpp's presses")


def refuse_unshardable_presses(press, model) -> None:
    """Raise a ValueError naming the kvpress press `press` holds (itself, or inside :data:`HEAD_WISE_WRAPPERS`) that
    cannot run on `model` where it splits its kv heads over tensor-parallel ranks. A rank holds its heads only;
    kvpress's presses are written for one process holding them all. They run sharded where each kv head is scored
    from that head's own queries and keys (:data:`SHARDABLE_SCORERS`); ours, ``AdaKVPress`` and ``DMSPress`` check
    themselves (their scorers included) when they set up on the model."""
    if isinstance(press, (KVCompPress, AdaKVPress, DMSPress)):
        return
    held = _presses_held(press, HEAD_WISE_WRAPPERS)
    if held is None:
        check_tensor_parallel(type(press).__name__, model,
                              None if isinstance(press, SHARDABLE_SCORERS) else _UNSHARDABLE)
        return
    for inner in held:
        refuse_unshardable_presses(inner, model)


def _refusing_unshardable_presses(call):
    """The context of a kvpress press whose ``__call__`` does not enter ``BasePress.__call__`` (KVzip's family),
    refusing it first on a model splitting its kv heads (:func:`refuse_unshardable_presses`)."""

    @contextmanager
    def adapted_call(self, model):
        refuse_unshardable_presses(self, model)
        with call(self, model):
            yield

    return adapted_call


def _adapted_press_context(call):
    @contextmanager
    def adapted_call(self, model):
        refuse_unshardable_presses(self, model)
        try:
            with call(self, model):
                give_layers_their_rotary(model)
                yield
        except KeyError as error:
            if not _missing_cache_position(error) or isinstance(self, KVCompPress):
                raise
            why = kvpress_transformers_mismatch() or "a model or transformers that does not pass it"
            raise RuntimeError(f"{type(self).__name__}: kvpress's hooks read each pass's cache_position, and its cache "
                               f"as past_key_values, neither of which the model's attention was given: "
                               f"{why}") from error

    return adapted_call


def _missing_cache_position(error: Exception) -> bool:
    """kvpress 0.5.5's hook reading a keyword the attention no longer gets: cache_position (transformers 5.17 on), or
    past_key_values, which it reads first (transformers 5.24 on pass the cache as `cache`)."""
    return isinstance(error, KeyError) and error.args in (("cache_position",), ("past_key_values",))


@contextmanager
def _naming_our_slots(press, module, kwargs: dict):
    """Raise what fails inside a kvpress press's prefill hook, on a layer one of ours (before it in a ComposedPress)
    compressed in this pass, as a RuntimeError naming both: the kvpress press reads our slots as the prompt's tokens,
    and SnapKV's window (say) over fewer slots than it fails in a torch shape error that names neither. What does not
    fail there is refused at the next pass (:func:`kvpress_cpp.cache.slots_rearranged_error`)."""
    try:
        yield
    except Exception as error:
        cache, hidden_states = pass_cache(kwargs), kwargs.get("hidden_states")
        layer = cache.layers[module.layer_idx] if cache is not None and hidden_states is not None else None
        state = get_state(layer) if layer is not None and layer.keys is not None else None
        if (isinstance(press, KVCompPress) or _missing_cache_position(error) or state is None
                or layer.keys.shape[-2] >= hidden_states.shape[1]):
            raise
        owner, name = state.owner_name(), type(press).__name__
        raise RuntimeError(f"{name} failed on layer {module.layer_idx}, where {owner} before it (in a ComposedPress) "
                           f"left {layer.keys.shape[-2]} slots of the pass's {hidden_states.shape[1]} tokens: a "
                           f"kvpress press after one of ours reads our slots as the prompt's tokens "
                           f"({type(error).__name__}: {error}). Place {owner} last, or alone") from error


def patch_presses_after_ours() -> None:
    """Wrap ``BasePress.forward_hook``, the prefill hook of kvpress's scorer presses, in :func:`_naming_our_slots`
    (``DMSPress``'s own hook is wrapped in :func:`patch_dms_press`). Idempotent."""
    _adapt(BasePress, "forward_hook", _naming_our_slots_in_the_hook)


def _naming_our_slots_in_the_hook(forward_hook):
    def adapted_forward_hook(self, module, input, kwargs, output):
        with _naming_our_slots(self, module, kwargs):
            output = forward_hook(self, module, input, kwargs, output)
        layer = pass_paged_layer(module, kwargs)
        if layer is not None and not isinstance(self, KVCompPress):
            layer.refuse_unknown_selection(type(self).__name__, module.layer_idx)
        return output

    return adapted_forward_hook


def patch_wrapper_placements() -> None:
    """Wrap ``PrefillDecodingPress.__call__``, ``BlockPress.post_init_from_model`` and ``BlockPress.compress`` so that
    presses placed where kvpress's wrapper cannot run them are refused naming both, where kvpress compressed nothing,
    scored other tokens, or stopped on an AttributeError or a shape error:

    * ``PrefillDecodingPress``'s ``decoding_press`` must be a decoding press (it calls its ``reset()``): a scorer
      there compressed nothing while decoding and failed at the end ("no attribute 'reset'").
    * ``BlockPress`` splices each block's hidden states across kv heads (a head's slice of the hidden size from its own
      kept tokens), so a scorer that reads each token's whole hidden state (KVzap) scored states of no token.
    * ``BlockPress`` on a paged layer that dropped the padding every row of the prompt starts with: its hidden states
      no longer line up with the layer's keys.
    * kvpress's :data:`SCORER_WRAPPERS` around a press of ours that is no ScorerPress: kvpress asserts it, with a
      bare ``AssertionError`` for KeyRerotationPress and none at all under ``python -O``.

    Idempotent."""
    for wrapper, argument in SCORER_WRAPPERS.items():
        _adapt(wrapper, "__init__", functools.partial(_refusing_our_presses_in, argument=argument),
               marker=_PLACEMENT_ATTR)
    _adapt(PrefillDecodingPress, "__call__", _refusing_non_decoding_presses, marker=_PLACEMENT_ATTR)
    _adapt(BlockPress, "post_init_from_model", _refusing_hidden_state_scorers)
    _adapt(BlockPress, "compress", _refusing_dropped_padding)


def _refusing_our_presses_in(init, argument: str):
    """A scorer wrapper's ``__init__``, refusing first a press of ours that is no ScorerPress (all but KVzapPress)."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def adapted_init(self, *args, **kwargs):
        press = signature.bind_partial(self, *args, **kwargs).arguments.get(argument)
        if isinstance(press, KVCompPress) and not isinstance(press, ScorerPress):
            wrapper, name = type(self).__name__, type(press).__name__
            raise ValueError(f"{wrapper}: its {argument} {name} is a kvpress_cpp press, not a kvpress ScorerPress: "
                             f"{wrapper} re-ranks the tokens a ScorerPress scores, and {name} chooses, merges and "
                             f"weighs its slots itself. Use {name} alone (it compresses the prompt"
                             f"{' and every decoding step' if isinstance(press, KVCompDecodingPress) else ''}), or "
                             f"wrap kvpress_cpp's KVzapPress, which is a ScorerPress")
        init(self, *args, **kwargs)

    return adapted_init


def _refusing_non_decoding_presses(call):
    """PrefillDecodingPress's context, refusing first a ``decoding_press`` that is no decoding press (before kvpress's
    context, whose ``finally`` calls its ``reset()`` and would raise an AttributeError over the refusal)."""

    @contextmanager
    def adapted_call(self, model):
        press = self.decoding_press
        if press is not None and not callable(getattr(press, "reset", None)):
            name = type(press).__name__
            raise ValueError(f"PrefillDecodingPress: its decoding_press {name} is not a decoding press (kvpress's "
                             f"DecodingPress, or one of kvpress_cpp's): it compresses nothing while decoding, and has "
                             f"no reset() for PrefillDecodingPress to call. Wrap it in kvpress's DecodingPress, or use "
                             f"a press that compresses while decoding (for KVzap: DMSPress({name}(...), "
                             f"decoding=True) or kvpress_cpp's KVzapThresholdPress)")
        with call(self, model):
            yield

    return adapted_call


def _refusing_hidden_state_scorers(post_init_from_model):
    def adapted_post_init_from_model(self, model):
        if isinstance(self.press, KVzapScorer):
            raise ValueError(f"BlockPress: its scorer {type(self.press).__name__} scores each token from its whole "
                             f"hidden state, which BlockPress splices across kv heads after the first block (each "
                             f"head's slice from its own kept tokens): it would score the states of no token. Use "
                             f"{type(self.press).__name__} alone, whose selection over the whole prompt BlockPress's "
                             f"blocks stand in for")
        post_init_from_model(self, model)

    return adapted_post_init_from_model


def _refusing_dropped_padding(compress):
    def adapted_compress(self, module, hidden_states, keys, values, attentions, kwargs):
        dropped = shared_padding_dropped(module, kwargs)
        if dropped and self.compression_ratio:
            raise RuntimeError(f"BlockPress: layer {module.layer_idx}'s PagedKVCache holds no slots for the {dropped} "
                               f"columns of padding every row of this batch starts with, so BlockPress's hidden states "
                               f"({hidden_states.shape[1]} tokens) do not line up with its keys ({keys.shape[2]}). Use "
                               f"a DynamicCache for BlockPress on a padded batch, or a batch without shared padding")
        return compress(self, module, hidden_states, keys, values, attentions, kwargs)

    return adapted_compress


def patch_pipeline_questions() -> None:
    """Wrap ``KVPressTextGenerationPipeline._forward`` so that several questions with a press of ours that compresses
    while decoding are refused naming the press and why: kvpress refuses them as "DecodingPress is not compatible",
    which names neither. Idempotent."""
    _adapt(KVPressTextGenerationPipeline, "_forward", _one_question_for_decoding_presses)


def _one_question_for_decoding_presses(forward):
    def adapted_forward(self, input_tensors, *args, **kwargs):
        press, questions = kwargs.get("press"), len(input_tensors["questions_ids"])  # transformers passes by keyword
        if isinstance(press, KVCompDecodingPress) and questions > 1:
            name = type(press).__name__
            raise ValueError(f"{name}: compresses while decoding, so after answering a question the cache no longer "
                             f"holds the context as compressed, and kvpress's pipeline cuts each answer off to ask the "
                             f"next question on that context: the pipeline takes one question with {name} (got "
                             f"{questions}). Ask one question per call, or several with a press that compresses the "
                             f"prompt only (ComposedPress([{name}(...)]), GVotePress, kvpress's)")
        return forward(self, input_tensors, *args, **kwargs)

    return adapted_forward


patch_dms_press()
patch_adakv_press()
patch_scorer_press()
patch_press_contexts()
patch_wrapper_contexts()
patch_presses_after_ours()
patch_wrapper_placements()
patch_pipeline_questions()
