"""The attention path that honours per-slot log-weights, whatever attention implementation the model runs.

A layer of a :class:`~kvpress_cpp.paged_cache.PagedKVCache` is always attended through
``kvcomp::paged_decode_attention``, which reads each head's own slots through its block table.

Every forward that attends to a cache layer with state (see :mod:`kvpress_cpp.cache`) computes
``softmax(q·k·scale + b)·v`` with the layer's log-weights b added for every query head of the group and the causal
mask over the new tokens, through ``kvcomp::decode_attention`` (GQA-native: keys are never repeated). transformers'
attention mask is not used there: it is built once for all layers from layer 0's length, which no longer matches
layers compacted to different lengths. Padding is folded into b instead, as -inf, when the press writes the state at
prefill (:func:`padding_log_weights`); padding in a later pass is refused by the press (:func:`new_token_padding`),
and hidden by a paged layer no press compressed, whose columns transformers' mask still describes. A press that scores
the prompt tells a layer's sdpa prompt pass (no padding) the weights it scores with (:func:`request_prefill_scores`).
On CPU the pass then runs
``kvcomp::prompt_attention_with_scores``, which computes the attention output, its log-sum-exp and the press's scores
from one QKᵀ (SmolLM2 layer, one thread, T = 8k: 0.69 s against 1.32 s for sdpa + ``prompt_scores``, and faster than
sdpa alone), and keeps them for the press. Where that op's workspace would pass
:data:`~kvpress_cpp.ops.FUSED_PROMPT_WORKSPACE_LIMIT` (a long prompt), the pass runs ATen's flash kernel, which
returns the log-sum-exp for free, and keeps it with the queries, so that ``kvcomp::prompt_scores`` skips its own first
pass. On CUDA it runs cuDNN's attention, which returns the log-sum-exp beside the output at sdpa's cost, and keeps
it with the queries likewise (half precision; float32 runs the layer's own attention and the op's first pass). The
path over a layer with state returns the attention probabilities as the attention weights, so a press's forward hook
gets them without a second pass over the keys. Forwards over layers without state call the original function unchanged.

transformers dispatches sdpa / flash attention through ``ALL_ATTENTION_FUNCTIONS`` and eager attention through the
module-level ``eager_attention_forward`` of each model file: both are wrapped, once. kvpress wraps the same registry
for its head-wise masking when it is imported; this module imports it first, so that its own wrapper is always the
outer one whatever the user imports first: a paged layer's pools must reach the paged path, never kvpress's masking,
which writes its masked slots into the keys it is handed.
"""

from __future__ import annotations

import functools
import sys
from typing import NamedTuple

import kvpress  # noqa: F401  (wraps ALL_ATTENTION_FUNCTIONS at import: before this module does, see above)
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_cpp import ops
from kvpress_cpp.cache import (attached_layer, get_state, head_wise_marks_error, in_one_dtype, state_for_attention,
                               tokens_held_at_close)
from kvpress_cpp.paged_cache import PagedLayer, paged_layer_of, settle_marks

__all__ = ["PrefillAttention", "patch_attention_functions", "patch_eager_attention", "padding_log_weights",
           "request_prefill_scores", "take_decode_query", "take_prefill_attention", "count_hook_without_probabilities",
           "active_presses", "mark_press_active", "patch_loaded_eager_attention", "set_positions_end",
           "tokens_fed_again_error", "take_prompt_last_query"]

_WRAPPED_ATTR = "_kvcomp_wrapped"
_DECODE_QUERY_ATTR = "_kvcomp_decode_query"
_ACTIVE_PRESSES_ATTR = "_kvcomp_active_presses"
_POSITIONS_END_ATTR = "_kvcomp_positions_end"
_PROMPT_LAST_QUERY_ATTR = "_kvcomp_prompt_last_query"
_HELD_PASS_ATTR = "_kvcomp_held_pass"


def padding_log_weights(attention_mask: torch.Tensor | None, batch: int, kv_heads: int, total: int,
                        device: torch.device) -> torch.Tensor:
    """Log-weights (B, H, T) of a prefill: 0 for tokens, -inf for padding, read from transformers' mask.

    The last query row of a 4-D mask (eager: additive float, sdpa: bool) sees every slot that is not padding;
    flash attention passes a (B, T) 0/1 mask; no mask means no padding.
    """
    log_weights = torch.zeros(batch, kv_heads, total, dtype=torch.float32, device=device)
    if attention_mask is None:
        return log_weights
    row = attention_mask[:, 0, -1, :total] if attention_mask.dim() == 4 else attention_mask[:, :total]
    visible = _visible(row, attention_mask.dim() == 4)
    return log_weights.masked_fill(~visible.unsqueeze(1).to(device), float("-inf"))


