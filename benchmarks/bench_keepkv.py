"""One KeepKV decoding step, kvcomp ops against plain PyTorch (tests/reference.py).

    python -m benchmarks.bench_keepkv           # writes benchmarks/results/keepkv.json

Step at B=4, Hq=32, H=8, budget 1024, d=128: the cache holds 1024 slots plus the new token (T = 1025).
  1. EMA of the scores (eq. 8): update_scores with decay β = 0.9, input_scale (1 - β)/G; ℓ = ln(S / (1 - β^t)).
  2. keep = all slots but the lowest-ℓ one outside 4 sinks and the last 32 (the same plain-PyTorch selection in both
     variants).
  3. keepkv_match(keys, keep, 0.8): one evicted slot against the 1024 retained ones per row.
  4. keepkv_zip_merge(keys, values, votes, ℓ, targets).
"vectorised" runs the same step in plain PyTorch over all heads at once: reference.update_scores, a cosine of the
evicted key against every slot (normalise, matmul, masked argmax), reference.keepkv_zip_merge_vectorised.
Second row per dtype, "keepkv_decode_step": the one op the press runs at every decoding step (on CUDA one kernel
launch), on a layer of the same size after a new token (tests.test_fuzz_ops' generator: probabilities from the
attention, EMA state, votes), which also recovers the logits from the probabilities and packs the cache in place:
more work than the three ops above, timed against the same plain-PyTorch step.
Target (the issue): >= 2x the plain-PyTorch step on CPU; >= 5x on a GPU (issue 20).
"""

import random


import torch

import kvpress_cpp  # noqa: F401  (registers torch.ops.kvcomp)
from benchmarks.common import configurations, median_seconds, print_table, write_results
from tests import reference
from tests.test_fuzz_ops import _keepkv_step_build

BETA = 0.9
BATCH, QUERY_HEADS, KV_HEADS, HEAD_DIM = 4, 32, 8, 128
BUDGET = 1024
SINKS, RECENT = 4, 32
STEP = 2000  # t of the bias correction 1 / (1 - β^t)
CASES = [torch.float32, torch.bfloat16]


def inputs(dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = BUDGET + 1
    keys = torch.randn(BATCH, KV_HEADS, total, HEAD_DIM, generator=generator).to(device, dtype)
    values = torch.randn(BATCH, KV_HEADS, total, HEAD_DIM, generator=generator).to(device, dtype)
    scores = torch.rand(BATCH, KV_HEADS, BUDGET, generator=generator).to(device)
    votes = (1.0 + torch.rand(BATCH, KV_HEADS, total, generator=generator)).to(device)
    attn = torch.rand(BATCH, QUERY_HEADS, 1, total, generator=generator).softmax(-1).to(device, dtype)
    return keys, values, scores, votes, attn


def select_keep(log_scores):
    middle = log_scores[..., SINKS:-RECENT]
    evicted = SINKS + middle.argmin(-1, keepdim=True)
    return torch.ones_like(log_scores, dtype=torch.bool).scatter_(-1, evicted, False)


def op_step(keys, values, scores, votes, attn):
    group = QUERY_HEADS // KV_HEADS
    ema = torch.ops.kvcomp.update_scores(scores, attn, BETA, (1 - BETA) / group)
    log_scores = ema.log() - torch.log1p(torch.tensor(-BETA ** STEP)).item()
    keep = select_keep(log_scores)
    targets = torch.ops.kvcomp.keepkv_match(keys, keep, 0.8)
    return torch.ops.kvcomp.keepkv_zip_merge(keys, values, votes, log_scores, targets, False)


def vectorised_match_one(keys, keep, threshold):
    """The decoding-step match in plain PyTorch: the single evicted key of each row against every slot."""
    evicted = (~keep).float().argmax(-1, keepdim=True)  # (B, H, 1)
    k = keys.float()
    normalised = k / k.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    key_e = normalised.gather(2, evicted[..., None].expand(-1, -1, -1, k.shape[-1]))
    similarity = (normalised @ key_e.transpose(-1, -2)).squeeze(-1).masked_fill(~keep, float("-inf"))
    best, slot = similarity.max(-1, keepdim=True)
    targets = torch.where(keep, -1, -2)
    return targets.scatter(2, evicted, torch.where(best >= threshold, slot, -2))


def vectorised_step(keys, values, scores, votes, attn):
    group = QUERY_HEADS // KV_HEADS
    ema = reference.update_scores(scores, attn, BETA, (1 - BETA) / group)
    log_scores = ema.log() - torch.log1p(torch.tensor(-BETA ** STEP)).item()
    keep = select_keep(log_scores)
    targets = vectorised_match_one(keys, keep, 0.8)
    return reference.keepkv_zip_merge_vectorised(keys, values, votes, log_scores, targets, False)


def fused_step_inputs(dtype, device) -> list:
    """keepkv_decode_step's arguments for the bench's layer: T = BUDGET + 1 slots, one new token, one eviction."""
    sizes = {"B": BATCH, "H": KV_HEADS, "Hq": QUERY_HEADS, "q": 1, "d": HEAD_DIM, "S": BUDGET, "T": BUDGET + 1}
    args = list(_keepkv_step_build(random.Random(0), sizes, dtype))
    args[10:15] = [BUDGET, SINKS, RECENT, 0.8, False]  # budget, sinks, recent, threshold, convex
    # In place: a repeated call packs the same rows again (a valid cache each time), the same work per call.
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def main() -> None:
    rows = []
    for device, threads in configurations():
        for dtype in CASES:
            args = inputs(dtype, device)
            for got, expected in zip(op_step(*args), vectorised_step(*args)):  # the two steps agree
                torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
            seconds = {"op": median_seconds(lambda: op_step(*args), num_threads=threads),
                       "vectorised": median_seconds(lambda: vectorised_step(*args), num_threads=threads)}
            rows.append({"what": "decode step", "device": device, "threads": threads, "dtype": str(dtype)[6:],
                         "B": BATCH, "Hq": QUERY_HEADS, "H": KV_HEADS, "budget": BUDGET, "d": HEAD_DIM,
                         "beta": BETA, "op_us": round(seconds["op"] * 1e6, 1),
                         "vectorised_us": round(seconds["vectorised"] * 1e6, 1),
                         "speedup_vs_vectorised": round(seconds["vectorised"] / seconds["op"], 1)})
            fused = fused_step_inputs(dtype, device)
            fused_s = median_seconds(lambda: torch.ops.kvcomp.keepkv_decode_step(*fused), num_threads=threads)
            rows.append({**rows[-1], "what": "keepkv_decode_step", "op_us": round(fused_s * 1e6, 1),
                         "speedup_vs_vectorised": round(seconds["vectorised"] / fused_s, 1)})
    print_table(rows, ["what", "device", "threads", "dtype", "budget", "op_us", "vectorised_us",
                       "speedup_vs_vectorised"])
    print("wrote", write_results("keepkv", rows))


if __name__ == "__main__":
    main()
