"""Options of our presses on the demo's needle question (a passphrase hidden in Austen, asked through SmolLM2's chat
template: kvpress_cpp.tasks), question-aware: the question is part of the compressed prompt, as the papers measure
(LongBench style). Each configuration answers the question at several needle depths; reported per configuration:
each answer, how many were answered, and for GVote the paper's kept fraction (mean over heads) and the memory the
compacted cache holds.

    python -m benchmarks.bench_needle_options --group gvote         # GVote's sinks / recent window / budget options
    python -m benchmarks.bench_needle_options --group streaming     # one-shot vs streamed prefill, ZSMerge order

Small on purpose (a handful of examples per configuration, one thread): it chooses defaults between options, and
the README says how few examples stand behind each choice.
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from benchmarks.common import positive_int, print_table, pyplot, save_figure, write_results
from kvpress_cpp.models import load_default_model
from kvpress_cpp.presses.gvote import GVotePress
from kvpress_cpp.presses.weightedkv import WeightedKVPress
from kvpress_cpp.presses.zsmerge import ZSMergePress
from kvpress_cpp.tasks import HiddenFact, hidden_fact_prompt

#: KV budget of the streaming group: a quarter of the prompt, in tokens (a streamed prompt needs a token count).
STREAMING_BUDGET = 0.25
STREAM_CHUNK = 128

# Per group: configuration name -> press factory of the prompt's token count.
GROUPS = {
    "gvote": {
        "paper (union only)": lambda tokens: GVotePress(),
        "+ 4 sinks": lambda tokens: GVotePress(keep_sinks=True),
        "+ 4 sinks, recent 32": lambda tokens: GVotePress(keep_sinks=True, recent=32),
        "+ 4 sinks, budget over last 16 queries": lambda tokens: GVotePress(keep_sinks=True, budget_queries=16),
        "+ 4 sinks, recent 32, budget over last 16": lambda tokens: GVotePress(keep_sinks=True, recent=32,
                                                                               budget_queries=16),
    },
    "streaming": {
        "ZSMerge one-shot": lambda tokens: ZSMergePress(budget=round(STREAMING_BUDGET * tokens)),
        "ZSMerge one-shot, paper order": lambda tokens: ZSMergePress(budget=round(STREAMING_BUDGET * tokens),
                                                                     eviction_order="paper"),
        f"ZSMerge streamed ({STREAM_CHUNK})": lambda tokens: ZSMergePress(budget=round(STREAMING_BUDGET * tokens),
                                                                          prefill_chunk_size=STREAM_CHUNK),
        "WeightedKV one-shot": lambda tokens: WeightedKVPress(cache_size=round(STREAMING_BUDGET * tokens)),
        f"WeightedKV streamed ({STREAM_CHUNK})": lambda tokens: WeightedKVPress(
            cache_size=round(STREAMING_BUDGET * tokens), prefill_chunk_size=STREAM_CHUNK),
    },
}


def plot(rows: list[dict], group: str) -> None:
    """Per configuration: the fraction of needle questions answered and, for GVote, the kept and held fractions."""
    plt = pyplot()
    names = [row["configuration"] for row in rows]
    series = {"answered": [row["answered"] / row["examples"] for row in rows]}
    if "memory_held" in rows[0]:
        series |= {"kept (mean over heads)": [row["kept_mean_over_heads"] for row in rows],
                   "memory held": [row["memory_held"] for row in rows]}
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 1.5))
    height = 0.8 / len(series)
    for k, (label, values) in enumerate(series.items()):
        ax.barh([i + k * height for i in range(len(rows))], values, height=height, label=label)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(rows))], names)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("fraction")
    ax.set_title(f"SmolLM2-135M needle question, {rows[0]['context_tokens']}-token context ({group})")
    ax.legend(loc="upper right")
    save_figure(fig, f"needle_options_{group}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", choices=list(GROUPS), required=True)
    parser.add_argument("--depths", type=float, nargs="+", default=[0.2, 0.5, 0.8])
    parser.add_argument("--context-tokens", type=positive_int, default=2000)
    parser.add_argument("--threads", type=positive_int, default=1)
    args = parser.parse_args()
    if bad := [depth for depth in args.depths if not 0 <= depth <= 1]:
        parser.error(f"--depths are fractions of the context, 0 (start) to 1 (end): got {bad}")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_default_model()
    fact = HiddenFact()
    rows = []
    for name, make_press in GROUPS[args.group].items():
        answers, kept, held = [], [], []
        for depth in args.depths:
            inputs = tokenizer(hidden_fact_prompt(tokenizer, args.context_tokens, depth, fact), return_tensors="pt")
            press = make_press(inputs.input_ids.shape[1])
            with torch.no_grad(), press(model):
                out = model.generate(**inputs, past_key_values=DynamicCache(), max_new_tokens=12, do_sample=False)
            answer = tokenizer.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)
            answers.append(answer)
            if isinstance(press, GVotePress):
                kept.append(1 - press.compression_ratio)
                held.append(1 - press.memory_compression_ratio)
            print(f"{name} depth {depth}: {answer!r}", flush=True)
        answered = [fact.answer in answer for answer in answers]
        row = {"configuration": name, "context_tokens": args.context_tokens, "depths": args.depths,
               "answered": sum(answered), "examples": len(answered), "answered_per_depth": answered,
               "answers_per_depth": answers}
        if kept:
            row |= {"kept_mean_over_heads": round(sum(kept) / len(kept), 3),
                    "memory_held": round(sum(held) / len(held), 3)}
        rows.append(row)
    print_table(rows, ["configuration", "answered", "examples", "kept_mean_over_heads", "memory_held"])
    write_results(f"needle_options_{args.group}", rows)
    plot(rows, args.group)


if __name__ == "__main__":
    main()
