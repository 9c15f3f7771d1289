"""KV blocks as files: the local-disk tier (G3) and the shared-directory tier (G4) of the offload hierarchy.

One file per block, named by the block's content hash, under ``root/namespace/<first two hex chars>/``.
A file is a fixed header followed by the payload::

    magic b"TMKV" | version u16 | namespace digest 8s | layout digest 16s | key length u16 | key
    | payload length u64 | HMAC-SHA256 32s

all little-endian. The HMAC covers everything before it and the payload, so a file is bound to its
block (the key it is looked up by), its namespace (model, dtype, weight precision, block shape, rank)
and its layout (the tensor's dtype and shape), and only a holder of the store's secret can make one
that passes. The secret of a private directory (the disk tier) is a random key kept beside the
namespaces in ``root/.tokenmill-kv-key`` (mode 0600, made on first use); a shared directory's comes
from the deployment (``TOKENMILL_KV_SHARED_KEY``, see tiers.py). Every field is checked on read, and
only regular files are opened (a symlink, FIFO, device or directory in a block's place is refused
without blocking), so a stale, truncated, foreign or forged file is dropped, never returned.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import logging
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

FORMAT_VERSION = 2
MAGIC = b"TMKV"
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
# A temp file this old belongs to a writer that crashed (a live one renames it within milliseconds).
STALE_TMP_SECONDS = 60.0
MAX_KEY_BYTES = 64  # 128 hex chars: the file name stays far below NAME_MAX
SECRET_FILE = ".tokenmill-kv-key"  # a private directory's HMAC key, in the store's root
SECRET_BYTES = 32
MIN_SECRET_BYTES = 16

_HEAD = struct.Struct("<4sH8s16sH")  # magic, version, namespace digest, layout digest, key length
_LENGTH = struct.Struct("<Q")  # payload length
_MAC_BYTES = 32  # HMAC-SHA256 of the header up to here and the payload
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9._-]+")
# Opened without following a symlink and without waiting for a FIFO's writer.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)

log = logging.getLogger(__name__)


class _Corrupt(Exception):
    """The file is not a valid block for this key, namespace, layout and secret."""


def _namespace_digest(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=8).digest()


def _layout_digest(layout: str) -> bytes:
    return hashlib.blake2b(layout.encode(), digest_size=16).digest()


def _open_regular(path: Path) -> tuple[int, os.stat_result]:
    """An open descriptor and its stat, for a regular file only: anything else in the block's place is
    _Corrupt (with its identity), found without following it or blocking on it. FileNotFoundError and
    other OSErrors propagate."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _Corrupt((st.st_dev, st.st_ino))
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        st = os.lstat(path)  # replaced meanwhile (by a symlink: ELOOP)
        if not stat.S_ISREG(st.st_mode):
            raise _Corrupt((st.st_dev, st.st_ino)) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _Corrupt((st.st_dev, st.st_ino))
    return fd, st


def local_secret(root: str | Path) -> bytes:
    """The HMAC key of a directory only this user writes (the disk tier): random, kept in
    ``root/.tokenmill-kv-key`` (mode 0600) so a restart can read its blocks, made on first use.

    A key file that is not a regular file of this user's, closed to everyone else, is refused with a
    ValueError: whoever could write it could forge blocks.
    """
    root = Path(root)
    path = root / SECRET_FILE
    try:
        return _read_secret_file(path)
    except FileNotFoundError:
        pass
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(8)}.new"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(SECRET_BYTES))
        try:
            os.link(tmp, path)  # never replaces a key another process made first: theirs is used
        except FileExistsError:
            pass
        except OSError:  # a filesystem without hard links
            if not os.path.lexists(path):
                os.rename(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return _read_secret_file(path)


def _read_secret_file(path: Path) -> bytes:
    try:
        fd, st = _open_regular(path)
    except _Corrupt:
        raise ValueError(f"KV offload: {path} is not a regular file; remove it to make a new key") from None
    with os.fdopen(fd, "rb") as f:
        secret = f.read(4096)
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise ValueError(f"KV offload: {path} belongs to another user; remove it to make a new key")
    if st.st_mode & 0o077:
        raise ValueError(f"KV offload: {path} is open to other users (needs mode 0600); chmod 600 it")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"KV offload: {path} holds no key; remove it to make a new one")
    return secret


def _as_key(key: bytes) -> bytes:
    if not isinstance(key, bytes | bytearray | memoryview):
        raise TypeError(f"key must be bytes, not {type(key).__name__}")
    key = bytes(key)
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    return key


