"""What a tier below the pool must do to hold KV blocks: the disk and shared tiers are directories of
files (file_store.py); an object store (S3, GCS, a KV service) would be one more implementation of this,
with nothing else changed."""

from __future__ import annotations

from typing import Protocol


class BlockStore(Protocol):
    name: str
    corrupt: int  # blocks found damaged or stale (refused, removed)

    def put(self, key: bytes, payload: bytes | bytearray | memoryview) -> bool:
        """Store a block under its content hash; False when it was there already or cannot fit."""
        ...

    def get(self, key: bytes) -> bytes | None:
        """The block's bytes, verified; None when absent, damaged or stale (never damaged bytes)."""
        ...

    def contains(self, key: bytes) -> bool: ...

    def discard(self, key: bytes) -> None: ...
