"""Fuzz suite of every kvcomp op (issue 17): seeded random valid inputs against tests/reference.py, and every
bad-input class derived from the op's declared contract (kvpress_cpp/_contract.py).

Per op, the cases are: random valid shapes and dtypes (GQA groups 1-3, float32 / float16 / bfloat16), checked against
the reference, with the all-meta call giving the same output shapes; and, derived from the contract, for every tensor
argument a wrong rank, a wrong size of each dim it shares with another argument, a wrong dtype, the meta device among
CPU tensors, a non-contiguous layout; each size set to 0 (empty); query heads that are not a multiple of the kv heads;
for every scalar a battery of out-of-range values (NaN, ±inf, negative, 2^31, 2^62, 2^63 - 1, ...); NaN / ±inf
entries; aliased arguments (one tensor passed twice, overlapping views); inputs requiring grad; and the op's own index
classes (out-of-range targets, budgets, positions).

The contract is the oracle: where it rejects the input the kernel must raise a RuntimeError naming the op and the
argument (or the value); where it accepts, the kernel must not raise and must agree with the reference. So the C++
checks, the fake kernels and the reference are held to one description.

Crashes and hangs: the cases run in a worker subprocess (``python -m tests.test_fuzz_ops OP[:FIRST] OP ...``, every op
in turn, so torch is imported once) that announces every case before running it. A worker that dies (signal, abort) or
overruns its time names the case it was running; the parent records it and starts a fresh worker at the next case.
KVCOMP_FUZZ_SEED changes the seed (default 17), KVCOMP_FUZZ_VALID the number of random valid inputs per op.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

import kvpress_cpp
from kvpress_cpp import ops
from kvpress_cpp._contract import CONTRACTS, Contract, Scalar, Tensor
from tests import reference

pytestmark = pytest.mark.independent_of_transformers

SEED = int(os.environ.get("KVCOMP_FUZZ_SEED", "17"))
VALID_CASES = int(os.environ.get("KVCOMP_FUZZ_VALID", "12"))  # random valid inputs per op
CUDA_VALID_CASES = 8  # per op, on the GPU
WORKER_TIMEOUT_S = 60.0
CRASH_AT = os.environ.get("KVCOMP_FUZZ_CRASH_AT")  # "op:k": the worker aborts at case k (tests the crash path)
ROOT = Path(__file__).resolve().parents[1]

CACHE = (torch.float32, torch.float16, torch.bfloat16)
BAD_INTS = (-1, 0, 1, 2**31, 2**62, -(2**62), 2**63 - 1)
BAD_VALUE_CASES = 6  # the most an op's bad_values lists; each is its own case
BAD_FLOATS = (math.nan, math.inf, -math.inf, -0.5, 0.0, 1.0, 1.5, 1e30, 1e39, -1e39)  # ±1e39: inf in float32


# ---------------------------------------------------------------------------------------------------------------
# Valid inputs and references, per op. sizes(r, o) draws the symbols of the contract (o overrides base sizes, e.g.
# {"T": 0} for the empty class); build(r, s, dtype) makes the arguments in schema order.

@dataclass
class OpFuzz:
    sizes: Callable
    build: Callable
    reference: Callable  # args -> outputs (tensor or tuple); for the in-place op, the compared slices
    tolerance: Callable = lambda dtype: (1e-4, 1e-4)  # (atol, rtol) by the cache dtype
    run: Callable | None = None  # args -> outputs, when it is not just the op call (in-place)
    bad_values: Callable | None = None  # r, args -> [(class, name, args)] the op's own index classes, all invalid
    odd_values: Callable | None = None  # r, args -> [(class, args)] unusual but valid values
    # The reference for NaN / inf entries, when the op's documented order of operations (not the paper's formula,
    # equal to it for finite inputs) decides where an inf meets a 0 or an opposite inf.
    nonfinite_reference: Callable | None = None
    # Why NaN / inf inputs are left out of the reference comparison (they still must not crash), when the op's
    # non-finite behaviour is specified elsewhere than in a reference.
    nonfinite_unchecked: str = ""
    # False for an op whose output shape depends on its inputs' values: meta tensors cannot carry it (FakeTensors
    # can, which opcheck and the torch.compile tests cover).
    meta_shapes: bool = True


def _g(r: random.Random, device="cpu") -> torch.Generator:
    return torch.Generator(device).manual_seed(r.getrandbits(62))


def _randn(r, shape, dtype=torch.float32, device="cpu"):
    return torch.randn(shape, generator=_g(r, device), device=device).to(dtype)


def _low_precision(dtype, low=2e-2):
    return (1e-4, 1e-4) if dtype == torch.float32 else (low, low)


def _update_scores_sizes(r, o):
    s = {"B": o.get("B", r.randint(1, 2)), "H": o.get("H", r.randint(1, 3)), "T_old": o.get("T_old", r.randint(0, 12)),
         "q": o.get("q", r.randint(1, 4))}
    s["Hq"] = o.get("Hq", s["H"] * r.randint(1, 3))
    s["T"] = s["T_old"] + s["q"]
    return s


def _update_scores_build(r, s, dtype):
    attn = _randn(r, (s["B"], s["Hq"], s["q"], s["T"])).softmax(-1).to(dtype)
    return _randn(r, (s["B"], s["H"], s["T_old"])), attn, r.uniform(0, 1), r.uniform(0.1, 2)


def _merge_count_bias_sizes(r, o):
    return {k: o.get(k, r.randint(1, n)) for k, n in (("B", 2), ("H", 3), ("T", 16))}


def _merge_count_bias_build(r, s, dtype):
    counts = torch.randint(0, 5, (s["B"], s["H"], s["T"]), generator=_g(r)).float()
    return counts, r.uniform(0, 2)


def _decode_attention_sizes(r, o):
    s = {"B": o.get("B", r.randint(1, 2)), "H": o.get("H", r.randint(1, 3)), "T": o.get("T", r.randint(1, 20)),
         "d": o.get("d", r.choice([1, 4, 8, 16]))}
    s["Hq"] = o.get("Hq", s["H"] * r.randint(1, 3))
    s["q"] = o.get("q", r.randint(1, min(4, max(1, s["T"]))))
    return s


def _decode_attention_build(r, s, dtype):
    query = _randn(r, (s["B"], s["Hq"], s["q"], s["d"]), dtype)
    keys = _randn(r, (s["B"], s["H"], s["T"], s["d"]), dtype)
    values = _randn(r, (s["B"], s["H"], s["T"], s["d"]), dtype)
    log_weights = _randn(r, (s["B"], s["H"], s["T"]))
    log_weights[torch.rand(log_weights.shape, generator=_g(r)) < 0.2] = -math.inf
    return query, keys, values, log_weights, max(s["d"], 1) ** -0.5


def _prompt_attention_build(r, s, dtype):
    query, keys, _, log_weights, scale = _decode_attention_build(r, s, dtype)
    return query, keys, log_weights, scale


def _prompt_scores_build(r, s, dtype):
    query, keys, log_weights, scale = _prompt_attention_build(r, s, dtype)
    # Any log-sum-exp is valid input: the op normalises by the one it is given (the model's own, in the presses).
    log_sum_exp = _randn(r, (s["B"], s["Hq"], s["q"])) + 2.0
    return query, keys, log_weights, log_sum_exp, scale, r.choice([1.0, 0.98, 0.5]), r.uniform(0, 2)


def _prompt_attention_with_scores_build(r, s, dtype):
    return _decode_attention_build(r, s, dtype) + (r.choice([1.0, 0.98, 0.5]), r.uniform(0, 2))


def _prompt_log_unnormalised_scores_build(r, s, dtype):
    return _prompt_attention_build(r, s, dtype) + (r.choice([0.9, 0.5, 0.01]), r.uniform(0.01, 2))


def _prompt_scores_given_lse(query, keys, log_weights, log_sum_exp, scale, decay, input_scale):
    """The reference with the op's argument order (the log-sum-exp a prompt pass kept comes fourth)."""
    return reference.prompt_scores(query, keys, log_weights, scale, decay, input_scale, log_sum_exp=log_sum_exp)


