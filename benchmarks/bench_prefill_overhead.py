"""Prefill cost of every press we ship and of kvpress's StreamingLLM, SnapKV, TOVA and ExpectedAttention, in one run,
and the prompt-scoring op alone against the path it replaced:

    python -m benchmarks.bench_prefill_overhead --threads 1       # SmolLM2 on CPU, 1k/2k/4k/8k Austen tokens
    python -m benchmarks.bench_prefill_overhead --device cuda --model random-llama3-8b     # presses: 8k/16k/32k random
    python -m benchmarks.bench_prefill_overhead --device cuda --parts op   # the op on a Llama-3-8B-shaped layer, 32k/128k

Presses (``part = "presses"``): for each prompt length, --repeats rounds (default 3), each a prefill forward without
a press (``logits_to_keep=1``, as ``generate`` runs it) followed by one under every press, so that the shared
machine's load drifts over the baseline and the presses alike; ``forward_s`` and ``with_press_s`` are the medians
over the rounds (the samples are kept in the row) and ``ratio`` = with_press_s / forward_s (the issue's target for
ZSMerge, KeepKV and WeightedKV: at most 1.15x at 2k-8k, and no worse than kvpress's SnapKV). On CPU those are the
process's CPU seconds (robust to other jobs on a shared machine, and the wall time at one thread; on several threads
they also count OpenMP's workers spinning while they wait for work); the
``*_wall_s`` and ``wall_ratio`` beside them are wall seconds, what a user waits for with several threads, where an
op whose threads wait on one another costs more wall time than CPU time. ``press_s`` is the
time inside the press's own prefill method (``compress_prefill`` for ours, ``compress`` for kvpress's) summed over the
layers, ``removed`` the fraction of slots it removed; on a GPU ``press_peak_MiB`` is the press's largest allocation
beyond what was live when its prefill method started.

The op alone (``part = "op"``, a SmolLM2-shaped layer: B=1, Hq=9, H=3, d=64, float32, random inputs): the scores of
all T queries by ``prompt_log_sum_exp`` + ``prompt_scores`` (decay 1: nothing skipped), by ``prompt_scores`` with
the log-sum-exp given (what the presses run on CPU, where sdpa hands it over), and with ZSMerge's λ = 0.98 (older
queries skipped); against the former path (decode_attention on 512-query chunks, folded by update_scores) and
against the layer's own causal sdpa (the attention forward the prefill runs anyway). ``workspace_MiB``: the op's
per-thread tiles times the threads; the former path held a (B, Hq, 512, T) float32 probability chunk. The prefill's
two ways to get the attention and the scores: ``fused_s`` (``prompt_attention_with_scores``: output, log-sum-exp and
scores from one QKᵀ; what the prefill runs up to its workspace limit, ``fused_workspace_MiB``) against
``sdpa_plus_scores_s`` (ATen's flash kernel with its log-sum-exp, then ``prompt_scores`` given it: the fallback), with
WeightedKV's weights (decay 1: every query adds) and ZSMerge's (λ = 0.98: ``prompt_scores`` skips negligible queries).

KeepKV's EMA op alone (``part = "keepkv_op"``, the same SmolLM2-shaped layer, its default window R = 0.8 M of the
last R queries at M = T / 4): ``prompt_log_unnormalised_scores`` (``op_s``) against the chunked PyTorch fold it
replaced (``former_s``, ``tests.reference.keepkv_former_prefill_fold``: (B, Hq, 256, T) float32 logits per chunk).

On CUDA (``--device cuda --parts op``): a random Llama-3-8B-shaped layer (B=1, Hq=32, H=8, d=128, bfloat16) at 32k
and 128k tokens: the op's time and peak memory beyond its inputs against the layer's sdpa (flash) forward, the scores
pass alone (the log-sum-exp given), and which of ATen's attention kernels hands over a log-sum-exp equal to
``prompt_log_sum_exp``'s (cuDNN, flash, memory-efficient), at what cost.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from functools import wraps
from pathlib import Path

import torch
from kvpress import ExpectedAttentionPress, SnapKVPress, StreamingLLMPress, TOVAPress
from tqdm import tqdm
from transformers import DynamicCache

from benchmarks.bench_decode import MODELS, build_model, model_arguments, model_dtype, prompt_ids
from benchmarks.common import positive_int, print_table, pyplot, save_figure, write_results
from kvpress_cpp import ops
from kvpress_cpp.kvpress_adapters import kvpress_transformers_mismatch
from kvpress_cpp.presses.gvote import GVotePress
from kvpress_cpp.presses.keepkv import KeepKVPress
from kvpress_cpp.presses.kvzap import (DEFAULT_THRESHOLD, KVzapThresholdPress, default_surrogate_dir,
                                       has_packaged_surrogate)
from kvpress_cpp.presses.weightedkv import WeightedKVPress
from kvpress_cpp.presses.zsmerge import ZSMergePress
from tests import reference

KEPT = 0.25  # budgets: a quarter of the prompt (kvpress's compression_ratio 0.75)
PRESSES = {
    "ZSMerge": lambda: ZSMergePress(budget=KEPT),
    "WeightedKV": lambda: WeightedKVPress(cache_size=KEPT),
    "KeepKV": lambda: KeepKVPress(budget=KEPT),
    "GVote": GVotePress,
    f"KVzap-MLP τ={DEFAULT_THRESHOLD:g}": KVzapThresholdPress,
    "StreamingLLM (kvpress)": lambda: StreamingLLMPress(compression_ratio=1 - KEPT),
    "SnapKV (kvpress)": lambda: SnapKVPress(compression_ratio=1 - KEPT),
    "TOVA (kvpress)": lambda: TOVAPress(compression_ratio=1 - KEPT),
    "ExpectedAttention (kvpress)": lambda: ExpectedAttentionPress(compression_ratio=1 - KEPT),
}
OP_LENGTHS = [2048, 4096, 8192, 16384, 32768]
FORMER_CHUNK = 512
# The CPU kernel's tiles (csrc/cpu/prompt_scores.cpp): kKeyTile keys, kQueryTile queries x G heads, rounded to 4 rows.
KEY_TILE, QUERY_TILE = 128, 64


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def clock(device: str) -> float:
    """CPU seconds of this process on CPU (the machine is shared: wall time would count the other jobs' turns), wall
    seconds on CUDA."""
    return time.process_time() if device == "cpu" else time.perf_counter()


def prefill(model, ids, press=None) -> tuple[float, float]:
    """(clock seconds, wall seconds) of one prefill forward over a fresh cache, under `press` when given."""
    synchronize(str(ids.device))
    start, wall_start = clock(str(ids.device)), time.perf_counter()
    with torch.inference_mode():
        if press is None:
            model(ids, past_key_values=DynamicCache(), logits_to_keep=1)
        else:
            with press(model):
                model(ids, past_key_values=DynamicCache(), logits_to_keep=1)
    synchronize(str(ids.device))
    return clock(str(ids.device)) - start, time.perf_counter() - wall_start


def instrument(press, device: str) -> dict:
    """Wrap the press's prefill method (ours: compress_prefill, kvpress's: compress) to add up its seconds and, on a
    GPU, its peak memory beyond what was live when it started."""
    totals = {"seconds": 0.0, "peak_bytes": 0}
    name = "compress_prefill" if hasattr(press, "compress_prefill") else "compress"
    method = getattr(press, name)
    cuda = device.startswith("cuda")

    @wraps(method)
    def timed(*args, **kwargs):
        synchronize(device)
        if cuda:
            live = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = clock(device)
        result = method(*args, **kwargs)
        synchronize(device)
        totals["seconds"] += clock(device) - start
        if cuda:
            totals["peak_bytes"] = max(totals["peak_bytes"], torch.cuda.max_memory_allocated() - live)
        return result

    setattr(press, name, timed)
    return totals


def removed_fraction(press) -> float:
    """The fraction of the prompt's slots the press removed: its own figure when it reports one, else the budget's."""
    ratio = getattr(press, "compression_ratio", None)
    return round(float(ratio), 3) if ratio is not None else 1 - KEPT


def press_rows(model, tokenizer, lengths, repeats, device, methods, save) -> list[dict]:
    """Per prompt length, `repeats` rounds; each round runs the forward without a press, then under every press in
    turn, so that a change of the shared machine's load during the run reaches the baseline and the presses alike.
    Times are medians over the rounds."""
    rows = []
    config = model.config
    prefill(model, prompt_ids(tokenizer, min(lengths), config.vocab_size, device))  # warm-up
    for length in lengths:
        ids = prompt_ids(tokenizer, length, config.vocab_size, device)
        forward_seconds, forward_wall = [], []
        samples = {method: {"total": [], "wall": [], "press": [], "peak_bytes": 0, "removed": None}
                   for method in methods}
        for _ in tqdm(range(repeats), desc=f"prefill {length}", unit="round"):
            seconds, wall = prefill(model, ids)
            forward_seconds.append(seconds)
            forward_wall.append(wall)
            for method in methods:
                press = PRESSES[method]()
                totals = instrument(press, device)
                seconds, wall = prefill(model, ids, press)
                samples[method]["total"].append(seconds)
                samples[method]["wall"].append(wall)
                samples[method]["press"].append(totals["seconds"])
                samples[method]["peak_bytes"] = max(samples[method]["peak_bytes"], totals["peak_bytes"])
                samples[method]["removed"] = removed_fraction(press)
        forward, forward_wall_s = statistics.median(forward_seconds), statistics.median(forward_wall)
        for method in methods:
            total, wall = statistics.median(samples[method]["total"]), statistics.median(samples[method]["wall"])
            rows.append({"part": "presses", "press": method, "prompt": length, "threads": torch.get_num_threads(),
                         "forward_s": round(forward, 3), "with_press_s": round(total, 3),
                         "ratio": round(total / forward, 3), "forward_wall_s": round(forward_wall_s, 3),
                         "with_press_wall_s": round(wall, 3), "wall_ratio": round(wall / forward_wall_s, 3),
                         "press_s": round(statistics.median(samples[method]["press"]), 3),
                         "removed": samples[method]["removed"], "repeats": repeats,
                         "forward_samples_s": [round(x, 3) for x in forward_seconds],
                         "with_press_samples_s": [round(x, 3) for x in samples[method]["total"]],
                         "forward_wall_samples_s": [round(x, 3) for x in forward_wall],
                         "with_press_wall_samples_s": [round(x, 3) for x in samples[method]["wall"]]})
            if device.startswith("cuda"):
                rows[-1]["press_peak_MiB"] = round(samples[method]["peak_bytes"] / 2**20, 1)
            print({k: v for k, v in rows[-1].items() if not k.endswith("samples_s")}, flush=True)
        save(rows)
    return rows


def former_scores(query, keys, log_weights, scale, decay, input_scale):
    """The presses' former prompt scoring: decode_attention's probabilities of 512-query chunks (P·V computed and
    thrown away) folded by update_scores."""
    total = keys.shape[-2]
    scores = torch.zeros(*keys.shape[:2], 0)
    for start in range(0, total, FORMER_CHUNK):
        end = min(start + FORMER_CHUNK, total)
        _, probs = ops.decode_attention(query[:, :, start:end], keys[:, :, :end], keys[:, :, :end],
                                        log_weights[..., :end], scale)
        scores = ops.update_scores(scores, probs, decay, input_scale)
    return scores


def sdpa_plus_scores(query, keys, values, log_weights, scale, decay, input_scale):
    """The prefill's fallback past the fused op's workspace limit: ATen's flash kernel (which hands its log-sum-exp
    over), its output in the model's layout, then prompt_scores given that log-sum-exp."""
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, keys, values, 0.0, True,
                                                                            scale=scale)
    output.transpose(1, 2).contiguous()
    return ops.prompt_scores(query, keys, log_weights, scale, decay, input_scale, log_sum_exp=lse)


