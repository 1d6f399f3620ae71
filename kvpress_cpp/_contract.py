"""The input contract of every kvcomp op, declared once in Python.

The C++ kernels validate their inputs in ``csrc/include/kvcomp/<family>.h``; this module states the same rules as data,
for the two places that cannot run that C++:

* the fake kernels (``kvpress_cpp/_fake.py``): meta tensors, ``torch.compile`` and mixed devices (a meta tensor after
  a CPU one dispatches to the fake, not to the CPU kernel) are refused where an eager call is, with an error naming
  the op and the argument as the C++ one does (the wording may differ: shapes as tuples, dtypes as torch's names), and
  the fake's output shapes come from :meth:`Contract.outputs`;
* the fuzz suite (``tests/test_fuzz_ops.py``), which derives its bad inputs from these declarations and checks that the
  C++ kernels reject exactly what the contract rejects, naming the op and the argument.

A contract lists the op's arguments in schema order: :class:`Tensor` (its dims as symbols, ``"B H T d"``: one symbol
names one size across all arguments; its dtype: a torch dtype, :data:`CACHE_DTYPES`, or the name of an earlier
argument whose dtype it must share) or :class:`Scalar`; then ``rules`` over the sizes and scalars (each a predicate
and the words of its error), and ``outputs``. Every tensor must be on the device of the first one. To add an op:
declare its ``Contract`` in :data:`CONTRACTS` (schema order, the C++ check's rules and what they name) and its fake is
registered from it, e.g. for ``my_op(Tensor keys, Tensor scores, int k) -> Tensor``::

    _declare(Contract(
        "my_op",
        [Tensor("keys", "B H T d", CACHE_DTYPES), Tensor("scores", "B H T", F32), Scalar("k")],
        rules=[_at_least("k", 1)],
        outputs=lambda v: [((v["B"], v["H"], v["T"]), F32)],
    ))

then give it a generator in ``FUZZ`` of tests/test_fuzz_ops.py and append it to the Autograd list of registration.cpp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # checks.h check_floating
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Tensor:
    name: str
    dims: str
    dtype: Any  # torch.dtype, CACHE_DTYPES, or the name of an earlier tensor argument
    optional: bool = False
    inplace: bool = False  # updated in place: contiguous, no overlap with another in-place argument, no grad
    # with inplace: each (b, h) row of (B, H, ...) contiguous, the rows in order at any stride, rather than contiguous
    # (checks.h check_contiguous_rows)
    strided_rows: bool = False

    @property
    def symbols(self) -> list[str]:
        return self.dims.split()


@dataclass(frozen=True)
class Scalar:
    name: str
    default: Any = None


@dataclass(frozen=True)
class Rule:
    """``holds(v)`` over the bound sizes and scalars ``v`` (a dict); ``says(v)`` completes "{op}: expected ..."."""

    holds: Callable[[dict], Any]
    says: Callable[[dict], str]


@dataclass
class Contract:
    op: str  # without the namespace
    args: list
    rules: list = field(default_factory=list)
    # (shape, dtype) of each output from the bound values; dtype as in Tensor.dtype. None for an in-place op.
    outputs: Callable[[dict], list] | None = None

    @property
    def qualified(self) -> str:
        return f"kvcomp::{self.op}"

    def fail(self, message: str):
        raise RuntimeError(f"{self.qualified}: {message}")

    def bind(self, args: tuple, kwargs: dict | None = None) -> dict:
        """The op's arguments by name, schema defaults filled in."""
        values = {}
        for i, arg in enumerate(self.args):
            if i < len(args):
                values[arg.name] = args[i]
            elif kwargs and arg.name in kwargs:
                values[arg.name] = kwargs[arg.name]
            elif isinstance(arg, Scalar):
                values[arg.name] = arg.default
            elif arg.optional:
                values[arg.name] = None
            else:
                self.fail(f"missing argument {arg.name}")
        return values

    def check(self, args: tuple, kwargs: dict | None = None) -> dict:
        """Validate the arguments as the C++ kernel does; returns the scalars and the sizes bound to each symbol."""
        values = self.bind(args, kwargs)
        tensors = [a for a in self.args if isinstance(a, Tensor) and values[a.name] is not None]
        first = values[tensors[0].name]
        for arg in tensors:
            t = values[arg.name]
            if t.dim() != len(arg.symbols):
                self.fail(f"expected {arg.name} of shape ({', '.join(arg.symbols)}), got a {t.dim()}-d tensor of "
                          f"shape {tuple(t.shape)}")
            expected = arg.dtype
            if isinstance(expected, str):
                if t.dtype != values[expected].dtype:
                    self.fail(f"expected {arg.name} of the dtype of {expected} ({values[expected].dtype}), got "
                              f"{t.dtype}")
            elif isinstance(expected, tuple):
                if t.dtype not in expected:
                    self.fail(f"expected {arg.name} of dtype float32, float16 or bfloat16, got {t.dtype}")
            elif t.dtype != expected:
                self.fail(f"expected {arg.name} of dtype {expected}, got {t.dtype}")
            if t.device != first.device:
                self.fail(f"expected {arg.name} on the device of {tensors[0].name} ({first.device}), got {t.device}")
        sizes: dict[str, Any] = {}
        owner: dict[str, str] = {}
        for arg in tensors:
            t = values[arg.name]
            for dim, symbol in enumerate(arg.symbols):
                if symbol not in sizes:
                    sizes[symbol], owner[symbol] = t.shape[dim], arg.name
                else:
                    bound = sizes[symbol]
                    torch._check(
                        t.shape[dim] == bound,
                        lambda: f"{self.qualified}: expected {arg.name}.size({dim}) == {bound} ({symbol} of "
                        f"{owner[symbol]}), got {arg.name} of shape {tuple(t.shape)}",
                    )
        env = {**sizes, **{a.name: values[a.name] for a in self.args}}
        for rule in self.rules:
            holds = rule.holds(env)
            if isinstance(holds, bool):
                if not holds:
                    self.fail(rule.says(env))
            else:  # a symbolic condition under torch.compile
                torch._check(holds, lambda: f"{self.qualified}: {rule.says(env)}")
        updated = [(a, values[a.name]) for a in tensors if a.inplace]
        self._check_inplace(updated)
        self._check_inputs_apart(updated, [(a, values[a.name]) for a in tensors if not a.inplace])
        return env

    def _check_inputs_apart(self, updated: list, read: list) -> None:
        """checks.h check_inputs_apart: no argument the op only reads shares memory with one it updates in place, or
        requires grad."""
        for arg, t in read if updated else []:
            if t.requires_grad:
                self.fail(f"expected {arg.name} not to require grad (the op updates its cache in place from it and has "
                          "no backward), got a tensor with requires_grad=True")
            for target_arg, target in updated:
                if _overlap(t, target):
                    self.fail(f"expected {arg.name} and {target_arg.name} to be separate memory ({target_arg.name} is "
                              "updated in place), got overlapping tensors")

    def _check_inplace(self, tensors: list) -> None:
        for i, (arg, t) in enumerate(tensors):
            name = arg.name
            if arg.strided_rows:
                if not has_contiguous_rows(t):
                    self.fail(f"expected {name} with contiguous (batch, kv head) rows in order (it is updated in place "
                              f"row by row), got strides {tuple(t.stride())} for shape {tuple(t.shape)}")
            elif not t.is_contiguous():
                self.fail(f"expected a contiguous {name} (it is updated in place), got strides {tuple(t.stride())} "
                          f"for shape {tuple(t.shape)}")
            if t.requires_grad:
                self.fail(f"expected {name} not to require grad (it is updated in place and the op has no backward), "
                          "got a tensor with requires_grad=True")
            for other_arg, other in tensors[:i]:
                if _overlap(t, other):
                    self.fail(f"expected {name} and {other_arg.name} to be separate memory (both are updated in place), "
                              "got overlapping tensors")

    def output_tensors(self, args: tuple, kwargs: dict | None = None):
        """What the fake kernel returns: validated arguments, new empty outputs on the device of the first tensor."""
        env = self.check(args, kwargs)
        if self.outputs is None:
            return None
        first = next(env[a.name] for a in self.args if isinstance(a, Tensor))
        outs = []
        for shape, dtype in self.outputs(env):
            dtype = env[dtype].dtype if isinstance(dtype, str) else dtype
            outs.append(first.new_empty(tuple(shape), dtype=dtype))
        return outs[0] if len(outs) == 1 else tuple(outs)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of two tensors of one storage intersect (checks.h may_overlap)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return False

    def byte_range(t):
        begin = t.storage_offset() * t.element_size()
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        return begin, begin + (last + 1) * t.element_size()

    (a_begin, a_end), (b_begin, b_end) = byte_range(a), byte_range(b)
    return a_begin < b_end and b_begin < a_end


