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
    """Append hashes for the full blocks among tokens[:upto] that `hashes` does not cover yet.

    The same names as hash_block's, computed with one conversion of the new tokens to bytes and one
    SHA-256 call per block: the router hashes every prompt it routes, so this is its hot path.
    """
    limit = len(tokens) if upto is None else min(upto, len(tokens))
    first, last = len(hashes), limit // block_size
    if last <= first:
        return
    data = array("q", tokens[first * block_size : last * block_size]).tobytes()
    step = block_size * 8
    parent = hashes[-1] if hashes else ROOT_HASH
    sha256 = hashlib.sha256
    for k in range(last - first):
        chunk = data[k * step : (k + 1) * step]
        if first + k == 0 and salt is not None:
            chunk += b"\x00salt\x00" + salt.encode()
        parent = sha256(parent + chunk).digest()[:16]
        hashes.append(parent)
