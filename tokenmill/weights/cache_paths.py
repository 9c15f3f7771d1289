"""Where what is derived from a checkpoint is cached: the dequantized tensors of a GGUF file, with its
config and tokenizer, per dtype and layout; its 4-bit and 8-bit codes; int8's calibration maxima.

Kept apart from weights/loader.py and free of PyTorch, so that a frontend process (the API server, a
router, `tokenmill bench`) finds the tokenizer without importing torch (~180 MB resident).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tokenmill.paths import default_cache_dir

CACHE_FORMAT = 2  # bump when the cached layout changes (2: config.json in Hugging Face form)


def file_digest(path: Path, cache_dir: Path) -> str:
    """A file's content digest (SHA-256), remembered under cache_dir/file-ids by its path, size and
    time: the file is read once, and again only when it changes. A copy of the same file elsewhere (the
    embedded model in each clone's own virtualenv, installed with a new time) has the same digest, so
    it shares the caches derived from it (~850 MB for the embedded model) instead of adding its own."""
    st = path.stat()
    where = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    memo = cache_dir / "file-ids" / hashlib.sha256(where.encode()).hexdigest()[:32]
    try:
        return memo.read_text().split("\n", 1)[0].strip()
    except FileNotFoundError:
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{digest}\n{where}\n")  # the second line lets `tokenmill cache` tell a memo is stale
    os.replace(tmp, memo)  # whole or absent: ranks loading together may race to write it
    return digest


def memo_is_stale(memo: Path) -> bool:
    """Whether a file_digest memo names a file that is gone or changed (or predates the line naming it)."""
    try:
        lines = memo.read_text().split("\n")
    except OSError:
        return False
    if len(lines) < 2 or "|" not in lines[1]:
        return True
    where, size, mtime = lines[1].rsplit("|", 2)
    try:
        st = Path(where).stat()
    except OSError:
        return True
    return f"{st.st_size}|{st.st_mtime_ns}" != f"{size}|{mtime}"


def dtype_cache_path(path: Path, dtype_name: str, cache_dir: Path) -> Path:
    """A GGUF file's cache for one dtype ("float32", "bfloat16"): keyed by the file's contents
    (file_digest), so a changed file gets a new folder and a copy shares its original's; each layout's
    tensors in a folder below."""
    key = f"{file_digest(path, cache_dir)}|{path.stat().st_size}|{CACHE_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir / f"{path.stem}-{digest}" / dtype_name


def weights_cache_root(path: Path, cache_dir: Path | None) -> Path:
    """The cache folder of one checkpoint's weights as they are now, for what is derived from them (the
    dequantized tensors and 4-bit codes of a GGUF file; int8's calibration maxima, models/smoothing.py).
    Keyed by the file's contents, or for a Hugging Face directory by its path and its files' sizes and
    times: a changed checkpoint gets a new folder."""
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
