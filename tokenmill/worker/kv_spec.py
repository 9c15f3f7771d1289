"""What one block of KV cache is, for one worker: plain data the engine sizes the shared pool from,
and the one place the cache's shape and byte cost are computed (offload tiers and KV transfer, later,
move blocks of exactly this shape)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int  # tokens per block
    num_layers: int  # this worker's layers (a pipeline stage holds only its own)
    num_kv_heads: int  # this worker's key/value heads (a tensor-parallel rank holds only its own)
    head_dim: int
    dtype_bytes: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (keys and values, every layer of this worker)."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[layers, k/v, blocks, tokens per block, kv heads, head dim]: the worker's whole cache."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
