"""Tests for kvpress_cpp.train_kvzap: KVzip+ targets against a loop reference, fits, R², kvpress layout, the CLI.

Everything runs on the tiny random models of tests/models.py and synthetic data; never the full training run.
"""

from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch
from torch import nn

from kvpress_cpp import train_kvzap as tk
from kvpress_cpp.presses.kvzap import save_surrogate
from tests.models import ENGLISH_PROSE, make_tiny_llama, make_tiny_qwen3
from tests.threads import intra_op_threads


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: on a shared, oversubscribed CPU, intra-op threads only add spin-waiting (8x slower)."""
    with intra_op_threads(1):
        yield


# ---------------------------------------------------------------------------------------------------------------------
# KVzip+ targets
# ---------------------------------------------------------------------------------------------------------------------


def reference_targets(model, prompt: tk.RepeatPrompt, h_norm: str):
    """Plain loops over layers, query heads, context tokens i and repeated rows j on the model's own returned
    attentions and hidden states (eager, output_attentions / output_hidden_states)."""
    cfg = model.config
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    group = n_heads // n_kv
    with torch.no_grad():
        out = model(prompt.input_ids, output_attentions=True, output_hidden_states=True)
    feats, logs = [], []
    for layer_idx, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        d = attn.head_dim
        residual = out.hidden_states[layer_idx][0]  # input of decoder layer layer_idx
        with torch.no_grad():
            attn_in = layer.input_layernorm(residual)  # (T, D)
            values = attn.v_proj(attn_in)  # (T, H*d)
        probs = out.attentions[layer_idx][0]  # (Hq, T, T)
        h_rows = residual if h_norm == "residual" else attn_in
        s = torch.zeros(len(prompt.context), n_kv, dtype=torch.float64)
        for h in range(n_heads):
            g = h // group
            w_o_h = attn.o_proj.weight[:, h * d : (h + 1) * d].double()  # (D, d)
            for a, i in enumerate(prompt.context):
                v_i = values[i, g * d : (g + 1) * d].double()
                wov = torch.linalg.vector_norm(w_o_h @ v_i)
                for j in prompt.repeat:
                    val = probs[h, j, i].double() * wov / torch.linalg.vector_norm(h_rows[j].double())
                    s[a, g] = max(s[a, g], val)
        feats.append(attn_in[list(prompt.context)])
        logs.append(torch.log(s))
    return torch.stack(feats), torch.stack(logs)


@pytest.mark.parametrize("maker", [make_tiny_llama, make_tiny_qwen3], ids=["llama", "qwen3"])
@pytest.mark.parametrize("h_norm", tk.H_NORMS)
def test_kvzip_plus_targets_match_loop_reference(maker, h_norm):
    model, tokenizer = maker(attn_implementation="eager", num_hidden_layers=3)
    ids = tokenizer.encode(ENGLISH_PROSE[:90], add_special_tokens=False)
    prompt = tk.build_repeat_prompt(tokenizer, ids)
    ref_x, ref_y = reference_targets(model, prompt, h_norm)
    # row_block=7 forces several blocks in the chunked max over rows.
    x, y = tk.kvzip_plus_targets(model, prompt, h_norm=h_norm, row_block=7)
    assert x.shape == (3, len(ids), model.config.hidden_size) and y.shape == (3, len(ids), 2)
    torch.testing.assert_close(x, ref_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-4, atol=1e-4)


def test_kvzip_plus_targets_same_under_sdpa_and_eager(tiny_llama):
    """The hooks form the repeated rows' probabilities themselves: the model's attention implementation (sdpa here,
    never switched) does not change the targets."""
    model, tokenizer = tiny_llama
    assert model.config._attn_implementation == "sdpa"
    prompt = tk.build_repeat_prompt(tokenizer, tokenizer.encode(ENGLISH_PROSE[:60], add_special_tokens=False))
    _, y = tk.kvzip_plus_targets(model, prompt)
    assert model.config._attn_implementation == "sdpa"
    eager, _ = make_tiny_llama(attn_implementation="eager")
    _, y_eager = tk.kvzip_plus_targets(eager, prompt)
    torch.testing.assert_close(y, y_eager, rtol=1e-4, atol=1e-4)


def test_attention_input_norm_is_the_default(tiny_llama):
    """kvpress's KVzipPress(kvzip_plus_normalization=True) convention: h_j is the normalised attention input."""
    model, tokenizer = tiny_llama
    prompt = tk.build_repeat_prompt(tokenizer, tokenizer.encode(ENGLISH_PROSE[:60], add_special_tokens=False))
    _, y_default = tk.kvzip_plus_targets(model, prompt)
    _, y_attention_input = tk.kvzip_plus_targets(model, prompt, h_norm="attention-input")
    _, y_residual = tk.kvzip_plus_targets(model, prompt, h_norm="residual")
    assert torch.equal(y_default, y_attention_input) and not torch.allclose(y_default, y_residual)
    assert tk.parse_args(["--out", "x"]).h_norm == "attention-input"


