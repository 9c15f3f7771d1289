"""The waiting queue: first come first served, or by (priority, arrival time)."""

from __future__ import annotations

import bisect
from collections import deque

from tokenmill.engine.request import Request


class WaitingQueue:
    def __init__(self, policy: str) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
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
        """Put back a preempted request: it goes before every request that arrived after it."""
        if self.by_priority:
            self.push(req)  # its (priority, arrival) key already places it
        else:
            self._fcfs.appendleft(req)

    def peek(self) -> Request:
        return self._sorted[0][2] if self.by_priority else self._fcfs[0]

    def pop(self) -> Request:
        return self._sorted.pop(0)[2] if self.by_priority else self._fcfs.popleft()

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