def new_token_padding(attention_mask: torch.Tensor | None, new_tokens: int) -> torch.Tensor | None:
    """(B, q) bool: the new tokens of a later pass that transformers' mask hides as padding (a batched next turn whose
    rows differ in length is padded inside the sequence), or None where it hides none. A 4-D mask is read at each new
    token's own row and column, which a causal or sliding-window mask always shows."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 4 and attention_mask.shape[-2] == new_tokens:
        own = attention_mask[:, 0].diagonal(offset=attention_mask.shape[-1] - new_tokens, dim1=-2, dim2=-1)
    else:
        own = attention_mask[:, 0, -1, -new_tokens:] if attention_mask.dim() == 4 else attention_mask[:, -new_tokens:]
    padding = ~_visible(own, attention_mask.dim() == 4)
    return padding if bool(padding.any()) else None


def _visible(mask: torch.Tensor, four_d: bool) -> torch.Tensor:
    """Where entries of transformers' mask let a query see a key: sdpa's bool mask as it is, eager's additive float
    mask where 0 (a very negative value elsewhere), flash attention's (B, T) 0/1 padding mask where 1."""
    if mask.dtype == torch.bool:
        return mask
    return mask == 0 if four_d else mask != 0


def padding_after_prefill_error(user: str, padding: torch.Tensor) -> ValueError:
    rows = padding.any(-1).nonzero().flatten().tolist()
    return ValueError(f"{user}: the attention mask hides {int(padding.sum())} of this pass's {padding.shape[-1]} new "
                      f"tokens in batch rows {rows} (padding after the prompt: a batched next turn or question whose "
                      f"rows differ in length). Over a cache a press compressed or keeps state for, padding is read "
                      f"at prefill only: these tokens would be attended, and decoded by the press, as text. Run those "
                      f"rows one at a time, or give every row's new tokens one length")


class PrefillAttention(NamedTuple):
    """What a layer's prompt pass kept for its press: the queries (B, Hq, T, d) post-RoPE and the log-sum-exp
    (B, Hq, T) float32 of their rows; with the fused op, also the scores (B, H, T) float32 of all T queries under
    ``weights`` = (decay, input_scale) (see :func:`kvpress_cpp.ops.prompt_scores`), else None."""
    queries: torch.Tensor
    log_sum_exp: torch.Tensor
    scores: torch.Tensor | None
    weights: tuple[float, float] | None


def request_prefill_scores(module: torch.nn.Module, weights: tuple[float, float] | None) -> None:
    """Ask the sdpa prompt pass of `module` to keep what its press needs to score the prompt with the query weights
    ``(decay, input_scale)`` (see :func:`take_prefill_attention`); None: keep nothing."""
    module._kvcomp_prompt_score_weights = weights
    module._kvcomp_prefill_attention = None


def active_presses(module: torch.nn.Module) -> list[str]:
    """The kvpress_cpp presses whose context is open on `module`, innermost last."""
    return list(module.__dict__.get(_ACTIVE_PRESSES_ATTR, ()))


def mark_press_active(module: torch.nn.Module, name: str, active: bool) -> None:
    """Record that press `name` hooks `module` (active) or no longer does: the attention path then refuses the
    attention variants it cannot apply (:func:`_refuse_unsupported_variant`) from the prompt pass on."""
    names = module.__dict__.setdefault(_ACTIVE_PRESSES_ATTR, [])
    names.append(name) if active else names.remove(name)


def set_positions_end(module: torch.nn.Module, end: int) -> None:
    """The tokens the cache stands for once the pass now starting is done (its press counts them): what a sliding
    window is compared with, where a compressed layer's length says nothing of it."""
    module.__dict__[_POSITIONS_END_ATTR] = end


