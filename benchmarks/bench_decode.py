"""End-to-end greedy generation with a compressing press against the full cache: prefill seconds, decode tokens/s and
the KV bytes held.

    python -m benchmarks.bench_decode                       # SmolLM2 on CPU, Austen prompts of 1k/2k/4k tokens
    python -m benchmarks.bench_decode --device cuda --model random-llama3-8b    # 8k-32k random-token prompts
    python -m benchmarks.bench_decode --model random-llama-tiny --budgets 0.25    # smoke test of the random-model path
    python -m benchmarks.bench_decode --methods KVzap --name decode_kvzap       # KVzap at its default τ (SmolLM2)

Each case runs ``model.generate`` (greedy, min_new_tokens = max_new_tokens = 64) with a fresh ``DynamicCache``, under
``with press(model):`` for ZSMergePress(budget=f), WeightedKVPress(cache_size=f) and KeepKVPress(budget=f), f = 10%
and 25% of the prompt (``--methods KVzap``: KVzapThresholdPress at its default τ, once per prompt, ``removed`` = the
ratio it reached), and without a press ("full"). A logits processor, called once after every forward, records the time and
``cache_bytes(cache)`` (keys, values and per-slot state) and the longest layer: prefill seconds is the time to the
first call (the prompt's forward, compression included), decode tokens/s is (n - 1) / (time from the first call to
the last), each the best of --repeats runs, and the peak bytes is the largest value seen after a forward (the press has compressed by then; the
one-slot overshoot inside a forward is not seen). ``match_full`` is the fraction of generated tokens equal to the
full cache's. The issue's target: decode tokens/s at 32k with a 10% budget >= 2x the full cache's (GPU, Llama-3-8B
shaped model).
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from benchmarks.common import positive_int, prompt_fraction, print_table, pyplot, save_figure, write_results
from kvpress_cpp.cache import cache_bytes
from kvpress_cpp.presses.keepkv import KeepKVPress
from kvpress_cpp.presses.kvzap import KVzapThresholdPress, has_packaged_surrogate
from kvpress_cpp.presses.weightedkv import WeightedKVPress
from kvpress_cpp.presses.zsmerge import ZSMergePress

MODELS = {  # name -> (LlamaConfig kwargs or None for the embedded SmolLM2, default prompt lengths)
    "smollm2": (None, [1024, 2048, 4096]),
    "random-llama3-8b": (dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                              intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
                              rope_theta=500000.0), [8192, 16384, 32768]),
    "random-llama-tiny": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=128, vocab_size=1000, max_position_embeddings=4096), [256, 512]),
}


def build_model(name: str, device: str, dtype: torch.dtype):
    """(model, tokenizer or None): the embedded SmolLM2, or a randomly initialised Llama built on `device`."""
    if name == "smollm2":
        from kvpress_cpp.models import load_default_model

        return load_default_model(dtype=dtype, device=device)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODELS[name][0], attn_implementation="sdpa", bos_token_id=0, eos_token_id=1,
                         pad_token_id=0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the target dtype, on the target device (no fp32 copy of 8B)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval(), None


def prompt_ids(tokenizer, length: int, vocab_size: int, device: str, batch: int = 1) -> torch.Tensor:
    """(batch, length) prompts: consecutive `length`-token passages of Austen's novels from the start, or random token
    ids for a random model."""
    if tokenizer is None:
        generator = torch.Generator().manual_seed(length)
        return torch.randint(2, vocab_size, (batch, length), generator=generator).to(device)
    from kvpress_cpp.texts import austen_text

    text = austen_text()[: 8 * length * batch]  # ~4.3 characters per token: enough for `length` tokens a row
    ids = tokenizer(text, return_tensors="pt").input_ids[0, : length * batch]
    assert ids.numel() == length * batch, f"only {ids.numel()} tokens of Austen, wanted {batch} x {length}"
    return ids.view(batch, length).to(device)


class StepRecorder(LogitsProcessor):
    """Called by generate after every forward: records the time, the cache's bytes and its longest layer."""

    def __init__(self, cache, device: str):
        self.cache, self.cuda = cache, device.startswith("cuda")
        self.times, self.bytes, self.slots = [], [], []

    def __call__(self, input_ids, scores):
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        self.bytes.append(cache_bytes(self.cache))
        self.slots.append(max(layer.keys.shape[-2] for layer in self.cache.layers))
        return scores