def test_data_cache_resumes_and_fits_a_stopped_collection(tmp_path, tiny_llama):
    model, tokenizer = tiny_llama
    texts = {"a": ENGLISH_PROSE, "b": ENGLISH_PROSE[::-1]}
    plan = tk.plan_chunks(tokenizer, texts, n_tokens=6 * 20, context_tokens=20, val_fraction=0.3, seed=0)
    assert len(plan.ids) == 6 and sorted(plan.text) == ["a"] * 3 + ["b"] * 3 and sum(plan.is_val) == 2
    cache = tmp_path / "cache"
    settings = {"any": "thing"}
    full = tk.collect_dataset(model, tokenizer, plan, progress=False, cache=cache, settings=settings)
    assert tk.cached_chunks(cache) == 6
    # Stop "after" the first chunks: keep the collected prefix holding one held-out and one training chunk.
    keep = max(plan.is_val.index(True), plan.is_val.index(False)) + 1
    for k in range(keep, 6):
        (cache / f"chunk_{k:05d}.pt").unlink()
    with pytest.raises(ValueError, match=f"holds {keep} of 6 chunks"):
        tk.load_data_cache(cache)
    part, stored_settings, _ = tk.load_data_cache(cache, allow_partial=True)
    assert stored_settings == settings and part.chunk_is_val == plan.is_val[:keep]
    torch.testing.assert_close(part.targets, full.targets[:, : keep * 20], rtol=0, atol=0)
    # Resuming computes only the missing chunks and gives the same data as one uninterrupted run.
    resumed = tk.collect_dataset(model, tokenizer, plan, progress=False, cache=cache, settings=settings)
    torch.testing.assert_close(resumed.targets, full.targets, rtol=1e-6, atol=1e-6)
    assert torch.equal(resumed.features, full.features)
    with pytest.raises(ValueError, match="other settings"):
        tk.collect_dataset(model, tokenizer, plan, progress=False, cache=cache, settings={"other": 1})