def has_contiguous_rows(t: torch.Tensor) -> bool:
    """Whether each (b, h) row of t (B, H, ...) is contiguous and the rows are in order (checks.h
    check_contiguous_rows). An empty tensor is, whatever its strides: nothing in it moves."""
    shape, strides = t.shape, t.stride()  # (once: a decoding step asks for every layer's keys and values)
    if len(shape) < 2:
        return False
    if 0 in shape:
        return True
    row = 1
    for size, stride in zip(shape[:1:-1], strides[:1:-1]):
        if size > 1 and stride != row:
            return False
        row *= size
    if shape[1] > 1 and strides[1] < row:
        return False
    heads_span = row if shape[1] <= 1 else (shape[1] - 1) * strides[1] + row
    return shape[0] <= 1 or strides[0] >= heads_span


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _finite(x) -> bool:
    """Finite as the kernels use it: in float32 (a Python float of 1e39 is inf there)."""
    return math.isfinite(x) and abs(x) <= _FLOAT32_MAX


def _gqa(query_heads: str, kv_heads: str, query_arg: str, kv_arg: str, allow_empty: bool = True) -> Rule:
    """Query heads a multiple of the kv heads (0 query heads allowed where the C++ check allows them)."""
    return Rule(lambda v: v[kv_heads] > 0 and v[query_heads] % v[kv_heads] == 0
                and (allow_empty or v[query_heads] > 0),
                lambda v: f"expected the {v[query_heads]} query heads of {query_arg} to be a positive multiple of the "
                f"{v[kv_heads]} kv heads of {kv_arg}")


