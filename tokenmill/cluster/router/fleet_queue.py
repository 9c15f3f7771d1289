"""The router's own waiting queue (`--router-queue`): while every worker is full, a new request waits at
the router rather than in one worker's queue, and the first place to free up anywhere in the fleet goes
to the request the engine's own policy would pick: lowest priority band first, then (under `fair`) the
tenant served fewest tokens across the whole fleet.

Without it each worker is fair only among the requests it was sent: a tenant whose requests the kv or
session policy keeps on one worker gets at most that worker, while a flood spread over the fleet takes
every place the others free (less than its share whenever that is more than one worker's worth).
llm-d's flow control holds requests at its gateway for the same reason.

A worker is full when the router has as many requests on it as it runs at once (`max_num_seqs`, from
the worker's own description) or when its last stats show a request waiting in its engine (KV blocks ran
short first). An idle or half-busy fleet pays nothing: nothing waits here while any worker has room.

The order is the engine's `FairQueue` over the router's relays. Tenants' virtual token counters are
charged from what the workers report as it streams back: with a request's first token, the prompt
tokens its engine computed (prefix-cache hits are free, as in the engine), then each token generated.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.engine.fairness import DEFAULT_TENANT, FairQueue, TenantLedger, band_of

if TYPE_CHECKING:
    from tokenmill.cluster.router.relay import Relay
    from tokenmill.cluster.router.worker import Worker


@dataclass
class FleetQueueStats:
    held: int = 0  # requests that waited here for a place
    released: int = 0  # ... and were then sent to a worker
    wait_sum: float = 0.0  # seconds the released ones waited, summed


class FleetQueue:
    def __init__(
        self,
        max_in_flight: int,
        fair: bool,
        weights: dict[str, float] | None = None,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"the router queue needs max_in_flight >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight  # a worker that does not say its own max_num_seqs
        self.fair = fair  # tenants kept apart (the fair policy); else one tenant: bands, then arrival
        self.queue: FairQueue[Relay] = FairQueue(weights, input_weight, output_weight)
        # Tenant names bounded as the engine bounds them (256 besides the configured ones, then `other`),
        # so a client rotating its tenant header cannot grow the router's state or its choices' cost.
        self.ledger = TenantLedger(known=(weights or {}).keys())
        self.held: dict[str, tuple[float, Relay]] = {}  # request id -> (when it began to wait, relay)
        self.counted: dict[str, Relay] = {}  # requests counted active in their band, until they end
        self.stats = FleetQueueStats()

    def __len__(self) -> int:
        return len(self.held)

    def tenant(self, tenant: str | None) -> str:
        return self.ledger.name(tenant) if self.fair else DEFAULT_TENANT

    def places(self, w: Worker) -> int:
        """How many more requests a worker takes now (0: full)."""
        stats = w.client.stats if w.client is not None else None
        if stats is not None and stats.num_waiting > 0:
            return 0  # its engine already queues (KV blocks or its token budget ran short first)
        return max(int(w.info.get("max_num_seqs") or self.max_in_flight) - len(w.active), 0)

    def full(self, w: Worker) -> bool:
        return self.places(w) == 0

    def has_room(self, workers: Iterable[Worker], promised: int = 0) -> bool:
        """Whether the workers have a place free beyond `promised` ones (requests on their way to a
        worker that hold none yet: prefilling on a prefill worker)."""
        free = 0
        for w in workers:
            free += self.places(w)
            if free > promised:
                return True
        return False

    @staticmethod
    def preemptible(workers: Iterable[Worker], priority: int) -> list[Worker]:
        """The workers running a request of a less urgent band than `priority`: there the engine's own
        priority preemption makes room for it, so it does not wait here."""
        band = band_of(priority)
        return [w for w in workers if w.bands and max(w.bands) > band]

    # -- a request's life -----------------------------------------------------------------------
    def arrive(self, relay: Relay) -> None:
        """A new request that goes to a worker at once: its tenant is active in its band (lifted to the
        band's level if it was idle there, so idle time banks no credit)."""
        self.queue.band(relay.priority).arrive(relay.tenant)
        self._count(relay)

    def hold(self, relay: Relay) -> None:
        """Wait for a place: a new request (its tenant made active, as with `arrive`), or one already
        counted that waited elsewhere first (for a cold start)."""
        rid = relay.req.request_id
        if rid in self.counted:
            self.queue.add(relay)
        else:
            self.queue.push(relay)
            self._count(relay)
        self.held[rid] = (time.monotonic(), relay)
        self.stats.held += 1

    def _count(self, relay: Relay) -> None:
        self.counted[relay.req.request_id] = relay
        if self.fair:
            self.ledger.enter(relay.tenant)

    def next(self) -> Relay:
        """The request the next free place goes to, no longer waiting."""
        relay = self.queue.pop()
        since, _ = self.held.pop(relay.req.request_id)
        self.stats.released += 1
        self.stats.wait_sum += time.monotonic() - since
        return relay

    def drop(self, request_id: str) -> bool:
        """Forget a request that ended while it waited (aborted); whether it was waiting."""
        got = self.held.pop(request_id, None)
        if got is None:
            return False
        self.queue.remove(got[1])
        return True

    def ended(self, request_id: str) -> None:
        """A request ended, wherever it was: its tenant stops being active for it."""
        relay = self.counted.pop(request_id, None)
        if relay is not None:
            self.queue.done(relay)
            if self.fair:
                self.ledger.leave(relay.tenant)

    def charge(self, relay: Relay, n_in: int, n_out: int) -> None:
        self.queue.charge(relay, n_in, n_out)