PRESSES = {
    "ZSMerge": lambda fraction: ZSMergePress(budget=fraction),
    "WeightedKV": lambda fraction: WeightedKVPress(cache_size=fraction),
    "KeepKV": lambda fraction: KeepKVPress(budget=fraction),
}
# Presses whose threshold, not a budget, decides what they keep: run once per prompt, at their default τ, with the
# surrogates packaged for the model (SmolLM2 only, unless kvpress_cpp/surrogates has others).
THRESHOLDED = {"KVzap": KVzapThresholdPress}


def presses(budgets: list[float], methods: list[str] = tuple(PRESSES)):
    yield "full", None, None
    for method in methods:
        if method in THRESHOLDED:
            yield method, None, THRESHOLDED[method]()
    for fraction in budgets:
        for method in methods:
            if method in PRESSES:
                yield method, fraction, PRESSES[method](fraction)


def generate(model, ids, press, new_tokens: int, device: str, pad_token_id: int):
    cache = DynamicCache()
    recorder = StepRecorder(cache, device)
    kwargs = dict(attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                  pad_token_id=pad_token_id, logits_processor=LogitsProcessorList([recorder]))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        if press is None:
            out = model.generate(ids, **kwargs)
        else:
            with press(model):
                out = model.generate(ids, **kwargs)
    generated = out[0, ids.shape[1]:].tolist()
    times = recorder.times
    return {"prefill_s": times[0] - start,
            "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
            "peak_kv_bytes": max(recorder.bytes), "max_slots": max(recorder.slots),
            "generated": len(generated)}, generated


def expected_slots(press, length: int) -> int | None:
    if isinstance(press, ZSMergePress):
        return sum(press.split(length))
    if isinstance(press, WeightedKVPress):
        return press.regions(length)[0]
    if isinstance(press, KeepKVPress):
        return press.layer_budget(length, 0, 1)
    return None


