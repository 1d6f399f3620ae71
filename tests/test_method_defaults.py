"""Each press's defaults are the papers' values, or those ``../shared/docs/methods.md`` fixes where the papers leave
them open: a user who sets nothing runs the method as published. Every value below is quoted from methods.md (the
line is cited), not read from the presses."""

from __future__ import annotations

import dataclasses

import pytest

from kvpress_cpp.presses import GVotePress, KeepKVPress, KVzapThresholdPress, WeightedKVPress, ZSMergePress

#: press → {field: (default, what methods.md says)}.
METHODS_MD = {
    ZSMergePress: {
        "decay": (0.98, "Defaults: λ = 0.98"),
        "alpha": (0.6, "α = 0.6"),
        "residual_slots": (1, "Br = 1 slot unless set"),
        "recent_fraction": (0.4, "Bp = 40% of M (authors' scripts)"),
        "prefill_merge": ("contiguous", "A similarity-driven prefill merge ... is an option, not the default"),
    },
    KeepKVPress: {
        "sinks": (4, "keep 4 sink tokens"),
        "similarity_threshold": (0.8, "if that similarity ≥ 0.8, otherwise it is evicted"),
        "ema_decay": (0.9, "β is not given by the paper: default 0.9"),
        "convex": (False, "eq. 7's ZIP key; the authors' convex form offered as an option"),
        "layer_budgets": ("uniform", "a uniform budget is the default"),
    },
    WeightedKVPress: {
        "sinks": (4, "Defaults from the paper: 4 sinks"),
    },
    KVzapThresholdPress: {
        "sliding_window": (128, "the sliding window of the last w = 128 tokens"),
    },
    GVotePress: {
        "nucleus_p": (0.95, "Defaults p_nuc = 0.95"),
        "num_samples": (8, "S = 8"),
        "future_positions": (512, "averaged over the n_f = 512 positions after the prompt"),
        "sinks": (4, "n_s = 4 sinks"),
        "recent": (0, "a recent window always kept: not in the paper, an option"),
        "budget_queries": (1, "budget from the last prompt query (per-head budgets over the last w: an option)"),
    },
}


@pytest.mark.parametrize("press", list(METHODS_MD), ids=lambda press: press.__name__)
def test_defaults_are_those_of_the_paper_and_methods_md(press):
    defaults = {field.name: field.default for field in dataclasses.fields(press)}
    for name, (value, quoted) in METHODS_MD[press].items():
        assert defaults[name] == value, f"{press.__name__}.{name} defaults to {defaults[name]!r}; methods.md: {quoted}"


@pytest.mark.parametrize("budget", [16, 64, 200])
def test_weightedkv_recent_window_defaults_to_half_the_cache_less_four(budget):
    """methods.md: "Defaults from the paper: 4 sinks, recent window m/2 - 4"."""
    assert WeightedKVPress(cache_size=budget).regions(4 * budget) == (budget, 4, budget // 2 - 4)
