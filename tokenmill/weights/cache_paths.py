"""Where what is derived from a checkpoint is cached: the dequantized tensors of a GGUF file, with its
config and tokenizer, per dtype and layout; its 4-bit and 8-bit codes; int8's calibration maxima.

Kept apart from weights/loader.py and free of PyTorch, so that a frontend process (the API server, a
router, `tokenmill bench`) finds the tokenizer without importing torch (~180 MB resident).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tokenmill.paths import default_cache_dir

CACHE_FORMAT = 2  # bump when the cached layout changes (2: config.json in Hugging Face form)


def dtype_cache_path(path: Path, dtype_name: str, cache_dir: Path) -> Path:
    """A GGUF file's cache for one dtype ("float32", "bfloat16"): keyed by the file's path, size and
    time, so a changed file gets a new folder; each layout's tensors in a folder below."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CACHE_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir / f"{path.stem}-{digest}" / dtype_name


def weights_cache_root(path: Path, cache_dir: Path | None) -> Path:
    """The cache folder of one checkpoint's weights as they are now, for what is derived from them (the
    dequantized tensors and 4-bit codes of a GGUF file; int8's calibration maxima, models/smoothing.py).
    Keyed by the file, or for a Hugging Face directory by its files' sizes and times: a changed
    checkpoint gets a new folder."""
    root = cache_dir or default_cache_dir()
    if not path.is_dir():
        return dtype_cache_path(path, "float32", root).parent
    files = sorted(f for f in path.iterdir() if f.is_file())
    stats = [f"{f.name}|{f.stat().st_size}|{f.stat().st_mtime_ns}" for f in files]
    key = "|".join([str(path.resolve()), *stats, str(CACHE_FORMAT)])
    return root / f"{path.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def complete_caches(path: Path, cache_dir: Path | None) -> list[Path]:
    """The complete caches of a GGUF file (any dtype, any layout): each holds its config and tokenizer."""
    root = weights_cache_root(path, cache_dir)
    return [done.parent for done in sorted(root.glob("*/*/done"))]
