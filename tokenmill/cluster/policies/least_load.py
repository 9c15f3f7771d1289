"""`least-load`: the worker with the fewest requests, the router's in flight and the worker's own queue."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.cluster.policies.base import Candidates, RoutingPolicy

if TYPE_CHECKING:
    from tokenmill.cluster.router.worker import Worker
    from tokenmill.engine.protocol import EngineRequest


def queued(w: Worker) -> int:
    stats = w.client.stats if w.client is not None else None
    return len(w.active) + (stats.num_waiting if stats is not None else 0)


class LeastLoadPolicy(RoutingPolicy):
    name = "least-load"

    def choose(
        self, cands: Candidates, overlaps: dict[int, int], blocks: int, req: EngineRequest | None
    ) -> Worker:
        return self.lowest(cands.workers, [float(queued(w)) for w in cands.workers])
