"""What the cache folder holds, what each entry is derived from, and which entries are stale: for
`tokenmill cache` (list) and `tokenmill cache prune`.

A weights cache is keyed by its source's contents (cache_paths.py), so a source that changes or goes
away leaves its folder behind, ~850 MB for the embedded model and gigabytes for a large one; so does
a kernel build once the sources change. Each weights folder records the sources it was derived from
(`sources.json`, written on use), which lets this module tell a folder that some file on the machine
still maps to from one that nothing does. Free of PyTorch, like cache_paths.py; the kernel builds
this install would use are given by the caller.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.weights.cache_paths import memo_is_stale, weights_cache_root

SOURCES_FILE = "sources.json"
_noted: set[tuple[str, str]] = set()  # (folder, source) pairs this process has recorded already


@dataclass
class CacheEntry:
    path: Path
    kind: str  # "weights", "kernels", "requantized", "file ids"; "other": not tokenmill's, left alone
    size: int  # bytes of the files below it
    last_used: float  # seconds since the epoch
    sources: list[str] = field(default_factory=list)
    stale: str | None = None  # why it can go without loss beyond a rebuild; None: in use or unknown
    parts: list[Path] = field(default_factory=list)  # stale parts of an entry that is itself in use


def note_source(folder: Path, source: Path) -> None:
    """Record in an existing weights folder that `source` maps to it, with the time: once per process
    and pair. Best effort (a read-only cache still serves): a lost record only makes the folder look
    unused."""
    key = (str(folder), str(source.resolve()))
    if key in _noted or not folder.is_dir():
        return
    _noted.add(key)
    try:
        # Sources that no longer exist go (a removed clone's virtualenv): the record stays short.
        record = {src: t for src, t in _read_sources(folder).items() if Path(src).exists()}
        record[key[1]] = time.time()
        tmp = folder / f"{SOURCES_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, folder / SOURCES_FILE)  # whole or absent: ranks loading together may race
    except OSError:
        pass


def _read_sources(folder: Path) -> dict[str, float]:
    try:
        data = json.loads((folder / SOURCES_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _size_and_newest(path: Path) -> tuple[int, float]:
    if path.is_file():
        st = path.stat()
        return st.st_size, st.st_mtime
    size, newest = 0, path.stat().st_mtime
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                st = os.stat(os.path.join(dirpath, name))
            except OSError:  # removed while walking
                continue
            size += st.st_size
            newest = max(newest, st.st_mtime)
    return size, newest


def size_of(path: Path) -> int:
    """Bytes of a file, or of every file below a folder."""
    return _size_and_newest(path)[0]


def _weights_entry(folder: Path, cache_dir: Path, codes_format: int) -> CacheEntry:
    size, newest = _size_and_newest(folder)
    record = _read_sources(folder)
    entry = CacheEntry(folder, "weights", size, max([newest, *record.values()]), sorted(record))
    if record:
        live = []
        for src in record:
            p = Path(src)
            try:
                if p.exists() and weights_cache_root(p, cache_dir) == folder:
                    live.append(src)
            except OSError:
                continue
        if not live:
            entry.stale = "sources gone or changed"
    # Codes of an older format are never read again (loader.CODES_FORMAT names the current one).
    for part in sorted(folder.glob("*-codes-*")):
        fmt = part.name.rsplit("-", 1)[-1]
        if part.is_dir() and fmt.isdigit() and int(fmt) != codes_format:
            entry.parts.append(part)
    return entry


def _is_weights_folder(folder: Path) -> bool:
    """What loader.py and smoothing.py write: a record of sources, a finished dtype cache, codes, maxima."""
    return (
        (folder / SOURCES_FILE).exists()
        or any(folder.glob("*/*/done"))
        or any(folder.glob("*-codes-*"))
        or any(folder.glob("int8-maxima-*"))
    )


def scan(cache_dir: Path, current_kernels: set[Path], codes_format: int) -> list[CacheEntry]:
    """Every entry of the cache folder, largest first. `current_kernels`: the kernel build folders
    this install loads (any other was built from other sources); `codes_format`: the codes' format."""
    entries: list[CacheEntry] = []
    if not cache_dir.is_dir():
        return entries
    for top in sorted(cache_dir.iterdir()):
        if top.name == "kernels" and top.is_dir():
            for build in sorted(top.glob("*/*")):
                if not build.is_dir():
                    continue
                size, newest = _size_and_newest(build)
                e = CacheEntry(build, "kernels", size, newest)
                if build not in current_kernels:
                    e.stale = "another version's build"
                entries.append(e)
        elif top.name == "file-ids" and top.is_dir():
            size, newest = _size_and_newest(top)
            memos = sorted(top.iterdir())
            entries.append(
                CacheEntry(top, "file ids", size, newest, parts=[m for m in memos if memo_is_stale(m)])
            )
        elif top.name == "requantized" and top.is_dir():
            for f in sorted(top.iterdir()):
                size, newest = _size_and_newest(f)
                entries.append(CacheEntry(f, "requantized", size, newest))
        elif top.is_dir() and _is_weights_folder(top):
            entries.append(_weights_entry(top, cache_dir, codes_format))
        else:  # not tokenmill's (a user's own folder under it, say): listed, never removed
            size, newest = _size_and_newest(top)
            entries.append(CacheEntry(top, "other", size, newest))
    return sorted(entries, key=lambda e: -e.size)


def prunable(
    entries: list[CacheEntry], older_than_days: float | None, now: float | None = None
) -> list[Path]:
    """What `prune` removes: stale entries and stale parts, and with `older_than_days` also any entry
    not used for that long (it is rebuilt from its source when next needed)."""
    now = time.time() if now is None else now
    cut = None if older_than_days is None else now - older_than_days * 86400
    out: list[Path] = []
    for e in entries:
        if e.kind == "other":
            continue
        if e.stale or (cut is not None and e.last_used < cut and e.kind != "file ids"):
            out.append(e.path)
        else:
            out.extend(e.parts)
    return out


def remove(paths: list[Path]) -> int:
    """Delete these files and folders; returns the bytes freed."""
    freed = 0
    for p in paths:
        freed += size_of(p) if p.exists() else 0
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return freed
