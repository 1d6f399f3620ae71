"""The kvzap family against plain PyTorch, and KVzap's cost next to the model it prunes:

    python -m benchmarks.bench_kvzap          # writes benchmarks/results/kvzap.json and kvzap.png
    python -m benchmarks.bench_kvzap --quick  # (a) only, no SmolLM2 forward
    python -m benchmarks.bench_kvzap --tau    # (d) only: writes benchmarks/results/kvzap_tau.json and kvzap_tau.png
    python -m benchmarks.bench_kvzap --decode # (e) only: writes benchmarks/results/paged_decode_kvzap.json

(a) Scoring + thresholding of one layer, float32, against the surrogate as an nn.Module (what kvpress's
    KVzapPress.score runs) followed by the DMS rule in plain PyTorch (DMSPress's ``scores < threshold`` on the tokens
    that left the window, written into log-weights, held count per head). Prefill of T = 4096 tokens at B = 1
    (``kvzap_score`` + ``kvzap_threshold``), and one decoding step as the rectangular press runs it
    (``kvzap_decode_step``: the new token scored, the state's scores and positions grown, the token leaving the window
    decided; plain PyTorch: the module, two ``cat`` and the rule) over caches of (B, T) in DECODE_SHAPES, for a
    SmolLM2-135M layer (Dh = 576, H = 3, MLP width 72) and a Llama-3.1-8B layer (Dh = 4096, H = 8, MLP width 512),
    linear and MLP.
(b) The 30 layers' scoring + thresholding as a share of SmolLM2-135M's own forward over the same 4096 tokens (CPU,
    one thread).
(c) FLOPs of the surrogate over the FLOPs of the model's linear projections (q, k, v, o, gate, up, down) per token
    (the paper's Table 3 measure: ≤ 1.1% for KVzap-MLP).
Random surrogate weights: the timings do not depend on trained values.
(d) τ sweep with the shipped SmolLM2 surrogates: the demo's needle question (a passphrase hidden in a 2000-token
    Austen haystack at depths 0.2 / 0.5 / 0.8, question-aware: the question is part of the compressed prompt, as
    LongBench), KVzapThresholdPress at each τ: the kept fraction of the prompt's slots (mean over layers and heads, the
    sliding window included) and how many of the 3 questions are answered, MLP at τ in TAUS (and the full cache),
    linear at LINEAR_TAUS. The paper's comparable figure is LongBench (real text): 34-43% kept at its chosen τ
    (Table 2).
(e) KVzap's decode step on SmolLM2 (CPU, one thread, 2k and 4k prompts), on the rectangular and the paged cache,
    against kvpress's TOVA (prefill only, rectangular): at 25% kept (bench_paged's reference), at the slots KVzap
    keeps of that prompt (its compression_ratio after a prefill), the issue's "same number of slots", and at the slots
    a DynamicCache holds for KVzap (each layer's longest head: the same memory, and the slots its rectangular step
    attends; a PagedKVCache holds the kept ones, compacted as often as a DynamicCache is). The rows are
    bench_paged's decode part (pairs decoded in turns, median step, load average recorded); --decode-lengths and
    --steps as in bench_paged.
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

import kvpress_cpp  # noqa: F401  (registers torch.ops.kvcomp)
from benchmarks import bench_paged
from benchmarks.common import (DECODE_STEP_GRID, configurations, median_seconds, print_table, pyplot, save_figure,
                               write_results)
from tests import reference

LENGTH, WINDOW, THRESHOLD = 4096, 128, 0.0
# (B, T) of the decoding-step rows: issue 20's B 1-16, T 4k-32k on a GPU.
DECODE_SHAPES = {"cpu": [(1, 4096)], "cuda": DECODE_STEP_GRID}
TAUS = (-5.0, -4.0, -3.5, -3.0, -2.5)
LINEAR_TAUS = (-4.0, -3.5, -3.0)
TAU_DEPTHS, TAU_CONTEXT_TOKENS = (0.2, 0.5, 0.8), 2000
# name: (hidden size Dh, kv heads H, query heads, head dim, MLP intermediate size, layers)
SHAPES = {
    "SmolLM2-135M": (576, 3, 9, 64, 1536, 30),
    "Llama-3.1-8B": (4096, 8, 32, 128, 14336, 32),
    "Qwen3-8B": (4096, 8, 32, 128, 12288, 36),
}


def surrogate_tensors(dim, heads, hidden_dim, device, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def linear(out_dim, in_dim):
        bound = in_dim ** -0.5
        return [((torch.rand(*shape, generator=generator) * 2 - 1) * bound).to(device)
                for shape in ((out_dim, in_dim), (out_dim,))]

    return linear(heads, dim) if hidden_dim is None else linear(hidden_dim, dim) + linear(heads, hidden_dim)


def plain_dms_rule(log_weights, scores, tokens_before, tokens_after):
    """DMSPress's rule as plain PyTorch on per-slot tensors laid out by position (slot i = token i)."""
    begin, end = max(0, tokens_before - WINDOW), max(0, tokens_after - WINDOW)
    evict = scores[..., begin:end] < THRESHOLD
    log_weights = log_weights.clone()
    log_weights[..., begin:end] = log_weights[..., begin:end].masked_fill(evict, float("-inf"))
    return log_weights, (log_weights != float("-inf")).sum(-1)