def _decode_attention_nonfinite(query, keys, values, log_weights, scale):
    """The documented attention with NaN / inf entries (ops.decode_attention): a slot of log-weight -inf is not read,
    its key and value whatever they hold (a paged cache's dead slots), and a slot a row gives probability 0 adds
    nothing to that row's output (no 0 · inf or 0 · NaN)."""
    dead = (log_weights == -math.inf).unsqueeze(-1)
    logits = _unread_dead_slots(reference.prompt_attention(query, keys, log_weights, scale), log_weights,
                                query.shape[1])
    probs = reference.softmax_or_zero(logits)
    group_values = values.double().masked_fill(dead, 0.0).repeat_interleave(query.shape[1] // keys.shape[1], dim=1)
    terms = probs.unsqueeze(-1) * group_values.unsqueeze(2)  # (B, Hq, q, T, d)
    out = terms.masked_fill((probs == 0).unsqueeze(-1), 0.0).sum(-2)
    return out.to(query.dtype), probs.float()


def _prompt_lse_nonfinite(query, keys, log_weights, scale):
    """The documented log-sum-exp with non-finite logits: NaN where the exact value is +inf (no softmax exists), and
    the keys of slots of log-weight -inf not read."""
    lse = _unread_dead_slots(reference.prompt_attention(query, keys, log_weights, scale), log_weights,
                             query.shape[1]).logsumexp(-1)
    return lse.masked_fill(lse == math.inf, math.nan)


def _unread_dead_slots(logits, log_weights, query_heads):
    """-inf at every slot of log-weight -inf, whatever the query (a NaN query times any key is NaN)."""
    dead = (log_weights == -math.inf).repeat_interleave(query_heads // log_weights.shape[1], dim=1).unsqueeze(2)
    return logits.masked_fill(dead, -math.inf)


def _paged_sizes(r, o):
    s = _decode_attention_sizes(r, o)
    s.update({k: o.get(k, r.randint(1, n)) for k, n in (("S", 4), ("M", 4))})
    s["N"] = o.get("N", s["B"] * s["H"] * s["M"] + r.randint(0, 2))
    return s


def _paged_build(r, s, dtype):
    """Every (b, h) owns distinct blocks of a shuffled pool, and holds 0 .. M·S slots (none when the pool is empty)."""
    query = _randn(r, (s["B"], s["Hq"], s["q"], s["d"]), dtype)
    key_blocks, value_blocks = (_randn(r, (s["N"], s["S"], s["d"]), dtype) for _ in range(2))
    log_weight_blocks = _randn(r, (s["N"], s["S"]))
    log_weight_blocks[torch.rand(log_weight_blocks.shape, generator=_g(r)) < 0.2] = -math.inf
    pairs = s["B"] * s["H"]
    owned = min(s["M"], s["N"] // pairs) if pairs else 0
    pool = torch.randperm(s["N"], generator=_g(r))
    tables = torch.zeros(s["B"], s["H"], s["M"], dtype=torch.int64)
    if owned:
        tables[..., :owned] = pool[:pairs * owned].view(s["B"], s["H"], owned)
    lengths = torch.randint(0, owned * s["S"] + 1, (s["B"], s["H"]), generator=_g(r))
    # max_len: mostly any bound from the longest length to the tables' capacity, else none (the op then finds the
    # longest itself, as every caller but PagedKVCache); none where the tables hold no slot
    capacity, longest = s["M"] * s["S"], int(lengths.max()) if lengths.numel() else 0
    max_len = r.randint(max(1, longest), capacity) if capacity and r.random() < 0.7 else None
    return (query, key_blocks, value_blocks, log_weight_blocks, tables, lengths, max(s["d"], 1) ** -0.5, True,
            max_len)


def _paged_reference(*args, head_attention=None):
    """The float64 reference, its probabilities widened with zero columns to max_len."""
    out, probs = reference.paged_decode_attention(*args[:7], head_attention=head_attention)
    max_len = args[8]
    return out, probs if max_len is None else torch.nn.functional.pad(probs, (0, max_len - probs.shape[-1]))


def _paged_nonfinite(*args):
    """decode_attention's documented non-finite behaviour per (b, h) over the slots its block table holds: nothing
    outside a head's lengths[b, h] slots (another head's blocks, free blocks, a block's tail) is read."""
    return _paged_reference(*args, head_attention=_decode_attention_nonfinite)


def _with(t: torch.Tensor, index: tuple, value) -> torch.Tensor:
    changed = t.clone()
    changed[index] = value
    return changed


def _paged_bad(r, args):
    tables, lengths = args[4], args[5]
    used = lengths > 0
    cases = []
    if bool(used.any()):
        b, h = used.nonzero()[0].tolist()
        cases += [("index", "block_tables", _replace(args, 4, _with(tables, (b, h, 0), value)))
                  for value in (-1, args[1].shape[0], 2**62)]
    cases += [("index", "lengths", _replace(args, 5, _with(lengths, (0, 0), value)))
              for value in (-1, tables.shape[2] * args[1].shape[1] + 1)]
    return cases


def _weightedkv_sizes(r, o):
    s = {"B": o.get("B", r.randint(1, 2)), "H": o.get("H", r.randint(1, 3)), "d": o.get("d", r.randint(1, 8)),
         "d_v": o.get("d_v", r.randint(1, 8)), "T": o.get("T", r.randint(4, 16))}
    return s


def _weightedkv_build(r, s, dtype):
    sinks, recent = r.randint(0, 2), r.randint(1, 2)
    evictions = r.randint(0, max(0, s["T"] - sinks - recent))
    counts = torch.randint(1, 5, (s["B"], s["H"], s["T"]), generator=_g(r)).float()
    return (_randn(r, (s["B"], s["H"], s["T"], s["d"]), dtype), _randn(r, (s["B"], s["H"], s["T"], s["d_v"]), dtype),
            torch.rand((s["B"], s["H"], s["T"]), generator=_g(r)) * counts, counts, sinks, recent, evictions,
            r.random() < 0.8)


def _weightedkv_run(args):
    return ops.weightedkv_evict(*(t.clone() for t in args[:4]), *args[4:])


def _zsmerge_prefill_sizes(r, o):
    return {"B": o.get("B", r.randint(1, 2)), "H": o.get("H", r.randint(1, 3)), "T": o.get("T", r.randint(4, 20)),
            "d": o.get("d", r.randint(1, 8))}


def _zsmerge_budget(r, tokens):
    """recent, context, residual with M = their sum < tokens (when tokens >= 3)."""
    recent = r.randint(1, max(1, min(3, tokens - 2)))
    context = r.randint(1, max(1, min(3, tokens - 1 - recent)))
    residual = r.randint(0, max(0, min(3, tokens - recent - context - 1)))
    return recent, context, residual


def _zsmerge_prefill_build(r, s, dtype):
    recent, context, residual = _zsmerge_budget(r, s["T"])
    return (_randn(r, (s["B"], s["H"], s["T"], s["d"]), dtype), _randn(r, (s["B"], s["H"], s["T"], s["d"]), dtype),
            _randn(r, (s["B"], s["H"], s["T"])), recent, context, residual)


def _zsmerge_decode_sizes(r, o):
    return {"B": o.get("B", r.randint(1, 2)), "H": o.get("H", r.randint(1, 3)), "T": o.get("T", r.randint(4, 14)),
            "d": o.get("d", r.randint(1, 8))}


def _zsmerge_decode_build(r, s, dtype):
    recent, context, residual = _zsmerge_budget(r, s["T"])
    counts = torch.randint(1, 4, (s["B"], s["H"], s["T"]), generator=_g(r)).float()
    return (_randn(r, (s["B"], s["H"], s["T"], s["d"]), dtype), _randn(r, (s["B"], s["H"], s["T"], s["d"]), dtype),
            _randn(r, (s["B"], s["H"], s["T"])), counts, r.randint(0, recent - 1), recent, context, residual,
            r.random() < 0.5)


def _zsmerge_decode_run(args, op=None):
    keys, values, scores, counts = (t.clone() for t in args[:4])
    (op or torch.ops.kvcomp.zsmerge_decode_step)(keys, values, scores, counts, *args[4:])
    slots = args[5] + args[6] + args[7]
    return tuple(t[:, :, :slots] for t in (keys, values, scores, counts))


def _keepkv_sizes(r, o):
    return {"B": o.get("B", r.randint(1, 2)), "H": o.get("H", r.randint(1, 3)), "T": o.get("T", r.randint(1, 24)),
            "d": o.get("d", r.randint(1, 16))}


def _keepkv_match_build(r, s, dtype):
    keys = _randn(r, (s["B"], s["H"], s["T"], s["d"]), dtype)
    keep = torch.rand((s["B"], s["H"], s["T"]), generator=_g(r)) < r.choice([0.3, 0.7, 0.95])
    # max_evicted is a bound that spares CUDA a host sync; any bound, even one below a row's count, gives one result.
    return keys, keep, r.uniform(-1, 1), r.randint(0, s["T"])


def _keepkv_zip_build(r, s, dtype):
    keys, keep, _, _ = _keepkv_match_build(r, s, dtype)
    targets = reference.keepkv_match(keys, keep, 0.2)
    votes = torch.rand((s["B"], s["H"], s["T"]), generator=_g(r)) + 0.1
    return (keys, _randn(r, keys.shape, dtype), votes, _randn(r, votes.shape), targets, r.random() < 0.5, True)


def _keepkv_zip_bad(r, args):
    targets = args[4]
    cases = []
    if targets.numel():
        for value in (-3, targets.shape[2], 2**62):
            bad = targets.clone()
            bad.view(-1)[r.randrange(bad.numel())] = value
            cases.append(("index", "targets", args[:4] + (bad,) + args[5:]))
        retained_free = targets.clone()  # a target that points at an evicted slot
        evicted = (targets != -1).nonzero()
        if len(evicted) and (targets == -1).any():
            b, h, e = evicted[0].tolist()
            retained_free[b, h, e] = e
            cases.append(("index", "targets", args[:4] + (retained_free,) + args[5:]))
    return cases


def _keepkv_step_sizes(r, o):
    s = {"B": o.get("B", r.randint(1, 2)), "H": o.get("H", r.randint(1, 3)), "q": o.get("q", r.randint(1, 3)),
         "d": o.get("d", r.choice([1, 4, 8, 16])), "S": o.get("S", r.randint(0, 16))}
    s["Hq"] = o.get("Hq", s["H"] * r.randint(1, 3))
    s["T"] = o.get("T", s["S"] + s["q"])
    return s


def _keepkv_step_run(args):
    """The in-place step on copies of keys and values: their retained slots, then the per-slot outputs."""
    return ops.keepkv_decode_step(args[0].clone(), args[1].clone(), *args[2:])


def _keepkv_step_build(r, s, dtype, device="cpu"):
    """A layer after a pass of q new tokens: probabilities are the causal softmax of q·k·scale + b (float64), as the
    attention gives them; old slots with random EMA, ages >= 1, votes and b (some -inf: slots no query sees).
    `device`: where the tensors are drawn and the softmax computed (bench_keepkv's layers of 16 x 32k slots take a
    minute on a CPU)."""
    batch, kv_heads, query_heads, new_tokens, slots, head_dim = (s[k] for k in ("B", "H", "Hq", "q", "T", "d"))
    old_slots = s["S"]
    keys, values = (_randn(r, (batch, kv_heads, slots, head_dim), dtype, device) for _ in range(2))
    queries = _randn(r, (batch, query_heads, new_tokens, head_dim), dtype, device)
    log_weights = _randn(r, (batch, kv_heads, slots), device=device) * 0.5
    log_weights[torch.rand(log_weights.shape, generator=_g(r, device), device=device) < 0.1] = -math.inf
    log_weights[..., slots - new_tokens:] = 0.0
    scale = max(head_dim, 1) ** -0.5
    if query_heads and kv_heads and query_heads % kv_heads == 0 and slots >= new_tokens >= 1:
        probabilities = reference.decode_attention(queries, keys, values, log_weights, scale)[1]
    else:  # shapes the contract rejects: any probabilities of the declared shape
        probabilities = torch.rand(batch, query_heads, new_tokens, slots, generator=_g(r, device), device=device)
    log_ema = _randn(r, (batch, kv_heads, old_slots), device=device) - 2.0
    age = torch.randint(1, 7, (batch, kv_heads, old_slots), generator=_g(r, device), device=device).float()
    votes = torch.rand((batch, kv_heads, old_slots), generator=_g(r, device), device=device) * 3 + 0.5
    sinks, recent = r.randint(0, 2), r.randint(1, 3)
    budget = r.randint(sinks + recent + 1, max(sinks + recent + 1, slots + 1))
    return (keys, values, queries, probabilities, log_weights, log_ema, age, votes, scale, r.choice([0.5, 0.9, 0.99]),
            budget, sinks, recent, r.uniform(-0.5, 0.9), r.random() < 0.5)


def _keepkv_match_odd(r, args):
    """Extreme magnitudes (float32 squares overflow beyond ~1e19, underflow below ~1e-19) and threshold 1.0 with
    duplicated keys, so that exact ties and similarity 1 are decided alike on the direct and the GEMM path."""
    keys, keep, threshold, max_evicted = args
    duplicated = keys.clone()
    if keys.shape[2] >= 2:
        duplicated[:, :, 1::2] = duplicated[:, :, : keys.shape[2] // 2 * 2 : 2]
    return [("scale", (keys.float() * scale, keep, threshold, max_evicted)) for scale in (3e19, 1e30, 1e-25, 1e-38)] + [
        ("ties", (duplicated, keep, 1.0, max_evicted)), ("ties", (duplicated, keep, threshold, max_evicted))]


def _nucleus_sizes(r, o):
    return {k: o.get(k, r.randint(1, n)) for k, n in (("B", 2), ("Hq", 4), ("T", 24))}


def _nucleus_build(r, s, dtype):
    return _randn(r, (s["B"], s["Hq"], s["T"])).mul(3).softmax(-1), r.uniform(0.05, 1.0)


def _rope_sizes(r, o):
    return {"B": o.get("B", r.randint(1, 2)), "Hq": o.get("Hq", r.randint(1, 3)), "S": o.get("S", r.randint(1, 4)),
            "d": o.get("d", 2 * r.randint(1, 8)), "n_f": o.get("n_f", r.randint(1, 5))}


def _rope_build(r, s, dtype):
    table_dtype = r.choice(CACHE)
    return (_randn(r, (s["B"], s["Hq"], s["S"], s["d"]), dtype), _randn(r, (s["n_f"], s["d"]), table_dtype),
            _randn(r, (s["n_f"], s["d"]), table_dtype))


def _rope_tables_first(queries, cos, sin):
    """averaged_rope as documented: the float64 means of the tables rounded to float32, then the float32 product."""
    mean_cos, mean_sin = (t.double().mean(0).float() for t in (cos, sin))
    q = queries.float()
    return (q * mean_cos + reference.rotate_half(q) * mean_sin).to(queries.dtype)


def _gvote_sizes(r, o):
    s = {"B": o.get("B", r.randint(1, 2)), "H": o.get("H", r.randint(1, 3)), "T": o.get("T", r.randint(1, 20)),
         "S": o.get("S", r.randint(1, 3)), "d": o.get("d", r.randint(1, 8))}
    s["Hq"] = o.get("Hq", s["H"] * r.randint(1, 3))
    return s


def _gvote_build(r, s, dtype):
    keys = _randn(r, (s["B"], s["H"], s["T"], s["d"]), dtype)
    queries = _randn(r, (s["B"], s["Hq"], s["S"], s["d"]), dtype)
    budgets = torch.randint(0, s["T"] + 1, (s["B"], s["Hq"]), generator=_g(r))
    return keys, queries, budgets, r.randint(0, 3), max(s["d"], 1) ** -0.5, r.randint(1, 8)


def _extreme_indices(index: int):
    """odd_values: argument `index` (int64, any value allowed: budgets are clamped, positions compared) with its
    first entry -2^62 and its last 2^62."""
    def odd(r, args):
        t = args[index].clone()
        if t.numel():
            t.view(-1)[0], t.view(-1)[-1] = -(2**62), 2**62
        return [("index", _replace(args, index, t))]
    return odd


def _kvzap_score_sizes(r, o):
    return {"B": o.get("B", r.randint(1, 2)), "T": o.get("T", r.randint(1, 12)), "Dh": o.get("Dh", r.randint(1, 16)),
            "W": o.get("W", r.randint(1, 8)), "H": o.get("H", r.randint(1, 3)), "mlp": r.random() < 0.5}


def _kvzap_score_build(r, s, dtype):
    hidden = _randn(r, (s["B"], s["T"], s["Dh"]), dtype)
    weight1, bias1 = _randn(r, (s["W"], s["Dh"]), dtype) * 0.3, _randn(r, (s["W"],), dtype)
    if not s["mlp"]:
        return hidden, weight1, bias1, None, None
    return hidden, weight1, bias1, _randn(r, (s["H"], s["W"]), dtype) * 0.3, _randn(r, (s["H"],), dtype)


def _kvzap_score_nonfinite(hidden, weight1, bias1, weight2=None, bias2=None):
    """The surrogate with NaN or ±inf inputs: its formula in float64, the exact GELU as written, 0.5·x·(1 + erf(x/√2)):
    +inf at +inf, NaN at -inf (-inf · 0). (torch's float32 GELU kernel also gives NaN at +inf, its scalar path +inf.)"""
    out = hidden.double() @ weight1.double().T + bias1.double()
    if weight2 is not None:
        out = 0.5 * out * (1 + torch.erf(out / math.sqrt(2))) @ weight2.double().T + bias2.double()
    return out.float().transpose(1, 2).contiguous()


def _kvzap_threshold_sizes(r, o):
    return {k: o.get(k, r.randint(1, n)) for k, n in (("B", 2), ("H", 3), ("T", 20))}


def _kvzap_threshold_build(r, s, dtype):
    shape = (s["B"], s["H"], s["T"])
    log_weights = torch.zeros(shape)
    log_weights[torch.rand(shape, generator=_g(r)) < 0.2] = -math.inf
    positions = torch.arange(s["T"]).expand(shape).contiguous()
    before = r.randint(0, s["T"])
    return (log_weights, _randn(r, shape), positions, r.gauss(0, 1), r.randint(0, 8), before,
            r.randint(before, s["T"] + 4))


def _kvzap_decode_step_sizes(r, o):
    s = _kvzap_score_sizes(r, o)
    s["q"], s["T"] = o.get("q", r.randint(1, 3)), o.get("T", r.randint(0, 20))
    if o.get("L") == 0:
        s["q"] = s["T"] = 0
    if o.get("K") == 0:
        s["H" if s["mlp"] else "W"] = 0
    return s


def _kvzap_decode_step_build(r, s, dtype):
    """A state of T slots as decoding leaves it (positions 0 .. T - 1 from tokens_before = T, a few slots evicted)
    and q new tokens. The threshold stays 0.1 away from the new tokens' scores (low precision moves them by up to
    5e-2), so that a new token leaving the window at once is decided as the reference decides it."""
    surrogate = _kvzap_score_build(r, {**s, "T": s["q"]}, dtype)
    heads = s["H"] if s["mlp"] else s["W"]
    state = (s["B"], heads, s["T"])
    log_weights = torch.zeros(s["B"], heads, s["T"] + s["q"])
    log_weights[..., :s["T"]][torch.rand(state, generator=_g(r)) < 0.2] = -math.inf
    positions = torch.arange(s["T"]).expand(state).contiguous()
    threshold = r.gauss(0, 1)
    new_scores = reference.kvzap_score(*surrogate)
    while bool(((new_scores - threshold).abs() < 0.1).any()):
        threshold += 0.1
    return (*surrogate, log_weights, _randn(r, state), positions, threshold, r.randint(0, 8), s["T"])


def _kvzap_paged_step_sizes(r, o):
    s = {k: o.get(k, r.randint(1, n)) for k, n in (("B", 2), ("H", 3), ("q", 3), ("S", 4))}
    s["window"], s["tokens_before"] = r.randint(0, 6), r.randint(0, 24)
    return s


def _kvzap_paged_step_build(r, s, dtype):
    """Each row as decoding leaves it: some earlier decided tokens (a few evicted, -inf), then every token from the
    first one leaving the window now to the new ones, in order; about one row in four disturbed (two slots swapped,
    or its oldest undecided token gone, as after a cut) so that it must be left alone. Rows own distinct blocks of a
    shuffled pool."""
    window, before, new_tokens, block_size = s["window"], s["tokens_before"], s["q"], max(1, s["S"])
    begin = max(0, before - window)
    rows = []
    for _ in range(s["B"] * s["H"]):
        earlier = sorted(r.sample(range(begin), r.randint(0, begin)))
        positions = earlier + list(range(begin, before + new_tokens))
        if r.random() < 0.25 and len(positions) > new_tokens + 1:
            if r.random() < 0.5:
                i = r.randrange(len(positions) - new_tokens - 1)
                positions[i], positions[i + 1] = positions[i + 1], positions[i]
            else:
                positions.remove(begin) if begin in positions else positions.pop(0)
        rows.append(positions)
    max_blocks = max((-(-len(p) // block_size) for p in rows), default=0) + r.randint(0, 1)
    blocks = sum(-(-len(p) // block_size) for p in rows) + r.randint(0, 2)
    pool = torch.randperm(blocks, generator=_g(r)).tolist()
    tables = torch.full((s["B"], s["H"], max_blocks), -1, dtype=torch.int64)
    position_blocks = torch.randint(-5, 50, (blocks, s["S"]), generator=_g(r))
    log_weight_blocks = _randn(r, (blocks, s["S"]))
    log_weight_blocks[torch.rand(log_weight_blocks.shape, generator=_g(r)) < 0.2] = -math.inf
    row_tables = tables.view(len(rows), max_blocks)  # not view(-1, ...): with max_blocks 0, -1 is ambiguous
    for row, positions in enumerate(rows):
        used = -(-len(positions) // block_size)
        row_tables[row, :used] = torch.tensor([pool.pop() for _ in range(used)], dtype=torch.int64)
        for t, position in enumerate(positions[:len(positions) - new_tokens] if s["S"] else []):
            position_blocks[row_tables[row, t // block_size], t % block_size] = position
    lengths = torch.tensor([len(p) for p in rows], dtype=torch.int64).view(s["B"], s["H"])
    return (log_weight_blocks, _randn(r, (blocks, s["S"])), position_blocks, tables, lengths,
            _randn(r, (s["B"], s["H"], new_tokens)), r.gauss(0, 1), window, before, False)


def _kvzap_paged_step_run(args):
    pools = tuple(t.clone() for t in args[:3])
    held = ops.kvzap_paged_step(*pools, *args[3:])
    return (held, *pools)


def _kvzap_paged_step_bad(r, args):
    tables, lengths, new_tokens = args[3], args[4], args[5].shape[-1]
    cases = [("index", "block_tables", _replace(args, 3, _with(tables, (0, 0, 0), value)))
             for value in (-1, args[0].shape[0], 2**62)]
    cases += [("index", "lengths", _replace(args, 4, _with(lengths, (0, 0), value)))
              for value in (new_tokens - 1, tables.shape[2] * args[0].shape[1] + 1)]
    named = (tables.flatten() >= 0).nonzero().flatten().tolist()  # the used entries: build leaves the others -1
    if len(named) >= 2:  # two entries naming one block: rows that would overwrite each other's slots
        first, later = sorted(r.sample(named, 2))
        shared = _with(tables.flatten(), later, int(tables.flatten()[first])).view_as(tables)
        cases.append(("shared", "block_tables", _replace(args, 3, shared)))
    return cases


FUZZ: dict[str, OpFuzz] = {
    "update_scores": OpFuzz(_update_scores_sizes, _update_scores_build, reference.update_scores),
    "merge_count_bias": OpFuzz(_merge_count_bias_sizes, _merge_count_bias_build, reference.merge_count_bias),
    "decode_attention": OpFuzz(_decode_attention_sizes, _decode_attention_build, reference.decode_attention,
                               tolerance=lambda dtype: _low_precision(dtype, 3e-2),
                               nonfinite_reference=_decode_attention_nonfinite),
    "prompt_log_sum_exp": OpFuzz(_decode_attention_sizes, _prompt_attention_build, reference.prompt_log_sum_exp,
                                 tolerance=lambda dtype: _low_precision(dtype, 3e-2),
                                 nonfinite_reference=_prompt_lse_nonfinite),
    "prompt_scores": OpFuzz(_decode_attention_sizes, _prompt_scores_build, _prompt_scores_given_lse,
                            tolerance=lambda dtype: _low_precision(dtype, 3e-2),
                            nonfinite_unchecked="queries below float32 resolution are skipped, NaN ones included "
                            "(test_prompt_scores.py plants NaN there)"),
    "prompt_attention_with_scores": OpFuzz(
        _decode_attention_sizes, _prompt_attention_with_scores_build, reference.prompt_attention_with_scores,
        tolerance=lambda dtype: _low_precision(dtype, 3e-2),
        nonfinite_unchecked="NaN and inf follow the online softmax (test_prompt_attention_with_scores.py plants NaN)"),
    "prompt_log_unnormalised_scores": OpFuzz(
        _decode_attention_sizes, _prompt_log_unnormalised_scores_build, reference.prompt_log_unnormalised_scores,
        tolerance=lambda dtype: _low_precision(dtype, 3e-2),
        nonfinite_unchecked="NaN and inf follow the online log-sum-exp (a +inf term meets the running max +inf: NaN, "
        "where torch.logsumexp gives +inf)"),
    "paged_decode_attention": OpFuzz(_paged_sizes, _paged_build,
                                     _paged_reference,
                                     tolerance=lambda dtype: _low_precision(dtype, 3e-2), bad_values=_paged_bad,
                                     meta_shapes=False, nonfinite_reference=_paged_nonfinite),
    "weightedkv_evict": OpFuzz(_weightedkv_sizes, _weightedkv_build, reference.weightedkv_evict,
                               tolerance=lambda dtype: _low_precision(dtype), run=_weightedkv_run),
    "zsmerge_prefill": OpFuzz(_zsmerge_prefill_sizes, _zsmerge_prefill_build, reference.zsmerge_prefill,
                              tolerance=lambda dtype: _low_precision(dtype)),
    "zsmerge_decode_step": OpFuzz(_zsmerge_decode_sizes, _zsmerge_decode_build,
                                  lambda *args: _zsmerge_decode_run(args, reference.zsmerge_decode_step),
                                  tolerance=lambda dtype: _low_precision(dtype), run=_zsmerge_decode_run),
    "keepkv_match": OpFuzz(_keepkv_sizes, _keepkv_match_build, reference.keepkv_match, odd_values=_keepkv_match_odd),
    "keepkv_zip_merge": OpFuzz(_keepkv_sizes, _keepkv_zip_build, reference.keepkv_zip_merge,
                               tolerance=lambda dtype: _low_precision(dtype, 3e-2) if dtype != torch.float32
                               else (1e-3, 1e-3), bad_values=_keepkv_zip_bad),
    "keepkv_decode_step": OpFuzz(_keepkv_step_sizes, _keepkv_step_build, reference.keepkv_decode_step,
                                 tolerance=lambda dtype: _low_precision(dtype, 3e-2) if dtype != torch.float32
                                 else (1e-3, 1e-3), run=_keepkv_step_run,
                                 nonfinite_unchecked="NaN / inf keys, queries or probabilities: the logits the op "
                                 "recovers from the probabilities are specified for a finite softmax only"),
    "nucleus_budget": OpFuzz(_nucleus_sizes, _nucleus_build, reference.nucleus_budget),
    "averaged_rope": OpFuzz(_rope_sizes, _rope_build, reference.averaged_rope,
                            tolerance=lambda dtype: _low_precision(dtype), nonfinite_reference=_rope_tables_first),
    "gvote_union_mask": OpFuzz(_gvote_sizes, _gvote_build, lambda k, q, b, sinks, scale, chunk:
                               reference.gvote_union_mask(k, q, b, sinks, scale), odd_values=_extreme_indices(2)),
    "kvzap_score": OpFuzz(_kvzap_score_sizes, _kvzap_score_build, reference.kvzap_score,
                          tolerance=lambda dtype: _low_precision(dtype, 5e-2),
                          nonfinite_reference=_kvzap_score_nonfinite),
    "kvzap_threshold": OpFuzz(_kvzap_threshold_sizes, _kvzap_threshold_build, reference.kvzap_threshold,
                              odd_values=_extreme_indices(2)),
    "kvzap_decode_step": OpFuzz(_kvzap_decode_step_sizes, _kvzap_decode_step_build, reference.kvzap_decode_step,
                                tolerance=lambda dtype: _low_precision(dtype, 5e-2), odd_values=_extreme_indices(7),
                                nonfinite_reference=lambda *args: reference.kvzap_decode_step(
                                    *args, score=_kvzap_score_nonfinite)),
    "kvzap_paged_step": OpFuzz(_kvzap_paged_step_sizes, _kvzap_paged_step_build, reference.kvzap_paged_step,
                               run=_kvzap_paged_step_run, bad_values=_kvzap_paged_step_bad,
                               odd_values=_extreme_indices(2)),
}


# ---------------------------------------------------------------------------------------------------------------
# Cases: (name, run) where run() raises AssertionError on a wrong outcome.

def _call(name: str, args: tuple):
    fuzz = FUZZ[name]
    return fuzz.run(args) if fuzz.run else getattr(torch.ops.kvcomp, name)(*args)


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _cache_dtype(args: tuple) -> torch.dtype:
    floats = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype in CACHE and a.dtype != torch.float32]
    return floats[0] if floats else torch.float32


def _assert_matches_reference(name: str, args: tuple, nonfinite: bool = False, device: str = "cpu") -> None:
    """The op on `device` (its arguments copied there, unless it is the CPU) against the reference on the CPU."""
    fuzz = FUZZ[name]
    on_device = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    got = tuple(g.cpu() for g in _as_tuple(_call(name, on_device)))
    if nonfinite and fuzz.nonfinite_unchecked:
        return
    reference_fn = (nonfinite and fuzz.nonfinite_reference) or fuzz.reference
    expected = _as_tuple(reference_fn(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args)))
    assert len(got) == len(expected), f"{len(got)} outputs, the reference has {len(expected)}"
    atol, rtol = fuzz.tolerance(_cache_dtype(args))
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape, f"output {i}: shape {tuple(g.shape)}, reference {tuple(e.shape)}"
        assert g.dtype == e.dtype or e.dtype == torch.float64, f"output {i}: dtype {g.dtype}, reference {e.dtype}"
        if g.dtype.is_floating_point:
            torch.testing.assert_close(g.float(), e.float(), atol=atol, rtol=rtol, equal_nan=True,
                                       msg=lambda m: f"output {i} differs from the reference: {m}")
        else:
            assert torch.equal(g, e.to(g.dtype)), f"output {i} differs from the reference"


def _assert_meta_shapes(name: str, args: tuple) -> None:
    """The fake (all arguments on meta) gives the eager outputs' shapes and dtypes."""
    if FUZZ[name].run or not FUZZ[name].meta_shapes:
        return
    got = _as_tuple(getattr(torch.ops.kvcomp, name)(*args))
    meta = _as_tuple(getattr(torch.ops.kvcomp, name)(*(a.to("meta") if isinstance(a, torch.Tensor) else a
                                                        for a in args)))
    for g, m in zip(got, meta):
        assert m.device.type == "meta" and (m.shape, m.dtype) == (g.shape, g.dtype), \
            f"fake output {tuple(m.shape)} {m.dtype}, eager {tuple(g.shape)} {g.dtype}"


def _contract_rejects(contract: Contract, args: tuple) -> str | None:
    try:
        contract.check(args)
    except RuntimeError as error:
        return str(error)
    return None


def _expect(name: str, args: tuple, names: tuple, must_reject: bool = False, nonfinite: bool = False) -> None:
    """The contract decides: rejected -> the op raises naming itself and one of `names`; accepted -> reference."""
    contract = CONTRACTS[name]
    rejected = _contract_rejects(contract, args)
    if must_reject:
        assert rejected, "the contract accepts an input it must reject"
    if rejected is None:
        _assert_matches_reference(name, args, nonfinite)
        return
    try:
        getattr(torch.ops.kvcomp, name)(*args)  # not _call: an in-place case must see the very tensors it was given
    except RuntimeError as error:
        message = str(error)
        assert contract.qualified in message, f"the error does not name the op: {message!r}"
        assert any(n in message for n in names), f"the error names none of {names}: {message!r}"
        return
    raise AssertionError(f"no error, the contract says: {rejected}")


def _tensor_args(contract: Contract, args: tuple) -> list[tuple[int, Tensor]]:
    return [(i, a) for i, a in enumerate(contract.args) if isinstance(a, Tensor) and i < len(args)
            and args[i] is not None]


def _replace(args: tuple, index: int, value) -> tuple:
    return args[:index] + (value,) + args[index + 1:]


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    doubled = torch.stack([t, torch.zeros_like(t)], dim=-1)  # every other element: same values, stride 2
    return doubled[..., 0]


def _wrong_dtype(t: torch.Tensor) -> torch.dtype:
    return {torch.bool: torch.uint8, torch.int64: torch.int32}.get(t.dtype, torch.float64)


def _cases(name: str) -> list[tuple[str, Callable]]:
    """Every case of one op, in a fixed order; case k draws from random.Random(f'{SEED}:{name}:{k}')."""
    contract, fuzz = CONTRACTS[name], FUZZ[name]
    cases: list[tuple[str, Callable]] = []

    def add(label: str, body: Callable[[random.Random], None]) -> None:
        k = len(cases)
        cases.append((label, lambda: body(random.Random(f"{SEED}:{name}:{k}"))))

    def valid(r: random.Random, overrides=None, dtype=None, needs: int | None = None, until=None, what: str = ""):
        """Valid arguments; with `needs`, redrawn until that (optional) argument is given; with `until`, until the
        arguments satisfy it (a case that needs, e.g., two tensors of one shape must not pass by doing nothing)."""
        for _ in range(100):
            s = fuzz.sizes(r, overrides or {})
            args = fuzz.build(r, s, dtype or r.choice(CACHE))
            if (needs is None or args[needs] is not None) and (until is None or until(args)):
                return args, s
        raise AssertionError(f"the generator of {name} never gives {what or f'argument {needs}'}")

    def alike(i: int, j: int, min_numel: int = 0):
        """A predicate on arguments: tensors i and j of one shape and dtype, with at least min_numel elements."""
        return lambda args: (args[i] is not None and args[j] is not None and args[i].shape == args[j].shape
                             and args[i].dtype == args[j].dtype and args[i].numel() >= min_numel)

    def sizes_where(until, what: str) -> dict | None:
        """Sizes under which the generator gives arguments satisfying `until` (None if 100 draws find none): a case
        needing them is added with them, or not at all, rather than pass without testing anything."""
        try:
            return valid(random.Random(f"{SEED}:{name}:sizes where {what}"), dtype=torch.float32, until=until)[1]
        except AssertionError:
            return None

    def valid_case(r):
        args, _ = valid(r)
        _expect(name, args, ())
        _assert_meta_shapes(name, args)

    for _ in range(VALID_CASES):
        add("valid", valid_case)

    arg_names = tuple(a.name for a in contract.args)
    # The probe gives every optional scalar (the type of its value picks the battery of bad values below).
    probe_random = random.Random(f"{SEED}:{name}:probe")
    for _ in range(20):
        probe = valid(probe_random, dtype=torch.float32)[0]
        if all(value is not None for value, arg in zip(probe, contract.args) if isinstance(arg, Scalar)):
            break
    tensors = _tensor_args(contract, probe)
    symbol_owners: dict[str, list[str]] = {}
    for _, arg in tensors:
        for symbol in arg.symbols:
            symbol_owners.setdefault(symbol, []).append(arg.name)

    for i, arg in tensors:
        def bad_rank(r, i=i, arg=arg):
            args = valid(r, needs=i)[0]
            _expect(name, _replace(args, i, args[i].unsqueeze(0)), (arg.name,), must_reject=True)
        add(f"rank:{arg.name}", bad_rank)

        def bad_dtype(r, i=i, arg=arg):
            args = valid(r, needs=i)[0]
            _expect(name, _replace(args, i, args[i].to(_wrong_dtype(args[i]))), arg_names, must_reject=True)
        add(f"dtype:{arg.name}", bad_dtype)

        def on_meta(r, i=i, arg=arg):  # only the whole call on meta is valid (the fake's shapes)
            args = valid(r, needs=i)[0]
            if len(tensors) == 1:
                _assert_meta_shapes(name, args)
            else:
                _expect(name, _replace(args, i, args[i].to("meta")), ("meta",), must_reject=True)
        add(f"device:{arg.name}", on_meta)

        def non_contiguous(r, i=i, arg=arg):
            args = valid(r, needs=i)[0]
            _expect(name, _replace(args, i, _non_contiguous(args[i])), (arg.name,), must_reject=arg.inplace)
        add(f"non-contiguous:{arg.name}", non_contiguous)

        for dim, symbol in enumerate(arg.symbols):
            if len(symbol_owners[symbol]) < 2:
                continue

            def mismatch(r, i=i, arg=arg, dim=dim, symbol=symbol):
                args = valid(r, needs=i)[0]
                shape = list(args[i].shape)
                shape[dim] += 1
                bad = torch.zeros(shape, dtype=args[i].dtype)
                _expect(name, _replace(args, i, bad), tuple(symbol_owners[symbol]), must_reject=True)
            add(f"shape:{arg.name}.{symbol}", mismatch)

    for symbol in symbol_owners:
        add(f"empty:{symbol}", lambda r, symbol=symbol: _expect(name, valid(r, {symbol: 0})[0], arg_names))

    if "Hq" in symbol_owners and "H" in symbol_owners:
        def gqa(r):
            h = r.randint(2, 3)
            _expect(name, valid(r, {"H": h, "Hq": h * r.randint(1, 2) + 1})[0], arg_names, must_reject=True)
        add("gqa", gqa)

    for i, arg in enumerate(contract.args):
        if not isinstance(arg, Scalar) or isinstance(probe[i], bool):
            continue
        battery = BAD_INTS if isinstance(probe[i], int) else BAD_FLOATS
        for value in battery:
            add(f"scalar:{arg.name}={value}", lambda r, i=i, arg=arg, value=value: _expect(
                name, _replace(valid(r)[0], i, value), (arg.name,)))

    int_scalars = [i for i, a in enumerate(contract.args) if isinstance(a, Scalar) and isinstance(probe[i], int)
                   and not isinstance(probe[i], bool)]
    if len(int_scalars) > 1:  # sums of sizes that wrap around (the segfault: 2^62, 2^62 - 1, 2^62)
        for values in ((0, 2**62, 2**62 - 1, 2**62), (2**62, 2**62 - 1, 2**62, 2**62), (2**63 - 1,) * 4,
                       (2**62, 2**62, 0, 0)):
            def all_huge(r, values=values):
                args = valid(r)[0]
                for i, value in zip(int_scalars, values):
                    args = _replace(args, i, value)
                _expect(name, args, tuple(contract.args[i].name for i in int_scalars))
            add(f"scalars:{'/'.join(str(v) for v in values[:len(int_scalars)])}", all_huge)

    float_args = [(i, a) for i, a in tensors if probe[i].dtype.is_floating_point]
    for i, arg in float_args:
        def nan_inf(r, i=i):
            args = valid(r, dtype=torch.float32, needs=i)[0]
            t = args[i].clone()
            if t.numel():
                for value in (math.nan, math.inf, -math.inf):
                    t.view(-1)[r.randrange(t.numel())] = value
            _expect(name, _replace(args, i, t), arg_names, nonfinite=True)
        add(f"nan-inf:{arg.name}", nan_inf)

    inplace = [(i, a) for i, a in tensors if a.inplace]
    # Pairs of in-place tensors, where the generator can give them one shape: drawn at such sizes.
    for (i, a), (j, b) in ((x, y) for n, x in enumerate(inplace) for y in inplace[n + 1:]):
        what = f"{a.name} and {b.name} alike"
        sizes = sizes_where(alike(i, j, 2), what)
        if sizes is None:
            continue

        def same_tensor(r, i=i, j=j, a=a, b=b, sizes=sizes, what=what):
            args = valid(r, sizes, dtype=torch.float32, until=alike(i, j, 1), what=what)[0]
            _expect(name, _replace(args, j, args[i]), (a.name, b.name), must_reject=True)
        add(f"alias:{a.name}={b.name}", same_tensor)

        def overlapping(r, i=i, j=j, a=a, b=b, sizes=sizes, what=what):
            args = valid(r, sizes, dtype=torch.float32, until=alike(i, j, 2), what=what)[0]
            buffer = torch.randn(args[i].numel() + 1)
            first, second = buffer[:-1].view(args[i].shape), buffer[1:].view(args[i].shape)
            _expect(name, _replace(_replace(args, i, first), j, second), (a.name, b.name), must_reject=True)
        add(f"overlap:{a.name}~{b.name}", overlapping)
    # An op that updates tensors in place has no backward: every floating input requiring grad is refused, read or
    # updated (what it writes from a read one would silently lose its graph).
    for i, arg in float_args if inplace else []:
        def grad_leaf(r, i=i, arg=arg):
            args = valid(r, dtype=torch.float32, needs=i)[0]
            if args[i].dtype.is_floating_point:
                _expect(name, _replace(args, i, args[i].clone().requires_grad_()), (arg.name,), must_reject=True)
        add(f"requires-grad:{arg.name}", grad_leaf)

    if not inplace:
        for i, arg in float_args:
            if probe[i].dtype != torch.float32:
                continue

            def with_partner(args, i=i):
                return any(alike(i, j)(args) for j, _ in float_args if j != i)
            sizes = sizes_where(with_partner, f"{arg.name} alike another")
            if sizes is None:
                continue

            def functional_alias(r, i=i, sizes=sizes, with_partner=with_partner):  # read-only arguments may alias:
                args = valid(r, sizes, dtype=torch.float32, needs=i, until=with_partner,  # the result is the
                             what=f"{contract.args[i].name} alike another")[0]  # reference's
                same = next(j for j, _ in float_args if j != i and alike(i, j)(args))
                _expect(name, _replace(args, same, args[i]), arg_names)
            add(f"alias:{arg.name}", functional_alias)

        def backward(r):
            args = valid(r, dtype=torch.float32)[0]
            args = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.dtype.is_floating_point
                         else a for a in args)
            outputs = [o for o in _as_tuple(getattr(torch.ops.kvcomp, name)(*args)) if o.requires_grad]
            if not outputs:  # integer or bool outputs only: nothing to differentiate
                return
            try:
                sum(o.float().sum() for o in outputs).backward()
            except RuntimeError as error:
                assert contract.qualified in str(error) and "not implemented" in str(error), str(error)
                return
            raise AssertionError("backward through the op ran without an error")
        add("backward", backward)

    if fuzz.bad_values:
        for k in range(BAD_VALUE_CASES):
            def bad_value(r, k=k):
                cases_ = fuzz.bad_values(r, valid(r, dtype=torch.float32)[0])
                assert len(cases_) <= BAD_VALUE_CASES, f"{len(cases_)} bad values: raise BAD_VALUE_CASES"
                if k < len(cases_):
                    _, arg_name, args = cases_[k]
                    try:
                        _call(name, args)
                    except RuntimeError as error:
                        assert contract.qualified in str(error) and arg_name in str(error), str(error)
                        return
                    raise AssertionError(f"no error for a bad {arg_name}")
            add(f"index:{k}", bad_value)
    if fuzz.odd_values:
        def odd_value(r):
            for _, args in fuzz.odd_values(r, valid(r, dtype=torch.float32)[0]):
                _expect(name, args, arg_names)
        add("index:odd", odd_value)
    return cases


# ---------------------------------------------------------------------------------------------------------------
# Worker (one subprocess runs the ops in turn: one torch import for the whole suite) and the pytest side.

def _worker(plan: list[str]) -> None:
    """plan: ["op:first", "op", ...]: run each op's cases from `first` (0 if not given), announcing each one."""
    for entry in plan:
        name, _, first = entry.partition(":")
        cases = _cases(name)
        print(f"TOTAL {name} {len(cases)}", flush=True)
        for k in range(int(first or 0), len(cases)):
            label, run = cases[k]
            print(f"START {name} {k} {label}", flush=True)
            if CRASH_AT == f"{name}:{k}":
                os.abort()
            try:
                run()
                print(f"PASS {name} {k}", flush=True)
            except Exception as error:  # noqa: BLE001  (reported to the parent, which fails the test)
                detail = "".join(traceback.format_exception_only(type(error), error)).strip().replace("\n", " | ")
                print(f"FAIL {name} {k} {label}: {detail[:600]}", flush=True)


@dataclass
class FuzzResult:
    total: int = 0
    passed: int = 0
    failures: list = field(default_factory=list)


def run_fuzz(names: list[str]) -> tuple[dict[str, FuzzResult], float]:
    """Every case of the given ops in worker subprocesses. A crash or hang is a failure naming its case; a fresh
    worker then resumes at the next case."""
    start = time.monotonic()
    results = {name: FuzzResult() for name in names}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVCOMP_FUZZ_SEED": str(SEED)}
    plan = list(names)
    while plan:
        process = subprocess.Popen([sys.executable, "-m", "tests.test_fuzz_ops", *plan], cwd=ROOT, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = process.communicate(timeout=WORKER_TIMEOUT_S)
            hung = False
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
            hung = True
        running = None
        for line in stdout.splitlines():
            word, name, rest = (line.split(" ", 2) + ["", ""])[:3]
            if word == "TOTAL":
                results[name].total = int(rest)
            elif word == "START":
                running = (name, rest)
            elif word == "PASS":
                results[name].passed += 1
                running = None
            elif word == "FAIL":
                results[name].failures.append(f"case {rest.partition(' ')[2]}")
                running = None
        if running is None:
            if process.returncode != 0 or hung:
                for name in plan:
                    results[name.partition(":")[0]].failures.append(
                        f"the worker exited with {process.returncode} outside any case: {stderr[-1500:]}")
            break
        name, case = running
        how = f"hang (> {WORKER_TIMEOUT_S:.0f} s)" if hung else f"crash (exit {process.returncode})"
        results[name].failures.append(f"case {case}: {how}: {stderr[-1500:]}")
        index = int(case.split(" ")[0])
        remaining = [n.partition(":")[0] for n in plan]
        remaining = remaining[remaining.index(name) + 1:]
        plan = ([f"{name}:{index + 1}"] if index + 1 < results[name].total else []) + remaining
    return results, time.monotonic() - start


@pytest.fixture(scope="module")
def fuzz_results():
    results, seconds = run_fuzz(sorted(name for name in CONTRACTS if name in FUZZ))
    total = sum(r.total for r in results.values())
    print(f"\nfuzz: {total} cases over {len(results)} ops in {seconds:.1f} s (seed {SEED})")
    return results


@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_fuzz(name, fuzz_results):
    assert name in FUZZ, f"kvcomp::{name} has a contract but no fuzz generator in tests/test_fuzz_ops.py"
    result = fuzz_results[name]
    assert result.total > 0 and result.passed + len(result.failures) >= result.total, result
    assert not result.failures, f"kvcomp::{name}: {len(result.failures)} of {result.total} cases failed:\n" + \
        "\n".join(result.failures)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("name", sorted(name for name in FUZZ if name != "prompt_attention_with_scores"))
def test_cuda_kernel_matches_the_reference_on_random_valid_inputs(name):
    """The fuzz's random valid inputs (shapes, GQA groups, dtypes, -inf log-weights) on the GPU against the float64
    reference: the CUDA kernels held to the description the CPU ones are. In process (a crash fails the run), and
    small enough for compute-sanitizer. prompt_attention_with_scores has no CUDA kernel (its own tests check that the
    dispatcher says so)."""
    fuzz, accepted = FUZZ[name], 0
    for k in range(CUDA_VALID_CASES):
        r = random.Random(f"{SEED}:{name}:cuda:{k}")
        args = fuzz.build(r, fuzz.sizes(r, {}), r.choice(CACHE))
        if _contract_rejects(CONTRACTS[name], args) is None:  # e.g. a drawn size the op refuses: the CPU fuzz covers it
            _assert_matches_reference(name, args, device="cuda")
            accepted += 1
    assert accepted > CUDA_VALID_CASES // 2, f"only {accepted} of {CUDA_VALID_CASES} random inputs were valid"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA"))])
@pytest.mark.parametrize("name", sorted(name for name in FUZZ if name != "prompt_attention_with_scores"))
def test_every_size_set_to_zero_gives_the_reference_or_the_ops_error(name, device):
    """Each size of the op's contract set to 0 (no batch, no kv heads, no slots, ...): an input the contract accepts
    gives the reference's (empty) outputs, one it refuses an error naming the op. In process and on CUDA too, where
    a kernel launched over a grid of 0 blocks fails as an invalid configuration: every op must return before it."""
    contract, fuzz = CONTRACTS[name], FUZZ[name]
    for symbol in sorted({symbol for arg in contract.args if isinstance(arg, Tensor) for symbol in arg.symbols}):
        r = random.Random(f"{SEED}:{name}:zero:{symbol}")
        args = fuzz.build(r, fuzz.sizes(r, {symbol: 0}), r.choice(CACHE))
        if _contract_rejects(contract, args) is None:
            _assert_matches_reference(name, args, device=device)
            continue
        on_device = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        with pytest.raises(RuntimeError, match=contract.qualified):
            getattr(torch.ops.kvcomp, name)(*on_device)


def _valid_float32_case(name: str, purpose: str) -> tuple:
    """The first of a few random float32 cases of op `name` that its contract accepts."""
    fuzz = FUZZ[name]
    for k in range(8):
        r = random.Random(f"{SEED}:{name}:{purpose}:{k}")
        args = fuzz.build(r, fuzz.sizes(r, {}), torch.float32)
        if _contract_rejects(CONTRACTS[name], args) is None:
            return args
    raise AssertionError(f"no valid float32 case of {name} in 8 draws")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA"))])
@pytest.mark.parametrize("name", sorted(FUZZ))
def test_autocast_changes_nothing(name, device):
    """Under torch.autocast an op computes in the dtypes it is given, as its reference: the ATen GEMMs inside
    gvote_union_mask, kvzap_score and keepkv_match ran in bfloat16 there (the first then refused its own result)."""
    if device == "cuda" and name in CPU_ONLY_OPS:
        pytest.skip("a CPU-only op")
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in _valid_float32_case(name, "autocast"))
    expected = _as_tuple(_call(name, args))
    with torch.autocast(device, dtype=torch.bfloat16):
        got = _as_tuple(_call(name, args))
    for out, want in zip(got, expected, strict=True):
        assert out.dtype == want.dtype
        torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


UPDATING_OPS = sorted(name for name in FUZZ if getattr(torch.ops.kvcomp, name).default._schema.is_mutable)


def test_updating_ops_are_the_four_that_update_in_place():
    assert UPDATING_OPS == ["keepkv_decode_step", "kvzap_paged_step", "weightedkv_evict", "zsmerge_decode_step"]


@pytest.mark.parametrize("name", UPDATING_OPS)
def test_an_update_in_place_bumps_the_versions_of_what_it_updates(name):
    """As torch's in-place ops: each tensor the schema marks written (Tensor(a!)) has its version counter bumped, the
    others keep theirs. Then autograd refuses a backward through a tensor it saved before the update, and a paged
    cache notices an edit of the view it handed out, where both used the stale or the edited tensor silently."""
    args = _valid_float32_case(name, "version")
    schema = getattr(torch.ops.kvcomp, name).default._schema
    written = [argument.alias_info is not None and argument.alias_info.is_write for argument in schema.arguments]
    updated = next(a for a, write in zip(args, written) if write)
    weight = torch.ones((), requires_grad=True)
    saved = (weight * updated).sum()  # autograd saves `updated` for the weight's gradient
    before = [a._version if isinstance(a, torch.Tensor) else None for a in args]
    getattr(torch.ops.kvcomp, name)(*args)
    for argument, write, version, arg in zip(schema.arguments, written, before, args):
        if isinstance(arg, torch.Tensor):
            assert (arg._version > version) == write, (argument.name, version, arg._version)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


def test_a_crash_names_its_case_and_the_other_cases_still_run(monkeypatch):
    monkeypatch.setenv("KVCOMP_FUZZ_CRASH_AT", "merge_count_bias:3")
    results, _ = run_fuzz(["merge_count_bias", "nucleus_budget"])
    crashed, after = results["merge_count_bias"], results["nucleus_budget"]
    assert len(crashed.failures) == 1 and crashed.failures[0].startswith("case 3 ") and "crash" in crashed.failures[0]
    assert crashed.passed == crashed.total - 1 and after.total > 0 and after.passed == after.total


def test_compile_meta_and_eager_give_the_same_error():
    """A bad call fails with the same words eagerly (C++ check), on meta tensors and under torch.compile (the fake)."""
    query, keys = torch.randn(1, 3, 1, 8), torch.randn(1, 2, 4, 8)  # 3 query heads over 2 kv heads
    args = (query, keys, keys, torch.zeros(1, 2, 4), 0.3)
    expected = "kvcomp::decode_attention: expected the 3 query heads of query to be a positive multiple of the 2 kv"

    def attend(*a):
        return torch.ops.kvcomp.decode_attention(*a)

    def attend_on_meta(*a):
        return attend(*(t.to("meta") if isinstance(t, torch.Tensor) else t for t in a))

    for call in (attend, attend_on_meta, torch.compile(attend, fullgraph=True, backend="eager")):
        with pytest.raises(Exception, match=expected):
            call(*args)


def test_every_registered_op_has_a_contract():
    ops = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("kvcomp::")}
    assert ops == set(CONTRACTS), f"ops without a contract: {ops - set(CONTRACTS)}"


#: The ops with a CPU kernel only: the prompt's attention kept with its scores is the CPU path of our attention (on
#: CUDA the model's own sdpa runs, and prompt_log_sum_exp / prompt_scores score after it).
CPU_ONLY_OPS = {"prompt_attention_with_scores"}


@pytest.mark.parametrize("op", sorted(CONTRACTS))
def test_every_op_has_a_cpu_kernel(op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kvcomp::{op}", "CPU")


@pytest.mark.skipif(torch.version.cuda is None, reason="CPU build of torch: no CUDA kernels expected")
@pytest.mark.parametrize("op", sorted(set(CONTRACTS) - CPU_ONLY_OPS))
def test_every_op_has_a_cuda_kernel_with_cuda_torch(op):
    assert kvpress_cpp.cuda_kernels_built(), "torch is a CUDA build but the extension registered no CUDA kernel"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kvcomp::{op}", "CUDA")


if __name__ == "__main__":
    _worker(sys.argv[1:])


def _head_dim_zero_calls():
    """Every wrapper in kvpress_cpp.ops that derives a default scale d ** -0.5, called with d = 0."""
    query, cache, log_weights = torch.zeros(1, 2, 1, 0), torch.zeros(1, 1, 4, 0), torch.zeros(1, 1, 4)
    blocks, block_weights = torch.zeros(1, 4, 0), torch.zeros(1, 4)
    tables, lengths = torch.zeros(1, 1, 1, dtype=torch.int32), torch.full((1, 1), 4, dtype=torch.int32)
    return {
        "decode_attention": lambda: ops.decode_attention(query, cache, cache, log_weights),
        "prompt_log_sum_exp": lambda: ops.prompt_log_sum_exp(query, cache, log_weights),
        "prompt_scores": lambda: ops.prompt_scores(query, cache, log_weights),
        "prompt_attention_with_scores": lambda: ops.prompt_attention_with_scores(query, cache, cache, log_weights),
        "prompt_log_unnormalised_scores": lambda: ops.prompt_log_unnormalised_scores(query, cache, log_weights),
        "paged_decode_attention": lambda: ops.paged_decode_attention(query, blocks, blocks, block_weights, tables,
                                                                     lengths),
        "gvote_union_mask": lambda: ops.gvote_union_mask(cache, query, torch.ones(1, 2, dtype=torch.int64)),
    }


@pytest.mark.parametrize("name", sorted(_head_dim_zero_calls()))
def test_a_default_scale_over_a_head_dim_of_zero_names_the_op(name):
    """d ** -0.5 with d = 0 raised Python's ZeroDivisionError, naming neither the op nor the tensor."""
    with pytest.raises(RuntimeError, match=rf"kvcomp::{name}: expected a head dim d >= 1 for the default scale"):
        _head_dim_zero_calls()[name]()