def _at_least(name: str, low: int) -> Rule:
    return Rule(lambda v: v[name] >= low, lambda v: f"expected {name} >= {low}, got {v[name]}")


def _slots_fit_32_bits(symbol: str) -> Rule:
    return Rule(lambda v: v[symbol] <= INT32_MAX, lambda v: f"expected at most 2^31 - 1 slots, got T = {v[symbol]}")


def _keep_rule() -> list:
    """KVzap's keep-rule scalars (kvzap.h check_keep_rule)."""
    return [
        Rule(lambda v: not math.isnan(v["threshold"]),
             lambda v: f"expected a threshold that is not NaN, got threshold = {v['threshold']}"),
        _at_least("window", 0),
        _at_least("tokens_before", 0),
    ]


def _kvzap_decoding_pass() -> list:
    """The keep rule for a pass of q new tokens after tokens_before."""
    return [
        *_keep_rule(),
        Rule(lambda v: v["tokens_before"] + v["q"] <= INT64_MAX,
             lambda v: f"expected tokens_before + q to fit in 64 bits, got tokens_before = {v['tokens_before']}, "
             f"q = {v['q']}"),
    ]


def _zsmerge_budget() -> list:
    return [
        _at_least("recent", 1),
        _at_least("context", 1),
        _at_least("residual", 0),
        Rule(lambda v: v["recent"] + v["context"] + v["residual"] <= INT64_MAX,
             lambda v: "expected recent + context + residual to fit in 64 bits, got recent = "
             f"{v['recent']}, context = {v['context']}, residual = {v['residual']}"),
    ]


def _zsmerge_slots(v) -> int:
    return v["recent"] + v["context"] + v["residual"]


F32, I64, BOOL = torch.float32, torch.int64, torch.bool

CONTRACTS: dict[str, Contract] = {}


def _declare(contract: Contract) -> None:
    CONTRACTS[contract.op] = contract


_declare(Contract(
    "update_scores",
    [Tensor("scores", "B H T_old", F32), Tensor("attn", "B Hq q T", CACHE_DTYPES), Scalar("decay"),
     Scalar("input_scale")],
    rules=[
        Rule(lambda v: 0.0 <= v["decay"] <= 1.0, lambda v: f"expected decay in [0, 1], got {v['decay']}"),
        Rule(lambda v: _finite(v["input_scale"]), lambda v: f"expected a finite float32 input_scale, got {v['input_scale']}"),
        _gqa("Hq", "H", "attn", "scores"),
        Rule(lambda v: v["T"] == v["T_old"] + v["q"],
             lambda v: f"expected attn.size(3) == {v['T_old'] + v['q']} (T_old + q: old slots plus the new queries), "
             f"got attn of shape {tuple(v['attn'].shape)}"),
    ],
    outputs=lambda v: [((v["B"], v["H"], v["T"]), F32)],
))

