"""The index for workers that publish no KV events: built from the router's own decisions.

A request routed to a worker is taken to leave its prompt's blocks there for a while (`ttl_s`; the
worker may evict them sooner or keep them longer, which nobody tells the router). Dynamo's
approximate mode, in the same spirit.
"""

from __future__ import annotations

import heapq

from tokenmill.cluster.kv_index import KVIndex
from tokenmill.engine.kv_events import MEDIUM_DEVICE, BlockRemoved, stored


class ApproxKVIndex(KVIndex):
    def __init__(self, ttl_s: float = 120.0) -> None:
        super().__init__()
        self.ttl_s = ttl_s
        self._expiry: dict[tuple[int, int], float] = {}  # (worker, hash) -> when it is forgotten
        self._heap: list[tuple[float, int, int]] = []

    def record(self, worker: int, hashes: list[int], now: float) -> None:
        until = now + self.ttl_s
        self.apply(worker, [stored(list(hashes), None, [], 0)])  # never published: hashes are all it needs
        for h in hashes:
            self._expiry[(worker, h)] = until
            heapq.heappush(self._heap, (until, worker, h))

    def expire(self, now: float) -> None:
        gone: dict[int, list[int]] = {}
        heap = self._heap
        while heap and heap[0][0] <= now:
            until, worker, h = heapq.heappop(heap)
            if self._expiry.get((worker, h)) == until:  # not renewed by a later request
                del self._expiry[(worker, h)]
                gone.setdefault(worker, []).append(h)
        for worker, hashes in gone.items():
            self.apply(worker, [BlockRemoved(hashes, MEDIUM_DEVICE)])

    def remove_worker(self, worker: int) -> None:
        super().remove_worker(worker)
        for key in [k for k in self._expiry if k[0] == worker]:
            del self._expiry[key]
