"""What one block of KV cache is, for one worker: plain data the engine sizes the shared pool from,
and the one place the cache's shape and byte cost are computed (offload tiers and KV transfer move
blocks of exactly this shape)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.models.attention.kv_quant import SCALE_BYTES


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int  # tokens per block
    num_layers: int  # this worker's layers (a pipeline stage holds only its own)
    num_kv_heads: int  # this worker's key/value heads (a tensor-parallel rank holds only its own)
    head_dim: int
    dtype_bytes: int  # bytes of one value in the model's dtype
    # None: values stored in the model's dtype; "int8" / "fp8": 8-bit rows with a scale each
    # (models/attention/kv_quant.py).
    kv_format: str | None = None

    @property
    def row_width(self) -> int:
        """Elements of one (token, kv head) row as stored: D values, or D codes and a scale's bytes."""
        return self.head_dim + SCALE_BYTES if self.kv_format else self.head_dim

    @property
    def row_bytes(self) -> int:
        return self.row_width if self.kv_format else self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (keys and values, every layer of this worker)."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.row_bytes

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[layers, k/v, blocks, tokens per block, kv heads, row]: the worker's whole cache."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.row_width)

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The cache tensor's dtype: the model's, or raw bytes for 8-bit rows."""
        return torch.uint8 if self.kv_format else model_dtype
