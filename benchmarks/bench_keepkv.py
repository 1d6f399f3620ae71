"""One KeepKV decoding step, kvcomp ops against plain PyTorch (tests/reference.py).

    python -m benchmarks.bench_keepkv           # writes benchmarks/results/keepkv.json

Step at Hq=32, H=8, d=128, the cache holding the budget's T - 1 slots plus the new token: B=4, T = 1025 on the CPU;
on CUDA B in {1, 16} x T in {4096, 32768} (common.DECODE_STEP_GRID), the range of issue 20's ">= 5x" target (gpu_check
reads it from the keepkv_decode_step rows).
  1. EMA of the scores (eq. 8): update_scores with decay β = 0.9, input_scale (1 - β)/G; ℓ = ln(S / (1 - β^t)).
  2. keep = all slots but the lowest-ℓ one outside 4 sinks and the last 32 (the same plain-PyTorch selection in both
     variants).
  3. keepkv_match(keys, keep, 0.8): one evicted slot against the T - 1 retained ones per row.
  4. keepkv_zip_merge(keys, values, votes, ℓ, targets).
"vectorised" runs the same step in plain PyTorch over all heads at once: reference.update_scores, a cosine of the
evicted key against every slot (normalise, matmul, masked argmax), reference.keepkv_zip_merge_vectorised.
Second row per dtype and shape, "keepkv_decode_step": the one op the press runs at every decoding step (on CUDA one
kernel launch), on a layer of the same size after a new token (tests.test_fuzz_ops' generator: probabilities from the
attention, EMA state, votes), which also recovers the logits from the probabilities and packs the cache in place:
more work than the three ops above, timed against the same plain-PyTorch step.
Target (the issue): >= 2x the plain-PyTorch step on CPU; >= 5x on a GPU (issue 20).
"""

import random

import torch

import kvpress_cpp  # noqa: F401  (registers torch.ops.kvcomp)
from benchmarks.common import (DECODE_STEP_GRID, configurations, median_seconds, parse_without_options, print_table,
                               write_results)
from tests import reference
from tests.test_fuzz_ops import _keepkv_step_build

BETA = 0.9
QUERY_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DECODE_SHAPES = {"cpu": [(4, 1025)], "cuda": DECODE_STEP_GRID}  # (B, T): T - 1 slots kept, the budget, plus the new one
SINKS, RECENT = 4, 32
STEP = 2000  # t of the bias correction 1 / (1 - β^t)
CASES = [torch.float32, torch.bfloat16]


def inputs(dtype, device, batch, total, seed=0):
    # Drawn on the device: at 16 x 32k slots a CPU takes seconds per tensor, a good part of the GPU run's time.
    generator = torch.Generator(device).manual_seed(seed)
    keys = torch.randn(batch, KV_HEADS, total, HEAD_DIM, generator=generator, device=device).to(dtype)
    values = torch.randn(batch, KV_HEADS, total, HEAD_DIM, generator=generator, device=device).to(dtype)
    scores = torch.rand(batch, KV_HEADS, total - 1, generator=generator, device=device)
    votes = 1.0 + torch.rand(batch, KV_HEADS, total, generator=generator, device=device)
    attn = torch.rand(batch, QUERY_HEADS, 1, total, generator=generator, device=device).softmax(-1).to(dtype)
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


def fused_step_inputs(dtype, device, batch, total) -> list:
    """keepkv_decode_step's arguments for the bench's layer: `total` slots, one new token, one eviction."""
    sizes = {"B": batch, "H": KV_HEADS, "Hq": QUERY_HEADS, "q": 1, "d": HEAD_DIM, "S": total - 1, "T": total}
    args = list(_keepkv_step_build(random.Random(0), sizes, dtype, device))
    args[10:15] = [total - 1, SINKS, RECENT, 0.8, False]  # budget, sinks, recent, threshold, convex
    # In place: a repeated call packs the same rows again (a valid cache each time), the same work per call.
    return args


def step_rows(device, threads, dtype, batch, total) -> list[dict]:
    """The three-op step and keepkv_decode_step against the vectorised step, on a cache of `total` slots."""
    args = inputs(dtype, device, batch, total)
    for got, expected in zip(op_step(*args), vectorised_step(*args)):  # the two steps agree
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    seconds = {"op": median_seconds(lambda: op_step(*args), num_threads=threads),
               "vectorised": median_seconds(lambda: vectorised_step(*args), num_threads=threads)}
    row = {"what": "decode step", "device": device, "threads": threads, "dtype": str(dtype)[6:], "B": batch,
           "Hq": QUERY_HEADS, "H": KV_HEADS, "T": total, "budget": total - 1, "d": HEAD_DIM, "beta": BETA,
           "op_us": round(seconds["op"] * 1e6, 1), "vectorised_us": round(seconds["vectorised"] * 1e6, 1),
           "speedup_vs_vectorised": round(seconds["vectorised"] / seconds["op"], 1)}
    fused = fused_step_inputs(dtype, device, batch, total)
    fused_s = median_seconds(lambda: torch.ops.kvcomp.keepkv_decode_step(*fused), num_threads=threads)
    return [row, {**row, "what": "keepkv_decode_step", "op_us": round(fused_s * 1e6, 1),
                  "speedup_vs_vectorised": round(seconds["vectorised"] / fused_s, 1)}]


def main() -> None:
    parse_without_options(__doc__)
    rows = []
    for device, threads in configurations():
        for dtype in CASES:
            for batch, total in DECODE_SHAPES[device]:
                rows += step_rows(device, threads, dtype, batch, total)
    print_table(rows, ["what", "device", "threads", "dtype", "B", "T", "budget", "op_us", "vectorised_us",
                       "speedup_vs_vectorised"])
    print("wrote", write_results("keepkv", rows))


if __name__ == "__main__":
    main()
