"""Streaming perplexity on real text (the WeightedKV paper's metric): the text is fed one token per forward, so every
press compresses during decoding, and the NLL of each next token is accumulated.

    python -m benchmarks.bench_streaming_ppl                      # SmolLM2 on CPU, Austen, m = 256 and 1024
    python -m benchmarks.bench_streaming_ppl --tokens 1024 --cache-sizes 256 --text python-docs

The first --prefill tokens (default 16) go in one forward (a short prompt: kvpress's DecodingPress leaves a prefill
alone, and ours compress it only beyond m); every later token is its own forward with the cache, at its absolute
position (cache_position and position_ids = t, as ``generate`` passes them, so RoPE positions do not shift when the
cache shrinks). Methods, at cache size m (slots per layer and kv head):

* full: no press (the reference; m does not apply).
* WeightedKV: ``WeightedKVPress(cache_size=m)`` (4 sinks, recent window m/2 - 4, evicted values merged).
* WeightedKV evict-only: the same with ``evict_only=True`` (the paper's ablation).
* ZSMerge: ``ZSMergePress(budget=m)``; "ZSMerge paper order" with ``eviction_order="paper"``.
* KeepKV: ``KeepKVPress(budget=m)`` (4 sinks, recent window 0.8 m, ZIP merges above cosine 0.8); "KeepKV convex" with
  ``convex=True`` (the authors' released code's key).
* StreamingLLM, TOVA: kvpress's scorer presses inside ``DecodingPress(base_press=..., compression_interval=1,
  target_size=m)``: every decoding forward cuts the cache back to m (DecodingPress tells prefill from decoding by
  cache_position, which is why positions are passed explicitly).

Reported: perplexity over all predicted tokens and over the tokens at positions >= m (where compression acts), the
largest layer length seen after any forward (must stay <= m), seconds per step, and the cumulative perplexity every
--checkpoint tokens (plotted).
"""

from __future__ import annotations

import argparse
import math
import time
from contextlib import nullcontext

import torch
from kvpress import DecodingPress, StreamingLLMPress, TOVAPress
from tqdm import tqdm
from transformers import DynamicCache

from benchmarks.common import positive_int, print_table, pyplot, save_figure, write_results
from kvpress_cpp.presses.keepkv import KeepKVPress
from kvpress_cpp.presses.weightedkv import WeightedKVPress
from kvpress_cpp.presses.zsmerge import ZSMergePress

METHODS = {
    "WeightedKV": lambda m: WeightedKVPress(cache_size=m),
    "WeightedKV evict-only": lambda m: WeightedKVPress(cache_size=m, evict_only=True),
    "ZSMerge": lambda m: ZSMergePress(budget=m),
    "ZSMerge paper order": lambda m: ZSMergePress(budget=m, eviction_order="paper"),
    "KeepKV": lambda m: KeepKVPress(budget=m),
    "KeepKV convex": lambda m: KeepKVPress(budget=m, convex=True),
    "StreamingLLM (kvpress)": lambda m: DecodingPress(base_press=StreamingLLMPress(), compression_interval=1,
                                                      target_size=m),
    "TOVA (kvpress)": lambda m: DecodingPress(base_press=TOVAPress(), compression_interval=1, target_size=m),
}


def text_ids(tokenizer, name: str, tokens: int) -> torch.Tensor:
    from kvpress_cpp.texts import austen_text, python_docs_text

    text = austen_text() if name == "austen" else python_docs_text(max_files=40)
    ids = tokenizer(text[: 8 * tokens], return_tensors="pt").input_ids[:, : tokens + 1]
    assert ids.shape[1] == tokens + 1, f"only {ids.shape[1]} tokens of {name}, wanted {tokens + 1}"
    return ids


def stream(model, ids: torch.Tensor, press, prefill: int, desc: str) -> dict:
    """NLL of ids[1:] fed as one prefill of `prefill` tokens then one token per forward."""
    tokens = ids.shape[1] - 1
    nll = torch.empty(tokens, dtype=torch.float64)
    cache = DynamicCache()
    max_slots, steps = 0, 0
    with torch.inference_mode(), (press(model) if press is not None else nullcontext()):
        positions = torch.arange(prefill)
        logits = model(ids[:, :prefill], past_key_values=cache, use_cache=True, position_ids=positions[None],
                       cache_position=positions).logits[0]
        nll[:prefill] = -logits.float().log_softmax(-1).gather(-1, ids[0, 1:prefill + 1, None])[:, 0].double()
        max_slots = max(layer.keys.shape[-2] for layer in cache.layers)
        start = time.perf_counter()
        for t in tqdm(range(prefill, tokens), desc=desc, unit="tok", leave=False, mininterval=5):
            position = torch.tensor([t])
            logits = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True, position_ids=position[None],
                           cache_position=position).logits[0, -1]
            nll[t] = -logits.float().log_softmax(-1)[ids[0, t + 1]].double()
            max_slots = max(max_slots, *(layer.keys.shape[-2] for layer in cache.layers))
            steps += 1
        seconds = time.perf_counter() - start
    return {"nll": nll, "max_slots": max_slots, "step_ms": 1e3 * seconds / max(steps, 1)}


