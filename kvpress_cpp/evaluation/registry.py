"""Our presses under the names kvpress's evaluation registry knows them by, with kvpress's ``compression_ratio``
(the fraction of the context removed) mapped onto each method's own budget.

kvpress's evaluate.py takes a press object out of ``PRESS_REGISTRY`` and sets ``press.compression_ratio = r`` on it
(for presses that are not one of its special cases). Our presses express the budget as the fraction kept
(``budget`` / ``cache_size`` as a float in (0, 1], of the prompt length), or choose their ratio themselves (GVote).
:func:`evaluation_press` wraps a press class in a subclass of the same name whose ``compression_ratio`` property
does the mapping:

* budgeted methods: setting r stores ``budget = 1 - r``; reading gives ``1 - budget``;
* measured methods (``budget=None``): setting r is ignored (logged), reading gives the ratio the press measured on
  its last run, which evaluate.py writes to the ``compression_ratio`` column of predictions.csv.

Adding a method is one :data:`METHODS` entry.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable

from kvpress.presses.base_press import BasePress

from kvpress_cpp.presses import GVotePress, KeepKVPress, KVzapThresholdPress, WeightedKVPress, ZSMergePress

__all__ = ["Method", "METHODS", "evaluation_press", "press_registry"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Method:
    """One of our methods in the evaluation.

    Attributes:
        press: builds a fresh press (paper defaults) when called with no argument.
        budget: the press field holding the kept fraction (set to 1 - compression_ratio), or None when the press
            chooses its ratio itself and reports it in a read-only ``compression_ratio``.
    """

    press: Callable[[], BasePress]
    budget: str | None

    @property
    def measured(self) -> bool:
        return self.budget is None


METHODS: dict[str, Method] = {
    "zsmerge": Method(ZSMergePress, budget="budget"),
    "keepkv": Method(KeepKVPress, budget="budget"),
    "weightedkv": Method(WeightedKVPress, budget="cache_size"),
    "gvote": Method(GVotePress, budget=None),
    # KVzap's budget is its threshold τ (the press default, -7 for SmolLM2); the ratio it reaches is measured.
    "kvzap_linear": Method(lambda: KVzapThresholdPress(model_type="linear"), budget=None),
    "kvzap_mlp": Method(lambda: KVzapThresholdPress(model_type="mlp"), budget=None),
}


@functools.cache
def _ratio_class(cls: type, budget: str | None) -> type:
    measured = getattr(cls, "compression_ratio", None) if budget is None else None
    if budget is None and not isinstance(measured, property):
        raise TypeError(f"{cls.__name__} has no compression_ratio property to report the ratio it chose; give the "
                        f"Method a budget field instead")

    def get(self) -> float:
        return measured.fget(self) if budget is None else round(1.0 - float(getattr(self, budget)), 9)

    def set(self, ratio: float) -> None:
        if budget is None:
            logger.warning("%s chooses its own compression ratio; the requested %s is ignored (the measured ratio "
                           "goes to predictions.csv)", cls.__name__, ratio)
            return
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"{cls.__name__}: compression_ratio must be in [0, 1), got {ratio}")
        setattr(self, budget, round(1.0 - float(ratio), 9))

    doc = (f"kvpress's fraction of the context removed: 1 - {budget}" if budget else
           "the fraction of the context removed on the last run, measured (setting it has no effect)")
    return type(cls.__name__, (cls,), {"compression_ratio": property(get, set, doc=doc),
                                       "__qualname__": cls.__qualname__, "__module__": cls.__module__,
                                       "__doc__": cls.__doc__})


def evaluation_press(method: Method) -> BasePress:
    """A fresh press of ``method`` whose ``compression_ratio`` kvpress's evaluate.py can set and read."""
    press = method.press()
    press.__class__ = _ratio_class(type(press), method.budget)
    return press


def press_registry() -> dict[str, BasePress]:
    """Name → press, ready to merge into kvpress's ``evaluate_registry.PRESS_REGISTRY``."""
    return {name: evaluation_press(method) for name, method in METHODS.items()}