def surrogate_flops(dim, heads, hidden_dim):
    return 2 * dim * heads if hidden_dim is None else 2 * (dim * hidden_dim + hidden_dim * heads)


def projection_flops(dim, kv_heads, query_heads, head_dim, intermediate):
    attention = 2 * dim * (query_heads + 2 * kv_heads) * head_dim + 2 * query_heads * head_dim * dim
    return attention + 3 * 2 * dim * intermediate


def bench_layer(rows, device, threads, model_name, kind):
    dim, heads = SHAPES[model_name][:2]
    hidden_dim = None if kind == "linear" else dim // 8
    weights = surrogate_tensors(dim, heads, hidden_dim, device)
    module = reference.kvzap_surrogate_module(*(w.cpu() for w in weights)).to(device).eval()
    # Seeded: the op and the module round differently, and a score within ~1e-6 of τ would be decided differently.
    hidden = torch.randn(1, LENGTH, dim, generator=torch.Generator().manual_seed(dim)).to(device)
    zeros = torch.zeros(1, heads, LENGTH, device=device)
    positions = torch.arange(LENGTH, device=device).expand(1, heads, LENGTH)

    def op_prefill():
        scores = torch.ops.kvcomp.kvzap_score(hidden, *weights)
        return torch.ops.kvcomp.kvzap_threshold(zeros, scores, positions, THRESHOLD, WINDOW, 0, LENGTH)

    def plain_prefill():
        with torch.no_grad():
            scores = module(hidden).transpose(1, 2)
        return plain_dms_rule(zeros, scores, 0, LENGTH)

    compare(rows, "prefill", op_prefill, plain_prefill, device=device, threads=threads, model=model_name,
            surrogate=kind, B=1, T=LENGTH)
    for batch, length in DECODE_SHAPES[device]:
        bench_decode_step(rows, device, threads, model_name, kind, weights, module, batch, length)


