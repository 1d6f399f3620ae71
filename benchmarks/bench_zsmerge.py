"""One ZSMerge decoding step and the ZSMerge prefill, kvcomp ops against plain PyTorch (tests/reference.py).

    python -m benchmarks.bench_zsmerge           # writes benchmarks/results/zsmerge.json

Decode step = update_scores (λ = 0.98, the G query heads summed) + zsmerge_decode_step on a full cache of M slots
plus q appended tokens (T = M + q slots), at Hq=32, H=8, d=128, q=1: B=4, M=1024 on the CPU; on CUDA B in {1, 16} x
T in {4096, 32768} (common.DECODE_STEP_GRID), the range of issue 20's ">= 5x" target (gpu_check reads it from these
rows). Two plain-PyTorch baselines run the same step: "loop" (CPU only: on a GPU it is launch-bound), the references
written one head and one token at a time (Python loops over B*H heads, so unfairly slow), and "vectorised", the same
step over all heads at once with gathers and scatters (what a plain-PyTorch press would do).
Prefill = zsmerge_prefill of T=4096 tokens into M=1024 slots at B=4 against the loop and vectorised references.
Targets (the issue): decode step >= 2x the plain-PyTorch step on CPU, >= 5x on GPU.
"""

import torch

import kvpress_cpp  # noqa: F401  (registers torch.ops.kvcomp)
from benchmarks.common import (DECODE_STEP_GRID, configurations, median_seconds, parse_without_options, print_table,
                               write_results)
from tests import reference

DECAY = 0.98
BATCH, QUERY_HEADS, KV_HEADS, HEAD_DIM = 4, 32, 8, 128
SLOTS = 1024  # M of the prefill, and of the decoding step on the CPU
DECODE_SHAPES = {"cpu": [(BATCH, SLOTS + 1)], "cuda": DECODE_STEP_GRID}  # (B, T): M = T - 1 slots plus the new token


def budget(slots, residual):
    """(recent, context, residual) with the authors' split: recent = 40% of M, context the rest."""
    recent = round(0.4 * slots)
    return recent, slots - recent - residual, residual


DECODE_CASES = [  # (dtype, residual)
    (torch.float32, 1),  # the paper's default Br = 1
    (torch.float32, 32),
    (torch.bfloat16, 1),
]
PREFILL_CASES = [(torch.float32, 1, 4096), (torch.float32, 32, 4096), (torch.bfloat16, 1, 4096)]  # (dtype, Br, T)


def decode_inputs(dtype, device, batch, slots, num_new=1, seed=0):
    # Drawn on the device: at 16 x 32k slots a CPU takes seconds per tensor, a good part of the GPU run's time.
    generator = torch.Generator(device).manual_seed(seed)
    total = slots + num_new
    keys = torch.randn(batch, KV_HEADS, total, HEAD_DIM, generator=generator, device=device).to(dtype)
    values = torch.randn(batch, KV_HEADS, total, HEAD_DIM, generator=generator, device=device).to(dtype)
    scores = torch.rand(batch, KV_HEADS, slots, generator=generator, device=device)
    counts = torch.ones(batch, KV_HEADS, total, device=device)
    attn = torch.rand(batch, QUERY_HEADS, num_new, total, generator=generator, device=device).softmax(-1).to(dtype)
    return keys, values, scores, counts, attn


def make_step(update, decode, inputs, recent, context, residual):
    keys, values, scores, counts, attn = inputs

    def step():
        new_scores = update(scores, attn, DECAY, 1.0)  # (B, H, M + q)
        decode(keys, values, new_scores, counts, 0, recent, context, residual)

    return step


def timing_fields(seconds: dict[str, float]) -> dict[str, float]:
    """The row fields of one case: each side's median in µs and the op's speedup over the two baselines."""
    return {**{f"{name}_us": round(value * 1e6, 1) for name, value in seconds.items()},
            **{f"speedup_vs_{name}": round(value / seconds["op"], 1) for name, value in seconds.items() if name != "op"}}


def decode_row(device, threads, dtype, residual, batch, slots) -> dict:
    """The op's decoding step against the plain-PyTorch ones on a full cache of `slots` slots and one new token."""
    recent, context, _ = budget(slots, residual)
    inputs = decode_inputs(dtype, device, batch, slots)
    steps = {
        "op": make_step(torch.ops.kvcomp.update_scores, torch.ops.kvcomp.zsmerge_decode_step, inputs,
                        recent, context, residual),
        "vectorised": make_step(reference.update_scores, reference.zsmerge_decode_step_vectorised, inputs,
                                recent, context, residual),
    }
    if device == "cpu":  # on a GPU the per-head loop is launch-bound: minutes per case, and no real baseline
        steps["loop"] = make_step(reference.update_scores, reference.zsmerge_decode_step, inputs, recent,
                                  context, residual)
    seconds = {name: median_seconds(fn, num_threads=threads) for name, fn in steps.items()}
    return {"what": "decode step", "device": device, "threads": threads, "dtype": str(dtype)[6:], "B": batch,
            "Hq": QUERY_HEADS, "H": KV_HEADS, "T": slots + 1, "M": slots, "d": HEAD_DIM, "q": 1,
            "Bp": recent, "Bc": context, "Br": residual, **timing_fields(seconds)}


def main() -> None:
    parse_without_options(__doc__)
    rows = []
    for device, threads in configurations():
        for dtype, residual in DECODE_CASES:
            for batch, total in DECODE_SHAPES[device]:
                rows.append(decode_row(device, threads, dtype, residual, batch, total - 1))
        for dtype, residual, tokens in PREFILL_CASES:
            recent, context, _ = budget(SLOTS, residual)
            generator = torch.Generator().manual_seed(1)
            keys = torch.randn(BATCH, KV_HEADS, tokens, HEAD_DIM, generator=generator).to(device, dtype)
            values = torch.randn(BATCH, KV_HEADS, tokens, HEAD_DIM, generator=generator).to(device, dtype)
            scores = torch.rand(BATCH, KV_HEADS, tokens, generator=generator).to(device)
            args = (keys, values, scores, recent, context, residual)
            seconds = {
                "op": median_seconds(lambda: torch.ops.kvcomp.zsmerge_prefill(*args), num_threads=threads),
                "vectorised": median_seconds(lambda: reference.zsmerge_prefill_vectorised(*args), num_threads=threads),
            }
            if device == "cpu":
                seconds["loop"] = median_seconds(lambda: reference.zsmerge_prefill(*args), min_run_time=0.1,
                                                 num_threads=threads)
            rows.append({"what": "prefill", "device": device, "threads": threads, "dtype": str(dtype)[6:],
                         "B": BATCH, "H": KV_HEADS, "T": tokens, "M": SLOTS, "d": HEAD_DIM,
                         "Bp": recent, "Bc": context, "Br": residual,
                         **timing_fields(seconds)})
    print_table(rows, ["what", "device", "threads", "dtype", "B", "T", "M", "Bp", "Bc", "Br", "op_us", "vectorised_us",
                       "loop_us", "speedup_vs_vectorised", "speedup_vs_loop"])
    print("wrote", write_results("zsmerge", rows))


if __name__ == "__main__":
    main()
