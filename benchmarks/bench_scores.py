"""kvcomp::update_scores against its plain-PyTorch reference (tests/reference.py).

    python -m benchmarks.bench_scores            # writes benchmarks/results/scores.json

Targets (issue 2): >= 2x the reference on CPU at B=1, Hq=32, H=8, T=8k, q=1; on GPU >= 60% of the measured copy
bandwidth at T >= 16k.
"""

import torch

import kvpress_cpp  # noqa: F401  (registers torch.ops.kvcomp)
from benchmarks.common import configurations, copy_bandwidth_gbs, median_seconds, print_table, write_results
from tests import reference

SHAPES = [  # (B, Hq, H, q, T)
    (1, 32, 8, 1, 8192),
    (1, 32, 8, 1, 16384),
    (4, 32, 8, 1, 32768),
    (1, 32, 8, 16, 8192),
]


def main() -> None:
    rows = []
    for device, threads in configurations():
        bandwidth = copy_bandwidth_gbs(device) if device == "cuda" else None
        for batch, query_heads, kv_heads, num_queries, total_len in SHAPES:
            scores = torch.rand(batch, kv_heads, total_len - num_queries, device=device)
            attn = torch.rand(batch, query_heads, num_queries, total_len, device=device)
            op_s = median_seconds(lambda: torch.ops.kvcomp.update_scores(scores, attn, 0.98, 1.0), num_threads=threads)
            ref_s = median_seconds(lambda: reference.update_scores(scores, attn, 0.98, 1.0), num_threads=threads)
            moved = attn.nbytes + scores.nbytes + 4 * batch * kv_heads * total_len
            row = {"device": device, "threads": threads, "B": batch, "Hq": query_heads, "H": kv_heads, "q": num_queries, "T": total_len,
                   "op_us": round(op_s * 1e6, 1), "reference_us": round(ref_s * 1e6, 1),
                   "speedup": round(ref_s / op_s, 2), "op_GBps": round(moved / op_s / 1e9, 1)}
            if bandwidth:
                row["fraction_of_copy_bw"] = round(moved / op_s / 1e9 / bandwidth, 2)
            rows.append(row)
    print_table(rows, ["device", "threads", "B", "Hq", "H", "q", "T", "op_us", "reference_us", "speedup", "op_GBps",
                       "fraction_of_copy_bw"])
    print("wrote", write_results("scores", rows))


if __name__ == "__main__":
    main()