def block_path(root: str | Path, namespace: str, key: bytes) -> Path:
    """Where a block lives under ``root``: for a process that checks presence without a FileStore."""
    hexkey = _as_key(key).hex()
    return Path(root) / namespace / hexkey[:2] / (hexkey + SUFFIX)


class FileStore:
    """A byte-capacity LRU store of KV blocks on a filesystem, safe across threads and processes.

    Several processes may share one directory (the G4 tier): files appear by atomic rename, so a
    reader sees a whole file or none, and ``get``/``contains`` find blocks other processes wrote
    (with the same ``secret``: pass the deployment's, or each process makes its own key file).
    The capacity is enforced only over the blocks this process knows (those it wrote, found at
    start or read since); other processes' evictions show up as misses.

    ``secret`` keys the files' HMACs (None: the directory's own key file, see local_secret);
    ``layout`` names the payload's layout (dtype, shape), bound into every file beside the namespace.
    """

    def __init__(
        self,
        root: str | Path,
        namespace: str,
        capacity_bytes: int | None = None,
        *,
        name: str = "disk",
        on_evict: Callable[[bytes, bytes], None] | None = None,
        on_dropped: Callable[[bytes], None] | None = None,
        secret: bytes | None = None,
        layout: str = "",
    ) -> None:
        if not _NAMESPACE_RE.fullmatch(namespace) or namespace in (".", ".."):
            raise ValueError(f"namespace must be a file-name-safe string, got {namespace!r}")
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        self.name = name
        self.namespace = namespace
        self.root = Path(root)
        self.directory = self.root / namespace
        self.directory.mkdir(parents=True, exist_ok=True)
        if secret is None:
            secret = local_secret(self.root)
        elif len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a file tier's secret needs {MIN_SECRET_BYTES}+ bytes, got {len(secret)}")
        self._secret = bytes(secret)
        self.on_evict = on_evict
        # Told each key it no longer holds: evicted for capacity (even one too damaged to hand to
        # on_evict), found damaged, gone from its directory, or discarded.
        self.on_dropped = on_dropped
        self._capacity = capacity_bytes
        self._ns_digest = _namespace_digest(namespace)
        self.layout = layout
        self._layout_digest = _layout_digest(layout)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._used = 0
        # Keys being written or evicted by this process: not to be written again or re-indexed meanwhile.
        self._writing: set[bytes] = set()
        self._evicting: set[bytes] = set()
        self._tmp_counter = itertools.count()
        self.hits = 0
        self.misses = 0
        self.corrupt = 0
        self.writes = 0
        self.evictions = 0
        self._warm_start()
        self._evict_over_capacity()

    # -- introspection ------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int | None:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def __repr__(self) -> str:
        return (
            f"FileStore(name={self.name!r}, directory={str(self.directory)!r}, blocks={len(self)}, "
            f"used_bytes={self._used}, capacity_bytes={self._capacity})"
        )

    def stats(self) -> dict[str, int]:
        """Counters and occupancy; ``capacity_bytes`` is -1 when unbounded."""
        with self._lock:
            return {
                "blocks": len(self._index),
                "used_bytes": self._used,
                "capacity_bytes": -1 if self._capacity is None else self._capacity,
                "hits": self.hits,
                "misses": self.misses,
                "corrupt": self.corrupt,
                "writes": self.writes,
                "evictions": self.evictions,
            }

    def path(self, key: bytes) -> Path:
        """Where the block for ``key`` lives (whether or not it exists)."""
        return block_path(self.root, self.namespace, key)

    # -- operations ---------------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """Known to this process, or present on disk (written by another process); not verified."""
        key = _as_key(key)
        with self._lock:
            if key in self._index:
                return True
        return os.path.exists(self.path(key))

    def put(self, key: bytes, payload: bytes | bytearray | memoryview) -> bool:
        """Store a block; False if it is already here (a use, for the LRU) or larger than the capacity.

        A block another process already wrote to this directory is adopted instead of rewritten.
        Write errors (e.g. a full disk) propagate.
        """
        key = _as_key(key)
        data = memoryview(payload)
        if not data.c_contiguous:
            data = memoryview(data.tobytes())
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        target = self.path(key)
        size = _HEAD.size + len(key) + _LENGTH.size + _MAC_BYTES + data.nbytes
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return False
            if key in self._writing or key in self._evicting:
                return False
            if self._capacity is not None and size > self._capacity:
                return False
            self._writing.add(key)
        try:
            try:
                # Shared tier: the same content is already there; a stat is cheaper than a rewrite.
                # (Anything but a regular file in its place is replaced.)
                st = os.lstat(target)
                existing: int | None = st.st_size if stat.S_ISREG(st.st_mode) else None
            except OSError:
                existing = None
            if existing is not None:
                with self._lock:
                    self._add(key, existing)
            else:
                # Hashed only now: a dedup, the common case, costs no pass over the payload.
                tmp = self._write_tmp(target, key, self._header(key, data), data)
                try:
                    with self._lock:
                        # Renamed under the lock so a concurrent get() dropping a corrupt file cannot race it.
                        os.replace(tmp, target)
                        self._add(key, size)
                        self.writes += 1
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
        finally:
            with self._lock:
                self._writing.discard(key)
        self._evict_over_capacity()
        return existing is None

    def get(self, key: bytes) -> bytes | None:
        """The verified payload, or None if absent or damaged (a damaged file is removed)."""
        key = _as_key(key)
        target = self.path(key)
        try:
            payload, size, ident = self._read(key, target)
        except FileNotFoundError:
            with self._lock:
                self.misses += 1
                # Only forget the key if the file is really gone: a put may have renamed it in meanwhile.
                gone = key in self._index and not os.path.exists(target)
                if gone:
                    self._drop(key)
            if gone:
                self._dropped(key)
            return None
        except _Corrupt as exc:
            ident = exc.args[0] if exc.args else None
            with self._lock:
                self.corrupt += 1
                corrupt = self.corrupt
                self._drop(key)
                self._unlink_if_same(target, ident)
            self._dropped(key)
            if corrupt & (corrupt - 1) == 0:  # the 1st, 2nd, 4th, 8th... : a wrong key must not flood the log
                log.warning(
                    "KV offload: refused %d block file(s) in the %s tier (damaged, forged, another layout "
                    "or key, or not a regular file), e.g. %s",
                    corrupt, self.name, target,
                )  # fmt: skip
            return None
        except OSError:
            # Unreadable for another reason (permissions, I/O error): a miss, but leave the file alone.
            with self._lock:
                self.misses += 1
            return None
        adopted = False
        with self._lock:
            self.hits += 1
            if key in self._index:
                self._index.move_to_end(key)
            elif key not in self._evicting and os.path.exists(target):
                # Written by another process, or by us before a restart: count it from now on.
                self._add(key, size)
                adopted = True
        # The mtime carries the LRU order across restarts.
        with contextlib.suppress(OSError):
            st = os.lstat(target)
            if (st.st_dev, st.st_ino) == ident:
                os.utime(target)
        if adopted:
            self._evict_over_capacity()
        return payload

    def discard(self, key: bytes) -> None:
        """Remove the block, if present."""
        key = _as_key(key)
        target = self.path(key)
        with self._lock:
            held = key in self._index
            self._drop(key)
            try:
                os.unlink(target)
                held = True
            except OSError:
                pass
        if held:
            self._dropped(key)

    def _dropped(self, key: bytes) -> None:
        if self.on_dropped is not None:
            with contextlib.suppress(Exception):
                self.on_dropped(key)

    # -- internals ----------------------------------------------------------------------------------

    def _mac(self, signed: bytes, payload: bytes | memoryview) -> bytes:
        mac = hmac.new(self._secret, signed, hashlib.sha256)
        mac.update(payload)
        return mac.digest()

    def _header(self, key: bytes, data: memoryview) -> bytes:
        head = _HEAD.pack(MAGIC, FORMAT_VERSION, self._ns_digest, self._layout_digest, len(key))
        signed = head + key + _LENGTH.pack(data.nbytes)
        return signed + self._mac(signed, data)

    def _write_tmp(self, target: Path, key: bytes, header: bytes, data: memoryview) -> Path:
        # Unique per process, thread and call, so concurrent writers never share a temp file.
        tmp = target.with_name(
            f".{key.hex()}.{os.getpid()}.{threading.get_ident()}.{next(self._tmp_counter)}{TMP_SUFFIX}"
        )
        try:
            f = open(tmp, "xb")  # noqa: SIM115 - the retry below needs the open outside a with
        except FileNotFoundError:
            target.parent.mkdir(parents=True, exist_ok=True)
            f = open(tmp, "xb")  # noqa: SIM115
        try:
            with f:
                f.write(header)
                f.write(data)
                # No fsync: a block torn by a power loss fails its checksum and is dropped on read.
                f.flush()
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return tmp

    def _read(self, key: bytes, target: Path) -> tuple[bytes, int, tuple[int, int]]:
        """Payload, file size and (device, inode); raises _Corrupt(ident) or OSError."""
        fd, st = _open_regular(target)
        ident = (st.st_dev, st.st_ino)
        with os.fdopen(fd, "rb") as f:
            head = f.read(_HEAD.size)
            if len(head) != _HEAD.size:
                raise _Corrupt(ident)
            magic, version, ns_digest, layout_digest, key_len = _HEAD.unpack(head)
            # Checked one by one: after a version mismatch the rest of the layout means nothing.
            if magic != MAGIC or version != FORMAT_VERSION or ns_digest != self._ns_digest:
                raise _Corrupt(ident)
            if layout_digest != self._layout_digest or key_len != len(key) or f.read(key_len) != key:
                raise _Corrupt(ident)
            tail = f.read(_LENGTH.size + _MAC_BYTES)
            if len(tail) != _LENGTH.size + _MAC_BYTES:
                raise _Corrupt(ident)
            (length,) = _LENGTH.unpack_from(tail)
            header_size = _HEAD.size + key_len + len(tail)
            # Before reading: a damaged length must not make us allocate a huge buffer.
            if st.st_size != header_size + length:
                raise _Corrupt(ident)
            payload = f.read(length)
        if len(payload) != length:
            raise _Corrupt(ident)
        signed = head + key + tail[: _LENGTH.size]
        if not hmac.compare_digest(self._mac(signed, payload), tail[_LENGTH.size :]):
            raise _Corrupt(ident)
        return payload, st.st_size, ident

    def _unlink_if_same(self, target: Path, ident: tuple[int, int] | None) -> None:
        # Another process may have replaced the bad file with a good one since we read it. (lstat: a
        # symlink in a block's place is removed, never what it points to.)
        with contextlib.suppress(OSError):
            st = os.lstat(target)
            if ident is None or (st.st_dev, st.st_ino) == ident:
                os.unlink(target)

    def _add(self, key: bytes, size: int) -> None:
        """Index a key as most recently used. Caller holds the lock."""
        old = self._index.pop(key, None)
        if old is not None:
            self._used -= old
        self._index[key] = size
        self._used += size

    def _drop(self, key: bytes) -> None:
        """Forget a key. Caller holds the lock."""
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size

    def _evict_over_capacity(self) -> None:
        """Evict least-recently-used blocks until within capacity, handing each to ``on_evict``."""
        if self._capacity is None:
            return
        victims: list[bytes] = []
        with self._lock:
            while self._used > self._capacity and self._index:
                key, size = self._index.popitem(last=False)
                self._used -= size
                self._evicting.add(key)
                self.evictions += 1
                victims.append(key)
        error: BaseException | None = None
        for key in victims:
            target = self.path(key)
            try:
                if self.on_evict is not None:
                    payload = self._read_for_eviction(key, target)
                    if payload is not None:
                        self.on_evict(key, payload)
            except Exception as exc:  # finish evicting the rest, then report the first failure
                if error is None:
                    error = exc
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(target)
                with self._lock:
                    self._evicting.discard(key)
                self._dropped(key)
        if error is not None:
            raise error

    def _read_for_eviction(self, key: bytes, target: Path) -> bytes | None:
        try:
            return self._read(key, target)[0]
        except _Corrupt:
            with self._lock:
                self.corrupt += 1
            return None
        except OSError:
            return None  # already gone (another process evicted it): nothing to hand down

    def _warm_start(self) -> None:
        """Index the blocks already on disk, oldest mtime first; remove crashed writers' temp files."""
        found: list[tuple[int, str, bytes, int]] = []
        now = time.time()
        with os.scandir(self.directory) as shards:
            shard_dirs = [e.name for e in shards if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
        for shard in shard_dirs:
            try:
                entries = list(os.scandir(self.directory / shard))
            except OSError:
                continue  # removed meanwhile by someone else
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if entry.name.endswith(TMP_SUFFIX):
                    if now - st.st_mtime > STALE_TMP_SECONDS:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                    continue
                if not entry.name.endswith(SUFFIX) or not entry.is_file(follow_symlinks=False):
                    continue
                try:
                    key = bytes.fromhex(entry.name[: -len(SUFFIX)])
                except ValueError:
                    continue
                # path() must lead back to this very file, or get() and eviction could never reach it.
                if (
                    not 1 <= len(key) <= MAX_KEY_BYTES
                    or entry.name != key.hex() + SUFFIX
                    or shard != key.hex()[:2]
                ):
                    continue
                found.append((st.st_mtime_ns, entry.name, key, st.st_size))
        found.sort()
        with self._lock:
            for _, _, key, size in found:
                self._add(key, size)
