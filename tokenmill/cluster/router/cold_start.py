"""Requests waiting for a cold start: a fleet scaled to zero (`--workers 0..N` with a planner) has no
worker in rotation, so a new request waits here, bounded in number and in time, while the planner
launches one. A worker that joins takes them in arrival order; one left waiting past the timeout ends
with EngineDeadError (the server's 503), and one beyond the bound is refused at once: nothing waits
forever and nothing is dropped unanswered."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.engine.client import EngineDeadError

if TYPE_CHECKING:
    from tokenmill.cluster.router.relay import Relay

log = logging.getLogger(__name__)

# Upper bounds (seconds) of the wait histogram's buckets: a small model loads in seconds, a big one in
# minutes; the default timeout (120 s) is the last finite bucket.
WAIT_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class ColdStartFullError(EngineDeadError):
    """No worker is running and as many requests as allowed already wait for one."""


@dataclass
class ColdStartStats:
    served: int = 0  # requests that waited and were then sent to a worker
    timed_out: int = 0
    refused: int = 0  # beyond the waiting bound
    # The waits of served requests, as a Prometheus histogram: counts per bucket (cumulated when read).
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS) + 1))
    wait_sum: float = 0.0

    def observe(self, wait: float) -> None:
        self.served += 1
        self.wait_sum += wait
        i = next((k for k, b in enumerate(WAIT_BUCKETS) if wait <= b), len(WAIT_BUCKETS))
        self.bucket_counts[i] += 1

    def buckets(self) -> list[tuple[str, int]]:
        """(upper bound, cumulative count) as prometheus_client's HistogramMetricFamily takes them."""
        out, total = [], 0
        for b, n in zip([*map(str, WAIT_BUCKETS), "+Inf"], self.bucket_counts, strict=True):
            total += n
            out.append((b, total))
        return out


class ColdStartQueue:
    def __init__(self, timeout_s: float, max_waiting: int) -> None:
        self.timeout_s, self.max_waiting = timeout_s, max_waiting
        self.waiting: collections.OrderedDict[str, tuple[float, Relay]] = collections.OrderedDict()
        self.stats = ColdStartStats()
        # Called (at once, from the request's own call) whenever a request starts to wait: the planner
        # launches a worker now rather than at its next interval.
        self.on_wait: Callable[[], None] | None = None

    def __len__(self) -> int:
        return len(self.waiting)

    def park(self, relay: Relay) -> None:
        if len(self.waiting) >= self.max_waiting:
            if relay.tries == 0:  # a retry asks again every poll until it gives up: count requests, once
                self.stats.refused += 1
            raise ColdStartFullError(
                f"no worker is running and {len(self.waiting)} requests already wait for one to start; "
                "retry shortly"
            )
        if relay.parked_since is None:
            relay.parked_since = time.monotonic()
        self.waiting[relay.req.request_id] = (relay.parked_since, relay)

    def wake(self) -> None:
        """Ask the planner for a worker (called once the waiting request can be found for abort)."""
        if self.on_wait is not None:
            try:
                self.on_wait()
            except Exception:  # noqa: BLE001 - the request waits on; the watcher asks again
                log.exception("cold start: asking the planner for a worker failed")

    def take_all(self) -> list[tuple[float, Relay]]:
        """Every waiting request, oldest first, no longer waiting."""
        got = list(self.waiting.values())
        self.waiting.clear()
        return got

    def put_back(self, since: float, relay: Relay) -> None:
        """A request taken that found no worker after all: it waits on, from its first arrival."""
        self.waiting[relay.req.request_id] = (since, relay)

    def drop(self, request_id: str) -> bool:
        """Forget an aborted request; whether it was waiting."""
        return self.waiting.pop(request_id, None) is not None

    def expired(self, now: float) -> list[Relay]:
        """The requests that have waited longer than the timeout, no longer waiting."""
        # (all of them looked at: a request put back is out of arrival order; there are few)
        late = [rid for rid, (since, _) in self.waiting.items() if now - since > self.timeout_s]
        out = [self.waiting.pop(rid)[1] for rid in late]
        self.stats.timed_out += len(out)
        return out
