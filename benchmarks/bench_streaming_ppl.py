"""Streaming perplexity on real text (the WeightedKV paper's metric): the text is fed one token per forward, so every
press compresses during decoding, and the NLL of each next token is accumulated, over several excerpts of the text.

    python -m benchmarks.bench_streaming_ppl                      # SmolLM2 on CPU, Austen, m = 256 and 1024
    python -m benchmarks.bench_streaming_ppl --tokens 640 --cache-sizes 256 --windows 6 --name streaming_ppl_windows
    python -m benchmarks.bench_streaming_ppl --tokens 1024 --cache-sizes 256 --text python-docs

--windows N excerpts (windows) of --tokens + 1 tokens each are read at evenly spaced character offsets across the
whole text (Austen: all six novels), each offset moved forward to the next paragraph start, so that the windows are
different passages and each opens as text does (and back, to end within its novel, when it would run into the next
one); window 0 is the text's opening (--windows 1 is the single excerpt of the earlier runs). Each window streams on
its own, from a fresh cache. The first --prefill tokens (default 16) go in one forward (a short prompt: kvpress's
DecodingPress leaves a prefill alone, and ours compress it only beyond m); every later token is its own forward with
the cache, at its absolute position (cache_position and position_ids = t, as ``generate`` passes them, so RoPE
positions do not shift when the cache shrinks). Methods, at cache size m (slots per layer and kv head):

* full: no press (the reference; m does not apply).
* WeightedKV: ``WeightedKVPress(cache_size=m)`` (4 sinks, recent window m/2 - 4, evicted values merged).
* WeightedKV evict-only: the same with ``evict_only=True`` (the paper's ablation).
* ZSMerge: ``ZSMergePress(budget=m)``; "ZSMerge paper order" with ``eviction_order="paper"``.
* KeepKV: ``KeepKVPress(budget=m)`` (4 sinks, recent window 0.8 m, ZIP merges above cosine 0.8); "KeepKV convex" with
  ``convex=True`` (the authors' released code's key).
* StreamingLLM, TOVA: kvpress's scorer presses inside ``DecodingPress(base_press=..., compression_interval=1,
  target_size=m)``: every decoding forward cuts the cache back to m (DecodingPress tells prefill from decoding by
  cache_position, which is why positions are passed explicitly). This is not StreamingLLM's cache: ScorerPress
  gathers the kept slots in ``topk``'s order, which for StreamingLLM's tied scores is not the cache's, and
  StreamingLLMPress scores by slot index (slots 0-3 the sinks, the next ones the oldest), so from the second
  compression on it evicts whatever the shuffle put there: after 100 tokens at m = 32 it holds 20 of positions 1-31
  (not 0) and 88-99, none of 32-87.
* StreamingLLM (kvpress, order kept): the same DecodingPress and StreamingLLMPress, with the kept slots gathered in
  cache order (:class:`OrderedStreamingLLMPress`), so that it holds what StreamingLLM holds: 4 sinks and the last
  m - 4 tokens.

Reported per method, pooled over the windows: the perplexity over the tokens at positions >= m (the headline: only
there does compression act; before m every press holds the whole text so far and equals the full cache), the
perplexity over all predicted tokens, and for each press the paired difference of mean NLL per token beyond m
(nats/token) against StreamingLLM (kvpress) and against the full cache, with a 95% interval from a paired block
bootstrap: the tokens beyond m of each window are cut into blocks of --block tokens (neighbouring tokens' NLLs are
correlated, so single tokens would give too narrow an interval), and --resamples times all windows' blocks are drawn
with replacement, the same draws for every method, each draw's difference being its summed NLL differences over its
summed tokens (a percentile interval). Also the largest layer length seen after any forward (must stay <= m), seconds
per step, every other pairwise difference beyond m (``diffs``: each press against each other press at the same m, the
same bootstrap), the cumulative perplexity every --checkpoint tokens pooled over the windows, and per window its
offset, perplexities, curve and per-block NLL sums beyond m (the full cache: beyond each m; the bootstrap's input, so
the intervals can be recomputed from the JSON). The plot: the difference against both StreamingLLMs with its interval,
beside the pooled cumulative curves over the full cache's.
"""

from __future__ import annotations

import argparse
import math
import time
from contextlib import nullcontext

