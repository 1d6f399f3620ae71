"""The compressed cache and its attention path, end to end on real models: per-slot log-weights honoured by every
attention implementation, per-head eviction compacted to the longest head, state on the cache (not the press),
cleared on the next prefill, and agreement between `generate` and kvpress's pipeline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from dataclasses import dataclass

import pytest
import torch
from transformers import DynamicCache, pipeline

from kvpress_cpp.cache import LayerState, cache_bytes, compact_to_longest_head, get_state
from kvpress_cpp.presses.base import KVCompDecodingPress, KVCompPress
from tests import kvpress_hooks
from tests.generation import TINY_MODELS, greedy, prompt_ids
from tests.models import make_tiny_llama


@dataclass
class KeepEverythingPress(KVCompDecodingPress):
    """Installs an all-zero state and keeps every slot, so every later forward runs the biased attention path."""

    def compress_prefill(self, module, hidden_states, keys, values, attentions, log_weights, kwargs):
        return keys, values, LayerState(log_weights)


def seeded_keep_mask(keys: torch.Tensor, layer_idx: int, keep_fraction: float) -> torch.Tensor:
    """A random per-head keep mask (different counts per head), always keeping the last slot."""
    generator = torch.Generator().manual_seed(1000 + layer_idx)
    keep = torch.rand(keys.shape[:3], generator=generator) < keep_fraction
    keep[..., -1] = True
    return keep.to(keys.device)


@dataclass
class EvictPerHeadPress(KVCompPress):
    """Per-head eviction with compaction to the longest head (prefill only)."""

    keep_fraction: float = 0.25

    def compress_prefill(self, module, hidden_states, keys, values, attentions, log_weights, kwargs):
        keep = seeded_keep_mask(keys, module.layer_idx, self.keep_fraction) & torch.isfinite(log_weights)
        return compact_to_longest_head(keys, values, keep, log_weights)


@dataclass
class MaskPerHeadPress(KVCompPress):
    """The same eviction as EvictPerHeadPress, expressed only as b = -inf on the evicted slots, nothing removed."""

    keep_fraction: float = 0.25

    def compress_prefill(self, module, hidden_states, keys, values, attentions, log_weights, kwargs):
        keep = seeded_keep_mask(keys, module.layer_idx, self.keep_fraction)
        return keys, values, LayerState(log_weights.masked_fill(~keep, float("-inf")))




@pytest.mark.parametrize("make_model,attn_implementation", TINY_MODELS)
def test_press_that_changes_nothing_generates_identical_tokens(make_model, attn_implementation):
    model, tokenizer = make_model(attn_implementation=attn_implementation)
    input_ids = prompt_ids(tokenizer, 48, batch=2)
    expected, _ = greedy(model, input_ids)
    got, cache = greedy(model, input_ids, press=KeepEverythingPress())
    assert all(get_state(layer) is not None for layer in cache.layers), "the press did not install its state"
    assert torch.equal(got, expected)


def test_press_that_changes_nothing_on_smollm2(default_model):
    model, tokenizer = default_model
    messages = [{"role": "user", "content": "List three colours of the rainbow."}]
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True).input_ids
    expected, _ = greedy(model, input_ids, max_new_tokens=20)
    got, _ = greedy(model, input_ids, press=KeepEverythingPress(), max_new_tokens=20)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("make_model,attn_implementation", TINY_MODELS)
def test_compacted_cache_equals_masked_cache(make_model, attn_implementation):
    """Removing evicted slots (compaction to the longest head, -inf padding) gives the same decoding as keeping
    them with b = -inf: a -inf slot contributes nothing, and compaction loses nothing that is kept."""
    model, tokenizer = make_model(attn_implementation=attn_implementation)
    input_ids = prompt_ids(tokenizer, 64)
    masked, masked_cache = greedy(model, input_ids, press=MaskPerHeadPress())
    compacted, compacted_cache = greedy(model, input_ids, press=EvictPerHeadPress())
    assert torch.equal(compacted, masked)
    assert compacted_cache.layers[0].keys.shape[-2] < masked_cache.layers[0].keys.shape[-2]


def tensors_reachable(obj, seen: set[int]) -> list[torch.Tensor]:
    """Every tensor `obj` holds: itself, or those in its fields, dicts and lists, each once (weak references, e.g. a
    state's owner press, are not followed)."""
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    children = (obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple))
                else vars(obj).values() if isinstance(obj, LayerState) else [])
    return [tensor for child in children for tensor in tensors_reachable(child, seen)]


