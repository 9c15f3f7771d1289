"""Cleaning up after tests that load model files of their own."""

from __future__ import annotations

import shutil
from pathlib import Path

from tokenmill.weights.cache_paths import weights_cache_root


def drop_weights_caches(path: Path) -> None:
    """Remove what loading a test's own model file left in the user's cache (its dequantized weights,
    codes, calibration): ~400 MB for the Q8_0 file of conftest.py, which piled up over test runs while
    the caches were keyed by the file's path (now by its contents, so a run's would be found by the
    next, but a test run should not leave it in the user's cache)."""
    shutil.rmtree(weights_cache_root(path, None), ignore_errors=True)