_declare(Contract(
    "merge_count_bias",
    [Tensor("counts", "B H T", F32), Scalar("alpha")],
    rules=[Rule(lambda v: _finite(v["alpha"]) and v["alpha"] >= 0,
                lambda v: f"expected a finite float32 alpha >= 0, got {v['alpha']}")],
    outputs=lambda v: [((v["B"], v["H"], v["T"]), F32)],
))

_declare(Contract(
    "decode_attention",
    [Tensor("query", "B Hq q d", CACHE_DTYPES), Tensor("keys", "B H T d", "query"),
     Tensor("values", "B H T d", "query"), Tensor("log_weights", "B H T", F32), Scalar("scale")],
    rules=[
        Rule(lambda v: _finite(v["scale"]) and v["scale"] > 0,
             lambda v: f"expected a finite float32 scale > 0, got {v['scale']}"),
        _gqa("Hq", "H", "query", "keys", allow_empty=False),
        Rule(lambda v: v["d"] > 0,
             lambda v: f"expected a head dim d >= 1, got query of shape {tuple(v['query'].shape)}"),
        Rule(lambda v: 1 <= v["q"] <= v["T"],
             lambda v: "expected 1 <= q <= T (the q queries are the last q of the T cached slots), got q = "
             f"query.size(2) = {v['q']} and T = keys.size(2) = {v['T']}"),
    ],
    outputs=lambda v: [((v["B"], v["Hq"], v["q"], v["d"]), "query"), ((v["B"], v["Hq"], v["q"], v["T"]), F32)],
))

_declare(Contract(
    "weightedkv_evict",
    [Tensor("keys", "B H T d", CACHE_DTYPES, inplace=True, strided_rows=True),
     Tensor("values", "B H T d_v", "keys", inplace=True, strided_rows=True),
     Tensor("sums", "B H T", F32, inplace=True, strided_rows=True),
     Tensor("counts", "B H T", F32, inplace=True, strided_rows=True), Scalar("sinks"), Scalar("recent"),
     Scalar("evictions"), Scalar("merge_values", True)],
    rules=[
        _slots_fit_32_bits("T"),
        _at_least("sinks", 0),
        _at_least("recent", 1),
        _at_least("evictions", 0),
        Rule(lambda v: v["sinks"] <= v["T"] and v["recent"] <= v["T"] - v["sinks"]
             and v["evictions"] <= v["T"] - v["sinks"] - v["recent"],
             lambda v: "expected evictions <= T - sinks - recent (enough middle slots to evict), got evictions = "
             f"{v['evictions']}, T = {v['T']}, sinks = {v['sinks']}, recent = {v['recent']}"),
    ],
))

_declare(Contract(
    "zsmerge_prefill",
    [Tensor("keys", "B H T d", CACHE_DTYPES), Tensor("values", "B H T d", "keys"), Tensor("scores", "B H T", F32),
     Scalar("recent"), Scalar("context"), Scalar("residual")],
    rules=_zsmerge_budget() + [
        Rule(lambda v: v["T"] >= _zsmerge_slots(v),
             lambda v: f"expected at least as many tokens as slots, T = keys.size(2) >= M = recent + context + "
             f"residual = {_zsmerge_slots(v)}, got T = {v['T']}"),
        Rule(lambda v: v["T"] <= INT32_MAX, lambda v: f"expected at most 2^31 - 1 tokens, got T = {v['T']}"),
    ],
    outputs=lambda v: [((v["B"], v["H"], _zsmerge_slots(v), v["d"]), "keys")] * 2
    + [((v["B"], v["H"], _zsmerge_slots(v)), F32)] * 2,
))

