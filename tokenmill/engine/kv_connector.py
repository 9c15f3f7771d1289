"""The scheduler's side of a KV connector: the seam through which KV blocks enter and leave the
engine's pool from outside it (offload tiers now; a prefill worker's blocks under disaggregation).

The scheduler asks it, at admission, how many blocks past the pool's own prefix hits can be loaded,
and whether that happens within the step (the request computes at once) or in the background (the
request waits in WAITING_FOR_KV, holding its blocks, until the worker reports them). It hears of every
block the pool evicts, and gives each step its metadata for the worker's side (plain data).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from tokenmill.engine.block_pool import KVBlock
from tokenmill.engine.kv_events import KVEvent
from tokenmill.engine.request import Request


class KVConnectorScheduler(ABC):
    @abstractmethod
    def num_external_blocks(self, req: Request, num_local_blocks: int) -> tuple[int, bool]:
        """Blocks of the request's prompt, after its first `num_local_blocks` (pool hits), that can be
        loaded from outside; and True when loading them must happen in the background."""

    @abstractmethod
    def after_alloc(self, req: Request, blocks: list[KVBlock], first: int, background: bool) -> None:
        """The pool gave `blocks` for the request's blocks first, first+1, ...: load them."""

    @abstractmethod
    def on_evicted(self, block: KVBlock) -> None:
        """The pool is about to reuse `block`, which still holds (and is still named by) its content."""

    @abstractmethod
    def build_meta(self) -> Any:
        """This step's metadata for the worker's side (plain data), or None; resets the step's state."""

    def flush_meta(self, cached: list[tuple[bytes, int]]) -> Any:
        """Metadata that writes everything worth keeping (`cached`: the pool's named blocks) to tiers
        that outlive the process; None when there are none."""
        return None

    @abstractmethod
    def loaded(self, request_id: str, num_ok: int) -> tuple[int, int]:
        """A background load ended with `num_ok` good blocks (as the worker counts them): the request's
        first block loaded, and how many leading blocks from there now hold their content."""

    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Called as a request finishes, before its blocks are freed: whether to keep them (until
        `released` or `expired` names it), and what to tell the client of it (plain data)."""
        return False, None

    def released(self, request_ids: list[str]) -> list[str]:
        """Readers are done with these kept requests: those whose blocks may now be freed."""
        return []

    def expired(self, now: float) -> list[str]:
        """Kept requests whose blocks are freed now although nobody said so."""
        return []

    def take_events(self) -> list[KVEvent]:
        return []

    def counters(self) -> dict[str, int]:
        return {}