def perplexity(nll: torch.Tensor) -> float:
    return math.exp(nll.mean().item()) if nll.numel() else float("nan")


def plot(rows: list[dict], title: str, name: str) -> None:
    plt = pyplot()
    sizes = sorted({r["cache_size"] for r in rows if r["cache_size"] is not None})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
    full = next((r for r in rows if r["method"] == "full"), None)
    for ax, size in zip(axes[0], sizes):
        if full is not None:
            ax.plot(full["checkpoints"], full["cumulative_ppl"], "k-", linewidth=2, label="full cache")
        for row in rows:
            if row["cache_size"] == size:
                ax.plot(row["checkpoints"], row["cumulative_ppl"], "-", label=row["method"])
        ax.axvline(size, color="gray", linewidth=0.8, linestyle=":")
        ax.set_title(f"cache size m = {size}")
        ax.set_xlabel("tokens")
        ax.set_ylabel("cumulative perplexity")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=positive_int, default=2048,
                        help="tokens predicted (the text holds tokens + 1)")
    parser.add_argument("--prefill", type=positive_int, default=16, help="tokens of the first forward")
    parser.add_argument("--cache-sizes", type=positive_int, nargs="+", default=[256, 1024])
    parser.add_argument("--methods", nargs="+", default=["full", *METHODS], choices=["full", *METHODS])
    parser.add_argument("--text", default="austen", choices=["austen", "python-docs"])
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="CPU threads (default 1: this VM's 2-thread OpenMP wake-ups make single-token forwards "
                             "slower)")
    parser.add_argument("--checkpoint", type=positive_int, default=32,
                        help="cumulative perplexity every this many tokens")
    parser.add_argument("--name", default=None, help="result file stem (default: streaming_ppl[_<text>])")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.prefill >= args.tokens:
        parser.error(f"--prefill ({args.prefill}) must be below --tokens ({args.tokens}): the first forward reads the "
                     f"text's first --prefill tokens, and the rest stream in one token per forward")
    if not set(args.methods) - {"full"}:
        parser.error("--methods: name at least one press beside 'full' (the plot compares them at each cache size)")

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    name = args.name or ("streaming_ppl" if args.text == "austen" else f"streaming_ppl_{args.text}")
    started = time.perf_counter()
    from kvpress_cpp.models import load_default_model

    model, tokenizer = load_default_model()
    ids = text_ids(tokenizer, args.text, args.tokens)
    runs = [("full", None)] if "full" in args.methods else []
    runs += [(method, size) for size in args.cache_sizes for method in args.methods if method != "full"]
    rows, full_nll = [], None
    for method, size in tqdm(runs, desc="runs", unit="run"):
        press = None if method == "full" else METHODS[method](size)
        result = stream(model, ids, press, args.prefill, f"{method} m={size}")
        nll = result["nll"]
        if method == "full":
            full_nll = nll
        checkpoints = list(range(args.checkpoint, args.tokens + 1, args.checkpoint))
        cumulative = (nll.cumsum(0) / torch.arange(1, args.tokens + 1)).exp()
        row = {"text": args.text, "tokens": args.tokens, "prefill": args.prefill, "threads": args.threads,
               "method": method, "cache_size": size, "ppl": round(perplexity(nll), 3),
               "ppl_beyond_m": round(perplexity(nll[size:]), 3) if size else None,
               "max_slots": result["max_slots"], "step_ms": round(result["step_ms"], 1),
               "finite": bool(torch.isfinite(nll).all()),
               "checkpoints": checkpoints, "cumulative_ppl": [round(cumulative[c - 1].item(), 3) for c in checkpoints]}
        if size is not None and row["max_slots"] > size:
            print(f"WARNING: {method} m={size} held {row['max_slots']} slots after a forward")
        if not row["finite"]:
            print(f"WARNING: {method} m={size}: non-finite NLL at tokens "
                  f"{torch.nonzero(~torch.isfinite(nll))[:10, 0].tolist()}")
        rows.append(row)
    if full_nll is not None:
        for row in rows:
            if row["cache_size"] is not None:
                row["full_ppl_beyond_m"] = round(perplexity(full_nll[row["cache_size"]:]), 3)
    print_table(rows, ["method", "cache_size", "ppl", "ppl_beyond_m", "full_ppl_beyond_m", "max_slots", "step_ms",
                       "finite"])
    print("wrote", write_results(name, rows))
    plot(rows, f"streaming perplexity, SmolLM2-135M, {args.text}, {args.tokens} tokens\n(prefill {args.prefill}, "
               f"then one token per forward)", name)
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
