"""Nsight Compute over the CUDA kernels furthest from their targets: why each is slow, in one short run.

    python -m benchmarks.ncu_kernels          # on a GPU with ncu: benchmarks/results/gpu/ncu_kernels.{json,md,csv}

The first GPU runs measured prompt scoring at 55x the layer's own sdpa (issue 19's target: 1.5x) and decode
attention at 36% of the copy bandwidth (issue 20's: 70%), without saying where the time goes. This profiles one
launch of each, on the shapes of those targets, next to torch's flash attention on the same layer:

* prompt scoring: ``prompt_log_sum_exp`` + ``prompt_scores`` on a random Llama-3-8B-shaped layer (B = 1, Hq = 32,
  H = 8, d = 128, bfloat16), T = 8192 (the kernels are quadratic in T: 8k keeps ncu's replays to seconds), and
  sdpa's causal GQA forward on the same tensors;
* decode attention: ``decode_attention`` and ``paged_decode_attention`` (blocks of 16) at B = 8, T = 16384, q = 1,
  and sdpa's GQA decode on the same keys; ``decode_attention`` twice, on the kernel its routing picks there (tensor
  cores) and on the split-K one (KVCOMP_DECODE_KERNEL=split_k), which ran at 30% of the copy bandwidth with the
  probabilities (run 13);
* KeepKV's fused decoding step, ``keepkv_decode_step`` (its step kernel and its pack), at B = 8, 8 kv heads, 32 query
  heads, d = 128, bfloat16, over 3277 slots (a 10% budget of 32k): on an H200 its kernel took 377 µs a layer at
  12 x 3277 slots (run 13), a twentieth of the bandwidth its bytes need.

Per kernel: duration, the speed-of-light figures (memory and SM throughput as a share of the device's peak, DRAM
throughput), achieved and theoretical occupancy with what limits it (registers, shared memory), and the warp cycles
per issued instruction. Every metric ncu printed stays in the CSV.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.bench_paged import shuffled_full_cache
from benchmarks.common import RESULTS_DIR, decode_kernel

NAME = "ncu_kernels"
SECTIONS = ["SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "WarpStateStats"]
#: The columns of the summary: ncu's metric name → the summary's.
SUMMARY_METRICS = {
    "Duration": "duration",
    "Memory Throughput": "memory_throughput_pct",
    "DRAM Throughput": "dram_throughput_pct",
    "Compute (SM) Throughput": "sm_throughput_pct",
    "Achieved Occupancy": "achieved_occupancy_pct",
    "Theoretical Occupancy": "theoretical_occupancy_pct",
    "Registers Per Thread": "registers_per_thread",
    "Dynamic Shared Memory Per Block": "dynamic_shared_per_block",
    "Block Limit Registers": "block_limit_registers",
    "Block Limit Shared Mem": "block_limit_shared_memory",
    "Warp Cycles Per Issued Instruction": "warp_cycles_per_instruction",
}


def launches(device: str = "cuda", prompt_length: int = 8192, cached: int = 16384, batch: int = 8,
             keepkv_slots: int = 3277) -> dict:
    """name → a callable launching it once, on random tensors of the module docstring's shapes."""
    from kvpress_cpp import ops

    generator = torch.Generator(device).manual_seed(0)
    dtype, query_heads, kv_heads, head_dim, block = torch.bfloat16, 32, 8, 128, 16
    scale = head_dim ** -0.5

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=generator)

    prompt, keys, values = randn(1, query_heads, prompt_length, head_dim), *[randn(1, kv_heads, prompt_length,
                                                                                   head_dim) for _ in range(2)]
    log_weights = torch.zeros(1, kv_heads, prompt_length, device=device)
    query = randn(batch, query_heads, 1, head_dim)
    cache = shuffled_full_cache(batch, kv_heads, cached, head_dim, block, dtype, device, generator)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # KeepKV's step over a cache at its budget plus the new token (one eviction a row), as a press's layer calls it.
    step_keys, step_values = randn(batch, kv_heads, keepkv_slots, head_dim), randn(batch, kv_heads, keepkv_slots,
                                                                                   head_dim)
    step_probs = torch.softmax(torch.randn(batch, query_heads, 1, keepkv_slots, device=device, generator=generator), -1)
    step_state = (torch.zeros(batch, kv_heads, keepkv_slots, device=device),  # log-weights
                  -torch.rand(batch, kv_heads, keepkv_slots - 1, device=device, generator=generator) - 5,  # ln S
                  torch.arange(keepkv_slots - 1, 0, -1, device=device, dtype=torch.float).expand(  # age
                      batch, kv_heads, -1).contiguous(),
                  torch.ones(batch, kv_heads, keepkv_slots - 1, device=device))  # votes
    return {
        "prompt_scores": lambda: ops.prompt_scores(prompt, keys, log_weights, scale, 1.0, 0.25),
        "prompt sdpa": lambda: sdpa(prompt, keys, values, is_causal=True, scale=scale, enable_gqa=True),
        "decode_attention": lambda: ops.decode_attention(query, cache["keys"], cache["values"], cache["log_weights"],
                                                         scale),
        "decode_attention, split-K": lambda: split_k(lambda: ops.decode_attention(
            query, cache["keys"], cache["values"], cache["log_weights"], scale)),
        "paged_decode_attention": lambda: ops.paged_decode_attention(
            query, cache["key_blocks"], cache["value_blocks"], cache["log_weight_blocks"], cache["block_tables"],
            cache["lengths"], scale, return_probs=False),
        "decode sdpa": lambda: sdpa(query, cache["keys"], cache["values"], scale=scale, enable_gqa=True),
        "keepkv_decode_step": lambda: ops.keepkv_decode_step(step_keys, step_values, query, step_probs, *step_state,
                                                             scale, 0.9, keepkv_slots - 1, 4, 8),
    }


