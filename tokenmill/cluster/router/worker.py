"""One worker of the fleet as the router sees it: its connection, its state in rotation, and the load
the router has put on it (kept as running sums, so a decision never costs O(requests))."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from tokenmill.cluster.kv_subscriber import KVEventSubscriber
from tokenmill.cluster.policies.base import DEFAULT_PREFILL_WEIGHT
from tokenmill.cluster.router.settings import SUSPECT_AFTER_S
from tokenmill.engine.client import ZmqEngineClient


@dataclass
class Active:
    prefill_blocks: int  # uncached blocks still to prefill (until the first token)
    blocks: int
    started: bool = False
    band: int = 0  # its priority band (the router's queue sends an urgent request where it can preempt)


@dataclass
class Worker:
    slot: int
    url: str
    name: str = ""  # its label in metrics (the url, or local-N for a worker launched here)
    client: ZmqEngineClient | None = None
    subscriber: KVEventSubscriber | None = None
    up: bool = False
    joining: bool = False
    last_attempt: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    active: dict[str, Active] = field(default_factory=dict)
    joins: int = 0
    last_error: str | None = None  # why its last attempt to join failed
    # An attempt to join failed before it ever joined: a launch that failed (sticky: each new attempt
    # clears last_error, and health must not flap with the attempts).
    start_failed: bool = False
    discovered: bool = False  # found by discovery (and so dropped when discovery loses it)
    retired: bool = False  # dropped from the fleet; its slot may be taken by a new worker
    draining: bool = False  # gets no new requests: it finishes what it has, then leaves (the planner)
    role: str | None = None  # its part in a disaggregated fleet, as launched (known before it joins)
    launched_at: float = field(default_factory=time.monotonic)
    left_planned: bool = False  # its last departure was planned (scaled down, drained on SIGTERM)
    # Running sums over `active` (kept, not recomputed: a decision must not cost O(requests)), read
    # through the properties below: uncached prompt blocks of requests without a token yet, and blocks
    # of requests that are generating.
    _prefill_blocks: int = 0
    _decode_blocks: int = 0
    # prefill_weight x prefill_blocks + decode_blocks: the kv cost of a request it holds nothing of,
    # less the request's own blocks; written also to the candidate lists it sits in (`seats`).
    prefill_weight: float = DEFAULT_PREFILL_WEIGHT
    base: float = 0.0
    seats: list[tuple[list[float], int]] = field(default_factory=list)
    bands: Counter = field(default_factory=Counter)  # band -> its requests in `active`

    @property
    def prefill_blocks(self) -> int:
        return self._prefill_blocks

    @prefill_blocks.setter
    def prefill_blocks(self, n: int) -> None:
        self._prefill_blocks = n
        self._moved()

    @property
    def decode_blocks(self) -> int:
        return self._decode_blocks

    @decode_blocks.setter
    def decode_blocks(self, n: int) -> None:
        self._decode_blocks = n
        self._moved()

    def weigh(self, prefill_weight: float) -> None:
        self.prefill_weight = prefill_weight
        self._moved()

    def _moved(self) -> None:
        b = self.prefill_weight * self._prefill_blocks + self._decode_blocks
        self.base = b
        for bases, i in self.seats:
            bases[i] = b

    def add_active(self, rid: str, a: Active) -> None:
        self.active[rid] = a
        self.bands[a.band] += 1
        self._prefill_blocks += a.prefill_blocks
        self._moved()

    def start_active(self, rid: str) -> None:
        a = self.active.get(rid)
        if a is not None and not a.started:
            a.started = True
            self._prefill_blocks -= a.prefill_blocks
            self._decode_blocks += a.blocks
            self._moved()

    def drop_active(self, rid: str) -> None:
        a = self.active.pop(rid, None)
        if a is not None:
            n = self.bands[a.band] - 1
            if n > 0:
                self.bands[a.band] = n
            else:
                del self.bands[a.band]
            if a.started:
                self._decode_blocks -= a.blocks
            else:
                self._prefill_blocks -= a.prefill_blocks
            self._moved()

    def clear_active(self) -> None:
        self.active.clear()
        self.bands.clear()
        self._prefill_blocks = self._decode_blocks = 0
        self._moved()

    def answering(self, now: float) -> bool:
        """Gets new requests: up, connected, not known dead (the supervisor drops dead ones within
        0.1 s, but a retry may look sooner) and heard from within SUSPECT_AFTER_S."""
        c = self.client
        return self.up and c is not None and c.dead_reason is None and now - c.last_heard < SUSPECT_AFTER_S

    def serving(self) -> bool:
        """In rotation: up and draining neither by the router's choice (scale-down) nor by its own
        (after a SIGTERM)."""
        return self.up and not self.draining and not self.stopping()

    def usable(self) -> bool:
        """Serving and connected, not known dead: may get a request if it also answers."""
        c = self.client
        return self.serving() and c is not None and c.dead_reason is None

    def stopping(self) -> bool:
        """It said it is draining (SIGTERM): its leaving is planned, not a loss."""
        stats = self.client.stats if self.client is not None else None
        return stats is not None and stats.draining


def fits(w: Worker, role: str | None) -> bool:
    """Whether a worker takes requests of a role: prefill ones need a worker that serves its blocks;
    decode ones (and all requests of an undivided fleet) go anywhere but to a prefill-only worker."""
    kv_role = w.info.get("kv_role")
    if role == "prefill":
        return kv_role in ("prefill", "both")
    if role == "decode":
        return kv_role != "prefill"
    return True


def in_pool(w: Worker, pool: str | None) -> bool:
    """Whether a worker belongs to a pool of a disaggregated fleet (None: the whole fleet). A worker's
    launched role counts before it has joined and said its own."""
    if pool is None:
        return True
    role = w.role or w.info.get("kv_role")
    return (role == "prefill") == (pool == "prefill")


def reachable(endpoint: str, worker_url: str) -> str:
    """A bound address (tcp://0.0.0.0:5557) as seen from here: the worker's host instead of a wildcard."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host in ("0.0.0.0", "*", "[::]", "::"):
        host = urlparse(worker_url.replace("tcp://", "http://", 1)).hostname or "127.0.0.1"
    return f"tcp://{host}:{port}"
