"""KVzap's presses: the scorer against kvpress's own KVzapPress, surrogate loading, and the thresholded press through
prefill and decoding against a plain-PyTorch replay of the DMS rule in absolute positions; kvpress's DMSPress,
AdaKVPress and pipeline on top. Surrogates are random, written in kvpress's KVzapModel format to a temp dir."""

from __future__ import annotations

import copy
import shutil
from types import SimpleNamespace

import pytest
import torch
from kvpress import (AdaKVPress, ComposedPress, CriticalAdaKVPress, DecodingPress, DMSPress, KnormPress,
                     PerLayerCompressionPress)
from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel
from kvpress.presses.kvzap_press import KVzapPress as KvpressKVzapPress
from safetensors.torch import load_file, save_file
from transformers import DynamicCache, Gemma3Config, pipeline

from kvpress_cpp.cache import LayerState, get_state
from kvpress_cpp.kvpress_adapters import kvpress_transformers_mismatch
from kvpress_cpp.presses import KVzapPress, KVzapThresholdPress
from kvpress_cpp.presses import kvzap as kvzap_module
from kvpress_cpp.presses.kvzap import save_surrogate
from kvpress_cpp.texts import austen_novel
from tests import kvpress_hooks, reference
from tests.generation import answers_hidden_fact, greedy, prompt_ids
from tests.models import make_tiny_llama

INF = float("inf")