def tokens_fed_again_error(user: str, new_tokens: int, first: int, processed: int, slots: int,
                           note: str = "") -> ValueError:
    return ValueError(
        f"{user}: this pass feeds {new_tokens} tokens from position {first}, but the cache already holds the tokens "
        f"up to position {processed - 1}, compressed to {slots} slots. `generate` resumes a cache from "
        f"get_seq_length(), which counts a compressed cache's slots, not its tokens, so a second generate call on it "
        f"feeds {processed - first} tokens again. Continue a compressed cache with forwards of the new tokens only, "
        f"at positions {processed} on (position_ids), or use kvpress's pipeline for several questions on one "
        f"context (with a press that compresses the prompt only: the pipeline takes one question with a press that "
        f"also compresses while decoding){note}")


def positions_behind_the_cache_error(user: str, new_tokens: int, first: int, held: int) -> ValueError:
    return ValueError(
        f"{user}: this pass's {new_tokens} tokens start at position {first}, but the cache holds {held} tokens, none "
        f"compressed, so the next position is {held}: the pass's positions count {held - first} token(s) fewer than "
        f"the cache holds. `generate` derives positions from the attention mask, and when it is given none it infers "
        f"one from pad_token_id: a pad id among the ids already in the cache (one an earlier turn generated, say) is "
        f"then taken for padding. Pass generate the attention mask of the whole sequence (ones where the tokens are "
        f"real), or continue with forwards at positions {held} on (position_ids)")


def _refuse_tokens_fed_again(layer, query: torch.Tensor, kwargs: dict) -> None:
    """Outside any press, over a layer holding a press's state (this pass's tokens appended): raise if a pass of
    several tokens starts before the tokens the layer stands for (a second ``generate`` on the cache once the press's
    context closed), after taking the pass's tokens back off the layer, so that the cache can still be continued as
    the message advises. One-token passes are not read, so a decoding step waits on nothing and does no more work."""
    new_tokens, positions = query.shape[-2], kwargs.get("position_ids")
    resume_point = tokens_held_at_close(layer) if layer is not None else None
    if new_tokens == 1 or resume_point is None or positions is None:
        return
    tokens, slots_then = resume_point
    slots = layer.get_seq_length() - new_tokens
    processed = tokens + slots - slots_then
    first = int(positions.reshape(-1, positions.shape[-1])[:, 0].max())
    if first < processed:
        state = get_state(layer)
        owner = state.owner_name() if state is not None else "a kvpress_cpp press"
        layer.crop(-new_tokens)  # the one argument every transformers version reads alike
        if slots == processed:  # generate resumed after every token held: the positions, not the tokens, are off
            raise positions_behind_the_cache_error(f"{owner} (its context closed)", new_tokens, first, processed)
        raise tokens_fed_again_error(f"{owner} (its context closed)", new_tokens, first, processed, slots)


# Keyword arguments with which a model's attention function applies something the attention over a compressed or
# paged layer (decode_attention, paged_decode_attention) does not: soft-capped logits, gpt-oss's per-head sink
# logits, and a sliding window once the sequence is longer than it. The prompt pass would run them, and every later
# pass would silently drop them.
_UNSUPPORTED_VARIANTS = ("sliding_window", "softcap", "s_aux")


def _refuse_unsupported_variant(module: torch.nn.Module, kwargs: dict, user: str, tokens) -> None:
    """Raise if this call applies a variant the paths over compressed or paged layers drop; a sliding window only
    where the tokens the cache stands for (`tokens()`, asked only then) reach past it."""
    for name in _UNSUPPORTED_VARIANTS:
        value = kwargs.get(name)
        if value is None:
            continue
        if name == "sliding_window":
            tokens = tokens()
            if tokens <= value:
                continue
        shown = f"a {name} tensor" if isinstance(value, torch.Tensor) else f"{name}={value!r}"
        raise ValueError(
            f"{user}: layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__}) runs its attention with "
            f"{shown}{f' over {tokens} tokens' if name == 'sliding_window' else ''}, which kvpress_cpp's attention over "
            f"a compressed or paged cache does not apply (it attends to every slot held with plain logits), so the "
            f"model's outputs would silently change. Soft-capped and sink-logit attention layers are not supported, "
            f"nor sliding-window layers over sequences longer than their window")


def count_hook_without_probabilities(module: torch.nn.Module, change: int) -> None:
    """A press whose forward hook on `module` never reads the attention's probabilities counts itself in (+1) when its
    context opens and out (-1) when it closes: a pass over a paged layer maps them to the view only for other hooks."""
    module._kvcomp_hooks_without_probs = getattr(module, "_kvcomp_hooks_without_probs", 0) + change


