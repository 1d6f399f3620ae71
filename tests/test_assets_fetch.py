"""kvpress_cpp._cache.run_fetch: a fetch that fails, however it fails, raises one AssetError saying why."""

from __future__ import annotations

import pytest

from kvpress_cpp._cache import AssetError, run_fetch


def test_a_fetch_killed_by_a_signal_is_a_failure():
    """A negative return code (the command killed by a signal: out of memory, a timeout's kill) is no success."""
    with pytest.raises(AssetError, match="could not fetch the thing"):
        run_fetch(["sh", "-c", "kill -9 $$"], "the thing", "Try again.")


def test_the_error_shows_what_the_command_said_on_stderr():
    """The last lines of stderr, where a fetch tool reports its error, even when it printed progress on stdout."""
    with pytest.raises(AssetError) as raised:
        run_fetch(["sh", "-c", "echo progress 10%; echo 'fatal: no such revision' >&2; exit 2"], "the thing",
                  "Try again.")
    message = str(raised.value)
    assert "exited with 2 (fatal: no such revision)." in message and message.endswith("Try again.")
