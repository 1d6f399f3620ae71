"""Where a decoding step's time goes: one forward of one new token over a prefilled cache, without a press and under
each press at a 10% budget, timed, profiled with torch.profiler and, on CUDA with --graphs, replayed from a CUDA graph.

    python -m benchmarks.bench_step_profile --device cuda --model random-llama3-8b --lengths 8192   # the GPU question
    python -m benchmarks.bench_step_profile --device cuda --model random-llama3-8b --lengths 32768 --batch 12 \\
        --graphs --top 0                                                    # issue 20's 3x, where it can be reached
    python -m benchmarks.bench_step_profile --model random-llama-tiny --lengths 512                 # smoke test

Each case prefills a batch of --batch prompts (model forward, no ``generate``), runs 3 warm-up steps and --steps
timed steps of ``model(token, past_key_values=cache)`` (``step_ms``: the mean, the device synchronised at both ends),
then profiles 3 more (--top 0: none). Rows (``profile_step.json``): step_ms and the --top operators by device time
(CUDA) or CPU time (CPU), each with its total over the profiled steps in ms and its call count; with --graphs also
``graph_top_ops``, the same over 3 replays.

The question it answers (issue 20): on the random Llama-3-8B shape on an H100 the full cache's step took ~53 ms
whatever the prompt length, against ~5 ms to read its weights, and the presses' step less: which operators carry
that time. A step launched from Python pays the host's time to launch its ~1000 kernels; --graphs also captures the
step in a CUDA graph and replays it --replays times (``graph_step_ms``), as vLLM and SGLang run their decoding steps,
leaving the device's own time. Then the full cache is held as a preallocating engine holds it (the prompt and one free
slot that every step writes, `PreallocatedLayer`) rather than a DynamicCache, whose torch.cat would copy the whole
cache each step. ``tok_s`` = batch / best_step_ms, the faster of the launched and the replayed step, is what issue 20's
"decode tokens/s at 32k with a 10% budget >= 3x the full cache's" is read from (``speedup_vs_full``): a step that only
read memory costs (weights + batch x KV) bytes, so the ratio is bounded by (16 + 4.3 B) / (16 + 0.43 B) GB on the 8B
shape at 32k, 1.24x at B = 1, 3x from B = 11.
"""

from __future__ import annotations

import contextlib
import time

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from benchmarks.bench_decode import PRESSES, build_model, model_arguments, model_dtype, prompt_ids
from benchmarks.common import positive_int, prompt_fraction, print_table, write_results
from kvpress_cpp.cache import cache_bytes
from tests.decoding_step import layer_tensors