@pytest.mark.parametrize("batch", ["one prompt", "left-padded rows"])
@pytest.mark.parametrize("press", ["ZSMerge", "KeepKV", "GVote"])
def test_cache_bytes_count_every_tensor_a_layer_holds(press, batch):
    """cache_bytes, which the demo and benchmarks report: the keys, the values and every tensor of the press's state
    (per-slot scores, counts, log-weights; each row's state in a padded batch), nothing left out."""
    from kvpress_cpp.presses import GVotePress, KeepKVPress, ZSMergePress

    model, tokenizer = make_tiny_llama()
    press = {"ZSMerge": ZSMergePress(budget=24), "KeepKV": KeepKVPress(budget=24), "GVote": GVotePress()}[press]
    kwargs = {}
    if batch == "one prompt":
        ids = prompt_ids(tokenizer, 64)
    else:
        ids = torch.cat([prompt_ids(tokenizer, 64), torch.cat([torch.zeros(1, 8, dtype=torch.long),
                                                               prompt_ids(tokenizer, 56)], dim=1)])
        kwargs["attention_mask"] = (torch.arange(64) >= torch.tensor([[0], [8]])).long()
    _, cache = greedy(model, ids, press=press, max_new_tokens=3, **kwargs)
    expected = 0
    for layer in cache.layers:
        state = get_state(layer)
        assert state is not None
        expected += sum(tensor.nbytes for tensor in tensors_reachable([layer.keys, layer.values, state], set()))
    assert cache_bytes(cache) == expected


@pytest.mark.parametrize("press", ["ZSMerge", "WeightedKV", "KeepKV"])
def test_a_compressed_prompt_leaves_no_storage_of_the_whole_prompt_behind(press):
    """The slots a prefill keeps must not be views of the prompt's keys and values: their storage would hold all T
    slots until the first decoding step rewrites them (cache_bytes, which counts what the tensors show, would not
    see it). A quarter of the prompt kept: the storages behind the cache hold under half of the prompt's bytes."""
    from kvpress_cpp.presses import KeepKVPress, WeightedKVPress, ZSMergePress

    model, tokenizer = make_tiny_llama()
    press = {"ZSMerge": ZSMergePress(budget=0.25), "WeightedKV": WeightedKVPress(cache_size=0.25),
             "KeepKV": KeepKVPress(budget=0.25)}[press]
    ids, cache = prompt_ids(tokenizer, 256), DynamicCache()
    with torch.no_grad(), press(model):
        model(ids, past_key_values=cache)
    for index, layer in enumerate(cache.layers):
        storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
                    for tensor in tensors_reachable([layer.keys, layer.values, get_state(layer)], set())}
        prompt_bytes = 2 * layer.keys[..., :1, :].nbytes * ids.shape[1]  # the prompt's keys and values
        assert sum(storages.values()) < prompt_bytes / 2, f"layer {index}"


def test_compaction_shrinks_memory_to_longest_head():
    model, tokenizer = make_tiny_llama()
    input_ids = prompt_ids(tokenizer, 400)
    full = DynamicCache()
    compressed = DynamicCache()
    with torch.no_grad():
        model(input_ids, past_key_values=full)
        with EvictPerHeadPress(keep_fraction=0.25)(model):
            model(input_ids, past_key_values=compressed)
    assert cache_bytes(compressed) <= 0.40 * cache_bytes(full)
    for layer in compressed.layers:
        state = get_state(layer)
        real = torch.isfinite(state.log_weights).sum(-1)
        assert layer.keys.shape[-2] == int(real.max()), "the layer is not compacted to its longest head"


