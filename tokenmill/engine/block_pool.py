"""The pool of KV blocks: reference counts, the content-hash index, and LRU eviction of free blocks.

A block with ref_cnt 0 is free but keeps its content and hash until it is handed out again, so a
later request with the same prefix can take it back (prefix reuse). Free blocks wait in an ordered
queue: blocks holding no reusable content at the head (handed out first), cached ones appended at
the tail as they are freed, so the least recently used cached block is evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

# What a KV event says of a named block besides its hash: its parent's published hash (None for a
# chain's first block), its token ids, its extra keys (the salt of a chain's first block, or None), and
# the LoRA adapter it was computed under ((lora id, name), or None for the base model).
EventInfo = tuple[int | None, list[int], list[Any] | None, tuple[int, str] | None]


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "event_info")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        # Set with KV events on, while the block is named: an offload tier the block moves to
        # announces it as fully as the pool did (a consumer chains blocks by parent and tokens).
        self.event_info: EventInfo | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        on_removed: Callable[[bytes], None] | None = None,
        on_evicted: Callable[[KVBlock], None] | None = None,
    ) -> None:
        """`on_removed` hears of every hash that stops naming a block here (for KV events);
        `on_evicted` of every cached block handed out again, before its content is overwritten
        (a KV connector saves it to an offload tier)."""
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._by_hash: dict[bytes, KVBlock] = {}
        self.num_evictions = 0
        self.on_removed = on_removed
        self.on_evicted = on_evicted

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._by_hash.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks a request reuses."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            _, b = self._free.popitem(last=False)
            if b.block_hash is not None:  # evict the least recently used cached content
                del self._by_hash[b.block_hash]
                if self.on_removed is not None:
                    self.on_removed(b.block_hash)
                if self.on_evicted is not None:
                    self.on_evicted(b)
                b.block_hash = None
                b.event_info = None
                self.num_evictions += 1
            b.ref_cnt = 1
            out.append(b)
        return out

    def cache(self, block: KVBlock, block_hash: bytes) -> bool:
        """Register a block that is (or is being) filled with the content the hash names; False if
        the block was named already, or an identical block is indexed (the first one is kept)."""
        if block.block_hash is not None or block_hash in self._by_hash:
            return False
        block.block_hash = block_hash
        self._by_hash[block_hash] = block
        return True

    def cached_blocks(self) -> list[tuple[bytes, int]]:
        """Every named block, as (hash, block id)."""
        return [(h, b.block_id) for h, b in self._by_hash.items()]

    def uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None and self._by_hash.get(block.block_hash) is block:
            del self._by_hash[block.block_hash]
            if self.on_removed is not None:
                self.on_removed(block.block_hash)
        block.block_hash = None
        block.event_info = None

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in eviction order (the first freed is evicted first)."""
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt < 0:
                raise RuntimeError(f"double free of {b}")
            if b.ref_cnt == 0:
                self._free[b.block_id] = b
                if b.block_hash is None:
                    self._free.move_to_end(b.block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget all cached content of free blocks."""
        for b in list(self._by_hash.values()):
            if b.ref_cnt == 0:
                del self._by_hash[b.block_hash]  # type: ignore[index]
                if self.on_removed is not None:
                    self.on_removed(b.block_hash)  # type: ignore[arg-type]
                b.block_hash = None
                b.event_info = None
