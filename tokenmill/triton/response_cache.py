"""Triton's response cache: one in-memory LRU cache of model outputs, shared by every model.

A model takes part with `response_cache { enable: true }` in its config.pbtxt, once the server runs with
`--cache-config local,size=<bytes>`. A request whose model, version, inputs (names, datatypes, shapes,
bytes), requested outputs and parameters match an earlier successful one gets that one's outputs
without the model running.
"""

from __future__ import annotations

import copy
import hashlib
import json
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.triton.dtypes import protocol_of, to_binary

if TYPE_CHECKING:
    from tokenmill.triton.config import TritonModelConfig

# Bookkeeping an entry costs beyond its arrays and key: the dict slot, the entry and array objects.
ENTRY_OVERHEAD = 512
# Request parameters that only steer scheduling: two requests differing in these get the same outputs.
SCHEDULING_PARAMETERS = frozenset({"priority", "timeout"})

Outputs = dict[str, np.ndarray]


@dataclass(frozen=True)
class CacheKey:
    """A request's identity in the cache.

    `digest` is a 32-byte BLAKE2b hash of an unambiguous encoding of the request (every field length-
    prefixed, so no two different requests encode alike). Entries are matched on the digest alone,
    without keeping the request's bytes to compare: with 256 bits, finding any two requests that share
    a digest takes about 2**128 hash evaluations, so different inputs do not share an entry in
    practice, and the cache's memory goes to outputs rather than to copies of every input. (Triton's
    own cache keys on a 64-bit hash, where collisions are merely unlikely.)
    """

    model: str
    version: str
    digest: bytes

    @property
    def nbytes(self) -> int:
        return len(self.digest) + len(self.model.encode()) + len(self.version.encode())


def _field(h: hashlib.blake2b, data: bytes) -> None:
    h.update(struct.pack("<Q", len(data)))
    h.update(data)


def make_key(
    model: str,
    version: str,
    inputs: dict[str, np.ndarray],
    requested_outputs: Sequence[str] | None = None,
    parameters: dict | None = None,
) -> CacheKey:
    """The key of a request: its model, version, every input tensor (name, datatype, shape, bytes;
    BYTES tensors by their serialized form), the outputs it asks for (None: all of them) and its
    parameters other than scheduling ones (a Python model can read parameters)."""
    h = hashlib.blake2b(digest_size=32, person=b"tokenmill-rc1")
    _field(h, model.encode())
    _field(h, str(version).encode())
    h.update(struct.pack("<Q", len(inputs)))
    for name in sorted(inputs):
        arr = np.asarray(inputs[name])
        _field(h, name.encode())
        _field(h, protocol_of(arr).encode())
        _field(h, struct.pack(f"<{arr.ndim}q", *arr.shape))
        _field(h, to_binary(arr))
    if requested_outputs is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01")
        h.update(struct.pack("<Q", len(requested_outputs)))
        for n in requested_outputs:
            _field(h, n.encode())
    kept = {k: v for k, v in (parameters or {}).items() if k not in SCHEDULING_PARAMETERS}
    _field(h, json.dumps(kept, sort_keys=True, default=repr).encode())
    return CacheKey(model, str(version), h.digest())


def _array_size(arr: np.ndarray) -> int:
    if arr.dtype == np.object_:  # the array holds pointers; the bytes objects are counted one by one
        return arr.nbytes + sum(sys.getsizeof(x) for x in arr.reshape(-1))
    return arr.nbytes


def _copy(arr: np.ndarray) -> np.ndarray:
    """A copy the caller cannot reach into: BYTES elements that are not immutable are copied too."""
    out = np.array(arr, copy=True)
    if out.dtype == np.object_:
        flat = out.reshape(-1)
        for i, x in enumerate(flat):
            if not isinstance(x, bytes | str):
                flat[i] = copy.deepcopy(x)
    return out


@dataclass
class _Entry:
    key: CacheKey
    outputs: Outputs
    size: int