def test_compact_to_longest_head_keeps_order_and_pads():
    keys = torch.arange(2 * 1 * 5 * 1, dtype=torch.float32).view(1, 2, 5, 1)
    keep = torch.tensor([[[True, False, True, True, False], [False, True, False, False, False]]])
    log_weights = torch.tensor([[[0.0, 1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0, 9.0]]])
    new_keys, new_values, state = compact_to_longest_head(keys, keys.clone(), keep, log_weights)
    assert new_keys[0, 0, :, 0].tolist() == [0.0, 2.0, 3.0]
    assert new_keys[0, 1, :, 0].tolist() == [6.0, 0.0, 0.0]
    assert state.log_weights[0, 0].tolist() == [0.0, 2.0, 3.0]
    assert state.log_weights[0, 1].tolist() == [6.0, float("-inf"), float("-inf")]


def test_compact_to_longest_head_keeps_order_over_many_slots():
    """Each head's kept slots in their original order at 300 slots per head, where an unstable sort of the evicted
    flags reorders them (torch sorts short rows by insertion, so the 5-slot test above would not tell)."""
    generator = torch.Generator().manual_seed(0)
    keep = torch.rand(2, 3, 300, generator=generator) < 0.4
    positions = torch.arange(300, dtype=torch.float32).expand(2, 3, 300)
    new_keys, _, state = compact_to_longest_head(positions.unsqueeze(-1), positions.unsqueeze(-1).clone(), keep,
                                                 positions.clone())
    for b in range(2):
        for h in range(3):
            kept = positions[b, h][keep[b, h]]
            assert torch.equal(new_keys[b, h, :len(kept), 0], kept)
            assert torch.equal(state.log_weights[b, h, :len(kept)], kept)


def test_align_cuts_to_the_layer_and_pads_the_new_tokens_however_often_it_is_called():
    """align(slots_before, new) = the state's first slots_before columns then `new` zeros, its per-slot tensors cut
    to slots_before; a second call on what the first left (the attention path, then the press) gives the same, and
    tensors a press wrote in between are aligned afresh even for the same arguments."""
    def expected(tensor, slots_before, new_tokens):
        return torch.cat([tensor[..., :slots_before], torch.zeros(*tensor.shape[:-1], new_tokens)], -1)

    log_weights, scores = torch.arange(6.0).view(1, 1, 6), torch.arange(10.0, 16.0).view(1, 1, 6)
    state = LayerState(log_weights.clone(), {"scores": scores.clone()})
    for slots_before, new_tokens in ((6, 1), (6, 1), (4, 2), (4, 2), (3, 1)):
        assert torch.equal(state.align(slots_before, new_tokens), expected(log_weights, slots_before, new_tokens))
        assert torch.equal(state.per_slot["scores"], scores[..., :slots_before])
    state.log_weights, state.per_slot = -log_weights, {"scores": -scores}  # the press's step, then the next pass
    assert torch.equal(state.align(3, 1), expected(-log_weights, 3, 1))
    assert torch.equal(state.per_slot["scores"], -scores[..., :3])


