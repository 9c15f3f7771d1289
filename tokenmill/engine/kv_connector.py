"""The scheduler's side of a KV connector: the seam through which KV blocks enter and leave the
engine's pool from outside it (offload tiers; a prefill engine's blocks under disaggregation). Its
worker side, the registry that names both, and how several are chained are in
worker/kv_connector.py.

The scheduler asks it, at admission, how many blocks past the pool's own prefix hits can be loaded,
and whether that happens within the step (the request computes at once) or in the background (the
request waits in WAITING_FOR_KV, holding its blocks, until the workers report them). It hears of every
block the pool evicts, and gives each step its metadata for the worker's side (plain data).

`MultiConnector` chains several: at admission each is asked in turn for the blocks after those the
ones before it can load (the first that can load a block range wins it), so a decode engine with
offload tiers takes a prompt's leading blocks from its own tiers and the rest from the prefill engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from tokenmill.engine.block_pool import KVBlock
from tokenmill.engine.kv_events import KVEvent
from tokenmill.engine.request import Request
from tokenmill.worker.kv_connector import connector_class
from tokenmill.worker.step import KVConnectorOutput

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.worker.kv_spec import KVCacheSpec


@dataclass
class KVSchedulerContext:
    """What a scheduler side is built from: the engine's configuration and pool, and what the workers
    said of themselves."""

    config: EngineConfig
    block_size: int
    num_blocks: int
    specs: list[KVCacheSpec]  # every rank's block, in rank order
    # Every rank's describe() of this connector's worker side, in rank order.
    worker_info: list[dict[str, Any]]
    tp_size: int = 1
    pp_size: int = 1
    # The engine's KV event list (None: events off), where a connector publishes its own tiers' events,
    # and whether the pool still holds a block hash.
    events: list[KVEvent] | None = None
    is_cached: Callable[[bytes], bool] | None = None
    secrets: dict[str, bytes] = field(default_factory=dict)  # the same the ranks were given

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def engine_block_bytes(self) -> int:
        """Bytes of one block over all ranks (each holds its heads' or layers' part)."""
        return sum(s.block_bytes for s in self.specs)


class KVConnectorScheduler(ABC):
    name: ClassVar[str] = ""

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        """ValueError if the configuration cannot work with this connector: called before any worker
        starts, so a bad setting fails with its reason rather than in a rank."""
        return None

    @classmethod
    def build(cls, ctx: KVSchedulerContext) -> KVConnectorScheduler:
        raise NotImplementedError(f"{cls.__name__} is not built from a configuration")

    @abstractmethod
    def num_external_blocks(self, req: Request, num_local_blocks: int) -> tuple[int, bool]:
        """Blocks of the request's prompt, after its first `num_local_blocks` (pool hits), that can be
        loaded from outside; and True when loading them must happen in the background."""

    @abstractmethod
    def after_alloc(self, req: Request, blocks: list[KVBlock], first: int, background: bool) -> None:
        """The pool gave `blocks` for the request's blocks first, first+1, ...: load them."""

    @abstractmethod
    def on_evicted(self, block: KVBlock) -> None:
        """The pool is about to reuse `block`, which still holds (and is still named by) its content."""

    @abstractmethod
    def build_meta(self) -> Any:
        """This step's metadata for the worker's side (plain data), or None; resets the step's state."""

    def flush_meta(self, cached: list[tuple[bytes, int]]) -> Any:
        """Metadata that writes everything worth keeping (`cached`: the pool's named blocks) to tiers
        that outlive the process; None when there are none."""
        return None

    @abstractmethod
    def loaded(self, request_id: str, num_ok: int) -> tuple[int, int]:
        """A background load ended with `num_ok` good blocks (as the worker counts them): the request's
        first block loaded, and how many leading blocks from there now hold their content."""

    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Called as a request finishes, before its blocks are freed: whether to keep them (until
        `released` or `expired` names it), and what to tell the client of it (plain data)."""
        return False, None

    def released(self, request_ids: list[str]) -> list[str]:
        """Readers are done with these kept requests: those whose blocks may now be freed."""
        return []

    def expired(self, now: float) -> list[str]:
        """Kept requests whose blocks are freed now although nobody said so."""
        return []

    def check_request(self, kv_transfer: dict[str, Any] | None) -> None:
        """A request's (already well-formed) kv_transfer on arrival: ValueError if this engine cannot
        serve it, so that request fails alone."""
        return None

    def on_worker_events(self, events: list[tuple[str, str, bytes]]) -> None:
        """Changes the worker side made on its own ((kind, tier, key)), for the KV events."""
        return None

    def update_from_workers(self, out: KVConnectorOutput) -> tuple[dict[str, int], list[str]]:
        """The workers' report of a step: background loads that ended (request id -> `num_ok` for
        `loaded`) and kept requests whose blocks may now be freed."""
        self.on_worker_events(out.events.get(self.name, []))
        sends = out.sends_done.get(self.name)
        return dict(out.loads_done.get(self.name, {})), self.released(sends) if sends else []

    def take_events(self) -> list[KVEvent]:
        return []

    def counters(self) -> dict[str, int]:
        return {}


@dataclass
class _Load:
    """A chain's background load of one request: each connector's block range, in order."""

    first: int
    parts: list[tuple[KVConnectorScheduler, int, bool]]  # (connector, blocks, in the background)
    reported: dict[str, int] = field(default_factory=dict)  # connector name -> its num_ok


class MultiConnector(KVConnectorScheduler):
    """Several connectors as one. Admission asks each in chain order for the blocks after those the
    ones before it took; the request's load is background if any part is, and done when each part's
    connector has reported. Evictions go to every connector (each keeps what it wants), a finished
    request to every connector (its blocks are kept while any keeps them), and each step's metadata is a
    dict of every connector's own, by name."""

    name = "multi"

    def __init__(self, connectors: list[KVConnectorScheduler]) -> None:
        self.connectors = connectors
        self.by_name = {c.name: c for c in connectors}
        # Request id -> (connector, blocks, background) as the last num_external_blocks found them; only
        # for this step (after_alloc follows in the same schedule()).
        self._plans: dict[str, list[tuple[KVConnectorScheduler, int, bool]]] = {}
        self._loading: dict[str, _Load] = {}
        # Request id -> loaded()'s answer, for the loads update_from_workers found done: the scheduler
        # asks right after (or not at all, for a request it no longer waits for), so only until the next.
        self._done: dict[str, tuple[int, int]] = {}
        self._keepers: dict[str, set[str]] = {}  # request id -> connectors keeping its blocks

    def __getitem__(self, name: str) -> KVConnectorScheduler:
        return self.by_name[name]

    def num_external_blocks(self, req: Request, num_local_blocks: int) -> tuple[int, bool]:
        plan: list[tuple[KVConnectorScheduler, int, bool]] = []
        total, background = 0, False
        for conn in self.connectors:
            # Every connector is asked, even when earlier ones took every block: one that has nothing
            # left to load may still act on it (a decode engine lets the prefill engine go once the
            # request is in).
            n, bg = conn.num_external_blocks(req, num_local_blocks + total)
            if n:
                plan.append((conn, n, bg))
                total += n
                background |= bg
        self._plans[req.request_id] = plan
        return total, background

    def after_alloc(self, req: Request, blocks: list[KVBlock], first: int, background: bool) -> None:
        plan = self._plans.pop(req.request_id)
        assert sum(n for _, n, _ in plan) == len(blocks), "after_alloc covers what num_external_blocks found"
        offset = 0
        for conn, n, bg in plan:
            # A part that loads within the step (host memory) does so in a background request too: its
            # blocks hold their content once this step's metadata is applied.
            conn.after_alloc(req, blocks[offset : offset + n], first + offset, bg)
            offset += n
        if background:
            self._loading[req.request_id] = _Load(first, plan)

    def loaded(self, request_id: str, num_ok: int) -> tuple[int, int]:
        return self._done.pop(request_id)

    def update_from_workers(self, out: KVConnectorOutput) -> tuple[dict[str, int], list[str]]:
        for conn in self.connectors:
            conn.on_worker_events(out.events.get(conn.name, []))
        self._done.clear()  # answers the scheduler did not ask for (it skipped the request) go
        done: dict[str, int] = {}
        for name, loads in out.loads_done.items():
            for rid, num_ok in loads.items():
                load = self._loading.get(rid)
                if load is None:
                    continue
                load.reported[name] = num_ok
                if all(c.name in load.reported for c, _, bg in load.parts if bg):
                    del self._loading[rid]
                    self._done[rid] = self._join(rid, load)
                    done[rid] = self._done[rid][1]
        released: list[str] = []
        for name, rids in out.sends_done.items():
            conn = self.by_name.get(name)
            if conn is not None:
                released += self._let_go(name, conn.released(rids))
        return done, released

    def _join(self, rid: str, load: _Load) -> tuple[int, int]:
        """The request's leading valid blocks over the chain's parts: each part's own count, up to the
        first part that came short (the request computes from there)."""
        valid = [conn.loaded(rid, load.reported[conn.name])[1] if bg else n for conn, n, bg in load.parts]
        total = 0
        for (_, n, _), v in zip(load.parts, valid, strict=True):
            total += v
            if v < n:
                break
        return load.first, total

    def on_evicted(self, block: KVBlock) -> None:
        for conn in self.connectors:
            conn.on_evicted(block)

    def build_meta(self) -> dict[str, Any] | None:
        self._plans.clear()
        parts = {c.name: m for c in self.connectors if (m := c.build_meta()) is not None}
        return parts or None

    def flush_meta(self, cached: list[tuple[bytes, int]]) -> dict[str, Any] | None:
        parts = {c.name: m for c in self.connectors if (m := c.flush_meta(cached)) is not None}
        return parts or None

    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        keepers: set[str] = set()
        answer: dict[str, Any] | None = None
        for conn in self.connectors:
            keep, said = conn.request_finished(req, block_ids)
            if keep:
                keepers.add(conn.name)
            if said is not None:
                answer = {**(answer or {}), **said}
        if keepers:
            self._keepers[req.request_id] = keepers
        return bool(keepers), answer

    def _let_go(self, name: str, request_ids: list[str]) -> list[str]:
        """Connector `name` no longer keeps these: those nobody keeps any more."""
        out = []
        for rid in request_ids:
            keepers = self._keepers.get(rid)
            if keepers is None:
                continue
            keepers.discard(name)
            if not keepers:
                del self._keepers[rid]
                out.append(rid)
        return out

    def expired(self, now: float) -> list[str]:
        out: list[str] = []
        for conn in self.connectors:
            out += self._let_go(conn.name, conn.expired(now))
        return out

    def check_request(self, kv_transfer: dict[str, Any] | None) -> None:
        for conn in self.connectors:
            conn.check_request(kv_transfer)

    def take_events(self) -> list[KVEvent]:
        return [e for c in self.connectors for e in c.take_events()]

    def counters(self) -> dict[str, int]:
        return {k: v for c in self.connectors for k, v in c.counters().items()}


def build_scheduler_connector(
    names: list[str], contexts: list[KVSchedulerContext]
) -> KVConnectorScheduler | None:
    """The scheduler side of the connectors `names` (each with its context): one connector's own, a
    chain of several, or None."""
    built = []
    for name, ctx in zip(names, contexts, strict=True):
        conn = connector_class(name, "scheduler").build(ctx)
        assert conn.name == name, f"{type(conn).__name__} is registered as {name!r}, named {conn.name!r}"
        built.append(conn)
    if not built:
        return None
    return built[0] if len(built) == 1 else MultiConnector(built)
