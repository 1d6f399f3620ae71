"""PagedKVCache against the rectangular cache: the memory head-wise compression really frees, and the decode step.

    python -m benchmarks.bench_paged                   # all CPU parts (SmolLM2, one thread), JSON + plot
    python -m benchmarks.bench_paged --parts kernel    # paged decode attention on a GPU vs its copy bandwidth
    python -m benchmarks.bench_paged --parts memory --name paged_memory   # parts in separate runs, then
    python -m benchmarks.bench_paged --merge paged_memory paged_batch paged_decode_calls  # paged.json + .png

Parts (each row of benchmarks/results/paged.json names its part):

* ``memory``: the demo prompt (kvpress_cpp/tasks.py, 3000-token haystack) prefilled under KVzapThresholdPress(its default τ,
  MLP), GVotePress() and kvpress's AdaKVPress(SnapKVPress(0.75)), once with a DynamicCache and once with a
  PagedKVCache (block size 16): bytes held as a fraction of the full (uncompressed) cache's keys and values, next to
  the fraction of slots the press kept. Targets: KVzap ≤ kept + 5 points, GVote within 5 points of kept, AdaKV ≤ 30%.
* ``batch``: eight prompts of 512 to 4096 tokens prefilled in one left-padded batch into a PagedKVCache (the first
  two layers of SmolLM2: the allocator does not depend on the layer, and all 30 would take long on one core), then every
  head of every sequence cut to 25% of its own tokens (kvpress's KnormPress scores, AdaKV-style budget shared by the
  heads of a sequence) through the press write-back. Target: bytes ≤ the kept slots + one block per head.
* ``decode``: CPU decode-step time (one thread) at 2k and 4k prompts, 25% kept, of every press that compresses while
  decoding, on the rectangular and the paged cache, against kvpress's TOVA (which prunes the prompt to the same slots
  and does not compress while decoding) on the rectangular cache. Every (press, cache) pair is prefilled once, then
  all are decoded in turns, one token each per round (120 timed rounds: a round takes under a second, the prefills
  dominate), so the machine's changing load falls on all alike. A step is timed up to the storing of what the press
  wrote to the paged layers, which generate pays at the next step (:func:`timed_step`). Each row is the median step
  (and the fastest), with the load average seen, its ratio to TOVA's median step (``vs_tova``) and the median over
  rounds of its step over TOVA's in the same round (``vs_tova_paired``, the robust one: the machine's speed drifts
  over seconds). Target: within 1.1x of TOVA.
* ``kernel`` (GPU): kvcomp::paged_decode_attention at T ≥ 16k against the device's copy bandwidth and against the
  rectangular kvcomp::decode_attention on the same slots, with max_len given as the cache gives it and without
  (``paged_host_checked_us``: the host sync of the table check); where FlashInfer imports, its paged decode
  (one of vLLM's attention backends) over the same keys and values as the peer (``peer`` rows; no log-weights, no
  probabilities).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import torch
from tqdm import tqdm

from benchmarks.common import RESULTS_DIR, copy_bandwidth_gbs, median_seconds, print_table, pyplot, save_figure, write_results

NAME = "paged"
DECODE_PRESSES = ("ZSMerge", "WeightedKV", "KeepKV", "KVzap")  # decode: the presses that compress while decoding


def full_cache_bytes(model, tokens: int, batch: int = 1) -> int:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * batch * config.num_key_value_heads * tokens * head_dim * element


def kept_fraction(cache, tokens: int) -> float:
    """Slots the heads of a PagedKVCache hold, as a fraction of the prompt's."""
    for layer in cache.layers:
        layer.flush()
    held = sum(int(layer.lengths.sum()) for layer in cache.layers)
    return held / (tokens * sum(layer.lengths.numel() for layer in cache.layers))