def seconds(fn, device: str = "cpu", repeats: int = 1) -> float:
    """The median over `repeats` runs of fn()."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = clock(device)
        fn()
        synchronize(device)
        times.append(clock(device) - start)
    return statistics.median(times)


def op_rows(lengths, threads: int, repeats: int, save) -> list[dict]:
    batch, query_heads, kv_heads, head_dim = 1, 9, 3, 64
    scale = head_dim ** -0.5
    rows = []

    def timed(fn):
        return seconds(fn, repeats=repeats)

    for length in tqdm(lengths, desc="op", unit="T"):
        generator = torch.Generator().manual_seed(length)
        query = torch.randn(batch, query_heads, length, head_dim, generator=generator)
        keys = torch.randn(batch, kv_heads, length, head_dim, generator=generator)
        values = torch.randn(batch, kv_heads, length, head_dim, generator=generator)
        log_weights = torch.zeros(batch, kv_heads, length)
        lse = ops.prompt_log_sum_exp(query, keys, log_weights, scale)
        rows_pad = -(-query_heads // kv_heads * QUERY_TILE // 4) * 4
        # TileScratch (queries, zero row, row pointers, transposed keys, bias, logits) and TileRows (lse, weight,
        # visible), in 4-byte words.
        tile_floats = (rows_pad * head_dim + head_dim + 2 * rows_pad + head_dim * KEY_TILE + KEY_TILE
                       + rows_pad * KEY_TILE + 4 * rows_pad)
        row = {
            "part": "op", "T": length,
            "op_s": timed(lambda: ops.prompt_scores(query, keys, log_weights, scale, 1.0, 1 / 3)),
            "op_given_lse_s": timed(lambda: ops.prompt_scores(query, keys, log_weights, scale, 1.0, 1 / 3,
                                                              log_sum_exp=lse)),
            "op_decay_0.98_s": timed(lambda: ops.prompt_scores(query, keys, log_weights, scale, 0.98, 1.0)),
            "former_s": timed(lambda: former_scores(query, keys, log_weights, scale, 1.0, 1 / 3)),
            "sdpa_s": timed(lambda: torch.nn.functional.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=scale, enable_gqa=True)),
            "workspace_MiB": round(threads * tile_floats * 4 / 2**20, 3),
            "former_chunk_MiB": round(batch * query_heads * FORMER_CHUNK * length * 4 / 2**20, 1),
        }
        for suffix, decay, input_scale in [("", 1.0, 1 / 3), ("_decay_0.98", 0.98, 1.0)]:
            row[f"fused{suffix}_s"] = timed(lambda: ops.prompt_attention_with_scores(
                query, keys, values, log_weights, scale, decay, input_scale))
            row[f"sdpa_plus_scores{suffix}_s"] = timed(lambda: sdpa_plus_scores(
                query, keys, values, log_weights, scale, decay, input_scale))
            row[f"fused_vs_sdpa_plus_scores{suffix}"] = round(row[f"fused{suffix}_s"]
                                                              / row[f"sdpa_plus_scores{suffix}_s"], 2)
        row["fused_workspace_MiB"] = round(ops.prompt_attention_workspace_bytes(query, keys, threads) / 2**20, 3)
        row["speedup_vs_former"] = round(row["former_s"] / row["op_s"], 2)
        row["op_vs_sdpa"] = round(row["op_s"] / row["sdpa_s"], 2)
        row["op_given_lse_vs_sdpa"] = round(row["op_given_lse_s"] / row["sdpa_s"], 2)
        for key in ("op_s", "op_given_lse_s", "op_decay_0.98_s", "former_s", "sdpa_s", "fused_s",
                    "sdpa_plus_scores_s", "fused_decay_0.98_s", "sdpa_plus_scores_decay_0.98_s"):
            row[key] = round(row[key], 4)
        rows.append(row)
        print(row, flush=True)
        save(rows)
    return rows


def keepkv_op_rows(lengths, repeats: int, save) -> list[dict]:
    """KeepKV's prefill EMA over its default window on a SmolLM2-shaped layer: the op against the former PyTorch fold
    (both given the window's queries)."""
    batch, query_heads, kv_heads, head_dim = 1, 9, 3, 64
    decay = KeepKVPress.ema_decay
    rows = []
    for length in tqdm(lengths, desc="keepkv op", unit="T"):
        window = round(KeepKVPress.recent * round(KEPT * length))
        generator = torch.Generator().manual_seed(length)
        query = torch.randn(batch, query_heads, window, head_dim, generator=generator)
        keys = torch.randn(batch, kv_heads, length, head_dim, generator=generator)
        log_weights = torch.zeros(batch, kv_heads, length)
        args = (query, keys, log_weights, head_dim ** -0.5, decay, (1 - decay) * kv_heads / query_heads)
        row = {"part": "keepkv_op", "T": length, "window": window,
               "op_s": round(seconds(lambda: ops.prompt_log_unnormalised_scores(*args), repeats=repeats), 4),
               "former_s": round(seconds(lambda: reference.keepkv_former_prefill_fold(*args), repeats=repeats), 4)}
        row["speedup_vs_former"] = round(row["former_s"] / row["op_s"], 1)
        rows.append(row)
        print(row, flush=True)
        save(rows)
    return rows


def attention_with_log_sum_exp(query, keys, values, scale) -> dict:
    """name → a callable running one of ATen's CUDA causal attention kernels that hand over their log-sum-exp beside
    the output (what a press could reuse instead of ``prompt_log_sum_exp``), each returning that log-sum-exp as
    (B, Hq, T) float32. cuDNN's takes the GQA keys as they are; flash and memory-efficient want repeated keys."""
    aten, group, length = torch.ops.aten, query.shape[1] // keys.shape[1], query.shape[2]
    repeated = [t.repeat_interleave(group, 1) for t in (keys, values)]

    def lse(tensor):  # cuDNN: (B, Hq, T, 1); memory-efficient: (B, Hq, T rounded up to 32)
        return tensor.float().flatten(2)[..., :length]

    return {
        "cudnn": lambda: lse(aten._scaled_dot_product_cudnn_attention(query, keys, values, None, True, 0.0, True,
                                                                      False, scale=scale)[1]),
        "flash": lambda: lse(aten._scaled_dot_product_flash_attention(query, *repeated, 0.0, True, False,
                                                                      scale=scale)[1]),
        "efficient": lambda: lse(aten._scaled_dot_product_efficient_attention(query, *repeated, None, True, 0.0, True,
                                                                              scale=scale)[1]),
    }


def cuda_op_rows(lengths) -> list[dict]:
    """A random Llama-3-8B-shaped layer in bfloat16: the op against the layer's sdpa (flash), time and peak memory
    beyond the inputs; the scores pass alone (``op_given_lse``: the log-sum-exp given); and each ATen attention kernel
    that hands over a log-sum-exp (:func:`attention_with_log_sum_exp`): its time and largest difference from
    ``prompt_log_sum_exp``'s, or why it did not run."""
    batch, query_heads, kv_heads, head_dim = 1, 32, 8, 128
    scale = head_dim ** -0.5
    rows = []
    for length in lengths:
        query = torch.randn(batch, query_heads, length, head_dim, device="cuda", dtype=torch.bfloat16)
        keys = torch.randn(batch, kv_heads, length, head_dim, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        log_weights = torch.zeros(batch, kv_heads, length, device="cuda")
        ours = ops.prompt_log_sum_exp(query, keys, log_weights, scale)
        row = {"part": "op", "T": length, "device": torch.cuda.get_device_name()}
        for name, fn in [
            ("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(query, keys, values, is_causal=True,
                                                                              scale=scale, enable_gqa=True)),
            ("op", lambda: ops.prompt_scores(query, keys, log_weights, scale, 1.0, 0.25)),
            ("op_decay_0.98", lambda: ops.prompt_scores(query, keys, log_weights, scale, 0.98, 1.0)),
            ("op_given_lse", lambda: ops.prompt_scores(query, keys, log_weights, scale, 1.0, 0.25,
                                                       log_sum_exp=ours)),
        ]:
            fn()
            torch.cuda.synchronize()
            live = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            row[f"{name}_s"] = round(min(seconds(fn, "cuda") for _ in range(3)), 5)
            row[f"{name}_peak_MiB"] = round((torch.cuda.max_memory_allocated() - live) / 2**20, 1)
        row["op_vs_sdpa"] = round(row["op_s"] / row["sdpa_s"], 2)
        for name, fn in attention_with_log_sum_exp(query, keys, values, scale).items():
            try:
                row[f"lse_{name}_max_error"] = round((fn() - ours).abs().max().item(), 6)
                row[f"lse_{name}_s"] = round(min(seconds(fn, "cuda") for _ in range(3)), 5)
            except (RuntimeError, NotImplementedError) as error:  # a kernel this GPU or shape does not support
                row[f"lse_{name}_error"] = f"{type(error).__name__}: {str(error)[:160]}"
        rows.append(row)
        print(row, flush=True)
    return rows


def threads_label(*counts: int) -> str:
    return f"{' / '.join(map(str, counts))} thread{'' if counts == (1,) else 's'}"


def plot(rows: list[dict], name: str, title: str) -> None:
    plt = pyplot()
    op = [r for r in rows if r["part"] == "op"]
    keepkv_op = [r for r in rows if r["part"] == "keepkv_op"]
    if op or keepkv_op:
        fig, (ax_presses, ax_op) = plt.subplots(1, 2, figsize=(12, 4.5))
    else:
        fig, ax_presses = plt.subplots(figsize=(6.5, 4.5))
    press_rows_ = [r for r in rows if r["part"] == "presses"]
    for method in dict.fromkeys(r["press"] for r in press_rows_):
        points = [r for r in press_rows_ if r["press"] == method]
        line, = ax_presses.plot([r["prompt"] for r in points], [r["ratio"] for r in points], "o-", label=method)
        walled = [r for r in points if "wall_ratio" in r and r.get("threads", 1) > 1]
        if walled:  # at one thread the wall ratio repeats the CPU-time one
            ax_presses.plot([r["prompt"] for r in walled], [r["wall_ratio"] for r in walled], "x--",
                            color=line.get_color(), label=f"{method}, wall")
    ax_presses.axhline(1.15, color="grey", linestyle=":", label="target 1.15x")
    ax_presses.set_xscale("log", base=2)
    ax_presses.set_xlabel("prompt tokens")
    ax_presses.set_ylabel("prefill with press / without (CPU time; x--: wall)")
    ax_presses.legend(fontsize=7)
    ax_presses.set_title(title, fontsize=9)
    if not (op or keepkv_op):
        save_figure(fig, name)
        return
    for key, label in [("former_s", "former (decode_attention chunks + update_scores)"),
                       ("op_s", "prompt_log_sum_exp + prompt_scores"), ("op_given_lse_s", "prompt_scores, LSE given"),
                       ("op_decay_0.98_s", "prompt_scores, λ = 0.98"), ("sdpa_s", "the layer's causal sdpa"),
                       ("sdpa_plus_scores_s", "sdpa + prompt_scores (LSE given)"),
                       ("fused_s", "prompt_attention_with_scores (output + scores)")]:
        points = [r for r in op if key in r]
        if points:
            ax_op.plot([r["T"] for r in points], [r[key] for r in points], "o-", label=label)
    for key, label in [("op_s", "KeepKV EMA: prompt_log_unnormalised_scores (window R = T / 5)"),
                       ("former_s", "KeepKV EMA: former PyTorch fold")]:
        if keepkv_op:
            ax_op.plot([r["T"] for r in keepkv_op], [r[key] for r in keepkv_op], "s--", label=label)
    ax_op.set_xscale("log", base=2)
    ax_op.set_yscale("log")
    ax_op.set_xlabel("T")
    ax_op.set_ylabel("seconds (one SmolLM2-shaped layer)")
    ax_op.legend(fontsize=7)
    save_figure(fig, name)


def main() -> None:
    parser = model_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["presses", "op", "keepkv_op"],
                        choices=["presses", "op", "keepkv_op"])
    parser.add_argument("--presses", nargs="+", default=None, choices=list(PRESSES),
                        help="default: all (KVzap only where the model has packaged surrogates)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="rounds per prompt length; the median time is kept")
    parser.add_argument("--op-lengths", type=positive_int, nargs="+", default=None)
    parser.add_argument("--name", default=None,
                        help="result file stem (default: prefill_overhead, or prefill_overhead_<model>_<device>)")
    parser.add_argument("--plot-from", nargs="+", default=None, metavar="JSON",
                        help="only draw the plot from these result files (e.g. the two parts run as two processes)")
    args = parser.parse_args()
    if args.plot_from:
        if missing := [path for path in args.plot_from if not Path(path).is_file()]:
            parser.error(f"--plot-from: no {', '.join(missing)}")
        rows = [r for path in args.plot_from for r in json.loads(Path(path).read_text())["rows"]]
        threads = sorted({r.get("threads", 1) for r in rows if r["part"] == "presses"}) or [1]
        plot(rows, args.name or "prefill_overhead",
             f"prefill with press / without (smollm2, cpu, {threads_label(*threads)})")
        return
    dtype = model_dtype(args)
    cuda = args.device.startswith("cuda")
    name = args.name or ("prefill_overhead" if (args.model, args.device) == ("smollm2", "cpu") else
                         f"prefill_overhead_{args.model}_{args.device}")
    load_before = os.getloadavg()

    def save(part_rows: list[dict]) -> Path:
        """Results so far (a long run on a shared machine keeps what it measured if it is stopped)."""
        load = {"load_average_1_5_15_before": [round(x, 2) for x in load_before],
                "load_average_1_5_15_now": [round(x, 2) for x in os.getloadavg()], "cores": os.cpu_count()}
        return write_results(name, rows + part_rows + [{"part": "machine", **load}])

    rows = []
    if "presses" in args.parts:
        model, tokenizer = build_model(args.model, args.device, dtype)
        lengths = args.lengths or {"smollm2": [1024, 2048, 4096, 8192]}.get(args.model, MODELS[args.model][1])
        presses = args.presses or list(PRESSES)
        kvzap = next(method for method in PRESSES if method.startswith("KVzap"))
        if args.presses is None and not has_packaged_surrogate(model, KVzapThresholdPress.model_type):  # random models
            presses.remove(kvzap)
            surrogate = default_surrogate_dir(model, KVzapThresholdPress.model_type)
            why = f"no packaged KVzap surrogate for {args.model} (expected in {surrogate})"
            rows.append({"part": "left_out", "press": kvzap, "why": why})
            print(f"left out {kvzap}: {why}", flush=True)
        if mismatch := kvpress_transformers_mismatch():  # kvpress's own presses run its forward hook
            left_out = [method for method in presses if method.endswith("(kvpress)")]
            presses = [method for method in presses if method not in left_out]
            rows += [{"part": "left_out", "press": method, "why": mismatch} for method in left_out]
            print(f"left out {', '.join(left_out)}: {mismatch}", flush=True)
        rows += press_rows(model, tokenizer, lengths, args.repeats, args.device, presses, save)
        del model
    if "op" in args.parts:
        rows += (cuda_op_rows(args.op_lengths or [32768, 131072]) if cuda else
                 op_rows(args.op_lengths or OP_LENGTHS, torch.get_num_threads(), args.repeats, save))
    if "keepkv_op" in args.parts and not cuda:
        rows += keepkv_op_rows(args.op_lengths or OP_LENGTHS[:3], args.repeats, save)
    for part, columns in [
        ("presses", ["press", "prompt", "threads", "forward_s", "with_press_s", "ratio", "forward_wall_s",
                     "with_press_wall_s", "wall_ratio", "press_s", "removed", "press_peak_MiB"]),
        ("op", ["T", "op_s", "op_given_lse_s", "op_decay_0.98_s", "former_s", "sdpa_s", "speedup_vs_former",
                "op_vs_sdpa", "workspace_MiB", "former_chunk_MiB", "op_peak_MiB", "sdpa_peak_MiB", "fused_s",
                "sdpa_plus_scores_s", "fused_vs_sdpa_plus_scores", "fused_decay_0.98_s",
                "sdpa_plus_scores_decay_0.98_s", "fused_vs_sdpa_plus_scores_decay_0.98", "fused_workspace_MiB"]),
        ("keepkv_op", ["T", "window", "op_s", "former_s", "speedup_vs_former"]),
    ]:
        if any(r["part"] == part for r in rows):
            print_table([r for r in rows if r["part"] == part], columns)
    print("wrote", save([]))
    if not cuda:
        plot(rows, name, f"prefill with press / without ({args.model}, {args.device}, "
                         f"{threads_label(torch.get_num_threads())})")


if __name__ == "__main__":
    main()