def split_k(call):
    with decode_kernel("split_k"):
        return call()


def workload() -> None:
    """One launch of each between cudaProfilerStart and Stop (ncu runs with --profile-from-start off), after a
    warm-up launch outside that range."""
    import kvpress_cpp  # noqa: F401  (registers torch.ops.kvcomp)

    calls = launches().values()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _number(text: str) -> float | str:
    """ncu's "1,234.56" → 1234.56; "n/a" and other text stay as they are."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def parse_details(text: str) -> list[dict]:
    """ncu's ``--csv --page details`` output → one dict per profiled launch, in launch order: the kernel's name, grid
    and block, every summary metric found (a number where it is one, its unit beside it unless %), every metric by
    section, and the rules' advice (e.g. what limits the occupancy)."""
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if header is None:
        raise ValueError('no ncu CSV table (a line starting with "ID") in the output')
    launches: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[header:]))):
        launch = launches.setdefault(row["ID"], {"kernel": row["Kernel Name"], "grid_size": row.get("Grid Size"),
                                                 "block_size": row.get("Block Size"), "metrics": {}, "rules": []})
        name = row.get("Metric Name", "")
        if not name:
            if row.get("Rule Description"):
                launch["rules"].append(f"{row['Section Name']}: {row['Rule Description']}")
            continue
        unit, value = row.get("Metric Unit", ""), _number(row["Metric Value"])
        launch["metrics"].setdefault(row["Section Name"], {})[name] = [value, unit]
        if name in SUMMARY_METRICS:
            launch[SUMMARY_METRICS[name]] = value
            if unit and unit != "%":
                launch[f"{SUMMARY_METRICS[name]}_unit"] = unit
    return [launches[key] for key in sorted(launches, key=int)]


def short_name(kernel: str) -> str:
    """``void kvcomp::(anonymous namespace)::scores_kernel<c10::BFloat16>(...)`` → ``scores_kernel<c10::BFloat16>``."""
    name = kernel.replace("(anonymous namespace)", "").removeprefix("void ").split("(", 1)[0]
    base, bracket, template = name.partition("<")
    return base.rsplit("::", 1)[-1] + bracket + template


def markdown(launches: list[dict]) -> str:
    columns = ["duration", "memory_throughput_pct", "dram_throughput_pct", "sm_throughput_pct",
               "achieved_occupancy_pct", "theoretical_occupancy_pct", "registers_per_thread",
               "warp_cycles_per_instruction", "grid_size", "block_size"]
    lines = ["| kernel | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for launch in launches:
        cells = [str(launch.get(c, "")) + (f" {launch[c + '_unit']}" if c + "_unit" in launch else "")
                 for c in columns]
        lines.append(f"| `{short_name(launch['kernel'])[:70]}` | " + " | ".join(cells) + " |")
    for launch in launches:
        if launch["rules"]:
            lines += ["", f"`{short_name(launch['kernel'])[:70]}`:", *[f"- {rule}" for rule in launch["rules"]]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="store_true", help="only launch the kernels (what ncu runs)")
    parser.add_argument("--ncu", default="ncu", help="the Nsight Compute command line tool (default: ncu on PATH)")
    args = parser.parse_args()
    if args.workload:
        workload()
        return
    if shutil.which(args.ncu) is None:
        sys.exit(f"ncu_kernels: --ncu {args.ncu!r} is not an executable on this machine (Nsight Compute's ncu ships "
                 "with the CUDA toolkit: pass its path, e.g. --ncu /usr/local/cuda/bin/ncu)")
    command = [args.ncu, "--profile-from-start", "off", "--csv", "--page", "details",
               *[f"--section={section}" for section in SECTIONS], sys.executable, "-m", "benchmarks.ncu_kernels",
               "--workload"]
    print(" ".join(command), flush=True)
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{NAME}.csv").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        sys.exit(f"ncu failed ({done.returncode}): {done.stderr[-2000:]}")
    launches = parse_details(done.stdout)
    (RESULTS_DIR / f"{NAME}.json").write_text(json.dumps({"launches": launches}, indent=2) + "\n")
    (RESULTS_DIR / f"{NAME}.md").write_text(markdown(launches))
    print(markdown(launches))
    print("wrote", RESULTS_DIR / f"{NAME}.json")


if __name__ == "__main__":
    main()
