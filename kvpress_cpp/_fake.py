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


@torch.library.register_fake("kvcomp::merge_count_bias")
def _merge_count_bias_fake(counts, alpha):
    return counts.new_empty(counts.shape)


@torch.library.register_fake("kvcomp::decode_attention")
def _decode_attention_fake(query, keys, values, log_weights, scale):
    torch._check(
        keys.shape[2] == log_weights.shape[2] and query.shape[2] <= keys.shape[2],
        lambda: f"kvcomp::decode_attention: expected 1 <= q <= T and log_weights over the T slots of keys, got query "
        f"{tuple(query.shape)}, keys {tuple(keys.shape)} and log_weights {tuple(log_weights.shape)}",
    )
    batch, query_heads, num_queries, _ = query.shape
    out = query.new_empty(query.shape)
    probs = query.new_empty((batch, query_heads, num_queries, keys.shape[2]), dtype=torch.float32)
    return out, probs


@torch.library.register_fake("kvcomp::weightedkv_evict")
def _weightedkv_evict_fake(keys, values, sums, counts, sinks, recent, evictions, merge_values=True):
    batch, kv_heads, total_len = keys.shape[:3]
    torch._check(
        evictions <= total_len - sinks - recent,
        lambda: f"kvcomp::weightedkv_evict: expected evictions <= T - sinks - recent (enough middle slots to evict), "
        f"got evictions = {evictions}, T = {total_len}, sinks = {sinks}, recent = {recent}",
    )
    out_len = total_len - evictions
    return (
        keys.new_empty((batch, kv_heads, out_len, keys.shape[3])),
        values.new_empty((batch, kv_heads, out_len, values.shape[3])),
        sums.new_empty((batch, kv_heads, out_len)),
        counts.new_empty((batch, kv_heads, out_len)),
    )


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


@torch.library.register_fake("kvcomp::keepkv_match")
def _keepkv_match_fake(keys, keep, threshold):
    return keep.new_empty(keep.shape, dtype=torch.int64)


@torch.library.register_fake("kvcomp::keepkv_zip_merge")
def _keepkv_zip_merge_fake(keys, values, votes, log_scores, targets, convex):
    return keys.new_empty(keys.shape), values.new_empty(values.shape), votes.new_empty(votes.shape)


@torch.library.register_fake("kvcomp::nucleus_budget")
def _nucleus_budget_fake(probs, p):
    return probs.new_empty(probs.shape[:2], dtype=torch.int64)


@torch.library.register_fake("kvcomp::averaged_rope")
def _averaged_rope_fake(queries, cos, sin):
    return torch.empty_like(queries, memory_format=torch.contiguous_format)


@torch.library.register_fake("kvcomp::gvote_union_mask")
def _gvote_union_mask_fake(keys, queries, budgets, sinks, scale, chunk_size):
    return keys.new_empty(keys.shape[:3], dtype=torch.bool)


@torch.library.register_fake("kvcomp::kvzap_score")
def _kvzap_score_fake(hidden, weight1, bias1, weight2=None, bias2=None):
    heads = (weight2 if weight2 is not None else weight1).shape[0]
    return hidden.new_empty((hidden.shape[0], heads, hidden.shape[1]), dtype=torch.float32)


@torch.library.register_fake("kvcomp::kvzap_threshold")
def _kvzap_threshold_fake(log_weights, scores, positions, threshold, window, tokens_before, tokens_after):
    held = log_weights.new_empty(log_weights.shape[:2], dtype=torch.int64)
    return log_weights.new_empty(log_weights.shape), held


@torch.library.register_fake("kvcomp::paged_decode_attention")
def _paged_decode_attention_fake(query, key_blocks, value_blocks, log_weight_blocks, block_tables, lengths, scale,
                                 return_probs):
    torch._check(
        key_blocks.shape[-1] == query.shape[-1] and block_tables.shape[:2] == lengths.shape,
        lambda: f"kvcomp::paged_decode_attention: expected key_blocks (N, S, d) with the d of query and lengths over "
        f"the (B, H) of block_tables, got query {tuple(query.shape)}, key_blocks {tuple(key_blocks.shape)}, "
        f"block_tables {tuple(block_tables.shape)} and lengths {tuple(lengths.shape)}",
    )
    batch, query_heads, num_queries, _ = query.shape
    width = torch.library.get_ctx().new_dynamic_size() if return_probs else 0
    out = query.new_empty(query.shape)
    probs = query.new_empty((batch, query_heads, num_queries, width), dtype=torch.float32)
    return out, probs
