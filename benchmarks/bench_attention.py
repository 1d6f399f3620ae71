"""kvcomp::decode_attention against what transformers does for a cache with per-slot log-weights.

    python -m benchmarks.bench_attention     # writes benchmarks/results/attention.json and attention.png

Baselines, both timed with the construction of their inputs from (keys, values, log_weights), as a decoding step has to:
  sdpa   repeat_kv (K and V expanded to the Hq query heads) + torch.nn.functional.scaled_dot_product_attention with
         an additive float mask (B, Hq, q, T) built from log_weights (and the causal mask); returns no probabilities.
  eager  repeat_kv + matmul + float32 softmax + matmul (transformers' eager_attention_forward), probabilities too.
Also, as the strongest plain-PyTorch path (not what transformers runs):
  sdpa_gqa  scaled_dot_product_attention(enable_gqa=True) with the same float mask: no repeat_kv copies.
The op reads K and V once for all G query heads of a kv head and also returns the probabilities.

The CPU rows also take SmolLM2's shape (Hq=9, H=3, d=64): three kv heads, fewer than most CPUs' threads, where the op
splits each head's slots into chunks (from 2048 slots on; their number and bounds fixed by the shape).

On the GPU each row also times both decode kernels at its shape (KVCOMP_DECODE_KERNEL=split_k, then tensor_cores;
split_k_us, tensor_cores_us) and reports routing_cost = op_us / the faster of the two: 1.00 where the routing
(kernels::launch::tensor_core_decode_pays) picked the faster kernel.

Targets (issue): CPU >= 1.5x sdpa at T = 8k, GQA 4:1 (B=1, Hq=32, H=8, q=1, d=64 and 128, float32); GPU (bf16) >=
60% of the measured copy bandwidth at T >= 8k with B * H >= 32 (the GPU rows use B = 4 and 8 for that, besides B = 1),
and >= 70% at B = 8, T >= 16k (issue 20). KVCOMP_BENCH_DEVICES=cuda measures the GPU only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kvpress_cpp  # noqa: F401  (registers torch.ops.kvcomp)
from benchmarks.common import (
    configurations, copy_bandwidth_gbs, decode_kernel, median_seconds, parse_without_options, print_table, pyplot,
    save_figure, write_results,
)

LENGTHS = [1024, 8192, 32768]
CUDA_LENGTHS = [1024, 8192, 16384, 32768]
NUM_QUERIES = 1
# (B, Hq, H, d): Llama-3-8B's heads (GQA 4:1) at two head dims on the CPU, and SmolLM2-135M's (GQA 3:1, 3 kv heads).
CPU_SHAPES = [(1, 32, 8, 64), (1, 32, 8, 128), (1, 9, 3, 64)]
CUDA_SHAPES = [(batch, 32, 8, 128) for batch in (1, 4, 8)]  # B = 8 at T >= 16k: the bandwidth target (issue 20)


def repeat_kv(hidden: torch.Tensor, group: int) -> torch.Tensor:
    """transformers.models.llama.modeling_llama.repeat_kv: (B, H, T, d) -> (B, H * group, T, d), a copy."""
    batch, heads, length, dim = hidden.shape
    return hidden[:, :, None].expand(batch, heads, group, length, dim).reshape(batch, heads * group, length, dim)


def float_mask(log_weights: torch.Tensor, group: int, num_queries: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, T) log-weights -> additive (B, Hq, q, T) mask with the causal part, in the attention dtype."""
    total_len = log_weights.shape[-1]
    causal = torch.arange(total_len, device=log_weights.device)[None, :] > (
        total_len - num_queries + torch.arange(num_queries, device=log_weights.device))[:, None]
    mask = log_weights.repeat_interleave(group, dim=1)[:, :, None, :].masked_fill(causal, float("-inf"))
    return mask.to(dtype)


def sdpa_attention(query, keys, values, log_weights, scale):
    group = query.shape[1] // keys.shape[1]
    mask = float_mask(log_weights, group, query.shape[2], query.dtype)
    return F.scaled_dot_product_attention(query, repeat_kv(keys, group), repeat_kv(values, group), attn_mask=mask,
                                          scale=scale)


