"""KVzapThresholdPress's decoding step on a PagedKVCache, which works in the layer's pools (scores the new token,
decides the slot leaving the window, drops the dead slots when the rectangular cache compacts) instead of reading and
writing the layer's view: it must keep what the rectangular cache keeps, slot for slot, and run on its own path,
reading nothing back from the device once its rows are found in order (the op checking the tables in its kernel)."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvpress_cpp import ops
from kvpress_cpp.cache import get_state
from kvpress_cpp.paged_cache import PagedKVCache
from kvpress_cpp.presses import KVzapThresholdPress
from tests import reference
from tests.generation import prompt_ids
from tests.models import make_tiny_llama
from tests.test_fuzz_ops import _kvzap_paged_step_bad, _kvzap_paged_step_build, _kvzap_paged_step_sizes
from tests.test_kvzap_press import write_surrogate


@pytest.fixture(scope="module")
def surrogate_dir(tmp_path_factory):
    model, _ = make_tiny_llama()
    return write_surrogate(tmp_path_factory.mktemp("surrogate") / "mlp", model, "mlp", seed=0, scale=4.0)


def held(layer):
    """Per (batch, kv head): the token positions, scores and keys of the slots attended (finite log-weight)."""
    state = get_state(layer)
    keys = layer.keys
    log_weights = state.align(keys.shape[-2], 0)
    kept = torch.isfinite(log_weights)
    return [(state.per_slot["positions"][b, h][kept[b, h]], state.per_slot["scores"][b, h][kept[b, h]],
             keys[b, h][kept[b, h]]) for b in range(keys.shape[0]) for h in range(keys.shape[1])]


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_step_keeps_the_rectangular_slots(block_size, surrogate_dir, monkeypatch):
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 64)
    results = {}
    for cache_name, cache in (("rectangular", DynamicCache()), ("paged", PagedKVCache(block_size=block_size))):
        press = KVzapThresholdPress(threshold=0.0, sliding_window=8, surrogate_dir=surrogate_dir, compaction_slack=3)
        general_steps = []
        general = press.compress_decoding
        monkeypatch.setattr(press, "compress_decoding", lambda *a, **k: general_steps.append(1) or general(*a, **k))
        steps = []
        with torch.no_grad(), press(model):
            token = ids
            for _ in range(14):
                token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
                steps.append(([held(layer) for layer in cache.layers],
                              [layer.get_seq_length() for layer in cache.layers], press.compression_ratio))
        results[cache_name] = steps, len(general_steps)
    (rectangular, rectangular_general), (paged, paged_general) = results["rectangular"], results["paged"]
    assert rectangular_general > 0 and paged_general == 0  # the paged steps never went through the view
    for step, ((want_layers, want_widths, want_ratio), (got_layers, got_widths, got_ratio)) in enumerate(
            zip(rectangular, paged)):
        assert got_widths == want_widths, f"step {step}"  # dead slots dropped when the rectangular cache compacts
        assert got_ratio == pytest.approx(want_ratio), f"step {step}"
        tokens = 64 + step  # step 0 is the prefill
        for layer, (want, got) in enumerate(zip(want_layers, got_layers)):
            for head, ((want_pos, want_scores, want_keys), (pos, scores, keys)) in enumerate(zip(want, got)):
                where = f"step {step} layer {layer} head {head}"
                assert torch.equal(pos, want_pos), where
                torch.testing.assert_close(scores, want_scores, rtol=1e-4, atol=1e-4, msg=where)
                torch.testing.assert_close(keys, want_keys, rtol=1e-4, atol=1e-4, msg=where)
                # The DMS rule: the window (the last 8 tokens) is held, a token that left it only if score >= τ.
                assert set(range(tokens - 8, tokens)) <= set(pos.tolist()), where
                assert bool((scores[pos < tokens - 8] >= 0.0).all()), where
    # Some token decided while decoding (positions 56 .. 68 left the window then) was evicted.
    last = paged[-1][0]
    assert any(set(range(56, 69)) - set(pos.tolist()) for heads in last for pos, _, _ in heads)


def test_paged_step_on_a_left_padded_batch_generates_the_rectangular_tokens(surrogate_dir):
    """Rows of a left-padded batch whose first tokens leave the window while padding precedes them take the general
    path for those steps; the greedy tokens stay the rectangular cache's."""
    model, tokenizer = make_tiny_llama()
    tokenizer.padding_side = "left"
    long, short = prompt_ids(tokenizer, 40)[0], prompt_ids(tokenizer, 40)[0][:4]
    ids = torch.stack([long, torch.cat([torch.full((36,), tokenizer.pad_token_id or 0), short])])
    mask = torch.stack([torch.ones(40, dtype=torch.long), torch.cat([torch.zeros(36), torch.ones(4)]).long()])
    outputs, paths = [], []
    for cache in (DynamicCache(), PagedKVCache(block_size=4)):
        press = KVzapThresholdPress(threshold=0.0, sliding_window=8, surrogate_dir=surrogate_dir, compaction_slack=3)
        in_pools = press._step_paged_layer
        press._step_paged_layer = lambda *a: paths.append(in_pools(*a)) or paths[-1]
        with torch.no_grad(), press(model):
            outputs.append(model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                                          min_new_tokens=12, do_sample=False))
    assert torch.equal(outputs[1], outputs[0])
    assert True in paths and paths.count(False) > len(model.model.layers)  # more than the prefill took the general path