import torch
from kvpress import DecodingPress, StreamingLLMPress, TOVAPress
from kvpress.utils import compute_n_kept
from tqdm import tqdm
from transformers import DynamicCache

from benchmarks.common import positive_int, print_table, pyplot, save_figure, write_results
from kvpress_cpp.evaluation.results import format_difference
from kvpress_cpp.presses.keepkv import KeepKVPress
from kvpress_cpp.presses.weightedkv import WeightedKVPress
from kvpress_cpp.presses.zsmerge import ZSMergePress

class OrderedStreamingLLMPress(StreamingLLMPress):
    """kvpress's StreamingLLMPress with the kept slots gathered in cache order: ScorerPress.compress gathers them in
    ``topk``'s order, which StreamingLLM's tied scores leave unspecified, while its score assumes slot i is the i-th
    oldest token; sorting the kept indices keeps that true from one compression to the next."""

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        kept = scores.topk(compute_n_kept(keys.shape[2], self.compression_ratio), dim=-1).indices.sort(-1).values
        kept = kept.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
        return keys.gather(2, kept).contiguous(), values.gather(2, kept).contiguous()


METHODS = {
    "WeightedKV": lambda m: WeightedKVPress(cache_size=m),
    "WeightedKV evict-only": lambda m: WeightedKVPress(cache_size=m, evict_only=True),
    "ZSMerge": lambda m: ZSMergePress(budget=m),
    "ZSMerge paper order": lambda m: ZSMergePress(budget=m, eviction_order="paper"),
    "KeepKV": lambda m: KeepKVPress(budget=m),
    "KeepKV convex": lambda m: KeepKVPress(budget=m, convex=True),
    "StreamingLLM (kvpress)": lambda m: DecodingPress(base_press=StreamingLLMPress(), compression_interval=1,
                                                      target_size=m),
    "StreamingLLM (kvpress, order kept)": lambda m: DecodingPress(base_press=OrderedStreamingLLMPress(),
                                                                  compression_interval=1, target_size=m),
    "TOVA (kvpress)": lambda m: DecodingPress(base_press=TOVAPress(), compression_interval=1, target_size=m),
}


REFERENCE = "StreamingLLM (kvpress)"  # the baseline the merging papers compare against
ORDERED_REFERENCE = "StreamingLLM (kvpress, order kept)"  # what StreamingLLM holds (see the docstring)


def paragraph_start(text: str, offset: int) -> int:
    """The first paragraph start (a line after a blank line) at or after `offset`; a line start when none follows."""
    if offset == 0:
        return 0
    found = text.find("\n\n", offset)
    start = found + 2 if found >= 0 else text.find("\n", offset) + 1
    while start < len(text) and text[start] == "\n":
        start += 1
    return start


def text_windows(tokenizer, name: str, tokens: int, windows: int) -> list[dict]:
    """`windows` excerpts of tokens + 1 tokens, at evenly spaced character offsets k / windows across the whole text,
    each moved to the next paragraph start (a token offset into the tokenized text would open windows mid-word), and
    moved back to end within its novel when it would run past the novel's end (into the next novel's title page)."""
    from kvpress_cpp.texts import AUSTEN_NOVELS, austen_novel, python_docs_text

    documents = [austen_novel(n) for n in AUSTEN_NOVELS] if name == "austen" else [python_docs_text(max_files=40)]
    ends = torch.tensor([len(d) + 2 for d in documents]).cumsum(0).tolist()  # austen_text() joins them with "\n\n"
    out = []
    for k in range(windows):
        offset = k * ends[-1] // windows
        d = next(i for i, end in enumerate(ends) if offset < end)
        document, local = documents[d], offset - (ends[d - 1] if d else 0)
        start = paragraph_start(document, local)
        ids = tokenizer(document[start:start + 8 * tokens], return_tensors="pt").input_ids[:, :tokens + 1]
        if ids.shape[1] <= tokens:  # too near the end: take the novel's last paragraphs instead
            start = paragraph_start(document, max(0, len(document) - 8 * tokens))
            ids = tokenizer(document[start:start + 8 * tokens], return_tensors="pt").input_ids[:, :tokens + 1]
        assert ids.shape[1] == tokens + 1, \
            f"only {ids.shape[1]} tokens of {name} from character {start}, wanted {tokens + 1}"
        out.append({"document": AUSTEN_NOVELS[d] if name == "austen" else name, "start_char": start,
                    "opening": document[start:start + 60], "ids": ids})
    return out


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