def plot(rows: list[dict], name: str, title: str) -> None:
    plt = pyplot()
    fig, (ax_speed, ax_bytes) = plt.subplots(1, 2, figsize=(11, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        points = [r for r in rows if r["method"] == method]
        lengths = [r["prompt"] for r in points]
        style = "o-" if method == "full" else ("s--" if method.startswith("ZSMerge") else "^:")
        ax_speed.plot(lengths, [r["decode_tok_s"] for r in points], style, label=method)
        ax_bytes.plot(lengths, [r["peak_kv_bytes"] / 2**20 for r in points], style, label=method)
    for ax in (ax_speed, ax_bytes):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.legend(fontsize=7)
    ax_speed.set_ylabel("decode tokens/s")
    ax_bytes.set_ylabel("peak KV cache MiB (keys, values, state)")
    ax_bytes.set_yscale("log")
    fig.suptitle(title)
    save_figure(fig, name)


def model_arguments(description: str) -> argparse.ArgumentParser:
    """A parser with the options every end-to-end benchmark shares: --device, --model, --dtype, --lengths,
    --threads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=None,
                        help="prompt lengths (default per model)")
    parser.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: all)")
    return parser


def model_dtype(args: argparse.Namespace) -> torch.dtype:
    """--dtype, or float32 on CPU and bfloat16 on CUDA; also applies --threads."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dtype:
        return getattr(torch, args.dtype)
    return torch.bfloat16 if args.device.startswith("cuda") else torch.float32


def main() -> None:
    parser = model_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=prompt_fraction, nargs="+", default=[0.1, 0.25],
                        help="fractions of the prompt")
    parser.add_argument("--methods", nargs="+", default=list(PRESSES), choices=[*PRESSES, *THRESHOLDED])
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument("--name", default=None, help="result file stem (default: decode, or decode_<model>_<device>)")
    parser.add_argument("--repeats", type=positive_int, default=2, help="runs per case; the best time is kept")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    dtype = model_dtype(args)
    name = args.name or ("decode" if (args.model, args.device) == ("smollm2", "cpu") else
                         f"decode_{args.model}_{args.device}")
    lengths = args.lengths or MODELS[args.model][1]
    started = time.perf_counter()
    model, tokenizer = build_model(args.model, args.device, dtype)
    for method in (m for m in args.methods if m in THRESHOLDED):
        if not has_packaged_surrogate(model, THRESHOLDED[method].model_type):
            parser.error(f"--methods {method}: no packaged surrogate for --model {args.model} (SmolLM2's are packaged)")
    pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
    print(f"model {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {dtype}) on "
          f"{args.device}, built in {time.perf_counter() - started:.1f} s")

    # Warm-up: one short generation per press type (allocator, kernels, lazy imports), on the fewest slots asked for,
    # so that a press refusing a budget too small for it does so before the timed runs, naming the options.
    warm = prompt_ids(tokenizer, min(lengths), model.config.vocab_size, args.device)
    for method, fraction, press in presses([min(args.budgets)], args.methods):
        try:
            generate(model, warm, press, 4, args.device, pad_token_id)
        except ValueError as error:
            budget = "" if fraction is None else f" at --budgets {fraction}"
            parser.error(f"--methods {method}{budget} of --lengths {min(lengths)}: {error}")

    cases = [(length, case) for length in lengths for case in presses(args.budgets, args.methods)]
    rows, reference = [], {}
    for length, (method, fraction, press) in tqdm(cases, desc="generate", unit="run"):
        ids = prompt_ids(tokenizer, length, model.config.vocab_size, args.device)
        runs = [generate(model, ids, press, args.new_tokens, args.device, pad_token_id) for _ in range(args.repeats)]
        result, generated = runs[0]
        assert all(g == generated for _, g in runs), f"{method}: greedy generations differ between repeats"
        result["prefill_s"] = min(r["prefill_s"] for r, _ in runs)  # best of the repeats (noisy shared VM)
        result["decode_tok_s"] = max(r["decode_tok_s"] for r, _ in runs)
        if press is None:
            reference[length] = generated
        full = reference.get(length)
        row = {"model": args.model, "device": args.device, "threads": torch.get_num_threads(),
               "dtype": str(dtype)[6:], "repeats": args.repeats, "prompt": length, "new_tokens": args.new_tokens,
               "method": method if fraction is None else f"{method} {fraction:.0%}", "budget_fraction": fraction,
               "budget_slots": expected_slots(press, length), **result}
        row["prefill_s"] = round(row["prefill_s"], 3)
        row["decode_tok_s"] = round(row["decode_tok_s"], 2)
        row["peak_kv_mib"] = round(row["peak_kv_bytes"] / 2**20, 2)
        if full is not None:
            row["match_full"] = round(sum(a == b for a, b in zip(generated, full)) / len(full), 3)
        if method in THRESHOLDED:
            row["removed"] = round(press.compression_ratio, 3)
        if row["budget_slots"] is not None and row["max_slots"] > row["budget_slots"]:
            print(f"WARNING: {row['method']} at {length} held {row['max_slots']} slots > budget {row['budget_slots']}")
        rows.append(row)
        write_results(name, rows)  # so far: a run cut short (make gpu-check's time limit) keeps its finished cases
    for row in rows:
        full = next(r for r in rows if r["prompt"] == row["prompt"] and r["method"] == "full")
        row["decode_speedup_vs_full"] = round(row["decode_tok_s"] / full["decode_tok_s"], 2)
        row["kv_fraction_of_full"] = round(row["peak_kv_bytes"] / full["peak_kv_bytes"], 3)
    print_table(rows, ["prompt", "method", "budget_slots", "removed", "max_slots", "prefill_s", "decode_tok_s",
                       "decode_speedup_vs_full", "peak_kv_mib", "kv_fraction_of_full", "match_full"])
    print("wrote", write_results(name, rows))
    plot(rows, name, f"{args.model} on {args.device} ({torch.get_num_threads()} threads, {str(dtype)[6:]}), "
                     f"greedy, {args.new_tokens} new tokens")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
