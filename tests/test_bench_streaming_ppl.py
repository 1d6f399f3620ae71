"""The statistics of ``benchmarks/bench_streaming_ppl.py`` and its StreamingLLM baseline, without the model: the block
sums and paired block bootstrap its intervals come from, the windows' snap to a paragraph start, and the order-kept
StreamingLLM, which must hold the sinks and the last tokens however many times it compresses (kvpress's
StreamingLLMPress under DecodingPress shuffles its cache, then evicts by slot index)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from kvpress import DecodingPress

from benchmarks.bench_streaming_ppl import OrderedStreamingLLMPress, block_sums, paired_bootstrap, paragraph_start


def draws(blocks: int, resamples: int = 500) -> torch.Tensor:
    return torch.randint(blocks, (resamples, blocks), generator=torch.Generator().manual_seed(0))


def test_block_sums_cover_the_tokens_beyond_start_and_the_last_block_may_be_short():
    nll = torch.arange(10, dtype=torch.float64)
    assert block_sums(nll, 3, 3).tolist() == [3 + 4 + 5, 6 + 7 + 8, 9]
    assert block_sums(nll, 10, 3).numel() == 0


def test_paired_bootstrap_is_the_pooled_mean_difference_with_an_interval_around_it():
    g = torch.Generator().manual_seed(1)
    reference = torch.rand(3, 100, dtype=torch.float64, generator=g)
    noise = 0.05 * torch.randn(3, 100, dtype=torch.float64, generator=g)
    nll = reference + 0.1 + noise
    blocks = 3 * len(range(30, 100, 32))  # 3 windows, blocks of 32, 22 and 6 tokens beyond 30
    result = paired_bootstrap(nll, reference, 30, 32, draws(blocks))
    assert result["nats_per_token"] == pytest.approx((0.1 + noise[:, 30:]).mean().item(), abs=1e-4)
    lo, hi = result["ci95"]
    assert lo < result["nats_per_token"] < hi and hi - lo < 0.05
    # A constant shift is the same in every resample: an interval of width 0, at the shift.
    shifted = paired_bootstrap(reference + 0.25, reference, 30, 32, draws(blocks))
    assert shifted["nats_per_token"] == pytest.approx(0.25) and shifted["ci95"] == pytest.approx([0.25, 0.25])
    # Paired: the reference's own variation between windows does not widen the interval.
    offset = reference + torch.tensor([[0.0], [5.0], [-5.0]], dtype=torch.float64)
    assert paired_bootstrap(offset + 0.1 + noise, offset, 30, 32, draws(blocks))["ci95"] == pytest.approx([lo, hi])


def test_windows_open_at_a_paragraph_start():
    text = "Title\n\nfirst line\nsecond line\n\n\nNext paragraph\nmore\n"
    assert paragraph_start(text, 0) == 0
    assert text[paragraph_start(text, 3):].startswith("first line")
    assert text[paragraph_start(text, 12):].startswith("Next paragraph")  # past the extra blank line
    assert text[paragraph_start(text, text.index("more") - 2):].startswith("more")  # no blank line left: a line start


def test_order_kept_streamingllm_holds_the_sinks_and_the_last_tokens():
    """Slot i of the fake cache holds position i in every coordinate; DecodingPress solves each step's ratio."""
    m, head_dim = 32, 4
    press, decoding = OrderedStreamingLLMPress(), DecodingPress(base_press=OrderedStreamingLLMPress(), target_size=m)
    module = SimpleNamespace(head_dim=head_dim)
    keys = torch.arange(16.0)[None, None, :, None].expand(1, 3, 16, head_dim)
    for t in range(16, 100):
        keys = torch.cat([keys, torch.full((1, 3, 1, head_dim), float(t))], dim=2)
        press.compression_ratio = decoding._find_target_compression_ratio(keys.shape[2], m)
        keys, _ = press.compress(module, None, keys, keys, None, {})
    held = keys[0, :, :, 0]
    assert (held == torch.cat([torch.arange(4.0), torch.arange(100.0 - (m - 4), 100.0)])).all()