_declare(Contract(
    "zsmerge_decode_step",
    [Tensor("keys", "B H T d", CACHE_DTYPES, inplace=True, strided_rows=True),
     Tensor("values", "B H T d", "keys", inplace=True, strided_rows=True),
     Tensor("scores", "B H T", F32, inplace=True, strided_rows=True),
     Tensor("counts", "B H T", F32, inplace=True, strided_rows=True),
     Scalar("ring_position"), Scalar("recent"), Scalar("context"), Scalar("residual"), Scalar("paper_order", False)],
    rules=_zsmerge_budget() + [
        Rule(lambda v: 0 <= v["ring_position"] < v["recent"],
             lambda v: f"expected ring_position in [0, recent) = [0, {v['recent']}), got {v['ring_position']}"),
        Rule(lambda v: v["T"] > _zsmerge_slots(v),
             lambda v: f"expected keys.size(2) = M + q with q >= 1 new tokens after the M = recent + context + "
             f"residual = {_zsmerge_slots(v)} slots, got keys of shape {tuple(v['keys'].shape)}"),
    ],
))

_declare(Contract(
    "keepkv_match",
    [Tensor("keys", "B H T d", CACHE_DTYPES), Tensor("keep", "B H T", BOOL), Scalar("threshold"),
     Scalar("max_evicted")],
    rules=[Rule(lambda v: -1.0 <= v["threshold"] <= 1.0,
                lambda v: f"expected threshold in [-1, 1], got {v['threshold']}"),
           Rule(lambda v: v["max_evicted"] is None or v["max_evicted"] >= 0,
                lambda v: f"expected max_evicted >= 0, got {v['max_evicted']}")],
    outputs=lambda v: [((v["B"], v["H"], v["T"]), I64)],
))

_declare(Contract(
    "keepkv_zip_merge",
    [Tensor("keys", "B H T d", CACHE_DTYPES), Tensor("values", "B H T d", "keys"), Tensor("votes", "B H T", F32),
     Tensor("log_scores", "B H T", F32), Tensor("targets", "B H T", I64), Scalar("convex"),
     Scalar("check_targets", True)],
    outputs=lambda v: [((v["B"], v["H"], v["T"], v["d"]), "keys")] * 2 + [((v["B"], v["H"], v["T"]), F32)],
))

_declare(Contract(
    "keepkv_decode_step",
    [Tensor("keys", "B H T d", CACHE_DTYPES, inplace=True, strided_rows=True),
     Tensor("values", "B H T d", "keys", inplace=True, strided_rows=True), Tensor("queries", "B Hq q d", "keys"),
     Tensor("probabilities", "B Hq q T", F32), Tensor("log_weights", "B H T", F32), Tensor("log_ema", "B H S", F32),
     Tensor("age", "B H S", F32), Tensor("votes", "B H S", F32), Scalar("scale"), Scalar("ema_decay"),
     Scalar("budget"), Scalar("sinks"), Scalar("recent"), Scalar("threshold"), Scalar("convex")],
    rules=[
        _gqa("Hq", "H", "queries", "keys", allow_empty=False),
        Rule(lambda v: 1 <= v["q"] <= v["T"],
             lambda v: f"expected queries.size(2) = q new tokens in [1, T = {v['T']}], got {v['q']}"),
        Rule(lambda v: v["S"] == v["T"] - v["q"],
             lambda v: f"expected log_ema.size(2) == {v['T'] - v['q']} (the slots before the q new tokens, T - q), "
             f"got log_ema of shape {tuple(v['log_ema'].shape)}"),
        Rule(lambda v: _finite(v["scale"]), lambda v: f"expected a finite float32 scale, got {v['scale']}"),
        Rule(lambda v: 0.0 < v["ema_decay"] < 1.0, lambda v: f"expected ema_decay in (0, 1), got {v['ema_decay']}"),
        _at_least("sinks", 0),
        _at_least("recent", 1),
        Rule(lambda v: v["budget"] > v["sinks"] + v["recent"],
             lambda v: f"expected budget > sinks + recent (a heavy hitter to evict), got budget = {v['budget']}, "
             f"sinks = {v['sinks']}, recent = {v['recent']}"),
        Rule(lambda v: -1.0 <= v["threshold"] <= 1.0,
             lambda v: f"expected threshold in [-1, 1], got {v['threshold']}"),
    ],
    outputs=lambda v: [((v["B"], v["H"], min(v["T"], v["budget"])), F32)] * 4 + [((v["B"], v["H"]), F32)],
))

