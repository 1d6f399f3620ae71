"""kvcomp::update_scores against its plain-PyTorch reference (tests/reference.py).

    python -m benchmarks.bench_scores            # writes benchmarks/results/scores.json

Targets (issue 2): >= 2x the reference on CPU at B=1, Hq=32, H=8, T=8k, q=1; on GPU >= 60% of the measured copy
bandwidth at T >= 16k. Issue 20's "every decode-step op >= 5x its plain-PyTorch equivalent at B 1-16, T 4k-32k" reads
the q = 1 rows (one decoding step's update), so on CUDA those span that range: B in {1, 16} x T in {4096, 32768}
(common.DECODE_STEP_GRID), Hq=32, H=8, float32. The q = 16 row (a chunk of 16 queries) is another comparison.
"""

import torch

import kvpress_cpp  # noqa: F401  (registers torch.ops.kvcomp)
from benchmarks.common import (DECODE_STEP_GRID, configurations, copy_bandwidth_gbs, median_seconds,
                               parse_without_options, print_table, write_results)
from tests import reference

SHAPES = {  # (B, Hq, H, q, T); the last of each, 16 queries at once, is a chunk rather than a decoding step
    "cpu": [(1, 32, 8, 1, 8192), (1, 32, 8, 1, 16384), (4, 32, 8, 1, 32768), (1, 32, 8, 16, 8192)],
    "cuda": [(batch, 32, 8, 1, length) for batch, length in DECODE_STEP_GRID] + [(1, 32, 8, 16, 8192)],
}


def main() -> None:
    parse_without_options(__doc__)
    rows = []
    for device, threads in configurations():
        bandwidth = copy_bandwidth_gbs(device) if device == "cuda" else None
        for batch, query_heads, kv_heads, num_queries, total_len in SHAPES[device]:
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
