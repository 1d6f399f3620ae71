"""The tests that run kvpress's own forward hooks (its presses, wrappers, pipeline decoding and test suite).

Those hooks read the ``cache_position`` transformers passes the attention layers below 5.3, the range kvpress 0.5.5
declares; transformers 5.17 (the GPU machine's, without network) no longer passes it. ``conftest.py`` skips what
carries :data:`mark` there, naming the mismatch (:func:`kvpress_cpp.kvpress_adapters.kvpress_transformers_mismatch`),
so the rest of the suite still runs on such a machine.
"""

from __future__ import annotations

import pytest

mark = pytest.mark.kvpress_hooks


def cases(names, hook_names) -> list:
    """`names` as parameters, those in `hook_names` marked as running kvpress's hooks."""
    return [pytest.param(name, marks=mark) if name in hook_names else name for name in names]


def runnable(names, hook_names) -> list:
    """The `names` that can run here: all, or those outside `hook_names` where the marked tests skip (for work a
    fixture does for every case at once, such as one torchrun launch)."""
    from kvpress_cpp.kvpress_adapters import kvpress_transformers_mismatch

    return [name for name in names if name not in hook_names or not kvpress_transformers_mismatch()]