def test_value_probe_tells_a_cut_from_another_presss_selection():
    """The probe (the first value channel of every slot a press wrote) lets a cut from the right through, down to any
    length, and refuses a selection that removes any one slot but the last, or keeps half the slots in order, as
    kvpress's Knorm after ours would; also once align has appended new tokens after the probed slots. (Probing every
    8th slot only, which would save 1-2% of a SmolLM2 decoding step on CPU, misses such a half whose samples all
    match.)"""
    for slots in (5, 16, 23):
        values = torch.randn(1, 2, slots, 4)
        state = LayerState(torch.zeros(1, 2, slots))
        state.value_probe = values[..., 0].clone()  # as the forward hook takes it
        for length in range(slots):
            state.check_slots(values[:, :, :length], length)  # kvpress's pipeline dropping an answer
        for removed in range(slots - 1):
            kept = [slot for slot in range(slots) if slot != removed]
            with pytest.raises(RuntimeError, match="another press rearranged the slots"):
                state.check_slots(values[:, :, kept], slots - 1)
        half = [0, *range(2, slots, 2)][:slots // 2]  # slot 0 and every other one: the first slot matches
        with pytest.raises(RuntimeError, match="another press rearranged the slots"):
            state.check_slots(values[:, :, half], len(half))
        state.align(slots, 2)  # two tokens after the probed slots, then one more slot removed
        with pytest.raises(RuntimeError, match="another press rearranged the slots"):
            state.check_slots(torch.cat([values[:, :, 1:], torch.randn(1, 2, 1, 4)], 2), slots)
        state.check_slots(torch.cat([values, torch.randn(1, 2, 1, 4)], 2), slots + 1)  # the new tokens cut


def test_state_is_ignored_by_another_cache_and_cleared_on_next_prefill():
    model, tokenizer = make_tiny_llama()
    input_ids = prompt_ids(tokenizer, 40)
    with torch.no_grad():
        reference_logits = model(input_ids).logits
        cache = DynamicCache()
        with MaskPerHeadPress(keep_fraction=0.5)(model):
            model(input_ids, past_key_values=cache)
        assert get_state(cache.layers[0]) is not None
        # A fresh cache on the same model: the old state must not leak into it.
        torch.testing.assert_close(model(input_ids, past_key_values=DynamicCache()).logits, reference_logits)
        # The same cache emptied and prefilled again: its old state is dropped.
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[..., :0, :], layer.values[..., :0, :]
        torch.testing.assert_close(model(input_ids, past_key_values=cache).logits, reference_logits)
        assert get_state(cache.layers[0]) is None


def test_two_caches_decoded_in_turns_each_match_their_run_alone():
    """The benchmark's turns (bench_paged.decode_rows): each cache's layers are attached before its step;
    re-attaching the layer already attached and switching to the other cache's must both leave every step as it is
    when the cache decodes alone."""
    from kvpress_cpp.cache import attach
    from kvpress_cpp.presses import KeepKVPress

    model, tokenizer = make_tiny_llama()
    prompts = [prompt_ids(tokenizer, 48), prompt_ids(tokenizer, 64)[:, 8:]]
    modules = [layer.self_attn for layer in model.model.layers]

    def prefill(ids):
        press, cache = KeepKVPress(budget=24, recent=8), DynamicCache()
        with torch.no_grad(), press(model):
            logits = model(ids, past_key_values=cache).logits
        return press, cache, logits[:, -1:].argmax(-1)

    def step(run):
        press, cache, token = run
        for module, layer in zip(modules, cache.layers):
            attach(module, layer)
        with torch.no_grad(), press(model):
            logits = model(token, past_key_values=cache).logits[:, -1]
        run[2] = logits.argmax(-1, keepdim=True)
        return logits

    alone = []
    for ids in prompts:
        run = list(prefill(ids))
        alone.append([step(run) for _ in range(6)])
    runs = [list(prefill(ids)) for ids in prompts]
    for turn in range(6):
        for run, expected in zip(runs, alone):
            torch.testing.assert_close(step(run), expected[turn], rtol=0, atol=0)


def test_a_compressed_context_keeps_its_state_when_another_cache_is_compressed_on_the_model():
    """Two contexts compressed in two caches of one model, answered outside the press (kvpress's pipeline's way):
    each question over a context gives the logits it gave before the other cache was compressed. A module used to
    know only the layer attached last, so the first context lost its merge weights (logits off by up to 1)."""
    from kvpress_cpp.presses import ZSMergePress

    model, tokenizer = make_tiny_llama()
    contexts, question = [prompt_ids(tokenizer, 48), prompt_ids(tokenizer, 64)[:, 8:]], prompt_ids(tokenizer, 5)

    def ask(cache, context):
        positions = torch.arange(context.shape[1], context.shape[1] + question.shape[1]).unsqueeze(0)
        logits = model(question, past_key_values=cache, position_ids=positions).logits
        # back to the context, as the pipeline cuts; a negative count, which every transformers version reads as
        # tokens to drop (5.24 refuses a positive length to keep)
        cache.crop(-question.shape[1])
        return logits

    caches, alone = [], []
    with torch.no_grad():
        for context in contexts:
            cache = DynamicCache()
            with ZSMergePress(budget=16)(model):
                model(context, past_key_values=cache)
            assert cache.get_seq_length() < context.shape[1], "the press must have compressed the context"
            alone.append(ask(cache, context))
            caches.append(cache)
        for cache, context, expected in zip(caches, contexts, alone):
            torch.testing.assert_close(ask(cache, context), expected, rtol=0, atol=0)


def test_pipeline_and_generate_agree_on_a_compressed_context():
    """kvpress's pipeline answers outside the press context; greedy decoding continuing the same compressed cache
    at the logical positions must give the same answer (a loop of forwards: transformers 5's generate no longer
    takes the positions)."""
    model, tokenizer = make_tiny_llama()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    context = "It is a truth universally acknowledged, that a single man in possession of a good fortune " * 6
    question = "who is in want of a wife?"
    press = EvictPerHeadPress(keep_fraction=0.5)
    answer = pipe(context, question=question, press=press, max_new_tokens=12)["answer"]

    inputs = pipe.preprocess(context, questions=[question], answer_prefix="", max_context_length=10**6)
    context_ids, question_ids = inputs["context_ids"], inputs["questions_ids"][0]
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=context_ids, past_key_values=cache)
    position, ids, generated = context_ids.shape[1], question_ids, []
    stop = model.generation_config.eos_token_id
    with torch.no_grad():
        while len(generated) < 12 and not (generated and generated[-1] in stop):
            positions = torch.arange(position, position + ids.shape[1]).unsqueeze(0)
            logits = model(input_ids=ids, past_key_values=cache, position_ids=positions).logits
            position, ids = position + ids.shape[1], logits[:, -1:].argmax(-1)
            generated.append(int(ids))
    assert answer == tokenizer.decode(generated, skip_special_tokens=True)


