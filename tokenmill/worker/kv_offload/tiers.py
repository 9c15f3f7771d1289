"""What `--kv-offload` says: which tiers exist below the engine's pool, where, and how big; the
namespace that keeps blocks of one cache layout apart from every other in a file tier; and the shared
tier's key."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

from tokenmill.worker.kv_spec import KVCacheSpec

_UNITS = {
    "": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30,
}  # fmt: skip
SHARED_KEY_ENV = "TOKENMILL_KV_SHARED_KEY"
MIN_SHARED_KEY_BYTES = 16
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes from "4GB", "512MiB", "1.5G" or a plain number of bytes."""
    m = _SIZE.match(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 4GB, 512MiB, 1000000)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"a tier size must be positive, got {text!r}")
    return n


@dataclass(frozen=True)
class OffloadTiers:
    host_bytes: int | None = None  # G2: a second pool of blocks in host memory
    disk_path: str | None = None  # G3: this worker's directory, a byte budget, least recently used out
    disk_bytes: int | None = None
    shared_path: str | None = None  # G4: a directory every worker reads and writes
    shared_bytes: int | None = None  # None: unbounded (the store's owner prunes it)

    @property
    def has_files(self) -> bool:
        return self.disk_path is not None or self.shared_path is not None


def _path_and_size(value: str, tier: str, size_required: bool) -> tuple[str, int | None]:
    # The size follows the last colon, when what follows it reads as a size (paths may hold colons).
    path, sep, tail = value.rpartition(":")
    if sep and _SIZE.match(tail) and path:
        return path, parse_size(tail)
    if size_required:
        raise ValueError(f"{tier}= needs a size: {tier}=PATH:SIZE (e.g. {tier}=/var/kv:20GB)")
    return value, None


def parse_tiers(spec: str) -> OffloadTiers:
    """Parse "host=SIZE,disk=PATH:SIZE,shared=PATH[:SIZE]" (any subset, each at most once)."""
    seen: dict[str, str] = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        name, eq, value = part.partition("=")
        name, value = name.strip().lower(), value.strip()
        if not eq or not value:
            raise ValueError(f"--kv-offload: {part.strip()!r} is not TIER=VALUE")
        if name not in ("host", "disk", "shared"):
            raise ValueError(f"--kv-offload: unknown tier {name!r}; tiers are host, disk and shared")
        if name in seen:
            raise ValueError(f"--kv-offload: tier {name!r} given twice")
        seen[name] = value
    if not seen:
        raise ValueError("--kv-offload names no tier (e.g. host=4GB,disk=/var/kv:20GB)")
    host = parse_size(seen["host"]) if "host" in seen else None
    disk_path = disk_bytes = shared_path = shared_bytes = None
    if "disk" in seen:
        disk_path, disk_bytes = _path_and_size(seen["disk"], "disk", size_required=True)
    if "shared" in seen:
        shared_path, shared_bytes = _path_and_size(seen["shared"], "shared", size_required=False)
    if disk_path is not None and disk_path == shared_path:
        raise ValueError("--kv-offload: disk and shared need different directories")
    return OffloadTiers(host, disk_path, disk_bytes, shared_path, shared_bytes)


def layout_namespace(
    model: str, dtype: str, quantization: str | None, spec: KVCacheSpec, rank: int, shard: str | None = None
) -> str:
    """A file-name-safe name for one cache layout: a block written by another model, dtype, weight
    precision (it changes the keys and values), block shape, rank or shard is never found under it.

    `shard`: which layers and key/value heads a rank of a tensor- or pipeline-parallel engine holds
    (shard_label); the same rank of another layout can hold other heads in the same shape (tensor
    parallel 4 over 2 key/value heads replicates them: rank 1 holds head 0, where tensor parallel 2's
    rank 1 holds head 1), and must not find these blocks. None for a single worker."""
    shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size, spec.dtype_bytes)
    text = f"v1|{model}|{dtype}|{quantization}|{'x'.join(map(str, shape))}|rank{rank}"
    if spec.kv_format:  # an 8-bit cache's blocks are another layout (older names stay as they were)
        text += f"|kv-{spec.kv_format}"
    if shard:
        text += f"|{shard}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def shard_label(layers: range, kv_heads: range, tp_size: int, pp_size: int) -> str:
    """A tensor/pipeline rank's part of every block, for its namespace: the engine's layout, and the
    global layers and key/value heads it holds."""
    return (
        f"tp{tp_size}pp{pp_size}|layers{layers.start}-{layers.stop}|kvheads{kv_heads.start}-{kv_heads.stop}"
    )


def shared_tier_key() -> bytes:
    """The shared tier's HMAC key: a per-deployment secret, the same on every worker of the directory
    and unknown to anyone else who can write to it. None set is an error, not a key made up here: a
    key file inside the shared directory would be readable (or replaceable) by the very writers the
    key is meant to keep out."""
    key = os.environ.get(SHARED_KEY_ENV, "").encode()
    if len(key) < MIN_SHARED_KEY_BYTES:
        raise ValueError(
            f"--kv-offload shared= needs a per-deployment key: set {SHARED_KEY_ENV} to the same secret of "
            f"at least {MIN_SHARED_KEY_BYTES} bytes on every worker sharing the directory "
            f"(e.g. `openssl rand -hex 32`)"
        )
    return key
