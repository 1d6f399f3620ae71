"""Shared pieces of the benchmarks: timing with torch.utils.benchmark, device bandwidth, and result files.

Every benchmark compares an op with its plain-PyTorch reference in the same run, reports the ratio, and writes JSON
(and a plot where a table is hard to read) under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
from pathlib import Path

import torch
import torch.utils.benchmark as tbench

# KVCOMP_RESULTS_DIR redirects every result file (make gpu-check: benchmarks/results/gpu).
RESULTS_DIR = Path(os.environ.get("KVCOMP_RESULTS_DIR", Path(__file__).resolve().parent / "results")).resolve()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `tests.reference` imports from a checkout

# (B, T) of the decoding-step rows on a GPU, T the slots the step reads (the new token's included): issue 20's target
# is every decode-step op >= 5x its plain-PyTorch equivalent at B 1-16, T 4k-32k, so each op benchmark times the
# corners of that range. On the CPU (tests, CI, a 2-core VM) each keeps its own smaller shapes.
DECODE_STEP_GRID = [(1, 4096), (16, 4096), (1, 32768), (16, 32768)]


def median_seconds(fn, min_run_time: float = 0.5, num_threads: int | None = None) -> float:
    """Median wall time of fn() (torch.utils.benchmark synchronises CUDA and runs on CPU alike)."""
    timer = tbench.Timer(stmt="fn()", globals={"fn": fn}, num_threads=num_threads or torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def copy_bandwidth_gbs(device: str, nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth (read + write bytes per second), the roofline a memory-bound
    kernel is judged against."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src))
    return 2 * nbytes / seconds / 1e9


def configurations() -> list[tuple[str, int]]:
    """(device, CPU threads) pairs to measure: the CPU at one thread and at all of them (on this VM, OpenMP wake-ups
    add tens of ms to multi-threaded ATen reductions, so both are reported), and the GPU when present.
    KVCOMP_BENCH_DEVICES=cuda keeps only the GPU (make gpu-check)."""
    cpu = [("cpu", 1)] + ([("cpu", torch.get_num_threads())] if torch.get_num_threads() > 1 else [])
    found = cpu + ([("cuda", torch.get_num_threads())] if torch.cuda.is_available() else [])
    wanted = os.environ.get("KVCOMP_BENCH_DEVICES")
    if not wanted:
        return found
    kept = [c for c in found if c[0] in wanted.split(",")]
    if not kept:  # else the benchmark would measure nothing and write an empty result file over the last one
        raise RuntimeError(f"KVCOMP_BENCH_DEVICES={wanted}: no such device here "
                           f"(torch sees {', '.join(sorted({device for device, _ in found}))})")
    return kept


def environment() -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
           "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (benchmarks run headless and write PNGs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, name: str) -> Path:
    """Lay out `fig` and write it to benchmarks/results/<name>.png."""
    fig.tight_layout()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.png"
    fig.savefig(path, dpi=120)
    print("wrote", path)
    return path


@contextlib.contextmanager
def decode_kernel(name: str):
    """Every decode attention call inside takes kernel `name` (split_k, tensor_cores) where both can run
    (KVCOMP_DECODE_KERNEL, read by the CUDA op at each call)."""
    before = os.environ.get("KVCOMP_DECODE_KERNEL")
    os.environ["KVCOMP_DECODE_KERNEL"] = name
    try:
        yield
    finally:
        if before is None:
            del os.environ["KVCOMP_DECODE_KERNEL"]
        else:
            os.environ["KVCOMP_DECODE_KERNEL"] = before


def positive_int(text: str) -> int:
    """An argparse type: a count, which must be ≥ 1 (a count of 0 would fail later, in a statistic over no runs)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer ≥ 1, got {text}")
    return value


def prompt_fraction(text: str) -> float:
    """An argparse type: a fraction of the prompt a press keeps, in (0, 1] (the presses refuse any other, but only
    once the model is built)."""
    value = float(text)
    if not 0 < value <= 1:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a fraction of the prompt in (0, 1], got {text}")
    return value


def parse_without_options(doc: str) -> None:
    """The command line of a benchmark that takes no options: ``--help`` shows `doc` (the module's docstring) and
    exits, and anything else is refused, before a run that would overwrite the committed results."""
    argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()


def write_results(name: str, rows: list[dict], env: dict | None = None) -> Path:
    """results/<name>.json: the rows and the environment they were measured in (this process's unless `env`)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"environment": env or environment(), "rows": rows}, indent=2) + "\n")
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max([len(c)] + [len(f"{r.get(c, '')}") for r in rows]) for c in columns]  # rows may be empty
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(f"{row.get(c, '')}".ljust(w) for c, w in zip(columns, widths)))
