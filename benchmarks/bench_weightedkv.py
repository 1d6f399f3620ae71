"""kvcomp::weightedkv_evict: one WeightedKV decoding step, and a prefill reduction, against plain PyTorch.

    python -m benchmarks.bench_weightedkv        # writes benchmarks/results/weightedkv.json

Decoding step (Hq=32, H=8, d=128; the paper's 4 sinks and m/2 - 4 recent slots): the new token took the cache to
T = m + 1 slots; fold its attention into the running sums a (update_scores, decay=1, input_scale=1/G),
n <- [n + 1, 1], evict one slot. The ops against the same step written in vectorised plain PyTorch (argmin over the
middle, gather the pair, merge, delete slot j with one gather or one boolean mask for all rows, whichever is
faster). B=4, m=1024 on the CPU; on CUDA B in {1, 16} x T in {4096, 32768} (common.DECODE_STEP_GRID), the range of
issue 20's ">= 5x" target (gpu_check reads it from these rows). Targets: >= 2x on CPU, >= 5x on GPU.

Prefill reduction (B=1, H=8, T=4096 -> m=1024, d=128): weightedkv_evict with evictions=3072 against the reference of
tests/reference.py (Algorithm 1 step by step, Python loop, torch.cat deletion), timed once, at one CPU thread (its
fastest: at two, OpenMP wake-ups in each of its ~10^5 small ops make it 10x slower).

CPU timings keep freed memory in glibc's heap (see keep_freed_memory); this helps plain PyTorch more than the op,
since it allocates more.
"""

import ctypes
import time

import torch
import torch.nn.functional as F

from benchmarks.common import (DECODE_STEP_GRID, configurations, copy_bandwidth_gbs, median_seconds,
                               parse_without_options, print_table, write_results)
from kvpress_cpp import ops
from tests import reference

QUERY_HEADS, KV_HEADS, CACHE_SIZE, HEAD_DIM = 32, 8, 1024, 128
SINKS = 4
PREFILL_LEN = 4096
DECODE_SHAPES = {"cpu": [(4, CACHE_SIZE + 1)], "cuda": DECODE_STEP_GRID}  # (B, T): m = T - 1 slots plus the new token


def recent_slots(cache_size):
    """The paper's recent window beside its 4 sinks: m/2 - 4 slots."""
    return cache_size // 2 - 4


def decoding_state(dtype, device, batch, cache_size, seed=0):
    """The cache right after the new token was appended: m + 1 keys / values, m old sums / counts, its attention."""
    # Drawn on the device: at 16 x 32k slots a CPU takes seconds per tensor, a good part of the GPU run's time.
    generator = torch.Generator(device).manual_seed(seed)
    total = cache_size + 1
    keys = torch.randn(batch, KV_HEADS, total, HEAD_DIM, generator=generator, device=device).to(dtype)
    values = torch.randn(batch, KV_HEADS, total, HEAD_DIM, generator=generator, device=device).to(dtype)
    counts = torch.randint(1, 4 * cache_size, (batch, KV_HEADS, cache_size), generator=generator, device=device).float()
    sums = torch.rand(batch, KV_HEADS, cache_size, generator=generator, device=device) * counts / cache_size
    attn = torch.randn(batch, QUERY_HEADS, 1, total, generator=generator, device=device).softmax(-1)
    return keys, values, sums, counts, attn.to(dtype)


def op_step(keys, values, sums, counts, attn):
    group = attn.shape[1] // sums.shape[1]
    recent = recent_slots(sums.shape[-1])
    sums = torch.ops.kvcomp.update_scores(sums, attn, 1.0, 1.0 / group)
    counts = F.pad(counts + 1, (0, 1), value=1.0)
    # In place: a repeated call evicts again from the same rows (a valid cache each time), the same work per call.
    return ops.weightedkv_evict(keys, values, sums, counts, SINKS, recent, 1)


def _plain_merge(keys, values, sums, counts, attn):
    """Plain PyTorch, vectorised over (batch, kv head): sums, counts, the slot j to evict (B, H, 1) and the values
    with V[j+1] merged."""
    batch, kv_heads, total, dim = keys.shape
    group = attn.shape[1] // kv_heads
    sums = F.pad(sums, (0, 1)) + attn.view(batch, kv_heads, group, total).float().mean(2)
    counts = F.pad(counts + 1, (0, 1), value=1.0)
    mean = sums / counts
    middle = mean[..., SINKS : total - recent_slots(total - 1)]
    j = torch.where(middle.isnan(), float("inf"), middle).argmin(-1, keepdim=True) + SINKS  # (B, H, 1)
    pair = mean.gather(-1, torch.cat([j, j + 1], -1))  # (B, H, 2)
    weight_sum = pair.sum(-1, keepdim=True)
    coefficients = torch.where(weight_sum == 0, 0.5, pair / weight_sum)
    pair_index = torch.cat([j, j + 1], -1)[..., None].expand(-1, -1, -1, dim)
    pair_values = values.gather(2, pair_index).float()
    merged = (coefficients[..., None] * pair_values).sum(2, keepdim=True).to(values.dtype)
    values = values.scatter(2, pair_index[:, :, 1:], merged)
    return values, sums, counts, j


def plain_step_gather(keys, values, sums, counts, attn):
    """The step in plain PyTorch, deleting slot j with one gather per tensor."""
    batch, kv_heads, total, dim = keys.shape
    values, sums, counts, j = _plain_merge(keys, values, sums, counts, attn)
    kept = torch.arange(total - 1, device=keys.device).expand(batch, kv_heads, -1)
    kept = kept + (kept >= j)  # skip slot j
    kept_rows = kept[..., None].expand(-1, -1, -1, dim)
    return keys.gather(2, kept_rows), values.gather(2, kept_rows), sums.gather(-1, kept), counts.gather(-1, kept)


