"""Every press on a tensor-parallel model equals the matching heads of a single-process run.

One ``torchrun --nproc-per-node 2`` launch (gloo on CPU) loads a tiny random Llama (4 kv heads, 8 query heads) with
transformers' ``tp_plan="auto"`` and runs every case of ``tests/tp_worker.py``; this process runs the same cases on the
same weights without sharding. Per case: the greedy tokens are equal, rank r's cache holds exactly kv heads
[2r, 2r+2) of the single-process cache (the slots each head attends to, those kvpress's head-wise presses mask left
out: keys, values, log-weights and the press's per-slot state such as scores, merge counts, votes), each rank holds at
most half of the single-process bytes, and ratios the presses report (GVote, KVzap, kvpress's DMSPress) are the
model's on every rank and on either cache.
Configurations that cannot run sharded are refused with an error naming the press. A plan that gathers the
projections' output (Phi-3's) leaves every rank the whole single-process cache.

Caches: :data:`CACHES` lists the cache kinds the worker runs the cases on (``--cache``); a new kind joins the
comparison by adding it there with its per-head slack (a paged cache may hold up to one partly filled block per head).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests import kvpress_hooks
from tests.models import make_tiny_llama
from tests.tp_worker import (
    ALL_HEADS_CASES,
    CASES,
    KEEP_EVERY_TOKEN_CASES,
    KVPRESS_HOOK_CASES,
    NEW_TOKENS,
    PROMPT_TOKENS,
    TP_SHAPE,
    run_case,
    write_assets,
)

RANKS = 2
#: The cases of tests/tp_worker.py a model splitting its kv heads runs.
SHARDED_CASES = [name for name in CASES if name not in ALL_HEADS_CASES]
RATIO_CASES = ["gvote", "kvzap-linear", "kvzap-mlp", "kvzap-in-kvpress-dms", "snapkv-in-kvpress-dms"]
#: The cases the launches run: kvpress's hooks fail (and would take every case of a launch down) where the
#: installed transformers is outside kvpress's range; their tests skip there.
RUN_CASES = kvpress_hooks.runnable(SHARDED_CASES, KVPRESS_HOOK_CASES)
#: cache kind → bytes a rank may hold beyond 1/N of the single-process cache, per (layer, kv head).
#: A paged rank may hold one partly filled block more per head: 16 slots of keys and values (head_dim 16, float32)
#: plus at most 8 float32 / int64 per-slot state entries.
CACHES = {"dynamic": 0, "paged": 16 * (2 * 16 * 4 + 8 * 8)}
LAUNCH_TIMEOUT_S = 170

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """(model dir, surrogate root, uneven model dir): the tiny Llama saved with save_pretrained, random KVzap
    surrogates for it, and a Llama whose 3 kv heads do not split over 2 ranks."""
    root = tmp_path_factory.mktemp("tensor_parallel")
    # transformers 5 asks hidden_size = heads x head_dim (16)
    uneven, _ = make_tiny_llama(num_attention_heads=6, num_key_value_heads=3, hidden_size=96)
    uneven.save_pretrained(root / "uneven")
    return *write_assets(root), root / "uneven"


def launch(model_dir: Path, surrogates: Path, out: Path, cache: str, cases: list[str], *extra: str) -> list[dict]:
    """Each rank's results ([rank 0, rank 1]) of one torchrun launch of tests/tp_worker.py running `cases`."""
    # torchrun's module, run by this interpreter: its script need not be on PATH or beside it (a venv layered on
    # another, as make test's transformers 5 run, has it only in the base venv).
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    command = [*torchrun, "--standalone", f"--nproc-per-node={RANKS}", str(Path(__file__).with_name("tp_worker.py")),
               str(model_dir), str(out), "--surrogates", str(surrogates), *extra, "--cache", cache, "--cases", *cases]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, f"torchrun failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    results = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(RANKS)]
    assert [r["rank"] for r in results] == list(range(RANKS)) and all(r["ranks"] == RANKS for r in results)
    return results


def run_alone(model_dir: Path, surrogates: Path, cache: str, cases: list[str]) -> dict[str, dict]:
    """The results of `cases` in this process, on the same weights, unsharded."""
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        return {name: run_case(model, tokenizer, name, surrogates, cache) for name in cases}