def test_pipeline_reuses_one_compressed_context_for_several_questions():
    model, tokenizer = make_tiny_llama()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    context = "It is a truth universally acknowledged, that a single man in possession of a good fortune " * 6
    questions = ["who is in want of a wife?", "what is acknowledged?"]
    press = EvictPerHeadPress(keep_fraction=0.5)
    together = pipe(context, questions=questions, press=press, max_new_tokens=10)["answers"]
    alone = [pipe(context, question=q, press=press, max_new_tokens=10)["answer"] for q in questions]
    assert together == alone


ORDER_SCRIPT = """
import json, sys, torch
sys.path.insert(0, ".")
from transformers import DynamicCache
from kvpress import AdaKVPress, KnormPress
from tests.models import make_tiny_llama
model, tokenizer = make_tiny_llama()
ids = tokenizer("It is a truth universally acknowledged, " * 12, return_tensors="pt").input_ids[:, :48]
def run(press):
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        out = model.generate(ids, past_key_values=cache, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    return out[0, ids.shape[1]:].tolist()
result = {"adakv": run(AdaKVPress(KnormPress(compression_ratio=0.5)))}
if "kvpress_cpp.attention" in sys.modules:
    from tests.test_cache_attention import EvictPerHeadPress, MaskPerHeadPress
    result["masked"], result["evicted"] = run(MaskPerHeadPress()), run(EvictPerHeadPress())
print(json.dumps(result))
"""