def block_sums(nll: torch.Tensor, start: int, block: int) -> torch.Tensor:
    """Sums of nll[start:] over consecutive blocks of `block` tokens (the last one may be shorter)."""
    return torch.stack([part.sum() for part in nll[start:].split(block)]) if nll.shape[0] > start else nll.new_zeros(0)


def paired_bootstrap(nll: torch.Tensor, reference: torch.Tensor, start: int, block: int,
                     draws: torch.Tensor) -> dict:
    """Mean NLL per token of `nll` minus `reference` (both (windows, tokens)) over the tokens at positions >= start,
    and its 95% percentile interval from the block resamples `draws` (resamples, blocks), indices into every
    window's blocks in turn."""
    sums = torch.cat([block_sums(a - b, start, block) for a, b in zip(nll, reference)])
    counts = torch.cat([block_sums(torch.ones_like(a), start, block) for a in nll])
    resampled = sums[draws].sum(1) / counts[draws].sum(1)
    lo, hi = torch.quantile(resampled, torch.tensor([0.025, 0.975], dtype=resampled.dtype)).tolist()
    return {"nats_per_token": round((sums.sum() / counts.sum()).item(), 4), "ci95": [round(lo, 4), round(hi, 4)]}


def plot(rows: list[dict], title: str, name: str) -> None:
    """Per cache size: the difference of mean NLL beyond m against kvpress's StreamingLLM and against it with its
    order kept (the full cache's too), with 95% intervals, beside the cumulative perplexity pooled over the windows,
    over the full cache's."""
    plt = pyplot()
    sizes = sorted({r["cache_size"] for r in rows if r["cache_size"] is not None})
    fig, axes = plt.subplots(len(sizes), 2, figsize=(13, 4.5 * len(sizes)), squeeze=False)
    full = next((r for r in rows if r["method"] == "full"), None)
    for (bars, curves), size in zip(axes, sizes):
        at = [r for r in rows if r["cache_size"] == size]
        labels = [r["method"] for r in at] + (["full cache"] if full is not None else [])
        references = [r for r in at if r["method"] in (REFERENCE, ORDERED_REFERENCE)]

        def plot_differences(points, shift, label):
            if not points:
                return
            mean = [d["nats_per_token"] for _, d in points]
            err = [[m - d["ci95"][0] for m, (_, d) in zip(mean, points)],
                   [d["ci95"][1] - m for m, (_, d) in zip(mean, points)]]
            bars.errorbar(mean, [i + shift for i, _ in points], xerr=err, fmt="o" if shift < 0 else "s", capsize=3,
                          label=label)

        for shift, reference in zip((-0.12, 0.12), references):
            points = [(i, r["diffs"][reference["method"]]) for i, r in enumerate(at)
                      if reference["method"] in r.get("diffs", {})]
            if reference.get("diff_vs_full"):  # full − reference: the same draws, negated
                d = reference["diff_vs_full"]
                points.append((len(at), {"nats_per_token": -d["nats_per_token"],
                                         "ci95": [-d["ci95"][1], -d["ci95"][0]]}))
            plot_differences(points, shift, f"− {reference['method']}")
        if not references:  # no StreamingLLM in the run: each press against the full cache
            plot_differences([(i, r["diff_vs_full"]) for i, r in enumerate(at) if r.get("diff_vs_full")], -0.12,
                             "− full cache")
        bars.set_yticks(range(len(labels)), labels, fontsize=8)
        bars.axvline(0, color="gray", linewidth=0.8)
        bars.invert_yaxis()
        bars.set_xlabel("difference of mean NLL beyond m (nats/token)")
        baseline = "StreamingLLM" if references else "the full cache"
        bars.set_title(f"m = {size}: difference vs {baseline}, paired block bootstrap 95%", fontsize=9)
        if bars.get_legend_handles_labels()[0]:
            bars.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)  # clear of the bars
        # Over the full cache's curve where there is one: the presses' curves, all within a few percent of it, are
        # one line on a plot of perplexity itself (before m every press equals the full cache).
        base = full["cumulative_ppl"] if full is not None else None
        for row in at:
            curve = row["cumulative_ppl"] if base is None else [a / b for a, b in zip(row["cumulative_ppl"], base)]
            curves.plot(row["checkpoints"], curve, "-", label=row["method"])
        if base is not None:
            curves.axhline(1, color="k", linewidth=2, label="full cache")
        curves.axvline(size, color="gray", linewidth=0.8, linestyle=":")
        curves.set_title(f"cache size m = {size}: cumulative perplexity pooled over the windows", fontsize=9)
        curves.set_xlabel("tokens into each window")
        curves.set_ylabel("cumulative perplexity" + (" / the full cache's" if base is not None else ""))
        curves.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=positive_int, default=2048,
                        help="tokens predicted per window (each window holds tokens + 1)")
    parser.add_argument("--windows", type=positive_int, default=6,
                        help="excerpts of the text, at evenly spaced offsets, each streamed from a fresh cache")
    parser.add_argument("--prefill", type=positive_int, default=16, help="tokens of the first forward")
    parser.add_argument("--cache-sizes", type=positive_int, nargs="+", default=[256, 1024])
    parser.add_argument("--methods", nargs="+", default=["full", *METHODS], choices=["full", *METHODS])
    parser.add_argument("--text", default="austen", choices=["austen", "python-docs"])
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="CPU threads (default 1: this VM's 2-thread OpenMP wake-ups make single-token forwards "
                             "slower)")
    parser.add_argument("--checkpoint", type=positive_int, default=32,
                        help="cumulative perplexity every this many tokens")
    parser.add_argument("--block", type=positive_int, default=32, help="tokens per bootstrap block")
    parser.add_argument("--resamples", type=positive_int, default=2000, help="bootstrap resamples")
    parser.add_argument("--name", default=None,
                        help="result file stem (default: streaming_ppl[_<text>] for one window, "
                             "streaming_ppl_windows[_<text>] for several, which never replace a one-excerpt file)")
    parser.add_argument("--seed", type=int, default=0, help="torch's seed and the bootstrap's")
    args = parser.parse_args()
    if args.prefill >= args.tokens:
        parser.error(f"--prefill ({args.prefill}) must be below --tokens ({args.tokens}): the first forward reads the "
                     f"text's first --prefill tokens, and the rest stream in one token per forward")
    if too_large := [size for size in args.cache_sizes if size > args.tokens - 2 * args.block]:
        # beyond m is what is measured, and one block gives the bootstrap a zero-width interval (none beyond: NaN)
        parser.error(f"--cache-sizes {too_large}: each must leave at least two --block blocks ({2 * args.block} "
                     f"tokens) of the --tokens {args.tokens} beyond it")
    if not set(args.methods) - {"full"}:
        parser.error("--methods: name at least one press beside 'full' (the plot compares them at each cache size)")

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    stem = "streaming_ppl" if args.windows == 1 else "streaming_ppl_windows"
    name = args.name or (stem if args.text == "austen" else f"{stem}_{args.text}")
    started = time.perf_counter()
    from kvpress_cpp.models import load_default_model

    model, tokenizer = load_default_model()
    windows = text_windows(tokenizer, args.text, args.tokens, args.windows)
    runs = [("full", None)] if "full" in args.methods else []
    runs += [(method, size) for size in args.cache_sizes for method in args.methods if method != "full"]
    rows, nlls = [], {}
    checkpoints = list(range(args.checkpoint, args.tokens + 1, args.checkpoint))
    for method, size in tqdm(runs, desc="runs", unit="run"):
        per_window, results = [], []
        for k, window in enumerate(windows):
            press = None if method == "full" else METHODS[method](size)  # a fresh press per window, as a fresh cache
            results.append(stream(model, window["ids"], press, args.prefill, f"{method} m={size} window {k}"))
        nll = torch.stack([result["nll"] for result in results])  # (windows, tokens)
        nlls[method, size] = nll
        for k, (window, result) in enumerate(zip(windows, results)):
            cumulative = (result["nll"].cumsum(0) / torch.arange(1, args.tokens + 1)).exp()
            per_window.append({
                "window": k, "document": window["document"], "start_char": window["start_char"],
                "opening": window["opening"],
                "ppl": round(perplexity(result["nll"]), 3),
                "ppl_beyond_m": round(perplexity(result["nll"][size:]), 3) if size else None,
                "max_slots": result["max_slots"], "step_ms": round(result["step_ms"], 1),
                "cumulative_ppl": [round(cumulative[c - 1].item(), 3) for c in checkpoints],
                # The bootstrap's input: this window's NLL summed over each block of tokens beyond m.
                "block_nll_sums": [round(x, 5) for x in block_sums(result["nll"], size, args.block).tolist()]
                if size else None})
            if size is None:  # the full cache has no m of its own: its figures beyond each m compared against
                per_window[-1]["beyond"] = {
                    str(m): {"ppl_beyond_m": round(perplexity(result["nll"][m:]), 3),
                             "block_nll_sums": [round(x, 5) for x in block_sums(result["nll"], m, args.block).tolist()]}
                    for m in args.cache_sizes}
        # Pooled over windows: the mean over every window's first c tokens, not a mean of the windows' perplexities.
        cumulative = (nll.sum(0).cumsum(0) / (nll.shape[0] * torch.arange(1, args.tokens + 1))).exp()
        row = {"text": args.text, "tokens": args.tokens, "windows": args.windows, "prefill": args.prefill,
               "threads": args.threads, "method": method, "cache_size": size, "ppl": round(perplexity(nll), 3),
               "ppl_beyond_m": round(perplexity(nll[:, size:]), 3) if size else None,
               "max_slots": max(r["max_slots"] for r in results),
               "step_ms": round(sum(r["step_ms"] for r in results) / len(results), 1),
               "finite": bool(torch.isfinite(nll).all()),
               "checkpoints": checkpoints, "cumulative_ppl": [round(cumulative[c - 1].item(), 3) for c in checkpoints],
               "block": args.block, "resamples": args.resamples, "seed": args.seed, "per_window": per_window}
        if size is not None and row["max_slots"] > size:
            print(f"WARNING: {method} m={size} held {row['max_slots']} slots after a forward")
        if not row["finite"]:
            print(f"WARNING: {method} m={size}: non-finite NLL at (window, token) "
                  f"{torch.nonzero(~torch.isfinite(nll))[:10].tolist()}")
        rows.append(row)
    for size in args.cache_sizes:
        if size >= args.tokens:  # no token beyond m: nothing compressed, nothing to compare
            continue
        # One set of block draws per cache size, shared by every comparison, so that the differences are paired
        # twice over: the same tokens and the same resampled blocks.
        blocks = args.windows * len(range(size, args.tokens, args.block))
        draws = torch.randint(blocks, (args.resamples, blocks), generator=torch.Generator().manual_seed(args.seed))
        for row in rows:
            if row["cache_size"] != size:
                continue
            nll = nlls[row["method"], size]
            if ("full", None) in nlls:
                row["full_ppl_beyond_m"] = round(perplexity(nlls["full", None][:, size:]), 3)
                row["diff_vs_full"] = paired_bootstrap(nll, nlls["full", None], size, args.block, draws)
            # Every comparison at this m (merging against its evict-only ablation, say), from the same draws.
            row["diffs"] = {other: paired_bootstrap(nll, nlls[other, size], size, args.block, draws)
                            for other, at in nlls if at == size and other != row["method"]}
            if REFERENCE in row["diffs"]:
                row["diff_vs_streamingllm"] = row["diffs"][REFERENCE]
    table = [{**row, "vs StreamingLLM": format_difference(row.get("diff_vs_streamingllm")),
              "vs full": format_difference(row.get("diff_vs_full"))} for row in rows]
    print(f"{args.windows} windows x {args.tokens} tokens; differences: mean NLL beyond m, nats/token [95% paired "
          f"block bootstrap, blocks of {args.block}, {args.resamples} resamples]")
    print_table(table, ["method", "cache_size", "ppl", "ppl_beyond_m", "full_ppl_beyond_m", "vs StreamingLLM",
                        "vs full", "max_slots", "step_ms", "finite"])
    print("wrote", write_results(name, rows))
    plot(rows, f"streaming perplexity, SmolLM2-135M, {args.text}, {args.windows} windows x {args.tokens} tokens\n"
               f"(prefill {args.prefill}, then one token per forward; a fresh cache per window)", name)
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
