"""`tokenmill cache` and `cache prune` (weights/cache_inventory.py, cli/cache.py): every entry listed
with what it was made from, and only what nothing uses any more removed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from typer.testing import CliRunner

from tokenmill.cli.main import app
from tokenmill.models import registry
from tokenmill.weights.cache_inventory import SOURCES_FILE, note_source, prunable, scan
from tokenmill.weights.cache_paths import file_digest, weights_cache_root


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _weights_folder(source: Path, cache: Path) -> Path:
    folder = weights_cache_root(source, cache)
    _write(folder / "bfloat16" / "llama" / "model.safetensors", b"x" * 1000)
    note_source(folder, source)
    return folder


def _by_path(entries: list) -> dict:
    return {e.path: e for e in entries}


def test_weights_are_stale_once_their_source_changes_or_goes(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    kept = _write(tmp_path / "kept.gguf", os.urandom(4096))
    changed = _write(tmp_path / "changed.gguf", os.urandom(4096))
    gone = _write(tmp_path / "gone.gguf", os.urandom(4096))
    folders = {f: _weights_folder(f, cache) for f in (kept, changed, gone)}
    unrecorded = cache / "old-path-keyed-0123456789abcdef"  # made before sources were recorded
    _write(unrecorded / "bfloat16" / "llama" / "model.safetensors", b"y" * 10)
    _write(unrecorded / "bfloat16" / "llama" / "done", b"ok\n")
    old_codes = folders[kept] / "int4-codes-2"  # an older codes format is never read again
    _write(old_codes / "llama" / "codes.safetensors", b"z")
    _write(folders[kept] / "int4-codes-3" / "llama" / "codes.safetensors", b"z")

    _write(changed, os.urandom(4096))
    os.utime(changed, ns=(changed.stat().st_mtime_ns + 10**9,) * 2)
    gone.unlink()
    foreign = _write(cache / "my-kv-offload" / "block-0.bin", b"k" * 10).parent  # a user's folder under it
    entries = _by_path(scan(cache, set(), codes_format=3))

    assert entries[foreign].kind == "other" and entries[foreign].stale is None
    assert entries[folders[kept]].stale is None
    assert entries[folders[kept]].sources == [str(kept.resolve())]
    assert entries[folders[kept]].parts == [old_codes]
    assert entries[folders[changed]].stale and entries[folders[gone]].stale
    assert entries[unrecorded].stale is None and entries[unrecorded].sources == []
    assert entries[folders[kept]].size >= 1000
    # The memos of the files' digests: the changed file's old one and the gone file's are stale.
    ids = entries[cache / "file-ids"]
    assert len(ids.parts) == 2 and all(p.parent == cache / "file-ids" for p in ids.parts)

    plain = set(prunable(list(entries.values()), None))
    assert plain == {folders[changed], folders[gone], old_codes, *ids.parts}
    # By age: everything unused for that long, live or not; nothing here is a day old.
    assert set(prunable(list(entries.values()), 1.0)) == plain
    later = time.time() + 2 * 86400
    aged = set(prunable(list(entries.values()), 1.0, now=later))
    assert {folders[kept], unrecorded} <= aged and cache / "file-ids" not in aged and foreign not in aged


def test_kernel_builds_of_other_sources_are_stale(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    current = cache / "kernels" / "torch-2.13.0+cpu" / "avx512_bf16-aaaaaaaaaaaa"
    other = cache / "kernels" / "torch-2.13.0+cpu" / "avx512_bf16-bbbbbbbbbbbb"
    for d in (current, other):
        _write(d / "lib.so", b"\0" * 100)
    entries = _by_path(scan(cache, {current}, codes_format=3))
    assert entries[current].stale is None and entries[other].stale
    assert prunable(list(entries.values()), None) == [other]


def test_an_old_memo_without_its_files_name_is_stale(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    f = _write(tmp_path / "model.gguf", b"gguf" * 100)
    file_digest(f, cache)
    (memo,) = (cache / "file-ids").iterdir()
    assert memo.read_text().split("\n")[1].startswith(str(f.resolve()))
    assert _by_path(scan(cache, set(), 3))[cache / "file-ids"].parts == []
    memo.write_text(memo.read_text().split("\n")[0] + "\n")  # the format before names were kept
    assert _by_path(scan(cache, set(), 3))[cache / "file-ids"].parts == [memo]


def test_a_load_records_its_source_and_the_cli_prunes_only_what_is_stale(
    model_path: Path, tmp_path: Path
) -> None:
    from tokenmill.weights import synthetic

    cache = tmp_path / "cache"
    shape = synthetic.Shape("tiny", hidden=64, layers=1, ffn=128, heads=2, kv_heads=1)
    live = synthetic.synthesize(model_path, tmp_path / "live.gguf", shape, "q8_0", seed=1)
    dead = synthetic.synthesize(model_path, tmp_path / "dead.gguf", shape, "q8_0", seed=2)
    for f in (live, dead):
        registry.load_checkpoint(f, torch.bfloat16, cache)
    live_folder, dead_folder = weights_cache_root(live, cache), weights_cache_root(dead, cache)
    assert (live_folder / SOURCES_FILE).exists() and (dead_folder / SOURCES_FILE).exists()
    dead.unlink()

    runner = CliRunner()
    listed = runner.invoke(app, ["cache", "--cache-dir", str(cache)])
    assert listed.exit_code == 0, listed.output
    assert "stale" in listed.output and "weights" in listed.output

    dry = runner.invoke(app, ["cache", "prune", "--dry-run", "--cache-dir", str(cache)])
    assert dry.exit_code == 0 and "would free" in dry.output and dead_folder.exists()
    done = runner.invoke(app, ["cache", "prune", "--yes", "--cache-dir", str(cache)])
    assert done.exit_code == 0, done.output
    assert not dead_folder.exists() and live_folder.exists()
    # The survivor still loads from its cache.
    assert registry.load_checkpoint(live, torch.bfloat16, cache).state_dict

    bad = runner.invoke(app, ["cache", "prune", "--older-than", "-1", "--cache-dir", str(cache)])
    assert bad.exit_code == 2 and "--older-than" in bad.output