@pytest.fixture(scope="module", params=list(CACHES))
def sharded(request, assets, tmp_path_factory):
    """Each rank's results ([rank 0, rank 1]) of one torchrun launch running every case, and the cache kind."""
    model_dir, surrogates, uneven = assets
    out = tmp_path_factory.mktemp(f"ranks_{request.param}")
    return launch(model_dir, surrogates, out, request.param, RUN_CASES, "--uneven-model", str(uneven)), request.param


@pytest.fixture(scope="module")
def single(assets):
    """The results of every case in this process, on the same weights, unsharded, on each cache kind."""
    model_dir, surrogates, _ = assets
    return {kind: run_alone(model_dir, surrogates, kind, RUN_CASES) for kind in CACHES}


def attended(layer: dict, head: int) -> dict[str, torch.Tensor]:
    """Keys, values, log-weights and the press's per-slot state of the slots one kv head attends to (batch row 0),
    in slot order."""
    rows = {"keys": layer["keys"][0, head], "values": layer["values"][0, head]}
    if layer["log_weights"] is None:  # no per-slot state (kvpress's own masking): every slot, or a paged head's own
        held = rows["keys"].shape[0] if layer["lengths"] is None else int(layer["lengths"][0, head])
        shown = torch.ones(held, dtype=torch.bool) if layer["masked"] is None else ~layer["masked"][0, head, :held]
        return {name: row[:held][shown] for name, row in rows.items()}
    rows["log-weights"] = layer["log_weights"][0, head]
    rows.update({name: tensor[0, head] for name, tensor in layer["per_slot"].items()})
    held = rows["log-weights"] != float("-inf")
    return {name: row[held] for name, row in rows.items()}