def test_repeat_prompt_layout(tiny_llama):
    _, tokenizer = tiny_llama
    ids = tokenizer.encode(ENGLISH_PROSE[:120], add_special_tokens=False)
    prompt = tk.build_repeat_prompt(tokenizer, ids)
    all_ids = prompt.input_ids[0].tolist()
    assert all_ids[prompt.context.start : prompt.context.stop] == ids
    assert all_ids[prompt.repeat.start : prompt.repeat.stop] == ids
    assert prompt.repeat.stop == len(all_ids)
    text = tokenizer.decode(all_ids)
    # Rendered by the chat template: user turn with the instruction, then the assistant's copy.
    user = f"<|im_start|>user\n{ENGLISH_PROSE[:120]}"
    assert text.startswith(user)
    assert tokenizer.decode(all_ids[prompt.context.stop : prompt.repeat.start]) == (
        "\n\nRepeat the previous context exactly.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_sample_chunks_are_exact_length_and_distinct(tiny_llama):
    _, tokenizer = tiny_llama
    chunks = tk.sample_chunks(tokenizer, ENGLISH_PROSE, 4, 40, random.Random(0))
    assert [len(c) for c in chunks] == [40] * 4
    # Spread over the text in order, without overlap: each chunk's text is found after the previous one's end.
    pos = 0
    for chunk in chunks:
        found = ENGLISH_PROSE.find(tokenizer.decode(chunk), pos)
        assert found >= pos
        pos = found + len(tokenizer.decode(chunk))
    with pytest.raises(ValueError, match="too short"):
        tk.sample_chunks(tokenizer, ENGLISH_PROSE[:300], 2, 400, random.Random(0))


# ---------------------------------------------------------------------------------------------------------------------
# Fits and metrics
# ---------------------------------------------------------------------------------------------------------------------


def test_ridge_recovers_linear_map_and_matches_lstsq():
    gen = torch.Generator().manual_seed(0)
    n, d, h = 2000, 24, 3
    x = torch.randn(n, d, generator=gen) * torch.linspace(0.5, 3, d) + 1.5
    w_true = torch.randn(d, h, generator=gen)
    b_true = torch.tensor([-4.0, 1.0, 2.5])
    y = x @ w_true + b_true + 0.01 * torch.randn(n, h, generator=gen)
    w, b = tk.fit_ridge(x, y, lam=0.0)
    torch.testing.assert_close(w, w_true, atol=2e-3, rtol=0)
    torch.testing.assert_close(b, b_true, atol=1e-2, rtol=0)
    # λ = 0: ordinary least squares with an intercept column.
    xa = torch.cat([x, torch.ones(n, 1)], 1).double()
    sol = torch.linalg.lstsq(xa, y.double()).solution
    torch.testing.assert_close(w.double(), sol[:d], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.double(), sol[d], atol=1e-5, rtol=1e-5)
    # λ > 0 with an unpenalised intercept: lstsq on the augmented system [X 1; sqrt(λ) I 0] w = [y; 0].
    lam = 500.0
    w, b = tk.fit_ridge(x, y, lam=lam)
    aug_x = torch.cat([xa, torch.cat([math.sqrt(lam) * torch.eye(d), torch.zeros(d, 1)], 1).double()], 0)
    aug_y = torch.cat([y.double(), torch.zeros(d, h, dtype=torch.float64)], 0)
    sol = torch.linalg.lstsq(aug_x, aug_y).solution
    torch.testing.assert_close(w.double(), sol[:d], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.double(), sol[d], atol=1e-5, rtol=1e-5)
    assert w.norm() < w_true.norm()  # the penalty shrinks


def test_select_ridge_prefers_small_penalty_on_clean_and_large_on_pure_noise():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(600, 40, generator=gen)
    inner = torch.arange(600) >= 500
    clean = x @ torch.randn(40, 2, generator=gen)
    *_, alpha_clean = tk.select_ridge(x, clean, inner, (1e-6, 1e-2, 1.0, 100.0))
    noise = torch.randn(600, 2, generator=gen)
    *_, alpha_noise = tk.select_ridge(x, noise, inner, (1e-6, 1e-2, 1.0, 100.0))
    assert alpha_clean == 1e-6 and alpha_noise == 100.0


def test_mlp_training_reduces_validation_mse_and_beats_linear_on_nonlinear_target():
    gen = torch.Generator().manual_seed(2)
    d, h = 16, 2
    x = torch.randn(3000, d, generator=gen) * 2 + 3  # offset and scale: exercises the folded standardisation
    proj = torch.randn(d, h, generator=gen) / 4
    y = torch.sin(2 * (x - 3) @ proj) + ((x - 3) @ proj) ** 2 - 5
    x_tr, y_tr, x_va, y_va = x[:2500], y[:2500], x[2500:], y[2500:]
    untrained = tk.train_mlp(x_tr, y_tr, hidden_dim=32, epochs=0, seed=0)
    trained = tk.train_mlp(x_tr, y_tr, hidden_dim=32, epochs=20, batch_size=250, lr=1e-2, seed=0)
    with torch.no_grad():
        mse0 = nn.functional.mse_loss(untrained(x_va), y_va)
        mse1 = nn.functional.mse_loss(trained(x_va), y_va)
    w, b = tk.fit_ridge(x_tr, y_tr, 1e-3)
    mse_lin = nn.functional.mse_loss(x_va @ w + b, y_va)
    assert mse1 < 0.2 * mse0
    assert mse1 < 0.5 * mse_lin
    assert isinstance(trained[0], nn.Linear) and isinstance(trained[1], nn.GELU) and trained[0].out_features == 32


def test_mlp_early_stopping_keeps_each_layers_best_epoch():
    gen = torch.Generator().manual_seed(4)
    d = 12
    x = torch.randn(2, 1200, d, generator=gen)
    proj = torch.randn(d, 1, generator=gen)
    y = torch.stack([torch.tanh(x[0] @ proj) * 2, torch.randn(1200, 1, generator=gen)])  # learnable, pure noise
    fit, stop = slice(0, 900), slice(900, 1200)
    kwargs = dict(hidden_dim=64, epochs=12, batch_size=100, lr=1e-2, weight_decay=0.0, seed=0)
    plain = tk.train_mlps(x[:, fit], y[:, fit], **kwargs)
    stopped = tk.train_mlps(x[:, fit], y[:, fit], **kwargs, x_stop=x[:, stop], y_stop=y[:, stop])
    with torch.no_grad():
        for layer in range(2):
            mse_plain = nn.functional.mse_loss(plain[layer](x[layer, stop]), y[layer, stop])
            mse_stopped = nn.functional.mse_loss(stopped[layer](x[layer, stop]), y[layer, stop])
            assert mse_stopped <= mse_plain * (1 + 1e-5)
    assert stopped[0].best_epoch > 0  # the learnable layer improves
    assert stopped[1].best_epoch < 12  # the noise layer overfits: an earlier epoch is better on unseen rows
    assert plain[0].best_epoch == 12


def test_r2_scores_match_direct_formulas():
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(500, 3, generator=gen)
    pred = 0.7 * target + 0.5 * torch.randn(500, 3, generator=gen) + torch.tensor([0.0, 1.0, -2.0])
    pearson2, cod = tk.r2_scores(pred, target)
    for k in range(3):
        p, t = pred[:, k].double().tolist(), target[:, k].double().tolist()
        mp, mt = sum(p) / len(p), sum(t) / len(t)
        cov = sum((a - mp) * (b - mt) for a, b in zip(p, t))
        vp = sum((a - mp) ** 2 for a in p)
        vt = sum((b - mt) ** 2 for b in t)
        assert pearson2[k].item() == pytest.approx(cov**2 / (vp * vt), rel=1e-5)
        sse = sum((a - b) ** 2 for a, b in zip(p, t))
        assert cod[k].item() == pytest.approx(1 - sse / vt, rel=1e-5, abs=1e-6)
    corr = torch.corrcoef(torch.stack([pred[:, 0], target[:, 0]]))[0, 1]
    assert pearson2[0].item() == pytest.approx(corr.item() ** 2, rel=1e-4)
    # A biased predictor: the squared correlation ignores the offset, the coefficient of determination does not.
    assert cod[2] < pearson2[2]



@pytest.mark.parametrize("numel", [999_999, 1_000_001, 17_694_720])
def test_quantiles_of_a_large_target_set_are_the_distributions(numel):
    # 17,694,720 = the 10x training set's targets (ran past a float32 linspace's last index). A uniform ramp's
    # p-quantile is p of its range, whether or not the helper subsamples it.
    values = torch.arange(numel, dtype=torch.float64) / (numel - 1)
    quantiles = tk._quantiles(values)
    for p, q in quantiles.items():
        assert q == pytest.approx(float(p), abs=2e-6)

# ---------------------------------------------------------------------------------------------------------------------
# kvpress layout
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden_dim", [None, 8])
def test_kvzap_model_round_trip(tmp_path, hidden_dim):
    from kvpress.presses.kvzap_press import KVzapModel

    torch.manual_seed(0)
    if hidden_dim is None:
        layers = [nn.Linear(64, 2) for _ in range(3)]
    else:
        layers = [nn.Sequential(nn.Linear(64, 8), nn.GELU(), nn.Linear(8, 2)) for _ in range(3)]
    model = tk.build_kvzap_model(layers, hidden_dim)
    save_surrogate(model, tmp_path)
    assert (tmp_path / "config.json").is_file() and (tmp_path / "model.safetensors").is_file()
    loaded = KVzapModel.from_pretrained(tmp_path)
    assert loaded.config.hidden_dim == hidden_dim and loaded.config.n_modules == 3
    x = torch.randn(5, 3, 64)  # KVzapModel.forward: (T, L, D) -> (T, L, H)
    with torch.no_grad():
        expected = torch.stack([layer(x[:, i]) for i, layer in enumerate(layers)], dim=1)
        torch.testing.assert_close(loaded(x), expected, rtol=0, atol=0)
    assert all(p.dtype == torch.float32 for p in loaded.parameters())


# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,message", [
    (["--context-tokens", "0"], "--context-tokens must be an integer >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
    (["--epochs", "0"], "--epochs must be an integer >= 1, got 0"),
    (["--val-fraction", "0"], r"--val-fraction must be in \(0, 1\), got 0.0"),
    (["--tokens", "256", "--context-tokens", "128"], r"gives 2 text\(s\) \[1, 1\] chunk\(s\) .* --tokens >= 512"),
    (["--fit-collected"], "--fit-collected fits the chunks saved in --data-cache, which is not given"),
    (["--compare-with", "/nonexistent"], "--compare-with /nonexistent: expected surrogates in linear, mlp/"),
    # AdamW refused these, and huggingface_hub the path, or load_text the file, after the collection or the model load
    (["--lr", "-1"], r"--lr must be a finite number > 0, got -1.0"),
    (["--lr", "0"], r"--lr must be a finite number > 0, got 0.0"),
    (["--weight-decay", "-5"], r"--weight-decay must be a finite number >= 0, got -5.0"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such directory"),
    (["--texts", "austen,/nonexistent/text.txt"], r"--texts: \['/nonexistent/text.txt'\] are neither austen, "),
    # a FileNotFoundError for index.json, and a FileExistsError for --out
    (["--fit-collected", "--data-cache", "/nonexistent"], "--data-cache /nonexistent: no collection there"),
    (["--out", __file__], "--out .*test_kvzap_training.py: not a directory"),
])
def test_cli_refuses_what_would_fail_after_the_collection(capsys, extra, message):
    """Each of these failed (a ZeroDivisionError, an empty held-out set's quantile, a hub lookup of the missing
    directory) or wrote an untrained surrogate (0 epochs) only after the model load and collection, or was ignored
    (--fit-collected alone): refused up front by the parser, naming the option."""
    with pytest.raises(SystemExit):
        tk.parse_args(["--out", "x", *extra])
    assert re.search(message, capsys.readouterr().err)


# CLI end to end
# ---------------------------------------------------------------------------------------------------------------------


def test_cli_refuses_a_text_file_without_text_naming_it(tmp_path, capsys):
    """An empty file failed after the model load as "the text is too short ... (chunk 0 has 0)", a file not in
    UTF-8 with a bare UnicodeDecodeError; neither named the file."""
    empty, binary = tmp_path / "empty.txt", tmp_path / "binary.txt"
    empty.write_text("\n  \n")
    binary.write_bytes(ENGLISH_PROSE.encode()[:100] + b"\xff\xfe\x00" + ENGLISH_PROSE.encode()[100:200])
    for path, problem in ((empty, "the file holds no text"),
                          (binary, r"not UTF-8 text \(invalid start byte at byte 100\)")):
        with pytest.raises(SystemExit):
            tk.parse_args(["--out", "x", "--texts", f"austen,{path}"])
        assert re.search(rf"--texts {path}: {problem}", capsys.readouterr().err)
        with pytest.raises(ValueError, match=rf"train_kvzap: --texts {path}: {problem}"):
            tk.load_text(str(path))
    with pytest.raises(ValueError, match=r"train_kvzap: text 'short' is too short for 2 chunks of 400 tokens"):
        tk.plan_chunks(make_tiny_llama()[1], {"short": ENGLISH_PROSE[:300]}, 800, 400, 0.5, 0)


def test_cli_refuses_surrogates_to_compare_of_another_shape_before_collecting(tmp_path, monkeypatch, capsys):
    """--compare-with surrogates of another model passed the parser (their files exist) and failed in the R² after
    the collection and the fit, with nothing saved."""
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

    model, tokenizer = make_tiny_llama()  # 2 layers, hidden size 64, 2 kv heads
    other = tmp_path / "other"
    for kind, hidden_dim in (("linear", None), ("mlp", 8)):
        save_surrogate(KVzapModel(KVzapConfig(input_dim=64, output_dim=3, n_modules=2, hidden_dim=hidden_dim)),
                       other / kind)
    monkeypatch.setattr(tk, "collect_dataset", lambda *args: pytest.fail("collected before refusing"))
    with pytest.raises(ValueError, match=rf"train_kvzap: --compare-with {other}: KVzap: the surrogate in "
                                         rf"{other / 'linear'} has output_dim = 3, expected 2 \(kv heads"):
        tk.main(["--model", "tiny", "--texts", "austen", "--out", str(tmp_path / "out"), "--tokens", "240",
                 "--context-tokens", "60", "--no-progress", "--compare-with", str(other)],
                model=model, tokenizer=tokenizer)
    (other / "mlp" / "model.safetensors").unlink()  # (the parser looked for config.json only)
    with pytest.raises(SystemExit):
        tk.parse_args(["--out", "x", "--compare-with", str(other)])
    expected = f"--compare-with {other}: expected surrogates in mlp/ (config.json + model.safetensors"
    assert expected in capsys.readouterr().err




def test_data_cache_of_an_edited_text_file_is_refused(tmp_path):
    """--data-cache was keyed by the texts' names: after the file was edited, a rerun fitted the old file's targets
    silently (complete cache) or mixed both files' chunks (resumed cache). Both are refused now, naming the texts'
    digests; a text file gone since a complete collection still refits from the cache."""
    model, tokenizer = make_tiny_llama(attn_implementation="eager")
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    paragraphs = ENGLISH_PROSE.split("\n\n")
    text = tmp_path / "prose.txt"
    text.write_text("\n\n".join(paragraphs * 3))
    cache = tmp_path / "data"
    argv = ["--model", str(model_dir), "--texts", str(text), "--out", str(tmp_path / "out"), "--tokens", "240",
            "--context-tokens", "60", "--epochs", "1", "--no-progress", "--data-cache", str(cache)]
    tk.main(argv)
    text.write_text("\n\n".join(paragraphs[::-1] * 3))
    with pytest.raises(ValueError, match="collected with other text_sha256"):
        tk.main(argv)
    tk._chunk_file(cache, 3).unlink()  # as a stopped collection leaves it, to be resumed
    with pytest.raises(ValueError, match="holds chunks for other settings"):
        tk.main(argv)
    tk.main(argv[:-2] + ["--data-cache", str(tmp_path / "data2")])
    text.unlink()
    assert tk.main(argv[:-2] + ["--data-cache", str(tmp_path / "data2")])["data"]["chunks"] == 4


def test_cli_end_to_end_on_tiny_model(tmp_path):
    from kvpress.presses.kvzap_press import KVzapModel

    model, tokenizer = make_tiny_llama(attn_implementation="eager")
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    paragraphs = ENGLISH_PROSE.split("\n\n")
    texts = [tmp_path / "prose_a.txt", tmp_path / "prose_b.txt"]
    texts[0].write_text("\n\n".join(paragraphs[:2] * 3))
    texts[1].write_text("\n\n".join(paragraphs[2:] * 3))
    out = tmp_path / "out"
    cache = tmp_path / "data.pt"
    argv = [
        "--model", str(model_dir), "--texts", f"{texts[0]},{texts[1]}", "--out", str(out), "--tokens", "480",
        "--context-tokens", "60", "--epochs", "2", "--seed", "0", "--no-progress", "--data-cache", str(cache),
    ]  # fmt: skip
    report = tk.main(argv)
    assert report["data"]["chunks"] == 8 and report["data"]["chunks_val"] == 2
    assert report["data"]["tokens_train"] + report["data"]["tokens_val"] == 480
    saved = json.loads((out / "training_report.json").read_text())
    assert set(saved["summary"]) == {"linear", "mlp"} and len(saved["r2"]["mlp"]) == 2
    assert (out / "r2_per_layer.png").stat().st_size > 0
    lin = KVzapModel.from_pretrained(out / "linear")
    mlp = KVzapModel.from_pretrained(out / "mlp")
    assert lin.config.hidden_dim is None and mlp.config.hidden_dim == 64 // 8
    assert (lin.config.input_dim, lin.config.output_dim, lin.config.n_modules) == (64, 2, 2)
    # The saved MLP reproduces the R² recorded in the report on the held-out chunks.
    data, settings, _ = tk.load_data_cache(cache)
    assert settings["context_tokens"] == 60 and data.features.shape == (2, 480, 64)
    val = data.token_mask(val=True)
    with torch.no_grad():
        pred = mlp(data.features[:, val].float().transpose(0, 1)).transpose(0, 1)  # (L, N, H)
    for layer in range(2):
        r2, _ = tk.r2_scores(pred[layer], data.targets[layer, val])
        assert r2.tolist() == pytest.approx(saved["r2"]["mlp"][layer], abs=1e-3)
    # Re-running from the cache with the same seed reproduces the weights exactly.
    # --compare-with scores other surrogates (here the first run's) on the same held-out chunks.
    report2 = tk.main(argv[:5] + [str(tmp_path / "out2")] + argv[6:] + ["--compare-with", str(out)])
    mlp2 = KVzapModel.from_pretrained(tmp_path / "out2" / "mlp")
    for p, q in zip(mlp.parameters(), mlp2.parameters()):
        assert torch.equal(p, q)
    for kind in ("linear", "mlp"):
        layer_means = [sum(row) / len(row) for row in saved["r2"][kind]]
        assert report2["compared"][kind]["r2_layer_mean"] == pytest.approx(layer_means, abs=1e-3)


# ---------------------------------------------------------------------------------------------------------------------
# Data split, chunk sampling, floor, fold of the standardisation, and what train_surrogates fits on
# ---------------------------------------------------------------------------------------------------------------------


def _numbered_text(lines: int) -> str:
    """Text whose every line is unique (so a chunk's decoded text is found at exactly one place)."""
    words = ENGLISH_PROSE.split()
    return "\n".join(f"Line {i} says {words[i % len(words)]} and {words[(7 * i) % len(words)]}." for i in range(lines))


def test_sample_chunks_never_overlap_when_segments_have_room(tiny_llama):
    """Each segment holds 8 characters per token of room beyond its chunk's start window: for any seed, the chunks
    are disjoint and in text order."""
    _, tokenizer = tiny_llama
    text = _numbered_text(1500)
    n_chunks, context_tokens = 4, 40
    assert len(text) // n_chunks > 2 * 8 * context_tokens
    for seed in range(12):
        chunks = tk.sample_chunks(tokenizer, text, n_chunks, context_tokens, random.Random(seed))
        spans = []
        for chunk in chunks:
            piece = tokenizer.decode(chunk)
            assert text.count(piece) == 1, piece
            start = text.index(piece)
            spans.append((start, start + len(piece)))
        for (_, end), (next_start, _) in zip(spans, spans[1:]):
            assert end <= next_start, (seed, spans)


@pytest.mark.parametrize("val_fraction", [0.5, 0.9, 0.99])
def test_plan_chunks_keeps_training_and_held_out_chunks_of_every_text(tiny_llama, val_fraction):
    """The CLI accepts any --val-fraction in (0, 1): each text keeps at least one held-out and one training chunk."""
    _, tokenizer = tiny_llama
    texts = {"a": ENGLISH_PROSE, "b": ENGLISH_PROSE[::-1]}
    plan = tk.plan_chunks(tokenizer, texts, n_tokens=4 * 20, context_tokens=20, val_fraction=val_fraction, seed=0)
    for name in texts:
        flags = [v for t, v in zip(plan.text, plan.is_val) if t == name]
        assert len(flags) == 2 and sum(flags) == 1, (name, flags)


def test_kvzip_plus_targets_are_floored():
    """Attention so peaked that most probabilities underflow: every target is max(log s, log SCORE_FLOOR), the score
    computed in float64 from the model's own logits (a plain loop over the repeated rows)."""
    model, tokenizer = make_tiny_llama(attn_implementation="eager")
    for layer in model.model.layers:
        layer.self_attn.scaling = 40.0  # logit gaps of hundreds of nats
    ids = tokenizer.encode(ENGLISH_PROSE[:60], add_special_tokens=False)
    prompt = tk.build_repeat_prompt(tokenizer, ids)
    _, y = tk.kvzip_plus_targets(model, prompt)
    floor = math.log(torch.finfo(torch.float32).tiny)
    # Reference: log a_ji from the logits in float64 (no underflow), then the same max as the loop reference.
    captured = {}
    hooks = [layer.self_attn.register_forward_hook(
        lambda m, a, k, o, i=i: captured.__setitem__(i, k["hidden_states"][0]), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            out = model(prompt.input_ids, output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    ref = torch.empty(len(model.model.layers), len(ids), cfg.num_key_value_heads, dtype=torch.float64)
    for li, layer in enumerate(model.model.layers):
        attn, x = layer.self_attn, captured[li]
        d, T = attn.head_dim, x.shape[0]
        with torch.no_grad():
            cos, sin = model.model.rotary_emb(x[None], torch.arange(T)[None])
            q = attn.q_proj(x).view(T, -1, d).transpose(0, 1)[None]
            k = attn.k_proj(x).view(T, -1, d).transpose(0, 1)[None]
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            v = attn.v_proj(x).double()
        q, k = q[0].double(), k[0].double().repeat_interleave(group, 0)
        logits = q @ k.transpose(1, 2) * attn.scaling
        logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        log_a = logits - logits.logsumexp(-1, keepdim=True)  # (Hq, T, T)
        log_h = x.double().norm(dim=-1).log()
        for g in range(cfg.num_key_value_heads):
            for a, i in enumerate(prompt.context):
                best = -math.inf
                for h in range(g * group, (g + 1) * group):
                    head_out = attn.o_proj.weight[:, h * d:(h + 1) * d].detach().double()
                    wov = (head_out @ v[i, g * d:(g + 1) * d]).norm().log()
                    rows = list(prompt.repeat)
                    best = max(best, float((log_a[h, rows, i] - log_h[rows]).max() + wov))
                ref[li, a, g] = max(best, floor)
    assert (ref == floor).float().mean() > 0.1  # the case the floor is for
    assert out.attentions[0].min() == 0  # (the model's own float32 probabilities do underflow)
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("scale,shift", [(100.0, -30.0), (0.01, 5.0)])
def test_trained_mlp_maps_raw_targets_whatever_their_scale(scale, shift):
    """Targets are standardised for training and the standardisation folded back into the weights: training on
    scale * y + shift gives scale * (the MLP trained on y) + shift."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 400, 6, generator=gen) * 3 + 1
    y = torch.tanh(x @ torch.randn(6, 2, generator=gen)) + 0.5
    kwargs = dict(hidden_dim=8, epochs=2, batch_size=100, lr=1e-2, seed=0)
    base = tk.train_mlps(x, y, **kwargs)
    moved = tk.train_mlps(x, scale * y + shift, **kwargs)
    with torch.no_grad():
        for layer in range(2):
            torch.testing.assert_close(moved[layer](x[layer]), scale * base[layer](x[layer]) + shift,
                                       rtol=1e-3, atol=1e-3 * scale)


def test_mlp_best_epoch_counts_epochs_from_one():
    """best_epoch is the number of epochs trained for the weights kept; 0 means the initial weights."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 600, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen)  # learnable: one epoch improves on the random init
    kwargs = dict(hidden_dim=16, epochs=1, batch_size=50, lr=1e-2, seed=0)
    (plain,) = tk.train_mlps(x[:, :500], y[:, :500], **kwargs)
    (stopped,) = tk.train_mlps(x[:, :500], y[:, :500], **kwargs, x_stop=x[:, 500:], y_stop=y[:, 500:])
    assert stopped.best_epoch == 1
    for p, q in zip(plain.parameters(), stopped.parameters()):
        assert torch.equal(p, q)  # the one epoch's weights were kept


def _synthetic_dataset(n_chunks, is_val, per_chunk=40, dim=8, heads=2, layers=2, seed=7):
    gen = torch.Generator().manual_seed(seed)
    n = n_chunks * per_chunk
    x = torch.randn(layers, n, dim, generator=gen) * torch.linspace(0.5, 2.0, dim) + 1.0
    w_train, w_val = torch.randn(dim, heads, generator=gen), torch.randn(dim, heads, generator=gen)
    chunk = torch.arange(n_chunks).repeat_interleave(per_chunk)
    val_rows = torch.tensor(is_val)[chunk]
    # Held-out chunks follow another map: a fit that saw them would not be the training rows' fit.
    y = torch.where(val_rows[None, :, None], x @ w_val - 3.0, x @ w_train + 2.0)
    y = y + 0.3 * torch.randn(layers, n, heads, generator=gen)
    return tk.Dataset(x.half(), y, chunk, ["t"] * n_chunks, list(is_val))


def test_train_surrogates_linear_is_the_ridge_fit_of_all_training_chunks_only():
    """The linear surrogate of each layer is the closed-form ridge fit (unpenalised intercept) on every training chunk
    and no held-out one, with λ = α · trace(Xcᵀ Xc) / D as reported."""
    is_val = [k % 4 == 3 for k in range(16)]
    data = _synthetic_dataset(16, is_val)
    alpha = 0.05
    linears, _, metrics = tk.train_surrogates(data, hidden_dim=4, epochs=1, batch_size=128, lr=1e-3,
                                              weight_decay=0.0, seed=0, ridge_alphas=(alpha,), progress=False)
    train_rows = ~torch.tensor(is_val)[data.chunk]
    for layer in range(2):
        x = data.features[layer, train_rows].double()
        y = data.targets[layer, train_rows].double()
        xc = x - x.mean(0)
        lam = alpha * float((xc * xc).sum()) / x.shape[1]
        assert metrics["ridge_alpha"][layer] == alpha
        assert metrics["ridge_lambda"][layer] == pytest.approx(lam, rel=1e-5, abs=1e-6)
        d = x.shape[1]
        aug_x = torch.cat([torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], 1),
                           torch.cat([math.sqrt(lam) * torch.eye(d, dtype=torch.float64),
                                      torch.zeros(d, 1, dtype=torch.float64)], 1)])
        aug_y = torch.cat([y, torch.zeros(d, y.shape[1], dtype=torch.float64)])
        sol = torch.linalg.lstsq(aug_x, aug_y).solution
        torch.testing.assert_close(linears[layer].weight.double(), sol[:d].T, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(linears[layer].bias.double(), sol[d], rtol=1e-4, atol=1e-4)


def _noise_dataset(seed: int, n_chunks: int, per_chunk: int, dim: int, training_chunks: int) -> tk.Dataset:
    """Features and targets of pure noise, one layer and one head: the first `training_chunks` chunks for training,
    the rest held out."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n_chunks * per_chunk, dim, generator=gen)
    y = torch.randn(1, n_chunks * per_chunk, 1, generator=gen)
    is_val = [k >= training_chunks for k in range(n_chunks)]
    return tk.Dataset(x.half(), y, torch.arange(n_chunks).repeat_interleave(per_chunk), ["t"] * n_chunks, is_val)


def test_train_surrogates_early_stops_the_mlp_on_unseen_training_chunks():
    """Pure-noise targets: an MLP judged on rows it does not train on is best early (the overfit later epochs do worse
    there); judged on rows it also trains on, the late, memorising epochs would look best."""
    data = _noise_dataset(seed=8, n_chunks=20, per_chunk=20, dim=32, training_chunks=17)
    epochs = 30
    _, _, metrics = tk.train_surrogates(data, hidden_dim=256, epochs=epochs, batch_size=50, lr=1e-2,
                                        weight_decay=0.0, seed=0, ridge_alphas=(1e-3,), progress=False)
    assert metrics["mlp_best_epoch"][0] < epochs // 2


@pytest.mark.parametrize("seed", range(4))
def test_train_surrogates_picks_ridge_penalty_on_training_chunks(seed):
    """Few training chunks, many held-out ones, pure-noise targets: λ is chosen on an inner split of the training
    chunks (the held-out ones never take part), where the largest penalty predicts noise best."""
    data = _noise_dataset(seed=9, n_chunks=24, per_chunk=30, dim=16, training_chunks=4)
    _, _, metrics = tk.train_surrogates(data, hidden_dim=4, epochs=1, batch_size=128, lr=1e-3, weight_decay=0.0,
                                        seed=seed, ridge_alphas=(1e-6, 1e3), progress=False)
    assert metrics["ridge_alpha"] == [1e3]