@pytest.mark.parametrize("methods", [["full", "ZSMerge"], ["full", "ZSMerge", "StreamingLLM (kvpress)"]])
def test_the_difference_panel_shows_every_press_with_or_without_streamingllm(tmp_path, monkeypatch, methods):
    """Without StreamingLLM among --methods the left panel, titled against it, drew nothing while the table printed
    each press against the full cache: it now shows those differences, titled so."""
    from benchmarks import bench_streaming_ppl, common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    difference = {"nats_per_token": 0.1, "ci95": [0.05, 0.15]}
    rows = []
    for method in methods:
        row = {"method": method, "cache_size": None if method == "full" else 32, "checkpoints": [16, 32],
               "cumulative_ppl": [40.0, 42.0]}
        if method != "full":
            row["diff_vs_full"] = difference
            row["diffs"] = {other: difference for other in methods if other.startswith("StreamingLLM")}
        rows.append(row)
    captured = {}
    monkeypatch.setattr(bench_streaming_ppl, "save_figure", lambda fig, name: captured.setdefault("fig", fig))
    bench_streaming_ppl.plot(rows, "title", "name")
    bars = captured["fig"].axes[0]
    reference = "StreamingLLM" if len(methods) == 3 else "the full cache"
    assert f"difference vs {reference}" in bars.get_title()
    plotted = [container.lines[0] for container in bars.containers]
    assert "ZSMerge" in [label.get_text() for label in bars.get_yticklabels()] and bars.get_legend() is not None
    assert 0.1 in [x for line in plotted for x in line.get_xdata()]  # ZSMerge's difference, at its row


def test_paired_bootstrap_interval_is_the_percentiles_of_resampled_blocks_recomputed_by_hand():
    """The interval written out from its definition: every window's tokens at positions >= start cut into blocks of
    `block` (the last one shorter), each draw's difference its blocks' summed NLL differences over their summed
    tokens, the 2.5th and 97.5th percentiles (linear interpolation) over the draws."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    windows, tokens, start, block = 2, 61, 20, 8  # 41 tokens beyond start a window: blocks of 8 x 5 and 1
    nll = torch.rand(windows, tokens, dtype=torch.float64, generator=g) * 3
    reference = torch.rand(windows, tokens, dtype=torch.float64, generator=g) * 3
    blocks_by_hand = []  # (summed difference, tokens), window after window
    for w in range(windows):
        for first in range(start, tokens, block):
            last = min(first + block, tokens)
            blocks_by_hand.append((sum(nll[w, t].item() - reference[w, t].item() for t in range(first, last)),
                                   last - first))
    assert [n for _, n in blocks_by_hand] == [8] * 5 + [1] + [8] * 5 + [1]
    resamples = draws(len(blocks_by_hand), 400)
    per_draw = [sum(blocks_by_hand[i][0] for i in row) / sum(blocks_by_hand[i][1] for i in row)
                for row in resamples.tolist()]
    lo, hi = np.percentile(per_draw, [2.5, 97.5])
    mean = sum(d for d, _ in blocks_by_hand) / sum(n for _, n in blocks_by_hand)
    result = paired_bootstrap(nll, reference, start, block, resamples)
    assert result["nats_per_token"] == pytest.approx(mean, abs=1e-4)
    assert result["ci95"] == pytest.approx([lo, hi], abs=1e-4)


def test_perplexity_is_the_exponential_of_the_mean_nll():
    from benchmarks.bench_streaming_ppl import perplexity

    nll = torch.tensor([0.5, 1.0, 4.5], dtype=torch.float64)
    assert perplexity(nll) == pytest.approx(math.exp((0.5 + 1.0 + 4.5) / 3))
    assert math.isnan(perplexity(nll[:0]))
