"""Where fetched assets (the default model, the real texts) live, and how they are fetched.

Everything is fetched once, verified, and read offline afterwards. Set ``KVPRESS_CPP_CACHE`` to move the cache.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path


class AssetError(RuntimeError):
    """An asset could not be fetched or failed verification. The message says what to do about it."""


def cache_dir(*parts: str) -> Path:
    """``$KVPRESS_CPP_CACHE/<parts>`` (default ``~/.cache/kvpress_cpp/<parts>``), created if missing."""
    root = Path(os.environ.get("KVPRESS_CPP_CACHE", Path.home() / ".cache" / "kvpress_cpp"))
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run_fetch(command: list[str], what: str, hint: str, cwd: Path | None = None) -> None:
    """Run a fetch command; on failure raise one AssetError naming what was being fetched and what to do."""
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise AssetError(f"could not fetch {what}: {command[0]!r} is not installed. {hint}") from exc
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise AssetError(
            f"could not fetch {what}: `{' '.join(command)}` exited with {result.returncode} "
            f"({' | '.join(tail)}). {hint}"
        )
