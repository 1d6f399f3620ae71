"""Our presses under the names kvpress's evaluation registry knows them by, with kvpress's ``compression_ratio``
(the fraction of the context removed) mapped onto each method's own budget.

kvpress's evaluate.py takes a press object out of ``PRESS_REGISTRY`` and sets ``press.compression_ratio = r`` on it
(for presses that are not one of its special cases). Our presses express the budget as the fraction kept
(``budget`` / ``cache_size`` as a float in (0, 1], of the prompt length), or choose their ratio themselves (GVote).
:func:`evaluation_press` gives each method a press whose ``compression_ratio`` does the mapping:

* budgeted methods (the press's own ``compression_ratio``): setting r stores ``budget = 1 - r``; reading gives
  ``1 - budget``;
* measured methods (``budget=None``): a subclass of the same name ignores the request (logged) where the press
  itself would refuse it; reading gives the ratio the press measured on its last run, which evaluate.py writes to
  the ``compression_ratio`` column of predictions.csv.

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
    # KVzap's budget is its threshold τ (the press default, -3.5); the ratio it reaches is measured.
    "kvzap_linear": Method(lambda: KVzapThresholdPress(model_type="linear"), budget=None),
    "kvzap_mlp": Method(lambda: KVzapThresholdPress(model_type="mlp"), budget=None),
}


@functools.cache
def _measured_class(cls: type) -> type:
    """``cls`` with a ``compression_ratio`` that evaluate.py may set: the request is ignored (logged), the ratio the
    press measured is read."""

    def ignore(self, ratio: float) -> None:
        logger.warning("%s chooses its own compression ratio; the requested %s is ignored (the measured ratio goes to "
                       "predictions.csv)", cls.__name__, ratio)

    return type(cls.__name__, (cls,), {"compression_ratio": property(cls.compression_ratio.fget, ignore,
                                                                     doc=cls.compression_ratio.__doc__),
                                       "__qualname__": cls.__qualname__, "__module__": cls.__module__,
                                       "__doc__": cls.__doc__})


def evaluation_press(method: Method) -> BasePress:
    """A fresh press of ``method`` whose ``compression_ratio`` kvpress's evaluate.py can set and read: budgeted
    presses map it onto their budget themselves (``budget = 1 - compression_ratio``)."""
    press = method.press()
    if press.budget_field != method.budget:
        raise TypeError(f"{type(press).__name__}: its budget field is {press.budget_field!r}, the Method says "
                        f"{method.budget!r}")
    if method.measured:
        press.__class__ = _measured_class(type(press))
    return press


def press_registry() -> dict[str, BasePress]:
    """Name → press, ready to merge into kvpress's ``evaluate_registry.PRESS_REGISTRY``."""
    return {name: evaluation_press(method) for name, method in METHODS.items()}