def write_surrogate(path, model, model_type="mlp", seed=0, scale=1.0):
    """A random KVzapModel for `model`, saved in save_pretrained's layout (config.json + model.safetensors).
    `scale` multiplies the weights (a wider spread of scores)."""
    config = model.config
    torch.manual_seed(seed)
    surrogate = KVzapModel(KVzapConfig(input_dim=config.hidden_size, output_dim=config.num_key_value_heads,
                                       n_modules=config.num_hidden_layers,
                                       hidden_dim=None if model_type == "linear" else config.hidden_size // 8))
    with torch.no_grad():
        for parameter in surrogate.parameters():
            parameter.mul_(scale)
    return save_surrogate(surrogate, path)


def kvpress_scorer(model, model_type, directory):
    """kvpress's own KVzapPress holding the surrogate of `directory`, set by hand; its kvzap_model_name is set to
    the hub name it would look up, so post_init_from_model does not try the hub."""
    scorer = KvpressKVzapPress(model_type=model_type)
    scorer.kvzap_model = KVzapModel.from_pretrained(directory, local_files_only=True)
    scorer.kvzap_model_name = f"nvidia/KVzap-{model_type}-{model.config.name_or_path.split('/')[-1]}"
    return scorer


@pytest.fixture(scope="module")
def llama():
    return make_tiny_llama()


@pytest.fixture(scope="module")
def surrogates(llama, tmp_path_factory):
    """{model_type: directory} of random surrogates for the tiny Llama (scores spread over about ±3)."""
    root = tmp_path_factory.mktemp("surrogates")
    return {kind: write_surrogate(root / kind, llama[0], kind, seed=i, scale=4.0)
            for i, kind in enumerate(("linear", "mlp"))}


class Recorder:
    """Wraps a KVzapThresholdPress's scorer (prefill, paged decoding) and its rectangular decoding step: every layer's
    scores as computed, in order."""

    def __init__(self, press):
        self.scores: dict[int, list[torch.Tensor]] = {}
        score, step = press.scorer.layer_scores, press.decode_step

        def recorded_score(module, hidden_states):
            scores = score(module, hidden_states)
            self.scores.setdefault(module.layer_idx, []).append(scores)
            return scores

        def recorded_step(module, hidden_states, log_weights, state):
            result = step(module, hidden_states, log_weights, state)
            self.scores.setdefault(module.layer_idx, []).append(result[1][..., -hidden_states.shape[1]:])
            return result

        press.scorer.layer_scores, press.decode_step = recorded_score, recorded_step

    def all_scores(self, layer_idx):
        return torch.cat(self.scores[layer_idx], dim=-1)


def kept_positions(layer) -> list[list[set[int]]]:
    """Per (batch, head): the absolute positions of the slots the cache layer still attends to."""
    state = get_state(layer)
    held = state.log_weights != -INF
    positions = state.per_slot["positions"]
    return [[set(positions[b, h][held[b, h]].tolist()) for h in range(held.shape[1])] for b in range(held.shape[0])]


def expected_positions(keep: torch.Tensor) -> list[list[set[int]]]:
    return [[set(torch.nonzero(keep[b, h]).view(-1).tolist()) for h in range(keep.shape[1])]
            for b in range(keep.shape[0])]


# ---------------------------------------------------------------------------------------------------------------
# scorer


@pytest.mark.parametrize("model_type", ["linear", "mlp"])
def test_score_equals_kvpress_kvzap_score(llama, surrogates, model_type):
    model, tokenizer = llama
    ours = KVzapPress(model_type=model_type, surrogate_dir=surrogates[model_type])
    ours.post_init_from_model(model)
    theirs = kvpress_scorer(model, model_type, surrogates[model_type])
    hidden = torch.randn(2, 77, model.config.hidden_size)
    for module in (layer.self_attn for layer in model.model.layers):
        got = ours.score(module, hidden, None, None, None, {})
        expected = theirs.score(module, hidden, None, None, None, {})
        assert got.dtype == torch.float32 and got.shape == expected.shape == (2, 2, 77)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_score_uses_a_hand_set_surrogate(llama, surrogates):
    model, _ = llama
    press = KVzapPress(model_type="linear")
    press.kvzap_model = KVzapModel.from_pretrained(surrogates["linear"], local_files_only=True)
    press.post_init_from_model(model)  # keeps the hand-set model, looks for no file
    module = model.model.layers[1].self_attn
    hidden = torch.randn(1, 9, model.config.hidden_size)
    linear = press.kvzap_model.layers[1]
    torch.testing.assert_close(press.score(module, hidden, None, None, None, {}),
                               reference.kvzap_score(hidden, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_default_surrogate_dir_is_packaged_by_model_name(llama, surrogates, tmp_path, monkeypatch):
    model, _ = llama
    monkeypatch.setattr(kvzap_module, "SURROGATES_DIR", tmp_path)
    monkeypatch.setattr(model.config, "name_or_path", "SomeOrg/Tiny-Llama")
    target = tmp_path / "Tiny-Llama" / "mlp"
    assert kvzap_module.default_surrogate_dir(model, "mlp") == target
    assert not kvzap_module.has_packaged_surrogate(model, "mlp")
    with pytest.raises(FileNotFoundError, match=rf"expected config.json, model.safetensors in {target}.*"
                                                r"python -m kvpress_cpp.train_kvzap"):
        KVzapThresholdPress().post_init_from_model(model)
    write_surrogate(target, model, "mlp")
    assert kvzap_module.has_packaged_surrogate(model, "mlp")
    assert not kvzap_module.has_packaged_surrogate(model, "linear")
    press = KVzapThresholdPress()
    press.post_init_from_model(model)
    assert press.scorer.kvzap_model.config.hidden_dim == model.config.hidden_size // 8


def test_a_model_without_a_name_is_told_to_pass_a_surrogate_dir(llama, monkeypatch):
    """A model built in memory (config.name_or_path empty) was looked up as kvpress_cpp/surrogates/mlp, and the error
    named the model ''."""
    model, _ = llama
    monkeypatch.setattr(model.config, "name_or_path", "")
    with pytest.raises(FileNotFoundError, match=r"KVzap: the model has no name .* pass surrogate_dir="):
        KVzapThresholdPress().post_init_from_model(model)


def test_missing_or_mismatched_surrogate_errors(llama, surrogates, tmp_path):
    model, _ = llama
    with pytest.raises(FileNotFoundError, match=r"no linear surrogate .* expected config.json, model.safetensors in "
                                                rf"{tmp_path / 'nowhere'}"):
        with KVzapThresholdPress(model_type="linear", surrogate_dir=tmp_path / "nowhere")(model):
            pass
    with pytest.raises(ValueError, match=r"is an MLP, but model_type = 'linear'"):
        KVzapPress(model_type="linear", surrogate_dir=surrogates["mlp"]).post_init_from_model(model)
    other = KVzapModel(KVzapConfig(input_dim=64, output_dim=3, n_modules=2))
    save_surrogate(other, tmp_path / "three_heads")
    with pytest.raises(ValueError, match=r"has output_dim = 3, expected 2 \(kv heads of the model\)"):
        KVzapPress(model_type="linear", surrogate_dir=tmp_path / "three_heads").post_init_from_model(model)
    with pytest.raises(ValueError, match=r"model_type must be 'linear' or 'mlp'"):
        KVzapPress(model_type="cubic")
    scorer = KVzapPress(model_type="linear")
    with pytest.raises(ValueError, match=r"KVzapPress: model_type must be 'linear' or 'mlp', got 'cubic'"):
        scorer.model_type = "cubic"  # assigned later (a sweep): refused then, not at the first load
    with pytest.raises(ValueError, match=r"KVzapPress: surrogate_dir must be a folder's path"):
        scorer.surrogate_dir = 3
    assert (scorer.model_type, scorer.surrogate_dir) == ("linear", None)
    with pytest.raises(ValueError, match=r"sliding_window must be an int ≥ 1, got -1"):
        KVzapThresholdPress(sliding_window=-1)


def test_a_press_used_again_checks_its_surrogate_against_the_new_model(llama, surrogates):
    """The surrogate is loaded once per folder, but checked against every model a press is used on: reused on a
    model with 4 kv heads, a 2-head surrogate silently dropped heads 2-3 from the cache (KVzapPress), or failed deep
    in an op (KVzapThresholdPress)."""
    model, tokenizer = llama
    wider, _ = make_tiny_llama(num_key_value_heads=4, seed=1)
    ids = prompt_ids(tokenizer, 40)
    for press in (KVzapPress(compression_ratio=0.5, surrogate_dir=surrogates["mlp"]),
                  KVzapThresholdPress(threshold=0.0, sliding_window=4, surrogate_dir=surrogates["mlp"])):
        if isinstance(press, KVzapThresholdPress) or not kvpress_transformers_mismatch():  # (kvpress's hooks run)
            with torch.no_grad(), press(model):
                model(ids, past_key_values=DynamicCache())
        press.post_init_from_model(model)
        with pytest.raises(ValueError, match=rf"the surrogate in {surrogates['mlp']} has output_dim = 2, expected 4"):
            with press(wider):
                pass
    scorer = KVzapPress(surrogate_dir=surrogates["mlp"])
    scorer.post_init_from_model(model)
    scorer.model_type = "linear"  # the folder unchanged: its surrogate is an MLP all the same
    with pytest.raises(ValueError, match=r"is an MLP, but model_type = 'linear'"):
        scorer.post_init_from_model(model)
    scorer.kvzap_model = KVzapModel.from_pretrained(surrogates["linear"], local_files_only=True)  # set by hand since
    scorer.post_init_from_model(model)
    with pytest.raises(ValueError, match=r"the surrogate set as kvzap_model has output_dim = 2, expected 4"):
        scorer.post_init_from_model(wider)
    # A multimodal model's surrogate maps its decoder's hidden states (Gemma 3's config nests them in text_config).
    text = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "intermediate_size": 128, "vocab_size": 300}
    scorer.post_init_from_model(SimpleNamespace(config=Gemma3Config(text_config=text)))
    with pytest.raises(ValueError, match=r"has n_modules = 2, expected 3 \(layers of the model\)"):
        scorer.post_init_from_model(SimpleNamespace(config=Gemma3Config(text_config={**text, "num_hidden_layers": 3})))


def test_a_surrogate_lacking_tensors_is_refused(llama, surrogates, tmp_path):
    """transformers fills tensors a model.safetensors lacks with new random weights and only logs it: the press then
    evicted by random scores in those layers."""
    model, _ = llama
    partial = tmp_path / "mlp"
    shutil.copytree(surrogates["mlp"], partial)
    tensors = load_file(partial / "model.safetensors")
    save_file({name: t for name, t in tensors.items() if not name.startswith("layers.1.")},
              partial / "model.safetensors")
    with pytest.raises(ValueError, match=rf"the surrogate in {partial} lacks 4 tensor\(s\) .*layers\.1\.0\.bias"):
        KVzapThresholdPress(surrogate_dir=partial).post_init_from_model(model)


@pytest.mark.parametrize("damage", [
    lambda folder: (folder / "model.safetensors").write_bytes(b""),  # safetensors: "header too small", no path
    lambda folder: (folder / "config.json").write_text("{}"),  # "KVzapConfig.__init__() missing 3 ... arguments"
    lambda folder: (folder / "config.json").write_text("{"),
], ids=["empty safetensors", "empty config", "truncated config"])
def test_an_unreadable_surrogate_is_refused_naming_its_folder(llama, surrogates, tmp_path, damage):
    """A damaged surrogate folder stopped on safetensors' or transformers' own error, naming neither KVzap nor the
    folder."""
    model, _ = llama
    damaged = tmp_path / "mlp"
    shutil.copytree(surrogates["mlp"], damaged)
    damage(damaged)
    with pytest.raises(ValueError, match=rf"KVzap: the mlp surrogate in {damaged} cannot be read"):
        KVzapThresholdPress(surrogate_dir=damaged).post_init_from_model(model)


@pytest.mark.parametrize("value", [1.0, 1.5, -0.2, float("nan")])
def test_compression_ratio_is_checked_when_set_on_a_built_scorer(value):
    """kvpress's evaluation sets compression_ratio on a built press: 1.0 once dropped the whole prompt silently."""
    press = KVzapPress(compression_ratio=0.5)
    with pytest.raises(ValueError, match=rf"KVzapPress: compression_ratio must be a number in \[0, 1\), got {value}"):
        press.compression_ratio = value
    assert press.compression_ratio == 0.5
    with pytest.raises(ValueError, match=r"KVzapPress: compression_ratio must be a number in \[0, 1\), got 2"):
        KVzapPress(compression_ratio=2)


@kvpress_hooks.mark
def test_scores_of_buffered_decoding_tokens_for_the_whole_cache_are_refused(llama, surrogates):
    """kvpress's DecodingPress hands a ScorerPress its buffered decoding tokens beside the whole cache: KVzap's
    scores are per hidden state, so their top-k picked slots among the first ones of the prompt, by the scores of
    other tokens (or indexed past them)."""
    model, tokenizer = llama
    scorer = KVzapPress(compression_ratio=0.5, surrogate_dir=surrogates["mlp"])
    decoding = DecodingPress(base_press=scorer, compression_interval=4, target_size=8)
    with pytest.raises(ValueError, match=r"KVzapPress: scores one slot per hidden state, got the hidden states of 4 "
                                         r"tokens for \d+ slots at layer 0"):
        greedy(model, prompt_ids(tokenizer, 48), press=decoding, max_new_tokens=6)


@kvpress_hooks.mark
def test_a_prompt_another_press_shrank_is_refused(llama, surrogates):
    """A press before KVzap in a ComposedPress left 24 slots for the 48 tokens' hidden states: refused, naming
    KVzapPress, where it indexed past the keys."""
    model, tokenizer = llama
    scorer = KVzapPress(compression_ratio=0.5, surrogate_dir=surrogates["mlp"])
    with pytest.raises(ValueError, match=r"KVzapPress: .* hidden states of 48 tokens for 24 slots at layer 0"):
        greedy(model, prompt_ids(tokenizer, 48), press=ComposedPress([KnormPress(0.5), scorer]), max_new_tokens=1)


def test_default_model_is_named_after_the_hub_checkpoint(default_model):
    model, _ = default_model
    assert model.config.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert kvzap_module.default_surrogate_dir(model, "mlp").parts[-3:] == ("surrogates", "SmolLM2-135M-Instruct",
                                                                           "mlp")


# ---------------------------------------------------------------------------------------------------------------
# thresholded press: the DMS rule in absolute positions


@pytest.mark.parametrize("model_type", ["linear", "mlp"])
@pytest.mark.parametrize("window,prompt_length,slack", [(16, 200, 1), (128, 200, 32), (16, 40, 8), (300, 100, 1)])
def test_decisions_equal_the_dms_rule_replayed(llama, surrogates, model_type, window, prompt_length, slack):
    """Prefill + 100 decoding steps: every cache layer holds exactly the positions that the DMS rule, replayed in
    Python on the scores the press computed, keeps: the last `window` tokens and every earlier token whose score is
    not below τ. The slots kept from the prompt hold the prompt's own keys and values."""
    model, tokenizer = llama
    press = KVzapThresholdPress(threshold=0.0, sliding_window=window, model_type=model_type,
                                surrogate_dir=surrogates[model_type], compaction_slack=slack)
    recorder = Recorder(press)
    ids = prompt_ids(tokenizer, prompt_length)
    _, cache = greedy(model, ids, press=press, max_new_tokens=101)
    _, full_cache = greedy(model, ids, max_new_tokens=1)
    total = prompt_length + 100
    evicted = 0
    for layer_idx, layer in enumerate(cache.layers):
        scores = recorder.all_scores(layer_idx)
        assert scores.shape[-1] == total
        keep = reference.dms_keep(scores, 0.0, window)
        assert kept_positions(layer) == expected_positions(keep)
        assert all(set(range(max(0, total - window), total)) <= kept for kept in kept_positions(layer)[0])
        evicted += int((~keep).sum())
        # compaction: the layer is at most `slack` - 1 slots longer than its longest head
        assert layer.keys.shape[-2] - int(keep.sum(-1).max()) < slack
        # prompt slots carry the prompt's keys / values (prefill attention is not changed by the press)
        state = get_state(layer)
        positions, held = state.per_slot["positions"], state.log_weights != -INF
        for h in range(layer.keys.shape[1]):
            slots = torch.nonzero(held[0, h] & (positions[0, h] < prompt_length)).view(-1)
            source = positions[0, h, slots]
            torch.testing.assert_close(layer.keys[0, h, slots], full_cache.layers[layer_idx].keys[0, h, source])
            torch.testing.assert_close(layer.values[0, h, slots], full_cache.layers[layer_idx].values[0, h, source])
    if total > window:
        assert evicted > 0, "the test should exercise evictions"
    ratios = press.layer_compression_ratios
    assert sorted(ratios) == [0, 1]
    heads = model.config.num_key_value_heads
    assert press.compression_ratio == pytest.approx(evicted / (2 * heads * total))


@pytest.mark.parametrize("pass_tokens", [7, 40])
def test_decisions_after_a_pass_of_several_tokens(llama, surrogates, pass_tokens):
    """A later pass of several tokens (kvpress's question, assisted decoding's candidates) between the prompt and
    one-token steps: each of its tokens takes its own absolute position, the DMS rule replayed over every score decides
    the same slots, and all of its tokens count as seen in the compression ratio."""
    model, tokenizer = llama
    press = KVzapThresholdPress(threshold=0.0, sliding_window=16, surrogate_dir=surrogates["mlp"], compaction_slack=1)
    recorder = Recorder(press)
    ids = prompt_ids(tokenizer, 200 + pass_tokens)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(ids[:, :200], past_key_values=cache)
        token = model(ids[:, 200:], past_key_values=cache).logits[:, -1:].argmax(-1)
        for _ in range(30):
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
    total = 200 + pass_tokens + 30
    evicted = 0
    for layer_idx, layer in enumerate(cache.layers):
        keep = reference.dms_keep(recorder.all_scores(layer_idx), 0.0, 16)
        assert keep.shape[-1] == total and get_state(layer).counters["tokens"] == total
        assert kept_positions(layer) == expected_positions(keep)
        evicted += int((~keep).sum())
    assert press.compression_ratio == pytest.approx(evicted / (2 * model.config.num_key_value_heads * total))


def test_decisions_in_a_batch_are_per_row(llama, surrogates):
    model, tokenizer = llama
    ids = torch.cat([prompt_ids(tokenizer, 150), prompt_ids(tokenizer, 170)[:, 20:]], dim=0)
    press = KVzapThresholdPress(threshold=0.0, sliding_window=32, surrogate_dir=surrogates["mlp"],
                                compaction_slack=1)
    recorder = Recorder(press)
    together, cache = greedy(model, ids, press=press, max_new_tokens=30)
    for layer_idx, layer in enumerate(cache.layers):
        keep = reference.dms_keep(recorder.all_scores(layer_idx), 0.0, 32)
        assert kept_positions(layer) == expected_positions(keep)
    alone = torch.cat([greedy(model, row[None], press=KVzapThresholdPress(
        threshold=0.0, sliding_window=32, surrogate_dir=surrogates["mlp"]), max_new_tokens=30)[0] for row in ids])
    assert torch.equal(together, alone)


def test_lower_threshold_keeps_more(llama, surrogates):
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 300)
    previous_ratio, previous_kept = 1.0, None
    for threshold in [3.0, 1.0, 0.0, -1.0, -3.0, -INF]:
        press = KVzapThresholdPress(threshold=threshold, sliding_window=16, surrogate_dir=surrogates["linear"],
                                    model_type="linear")
        _, cache = greedy(model, ids, press=press, max_new_tokens=1)
        kept = [kept_positions(layer) for layer in cache.layers]
        assert press.compression_ratio <= previous_ratio
        if previous_kept is not None:
            assert all(a <= b for layer_a, layer_b in zip(previous_kept, kept) for a, b in zip(layer_a[0], layer_b[0]))
        previous_ratio, previous_kept = press.compression_ratio, kept
    assert press.compression_ratio == 0.0
    assert all(layer.keys.shape[-2] == 300 for layer in cache.layers)


def test_one_press_on_models_of_two_dtypes_scores_each_in_its_own(llama, surrogates):
    """The press converts its surrogate's weights once per (layer, device, dtype) and keeps them: used on a float32
    model and then on a bfloat16 copy, it must score the copy as a new press does."""
    model, tokenizer = llama
    half = copy.deepcopy(model).to(torch.bfloat16)
    ids = prompt_ids(tokenizer, 120)

    def press():
        return KVzapThresholdPress(threshold=0.0, sliding_window=16, surrogate_dir=surrogates["mlp"])

    reused = press()
    greedy(model, ids, press=reused, max_new_tokens=4)
    got, got_cache = greedy(half, ids, press=reused, max_new_tokens=4)
    expected, expected_cache = greedy(half, ids, press=press(), max_new_tokens=4)
    assert torch.equal(got, expected)
    assert [kept_positions(layer) for layer in got_cache.layers] == [kept_positions(layer)
                                                                     for layer in expected_cache.layers]


def test_compression_ratio_is_read_only_and_memory_shrinks(llama, surrogates):
    model, tokenizer = llama
    press = KVzapThresholdPress(threshold=1.0, sliding_window=16, surrogate_dir=surrogates["mlp"])
    assert press.compression_ratio == 0.0  # before any run
    _, cache = greedy(model, prompt_ids(tokenizer, 200), press=press, max_new_tokens=10)
    assert 0.2 < press.compression_ratio < 1.0
    with pytest.raises(AttributeError, match="cannot be set"):
        press.compression_ratio = 0.5
    assert all(layer.keys.shape[-2] < 209 for layer in cache.layers)


def test_decoding_steps_that_only_append_probe_their_new_slots_as_a_full_probe_would(llama, surrogates, monkeypatch):
    """A decoding step that appends (no compaction) extends the value probe by its new slots instead of reading every
    slot again: after every pass, through compactions, a cut of the cache (kvpress's pipeline dropping an answer) and a
    two-token pass, each layer's probe must equal the first value channel of every slot it holds; and a selection
    among the slots two such steps in a row probed must still be refused."""
    model, tokenizer = llama
    press = KVzapThresholdPress(threshold=0.0, sliding_window=8, surrogate_dir=surrogates["mlp"], compaction_slack=5)
    unchanged = []  # per probe, in layer order each pass: the slots it took as they were (0: it read every slot)
    probe_slots = LayerState.probe_slots
    monkeypatch.setattr(LayerState, "probe_slots",
                        lambda state, values, kept: unchanged.append(kept) or probe_slots(state, values, kept))
    cache, layers, slots_before = DynamicCache(), len(model.model.layers), []  # layer 0's slots before each pass
    with torch.no_grad(), press(model):
        token = prompt_ids(tokenizer, 64)
        for step in range(12):
            if step == 7:
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, :-3], layer.values[:, :, :-3]
            if step == 8:
                token = torch.cat([token, token], dim=-1)
            slots_before.append(cache.layers[0].keys.shape[-2] if step else 0)
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
            for layer_idx, layer in enumerate(cache.layers):
                assert torch.equal(get_state(layer).value_probe, layer.values[..., 0]), f"step {step} layer {layer_idx}"
        assert len(unchanged) == 12 * layers
        kept = [unchanged[step * layers] for step in range(12)]  # layer 0's
        assert all(slots in (0, before) for slots, before in zip(kept, slots_before))
        # A compaction read every slot; the pass after the cut and the last two passes extended the probe.
        assert 0 in kept[1:] and kept[7] == slots_before[7] and kept[10] and kept[11]
        layer = cache.layers[0]
        others = [slot for slot in range(layer.keys.shape[-2]) if slot != layer.keys.shape[-2] - 2]
        layer.keys, layer.values = layer.keys[:, :, others], layer.values[:, :, others]
        with pytest.raises(RuntimeError, match="KVzapThresholdPress: another press rearranged the slots"):
            model(token, past_key_values=cache)


# ---------------------------------------------------------------------------------------------------------------
# inside kvpress


@kvpress_hooks.mark
def test_prefill_evicts_what_kvpress_dms_press_masks(llama, surrogates):
    """At prefill (where compression cannot change the hidden states), our press evicts exactly the positions that
    kvpress's DMSPress over kvpress's KVzapPress masks, and DMSPress over our scorer masks the same ones."""
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 180)
    ours = KVzapThresholdPress(threshold=0.0, sliding_window=32, surrogate_dir=surrogates["mlp"])
    _, cache = greedy(model, ids, press=ours, max_new_tokens=1)
    theirs_scorer = kvpress_scorer(model, "mlp", surrogates["mlp"])
    for scorer in (theirs_scorer, KVzapPress(model_type="mlp", surrogate_dir=surrogates["mlp"])):
        dms = DMSPress(press=scorer, threshold=0.0, sliding_window_size=32)
        with torch.no_grad(), dms(model):
            model(ids, past_key_values=DynamicCache())
        for layer_idx, layer in enumerate(cache.layers):
            batch, heads, positions = model.model.layers[layer_idx].self_attn.masked_key_indices
            masked = [[set() for _ in range(2)]]
            for h, p in zip(heads.tolist(), positions.tolist()):
                masked[0][h].add(p)
            assert [[set(range(180)) - kept for kept in row] for row in kept_positions(layer)] == masked
        assert dms.compression_ratio == pytest.approx(ours.compression_ratio)