_declare(Contract(
    "nucleus_budget",
    [Tensor("probs", "B Hq T", F32), Scalar("p")],
    rules=[Rule(lambda v: 0.0 < v["p"] <= 1.0, lambda v: f"expected p in (0, 1], got p = {v['p']}")],
    outputs=lambda v: [((v["B"], v["Hq"]), I64)],
))

_declare(Contract(
    "averaged_rope",
    [Tensor("queries", "B Hq S d", CACHE_DTYPES), Tensor("cos", "n_f d", CACHE_DTYPES),
     Tensor("sin", "n_f d", CACHE_DTYPES)],
    rules=[
        Rule(lambda v: v["d"] % 2 == 0,
             lambda v: "expected an even head dim d (rotate_half splits it in halves), got queries of shape "
             f"{tuple(v['queries'].shape)}"),
        Rule(lambda v: v["n_f"] >= 1,
             lambda v: f"expected at least one future position, got cos of shape {tuple(v['cos'].shape)}"),
    ],
    outputs=lambda v: [((v["B"], v["Hq"], v["S"], v["d"]), "queries")],
))

_declare(Contract(
    "gvote_union_mask",
    [Tensor("keys", "B H T d", CACHE_DTYPES), Tensor("queries", "B Hq S d", "keys"), Tensor("budgets", "B Hq", I64),
     Scalar("sinks"), Scalar("scale"), Scalar("chunk_size")],
    rules=[
        _gqa("Hq", "H", "queries", "keys"),
        _slots_fit_32_bits("T"),
        _at_least("sinks", 0),
        Rule(lambda v: _finite(v["scale"]) and v["scale"] > 0,
             lambda v: f"expected a finite float32 scale > 0, got scale = {v['scale']}"),
        _at_least("chunk_size", 1),
    ],
    outputs=lambda v: [((v["B"], v["H"], v["T"]), BOOL)],
))

_declare(Contract(
    "kvzap_score",
    # Linear: weight1 (H, Dh), bias1 (H). MLP: weight1 (Dh', Dh), bias1 (Dh'), weight2 (H, Dh'), bias2 (H).
    [Tensor("hidden", "B T Dh", CACHE_DTYPES), Tensor("weight1", "W Dh", "hidden"), Tensor("bias1", "W", "hidden"),
     Tensor("weight2", "H W", "hidden", optional=True), Tensor("bias2", "H", "hidden", optional=True)],
    rules=[
        Rule(lambda v: (v["weight2"] is None) == (v["bias2"] is None),
             lambda v: "expected weight2 and bias2 both given (MLP surrogate) or both None (linear surrogate), got "
             f"weight2 {'None' if v['weight2'] is None else 'given'} and bias2 "
             f"{'None' if v['bias2'] is None else 'given'}"),
        Rule(lambda v: v["W"] >= 1,
             lambda v: ("expected at least one output head, got weight1" if v["weight2"] is None else
                        "expected a hidden layer of at least one unit, got weight1")
             + f" of shape {tuple(v['weight1'].shape)}"),
        Rule(lambda v: v["weight2"] is None or v["H"] >= 1,
             lambda v: f"expected at least one output head, got weight2 of shape {tuple(v['weight2'].shape)}"),
    ],
    outputs=lambda v: [((v["B"], v["W"] if v["weight2"] is None else v["H"], v["T"]), F32)],
))

_declare(Contract(
    "kvzap_threshold",
    [Tensor("log_weights", "B H T", F32), Tensor("scores", "B H T", F32), Tensor("positions", "B H T", I64),
     Scalar("threshold"), Scalar("window"), Scalar("tokens_before"), Scalar("tokens_after")],
    rules=[
        *_keep_rule(),
        Rule(lambda v: v["tokens_after"] >= v["tokens_before"],
             lambda v: f"expected tokens_after >= tokens_before ({v['tokens_before']}), got tokens_after = "
             f"{v['tokens_after']}"),
    ],
    outputs=lambda v: [((v["B"], v["H"], v["T"]), F32), ((v["B"], v["H"]), I64)],
))

