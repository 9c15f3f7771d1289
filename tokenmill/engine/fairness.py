"""Fair shares between tenants: virtual token counters over priority bands (the `fair` policy).

A tenant is a name a request carries (`EngineRequest.tenant`: the server sets it from the API key's
name or a header); requests without one are the tenant `default`. Each request's `priority` is its
band: a lower band is always served first, as with the `priority` policy. Within a band, the waiting
queue serves the tenant that has been served least, by a virtual token counter per tenant (Sheng et
al., "Fairness in Serving Large Language Models", OSDI 2024):

- a tenant's counter grows by the tokens it is served, weighted: prompt tokens as they are computed
  (chunk by chunk; prefix-cache hits cost nothing) times `input_weight`, generated tokens step by step
  times `output_weight`, all divided by the tenant's share weight (`a=2` gets twice the service of a
  tenant of weight 1 before they are even);
- the backlogged tenant (one with a request waiting in the band) with the smallest counter goes first;
  its oldest waiting request is the one admitted;
- a tenant that becomes active again (a new request, after a time with nothing waiting or running in
  the band) is lifted to the smallest counter among the band's backlogged tenants (to the counter of
  the last tenant that left the backlog when there are none), so that time spent idle banks no credit.
  A request that goes back to the queue (preempted, its KV load done, no LoRA slot free yet) lifts
  nothing: its tenant never stopped being served.

Each band keeps counters of its own: service in one band is not held against a tenant in another.
Priorities past BAND_RANGE are in its end bands, so the bands (and their counters) are bounded.
Nothing here knows the engine: items need `priority`, `tenant` and `arrival_time`, so a router can
order its own queue with the same class.
"""

from __future__ import annotations

import re
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from typing import Generic, Protocol, TypeVar

DEFAULT_TENANT = "default"
OTHER_TENANT = "other"  # where the tenants past MAX_TENANTS are counted
MAX_TENANTS = 256  # tenant names one engine keeps apart besides the configured ones (metrics stay bounded)
MAX_TENANT_NAME = 128  # characters
# What a tenant may be called (a key's name, a header's value, a name in a flag): no spaces, commas,
# quotes or `=`, so that it reads the same in a flag, a log line and a Prometheus label.
TENANT_NAME = re.compile(rf"[A-Za-z0-9._@/+-]{{1,{MAX_TENANT_NAME}}}")
# Counters of tenants that left their band's backlog are pruned past this many (only those a lift would
# raise anyway, so nothing is lost).
PRUNE_AT = 1024
# The bands the fair queue keeps apart: a priority below or above is in the end band.
BAND_RANGE = (-32, 32)


def band_of(priority: int) -> int:
    lo, hi = BAND_RANGE
    return min(max(priority, lo), hi)


def name_values(text: str | None) -> Iterator[tuple[str, str, str | None]]:
    """`a=2, b=1` -> ("a=2", "a", "2"), ("b=1", "b", "1"): a comma-separated NAME=VALUE list's entries
    (value None where an entry has no `=`), for each flag's own checks."""
    for entry in (text or "").split(","):
        entry = entry.strip()
        if entry:
            name, sep, value = (s.strip() for s in entry.partition("="))
            yield entry, name, value if sep else None


def parse_tenant_weights(text: str | None) -> dict[str, float]:
    """`a=2,b=1` -> {"a": 2.0, "b": 1.0}; ValueError naming a bad entry. Tenants not named weigh 1."""
    weights: dict[str, float] = {}
    for entry, name, value in name_values(text):
        try:
            weight = float(value) if value is not None else float("nan")
        except ValueError:
            weight = float("nan")
        if not TENANT_NAME.fullmatch(name) or not 0 < weight < float("inf"):
            raise ValueError(
                f"tenant weights are NAME=WEIGHT (a positive number; NAME 1 to {MAX_TENANT_NAME} letters, "
                f"digits or ._@/+-), comma-separated: {entry!r}"
            )
        weights[name] = weight
    return weights


def parse_tenant_names(text: str | None) -> list[str]:
    """`a,b` -> ["a", "b"]: tenant names, each checked (ValueError naming a bad one)."""
    names = []
    for name in (text or "").split(","):
        name = name.strip()
        if not name:
            continue
        if not TENANT_NAME.fullmatch(name):
            raise ValueError(
                f"a tenant name is 1 to {MAX_TENANT_NAME} letters, digits or ._@/+-, got {name!r}"
            )
        names.append(name)
    return names