class ResponseCache:
    """An LRU map from CacheKey to outputs, holding at most `size_bytes` (arrays, keys and a fixed
    overhead per entry). Safe to use from several threads: one lock guards the map; copying arrays in
    and out happens outside it."""

    def __init__(self, size_bytes: int) -> None:
        if size_bytes <= 0:
            raise ValueError(f"response cache size must be positive, got {size_bytes}")
        self.capacity = int(size_bytes)
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.used = 0
        # Server-wide counters (Triton's local cache reports these as nv_cache_num_* gauges).
        self.hits = self.misses = self.inserts = self.evictions = 0
        self.lookup_ns = self.insert_ns = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: CacheKey) -> Outputs | None:
        """Copies of the cached outputs, or None; a hit makes the entry the most recently used."""
        t0 = time.perf_counter_ns()
        with self._lock:
            e = self._entries.get(key.digest)
            if e is not None:
                self._entries.move_to_end(key.digest)
                self.hits += 1
            else:
                self.misses += 1
        # Stored arrays are never written to, so they can be copied without the lock.
        out = None if e is None else {n: _copy(a) for n, a in e.outputs.items()}
        with self._lock:
            self.lookup_ns += time.perf_counter_ns() - t0
        return out

    def insert(self, key: CacheKey, outputs: Outputs) -> bool:
        """Store copies of `outputs` under `key`, evicting least recently used entries to make room.
        False when the entry alone is larger than the cache (it is then not stored)."""
        t0 = time.perf_counter_ns()
        stored = {n: _copy(np.asarray(a)) for n, a in outputs.items()}
        size = sum(_array_size(a) + len(n.encode()) for n, a in stored.items()) + key.nbytes + ENTRY_OVERHEAD
        with self._lock:
            try:
                if size > self.capacity:
                    return False
                old = self._entries.pop(key.digest, None)
                if old is not None:  # two identical requests that missed at once: keep the newer
                    self.used -= old.size
                while self.used + size > self.capacity:
                    _, victim = self._entries.popitem(last=False)
                    self.used -= victim.size
                    self.evictions += 1
                self._entries[key.digest] = _Entry(key, stored, size)
                self.used += size
                self.inserts += 1
                return True
            finally:
                self.insert_ns += time.perf_counter_ns() - t0

    def evict_models(self, names: Iterable[str]) -> int:
        """Drop every entry of these models (all versions): their outputs may have changed with a
        reload. Returns how many entries went."""
        names = set(names)
        with self._lock:
            gone = [d for d, e in self._entries.items() if e.key.model in names]
            for d in gone:
                self.used -= self._entries.pop(d).size
        return len(gone)

    def utilization(self) -> float:
        return self.used / self.capacity


def parse_cache_config(values: list[str]) -> int | None:
    """The cache size in bytes from `--cache-config` values (Triton's `<cache>,<key>=<value>`, the flag
    repeatable), or None without any. Only Triton's `local` cache exists here, and its one setting,
    `size`, is a plain number of bytes: Triton's local cache reads `size=512MB` as 512 bytes, so a
    unit is refused rather than read either way."""
    if not values:
        return None
    size: int | None = None
    for value in values:
        name, sep, rest = value.partition(",")
        name = name.strip()
        if name != "local":
            raise ValueError(
                f"--cache-config {value}: tokenmill has only the in-process 'local' cache "
                "(use --cache-config local,size=<bytes>)"
            )
        if not sep or not rest.strip():
            raise ValueError(f"--cache-config {value}: the format is local,size=<bytes>")
        for pair in rest.split(","):
            key, eq, val = pair.partition("=")
            key, val = key.strip(), val.strip()
            if not eq:
                raise ValueError(f"--cache-config {value}: the format is local,size=<bytes>")
            if key != "size":
                raise ValueError(
                    f"--cache-config {value}: unknown setting {key!r}; "
                    "the local cache takes only size=<bytes>"
                )
            if not val.isdigit() or int(val) <= 0:
                raise ValueError(
                    f"--cache-config {value}: size must be a positive number of bytes "
                    "(e.g. local,size=536870912; no units)"
                )
            size = int(val)
    if size is None:
        raise ValueError("--cache-config: the local cache needs size=<bytes>")
    return size


def check_cacheable(cfg: TritonModelConfig, steps: Iterable[TritonModelConfig] = ()) -> str | None:
    """Why the model cannot use the response cache it asks for, or None (also when it does not ask).

    As Triton: decoupled models (0..n responses per request) and the sequence batcher (outputs depend
    on the sequence's state) cannot be cached. An ensemble can (in recent Triton releases too), when none
    of its composing models is one of those; `steps` are their configs (TritonModelConfig)."""
    if not cfg.response_cache:
        return None
    if cfg.decoupled:
        return (
            f"{cfg.name}: the response cache does not support decoupled models "
            "(remove response_cache or model_transaction_policy { decoupled: true })"
        )
    if cfg.sequence_batching is not None:
        return (
            f"{cfg.name}: the response cache does not support the sequence batcher "
            "(outputs depend on each sequence's state); remove response_cache"
        )
    for step in steps:
        if step.decoupled or step.sequence_batching is not None:
            kind = "decoupled" if step.decoupled else "sequence-batched"
            return (
                f"{cfg.name}: the response cache does not support an ensemble with a {kind} "
                f"composing model ({step.name}); remove response_cache"
            )
    return None