WARMUP_STEPS, PROFILED_STEPS = 3, 3


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class PreallocatedLayer(DynamicLayer):
    """A full-cache layer as a serving engine allocates it for a step replayed from a CUDA graph: the prompt's keys and
    values followed by one free slot, which every decoding step (and every replay of it) writes before it attends all
    T + 1 slots. The layer's length stays T, so each step is the same step at position T."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.keys is None or self.keys.numel() == 0:  # the prompt
            batch, heads, length, dim = key_states.shape
            self.all_keys = key_states.new_empty(batch, heads, length + 1, dim)
            self.all_values = value_states.new_empty(batch, heads, length + 1, value_states.shape[-1])
            self.all_keys[:, :, :length] = key_states
            self.all_values[:, :, :length] = value_states
            self.keys, self.values = self.all_keys[:, :, :length], self.all_values[:, :, :length]
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            return self.keys, self.values
        if key_states.shape[-2] != 1:
            raise ValueError(f"PreallocatedLayer holds one free slot: a decoding step of {key_states.shape[-2]} "
                             "tokens does not fit")
        self.all_keys[:, :, -1:] = key_states
        self.all_values[:, :, -1:] = value_states
        return self.all_keys, self.all_values


def full_cache(graphs: bool) -> Cache:
    return Cache(layer_class_to_replicate=PreallocatedLayer) if graphs else DynamicCache()


@contextlib.contextmanager
def decoding_step(model, ids: torch.Tensor, press, graphs: bool = False):
    """Inside: `ids` prefilled into a cache (compressed by `press`, whose context this holds open) and
    (step, cache): step() runs one decoding step of the batch over the cache, its token in a fixed buffer."""
    cache = full_cache(graphs) if press is None else DynamicCache()
    with torch.inference_mode(), (press(model) if press is not None else contextlib.nullcontext()):
        # logits_to_keep: the prompt's logits at every position would be batch x T x vocab (100 GB at 12 x 32k).
        logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1:].argmax(-1)
        yield (lambda: model(token, past_key_values=cache, use_cache=True).logits), cache


def replayed_step(step, cache: Cache, replays: int, device: str, top: int) -> tuple[float, list[dict]]:
    """Milliseconds per replay of `step` captured in a CUDA graph, and the `top` operators of PROFILED_STEPS replays
    (none for 0): the kernels the capture ended up with, where they differ from the launched step's (the full cache's
    replay took 13x its launched step on an H200, run 13, with no kernel list to say why)."""
    side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graphs asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    # A step may hand its layers new tensors (a press's compaction): the graph reads the ones it was captured over,
    # which must outlive it.
    captured_over = layer_tensors(cache)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    ops = profiled_ops(graph.replay, device, top) if top else []
    del captured_over
    return start.elapsed_time(end) / replays, ops


def profile_case(model, ids, press, device: str, steps: int, top: int, graphs: bool, replays: int) -> dict:
    with decoding_step(model, ids, press, graphs) as (step, cache):
        for _ in range(WARMUP_STEPS):
            step()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        row = {"step_ms": round((time.perf_counter() - start) / steps * 1e3, 3), "slots": cache.get_seq_length(),
               "kv_bytes": cache_bytes(cache)}
        if graphs:
            replayed_ms, replayed_ops = replayed_step(step, cache, replays, device, top)
            row["graph_step_ms"] = round(replayed_ms, 3)
            row["graph_tok_s"] = round(ids.shape[0] * 1e3 / row["graph_step_ms"], 1)
            if replayed_ops:
                row["graph_top_ops"] = replayed_ops
        # The case's step at its faster of launched and replayed: what a comparison between cases reads, so that a
        # replay slower than the launched step (as the full cache's on an H200, 274 against 23 ms at 12 x 32k: the
        # sdpa kernel a capture ends up with) cannot flatter the presses, whose attention is not sdpa's.
        row["best_step_ms"] = min(row["step_ms"], row.get("graph_step_ms", row["step_ms"]))
        row["tok_s"] = round(ids.shape[0] * 1e3 / row["best_step_ms"], 1)
        if top:
            row["top_ops"] = profiled_ops(step, device, top)
    return row


def profiled_ops(step, device: str, top: int) -> list[dict]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(PROFILED_STEPS):
            step()
        synchronize(device)
    key = "device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    # Only events that took time: a replay whose kernels the profiler did not see lists nothing, not 0 ms host calls.
    timed = [e for e in profile.key_averages() if getattr(e, key) > 0]
    events = sorted(timed, key=lambda e: getattr(e, key), reverse=True)[:top]
    return [{"op": e.key, "ms": round(getattr(e, key) / 1e3, 3), "calls": e.count} for e in events]


def main() -> None:
    parser = model_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(PRESSES), choices=list(PRESSES))
    parser.add_argument("--budget", type=prompt_fraction, default=0.1, help="fraction of the prompt the presses keep")
    parser.add_argument("--batch", type=positive_int, default=1, help="prompts decoded together")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps per case")
    parser.add_argument("--top", type=int, default=12, help="operators listed per case (0: no profile)")
    parser.add_argument("--graphs", action="store_true", help="also time the step replayed from a CUDA graph")
    parser.add_argument("--replays", type=positive_int, default=20, help="replays timed per case with --graphs")
    parser.add_argument("--name", default="profile_step")
    args = parser.parse_args()
    if args.graphs and not args.device.startswith("cuda"):
        parser.error("--graphs needs --device cuda (CUDA graphs)")
    dtype = model_dtype(args)
    model, tokenizer = build_model(args.model, args.device, dtype)
    rows = []
    for length in args.lengths or [512]:
        ids = prompt_ids(tokenizer, length, model.config.vocab_size, args.device, args.batch)
        cases = [("full", None)] + [(f"{m} {args.budget:.0%}", PRESSES[m](args.budget)) for m in args.methods]
        for method, press in cases:
            row = {"prompt": length, "batch": args.batch, "method": method}
            try:
                row.update(profile_case(model, ids, press, args.device, args.steps, args.top, args.graphs,
                                        args.replays))
            except torch.OutOfMemoryError as error:  # the next, smaller case may still fit
                row["error"] = f"out of memory: {str(error).splitlines()[0]}"
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            rows.append(row)
            write_results(args.name, rows)  # so far: a run cut short (make gpu-check's time limit) keeps its rows
            print(f"{method} at {args.batch} x {length}: {row.get('step_ms', row.get('error'))} ms a step over "
                  f"{row.get('slots')} slots" + (f", {row['graph_step_ms']} ms replayed" if "graph_step_ms" in row
                                                 else ""))
            for key, what in (("top_ops", "launched"), ("graph_top_ops", "replayed")):
                if row.get(key):
                    print(f"{what}:")
                    print_table(row[key], ["op", "ms", "calls"])
    for row in rows:
        full = next((r for r in rows if r["prompt"] == row["prompt"] and r["method"] == "full"), {})
        if "tok_s" in row and "tok_s" in full:
            row["speedup_vs_full"] = round(row["tok_s"] / full["tok_s"], 2)
    print_table(rows, ["prompt", "batch", "method", "slots", "kv_bytes", "step_ms", "graph_step_ms", "tok_s",
                       "speedup_vs_full", "error"])
    print("wrote", write_results(args.name, rows))


if __name__ == "__main__":
    main()
