"""How much of a prompt each worker holds: from the workers' KV events (exact), or, for workers that
publish none, from the router's own placements (`kv-approx`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.cluster.approx_index import ApproxKVIndex
from tokenmill.cluster.prefix_hasher import PrefixHasher
from tokenmill.cluster.radix_index import RadixKVIndex
from tokenmill.lora.request import kv_salt

if TYPE_CHECKING:
    from tokenmill.cluster.router.relay import Relay
    from tokenmill.engine.protocol import EngineRequest


EventIndex = RadixKVIndex


def request_salt(req: EngineRequest) -> str | None:
    """What the workers salt the request's first block with: its cache salt and its LoRA adapter, so
    a prefix score counts only blocks cached under the same adapter."""
    return kv_salt(req.cache_salt, req.lora)


class PrefixIndex:
    def __init__(self, approx_ttl_s: float | None = None) -> None:
        self.block_size = 0
        self.events: EventIndex | None = None  # fed by the workers' KV events (once the block size is known)
        self.approx = ApproxKVIndex(approx_ttl_s) if approx_ttl_s is not None else None
        self._hasher: PrefixHasher | None = None

    def set_block_size(self, block_size: int) -> None:
        """Made once, when the first worker joins (the router refuses workers of another block size)."""
        if self.events is None:
            self.block_size = block_size
            self.events = EventIndex(block_size)
            self._hasher = PrefixHasher(block_size)

    def __len__(self) -> int:
        return len(self.approx) if self.approx is not None else len(self.events or ())

    def remove_worker(self, slot: int) -> None:
        if self.events is not None:
            self.events.remove_worker(slot)
        if self.approx is not None:
            self.approx.remove_worker(slot)

    def hashes(self, tokens: list[int], salt: str | None) -> list[int]:
        """The published names of a prompt's full blocks (the chain the workers compute)."""
        assert self._hasher is not None, "no worker has joined yet"
        return self._hasher.hashes(tokens, salt)

    def overlaps(self, relay: Relay, mask: int, now: float) -> dict[int, int]:
        """For each worker slot in `mask`, the leading blocks of the request's prompt it holds."""
        req = relay.req
        if self.approx is not None:
            self.approx.expire(now)
            if relay.hashes is None:  # all of them: the approximate index records them
                relay.hashes = self.hashes(req.prompt_token_ids, request_salt(req))
            return self.approx.overlaps(relay.hashes, mask)
        if self.events is None:
            return {}
        return self.events.overlaps(req.prompt_token_ids, request_salt(req), mask)

    def placed(self, slot: int, relay: Relay, now: float) -> None:
        """A request went to `slot`: the approximate index takes its prompt to be there for a while."""
        if self.approx is not None and relay.hashes:
            self.approx.record(slot, relay.hashes, now)