class Fairable(Protocol):
    priority: int
    tenant: str
    arrival_time: float


T = TypeVar("T", bound=Fairable)


class BandCounters:
    """The virtual token counters of one band, who is backlogged in it (has a request waiting), and
    who is active (has a request in it at all: waiting, running, or aside)."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.backlogged: set[str] = set()
        self.active: dict[str, int] = {}  # tenant -> its requests in the band, not done
        self.last_left: str | None = None

    def value(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def level(self) -> float | None:
        """What a tenant becoming active is lifted to (None: nobody to compare with yet)."""
        if self.backlogged:
            return min(self.value(t) for t in self.backlogged)
        return None if self.last_left is None else self.value(self.last_left)

    def arrive(self, tenant: str) -> None:
        """A new request of `tenant`: if it had none in the band, lift it, so idle time banks nothing."""
        n = self.active.get(tenant, 0)
        if n == 0:
            level = self.level()
            if level is not None and self.value(tenant) < level:
                self.counters[tenant] = level
        self.active[tenant] = n + 1

    def done(self, tenant: str) -> None:
        """One of `tenant`'s requests in the band ended."""
        n = self.active.get(tenant, 0) - 1
        if n > 0:
            self.active[tenant] = n
        else:
            self.active.pop(tenant, None)

    def join(self, tenant: str) -> None:
        self.backlogged.add(tenant)

    def leave(self, tenant: str) -> None:
        self.backlogged.discard(tenant)
        self.last_left = tenant
        if len(self.counters) > PRUNE_AT:
            self.prune()

    def charge(self, tenant: str, cost: float) -> None:
        self.counters[tenant] = self.value(tenant) + cost

    def prune(self) -> None:
        """Forget idle tenants a lift would raise to the level anyway (the level never falls). An active
        tenant keeps its counter: it is not lifted when it queues again."""
        level = self.level()
        if level is None:
            return
        keep = self.backlogged | self.active.keys() | {self.last_left}
        for t in [t for t, c in self.counters.items() if c <= level and t not in keep]:
            del self.counters[t]


class FairQueue(Generic[T]):
    """The waiting queue of the `fair` policy: lowest band first, then the backlogged tenant with the
    smallest virtual token counter, then that tenant's oldest request (preempted ones go back first).

    `push` is a new request, `push_front` one going back to the queue, `done` a request that ended
    (wherever it was); `charge` is how service is counted: the scheduler calls it as tokens are
    scheduled and generated."""

    # The scheduler's priority preemption applies: a waiting request of a lower band may push out
    # running requests of a higher band.
    by_priority = True

    def __init__(
        self,
        weights: dict[str, float] | None = None,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
    ) -> None:
        self.weights = dict(weights or {})
        self.input_weight, self.output_weight = input_weight, output_weight
        self._bands: dict[int, BandCounters] = {}  # at most one per band of BAND_RANGE
        self._queues: dict[int, dict[str, deque[T]]] = {}  # band -> tenant -> its waiting requests
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[T]:
        """In band order (within a band, tenant by tenant: not the order they will be served in)."""
        for band in sorted(self._queues):
            for q in self._queues[band].values():
                yield from q

    def band(self, band: int) -> BandCounters:
        band = band_of(band)
        state = self._bands.get(band)
        if state is None:
            state = self._bands[band] = BandCounters()
        return state

    def counter(self, item: T) -> float:
        state = self._bands.get(band_of(item.priority))
        return 0.0 if state is None else state.value(item.tenant)

    def _put(self, item: T, front: bool) -> None:
        band = band_of(item.priority)
        queues = self._queues.setdefault(band, {})
        q = queues.get(item.tenant)
        if q is None:
            q = queues[item.tenant] = deque()
            self.band(band).join(item.tenant)
        if front:
            q.appendleft(item)
        else:
            q.append(item)
        self._len += 1

    def push(self, item: T) -> None:
        """A new request: last of its tenant's in its band; its tenant is lifted if it was idle there."""
        self.band(item.priority).arrive(item.tenant)
        self._put(item, front=False)

    def add(self, item: T) -> None:
        """Queue a request whose arrival was already counted (`band(...).arrive`): last of its tenant's
        in its band, nobody lifted (a router's request that waited elsewhere first)."""
        self._put(item, front=False)

    def push_front(self, item: T) -> None:
        """Put back a request that had left the queue (preempted, loaded, no LoRA slot yet): first of its
        tenant's in its band, and its tenant's counter as it is."""
        self._put(item, front=True)

    def done(self, item: T) -> None:
        """`item` ended, wherever it was (take it out of the queue first if it waits there)."""
        self.band(item.priority).done(item.tenant)

    def _head(self) -> tuple[int, str]:
        if not self._len:
            raise IndexError("the waiting queue is empty")
        band = min(self._queues)
        queues, state = self._queues[band], self._bands[band]
        tenant = min(queues, key=lambda t: (state.value(t), queues[t][0].arrival_time, t))
        return band, tenant

    def peek(self) -> T:
        band, tenant = self._head()
        return self._queues[band][tenant][0]

    def pop(self) -> T:
        band, tenant = self._head()
        q = self._queues[band][tenant]
        item = q.popleft()
        self._taken(band, tenant, q)
        return item

    def remove(self, item: T) -> bool:
        band = band_of(item.priority)
        q = self._queues.get(band, {}).get(item.tenant)
        if q is None:
            return False
        try:
            q.remove(item)
        except ValueError:
            return False
        self._taken(band, item.tenant, q)
        return True

    def _taken(self, band: int, tenant: str, q: deque[T]) -> None:
        self._len -= 1
        if q:
            return
        queues = self._queues[band]
        del queues[tenant]
        if not queues:
            del self._queues[band]
        self._bands[band].leave(tenant)

    def cost(self, tenant: str, n_in: int, n_out: int) -> float:
        return (n_in * self.input_weight + n_out * self.output_weight) / self.weights.get(tenant, 1.0)

    def charge(self, item: T, n_in: int, n_out: int) -> None:
        """`item` was served n_in prompt tokens and n_out generated ones."""
        self.band(item.priority).charge(item.tenant, self.cost(item.tenant, n_in, n_out))

    def victim_key(self, item: T) -> tuple[int, float, float]:
        """What preemption pushes out first (the largest): the highest band, then the tenant served
        most there, then the latest arrival."""
        return (band_of(item.priority), self.counter(item), item.arrival_time)