def memory_rows(model, tokenizer) -> list[dict]:
    from kvpress import AdaKVPress, SnapKVPress
    from transformers import DynamicCache

    from kvpress_cpp.cache import cache_bytes
    from kvpress_cpp.paged_cache import PagedKVCache
    from kvpress_cpp.presses import GVotePress, KVzapThresholdPress
    from kvpress_cpp.presses.kvzap import DEFAULT_THRESHOLD
    from kvpress_cpp.tasks import hidden_fact_prompt

    ids = tokenizer(hidden_fact_prompt(tokenizer, 3000), return_tensors="pt").input_ids
    tokens = ids.shape[1]
    full = full_cache_bytes(model, tokens)
    presses = {f"KVzap-MLP τ={DEFAULT_THRESHOLD:g}": KVzapThresholdPress,
               "GVote": GVotePress,
               "AdaKV(SnapKV(0.75))": lambda: AdaKVPress(SnapKVPress(compression_ratio=0.75))}
    rows = []
    for name, make_press in presses.items():
        rectangular, paged = DynamicCache(), PagedKVCache()
        for cache in (rectangular, paged):
            press = make_press()
            with torch.no_grad(), press(model):
                model.model(ids, past_key_values=cache)
        reported = 1 - press.compression_ratio  # what the press says it kept
        rows.append({"part": "memory", "press": name, "tokens": tokens,
                     "kept": round(kept_fraction(paged, tokens), 4), "reported_kept": round(reported, 4),
                     "rectangular": round(cache_bytes(rectangular) / full, 4),
                     "paged": round(paged.bytes_held() / full, 4),
                     "paged_reserved": round(paged.bytes_reserved() / full, 4)})
    return rows


