"""Where what is derived from a checkpoint is cached (weights/cache_paths.py): keyed by a GGUF file's
contents, so a copy shares its original's caches and a changed file gets its own."""

from __future__ import annotations

import os
from pathlib import Path

from tokenmill.weights.cache_paths import dtype_cache_path, file_digest, weights_cache_root


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_a_copy_shares_its_originals_caches_and_a_change_does_not(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    data = os.urandom(3 << 20)
    a = _write(tmp_path / "one" / "model.gguf", data)
    b = _write(tmp_path / "two" / "model.gguf", data)  # each clone's virtualenv holds its own copy
    assert weights_cache_root(a, cache) == weights_cache_root(b, cache)
    assert dtype_cache_path(a, "bfloat16", cache) == dtype_cache_path(b, "bfloat16", cache)
    # The same size, one byte changed (and a later time): another folder.
    changed = bytearray(data)
    changed[len(data) // 2] ^= 1
    _write(b, bytes(changed))
    os.utime(b, ns=(a.stat().st_mtime_ns + 10**9, a.stat().st_mtime_ns + 10**9))
    assert weights_cache_root(a, cache) != weights_cache_root(b, cache)


def test_the_digest_is_read_once_and_remembered_by_path_size_and_time(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    f = _write(tmp_path / "model.gguf", b"gguf" * 1000)
    digest = file_digest(f, cache)
    (memo,) = (cache / "file-ids").iterdir()
    assert memo.read_text().split("\n")[0] == digest and len(digest) == 64
    memo.write_text("remembered\n")  # a later start takes the remembered digest without reading the file
    assert file_digest(f, cache) == "remembered"
    os.utime(f, ns=(f.stat().st_mtime_ns + 10**9, f.stat().st_mtime_ns + 10**9))  # touched: read again
    assert file_digest(f, cache) == digest
    assert not list((cache / "file-ids").glob("*.tmp"))