def run_with_imports(imports: list[str]) -> dict:
    result = subprocess.run([sys.executable, "-c", "\n".join(imports) + ORDER_SCRIPT], capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@kvpress_hooks.mark
def test_coexists_with_kvpress_attention_patch_in_either_import_order():
    """kvpress's head-wise masking (AdaKV's fake keys) and our log-weights both keep working whichever package
    patched transformers' attention functions first."""
    kvpress_alone = run_with_imports(["import kvpress"])
    for imports in (["import kvpress", "import kvpress_cpp.attention"],
                    ["import kvpress_cpp.attention", "import kvpress"]):
        both = run_with_imports(imports)
        assert both["adakv"] == kvpress_alone["adakv"], f"kvpress's patch broken with {imports}"
        assert both["masked"] == both["evicted"], f"log-weights not honoured with {imports}"


@pytest.mark.parametrize("make_model,attn_implementation", TINY_MODELS)
def test_left_padded_batch_matches_no_press(make_model, attn_implementation):
    """Padding is folded into the log-weights at prefill (-inf), so a padded batch decodes as without a press."""
    model, tokenizer = make_model(attn_implementation=attn_implementation)
    tokenizer.padding_side = "left"
    texts = ["It is a truth universally acknowledged, that a single man", "Emma Woodhouse, handsome, clever"]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    assert not bool(batch.attention_mask.all()), "the batch must contain padding"
    expected, _ = greedy(model, batch.input_ids, attention_mask=batch.attention_mask)
    got, cache = greedy(model, batch.input_ids, press=KeepEverythingPress(), attention_mask=batch.attention_mask)
    assert torch.isinf(get_state(cache.layers[0]).log_weights).any()
    assert torch.equal(got, expected)



def _allocation(batch=2, heads=3, capacity=10, dim=4):
    return torch.randn(batch, heads, capacity, dim, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("columns,new_tokens,in_place", [
    ((0, 7), 3, True),    # room for all three after column 7
    ((0, 9), 1, True),    # a press's steady state: M of the M + 1 slots held, one appended
    ((2, 8), 2, True),    # a view from column 2: columns 8 and 9 are still this row's
    ((2, 9), 2, False),   # column 10 would be the next row's first
    ((0, 9), 2, False),
])
def test_slots_append_in_place_only_into_columns_no_row_holds(columns, new_tokens, in_place):
    """append_slots is torch.cat([held, new], -2) (the reference), written into the allocation behind `held` only where
    every row's new columns lie inside that row and after its held ones; nothing else of the allocation changes."""
    from kvpress_cpp.cache import append_slots

    allocation = _allocation()
    first, end = columns
    held = allocation[:, :, first:end]
    new = torch.randn(2, 3, new_tokens, 4)
    expected = torch.cat([held, new], dim=-2)
    before = allocation.clone()
    grown = append_slots(held, new)
    torch.testing.assert_close(grown, expected, rtol=0, atol=0)
    assert (grown.untyped_storage().data_ptr() == allocation.untyped_storage().data_ptr()) is in_place
    if in_place:
        torch.testing.assert_close(allocation[:, :, end:end + new_tokens], new, rtol=0, atol=0)
        before[:, :, end:end + new_tokens] = new
    torch.testing.assert_close(allocation, before, rtol=0, atol=0)


@pytest.mark.parametrize("held", [
    lambda a: a[1:, :, :5],                         # one batch row of two: the storage holds more than the view
    lambda a: a[:, 1:, :5],                         # likewise along the heads
    lambda a: a[:, :, :5].clone(),                  # an exact-size copy: no room
    lambda a: a[:, :, :5].clone().requires_grad_(),  # autograd's
])
def test_slots_append_by_copy_where_the_layout_is_not_one_allocation_with_room(held):
    from kvpress_cpp.cache import append_slots

    allocation = _allocation()
    tensor = held(allocation)
    before = allocation.clone()
    new = torch.randn(*tensor.shape[:2], 1, 4)
    grown = append_slots(tensor, new)
    torch.testing.assert_close(grown, torch.cat([tensor, new], dim=-2), rtol=0, atol=0)
    assert grown.untyped_storage().data_ptr() != allocation.untyped_storage().data_ptr()
    torch.testing.assert_close(allocation, before, rtol=0, atol=0)


@pytest.mark.parametrize("press", ["ZSMerge", "WeightedKV", "KeepKV"])
def test_a_press_keeping_m_slots_decodes_without_copying_its_layer(press, monkeypatch):
    """Each decoding step of a press that keeps M slots appends its token into the slot the press freed, in place:
    every layer's keys and values stay in one allocation from the second step on (transformers' own update copies the
    layer with torch.cat every step), and the tokens are those of the copying update (torch.cat forced)."""
    import kvpress_cpp.cache as cache_module
    from benchmarks.bench_decode import PRESSES

    model, _ = make_tiny_llama()
    ids = torch.randint(2, model.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))

    def decode():
        cache, storages, tokens = DynamicCache(), [], []
        with torch.no_grad(), PRESSES[press](0.25)(model):
            token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(6):
                token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                tokens.append(token)
                storages.append({(layer.keys.untyped_storage().data_ptr(), layer.values.untyped_storage().data_ptr())
                                 for layer in cache.layers})
        return torch.cat(tokens, 1), storages

    tokens, storages = decode()
    assert all(step == storages[1] for step in storages[1:]), f"{press} copied its layers in a decoding step"
    monkeypatch.setattr(cache_module, "_room_after", lambda held, new: False)
    copied_tokens, _ = decode()
    assert torch.equal(tokens, copied_tokens)