def batch_rows(model, tokenizer, kept: float = 0.25, layers: int = 2) -> list[dict]:
    from kvpress import KnormPress

    from kvpress_cpp.cache import LayerState, set_state
    from kvpress_cpp.paged_cache import PagedKVCache
    from kvpress_cpp.texts import austen_novel

    lengths = [512 * (i + 1) for i in range(8)]
    text = tokenizer(austen_novel("prideprejudice")[:80000]).input_ids
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        start = 997 * row  # a different stretch of the novel per sequence
        ids[row, width - length:] = torch.tensor(text[start:start + length])
        mask[row, width - length:] = 1
    cache = PagedKVCache()
    all_layers = model.model.layers
    model.model.layers = all_layers[:layers]  # a 32k-token prefill of all 30 layers would take long on one core
    try:
        with torch.no_grad():
            model.model(ids, attention_mask=mask, past_key_values=cache)
    finally:
        model.model.layers = all_layers
    scorer = KnormPress()
    slot_bytes = bound = 0
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        scores = scorer.score(None, None, keys, values, None, {}).float()
        real = keys.abs().sum(-1) != 0  # the padding left by the prefill is zeros in the view
        scores = scores.masked_fill(~real, float("-inf"))
        keep = torch.zeros_like(real)
        for row, length in enumerate(lengths):
            budget = round(kept * length * keys.shape[1])
            top = scores[row].flatten().topk(budget).indices
            keep[row].view(-1)[top] = True
        layer.keys, layer.values = keys, values
        set_state(layer, LayerState(torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))))
        layer.flush()
        slot_bytes = layer._block_bytes() // layer.block_size
        bound += (int(keep.sum()) + layer.lengths.numel() * layer.block_size) * slot_bytes
    held = cache.bytes_held()
    kept_bytes = sum(int(layer.lengths.sum()) for layer in cache.layers) * slot_bytes
    return [{"part": "batch", "layers": layers, "sequences": len(lengths), "tokens": sum(lengths),
             "padded_tokens": width * len(lengths),
             "kept": kept, "bytes_held": held, "kept_slots_bytes": kept_bytes, "bound": bound,
             "held_over_bound": round(held / bound, 4),
             "rectangular_padded_full": full_cache_bytes(model, width, len(lengths)) * layers
             // model.config.num_hidden_layers}]


def decode_rows(model, tokenizer, prompt_lengths=(2048, 4096), steps: int = 121, presses: dict | None = None,
                references: dict[str, str] | None = None, only: list[str] | None = None) -> list[dict]:
    """Every (press, cache) pair prefilled once, then decoded one token at a time in turns (pair after pair, `steps`
    rounds), so that a change in the machine's load falls on all of them alike; the median step of each. `presses`:
    {name: press factory} in place of the default set (:func:`decode_presses`, `only` those named). `references`:
    {column: press name} whose rectangular run each row is compared with, as ``column`` (ratio of medians) and
    ``column_paired`` (:func:`paired_ratio`); by default ``vs_tova`` against "TOVA (prefill only)"."""
    from transformers import DynamicCache

    from kvpress_cpp.cache import attach
    from kvpress_cpp.paged_cache import PagedKVCache
    from kvpress_cpp.texts import austen_novel

    text = tokenizer(austen_novel("prideprejudice")[:40000]).input_ids
    presses = presses if presses is not None else decode_presses(only)
    references = references or {"vs_tova": "TOVA (prefill only)"}
    caches = {"rectangular": DynamicCache, "paged": PagedKVCache}
    rows = []
    for length in prompt_lengths:
        if length > len(text):
            raise ValueError(f"bench_paged: a decode prompt of {length} tokens is longer than the text it is cut "
                             f"from ({len(text)} tokens)")
        ids = torch.tensor([text[:length]])
        runs = []  # (press name, cache name, press, cache, next token, step times)
        pairs = [(name, make_press, cache_name, make_cache) for name, make_press in presses.items()
                 for cache_name, make_cache in caches.items()]
        for name, make_press, cache_name, make_cache in tqdm(pairs, desc=f"prefill {length}", unit="pair"):
            press, cache = make_press(), make_cache()
            with torch.no_grad(), press(model):
                logits = model(ids, past_key_values=cache).logits
            runs.append([name, cache_name, press, cache, logits[:, -1:].argmax(-1), []])
        loads = []
        attention_modules = [layer.self_attn for layer in model.model.layers]
        for _ in tqdm(range(steps), desc=f"decode {length}", unit="round", mininterval=5):
            loads.append(os.getloadavg()[0])
            for run in runs:
                _, _, press, cache, token, times = run
                # A layer's state is found through the attention module it was last attached to (one cache per
                # model at a time, as generate uses it): this cache's turn.
                for module, layer in zip(attention_modules, cache.layers):
                    attach(module, layer)
                with torch.no_grad(), press(model):
                    run[4], seconds = timed_step(model, token, cache)
                    times.append(seconds)
        reference_times = {column: next(times[1:] for name, cache_name, *_, times in runs
                                        if name == reference and cache_name == "rectangular")
                           for column, reference in references.items()}
        for name, cache_name, _, _, _, times in runs:
            timed = times[1:]
            row = {"part": "decode", "prompt": length, "press": name, "cache": cache_name,
                   "step_ms": round(1000 * statistics.median(timed), 2), "fastest_ms": round(1000 * min(timed), 2),
                   "steps": len(timed), "load_average": round(statistics.median(loads), 2)}
            for column, reference in reference_times.items():
                row[column] = round(statistics.median(timed) / statistics.median(reference), 3)
                row[f"{column}_paired"] = paired_ratio(timed, reference)
            rows.append(row)
    return rows


def timed_step(model, token: torch.Tensor, cache) -> tuple[torch.Tensor, float]:
    """One decoding step of `token` over `cache`: (the next token, its seconds). A paged layer stores what a press wrote
    to it when the layer is next read, which in generate is the next step's update: every layer is read here, inside
    the time, so that each step pays its own write-back (the press context's close, after the time, stored it before:
    1-2% of KeepKV's paged step went untimed)."""
    start = time.perf_counter()
    next_token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
    for layer in cache.layers:
        layer.get_seq_length()
    return next_token, time.perf_counter() - start


def decode_presses(only: list[str] | None = None) -> dict:
    """{row name: press factory} of the decode part: kvpress's TOVA, to which every row is compared, and our presses
    that compress while decoding, at 25% kept; `only`: those of DECODE_PRESSES named, beside TOVA."""
    from kvpress import TOVAPress

    from kvpress_cpp.presses import KeepKVPress, KVzapThresholdPress, WeightedKVPress, ZSMergePress
    from kvpress_cpp.presses.kvzap import DEFAULT_THRESHOLD

    ours = {"ZSMerge": ("ZSMerge", lambda: ZSMergePress(budget=0.25)),
            "WeightedKV": ("WeightedKV", lambda: WeightedKVPress(cache_size=0.25)),
            "KeepKV": ("KeepKV", lambda: KeepKVPress(budget=0.25)),
            "KVzap": (f"KVzap-MLP τ={DEFAULT_THRESHOLD:g}", KVzapThresholdPress)}
    return {"TOVA (prefill only)": lambda: TOVAPress(compression_ratio=0.75),
            **dict(row for press, row in ours.items() if only is None or press in only)}


def paired_ratio(times: list[float], reference: list[float]) -> float:
    """The median over rounds of a step's time over the reference's step in the same round: the machine's speed
    drifts by ±10% over seconds on a shared VM (thread CPU time drifts alike, so it is not time lost waiting for a
    core), which moves each run's median; within one round (under a second) both see the same speed."""
    return round(statistics.median(t / r for t, r in zip(times, reference)), 3)


def shuffled_full_cache(batch: int, kv_heads: int, length: int, head_dim: int, block_size: int, dtype: torch.dtype,
                        device: str, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """A paged cache whose every (b, h) holds `length` random slots in shuffled blocks (slot t of (b, h) at block
    tables[b, h, t // S], offset t % S; log-weights 0), and the rectangular (B, H, T, d) copies of the same slots:
    the inputs of paged_decode_attention and of decode_attention over one cache."""
    blocks_per_head = length // block_size
    num_blocks = batch * kv_heads * blocks_per_head
    tables = torch.randperm(num_blocks, device=device, generator=generator).view(batch, kv_heads, blocks_per_head)
    key_blocks, value_blocks = (torch.randn(num_blocks, block_size, head_dim, device=device, dtype=dtype,
                                            generator=generator) for _ in range(2))
    slots = (tables.unsqueeze(-1) * block_size + torch.arange(block_size, device=device)).view(batch, kv_heads, -1)
    return {"key_blocks": key_blocks, "value_blocks": value_blocks,
            "log_weight_blocks": torch.zeros(num_blocks, block_size, device=device), "block_tables": tables,
            "lengths": torch.full((batch, kv_heads), length, device=device),
            "keys": key_blocks.view(-1, head_dim)[slots], "values": value_blocks.view(-1, head_dim)[slots],
            "log_weights": torch.zeros(batch, kv_heads, length, device=device)}


def flashinfer_pages(keys: torch.Tensor, values: torch.Tensor, page_size: int,
                     generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """The rectangular (B, H, T, d) keys and values in FlashInfer's paged layout (NHD): pages of `page_size` tokens
    holding every kv head, (num_pages, page_size, H, d), in shuffled order, one page list per sequence (indptr,
    indices, last_page_len, int32). FlashInfer pages a sequence where we page each (sequence, kv head); the bytes read
    are the same. T must be a whole number of pages."""
    batch, kv_heads, length, head_dim = keys.shape
    if length % page_size:
        raise ValueError(f"flashinfer_pages: expected T a multiple of page_size = {page_size}, got T = {length}")
    pages_per_sequence = length // page_size
    num_pages = batch * pages_per_sequence
    # order[i]: where logical page i (sequence i // pages_per_sequence) lies.
    order = torch.randperm(num_pages, generator=generator).to(keys.device)

    def paged(rows: torch.Tensor) -> torch.Tensor:
        logical = rows.transpose(1, 2).reshape(num_pages, page_size, kv_heads, head_dim)
        pages = torch.empty_like(logical)
        pages[order] = logical
        return pages

    int32 = dict(dtype=torch.int32, device=keys.device)
    return {"k_cache": paged(keys), "v_cache": paged(values), "indices": order.to(torch.int32),
            "indptr": torch.arange(batch + 1, **int32) * pages_per_sequence,
            "last_page_len": torch.full((batch,), page_size, **int32)}


def flashinfer_row(query: torch.Tensor, cache: dict, block_size: int, expected: torch.Tensor, copy_gbs: float) -> dict:
    """FlashInfer's paged decode (BatchDecodeWithPagedKVCacheWrapper, tensor cores) over the same keys and values, its
    output checked against ours first. It reads no log-weights and writes no probabilities."""
    import flashinfer

    batch, query_heads, _, head_dim = query.shape
    pages = flashinfer_pages(cache["keys"], cache["values"], block_size)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=query.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    wrapper.plan(pages["indptr"], pages["indices"], pages["last_page_len"], query_heads, cache["keys"].shape[1],
                 head_dim, block_size, q_data_type=query.dtype, kv_data_type=query.dtype)
    q = query[:, :, 0].contiguous()
    kv = (pages["k_cache"], pages["v_cache"])
    torch.testing.assert_close(wrapper.run(q, kv), expected[:, :, 0], atol=2e-2, rtol=2e-2)
    seconds = median_seconds(lambda: wrapper.run(q, kv))
    read = pages["k_cache"].nbytes + pages["v_cache"].nbytes
    return {"part": "kernel", "peer": "flashinfer", "version": getattr(flashinfer, "__version__", "?"),
            "T": cache["keys"].shape[2], "batch": batch, "peer_us": round(seconds * 1e6, 1),
            "peer_gbs": round(read / seconds / 1e9, 1), "fraction_of_copy": round(read / seconds / 1e9 / copy_gbs, 3)}


def kernel_rows(lengths=(16384, 32768, 65536), batch: int = 4, kv_heads: int = 8, group: int = 4,
                head_dim: int = 128, block_size: int = 16) -> list[dict]:
    """GPU only: bytes of keys, values and log-weights read per second, against the device's copy bandwidth."""
    import kvpress_cpp  # noqa: F401
    from kvpress_cpp import ops

    device, dtype = "cuda", torch.bfloat16
    copy_gbs = copy_bandwidth_gbs(device)
    rows = []
    for length in lengths:
        c = shuffled_full_cache(batch, kv_heads, length, head_dim, block_size, dtype, device)
        key_blocks, value_blocks, log_weights = c["key_blocks"], c["value_blocks"], c["log_weight_blocks"]
        query = torch.randn(batch, kv_heads * group, 1, head_dim, device=device, dtype=dtype)
        read = key_blocks.nbytes + value_blocks.nbytes + log_weights.nbytes
        inputs = (query, key_blocks, value_blocks, log_weights, c["block_tables"], c["lengths"])
        # As PagedKVCache calls it (max_len from its host lengths: the tables checked on the device, no sync), and
        # without max_len (the tables checked and the longest length read back on the host: one sync a call).
        paged = median_seconds(lambda: ops.paged_decode_attention(*inputs, return_probs=False, max_len=length))
        host_checked = median_seconds(lambda: ops.paged_decode_attention(*inputs, return_probs=False))
        rectangular = median_seconds(lambda: ops.decode_attention(query, c["keys"], c["values"], c["log_weights"]))
        rows.append({"part": "kernel", "T": length, "batch": batch, "kv_heads": kv_heads, "group": group,
                     "head_dim": head_dim, "dtype": "bf16", "paged_us": round(paged * 1e6, 1),
                     "paged_gbs": round(read / paged / 1e9, 1), "copy_gbs": round(copy_gbs, 1),
                     "fraction_of_copy": round(read / paged / 1e9 / copy_gbs, 3),
                     "paged_host_checked_us": round(host_checked * 1e6, 1),
                     "rectangular_decode_attention_us": round(rectangular * 1e6, 1)})
        try:
            rows.append(flashinfer_row(query, c, block_size, ops.decode_attention(query, c["keys"], c["values"],
                                                                                  c["log_weights"])[0], copy_gbs))
        except ImportError:
            if length == lengths[0]:
                rows.append({"part": "kernel", "peer": "flashinfer", "note": "not installed"})
        except Exception as error:  # a peer that fails (its JIT build, a different output) is reported, not fatal
            rows.append({"part": "kernel", "peer": "flashinfer", "note": f"failed at T = {length}: "
                                                                        f"{type(error).__name__}: {error}"[:300]})
    return rows


def plot(rows: list[dict]) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    memory = [r for r in rows if r["part"] == "memory"]
    if memory:
        x = range(len(memory))
        for offset, key in enumerate(("kept", "rectangular", "paged")):
            left.bar([i + 0.27 * (offset - 1) for i in x], [r[key] for r in memory], width=0.27, label=key)
        left.set_xticks(list(x), [r["press"] for r in memory], fontsize=8)
        left.set_ylabel("fraction of the full cache")
        left.set_title("demo prompt: slots kept and bytes held")
        left.legend()
    decode = [r for r in rows if r["part"] == "decode"]
    if decode:
        labels = sorted({(r["press"], r["cache"]) for r in decode}, key=lambda k: (k[0], k[1]))
        for prompt in sorted({r["prompt"] for r in decode}):
            by_label = {(r["press"], r["cache"]): r.get("vs_tova_paired", r["vs_tova"]) for r in decode
                        if r["prompt"] == prompt}
            right.plot(range(len(labels)), [by_label.get(label, float("nan")) for label in labels], "o",
                       label=f"{prompt} tokens")
        right.axhline(1.1, color="grey", linestyle="--", linewidth=1)
        right.set_xticks(range(len(labels)), [f"{p}\n{c}" for p, c in labels], fontsize=6, rotation=60)
        right.set_ylabel("step / TOVA's in the same round")
        right.set_title("CPU decode step, 1 thread, 25% kept")
        right.legend()
    save_figure(fig, NAME)


def add_decode_size_arguments(parser: argparse.ArgumentParser) -> None:
    """The decode part's sizes as options (here and in bench_kvzap --decode): smaller ones give a quick look."""
    parser.add_argument("--decode-lengths", nargs="+", type=int, default=[2048, 4096], metavar="TOKENS",
                        help="decode: the prompt lengths (default: 2048 4096)")
    parser.add_argument("--steps", type=int, default=121, help="decode: decoding rounds per prompt (default: 121)")


def check_decode_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.steps < 2 or min(args.decode_lengths) < 1:
        parser.error(f"--steps must be ≥ 2 (the first step is not timed) and --decode-lengths ≥ 1, got {args.steps} "
                     f"and {args.decode_lengths}")
    return args


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["memory", "batch", "decode"],
                        choices=["memory", "batch", "decode", "kernel"])
    parser.add_argument("--name", default=NAME, help="results/<NAME>.json (another name keeps the committed results)")
    add_decode_size_arguments(parser)
    parser.add_argument("--decode-presses", nargs="+", choices=DECODE_PRESSES, metavar="PRESS",
                        help=f"decode: only these presses, beside TOVA ({', '.join(DECODE_PRESSES)}; default: all)")
    parser.add_argument("--merge", nargs="+", metavar="NAME",
                        help="only merge the rows of earlier runs (results/NAME.json) into results/<--name>.json")
    args = check_decode_sizes(parser, parser.parse_args())
    env = None
    if args.merge:
        if missing := [name for name in args.merge if not (RESULTS_DIR / f"{name}.json").is_file()]:
            parser.error(f"--merge: no {', '.join(str(RESULTS_DIR / f'{name}.json') for name in missing)}")
        parts = {name: json.loads((RESULTS_DIR / f"{name}.json").read_text()) for name in args.merge}
        rows = [row for part in parts.values() for row in part["rows"]]
        # The rows were measured by the earlier runs, not by this process: keep their environment.
        envs = {name: part["environment"] for name, part in parts.items()}
        env = next(iter(envs.values())) if all(e == next(iter(envs.values())) for e in envs.values()) else envs
    else:
        rows = measured_rows(args)
    print("wrote", write_results(args.name, rows, env))
    if args.name == NAME:  # another name keeps the committed plot too
        plot(rows)


def measured_rows(args: argparse.Namespace) -> list[dict]:
    rows = []
    if {"memory", "batch", "decode"} & set(args.parts):
        from kvpress_cpp.models import load_default_model

        torch.set_num_threads(1)
        model, tokenizer = load_default_model()
        decode = functools.partial(decode_rows, prompt_lengths=args.decode_lengths, steps=args.steps,
                                   only=args.decode_presses)
        for part, fn in (("memory", memory_rows), ("batch", batch_rows), ("decode", decode)):
            if part in args.parts:
                rows += fn(model, tokenizer)
                print_table([r for r in rows if r["part"] == part], list(rows[-1]))
    if "kernel" in args.parts:
        kernel = kernel_rows()
        rows += kernel
        print_table([r for r in kernel if "T" in r], list(kernel[0]))
    return rows


if __name__ == "__main__":
    main()