@pytest.mark.skipif(kvpress_transformers_mismatch() is None, reason="kvpress's hooks run with this transformers")
def test_dms_press_where_kvpress_hooks_cannot_run_says_why(llama, surrogates):
    """Where transformers no longer passes cache_position (5.3 on), DMSPress over our scorer is refused by our
    adapter naming DMSPress and the version mismatch, where it raised a bare KeyError('cache_position')."""
    model, tokenizer = llama
    press = DMSPress(press=KVzapPress(model_type="linear", surrogate_dir=surrogates["linear"]), threshold=0.0)
    with pytest.raises(RuntimeError, match=r"DMSPress: kvpress's hooks read each pass's cache_position, .* kvpress "
                                           r"requires transformers"):
        greedy(model, prompt_ids(tokenizer, 48), press=press, max_new_tokens=1)


@kvpress_hooks.mark
def test_dms_and_adakv_accept_our_scorer_under_generate(llama, surrogates):
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 120)
    theirs_scorer = kvpress_scorer(model, "linear", surrogates["linear"])
    ours_scorer = KVzapPress(model_type="linear", surrogate_dir=surrogates["linear"])
    for make in (lambda s: DMSPress(press=s, threshold=0.0, sliding_window_size=16, decoding=True),
                 lambda s: AdaKVPress(press=s)):
        theirs_scorer.compression_ratio = ours_scorer.compression_ratio = 0.5
        expected, _ = greedy(model, ids, press=make(theirs_scorer), max_new_tokens=12)
        got, _ = greedy(model, ids, press=make(ours_scorer), max_new_tokens=12)
        assert torch.equal(got, expected)