def take_prefill_attention(module: torch.nn.Module, prompt_length: int) -> PrefillAttention | None:
    """What the prompt forward of `prompt_length` tokens that just ran on `module` kept, if it did; None otherwise.
    Taken once."""
    kept = getattr(module, "_kvcomp_prefill_attention", None)
    module._kvcomp_prefill_attention = None
    return kept if kept is not None and kept.log_sum_exp.shape[-1] == prompt_length else None


def _hand_decode_query(module: torch.nn.Module, query: torch.Tensor | None) -> None:
    """Keep a pass's queries on `module` for its press's hook. Once per layer and decoding step: straight into the
    instance dict (what ``nn.Module.__setattr__`` does for a name that is no parameter, buffer or submodule, after
    three dict lookups and a type check)."""
    module.__dict__[_DECODE_QUERY_ATTR] = query


def hold_pass_for_attention(module: torch.nn.Module, press, kwargs: dict | None) -> None:
    """Have the pass over `module` now starting call ``press.compress_after_attention(module, kwargs, probabilities)``
    as soon as its decoding attention has read the layer (None: not this pass, and nothing held is left on the
    module). The layer's keys and values are then still in the CPU's caches: the module's output projection, which
    the forward hook waits for, streams 1.3 MB of weights through a 2 MB L2 on SmolLM2 and left KeepKV's step reading
    them back from L3."""
    if kwargs is None:
        module.__dict__.pop(_HELD_PASS_ATTR, None)
    else:
        module.__dict__[_HELD_PASS_ATTR] = (press, kwargs)


def _compress_held_pass(module: torch.nn.Module, probabilities: torch.Tensor | None) -> None:
    held = module.__dict__.pop(_HELD_PASS_ATTR, None)
    if held is not None:
        press, kwargs = held
        press.compress_after_attention(module, kwargs, probabilities)


def take_decode_query(module: torch.nn.Module, new_tokens: int) -> torch.Tensor | None:
    """The post-RoPE queries (B, Hq, q, d) of the later pass of `new_tokens` tokens that just attended to `module`'s
    layer with state (the ones its probabilities come from), or None. Taken once."""
    query = module.__dict__.pop(_DECODE_QUERY_ATTR, None)
    return query if query is not None and query.shape[2] == new_tokens else None


def take_prompt_last_query(module: torch.nn.Module) -> torch.Tensor | None:
    """The post-RoPE queries (B, Hq, 1, d) of the last token of the prompt pass that just ran on `module` while a
    press of ours was active (the ones its attention used), or None. Taken once."""
    return module.__dict__.pop(_PROMPT_LAST_QUERY_ATTR, None)


def _keeps_prompt_scores(module, query, key, attention_mask, dropout, kwargs) -> bool:
    """Whether this forward is a plain causal CPU or CUDA prompt pass whose press asked for its scores: no mask (no
    padding, so b = 0), no dropout, no sliding window or softcap, the query as long as the keys."""
    return (getattr(module, "_kvcomp_prompt_score_weights", None) is not None
            and query.device.type in ("cpu", "cuda")
            and attention_mask is None and query.shape[2] == key.shape[2] and not dropout
            and kwargs.get("sliding_window") is None and kwargs.get("softcap") is None
            and kwargs.get("is_causal") is not False and getattr(module, "is_causal", True))


def _prompt_attention_keeping_scores(module, query, key, value, kwargs):
    """The causal attention of a prompt pass, keeping on the module what its press needs to score the prompt. On
    CPU: the output, log-sum-exp and scores from one QKᵀ (``kvcomp::prompt_attention_with_scores``); past its
    workspace limit, ATen's flash kernel (which sdpa dispatches to there), whose log-sum-exp comes beside the output.
    On CUDA: :func:`_cuda_prompt_attention_keeping_log_sum_exp`. All GQA without repeated keys. None: nothing kept,
    the layer's own attention function runs."""
    scaling = _scaling(module, kwargs)
    if query.device.type == "cuda":
        return _cuda_prompt_attention_keeping_log_sum_exp(module, query, key, value, scaling)
    weights = module._kvcomp_prompt_score_weights
    if ops.prompt_attention_workspace_bytes(query, key) <= ops.FUSED_PROMPT_WORKSPACE_LIMIT:
        log_weights = torch.zeros(key.shape[:3], dtype=torch.float32)
        output, lse, scores = ops.prompt_attention_with_scores(query, key, value, log_weights, scaling, *weights)
        module._kvcomp_prefill_attention = PrefillAttention(query, lse, scores, weights)
        return output, None
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, True,
                                                                            scale=scaling)
    module._kvcomp_prefill_attention = PrefillAttention(query, lse, None, None)
    return output.transpose(1, 2).contiguous(), None