_declare(Contract(
    "kvzap_decode_step",
    # hidden (B, q, Dh) and the surrogate as kvzap_score's; the state of T slots; log-weights of the T + q.
    [Tensor("hidden", "B q Dh", CACHE_DTYPES), Tensor("weight1", "W Dh", "hidden"), Tensor("bias1", "W", "hidden"),
     Tensor("weight2", "H W", "hidden", optional=True), Tensor("bias2", "H", "hidden", optional=True),
     Tensor("log_weights", "B K L", F32), Tensor("scores", "B K T", F32), Tensor("positions", "B K T", I64),
     Scalar("threshold"), Scalar("window"), Scalar("tokens_before")],
    rules=[
        *CONTRACTS["kvzap_score"].rules,
        Rule(lambda v: v["K"] == (v["W"] if v["weight2"] is None else v["H"]),
             lambda v: f"expected log_weights.size(1) == {v['W'] if v['weight2'] is None else v['H']} (output heads H "
             f"of the surrogate), got log_weights of shape {tuple(v['log_weights'].shape)}"),
        Rule(lambda v: v["L"] >= v["q"],
             lambda v: f"expected log_weights with a slot for each of the q = {v['q']} new tokens, got log_weights of "
             f"shape {tuple(v['log_weights'].shape)}"),
        Rule(lambda v: v["T"] == v["L"] - v["q"],
             lambda v: f"expected scores.size(2) == {v['L'] - v['q']} (slots of log_weights before the q new tokens), "
             f"got scores of shape {tuple(v['scores'].shape)}"),
        *_kvzap_decoding_pass(),
    ],
    outputs=lambda v: [((v["B"], v["K"], v["L"]), F32), ((v["B"], v["K"], v["L"]), F32),
                       ((v["B"], v["K"], v["L"]), I64), ((v["B"], v["K"]), I64)],
))

_declare(Contract(
    "kvzap_paged_step",
    [Tensor("log_weight_blocks", "N S", F32, inplace=True), Tensor("score_blocks", "N S", F32, inplace=True),
     Tensor("position_blocks", "N S", I64, inplace=True), Tensor("block_tables", "B H M", I64),
     Tensor("lengths", "B H", I64), Tensor("new_scores", "B H q", F32), Scalar("threshold"), Scalar("window"),
     Scalar("tokens_before"), Scalar("check_tables_on_device", False)],
    rules=[
        Rule(lambda v: v["S"] >= 1, lambda v: f"expected a block size (log_weight_blocks.size(1)) >= 1, got {v['S']}"),
        Rule(lambda v: v["q"] >= 1,
             lambda v: f"expected at least one new token, got new_scores of shape {tuple(v['new_scores'].shape)}"),
        *_kvzap_decoding_pass(),
    ],
    outputs=lambda v: [((v["B"], v["H"]), I64)],
))


def _prompt_attention_args() -> list:
    return [Tensor("query", "B Hq q d", CACHE_DTYPES), Tensor("keys", "B H T d", "query"),
            Tensor("log_weights", "B H T", F32)]


def _prompt_attention_rules() -> list:
    return [
        Rule(lambda v: _finite(v["scale"]) and v["scale"] > 0,
             lambda v: f"expected a finite float32 scale > 0, got {v['scale']}"),
        _gqa("Hq", "H", "query", "keys", allow_empty=False),
        Rule(lambda v: v["d"] > 0,
             lambda v: f"expected a head dim d >= 1, got query of shape {tuple(v['query'].shape)}"),
        Rule(lambda v: v["T"] >= 1,
             lambda v: f"expected a prompt of T >= 1 tokens, got keys of shape {tuple(v['keys'].shape)}"),
        Rule(lambda v: 1 <= v["q"] <= v["T"],
             lambda v: "expected 1 <= q <= T (the q queries are the last q of the T prompt tokens), got q = "
             f"query.size(2) = {v['q']} and T = keys.size(2) = {v['T']}"),
    ]


_declare(Contract(
    "prompt_log_sum_exp",
    _prompt_attention_args() + [Scalar("scale")],
    rules=_prompt_attention_rules(),
    outputs=lambda v: [((v["B"], v["Hq"], v["q"]), F32)],
))

def _prompt_score_weight_rules() -> list:
    return [
        Rule(lambda v: 0.0 < v["decay"] <= 1.0, lambda v: f"expected decay in (0, 1], got {v['decay']}"),
        Rule(lambda v: _finite(v["input_scale"]) and v["input_scale"] >= 0,
             lambda v: f"expected a finite float32 input_scale >= 0, got {v['input_scale']}"),
    ]


