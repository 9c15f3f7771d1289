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


def block_input(parent: bytes, token_bytes: bytes, salt: str | None) -> bytes:
    """What a block's name is the digest of: its parent's name, its tokens (int64), and the salt."""
    return parent + token_bytes if salt is None else parent + token_bytes + b"\x00salt\x00" + salt.encode()


def digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


def hash_block(parent: bytes, tokens: Sequence[int], salt: str | None = None) -> bytes:
    return digest(block_input(parent, array("q", tokens).tobytes(), salt))


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
    for k in range(last - first):
        chunk = data[k * step : (k + 1) * step]
        parent = digest(block_input(parent, chunk, salt if first + k == 0 else None))
        hashes.append(parent)