def close(actual, expected, what):
    torch.testing.assert_close(actual, expected, atol=2e-4, rtol=2e-4, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("case", kvpress_hooks.cases(SHARDED_CASES, KVPRESS_HOOK_CASES))
def test_tokens_equal_single_process(sharded, single, case):
    results, kind = sharded
    for rank in results:
        assert rank["cases"][case]["tokens"].tolist() == single[kind][case]["tokens"].tolist(), f"rank {rank['rank']}"


@pytest.mark.parametrize("case", kvpress_hooks.cases(SHARDED_CASES, KVPRESS_HOOK_CASES))
def test_each_rank_holds_its_heads_of_the_single_process_cache(sharded, single, case):
    results, kind = sharded
    whole = single[kind][case]["layers"]
    if case not in KEEP_EVERY_TOKEN_CASES:
        fed = PROMPT_TOKENS + NEW_TOKENS - 1  # the last token is generated, never fed back
        assert any(min(len(attended(layer, head)["keys"]) for head in range(layer["keys"].shape[1])) < fed
                   for layer in whole), "the case compresses nothing"
    for rank in results:
        for index, (layer, reference) in enumerate(zip(rank["cases"][case]["layers"], whole)):
            local = layer["keys"].shape[1]
            assert local * RANKS == reference["keys"].shape[1]
            for head in range(local):
                model_head = rank["rank"] * local + head
                ours, theirs = attended(layer, head), attended(reference, model_head)
                where = f"{case}, rank {rank['rank']}, layer {index}, kv head {model_head}"
                assert ours.keys() == theirs.keys(), where
                assert ours["keys"].shape == theirs["keys"].shape, \
                    f"{where}: {ours['keys'].shape[0]} vs {theirs['keys'].shape[0]} slots"
                for name in theirs:
                    close(ours[name], theirs[name], f"{where}, {name}")


@pytest.mark.parametrize("case", kvpress_hooks.cases(SHARDED_CASES, KVPRESS_HOOK_CASES))
def test_kv_bytes_per_rank_at_most_a_share(sharded, single, case):
    results, kind = sharded
    slack = CACHES[kind] * sum(layer["keys"].shape[1] for layer in single[kind][case]["layers"]) // RANKS
    for rank in results:
        assert rank["cases"][case]["bytes"] <= single[kind][case]["bytes"] / RANKS + slack, f"rank {rank['rank']}"


@pytest.mark.parametrize("case", kvpress_hooks.cases(RATIO_CASES, KVPRESS_HOOK_CASES))
def test_reported_ratios_are_the_models(sharded, single, case):
    results, kind = sharded
    expected = single[kind][case]["ratios"]
    assert 0 < expected["overall"] < 1
    rectangular = single["dynamic"][case]["ratios"]  # the paged cache evicts what the rectangular one marks or pads
    assert expected["overall"] == pytest.approx(rectangular["overall"], abs=1e-6)
    assert expected["layers"] == pytest.approx(rectangular["layers"], abs=1e-6)
    for rank in results:
        got = rank["cases"][case]["ratios"]
        assert got["overall"] == pytest.approx(expected["overall"], abs=1e-6)
        assert got["layers"] == pytest.approx(expected["layers"], abs=1e-6)


def test_gvote_memory_ratio_is_what_the_ranks_hold_on_every_rank(sharded, single):
    """Each rank compacts a layer to its own heads' longest, so the model's memory freed is 1 - the mean over ranks of
    the columns each holds for the prompt, over the prompt's (a rank reported its own layers alone: rank 0's layer 0
    freed 0.59 where its heads kept 0.38). The same on every rank; at most the paper's mean-over-heads ratio."""
    results, kind = sharded
    reported = [rank["cases"]["gvote"]["ratios"] for rank in results]
    for rank in reported[1:]:
        assert rank["memory"] == pytest.approx(reported[0]["memory"], abs=1e-6)
    for layer, freed in reported[0]["memory"].items():
        assert freed <= reported[0]["layers"][layer] + 1e-6
    if kind != "dynamic":  # the columns below are a DynamicLayer's: its prompt's, then the generated tokens'
        return
    alone = single["dynamic"]["gvote"]
    for layer, freed in reported[0]["memory"].items():
        prompt_columns = round((1 - alone["ratios"]["memory"][layer]) * PROMPT_TOKENS)
        generated = alone["layers"][layer]["keys"].shape[-2] - prompt_columns
        held = [rank["cases"]["gvote"]["layers"][layer]["keys"].shape[-2] - generated for rank in results]
        assert freed == pytest.approx(1 - sum(held) / len(held) / PROMPT_TOKENS, abs=1e-6)


def test_configurations_that_cannot_run_sharded_are_refused(sharded):
    results, _ = sharded
    for rank in results:
        errors = rank["refusals"]
        assert errors["uneven-heads"].startswith("ZSMergePress: the model has 3 key value heads, which do not split "
                                                 "evenly over 2 tensor-parallel ranks")
        assert errors["kvpress-scorer"].startswith("KeepKVPress cannot run on a tensor-parallel model (2 ranks): its "
                                                   "scorer SnapKVPress is a kvpress scorer")
        assert errors["adakv-cross-head-scorer"].startswith("AdaKVPress cannot run on a tensor-parallel model (2 "
                                                            "ranks): its scorer TOVAPress is not known to score each "
                                                            "kv head from that head's own queries and keys")
        assert errors["dms-cross-head-scorer"].startswith("DMSPress cannot run on a tensor-parallel model (2 ranks): "
                                                          "its scorer TOVAPress is not known to score each kv head")
        # kvpress's presses alone, composed and wrapped: a shape error in the first pass before.
        unshardable = "cannot run on a tensor-parallel model (2 ranks): it is not known to compress each kv head"
        assert errors["cross-head-press"].startswith(f"TOVAPress {unshardable}")
        assert errors["composed-cross-head-press"].startswith(f"TOVAPress {unshardable}")
        assert errors["wrapped-scorer"].startswith(f"CriticalKVPress {unshardable}")
        assert errors["own-context"].startswith(f"KVzipPress {unshardable}")  # entered without BasePress.__call__


#: One case of each press family, and those a split model refuses, run on a tiny Phi-3.
GATHERED_CASES = kvpress_hooks.runnable(["zsmerge", "weightedkv", "keepkv", "kvzap-linear", "gvote", "adakv-kvzap",
                                         "kvzap-in-kvpress-dms", *sorted(ALL_HEADS_CASES)], KVPRESS_HOOK_CASES)


@pytest.fixture(scope="module")
def gathered(tmp_path_factory):
    """([rank 0's, rank 1's], single process's) results of :data:`GATHERED_CASES` on a tiny Phi-3, whose plan shards
    the packed q/k/v projection's weights over the ranks but gathers its output on every rank."""
    root = tmp_path_factory.mktemp("gathered_heads")
    model_dir, surrogates = write_assets(root, "phi3")
    return (launch(model_dir, surrogates, root / "ranks", "dynamic", GATHERED_CASES),
            run_alone(model_dir, surrogates, "dynamic", GATHERED_CASES))


@pytest.mark.parametrize("case", kvpress_hooks.cases(GATHERED_CASES, KVPRESS_HOOK_CASES))
def test_a_plan_gathering_the_projection_leaves_each_rank_the_whole_cache(gathered, case):
    """Every rank holds all kv heads and compresses them as one process does. Read from the sharded weights, the
    layers counted as split: each rank took its heads for heads [2r, 2r+2), so kvpress's AdaKV and DMS around KVzap
    kept other tokens than the single process, and ours stopped ("no query projection to read on a sharded
    Phi3Attention")."""
    ranks, alone = gathered
    expected = alone[case]
    for rank in ranks:
        got, where = rank["cases"][case], f"{case}, rank {rank['rank']}"
        assert got["tokens"].tolist() == expected["tokens"].tolist(), where
        for index, (layer, reference) in enumerate(zip(got["layers"], expected["layers"])):
            assert layer["keys"].shape[1] == reference["keys"].shape[1] == TP_SHAPE["num_key_value_heads"], where
            for head in range(reference["keys"].shape[1]):
                ours, theirs = attended(layer, head), attended(reference, head)
                assert ours.keys() == theirs.keys(), where
                for name in theirs:
                    close(ours[name], theirs[name], f"{where}, layer {index}, kv head {head}, {name}")
        if expected["ratios"] is not None:
            assert got["ratios"]["overall"] == pytest.approx(expected["ratios"]["overall"], abs=1e-6), where


# ---------------------------------------------------------------------------------------------------------------------
# One rank's view of a model, in this process: its attention layers' q/k/v projections cut to a rank's rows (or left
# whole, as a plan gathering their output leaves them), so each rank's shard and queries are checked against the
# unsharded layer without a launch.
# ---------------------------------------------------------------------------------------------------------------------


class _StandInMesh:
    """What kvpress_cpp.distributed reads of a 1-D tensor-parallel mesh: its size and this process's rank in it."""

    ndim = 1

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


def _rank_view(model: torch.nn.Module, ranks: int, rank: int, cut: bool = True) -> torch.nn.Module:
    """A copy of `model` on rank `rank` of `ranks`: its attention layers holding that rank's rows of q_proj, k_proj
    and v_proj (column sharding), or all rows where not `cut`."""
    import copy

    view = copy.deepcopy(model)
    view._tp_size, view._device_mesh = ranks, _StandInMesh(ranks, rank)
    for decoder in view.model.layers if cut else ():
        for name in ("q_proj", "k_proj", "v_proj"):
            full = getattr(decoder.self_attn, name)
            rows = full.out_features // ranks
            part = torch.nn.Linear(full.in_features, rows, bias=full.bias is not None)
            with torch.no_grad():
                part.weight.copy_(full.weight[rank * rows : (rank + 1) * rows])
                if full.bias is not None:
                    part.bias.copy_(full.bias[rank * rows : (rank + 1) * rows])
            setattr(decoder.self_attn, name, part)
    return view


@pytest.mark.parametrize("maker", ["llama", "qwen3"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_a_ranks_heads_and_queries_are_those_of_its_rows(maker, ranks):
    from kvpress_cpp import distributed
    from tests.models import make_tiny_qwen3

    make = make_tiny_llama if maker == "llama" else make_tiny_qwen3
    model, _ = make(num_attention_heads=8, num_key_value_heads=4, hidden_size=128)
    attn = model.model.layers[0].self_attn
    d, n_kv, n_q = attn.head_dim, 4, 8
    hidden = torch.randn(1, 5, 128, generator=torch.Generator().manual_seed(0))
    assert distributed.kv_head_shard(attn) is None  # unsharded: every head
    # A layer whose projection returns every head is unsharded on a tensor-parallel model: its plan gathers the
    # output (Phi-3's, OLMo-2's).
    whole = _rank_view(model, ranks, 0, cut=False)
    distributed.check_tensor_parallel("ZSMergePress", whole)
    assert distributed.kv_head_shard(whole.model.layers[0].self_attn) is None
    for rank in range(ranks):
        view = _rank_view(model, ranks, rank)
        distributed.check_tensor_parallel("ZSMergePress", view)
        shard = view.model.layers[0].self_attn
        first, stop = distributed.kv_head_shard(shard)
        # The heads whose keys this rank's k_proj computes: the unsharded keys' heads equal to them.
        with torch.no_grad():
            keys = attn.k_proj(hidden).view(1, 5, n_kv, d)
            local_keys = shard.k_proj(hidden).view(1, 5, -1, d)
        held = [h for h in range(n_kv) if any(torch.equal(keys[:, :, h], local_keys[:, :, j])
                                               for j in range(local_keys.shape[2]))]
        assert (first, stop) == (held[0], held[-1] + 1) and stop - first == local_keys.shape[2]
        # Its queries (pre-RoPE, after the per-head norm a model has one) are those of its query heads, in plain
        # PyTorch on the unsharded layer.
        with torch.no_grad():
            queries = torch.nn.functional.linear(hidden, attn.q_proj.weight, attn.q_proj.bias).view(1, 5, n_q, d)
            if getattr(attn, "q_norm", None) is not None:
                variance = queries.pow(2).mean(-1, keepdim=True)
                queries = attn.q_norm.weight * (queries * torch.rsqrt(variance + attn.q_norm.variance_epsilon))
            expected = queries.transpose(1, 2)[:, rank * n_q // ranks : (rank + 1) * n_q // ranks]
            torch.testing.assert_close(distributed.prerope_query_states(shard, hidden), expected)
        assert distributed.query_group_size(shard) == n_q // n_kv


def test_the_tensor_parallel_mesh_is_the_tp_dimension_of_a_model_mesh():
    """transformers 5.24 keeps the model's whole ("fsdp", "tp") mesh as ``_device_mesh``: the kv heads split over its
    "tp" dimension, not over every rank of the job; a model mesh without one is no tensor-parallel mesh."""
    from types import SimpleNamespace

    from kvpress_cpp.distributed import model_tensor_parallel_mesh

    tp = _StandInMesh(2, 1)

    class _ModelMesh:
        ndim = 2

        def __init__(self, names):
            self.mesh_dim_names = names

        def __getitem__(self, name):
            assert name == "tp", name
            return tp

    assert model_tensor_parallel_mesh(SimpleNamespace(_device_mesh=_ModelMesh(("fsdp", "tp")))) is tp
    assert model_tensor_parallel_mesh(SimpleNamespace(_device_mesh=_ModelMesh(("pp", "fsdp")))) is None
    assert model_tensor_parallel_mesh(SimpleNamespace(_device_mesh=tp)) is tp  # transformers before 5.24


def test_a_vision_towers_attention_is_not_read_for_kv_heads():
    """Gemma 3's SigLIP tower has k_proj too, and a configuration without kv heads: reading it for a shard stopped
    every press on a tensor-parallel Gemma 3 (AttributeError: 'SiglipVisionConfig' object has no attribute
    'num_key_value_heads'). Only the decoder's layers are read; here they hold every head (no rows cut)."""
    from kvpress_cpp import distributed
    from tests.test_misplaced_presses import tiny_gemma3

    model = tiny_gemma3(["sliding_attention", "full_attention"], sliding_window=16)
    model._tp_size, model._device_mesh = 2, _StandInMesh(2, 0)
    distributed.check_tensor_parallel("ZSMergePress", model)
    assert all(distributed.kv_head_shard(layer.self_attn) is None for layer in model.model.language_model.layers)


# ---------------------------------------------------------------------------------------------------------------------
# The example's command line
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arguments,message", [
    (["--model", "random-llama", "--kv-heads", "0"], "--kv-heads must be at least 1, got 0"),
    (["--model", "random-llama", "--layers", "0"], "--layers must be at least 1, got 0"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: not smollm2, random-llama or a local HF model "
                                        "directory (no such directory)"),
])
def test_the_example_refuses_bad_arguments_before_starting_the_ranks(monkeypatch, capsys, arguments, message):
    """--kv-heads 0 and --layers 0 ended in a ZeroDivisionError inside transformers' attention, on every rank."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "tensor_parallel.py"
    spec = importlib.util.spec_from_file_location("tensor_parallel_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setenv("RANK", "0")  # as under torchrun
    monkeypatch.setattr(sys, "argv", [str(path), *arguments])
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: pytest.fail("started the ranks"))
    with pytest.raises(SystemExit) as exit_:
        example.main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err