def plain_step_mask(keys, values, sums, counts, attn):
    """The step in plain PyTorch, deleting slot j with one boolean mask for all tensors (faster than the gather for
    half types on CPU, slower for float32)."""
    batch, kv_heads, total, dim = keys.shape
    values, sums, counts, j = _plain_merge(keys, values, sums, counts, attn)
    kept = torch.arange(total, device=keys.device) != j  # (B, H, T)
    shape = (batch, kv_heads, total - 1)
    return (keys[kept].view(*shape, dim), values[kept].view(*shape, dim), sums[kept].view(shape),
            counts[kept].view(shape))


PLAIN_STEPS = {"gather": plain_step_gather, "mask": plain_step_mask}


def prefill_state(device, seed=1):
    """T = 4096 prompt slots: keys, values, a_i = sum_{j >= i} A[j, i] (random here), n_i = T - i."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, KV_HEADS, PREFILL_LEN, HEAD_DIM, generator=generator)
    values = torch.randn(1, KV_HEADS, PREFILL_LEN, HEAD_DIM, generator=generator)
    counts = torch.arange(PREFILL_LEN, 0, -1, dtype=torch.float32).expand(1, KV_HEADS, -1).contiguous()
    sums = torch.rand(1, KV_HEADS, PREFILL_LEN, generator=generator) * counts / 64
    return keys.to(device), values.to(device), sums.to(device), counts.to(device)


def keep_freed_memory() -> None:
    """Every step returns a fresh 17 MB cache (float32). By default glibc serves blocks that large with mmap (or trims
    them off the heap top when freed), so each new tensor page-faults in anew: on this VM ~20 ms per step, noisy from
    1 to 25 ms, for the op and plain PyTorch alike, which then measures the kernel's page zeroing. Keep freed blocks
    in the heap, as a serving process (or a caching allocator) would, so that the timings compare the kernels."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum; blocks below it come from the heap
    libc.mallopt(m_trim_threshold, 1 << 30)


def once_seconds(fn, device):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_row(device, threads, bandwidth, dtype, batch, cache_size) -> dict:
    """The op's decoding step against the faster plain-PyTorch one, m = cache_size slots plus the new token."""
    state = decoding_state(dtype, device, batch, cache_size)
    for plain_step in PLAIN_STEPS.values():  # same step, same result (the op's on copies: it works in place)
        for got, expected in zip(op_step(*(t.clone() for t in state)), plain_step(*state)):
            torch.testing.assert_close(got, expected, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-5)
    op_s = median_seconds(lambda: op_step(*state), num_threads=threads)
    # the baseline is the faster of the two plain deletions
    plain_times = {name: median_seconds(lambda: step(*state), num_threads=threads)
                   for name, step in PLAIN_STEPS.items()}
    plain_name = min(plain_times, key=plain_times.get)
    plain_s = plain_times[plain_name]
    keys, values = state[0], state[1]
    moved = (keys.nbytes + values.nbytes) * (2 * cache_size + 1) // (cache_size + 1) + state[4].nbytes
    row = {"case": "decode step", "device": device, "threads": threads, "dtype": str(dtype).split(".")[-1],
           "B": batch, "Hq": QUERY_HEADS, "H": KV_HEADS, "T": cache_size + 1, "m": cache_size, "evictions": 1,
           "d": HEAD_DIM, "op_us": round(op_s * 1e6, 1), "plain_us": round(plain_s * 1e6, 1), "plain": plain_name,
           "speedup": round(plain_s / op_s, 2), "op_GBps": round(moved / op_s / 1e9, 1)}
    if bandwidth:
        row["fraction_of_copy_bw"] = round(moved / op_s / 1e9 / bandwidth, 2)
    return row


def main() -> None:
    parse_without_options(__doc__)
    keep_freed_memory()
    rows = []
    for device, threads in configurations():
        torch.set_num_threads(threads)
        bandwidth = copy_bandwidth_gbs(device) if device == "cuda" else None
        for dtype in (torch.float32, torch.bfloat16) if device == "cpu" else (torch.bfloat16, torch.float16):
            for batch, total in DECODE_SHAPES[device]:
                rows.append(decode_row(device, threads, bandwidth, dtype, batch, total - 1))

        evictions = PREFILL_LEN - CACHE_SIZE
        prefill = prefill_state(device)
        recent = recent_slots(CACHE_SIZE)
        op_s = median_seconds(lambda: torch.ops.kvcomp.weightedkv_evict(*prefill, SINKS, recent, evictions),
                              num_threads=threads)
        torch.set_num_threads(1 if device == "cpu" else threads)
        reference_s = once_seconds(lambda: reference.weightedkv_evict(*prefill, SINKS, recent, evictions), device)
        rows.append({"case": "prefill 4k->1k", "device": device, "threads": threads, "dtype": "float32", "B": 1,
                     "H": KV_HEADS, "T": PREFILL_LEN, "evictions": evictions, "d": HEAD_DIM,
                     "op_us": round(op_s * 1e6, 1), "reference_us": round(reference_s * 1e6, 1),
                     "speedup": round(reference_s / op_s, 1),
                     "reference_threads": 1 if device == "cpu" else threads})
    print_table(rows, ["case", "device", "threads", "dtype", "B", "H", "T", "m", "evictions", "op_us", "plain_us",
                       "plain", "reference_us", "speedup", "op_GBps", "fraction_of_copy_bw"])
    print("wrote", write_results("weightedkv", rows))


if __name__ == "__main__":
    main()