def bench_decode_step(rows, device, threads, model_name, kind, weights, module, batch, length):
    """One decoding step as the rectangular press runs it (kvzap_decode_step: score the new token, grow the state,
    decide the token leaving the window) over a state of length - 1 slots, against the same in plain PyTorch."""
    dim, heads = SHAPES[model_name][:2]
    generator = torch.Generator().manual_seed(length)
    new_hidden = torch.randn(batch, 1, dim, generator=generator).to(device)
    old_scores = (torch.randn(batch, heads, length - 1, generator=generator) - 0.5).to(device)
    old_positions = torch.arange(length - 1, device=device).expand(batch, heads, length - 1).contiguous()
    old_lw, _ = torch.ops.kvcomp.kvzap_threshold(torch.zeros(batch, heads, length - 1, device=device), old_scores,
                                                  old_positions, THRESHOLD, WINDOW, 0, length - 1)
    surrogate = (*weights, None, None)[:4]

    def op_decode():
        lw = torch.nn.functional.pad(old_lw, (0, 1))  # the layer's log-weights as the attention read them
        return torch.ops.kvcomp.kvzap_decode_step(new_hidden, *surrogate, lw, old_scores, old_positions, THRESHOLD,
                                                  WINDOW, length - 1)

    def plain_decode():
        with torch.no_grad():
            scores = torch.cat([old_scores, module(new_hidden).transpose(1, 2)], -1)
        positions = torch.cat([old_positions, torch.full_like(old_positions[..., :1], length - 1)], -1)
        log_weights, held = plain_dms_rule(torch.nn.functional.pad(old_lw, (0, 1)), scores, length - 1, length)
        return log_weights, scores, positions, held

    def same(got, expected):
        torch.testing.assert_close(got[1], expected[1])
        assert all(torch.equal(got[i], expected[i]) for i in (0, 2, 3))

    compare(rows, "decode step", op_decode, plain_decode, same, device=device, threads=threads, model=model_name,
            surrogate=kind, B=batch, T=length)


def compare(rows, phase, op_fn, plain_fn, same=None, **row):
    got, expected = op_fn(), plain_fn()
    if same is None:
        torch.testing.assert_close(got[0], expected[0])  # same decisions (random weights: no score sits on τ)
        assert torch.equal(got[1], expected[1])
    else:
        same(got, expected)
    op_s = median_seconds(op_fn, num_threads=row["threads"])
    plain_s = median_seconds(plain_fn, num_threads=row["threads"])
    rows.append({"case": "score+threshold", **row, "phase": phase, "op_us": round(op_s * 1e6, 1),
                 "plain_us": round(plain_s * 1e6, 1), "speedup": round(plain_s / op_s, 2)})