#: kvpress wrappers that never call their scorer's post_init_from_model.
WRAPPERS_SKIPPING_POST_INIT = [
    pytest.param(lambda s: CriticalAdaKVPress(press=s), id="CriticalAdaKVPress"),
    pytest.param(lambda s: PerLayerCompressionPress(press=s, compression_ratios=[0.3, 0.7]),
                 id="PerLayerCompressionPress"),
]


@kvpress_hooks.mark
@pytest.mark.parametrize("wrapper", WRAPPERS_SKIPPING_POST_INIT)
def test_wrappers_that_skip_the_scorers_post_init_load_the_surrogate(llama, surrogates, wrapper):
    """These kvpress wrappers never call their scorer's post_init_from_model, where our scorer loads its surrogate
    (it raised 'no surrogate loaded' under `with press(model):`): it loads at its first score instead, and scores
    as kvpress's own KVzapPress holding the same surrogate."""
    model, tokenizer = llama
    ids = prompt_ids(tokenizer, 96)
    theirs_scorer = kvpress_scorer(model, "linear", surrogates["linear"])
    ours_scorer = KVzapPress(model_type="linear", surrogate_dir=surrogates["linear"])
    theirs_scorer.compression_ratio = ours_scorer.compression_ratio = 0.5
    expected, _ = greedy(model, ids, press=wrapper(theirs_scorer), max_new_tokens=12)
    got, _ = greedy(model, ids, press=wrapper(ours_scorer), max_new_tokens=12)
    assert torch.equal(got, expected)


