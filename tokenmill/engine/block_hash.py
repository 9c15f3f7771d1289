"""Content hashes of full KV blocks, chained so that a hash names a block and its whole prefix.

hash(block i) = H(hash(block i-1), tokens of block i, salt if i == 0). The salt only enters the first
block, and through the chain it separates every later block too: tenants with different salts never
share a block. SHA-256 makes the names stable across processes, which a KV-aware router needs.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b"tokenmill-kv-root"


def hash_block(parent: bytes, tokens: Sequence[int], salt: str | None = None) -> bytes:
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    if salt is not None:
        h.update(b"\x00salt\x00" + salt.encode())
    return h.digest()[:16]


def extend_block_hashes(
    hashes: list[bytes], tokens: Sequence[int], block_size: int, salt: str | None, upto: int | None = None
) -> None:
    """Append hashes for the full blocks among tokens[:upto] that `hashes` does not cover yet."""
    limit = len(tokens) if upto is None else min(upto, len(tokens))
    while (len(hashes) + 1) * block_size <= limit:
        i = len(hashes)
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(
            hash_block(parent, tokens[i * block_size : (i + 1) * block_size], salt if i == 0 else None)
        )
