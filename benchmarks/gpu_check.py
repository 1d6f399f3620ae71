"""make gpu-check: everything the CUDA path must prove on a machine with a GPU and no network, in one run.

    python -m benchmarks.gpu_check                   # all stages
    python -m benchmarks.gpu_check --stages tests sanitizer --timeout 900
    python -m benchmarks.gpu_check --stages ops --op-benchmarks bench_attention bench_kvzap

Stages (each runs in a subprocess with its own time limit; a failure is recorded and the next stage still runs):
  environment  GPU, driver, torch / transformers / kvpress versions, whether kvpress imports
  build        the extension for this GPU's architecture (TORCH_CUDA_ARCH_LIST from its compute capability)
  bandwidth    the device-to-device copy bandwidth (read + write), the roofline of the memory-bound ops
  tests        every test with CUDA in its name (op tests' CUDA cases, the CUDA fuzz, presses across devices), then
               the CUDA-graph capture of each press's decoding step
  sanitizer    compute-sanitizer memcheck, racecheck and synccheck over the CUDA fuzz (every op, random valid inputs)
  ops          the op benchmarks on CUDA against their plain-PyTorch equivalents (benchmarks/bench_*.py), paged
               decode attention against the copy bandwidth (bench_paged --parts kernel), and prompt scoring on a
               Llama-3-8B-shaped layer at 32k and 128k against its sdpa (bench_prefill_overhead)
  prefill      bench_prefill_overhead: each press's prefill over the full-cache forward on a random-weight
               Llama-3-8B-shaped model at 8k and 16k, kvpress's presses beside ours
  decode       bench_decode on that model at 8k, 16k and 32k, 10% budget
  graphs       bench_step_profile --graphs on that model at 32k with a 10% budget (and at 3276 tokens, a 10% press's
               slots, for the press's own share of the step), as many prompts as the GPU's memory fits (12 on an
               H200): the decoding step replayed from a CUDA graph, without the host's launch time, where compression
               can reach issue 20's 3x (a step that only read memory: (16 + 4.3 B) / (16 + 0.43 B) GB)
  profile      bench_step_profile: where one decoding step's time goes on that model at 8k, full cache and presses
  ncu          Nsight Compute over the kernels furthest from their targets (prompt scoring, decode attention, paged
               decode attention, KeepKV's fused step) beside torch's flash attention: throughput, occupancy and its
               limits (benchmarks/ncu_kernels.py)
Results: benchmarks/results/gpu/*.json (the benchmarks' own files, logs) and summary.json + summary.md, which also
check the issue's targets against the figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "gpu"
PYTHON = sys.executable
EXTENSION = "_C.abi3.so"  # the extension module setup.py builds (limited API)
STAGES = ["environment", "build", "bandwidth", "tests", "sanitizer", "ops", "prefill", "decode", "graphs", "profile",
          "ncu"]
# Sanitizer runs are 10-100x slower: every op on 8 random valid inputs (the CUDA fuzz), 25-50 s in all on an H100.
# Not the CUDA-graph tests: without the caching allocator (which memcheck needs to see out-of-bounds accesses within
# pooled blocks) a capture's allocations are cudaMalloc calls, which a capture refuses.
# The CUDA fuzz (every op, small shapes), and the in-place decoding steps over rows of many tiles: memcheck sees an
# edge copy or a tile indexed past its allocation only at such lengths.
SANITIZER_TESTS = ["tests/test_fuzz_ops.py::test_cuda_kernel_matches_the_reference_on_random_valid_inputs",
                   "tests/test_weightedkv_ops.py::test_decoding_step_over_long_rows",
                   "tests/test_keepkv_ops.py::test_decode_step_on_cuda_packs_long_rows_as_the_cpu_op"]
# Those a target reads first, gvote's (no target) last: what a short stage cuts is the least needed.
OP_BENCHMARKS = ["bench_attention", "bench_scores", "bench_keepkv", "bench_zsmerge", "bench_weightedkv",
                 "bench_kvzap --quick", "bench_paged --parts kernel --name paged_kernel_cuda",
                 "bench_prefill_overhead --device cuda --parts op --name prefill_op_cuda", "bench_gvote"]


def benchmark_module(bench: str) -> str:
    """The module an OP_BENCHMARKS entry runs (what --op-benchmarks names)."""
    return bench.split()[0]


DECODE_LENGTHS = [8192, 16384, 32768]
# One run per (press, length), KeepKV first: its prefill folds only its recent window, while ZSMerge's and
# WeightedKV's fold the whole prompt's attention (quadratic in the prompt: slow at 32k on an 8B model), so a run cut
# short by its time limit leaves the others' figures intact.
DECODE_METHODS = ["KeepKV", "ZSMerge", "WeightedKV"]


def run(name: str, command: list[str] | str, timeout: float, env: dict | None = None) -> dict:
    """Run one command, its output to OUT/<name>.log; {'ok', 'seconds', 'rc', 'tail'}."""
    log = OUT / f"{name}.log"
    started = time.perf_counter()
    shell = isinstance(command, str)
    print(f"[gpu-check] {name}: {command if shell else ' '.join(command)}", flush=True)
    try:
        with log.open("w") as out:
            process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                       env={**os.environ, **(env or {})}, shell=shell, start_new_session=True)
            try:
                rc = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # The command's whole process group: pytest's xdist workers and the program compute-sanitizer runs
                # would outlive the command alone, holding the GPU into the next stage's time.
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                rc = "timeout"
    except OSError as error:  # the program itself is missing (no compute-sanitizer, no nvidia-smi)
        log.write_text(f"{type(error).__name__}: {error}\n")
        rc = "not run"
    text = log.read_text(errors="replace")
    result = {"ok": rc == 0, "rc": rc, "seconds": round(time.perf_counter() - started, 1), "log": log.name,
              "tail": text[-2000:]}
    print(f"[gpu-check] {name}: {'ok' if rc == 0 else f'FAILED ({rc})'} in {result['seconds']} s", flush=True)
    return result


def python(code: str) -> list[str]:
    return [PYTHON, "-c", code]


def stage_environment(timeout: float) -> dict:
    probe = (
        "import json, torch, transformers; d = {'torch': torch.__version__, 'cuda': torch.version.cuda, "
        "'transformers': transformers.__version__, 'gpu': torch.cuda.get_device_name(), "
        "'capability': '.'.join(map(str, torch.cuda.get_device_capability())), "
        "'sms': torch.cuda.get_device_properties(0).multi_processor_count}\n"
        "try:\n import kvpress; d['kvpress'] = getattr(kvpress, '__version__', 'imported')\n"
        "except Exception as e: d['kvpress'] = f'import failed: {type(e).__name__}: {e}'\n"
        "print('ENV', json.dumps(d))")
    result = run("environment", python(probe), timeout)
    found = re.search(r"^ENV (.*)$", (OUT / "environment.log").read_text(), re.M)
    result["figures"] = json.loads(found.group(1)) if found else {}
    smi = run("nvidia-smi", ["nvidia-smi"], 60)
    result["figures"]["nvidia_smi_ok"] = smi["ok"]
    return result


def build_check() -> dict:
    return run("build-check", python("import kvpress_cpp; assert kvpress_cpp.cuda_kernels_built(), 'no CUDA kernels'"),
               120)


def stage_build(timeout: float, prebuilt: Path | None = None) -> dict:
    """`prebuilt`: an extension built off the device against this machine's torch (`make gpu-prebuild`), used where it
    loads with its CUDA kernels; else (or when it does not load) the extension is built here."""
    if prebuilt is not None:
        shutil.copyfile(prebuilt, ROOT / "kvpress_cpp" / EXTENSION)
        check = build_check()
        if check["ok"]:
            return {"ok": True, "figures": {"prebuilt": str(prebuilt), "cuda_kernels_built": True}}
        print(f"[gpu-check] build: {prebuilt} does not load here, building", flush=True)
    capability = subprocess.run(
        python("import torch; print('%d.%d' % torch.cuda.get_device_capability())"), capture_output=True, text=True,
        cwd=ROOT).stdout.strip()
    env = {"TORCH_CUDA_ARCH_LIST": capability or "9.0", "MAX_JOBS": os.environ.get("MAX_JOBS", str(os.cpu_count()))}
    result = run("build", [PYTHON, "setup.py", "build_ext", "--inplace"], timeout, env)
    check = build_check()
    result["ok"] = result["ok"] and check["ok"]
    result["figures"] = {"arch": env["TORCH_CUDA_ARCH_LIST"], "cuda_kernels_built": check["ok"]}
    return result


def stage_bandwidth(timeout: float) -> dict:
    result = run("bandwidth", python("from benchmarks.common import copy_bandwidth_gbs; "
                                     "print('COPY_GBPS', copy_bandwidth_gbs('cuda'))"), timeout)
    found = re.search(r"COPY_GBPS ([0-9.]+)", (OUT / "bandwidth.log").read_text())
    result["figures"] = {"copy_GBps": round(float(found.group(1)), 1)} if found else {}
    return result


def pytest_summary(log: Path) -> dict:
    text = log.read_text(errors="replace")
    # pytest writes "1 error" and "2 errors": one key, "errors", for both.
    return {"errors" if kind.startswith("error") else kind: int(n)
            for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", text)}


def workers(count: int) -> list[str]:
    """pytest-xdist's option for `count` workers where it is installed (the GPU is shared, the CPU references are
    the slow part), else nothing."""
    return ["-n", str(count)] if importlib.util.find_spec("xdist") is not None else []


def stage_tests(timeout: float) -> dict:
    """Every test with CUDA in its name (each op test's CUDA cases, the CUDA fuzz, presses across devices), then the
    CUDA-graph capture of each press's decoding step on its own."""
    command = [PYTHON, "-m", "pytest", "-q", "-rfE", *workers(8), "-k", "cuda and not test_cuda_graphs", "tests"]
    result = run("tests", command, timeout / 2)
    graphs = run("tests-cuda-graphs", [PYTHON, "-m", "pytest", "-q", "tests/test_cuda_graphs.py"], timeout / 2)
    result["figures"] = {"op_tests": pytest_summary(OUT / "tests.log"),
                         "cuda_graph_tests": pytest_summary(OUT / "tests-cuda-graphs.log")}
    result["ok"] = result["ok"] and graphs["ok"]
    return result


def stage_sanitizer(timeout: float) -> dict:
    figures, ok = {}, True
    for tool in ("memcheck", "racecheck", "synccheck"):
        command = ["compute-sanitizer", f"--tool={tool}", "--error-exitcode=99", "--target-processes=all", PYTHON,
                   "-m", "pytest", "-q", *SANITIZER_TESTS]
        result = run(f"sanitizer-{tool}", command, timeout / 3, {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
        errors = sanitizer_errors((OUT / f"sanitizer-{tool}.log").read_text(errors="replace"))
        figures[tool] = {"errors": errors, "rc": result["rc"], "tests": pytest_summary(OUT / f"sanitizer-{tool}.log")}
        ok = ok and result["ok"] and errors == 0
    return {"ok": ok, "figures": figures}


def sanitizer_errors(text: str) -> int | None:
    """Errors compute-sanitizer reported in a log (summed over its processes), None where it printed no summary.
    memcheck and synccheck end with "ERROR SUMMARY: N errors", racecheck with "RACECHECK SUMMARY: H hazards displayed
    (N errors, W warnings)"."""
    counts = re.findall(r"ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: .*?\((\d+) error", text)
    return sum(int(a or b) for a, b in counts) if counts else None


def stage_ops(timeout: float, benchmarks: list[str] = OP_BENCHMARKS) -> dict:
    """`timeout`: seconds for all the op benchmarks. Each gets an equal share of what the ones before it left, so the
    time a quick one does not use goes to the slower ones after it (the ninth run cut four at a fixed 27 s each).
    `benchmarks`: those of OP_BENCHMARKS to run, for a device lease too short for all of them."""
    figures, ok = {}, True
    env = {"KVCOMP_RESULTS_DIR": str(OUT), "KVCOMP_BENCH_DEVICES": "cuda"}
    deadline = time.perf_counter() + timeout
    for index, bench in enumerate(benchmarks):
        module, *args = bench.split()
        share = max(deadline - time.perf_counter(), 0.0) / (len(benchmarks) - index)
        result = run(module, [PYTHON, "-m", f"benchmarks.{module}", *args], max(share, 1.0), env)
        figures[module] = "ok" if result["ok"] else f"failed ({result['rc']})"
        ok = ok and result["ok"]
    return {"ok": ok, "figures": figures}


PREFILL_NAME = "prefill_overhead_random-llama3-8b_cuda"
PREFILL_PRESSES = ["ZSMerge", "WeightedKV", "KeepKV", "GVote", "StreamingLLM (kvpress)", "SnapKV (kvpress)",
                   "TOVA (kvpress)"]


def stage_prefill(timeout: float) -> dict:
    """One round per prompt length (an 8B forward at 16k takes seconds); kvpress's presses are left out, saying why,
    where its transformers range is not met."""
    command = [PYTHON, "-m", "benchmarks.bench_prefill_overhead", "--device", "cuda", "--model", "random-llama3-8b",
               "--lengths", "8192", "16384", "--repeats", "1", "--parts", "presses", "--presses", *PREFILL_PRESSES,
               "--name", PREFILL_NAME]
    result = run("prefill", command, timeout, {"KVCOMP_RESULTS_DIR": str(OUT)})
    result["figures"] = {f"{row['press']} {row['prompt']}": row["ratio"] for row in load_rows(PREFILL_NAME)
                         if row.get("part") == "presses"}
    return result


def decode_name(method: str, length: int) -> str:
    return f"decode_random-llama3-8b_{method}_{length}"


def stage_decode(timeout: float) -> dict:
    """`timeout`: seconds per bench_decode run (one press, one prompt length)."""
    figures, ok = {}, True
    env = {"KVCOMP_RESULTS_DIR": str(OUT)}
    # The full cache at a tenth of each prompt holds as many slots as a 10% press does: its step time is what the
    # press's step would cost without the press (so the press's own share of the step is the difference).
    runs = [(method, length) for method in DECODE_METHODS for length in DECODE_LENGTHS]
    runs += [("KeepKV", length // 10) for length in DECODE_LENGTHS]
    for method, length in runs:
        name = decode_name(method, length)
        command = [PYTHON, "-m", "benchmarks.bench_decode", "--device", "cuda", "--model", "random-llama3-8b",
                   "--lengths", str(length), "--budgets", "0.1", "--methods", method, "--repeats", "1",
                   "--new-tokens", "32", "--name", name]
        result = run(name, command, timeout, env)
        figures[f"{method} {length}"] = "ok" if result["ok"] else f"failed ({result['rc']})"
        ok = ok and result["ok"]
    return {"ok": ok, "figures": figures}


GRAPHS_NAME = "profile_step_graphs_random-llama3-8b"
# The target's prompt, then a tenth of it: the full cache there holds as many slots as a 10% press at 32k, so the
# difference of their replayed steps is the press's own cost.
GRAPHS_LENGTH, GRAPHS_SAME_SLOTS = 32768, 3276


def replay_batch(total_bytes: int) -> int:
    """Prompts of 32k the graphs stage decodes together on a GPU of `total_bytes`: beside the 16 GB of weights, each
    prompt's full-cache prefill takes ~9 GiB (4 GiB of keys and values, the rest its MLP's activations); at most 12,
    where (16 + 4.3 B) / (16 + 0.43 B) passes 3."""
    return max(1, min(12, int((total_bytes / 2**30 - 24) / 9)))


def stage_graphs(timeout: float) -> dict:
    import torch

    batch = replay_batch(torch.cuda.get_device_properties(0).total_memory)
    # --top: each case's kernels by device time as well, launched and replayed, so that a step slower than its bytes
    # say (or a replay slower than its launched step) is explained in the same run. Expandable segments: at 12 x 32k
    # the full cache's prefill ran out of memory without them (40 GiB reserved but unallocated, H200) and fitted with
    # them.
    command = [PYTHON, "-m", "benchmarks.bench_step_profile", "--device", "cuda", "--model", "random-llama3-8b",
               "--lengths", str(GRAPHS_LENGTH), str(GRAPHS_SAME_SLOTS), "--batch", str(batch), "--graphs", "--top",
               "15", "--steps", "3", "--methods", *DECODE_METHODS, "--name", GRAPHS_NAME]
    result = run("graphs", command, timeout, {"KVCOMP_RESULTS_DIR": str(OUT),
                                              "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    result["figures"] = {f"{row['method']}, {row['batch']} x {row['prompt']}": row.get("tok_s", row.get("error"))
                         for row in load_rows(GRAPHS_NAME)}
    return result


def stage_profile(timeout: float) -> dict:
    env = {"KVCOMP_RESULTS_DIR": str(OUT)}
    command = [PYTHON, "-m", "benchmarks.bench_step_profile", "--device", "cuda", "--model", "random-llama3-8b",
               "--lengths", "8192", "--name", "profile_step_random-llama3-8b"]
    result = run("profile", command, timeout, env)
    result["figures"] = {f"{row['method']} {row['prompt']}": row["step_ms"]
                         for row in load_rows("profile_step_random-llama3-8b")}
    return result


def stage_ncu(timeout: float) -> dict:
    from benchmarks.ncu_kernels import NAME, short_name

    result = run("ncu", [PYTHON, "-m", "benchmarks.ncu_kernels"], timeout, {"KVCOMP_RESULTS_DIR": str(OUT)})
    path = OUT / f"{NAME}.json"
    launches = json.loads(path.read_text())["launches"] if result["ok"] and path.exists() else []
    result["figures"] = {short_name(launch["kernel"])[:60]: {key: launch.get(key) for key in (
        "duration", "duration_unit", "dram_throughput_pct", "sm_throughput_pct", "achieved_occupancy_pct")}
        for launch in launches}
    return result


# Per op benchmark: which of its rows time a decoding step as a press runs it, and the speedup over the step in plain
# PyTorch (vectorised over the heads). Prefill rows, bench_scores' chunk of 16 queries (a step appends one token),
# bench_keepkv's former three-op composition (no press runs it) and bench_zsmerge's one-head-at-a-time loop are other
# comparisons.
DECODE_STEP_ROWS = {
    "scores": (lambda row: row.get("q") == 1, "speedup"),
    "keepkv": (lambda row: row.get("what") == "keepkv_decode_step", "speedup_vs_vectorised"),
    "zsmerge": (lambda row: row.get("what") == "decode step", "speedup_vs_vectorised"),
    "weightedkv": (lambda row: row.get("case") == "decode step", "speedup"),
    "kvzap": (lambda row: row.get("phase") == "decode step", "speedup"),
}


# When this check's summary was begun (its first invocation on this machine; later invocations add stages to it):
# result files older than that are an earlier run's (the committed ones of a fresh clone), which targets() ignores.
RUN_STARTED = 0.0


def load_rows(name: str) -> list[dict]:
    path = OUT / f"{name}.json"
    fresh = path.exists() and path.stat().st_mtime >= RUN_STARTED
    return json.loads(path.read_text())["rows"] if fresh else []


def targets(stages: dict) -> list[dict]:
    """The issues' targets and the decode routing's check, each {'target', 'value', 'met'} (met None: not measured in
    this run)."""
    checks = []
    attention = [r for r in load_rows("attention") if r.get("B") == 8 and r["T"] >= 16384]
    fractions = [r.get("fraction_of_copy_bw") for r in attention if r.get("fraction_of_copy_bw") is not None]
    checks.append({"target": "decode attention B=8, Hq=32, H=8, d=128, bf16, T>=16k: >= 70% of copy bandwidth",
                   "value": fractions, "met": bool(fractions) and min(fractions) >= 0.70 if fractions else None})
    timed_both = [r for r in load_rows("attention") if "routing_cost" in r]
    checks.append({"target": "decode attention's routing: each shape within 5% of the faster of its two kernels",
                   "value": {f"B={r['B']} T={r['T']}": r["routing_cost"] for r in timed_both},
                   "met": max(r["routing_cost"] for r in timed_both) <= 1.05 if timed_both else None})
    long_caches = [r for r in load_rows("paged_kernel_cuda") if r.get("T", 0) >= 16384]
    paged = [r["fraction_of_copy"] for r in long_caches if "peer" not in r]
    checks.append({"target": "paged decode attention (issue 21), B=4, H=8, G=4, d=128, bf16, blocks of 16, T>=16k: "
                             ">= 70% of copy bandwidth", "value": paged, "met": min(paged) >= 0.70 if paged else None})
    peers = {f"{r['peer']} T={r['T']}": r["fraction_of_copy"] for r in long_caches if "peer" in r}
    notes = [r["note"] for r in load_rows("paged_kernel_cuda") if "peer" in r and "note" in r]
    checks.append({"target": "peer: FlashInfer's paged decode on the same keys and values, fraction of copy bandwidth "
                             "(no log-weights, no probabilities)", "value": peers or notes or None, "met": None})
    speedups = {}
    for bench, (is_decode_step, speedup) in DECODE_STEP_ROWS.items():
        for row in load_rows(bench):
            if is_decode_step(row) and isinstance(row.get(speedup), (int, float)):
                speedups.setdefault(bench, []).append(row[speedup])
    worst = {bench: min(values) for bench, values in speedups.items()}
    checks.append({"target": "every decode-step op >= 5x its plain-PyTorch equivalent (smallest speedup per bench)",
                   "value": worst, "met": all(v >= 5 for v in worst.values()) if worst else None})
    # Each run holds its press's row and a full-cache row of the same prompt, measured in the same process.
    ratios, overhead = {}, {}
    for method in DECODE_METHODS:
        for length in DECODE_LENGTHS:
            rows = {r["method"]: r for r in load_rows(decode_name(method, length))}
            full, pressed = rows.get("full"), rows.get(f"{method} 10%")
            if full and pressed:
                ratios[f"{method} {length}"] = round(pressed["decode_tok_s"] / full["decode_tok_s"], 2)
            same_size = {r["method"]: r for r in load_rows(decode_name("KeepKV", length // 10))}.get("full")
            if pressed and same_size:
                overhead[f"{method} {length}"] = round(same_size["decode_tok_s"] / pressed["decode_tok_s"] - 1, 3)
    at_32k = {k: v for k, v in ratios.items() if k.endswith(" 32768")}
    checks.append({"target": "32k, 10% budget: decode tokens/s >= 3x the full cache's", "value": at_32k,
                   "met": all(v >= 3 for v in at_32k.values()) if at_32k else None})
    # Each case at its faster of launched and replayed (bench_step_profile's tok_s, best_step_ms).
    replayed_rows = [row for row in load_rows(GRAPHS_NAME) if "tok_s" in row]
    replayed = {row["method"]: row for row in replayed_rows if row["prompt"] == GRAPHS_LENGTH}
    full = replayed.pop("full", None)
    replayed_ratios = {f"{method}, batch {row['batch']}": round(row["tok_s"] / full["tok_s"], 2)
                       for method, row in replayed.items()} if full else {}
    every_press = all(any(key.startswith(f"{method} ") for key in replayed_ratios) for method in DECODE_METHODS)
    checks.append({"target": "32k, 10% budget, steps replayed from a CUDA graph (each case at its faster of replayed "
                             "and launched), as many prompts as the GPU fits: decode tokens/s >= 3x the full cache's",
                   "value": replayed_ratios or None,
                   "met": False if any(v < 3 for v in replayed_ratios.values()) else (True if every_press else None)})
    same_slots = next((row for row in replayed_rows if row["prompt"] == GRAPHS_SAME_SLOTS and row["method"] == "full"),
                      None)
    replayed_overhead = {f"{method}, batch {row['batch']}":
                         round(row["best_step_ms"] / same_slots["best_step_ms"] - 1, 3)
                         for method, row in replayed.items()} if same_slots else {}
    checks.append({"target": "a merging press adds <= 10% to the decode step replayed from a CUDA graph (its step at "
                             "32k over the full cache's at 3276 slots, minus 1; each at its faster of replayed and "
                             "launched)", "value": replayed_overhead or None,
                   "met": all(v <= 0.10 for v in replayed_overhead.values()) if replayed_overhead else None})
    checks.append({"target": "decode tokens/s with a 10% budget over the full cache's, every length",
                   "value": ratios, "met": None})
    checks.append({"target": "a merging press adds <= 10% to the decode step (step time over that of a full cache "
                             "of as many slots, minus 1)", "value": overhead,
                   "met": all(v <= 0.10 for v in overhead.values()) if overhead else None})
    # In half precision the layer's own prompt pass (cuDNN's attention) hands its log-sum-exp to the press, whose
    # scoring is then prompt_scores' second pass alone; both passes run where cuDNN's attention does not.
    op_rows = {row["T"]: row for row in load_rows("prefill_op_cuda") if row.get("part") == "op"}
    scoring = {length: {"scores pass, log-sum-exp from the layer's attention": round(row["op_given_lse_s"] /
                                                                                     row["sdpa_s"], 2),
                        "both passes": row["op_vs_sdpa"]} for length, row in op_rows.items()}
    checks.append({"target": "prompt scoring <= 1.5x the layer's sdpa at 32k, Llama-3-8B layer, B = 1",
                   "value": scoring.get(32768),
                   "met": (scoring[32768]["scores pass, log-sum-exp from the layer's attention"] <= 1.5
                           if 32768 in scoring else None)})
    checks.append({"target": "prompt scoring at 128k, B = 1, completes", "value": scoring.get(131072),
                   "met": True if 131072 in scoring else None})
    sanitizer = stages.get("sanitizer", {}).get("figures", {})
    errors = {tool: f.get("errors") for tool, f in sanitizer.items()}
    checks.append({"target": "compute-sanitizer memcheck / racecheck / synccheck: zero errors", "value": errors,
                   "met": all(e == 0 for e in errors.values()) if errors else None})
    graphs = stages.get("tests", {}).get("figures", {}).get("cuda_graph_tests", {})
    checks.append({"target": "each press's decoding step captured in a CUDA graph replays as eager", "value": graphs,
                   "met": (graphs.get("passed", 0) > 0 and not graphs.get("failed") and not graphs.get("errors"))
                   if graphs else None})
    return checks


def markdown(stages: dict, checks: list[dict]) -> str:
    lines = ["# make gpu-check", "", "| stage | result | seconds | figures |", "| --- | --- | --- | --- |"]
    for name, stage in stages.items():
        status = "ok" if stage.get("ok") else "FAILED"
        figures = json.dumps(stage.get("figures", {}))
        lines.append(f"| {name} | {status} | {stage.get('seconds', '')} | `{figures}` |")
    lines += ["", "| target | measured | met |", "| --- | --- | --- |"]
    for check in checks:
        met = {True: "yes", False: "NO", None: "not measured"}[check["met"]]
        lines.append(f"| {check['target']} | `{json.dumps(check['value'])}` | {met} |")
    failed = [name for name, stage in stages.items() if not stage.get("ok")]
    for name in failed:
        lines += ["", f"## {name}: last lines of its log", "", "```", stages[name].get("tail", "")[-1500:], "```"]
    return "\n".join(lines) + "\n"


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", nargs="+", default=STAGES, choices=STAGES)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per stage")
    parser.add_argument("--decode-timeout", type=float, default=300, help="seconds per decode benchmark run")
    parser.add_argument("--op-benchmarks", nargs="+", choices=[benchmark_module(bench) for bench in OP_BENCHMARKS],
                        help="the ops stage runs only these (default: all, in their order)")
    parser.add_argument("--prebuilt", type=Path, default=None,
                        help="the build stage first tries this extension, built off the device (make gpu-prebuild)")
    args = parser.parse_args()
    if not visible_gpus():  # before anything is written: a run here would replace the last GPU run's results
        sys.exit(f"gpu_check: torch sees no CUDA device on this machine; it runs on a machine with a GPU and writes "
                 f"its results over {OUT}, where the last GPU run's are kept")
    OUT.mkdir(parents=True, exist_ok=True)
    summary_path = OUT / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    stages = summary.get("stages", {})
    global RUN_STARTED
    RUN_STARTED = summary.get("started", time.time())
    for name in args.stages:
        started = time.perf_counter()
        try:
            extra = {"prebuilt": args.prebuilt} if name == "build" else {}
            if name == "ops" and args.op_benchmarks:
                extra = {"benchmarks": [b for b in OP_BENCHMARKS if benchmark_module(b) in args.op_benchmarks]}
            stages[name] = globals()[f"stage_{name}"](args.decode_timeout if name == "decode" else args.timeout,
                                                      **extra)
        except Exception as error:  # a broken stage is recorded, the others still run
            stages[name] = {"ok": False, "tail": f"{type(error).__name__}: {error}"}
        stages[name]["seconds"] = round(time.perf_counter() - started, 1)
        checks = targets(stages)
        summary_path.write_text(json.dumps({"started": RUN_STARTED, "stages": stages, "targets": checks},
                                           indent=2) + "\n")
        (OUT / "summary.md").write_text(markdown(stages, checks))
    print((OUT / "summary.md").read_text())
    sys.exit(0 if all(stages[name].get("ok") for name in args.stages) else 1)


if __name__ == "__main__":
    main()
