"""`random`: any worker, uniformly (a baseline, and what a plain load balancer does)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.cluster.policies.base import Candidates, RoutingPolicy

if TYPE_CHECKING:
    from tokenmill.cluster.router.worker import Worker
    from tokenmill.engine.protocol import EngineRequest


class RandomPolicy(RoutingPolicy):
    name = "random"

    def choose(
        self, cands: Candidates, overlaps: dict[int, int], blocks: int, req: EngineRequest | None
    ) -> Worker:
        return self.rng.choice(cands.workers)
