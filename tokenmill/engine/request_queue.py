"""The waiting queue: first come first served, by (priority, arrival time), or fair shares between
tenants within priority bands (engine/fairness.py)."""

from __future__ import annotations

import bisect
from collections import deque

from tokenmill.config import SchedulerConfig
from tokenmill.engine.fairness import FairQueue, parse_tenant_weights
from tokenmill.engine.request import Request


def make_waiting_queue(config: SchedulerConfig) -> WaitingQueue | FairQueue[Request]:
    if config.policy == "fair":
        return FairQueue(
            parse_tenant_weights(config.tenant_weights), config.fair_input_weight, config.fair_output_weight
        )
    return WaitingQueue(config.policy)


class WaitingQueue:
    def __init__(self, policy: str) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs', 'priority' or 'fair', got {policy!r}")
        self.by_priority = policy == "priority"
        self._fcfs: deque[Request] = deque()
        self._sorted: list[tuple[tuple[int, float], int, Request]] = []
        self._seq = 0  # tie-breaker keeps insertion order among equal keys

    def __len__(self) -> int:
        return len(self._sorted) if self.by_priority else len(self._fcfs)

    def __iter__(self):
        return (e[2] for e in self._sorted) if self.by_priority else iter(self._fcfs)

    def push(self, req: Request) -> None:
        if self.by_priority:
            self._seq += 1
            bisect.insort(self._sorted, (req.sort_key(), self._seq, req), key=lambda e: (e[0], e[1]))
        else:
            self._fcfs.append(req)

    def push_front(self, req: Request) -> None:
        """Put back a request that had left the queue (preempted, loaded, no LoRA slot yet): it goes
        before every request that arrived after it."""
        if self.by_priority:
            self.push(req)  # its (priority, arrival) key already places it
        else:
            self._fcfs.appendleft(req)

    def peek(self) -> Request:
        return self._sorted[0][2] if self.by_priority else self._fcfs[0]

    def pop(self) -> Request:
        return self._sorted.pop(0)[2] if self.by_priority else self._fcfs.popleft()

    def victim_key(self, req: Request) -> tuple[int, float]:
        """Priority preemption pushes out the least urgent, latest arrived request first."""
        return req.sort_key()

    def charge(self, req: Request, n_in: int, n_out: int) -> None:
        """Service is not what orders this queue."""

    def done(self, req: Request) -> None:
        """Nothing is kept of a request once it leaves this queue."""

    def remove(self, req: Request) -> bool:
        if self.by_priority:
            for i, e in enumerate(self._sorted):
                if e[2] is req:
                    del self._sorted[i]
                    return True
            return False
        try:
            self._fcfs.remove(req)
            return True
        except ValueError:
            return False