def sdpa_gqa_attention(query, keys, values, log_weights, scale):
    mask = float_mask(log_weights, query.shape[1] // keys.shape[1], query.shape[2], query.dtype)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)


def eager_attention(query, keys, values, log_weights, scale):
    group = query.shape[1] // keys.shape[1]
    mask = float_mask(log_weights, group, query.shape[2], query.dtype)
    logits = torch.matmul(query, repeat_kv(keys, group).transpose(2, 3)) * scale + mask
    probs = logits.softmax(-1, dtype=torch.float32)
    return torch.matmul(probs.to(query.dtype), repeat_kv(values, group)), probs


def make_inputs(batch, query_heads, kv_heads, head_dim, total_len, dtype, device):
    query = torch.randn(batch, query_heads, NUM_QUERIES, head_dim, dtype=dtype, device=device)
    keys = torch.randn(batch, kv_heads, total_len, head_dim, dtype=dtype, device=device)
    values = torch.randn_like(keys)
    counts = torch.randint(0, 4, (batch, kv_heads, total_len), device=device).float()  # a quarter evicted
    log_weights = torch.ops.kvcomp.merge_count_bias(counts, 0.6)
    return query, keys, values, log_weights


def plot(rows: list[dict]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    def key(r):
        return r["device"], r["threads"], r["B"], r["Hq"], r["H"], r["d"], r["dtype"]

    for device, threads, batch, query_heads, kv_heads, head_dim, dtype in sorted({key(r) for r in rows}):
        points = [r for r in rows if key(r) == (device, threads, batch, query_heads, kv_heads, head_dim, dtype)]
        label = f"{device} {threads}t B={batch} {query_heads}:{kv_heads} d={head_dim} {dtype}"
        line, = ax.plot([r["T"] for r in points], [r["speedup_vs_sdpa"] for r in points], "o-", label=f"{label} vs sdpa")
        ax.plot([r["T"] for r in points], [r["speedup_vs_eager"] for r in points], "s--", color=line.get_color(),
                label=f"{label} vs eager")
        ax.plot([r["T"] for r in points], [r["speedup_vs_sdpa_gqa"] for r in points], "^:", color=line.get_color(),
                label=f"{label} vs sdpa(enable_gqa)")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cache length T")
    ax.set_ylabel("speedup of kvcomp::decode_attention")
    ax.set_title(f"decode attention, q={NUM_QUERIES}")
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    save_figure(fig, "attention")


def main() -> None:
    parse_without_options(__doc__)
    rows = []
    for device, threads in configurations():
        cuda = device == "cuda"
        bandwidth = copy_bandwidth_gbs(device) if cuda else None
        dtype = torch.bfloat16 if cuda else torch.float32
        for batch, query_heads, kv_heads, head_dim in CUDA_SHAPES if cuda else CPU_SHAPES:
            for total_len in CUDA_LENGTHS if cuda else LENGTHS:
                query, keys, values, log_weights = make_inputs(batch, query_heads, kv_heads, head_dim, total_len,
                                                               dtype, device)
                scale = head_dim**-0.5
                op_s = median_seconds(lambda: torch.ops.kvcomp.decode_attention(query, keys, values, log_weights, scale),
                                      num_threads=threads)
                sdpa_s = median_seconds(lambda: sdpa_attention(query, keys, values, log_weights, scale),
                                        num_threads=threads)
                eager_s = median_seconds(lambda: eager_attention(query, keys, values, log_weights, scale),
                                         num_threads=threads)
                gqa_s = median_seconds(lambda: sdpa_gqa_attention(query, keys, values, log_weights, scale),
                                       num_threads=threads)
                probs_bytes = 4 * batch * query_heads * NUM_QUERIES * total_len
                moved = keys.nbytes + values.nbytes + log_weights.nbytes + 2 * query.nbytes + probs_bytes
                row = {"device": device, "threads": threads, "dtype": str(dtype).removeprefix("torch."), "B": batch,
                       "Hq": query_heads, "H": kv_heads, "q": NUM_QUERIES, "d": head_dim, "T": total_len,
                       "op_us": round(op_s * 1e6, 1), "sdpa_us": round(sdpa_s * 1e6, 1),
                       "eager_us": round(eager_s * 1e6, 1), "sdpa_gqa_us": round(gqa_s * 1e6, 1),
                       "speedup_vs_sdpa": round(sdpa_s / op_s, 2), "speedup_vs_eager": round(eager_s / op_s, 2),
                       "speedup_vs_sdpa_gqa": round(gqa_s / op_s, 2), "op_GBps": round(moved / op_s / 1e9, 1)}
                if cuda:
                    for kernel in ("split_k", "tensor_cores"):
                        with decode_kernel(kernel):
                            row[f"{kernel}_us"] = round(1e6 * median_seconds(
                                lambda: torch.ops.kvcomp.decode_attention(query, keys, values, log_weights, scale)), 1)
                    row["routing_cost"] = round(row["op_us"] / min(row["split_k_us"], row["tensor_cores_us"]), 2)
                if bandwidth:
                    row["copy_GBps"] = round(bandwidth, 1)
                    row["fraction_of_copy_bw"] = round(moved / op_s / 1e9 / bandwidth, 2)
                rows.append(row)
                print(row)
                del query, keys, values, log_weights
    print()
    print_table(rows, ["device", "threads", "dtype", "B", "Hq", "H", "d", "T", "op_us", "sdpa_us", "eager_us", "sdpa_gqa_us",
                       "speedup_vs_sdpa", "speedup_vs_eager", "speedup_vs_sdpa_gqa", "op_GBps", "fraction_of_copy_bw",
                       "split_k_us", "tensor_cores_us", "routing_cost"])
    print("wrote", write_results("attention", rows))
    plot(rows)


if __name__ == "__main__":
    main()
