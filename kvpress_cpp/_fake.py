"""Shape functions (fake kernels) of every kvcomp op, so torch.compile and meta tensors can trace them.

The C++ kernels validate everything; the checks here are only those a trace needs to produce the right shapes.
"""

import torch


@torch.library.register_fake("kvcomp::update_scores")
def _update_scores_fake(scores, attn, decay, input_scale):
    torch._check(
        attn.shape[-1] == scores.shape[-1] + attn.shape[2],
        lambda: f"kvcomp::update_scores: expected attn.size(3) == T_old + q, got attn {tuple(attn.shape)} "
        f"and scores {tuple(scores.shape)}",
    )
    return scores.new_empty((scores.shape[0], scores.shape[1], attn.shape[-1]))


@torch.library.register_fake("kvcomp::zsmerge_prefill")
def _zsmerge_prefill_fake(keys, values, scores, recent, context, residual):
    slots = recent + context + residual
    torch._check(
        keys.shape[2] > slots,
        lambda: f"kvcomp::zsmerge_prefill: expected more tokens than slots, T = keys.size(2) > M = {slots}, "
        f"got T = {keys.shape[2]}",
    )
    batch, kv_heads, _, head_dim = keys.shape
    out_keys = keys.new_empty((batch, kv_heads, slots, head_dim))
    out_scores = scores.new_empty((batch, kv_heads, slots))
    return out_keys, torch.empty_like(out_keys), out_scores, torch.empty_like(out_scores)


@torch.library.register_fake("kvcomp::zsmerge_decode_step")
def _zsmerge_decode_step_fake(keys, values, scores, counts, ring_position, recent, context, residual):
    return None  # in place: no outputs