def test_passes_over_rows_found_in_order_read_nothing_back_and_keep_the_same_slots(surrogate_dir):
    """Once a pass finds every row's last slots in position order, the passes that only append read nothing back
    from the device (whether the op found its slots); a cut of the cache (``crop``) makes the next pass read again.
    Every pass keeps the slots of a press that reads at every pass, on a flow with a cut and a two-token pass."""
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 64)
    runs = {}
    for always_read in (False, True):
        press = KVzapThresholdPress(threshold=0.0, sliding_window=8, surrogate_dir=surrogate_dir, compaction_slack=3)
        if always_read:
            press._rows_known_in_order = lambda *args: False
        read_rows, passes, reads = press._read_rows, [], []
        press._read_rows = lambda *args: reads.append(len(passes)) or read_rows(*args)
        cache = PagedKVCache(block_size=4)
        with torch.no_grad(), press(model):
            token = ids
            for step in range(16):
                if step == 6:  # the last 3 slots of layer 0 (cache.crop counts tokens, refused this far back)
                    kept = cache.get_seq_length() - 3
                    for layer in cache.layers:
                        layer.crop(kept)
                if step == 10:
                    token = torch.cat([token, token], dim=-1)
                token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
                passes.append([held(layer) for layer in cache.layers])
        runs[always_read] = passes, reads
    (passes, reads), (always_passes, always_reads) = runs[False], runs[True]
    layers = len(model.model.layers)
    assert always_reads == [step for step in range(1, 16) for _ in range(layers)]  # step 0: the prefill
    assert reads[:layers] == [1] * layers and not {2, 3, 4, 5} & set(reads)
    assert 6 in reads  # the pass after the cut
    for step, (got, want) in enumerate(zip(passes, always_passes)):
        for layer, (got_heads, want_heads) in enumerate(zip(got, want)):
            for head, (got_head, want_head) in enumerate(zip(got_heads, want_heads)):
                for part, a, b in zip(("positions", "scores", "keys"), got_head, want_head):
                    assert torch.equal(a, b), f"step {step} layer {layer} head {head} {part}"


# ---------------------------------------------------------------------------------------------------------------
# The op's check_tables_on_device: the tables a PagedKVCache built, checked in the kernel rather than on the host

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


def paged_step_inputs(seed: int, device: str = "cpu") -> tuple:
    """Valid kvzap_paged_step arguments (some rows as decoding leaves them, some disturbed), as the fuzz test draws."""
    r = random.Random(seed)
    args = _kvzap_paged_step_build(r, _kvzap_paged_step_sizes(r, {"B": 2, "H": 3, "q": 2, "S": 4}), torch.float32)
    return tuple(arg.to(device) if isinstance(arg, torch.Tensor) else arg for arg in args)


def run_paged_step(args: tuple, check_tables_on_device: bool = False) -> tuple:
    """(held, *pools) of kvzap_paged_step over copies of the pools of `args` (paged_step_inputs'), the tables checked
    where asked."""
    pools = tuple(t.clone() for t in args[:3])
    return ops.kvzap_paged_step(*pools, *args[3:9], check_tables_on_device=check_tables_on_device), *pools


def test_opcheck():
    """The schema's in-place pools (Tensor(a!) ...) and the fake, as torch.library checks them."""
    for seed in range(3):
        torch.library.opcheck(torch.ops.kvcomp.kvzap_paged_step.default, paged_step_inputs(seed))


def test_compile_fullgraph():
    """Compiled, the step writes the pools in place as eagerly (a functionalised copy would leave them unchanged)."""
    compiled = torch.compile(run_paged_step, fullgraph=True)
    for seed in range(2):
        args = paged_step_inputs(seed)
        for got, expected in zip(compiled(args), run_paged_step(args)):
            assert torch.equal(got, expected)


def test_a_cpu_call_checks_the_tables_on_the_host_either_way():
    """On a CPU nothing waits, so check_tables_on_device changes nothing: bad tables get the host's error."""
    args = paged_step_inputs(0)
    for _, name, bad in _kvzap_paged_step_bad(random.Random(1), args):
        with pytest.raises(RuntimeError) as on_host:
            run_paged_step(bad)
        with pytest.raises(RuntimeError) as flagged:
            run_paged_step(bad, check_tables_on_device=True)
        assert str(flagged.value) == str(on_host.value) and "kvcomp::kvzap_paged_step" in str(on_host.value), name
    for got, want in zip(run_paged_step(args, check_tables_on_device=True), reference.kvzap_paged_step(*args)):
        assert torch.equal(got, want)