class TenantLedger:
    """The engine's tenant names and what each was served since it got its name (prompt tokens
    computed, tokens generated).

    `known` names (configured: the server's named keys, --tenant-weights, --known-tenants) and
    `default` and `other` are kept for good. Other names are kept while they have requests, up to
    `limit` of them: a new name past that takes the place of the least recently used one with no
    request waiting or running (its counts are forgotten), or is counted and scheduled as `other`
    when every one of them is busy. So the names (and the metrics' labels) number at most
    len(known) + limit + 2."""

    def __init__(self, limit: int = MAX_TENANTS, known: Iterable[str] = ()) -> None:
        self.limit = limit
        self.known = {DEFAULT_TENANT, OTHER_TENANT, *known}
        self.tokens: dict[str, list[int]] = {}
        self.active: dict[str, int] = {}  # name -> its requests not finished
        self._lru: OrderedDict[str, None] = OrderedDict()  # the names not known, least recently used first

    def name(self, tenant: str | None) -> str:
        """The name a request of `tenant` is counted and scheduled under (it is not counted active)."""
        if not tenant:
            return DEFAULT_TENANT
        if tenant in self.known:
            return tenant
        if tenant in self._lru:
            self._lru.move_to_end(tenant)
            return tenant
        if len(self._lru) >= self.limit:
            idle = next((t for t in self._lru if not self.active.get(t)), None)
            if idle is None:
                return OTHER_TENANT
            del self._lru[idle]
            self.tokens.pop(idle, None)
        self._lru[tenant] = None
        return tenant

    def enter(self, tenant: str | None) -> str:
        """A request of `tenant` arrives: its name, counted active until `leave`."""
        name = self.name(tenant)
        self.active[name] = self.active.get(name, 0) + 1
        return name

    def leave(self, name: str) -> None:
        n = self.active.get(name, 0) - 1
        if n > 0:
            self.active[name] = n
        else:
            self.active.pop(name, None)

    def add(self, tenant: str, n_in: int, n_out: int) -> None:
        row = self.tokens.get(tenant)
        if row is None:
            row = self.tokens[tenant] = [0, 0]
        row[0] += n_in
        row[1] += n_out

    def snapshot(self) -> dict[str, list[int]]:
        return {t: list(row) for t, row in self.tokens.items()}