# (device, dtype, head dim) of prompt passes cuDNN's attention refused.
_CUDNN_REFUSED: set[tuple[torch.device, torch.dtype, int]] = set()


def _cuda_prompt_attention_keeping_log_sum_exp(module, query, key, value, scaling):
    """A CUDA prompt pass through cuDNN's causal attention, which takes the GQA keys as they are and returns the
    log-sum-exp beside the output at sdpa's cost (H100, B = 1, Llama-3-8B layer: 12.9 / 239 ms at 32k / 128k against
    sdpa's 12.8 / 234 ms, within 4e-6 of ``prompt_log_sum_exp``; ``benchmarks/results/gpu/prefill_op_cuda_before.json``),
    so ``kvcomp::prompt_scores`` runs its second pass only. None where cuDNN does not take the inputs (float32, a
    GPU or build without its attention): the press's op then computes the log-sum-exp itself. A refusal is
    remembered for the device, dtype and head dim, so later layers and prefills do not ask again."""
    inputs = (query.device, query.dtype, query.shape[-1])
    if query.dtype not in (torch.float16, torch.bfloat16) or inputs in _CUDNN_REFUSED:
        return None
    try:
        output, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(query, key, value, None, True, 0.0, True,
                                                                        False, scale=scaling)[:2]
    except RuntimeError as error:
        if not isinstance(error, torch.OutOfMemoryError):  # a refusal of the inputs, made again at every layer
            _CUDNN_REFUSED.add(inputs)
        return None
    module._kvcomp_prefill_attention = PrefillAttention(query, lse.flatten(2), None, None)  # (B, Hq, T, 1)
    return output.transpose(1, 2).contiguous(), None


def _scaling(module: torch.nn.Module, kwargs: dict) -> float:
    """The attention scale of this call: the kwarg where the model passes one, else the module's. Read only on our
    paths: attention modules of other models (GPT-2, CLIP, ...) run through the same registry without a `scaling`,
    and are refused there rather than attended at a scale they may not use."""
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = getattr(module, "scaling", None)
    if scaling is None:
        raise ValueError(
            f"kvpress_cpp: layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__}) gives its attention no "
            f"scale (no `scaling` argument or attribute), so kvpress_cpp's attention over a compressed or paged cache "
            f"cannot apply the model's own; models whose attention modules set `scaling` (Llama, Mistral, Qwen, "
            f"Gemma, Phi, ...) are supported")
    return scaling


def refuse_attention_outside_the_registry(frame, max_depth: int = 6) -> None:
    """Raise if the attention module whose forward is appending to a paged cache (the nearest `forward` up the stack
    from `frame` whose ``self`` is an nn.Module; none found, no check) computes its attention itself instead of
    through transformers' attention registry: only what the registry dispatches to, wrapped here, reads a paged
    layer through its block tables. The module's own attention would take the block pools for its keys and values
    (silently wrong tokens from Falcon, shape errors from GPT-J or Bloom). Whether the forward's module can reach the
    registry is read from the globals of the code running it (a decorator's wrapper would show its own module's)."""
    for _ in range(max_depth):
        if frame is None:
            return
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
        if isinstance(owner, torch.nn.Module):
            if not any(name in frame.f_globals for name in ("ALL_ATTENTION_FUNCTIONS", "AttentionInterface")):
                raise ValueError(
                    f"PagedKVCache: layer {getattr(owner, 'layer_idx', '?')} ({type(owner).__name__}) computes its "
                    f"attention itself, not through transformers' attention registry (ALL_ATTENTION_FUNCTIONS), so it "
                    f"would read the cache's block pools as its keys and values; only models whose attention "
                    f"dispatches through the registry (Llama, Mistral, Qwen, Gemma, Phi, ...) run on a PagedKVCache. "
                    f"Use a DynamicCache for this model")
            return
        frame = frame.f_back