@kvpress_hooks.mark
@pytest.mark.parametrize("wrapper", WRAPPERS_SKIPPING_POST_INIT)
def test_wrappers_that_skip_the_scorers_post_init_score_a_second_model_with_its_own_surrogate(llama, tmp_path,
                                                                                             monkeypatch, wrapper):
    """A scorer reused through these wrappers on another model kept the first model's surrogate: the packaged one of
    another model name scored it silently, and one of another shape failed in an op or an IndexError. It now scores as
    kvpress's own KVzapPress holding the second model's surrogate, and refuses a surrogate that does not fit."""
    model, tokenizer = llama
    other, _ = make_tiny_llama(seed=1)
    wider, _ = make_tiny_llama(num_key_value_heads=4, seed=2)
    monkeypatch.setattr(kvzap_module, "SURROGATES_DIR", tmp_path)
    for name, each in (("Model-A", model), ("Model-B", other), ("Model-C", wider)):
        monkeypatch.setattr(each.config, "name_or_path", f"SomeOrg/{name}")
    write_surrogate(tmp_path / "Model-A" / "linear", model, "linear", seed=0, scale=4.0)
    write_surrogate(tmp_path / "Model-B" / "linear", other, "linear", seed=5, scale=4.0)
    write_surrogate(tmp_path / "Model-C" / "linear", model, "linear", seed=6)  # 2 kv heads: Model-A's shape
    ids = prompt_ids(tokenizer, 96)
    reused = KVzapPress(compression_ratio=0.5, model_type="linear")
    greedy(model, ids, press=wrapper(reused), max_new_tokens=2)
    theirs = kvpress_scorer(other, "linear", tmp_path / "Model-B" / "linear")
    theirs.compression_ratio = 0.5
    expected, expected_cache = greedy(other, ids, press=wrapper(theirs), max_new_tokens=4)
    got, cache = greedy(other, ids, press=wrapper(reused), max_new_tokens=4)
    assert torch.equal(got, expected)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(cache.layers, expected_cache.layers))
    with pytest.raises(ValueError, match=r"output_dim = 2, expected 4 \(kv heads of the model\)"):
        greedy(wider, ids, press=wrapper(reused), max_new_tokens=1)