@CUDA
def test_tables_checked_on_the_device_read_nothing_back():
    """With check_tables_on_device the op syncs nothing and gives the reference's result; without it, it syncs to
    check the tables (which shows that the sync check sees a sync)."""
    args = paged_step_inputs(2, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = run_paged_step(args, check_tables_on_device=True)
        with pytest.raises(RuntimeError, match="synchroniz"):
            run_paged_step(args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got_tensor, want in zip(got, reference.kvzap_paged_step(*(a.cpu() if isinstance(a, torch.Tensor) else a
                                                                   for a in args))):
        assert torch.equal(got_tensor.cpu(), want)


BAD_TABLE_ON_DEVICE = """
import torch
from tests.test_kvzap_paged_step import paged_step_inputs, run_paged_step
args = list(paged_step_inputs(2, "cuda"))
tables, lengths, block_size = args[3], args[4], args[0].shape[1]
{change}
run_paged_step(tuple(args), check_tables_on_device=True)
torch.cuda.synchronize()
"""


@CUDA
@pytest.mark.parametrize("change,says", [
    ("tables[0, 0, (int(lengths[0, 0]) - 1) // block_size] = args[0].shape[0]",
     r"block table index out of range: block_tables\[0, \d+\] \(b \* H \+ h, entry\) = \d+ is used but not in \[0, \d+\)"),
    ("lengths[0, 0] = tables.shape[2] * block_size + 1",
     r"expected every length in \[q = 2, max_blocks \* block size = \d+\], got lengths\[0\] \(b \* H \+ h\) = \d+"),
], ids=["block", "length"])
def test_bad_tables_checked_on_the_device_stop_the_kernel(change, says):
    """A bad table the host did not read stops the kernel with a device-side assert naming the op and the entry (in
    a subprocess: the assert leaves its CUDA context unusable)."""
    done = subprocess.run([sys.executable, "-c", BAD_TABLE_ON_DEVICE.format(change=change)], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent,
                          env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})
    assert done.returncode != 0
    assert "device-side assert" in done.stderr
    assert re.search("kvcomp::kvzap_paged_step: " + says, done.stdout + done.stderr)


@pytest.mark.parametrize("window", [1, 8])
def test_tokens_fed_outside_the_press_are_refused_as_on_the_rectangular_cache(window, surrogate_dir):
    """Tokens appended while the press's context was closed have no scores in its state: the next pass in the context
    is refused on both caches, with the smallest window too."""
    model, tokenizer = make_tiny_llama()
    ids = prompt_ids(tokenizer, 48)
    errors = {}
    for cache in (DynamicCache(), PagedKVCache(block_size=4)):
        press = KVzapThresholdPress(threshold=0.0, sliding_window=window, surrogate_dir=surrogate_dir)
        with torch.no_grad():
            with press(model):
                token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
                token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)  # outside the press
            with press(model), pytest.raises(ValueError) as refused:
                model(token, past_key_values=cache)
        errors[type(cache).__name__] = str(refused.value)
    assert errors["PagedKVCache"] == errors["DynamicCache"]


@pytest.mark.parametrize("batches", [(2, 4), (1, 1)])
def test_two_caches_stepped_in_one_context_count_their_own_slots(batches, surrogate_dir):
    """Two conversations (caches of batch 2 and 4, or 1 and 1) decoded in turns under one press context: the paged
    step added its held counts to those of the other cache's state (a shape error at batches 2 and 4, a layer
    compression ratio of -0.08 at 2 and 1, 0.44 for 0.54 at 1 and 1). Each step now counts on its own cache, and the
    tokens and ratios are the rectangular cache's."""
    model, tokenizer = make_tiny_llama()

    def conversations(make_cache):
        press, caches = KVzapThresholdPress(threshold=0.0, sliding_window=8, surrogate_dir=surrogate_dir), []
        tokens = []
        with torch.no_grad(), press(model):
            for batch, length in zip(batches, (48, 40)):
                caches.append((make_cache(), length))
                tokens.append(model(prompt_ids(tokenizer, length, batch), past_key_values=caches[-1][0])
                              .logits[:, -1:].argmax(-1))
            steps = [[] for _ in batches]
            for step in range(8):
                for i, (cache, length) in enumerate(caches):
                    positions = torch.full((batches[i], 1), length + step)
                    tokens[i] = model(tokens[i], past_key_values=cache, position_ids=positions).logits[:, -1:].argmax(-1)
                    steps[i].append(tokens[i])
        return [torch.cat(s, dim=1) for s in steps], press.compression_ratio, press.layer_compression_ratios

    rectangular, paged = conversations(DynamicCache), conversations(lambda: PagedKVCache(block_size=4))
    for expected, got in zip(rectangular[0], paged[0], strict=True):
        assert torch.equal(got, expected)
    assert paged[1] == pytest.approx(rectangular[1])
    assert paged[2] == pytest.approx(rectangular[2])