def bench_forward_share(rows, threads):
    """(b): SmolLM2-135M's forward over LENGTH tokens against its 30 layers' scoring + thresholding."""
    from kvpress_cpp.models import load_default_model

    model, _ = load_default_model()
    config = model.config
    ids = torch.randint(10, config.vocab_size - 10, (1, LENGTH))
    with torch.no_grad():  # ~30-60 s on the 2-core CI CPU: one warm-up on a short prompt, then one timed run
        model(ids[:, :256], use_cache=False)
        start = time.perf_counter()
        model(ids, use_cache=False)
        forward_s = time.perf_counter() - start
    dim, heads = config.hidden_size, config.num_key_value_heads
    for kind in ("linear", "mlp"):
        weights = surrogate_tensors(dim, heads, None if kind == "linear" else dim // 8, "cpu")
        hidden = torch.randn(1, LENGTH, dim)
        zeros = torch.zeros(1, heads, LENGTH)
        positions = torch.arange(LENGTH).expand(1, heads, LENGTH)

        def all_layers():
            for _ in range(config.num_hidden_layers):
                scores = torch.ops.kvcomp.kvzap_score(hidden, *weights)
                torch.ops.kvcomp.kvzap_threshold(zeros, scores, positions, THRESHOLD, WINDOW, 0, LENGTH)

        kvzap_s = median_seconds(all_layers, num_threads=threads)
        rows.append({"case": "share of forward", "model": "SmolLM2-135M", "surrogate": kind, "phase": "prefill",
                     "device": "cpu", "threads": threads, "T": LENGTH, "op_us": round(kvzap_s * 1e6, 1),
                     "forward_ms": round(forward_s * 1e3, 1), "share_pct": round(100 * kvzap_s / forward_s, 3)})


def flop_rows():
    rows = []
    for name, (dim, heads, query_heads, head_dim, intermediate, _) in SHAPES.items():
        for kind in ("linear", "mlp"):
            ratio = surrogate_flops(dim, heads, None if kind == "linear" else dim // 8) / projection_flops(
                dim, heads, query_heads, head_dim, intermediate)
            rows.append({"case": "FLOP ratio", "model": name, "surrogate": kind, "flop_pct": round(100 * ratio, 3)})
    return rows


def plot(rows):
    plt = pyplot()
    timed = [r for r in rows if r["case"] == "score+threshold" and r["threads"] == 1 and r["device"] == "cpu"]
    labels = [f"{r['model']}\n{r['surrogate']}, {r['phase']}" for r in timed]
    fig, ax = plt.subplots(figsize=(max(8, len(timed) * 1.1), 4.5))
    x = torch.arange(len(timed)).float()
    ax.bar(x - 0.2, [r["op_us"] for r in timed], 0.4,
           label="kvzap_score + kvzap_threshold (prefill), kvzap_decode_step (decode step)")
    ax.bar(x + 0.2, [r["plain_us"] for r in timed], 0.4, label="nn.Module + plain-PyTorch DMS rule")
    for xi, r in zip(x.tolist(), timed):
        ax.text(xi, max(r["op_us"], r["plain_us"]) * 1.1, f"{r['speedup']}x", ha="center", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("µs (median, CPU, 1 thread, float32)")
    ax.set_xticks(x.tolist(), labels, fontsize=7)
    ax.set_title(f"KVzap scoring + thresholding of one layer, B = 1, T = {LENGTH}, window {WINDOW}")
    ax.legend(fontsize=8)
    return save_figure(fig, "kvzap")


def tau_sweep(surrogate_root: Path | None = None) -> list[dict]:
    """(d): kept fraction and needle answers per (surrogate, τ); ``surrogate_root`` holds linear/ and mlp/ (default:
    the shipped ones)."""
    from transformers import DynamicCache

    from kvpress_cpp.models import load_default_model
    from kvpress_cpp.presses import KVzapThresholdPress
    from kvpress_cpp.tasks import HiddenFact, hidden_fact_prompt

    torch.set_num_threads(1)
    model, tokenizer = load_default_model()
    fact = HiddenFact()
    prompts = [tokenizer(hidden_fact_prompt(tokenizer, TAU_CONTEXT_TOKENS, depth, fact), return_tensors="pt")
               for depth in TAU_DEPTHS]
    rows = []
    for kind in ("mlp", "linear"):
        for tau in (None, *TAUS) if kind == "mlp" else LINEAR_TAUS:
            kept, answered = [], []
            for inputs in prompts:
                press = None if tau is None else KVzapThresholdPress(
                    threshold=tau, model_type=kind,
                    surrogate_dir=None if surrogate_root is None else surrogate_root / kind)
                with torch.no_grad(), (press(model) if press is not None else nullcontext()):
                    out = model.generate(**inputs, past_key_values=DynamicCache(), max_new_tokens=12, do_sample=False)
                answer = tokenizer.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)
                answered.append(fact.answer in answer)
                kept.append(1.0 if press is None else 1 - press.compression_ratio)
                print(f"{kind} τ={tau}: kept {kept[-1]:.3f} {answer!r}", flush=True)
            rows.append({"case": "tau_sweep", "surrogate": "none (full cache)" if tau is None else kind, "tau": tau,
                         "context_tokens": TAU_CONTEXT_TOKENS, "depths": list(TAU_DEPTHS),
                         "kept": round(sum(kept) / len(kept), 3), "kept_per_depth": [round(k, 3) for k in kept],
                         "answered": sum(answered), "examples": len(answered),
                         "surrogate_dir": str(surrogate_root or "shipped"),
                         "load_average_1min": round(os.getloadavg()[0], 2)})
    return rows


def plot_tau(rows):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for kind, color in (("mlp", "tab:orange"), ("linear", "tab:blue")):
        sweep = [r for r in rows if r["surrogate"] == kind]
        ax.plot([r["tau"] for r in sweep], [r["kept"] for r in sweep], marker="o", color=color, label=f"{kind}: kept")
        for r in sweep:
            ax.annotate(f"{r['answered']}/{r['examples']}", (r["tau"], r["kept"]), textcoords="offset points",
                        xytext=(0, 6 if kind == "mlp" else -12), ha="center", fontsize=8, color=color)
    ax.axhspan(0.34, 0.43, color="gray", alpha=0.2, label="paper, LongBench: 34-43% kept")
    ax.set_xlabel("τ (threshold on the predicted log KVzip+ score)")
    ax.set_ylabel("kept fraction of the prompt's slots")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(f"KVzap on SmolLM2-135M, {TAU_CONTEXT_TOKENS}-token needle prompt\n"
                 "labels: needle questions answered")
    ax.legend(fontsize=8)
    return save_figure(fig, "kvzap_tau")


def decode_rows(prompt_lengths=(2048, 4096), steps: int = 121) -> list[dict]:
    from kvpress import TOVAPress
    from transformers import DynamicCache

    from kvpress_cpp.models import load_default_model
    from kvpress_cpp.presses import KVzapThresholdPress
    from kvpress_cpp.texts import austen_novel

    torch.set_num_threads(1)
    model, tokenizer = load_default_model()
    text = tokenizer(austen_novel("prideprejudice")[:40000]).input_ids
    rows = []
    for length in prompt_lengths:
        press, cache = KVzapThresholdPress(), DynamicCache()
        with torch.no_grad(), press(model):
            model(torch.tensor([text[:length]]), past_key_values=cache)
        removed = round(press.compression_ratio, 3)
        held = round(sum(layer.keys.shape[-2] for layer in cache.layers) / (len(cache.layers) * length), 3)
        same_slots = f"TOVA at KVzap's slots ({1 - removed:.0%} kept)"
        held_slots = f"TOVA at the slots KVzap's DynamicCache holds ({held:.0%})"
        presses = {"TOVA (prefill only)": lambda: TOVAPress(compression_ratio=0.75),
                   same_slots: lambda: TOVAPress(compression_ratio=removed),
                   held_slots: lambda: TOVAPress(compression_ratio=1 - held),
                   f"KVzap-MLP τ={press.threshold:g}": KVzapThresholdPress}
        rows += bench_paged.decode_rows(model, tokenizer, (length,), steps, presses=presses,
                                        references={"vs_tova": "TOVA (prefill only)", "vs_tova_same_slots": same_slots,
                                                    "vs_tova_held_slots": held_slots})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    part = parser.add_mutually_exclusive_group()
    part.add_argument("--quick", action="store_true", help="(a) only, no SmolLM2 forward")
    part.add_argument("--tau", action="store_true", help="(d) only: the τ sweep (kvzap_tau.json)")
    part.add_argument("--decode", action="store_true", help="(e) only: the decode step (paged_decode_kvzap.json)")
    bench_paged.add_decode_size_arguments(parser)
    args = bench_paged.check_decode_sizes(parser, parser.parse_args())
    if args.decode:
        rows = decode_rows(args.decode_lengths, args.steps)
        print_table(rows, list(rows[0]))
        print("wrote", write_results("paged_decode_kvzap", rows))
        return
    quick = args.quick
    if args.tau:
        rows = tau_sweep()
        print_table(rows, ["surrogate", "tau", "kept", "answered", "examples"])
        print("wrote", write_results("kvzap_tau", rows), "and", plot_tau(rows))
        return
    rows = []
    for device, threads in configurations():
        torch.set_num_threads(threads)
        for model_name in ("SmolLM2-135M", "Llama-3.1-8B"):
            for kind in ("linear", "mlp"):
                bench_layer(rows, device, threads, model_name, kind)
    if not quick:
        # One thread: on the shared 2-core CI VM, two-thread ATen calls pay OpenMP wake-ups of tens of ms, which
        # would measure the machine rather than KVzap (two-thread rows of (a) are in the JSON for reference).
        torch.set_num_threads(1)
        bench_forward_share(rows, 1)
    rows += flop_rows()
    print_table(rows, ["case", "model", "surrogate", "phase", "device", "threads", "B", "T", "op_us", "plain_us", "speedup",
                       "forward_ms", "share_pct", "flop_pct"])
    print("wrote", write_results("kvzap", rows), "and", plot(rows))


if __name__ == "__main__":
    main()
