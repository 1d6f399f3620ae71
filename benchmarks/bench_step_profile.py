"""Where a decoding step's time goes: one forward of one new token over a prefilled cache, without a press and under
each press at a 10% budget, timed and profiled with torch.profiler.

    python -m benchmarks.bench_step_profile --device cuda --model random-llama3-8b --lengths 8192   # the GPU question
    python -m benchmarks.bench_step_profile --model random-llama-tiny --lengths 512                 # smoke test

Each case prefills the prompt (model forward, no ``generate``), runs 3 warm-up steps and --steps timed steps of
``model(token, past_key_values=cache)`` (``step_ms``: the mean, the device synchronised at both ends), then profiles 3
more. Rows (``profile_step.json``): step_ms and the --top operators by device time (CUDA) or CPU time (CPU), each
with its total over the profiled steps in ms and its call count. The question it answers (issue 20): on the random
Llama-3-8B shape on an H100 the full cache's step took ~53 ms whatever the prompt length, against ~5 ms to read its
weights, and the presses' step less: which operators carry that time.
"""

from __future__ import annotations

import contextlib
import time

import torch
from transformers import DynamicCache

from benchmarks.bench_decode import PRESSES, build_model, model_arguments, model_dtype, prompt_ids
from benchmarks.common import print_table, write_results

WARMUP_STEPS, PROFILED_STEPS = 3, 3


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def profile_case(model, ids, press, device: str, steps: int, top: int) -> dict:
    cache = DynamicCache()
    forward = lambda token: model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)  # noqa: E731
    with torch.inference_mode(), (press(model) if press is not None else contextlib.nullcontext()):
        token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(WARMUP_STEPS):
            token = forward(token)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            token = forward(token)
        synchronize(device)
        step_ms = (time.perf_counter() - start) / steps * 1e3
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(PROFILED_STEPS):
                token = forward(token)
            synchronize(device)
    on_device = device.startswith("cuda")
    key = "device_time_total" if on_device else "self_cpu_time_total"
    events = sorted(profile.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    return {"step_ms": round(step_ms, 3), "slots": cache.get_seq_length(),
            "top_ops": [{"op": e.key, "ms": round(getattr(e, key) / 1e3, 3), "calls": e.count} for e in events]}


def main() -> None:
    parser = model_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(PRESSES), choices=list(PRESSES))
    parser.add_argument("--budget", type=float, default=0.1, help="fraction of the prompt the presses keep")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case")
    parser.add_argument("--top", type=int, default=12, help="operators listed per case")
    parser.add_argument("--name", default="profile_step")
    args = parser.parse_args()
    dtype = model_dtype(args)
    model, tokenizer = build_model(args.model, args.device, dtype)
    rows = []
    for length in args.lengths or [512]:
        ids = prompt_ids(tokenizer, length, model.config.vocab_size, args.device)
        cases = [("full", None)] + [(f"{m} {args.budget:.0%}", PRESSES[m](args.budget)) for m in args.methods]
        for method, press in cases:
            row = {"prompt": length, "method": method, **profile_case(model, ids, press, args.device, args.steps,
                                                                      args.top)}
            rows.append(row)
            print(f"{method} at {length}: {row['step_ms']} ms a step over {row['slots']} slots; top operators:")
            print_table(row["top_ops"], ["op", "ms", "calls"])
    print("wrote", write_results(args.name, rows))


if __name__ == "__main__":
    main()