def _tokens_held(module: torch.nn.Module, presses, paged_layer: PagedLayer | None, key: torch.Tensor) -> int:
    """The tokens the cache stands for after this pass: counted by the active press, else the layer's length (a
    lower bound where something compressed it outside a press of ours)."""
    counted = module.__dict__.get(_POSITIONS_END_ATTR) if presses else None
    if counted is not None:
        return counted
    return paged_layer.get_seq_length() if paged_layer is not None else key.shape[-2]


def _honour_log_weights(attention_fn, keeps_prompt_scores: bool = False, returns_weights: bool = False,
                        continuous_batching: str | None = None):
    """`returns_weights`: the function always returns the attention probabilities (eager attention, whose are what
    output_attentions=True reports), so a paged pass returns them too. `continuous_batching`: the name of one of
    transformers' continuous-batching attentions, which read their own cache, refused under a press or on a paged
    layer."""
    if getattr(attention_fn, _WRAPPED_ATTR, False):
        return attention_fn

    @functools.wraps(attention_fn)
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        paged_layer = paged_layer_of(key)
        presses = module.__dict__.get(_ACTIVE_PRESSES_ATTR)
        if presses or paged_layer is not None:
            user = presses[-1] if presses else "PagedKVCache"
            if continuous_batching is not None:
                raise ValueError(f"{user}: layer {getattr(module, 'layer_idx', '?')} runs transformers' "
                                 f"continuous-batching attention ({continuous_batching!r}), which reads its own "
                                 f"PagedAttentionCache (generate_batch), not a cache kvpress_cpp compressed or paged; "
                                 f"load the model with attn_implementation='sdpa', 'eager' or 'flash_attention_2'")
            if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
                implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
                raise ValueError(f"{user}: layer {getattr(module, 'layer_idx', '?')} runs its attention "
                                 f"({implementation}) with a {type(attention_mask).__name__} mask, which kvpress_cpp's "
                                 f"attention over a compressed or paged cache cannot read; load the model with "
                                 f"attn_implementation='sdpa', 'eager' or 'flash_attention_2'")
            _refuse_unsupported_variant(module, kwargs, user, lambda: _tokens_held(module, presses, paged_layer, key))
        if paged_layer is None:
            settle_marks(module, None)
        else:
            prompt_states = _enter_paged_pass(paged_layer, module, attention_mask)
            if prompt_states is None:
                if not presses and paged_layer.has_state:
                    _refuse_tokens_fed_again(paged_layer, query, kwargs)
                # A later pass's padding (several tokens: generate never pads a decoding step), read from transformers'
                # mask where its columns are the layer's: no press compressed the layer (one refuses padding there).
                if (query.shape[-2] > 1 and not presses and not paged_layer.has_state
                        and paged_layer.holds_every_token()
                        and (padding := new_token_padding(attention_mask, query.shape[-2])) is not None):
                    paged_layer.hide_new_tokens(padding)  # as a DynamicCache's mask hides them from every query
                output, probs = _paged_attention(paged_layer, module, query, _scaling(module, kwargs), returns_weights)
                _compress_held_pass(module, probs)
                return output, probs
            key, value = prompt_states  # a prefill: the model's own attention over the prompt, as without paging
        log_weights = state_for_attention(module, query, key)
        if log_weights is None and query.shape[-2] == key.shape[-2]:
            # A prefill: marks an earlier pass left are not this prompt's. kvpress's own wrapper clears them too, but
            # the kept-scores path and eager attention do not call it, and a press of ours reads them (forward_hook).
            module.masked_key_indices = None
            if presses:
                module.__dict__[_PROMPT_LAST_QUERY_ATTR] = query[:, :, -1:].clone()
        elif log_weights is not None and getattr(module, "masked_key_indices", None) is not None:
            raise head_wise_marks_error(get_state(attached_layer(module, key)).owner_name())
        if log_weights is not None and not presses:  # a compressed context answered outside its press's context
            _refuse_unsupported_variant(module, kwargs, "kvpress_cpp", lambda: key.shape[-2])
            _refuse_tokens_fed_again(attached_layer(module, key), query, kwargs)
        if log_weights is None:
            # kvpress's own wrapper, when it wraps this one, passes dropout positionally (as its 6th argument).
            if (keeps_prompt_scores and len(args) <= 1
                    and _keeps_prompt_scores(module, query, key, attention_mask, args[0] if args else
                                             kwargs.get("dropout"), kwargs)):
                kept = _prompt_attention_keeping_scores(module, query, *in_one_dtype(key, value), kwargs)
                if kept is not None:
                    return kept
            return attention_fn(module, query, key, value, attention_mask, *args, **kwargs)
        output, probs = ops.decode_attention(query, *in_one_dtype(key, value), log_weights, _scaling(module, kwargs))
        _hand_decode_query(module, query)  # for the press's hook (take_decode_query): no second projection
        output = output.transpose(1, 2).contiguous()
        _compress_held_pass(module, probs)
        return output, probs

    setattr(attention, _WRAPPED_ATTR, True)
    return attention