_declare(Contract(
    "prompt_scores",
    _prompt_attention_args() + [Tensor("log_sum_exp", "B Hq q", F32), Scalar("scale"), Scalar("decay"),
                                Scalar("input_scale")],
    rules=_prompt_attention_rules() + _prompt_score_weight_rules(),
    outputs=lambda v: [((v["B"], v["H"], v["T"]), F32)],
))

_declare(Contract(
    "prompt_attention_with_scores",
    _prompt_attention_args()[:2] + [Tensor("values", "B H T d", "query"), _prompt_attention_args()[2],
                                    Scalar("scale"), Scalar("decay"), Scalar("input_scale")],
    rules=_prompt_attention_rules() + _prompt_score_weight_rules(),
    outputs=lambda v: [((v["B"], v["q"], v["Hq"], v["d"]), "query"), ((v["B"], v["Hq"], v["q"]), F32),
                       ((v["B"], v["H"], v["T"]), F32)],
))

_declare(Contract(
    "prompt_log_unnormalised_scores",
    _prompt_attention_args() + [Scalar("scale"), Scalar("decay"), Scalar("input_scale")],
    rules=_prompt_attention_rules() + [
        Rule(lambda v: 0.0 < v["decay"] < 1.0, lambda v: f"expected decay in (0, 1), got {v['decay']}"),
        Rule(lambda v: _finite(v["input_scale"]) and v["input_scale"] > 0,
             lambda v: f"expected a finite float32 input_scale > 0, got {v['input_scale']}"),
    ],
    outputs=lambda v: [((v["B"], v["H"], v["T"]), F32)],
))


def _longest(lengths: torch.Tensor) -> int:
    """max(lengths) where the values can be read without a device sync (a CPU tensor), else 0: the host's check of
    a max_len given to paged_decode_attention, which a GPU call leaves to its kernel."""
    if lengths.device.type != "cpu" or isinstance(lengths, torch._subclasses.FakeTensor) or not lengths.numel():
        return 0
    return int(lengths.max())


def _probs_width(v) -> Any:
    """Width of paged_decode_attention's probabilities: the caller's max_len, else max(lengths), known only from the
    tables' contents."""
    if not v["return_probs"]:
        return 0
    if v["max_len"] is not None:
        return v["max_len"]
    lengths = v["lengths"]
    if lengths.device.type == "meta" or isinstance(lengths, torch._subclasses.FakeTensor):
        return torch.library.get_ctx().new_dynamic_size()
    return int(lengths.max()) if lengths.numel() else 0


_declare(Contract(
    "paged_decode_attention",
    [Tensor("query", "B Hq q d", CACHE_DTYPES), Tensor("key_blocks", "N S d", "query"),
     Tensor("value_blocks", "N S d", "query"), Tensor("log_weight_blocks", "N S", F32),
     Tensor("block_tables", "B H M", I64), Tensor("lengths", "B H", I64), Scalar("scale"),
     Scalar("return_probs", True), Scalar("max_len")],
    rules=[
        Rule(lambda v: _finite(v["scale"]) and v["scale"] > 0,
             lambda v: f"expected a finite float32 scale > 0, got {v['scale']}"),
        Rule(lambda v: v["S"] >= 1, lambda v: f"expected a block size (key_blocks.size(1)) >= 1, got {v['S']}"),
        _gqa("Hq", "H", "query", "block_tables", allow_empty=False),
        Rule(lambda v: v["d"] > 0,
             lambda v: f"expected a head dim d >= 1, got query of shape {tuple(v['query'].shape)}"),
        Rule(lambda v: v["q"] >= 1,
             lambda v: f"expected at least one query, got query of shape {tuple(v['query'].shape)}"),
        Rule(lambda v: v["max_len"] is None or 1 <= v["max_len"] <= v["M"] * v["S"],
             lambda v: f"expected max_len in [1, {v['M'] * v['S']}] (max_blocks * block size), got {v['max_len']}"),
        Rule(lambda v: v["max_len"] is None or _longest(v["lengths"]) <= v["max_len"],
             lambda v: f"expected every length <= max_len = {v['max_len']}, got a length of {_longest(v['lengths'])}"),
    ],
    outputs=lambda v: [((v["B"], v["Hq"], v["q"], v["d"]), "query"), ((v["B"], v["Hq"], v["q"], _probs_width(v)), F32)],
))

