"""Where tokenmill keeps files between runs (one place that reads the environment for it)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/tokenmill, else ~/.cache/tokenmill: dequantized weights, compiled kernels."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenmill"
