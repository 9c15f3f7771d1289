"""The attention backend interface: what a kernel gets to compute attention over a paged KV cache.

A step's tokens form one flat batch: first the decode rows (one query token each), then the prefill
segments (several query tokens of one request each). Every backend writes the step's keys and values
into the cache through `slot_mapping`, then attends each query to its request's cached context,
reading the cache through block tables. The plain-PyTorch `TorchReferenceBackend` defines the
semantics; faster backends are tested against it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSegment:
    """Query tokens [q_start, q_start + q_len) of one request, at positions start_pos.. in its sequence."""

    q_start: int
    q_len: int
    start_pos: int
    block_ids: torch.Tensor  # [num_blocks] long: the request's block table, up to this chunk's end
    # [q_len, context_len] bool by sliding window (0: none), each built on first use and shared by all
    # layers of the step.
    masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # The first block id when the block table is a run of consecutive ids (then the cached context is
    # a plain slice of the cache and needs no gather), else None.
    first_block: int | None = None

    @property
    def context_len(self) -> int:
        return self.start_pos + self.q_len

    def causal_mask(self, window: int = 0) -> torch.Tensor:
        """Query i sits at position start_pos + i and sees keys 0..start_pos + i; with a sliding `window`,
        only the last `window` of them (itself included)."""
        if window not in self.masks:
            dev = self.block_ids.device
            qpos = torch.arange(self.start_pos, self.context_len, device=dev)[:, None]
            kpos = torch.arange(self.context_len, device=dev)[None, :]
            mask = kpos <= qpos
            self.masks[window] = mask & (kpos > qpos - window) if window else mask
        return self.masks[window]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot (block_id * block_size + offset) of each token
    num_decode: int  # the first num_decode tokens are decode rows
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] long, padded with 0
    decode_context_lens: torch.Tensor | None  # [num_decode] long: tokens in context incl. the new one
    prefills: list[PrefillSegment]
    block_size: int
    # [num_decode, 1, 1, max_blocks * block_size] bool by sliding window (0: none), built on first use (by
    # backends that gather).
    _decode_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    _longest_decode: int | None = None

    @classmethod
    def of(
        cls,
        slots: list[int],
        tables: list[list[int]],
        context_lens: list[int],
        prefills: list[PrefillSegment],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """From plain lists: each token's cache slot, each decode row's block table and context length
        (tokens it attends to, itself included), and the prefill segments (moved to `device`)."""
        meta = cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            num_decode=len(tables),
            decode_block_tables=None,
            decode_context_lens=None,
            prefills=prefills,
            block_size=block_size,
        )
        if tables:
            bt = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.long)
            for i, t in enumerate(tables):
                bt[i, : len(t)] = torch.tensor(t, dtype=torch.long)
            meta.decode_block_tables = bt.to(device)
            meta.decode_context_lens = torch.tensor(context_lens, dtype=torch.long).to(device)
        for seg in prefills:
            seg.block_ids = seg.block_ids.to(device)
        return meta

    def longest_decode_context(self) -> int:
        """The longest context of the decode rows (0 without any), read once a step."""
        if self._longest_decode is None:
            lens = self.decode_context_lens
            self._longest_decode = int(lens.max()) if lens is not None and len(lens) else 0
        return self._longest_decode

    def decode_mask(self, window: int = 0) -> torch.Tensor:
        """Which positions of the gathered, padded block tables each decode row may see (with a sliding
        `window`, the last `window` of its context)."""
        if window not in self._decode_masks:
            assert self.decode_block_tables is not None and self.decode_context_lens is not None
            b, nb = self.decode_block_tables.shape
            width = nb * self.block_size
            pos = torch.arange(width, device=self.decode_context_lens.device)[None, :]
            lens = self.decode_context_lens[:, None]
            mask = pos < lens
            self._decode_masks[window] = (mask & (pos >= lens - window) if window else mask).view(
                b, 1, 1, width
            )
        return self._decode_masks[window]


class AttentionBackend(ABC):
    """Computes attention for one layer of a flat token batch over that layer's paged KV cache."""

    name: str = "abstract"

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D], rope applied
        k: torch.Tensor,  # [T, Hkv, D], rope applied
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,  # a sliding window: each query sees the last `window` positions, itself included
    ) -> torch.Tensor:  # [T, H, D]
        ...