def _enter_paged_pass(layer: PagedLayer, module: torch.nn.Module,
                      attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Bookkeeping of a pass over a paged layer; returns the prompt's keys and values when the pass is a prefill. A
    prefill evicts its padding (read from transformers' mask, as the rectangular path folds it into b), so a shorter
    prompt of a batch holds only its own blocks."""
    layer.attended_by(module)
    layer.check_state_in_place()
    prompt_states = layer.take_prompt_states()
    if prompt_states is None:
        return None
    module.masked_key_indices = None  # kvpress's head-wise presses expect it (its own patch resets it at prefill)
    if attention_mask is not None:
        layer.drop_padding(padding_log_weights(attention_mask, *layer.lengths.shape, layer.get_seq_length(),
                                               attention_mask.device))
    return prompt_states


def _paged_attention(layer: PagedLayer, module: torch.nn.Module, query: torch.Tensor, scaling: float,
                     returns_weights: bool = False):
    """Attention of a later pass over a paged layer (``kvcomp::paged_decode_attention``), with probabilities over the
    view's columns when a hook that reads them is attached or the attention function replaced returns them (eager:
    transformers 4.57 records output_attentions by wrapping the module's forward, not by a hook)."""
    wants_probs = returns_weights or len(module._forward_hooks) > getattr(module, "_kvcomp_hooks_without_probs", 0)
    output, probs = ops.paged_decode_attention(query, *layer.attention_inputs(), scaling, wants_probs,
                                               max_len=layer.longest_length() or None)
    _hand_decode_query(module, query if wants_probs else None)
    return output.transpose(1, 2).contiguous(), layer.probs_to_view(probs) if wants_probs else None


def patch_attention_functions() -> None:
    """Wrap every attention function registered with transformers (sdpa, flash attention, ...). Idempotent."""
    for name, attention_fn in list(ALL_ATTENTION_FUNCTIONS.items()):
        ALL_ATTENTION_FUNCTIONS[name] = _honour_log_weights(attention_fn, keeps_prompt_scores=name == "sdpa",
                                                            continuous_batching=name if "paged" in name else None)


def _wrap_eager_attention(model_file) -> None:
    # Read from the module's own dict: transformers' lazy package modules import on attribute access.
    eager = getattr(model_file, "__dict__", {}).get("eager_attention_forward")
    if eager is not None:
        model_file.eager_attention_forward = _honour_log_weights(eager, returns_weights=True)


def patch_eager_attention(model: torch.nn.Module) -> None:
    """Wrap the eager attention function of every model file `model` uses. Idempotent."""
    for module in model.modules():
        _wrap_eager_attention(sys.modules.get(type(module).__module__))


def patch_loaded_eager_attention() -> None:
    """Wrap the eager attention function of every transformers model file imported so far. A paged layer, or one
    holding a press's state, calls it at each append (the model's file is imported by then; a cache loaded by
    torch.load gets here too), so eager attention reads it without a press's ``with press(model):`` having patched the
    model. Scans only when modules were imported since the last scan (a scan reads ~3,400 modules: 0.7 ms)."""
    global _modules_scanned
    if len(sys.modules) == _modules_scanned:
        return
    for name, model_file in list(sys.modules.items()):
        if name.startswith("transformers.models.") and model_file is not None:
            _wrap_eager_attention(model_file)
    _modules_scanned = len(sys.modules)


_modules_scanned = 0


patch_attention_functions()
