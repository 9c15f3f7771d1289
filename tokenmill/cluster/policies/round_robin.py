"""`round-robin`: each request to the next worker in slot order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.cluster.policies.base import DEFAULT_PREFILL_WEIGHT, Candidates, RoutingPolicy

if TYPE_CHECKING:
    from tokenmill.cluster.router.worker import Worker
    from tokenmill.engine.protocol import EngineRequest


class RoundRobinPolicy(RoutingPolicy):
    name = "round-robin"

    def __init__(
        self, temperature: float = 0.0, prefill_weight: float = DEFAULT_PREFILL_WEIGHT, seed: int = 0
    ) -> None:
        super().__init__(temperature, prefill_weight, seed)
        self._turn = 0

    def choose(
        self, cands: Candidates, overlaps: dict[int, int], blocks: int, req: EngineRequest | None
    ) -> Worker:
        self._turn += 1
        ws = cands.workers  # the router lists workers in slot order
        return ws[self._turn % len(ws)]
