"""What a routing policy is: a choice of one worker among those that may take a request, made from
their plain numbers (blocks of the prompt each holds, the load the router has put on each).

The router keeps the candidates ready between membership changes (`Candidates`), with each worker's
load kept current as its requests start and end, so a decision costs a few operations per worker the
prompt touches rather than a loop over the fleet: a fleet of 64 workers routes tens of thousands of
requests a second on one core.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from tokenmill.cluster.router.worker import Worker
    from tokenmill.engine.protocol import EngineRequest


class Candidates:
    """The workers a request may go to, with their load costs (`Worker.base`) side by side in a list the
    workers keep current (their seats), so a policy can take the minimum in one C call."""

    __slots__ = ("workers", "bases", "by_slot", "mask", "seated")

    def __init__(self, workers: Sequence[Worker], seated: bool = False) -> None:
        self.workers = list(workers)
        self.bases = [w.base for w in self.workers]
        self.by_slot = {w.slot: w for w in self.workers}
        self.mask = 0
        for w in self.workers:
            self.mask |= 1 << w.slot
        self.seated = seated
        if seated:  # each worker writes its new base here when its load changes
            for i, w in enumerate(self.workers):
                w.seats.append((self.bases, i))

    def unseat(self) -> None:
        if self.seated:
            for w in self.workers:
                w.seats = [s for s in w.seats if s[0] is not self.bases]
            self.seated = False


# What a prompt block still to prefill weighs against a block of a request that is generating, in the kv
# cost. A new request's first token waits for the prompt work queued ahead of it and for its own; a
# generating request slows each step only a little. 4 was measured on a 2-core CPU
# (benchmarks/kv_routing.py): at 1 the router sent requests to a worker busy with a cold 1024-token
# prefill because its decode count looked lighter, and kv's TTFT p50 fell to 0.72x round-robin's on the
# `shared` family; at 4, 0.98x with a p90 4.7x better. Dynamo's default (1) suits accelerators, on which a
# prefill is cheaper against a step: set --router-prefill-weight there.
DEFAULT_PREFILL_WEIGHT = 4.0


class RoutingPolicy(ABC):
    name: ClassVar[str]
    # Asks the prefix index how many leading blocks of the prompt each candidate holds.
    uses_prefix: ClassVar[bool] = False

    def __init__(
        self, temperature: float = 0.0, prefill_weight: float = DEFAULT_PREFILL_WEIGHT, seed: int = 0
    ) -> None:
        if temperature < 0:
            raise ValueError("router temperature must be >= 0")
        self.temperature, self.prefill_weight = temperature, prefill_weight
        self.rng = random.Random(seed)

    @abstractmethod
    def choose(
        self, cands: Candidates, overlaps: dict[int, int], blocks: int, req: EngineRequest | None
    ) -> Worker:
        """The worker for a request of `blocks` prompt blocks; `overlaps` maps the slots of candidates
        holding some of its leading blocks to how many (empty unless `uses_prefix`)."""

    def lowest(self, workers: Sequence[Worker], costs: list[float]) -> Worker:
        """The worker of the lowest cost (ties: fewer requests in flight, then chance), or with a
        temperature a softmax draw over the costs."""
        if self.temperature > 0 and len(workers) > 1:
            # Softmax over costs normalised by their spread: the temperature means the same at any load.
            lo, hi = min(costs), max(costs)
            span = (hi - lo) or 1.0
            weights = [math.exp(-(c - lo) / span / self.temperature) for c in costs]
            return self.rng.choices(workers, weights)[0]
        best = min(costs)
        if costs.count(best) == 1:  # the usual case, without building the list of ties
            return workers[costs.index(best)]
        return self.fewest_in_flight([w for w, c in zip(workers, costs, strict=True) if c == best])

    def fewest_in_flight(self, tied: list[Worker]) -> Worker:
        fewest = min(len(w.active) for w in tied)
        return self.rng.choice([w for w in tied if len(w.active) == fewest])
