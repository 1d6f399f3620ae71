"""The gvote family on a SmolLM2-135M-shaped layer (Hq=9, H=3, d=64, S=8 samples, n_f=512 future positions) at
T = 1k, 2k, 4k, 8k prompt tokens, against plain PyTorch written the obvious vectorised way:

    python -m benchmarks.bench_gvote        # writes benchmarks/results/gvote.json

- nucleus_budget vs sort + cumsum (tests/reference.py's, float64),
- averaged_rope vs ``q * cos.mean(0) + rotate_half(q) * sin.mean(0)``,
- gvote_union_mask vs the full (B, Hq, S, T) logits, a stable descending argsort, a rank < k scatter and an any()
  over each group (the set union of the reference, vectorised),
- peak extra memory of gvote_union_mask against that baseline: measured with torch.cuda.max_memory_allocated on a
  GPU; on CPU computed from the tensors each one allocates (op: chunk_size x T float32 logits plus one T-long
  uint64 key row per thread; plain: the S x Hq x T logits, their int64 argsort and the bool scatter).
"""

import torch

import kvpress_cpp  # noqa: F401  (registers torch.ops.kvcomp)
from benchmarks.common import configurations, median_seconds, parse_without_options, print_table, write_results
from tests import reference

BATCH, QUERY_HEADS, KV_HEADS, HEAD_DIM, SAMPLES, FUTURE = 1, 9, 3, 64, 8, 512
LENGTHS = (1024, 2048, 4096, 8192)
SINKS, P_NUC, CHUNK = 4, 0.95, 64


def plain_averaged_rope(queries, cos, sin):
    return queries * cos.mean(0) + reference.rotate_half(queries) * sin.mean(0)


def plain_union_mask(keys, queries, budgets, sinks, scale):
    group = QUERY_HEADS // KV_HEADS
    total_len = keys.shape[2]
    logits = (queries.float() @ keys.float().repeat_interleave(group, 1).transpose(-1, -2)) * scale
    order = logits.argsort(dim=-1, descending=True, stable=True)
    in_budget = torch.arange(total_len, device=keys.device) < budgets[:, :, None, None]
    selected = torch.zeros_like(in_budget.expand_as(order)).scatter(-1, order, in_budget.expand_as(order))
    keep = selected.view(BATCH, KV_HEADS, group * SAMPLES, total_len).any(2)
    keep[..., :sinks] = True
    return keep


def inputs(total_len, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(BATCH, KV_HEADS, total_len, HEAD_DIM, generator=generator).to(device, dtype)
    queries = torch.randn(BATCH, QUERY_HEADS, SAMPLES, HEAD_DIM, generator=generator).to(device, dtype)
    probs = (torch.randn(BATCH, QUERY_HEADS, total_len, generator=generator) * 3).softmax(-1).to(device)
    angles = torch.outer(torch.arange(total_len, total_len + FUTURE, dtype=torch.float64),
                         1e5 ** -(torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    emb = torch.cat([angles, angles], -1)
    return keys, queries, probs, emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def peak_extra_bytes(fn):
    """Peak bytes allocated by fn beyond what was live before (GPU only)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def main() -> None:
    parse_without_options(__doc__)
    rows = []
    for device, threads in configurations():
        torch.set_num_threads(threads)
        for dtype in (torch.float32,) if device == "cpu" else (torch.float32, torch.bfloat16):
            tag = {"device": device, "threads": threads, "dtype": str(dtype).split(".")[-1]}
            keys, queries, probs, cos, sin = inputs(LENGTHS[0], dtype, device)
            rope_op = median_seconds(lambda: torch.ops.kvcomp.averaged_rope(queries, cos, sin), num_threads=threads)
            rope_plain = median_seconds(lambda: plain_averaged_rope(queries, cos, sin), num_threads=threads)
            rows.append({"op": "averaged_rope", **tag, "T": "-", "op_us": round(rope_op * 1e6, 1),
                         "plain_us": round(rope_plain * 1e6, 1), "speedup": round(rope_plain / rope_op, 2)})
            for total_len in LENGTHS:
                keys, queries, probs, cos, sin = inputs(total_len, dtype, device, seed=total_len)
                scale = HEAD_DIM**-0.5
                budgets = torch.ops.kvcomp.nucleus_budget(probs, P_NUC)
                assert torch.equal(budgets.cpu(), reference.nucleus_budget(probs.cpu(), P_NUC))
                sampled = torch.ops.kvcomp.averaged_rope(queries, cos, sin)
                mask = torch.ops.kvcomp.gvote_union_mask(keys, sampled, budgets, SINKS, scale, CHUNK)
                assert torch.equal(mask, plain_union_mask(keys, sampled, budgets, SINKS, scale))

                budget_op = median_seconds(lambda: torch.ops.kvcomp.nucleus_budget(probs, P_NUC), num_threads=threads)
                budget_plain = median_seconds(lambda: reference.nucleus_budget(probs, P_NUC), num_threads=threads)
                rows.append({"op": "nucleus_budget", **tag, "T": total_len, "op_us": round(budget_op * 1e6, 1),
                             "plain_us": round(budget_plain * 1e6, 1), "speedup": round(budget_plain / budget_op, 2),
                             "mean_budget": round(budgets.float().mean().item(), 1)})

                union_op = median_seconds(
                    lambda: torch.ops.kvcomp.gvote_union_mask(keys, sampled, budgets, SINKS, scale, CHUNK),
                    num_threads=threads)
                union_plain = median_seconds(lambda: plain_union_mask(keys, sampled, budgets, SINKS, scale),
                                             num_threads=threads)
                rows_total = QUERY_HEADS * SAMPLES
                if device == "cuda":
                    op_bytes = peak_extra_bytes(
                        lambda: torch.ops.kvcomp.gvote_union_mask(keys, sampled, budgets, SINKS, scale, CHUNK))
                    plain_bytes = peak_extra_bytes(lambda: plain_union_mask(keys, sampled, budgets, SINKS, scale))
                    memory = "measured"
                else:
                    # float32 logits of at most CHUNK rows (whole kv heads: 64 // 24 = 2 heads = 48 rows) + one key row
                    # per thread + the mask; plain: logits, argsort (int64), bool scatter + the budget mask.
                    chunk_rows = (CHUNK // (rows_total // KV_HEADS)) * (rows_total // KV_HEADS) or CHUNK
                    op_bytes = chunk_rows * total_len * 4 + threads * total_len * 8 + KV_HEADS * total_len
                    plain_bytes = rows_total * total_len * (4 + 8 + 1 + 1)
                    memory = "analytic"
                rows.append({"op": "gvote_union_mask", **tag, "T": total_len, "op_us": round(union_op * 1e6, 1),
                             "plain_us": round(union_plain * 1e6, 1), "speedup": round(union_plain / union_op, 2),
                             "kept_fraction": round(mask.float().mean().item(), 3),
                             "op_extra_MB": round(op_bytes / 2**20, 2), "plain_extra_MB": round(plain_bytes / 2**20, 2),
                             "memory": memory})
    print_table(rows, ["op", "device", "threads", "dtype", "T", "op_us", "plain_us", "speedup", "mean_budget",
                       "kept_fraction", "op_extra_MB", "plain_extra_MB", "memory"])
    print("wrote", write_results("gvote", rows))


if __name__ == "__main__":
    main()