def test_pipeline_compresses_prefill_and_decoding(llama, surrogates):
    model, tokenizer = llama
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    press = KVzapThresholdPress(threshold=0.0, sliding_window=8, surrogate_dir=surrogates["mlp"], compaction_slack=1)
    decoding_calls = []
    original = press.compress_decoding

    def counted(*args):
        result = original(*args)
        decoding_calls.append(result is not None)
        return result

    press.compress_decoding = counted
    context = "It is a truth universally acknowledged, that a single man in possession of a good fortune " * 4
    cache = DynamicCache()
    answer = pipe(context, question="who is in want of a wife?", press=press, max_new_tokens=20, cache=cache)
    assert isinstance(answer["answer"], str)
    assert decoding_calls and all(decoding_calls)
    assert 0 < press.compression_ratio < 1


def test_default_model_runs_with_a_random_surrogate(default_model, tmp_path):
    """SmolLM2-135M (30 layers, 576 → 3 kv heads) end to end with a random MLP surrogate of the shipped shape."""
    model, tokenizer = default_model
    write_surrogate(tmp_path / "mlp", model, "mlp", scale=3.0)
    press = KVzapThresholdPress(threshold=0.0, sliding_window=32, surrogate_dir=tmp_path / "mlp")
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 20, return_tensors="pt").input_ids
    _, cache = greedy(model, ids, press=press, max_new_tokens=4)
    assert len(press.layer_compression_ratios) == 30
    assert 0 < press.compression_ratio < 1
    assert press.scorer.kvzap_model.config.hidden_dim == 72


@pytest.mark.default_model_answers
@pytest.mark.parametrize("model_type", ["linear", "mlp"])
def test_shipped_surrogates_answer_the_demo_question_while_pruning(default_model, model_type):
    """The packaged SmolLM2 surrogates (no surrogate_dir) at the default τ on the demo: the hidden fact survives the
    pruning, and a higher τ prunes more of the same prompt."""
    model, tokenizer = default_model
    threshold = kvzap_module.DEFAULT_THRESHOLD
    press = KVzapThresholdPress(model_type=model_type)
    found, answer = answers_hidden_fact(model, tokenizer, press)
    assert found, answer
    assert press.compression_ratio > 0.15, press.layer_compression_ratios
    ids = tokenizer(austen_novel("emma")[:6000], return_tensors="pt").input_ids[:, :1000]
    ratios = []
    for tau in (threshold - 1, threshold + 1):
        looser = KVzapThresholdPress(threshold=tau, model_type=model_type)
        greedy(model, ids, press=looser, max_new_tokens=1)
        ratios.append(looser.compression_ratio)
    assert ratios[0] < ratios[1], ratios
