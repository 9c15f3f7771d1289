"""KV connectors: the registry of them, and their worker side.

A KV connector moves KV blocks into and out of the engine's pool from outside it. It has two halves,
one on each side of the step's process boundary, and only plain data crosses between them:

- the scheduler side (engine/kv_connector.py) decides, in the engine process, which blocks move: what a
  request loads at admission, where an evicted block goes, which finished request's blocks are kept
  for a reader; each step it hands the workers its metadata (SchedulerOutput.kv_connector_metadata);
- the worker side (`KVConnectorWorker`, here) holds the bytes on each rank: it carries a step's
  metadata out before the forward pass (`apply`: first what leaves the pool, `save_blocks`, then what
  comes in, `load_blocks`; in a chain every connector's saves before any connector's loads) and
  reports afterwards what finished (`after_step`: a KVConnectorOutput).

`REGISTRY` names each connector and its two classes; the configuration says which are on, and
`connector_names` lists them in chain order. Both sides are built from those names, so the engine
core and the workers never choose a connector themselves. Several connectors at once form a chain
(`MultiConnectorWorker` here, `MultiConnector` in the engine): the metadata is then a dict of each
connector's own, keyed by name.

Under tensor or pipeline parallelism every rank has its own worker side, for its own heads or layers
of each block, and reports for itself; `RankCombiner` joins the ranks' reports in the executor, by
rank, so the scheduler hears of a load (or a reader's `done`) only once every rank has it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tokenmill.worker.step import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.worker.kv_spec import KVCacheSpec


# -- the registry -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConnectorEntry:
    """One connector: its two halves ("module:Class", imported only when it is on) and when it is on."""

    scheduler: str
    worker: str
    enabled: Callable[[EngineConfig], bool]
    # Whether its worker side needs the KV cache in shared memory (a transfer server's readers map it).
    shares_kv_cache: Callable[[EngineConfig], bool] = lambda config: False
    # Whether its worker side finishes queued writes as it closes (up to FLUSH_TIMEOUT_S), so a restart
    # finds them: the executor waits that long for each rank at shutdown before it kills any.
    flushes_on_close: bool = False


# How long a worker side that flushes on close may take (its queued writes reaching the file tiers).
FLUSH_TIMEOUT_S = 60.0


# In chain order: at admission the scheduler asks each in turn for the blocks after those the previous
# ones can load, so the cheap local tiers come before a read from another engine.
REGISTRY: dict[str, ConnectorEntry] = {
    "offload": ConnectorEntry(
        "tokenmill.engine.offload_connector:OffloadConnector",
        "tokenmill.worker.kv_offload.worker_connector:OffloadWorker",
        lambda config: bool(config.offload.kv_offload),
        flushes_on_close=True,
    ),
    "pd": ConnectorEntry(
        "tokenmill.engine.pd_connector:PDConnector",
        "tokenmill.worker.kv_transfer.pd_worker:PDWorker",
        lambda config: config.kv_transfer.kv_role is not None,
        lambda config: config.kv_transfer.serves and config.kv_transfer.kv_transfer_shm,
    ),
}


def connector_names(config: EngineConfig) -> list[str]:
    """The connectors the configuration turns on, in chain order."""
    return [name for name, entry in REGISTRY.items() if entry.enabled(config)]


def connector_class(name: str, side: str) -> type:
    """The class of connector `name`'s `side` ("scheduler" or "worker")."""
    try:
        entry = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown KV connector {name!r}; known: {', '.join(REGISTRY)}") from None
    module, _, cls = getattr(entry, side).partition(":")
    return getattr(importlib.import_module(module), cls)


def shares_kv_cache(config: EngineConfig) -> bool:
    return any(REGISTRY[name].shares_kv_cache(config) for name in connector_names(config))


def close_timeout_s(config: EngineConfig) -> float:
    """How long a rank's KV connectors may take to close (0: they write nothing that outlives them)."""
    return FLUSH_TIMEOUT_S if any(REGISTRY[n].flushes_on_close for n in connector_names(config)) else 0.0


# -- the worker side ------------------------------------------------------------------------------------
@dataclass
class KVWorkerContext:
    """What a worker side is built from: the rank's cache and where it stands (the engine's plain facts
    and the worker's own objects)."""

    config: EngineConfig
    kv_caches: torch.Tensor  # [layers, k/v, blocks, tokens, kv heads, row]: this rank's part of each block
    spec: KVCacheSpec
    rank: int
    tp_size: int
    pp_size: int
    # Every rank's bytes per block, in rank order: budgets given for the engine (a host tier's size)
    # are shared out in proportion, so every rank holds the same blocks.
    rank_block_bytes: list[int]
    # This rank's cache layout as a file-name-safe name (model, dtype, weights, block shape, rank and
    # shard): blocks stored under it are never read by another layout or rank.
    namespace: str
    shm_path: Path | None = None  # the cache's shared-memory file, when shares_kv_cache asked for one
    # Engine-wide secrets the engine hands its ranks (a transfer server's grant key).
    secrets: dict[str, bytes] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def share(self, engine_bytes: int) -> int:
        """This rank's part of a byte budget given for the whole engine."""
        return engine_bytes * self.rank_block_bytes[self.rank] // sum(self.rank_block_bytes)


class KVConnectorWorker(ABC):
    """The worker side of one connector, on one rank."""

    name: ClassVar[str] = ""

    @classmethod
    @abstractmethod
    def build(cls, ctx: KVWorkerContext) -> KVConnectorWorker: ...

    def save_blocks(self, meta: Any) -> None:
        """The first phase of a step's metadata, before the forward pass: copy out of the pool every
        block that leaves it (an evicted block whose place the pool gave out again this step). In a
        chain every connector's saves come before any connector's loads (`apply`), whatever the order:
        a load may write into the very block another connector saves."""
        return None

    @abstractmethod
    def load_blocks(self, meta: Any) -> None:
        """The second phase, once every connector's saves are done: copy blocks into the pool, or start
        reading them in the background (and whatever else the metadata asks)."""

    def apply(self, meta: Any) -> None:
        """Carry out the scheduler side's metadata for this step, before the forward pass writes into any
        block: saves first, then loads."""
        self.save_blocks(meta)
        self.load_blocks(meta)

    def take_finished_loads(self, wait_s: float = 0.0) -> dict[str, int]:
        """Background loads that ended since the last call: request id -> leading blocks intact. With
        `wait_s`, wait that long for one when some are under way (a step with nothing else to do)."""
        return {}

    def take_finished_sending(self) -> list[str]:
        """Requests whose kept blocks a reader is done with, since the last call."""
        return []

    def take_events(self) -> list[tuple[str, str, bytes]]:
        """(kind, tier, key) of changes made here on its own since the last call."""
        return []

    def counters(self) -> dict[str, int]:
        return {}

    def describe(self) -> dict:
        """Plain facts the scheduler side needs from this rank (an endpoint, a namespace)."""
        return {}

    def close(self) -> None:
        return None

    def after_step(self, wait_s: float = 0.0) -> KVConnectorOutput:
        """The step's report, as plain data keyed by this connector's name."""
        out = KVConnectorOutput(stats=self.counters())
        loads, sends, events = (
            self.take_finished_loads(wait_s),
            self.take_finished_sending(),
            self.take_events(),
        )
        if loads:
            out.loads_done[self.name] = loads
        if sends:
            out.sends_done[self.name] = sends
        if events:
            out.events[self.name] = events
        return out


class MultiConnectorWorker(KVConnectorWorker):
    """Several connectors' worker sides as one: each gets its part of the metadata in two phases, every
    connector's saves and then every connector's loads (so one connector's copies of evicted blocks are
    done before any starts loading into the blocks the pool gave out in their place, whatever the chain
    order), and their reports are joined."""

    name = "multi"

    def __init__(self, connectors: list[KVConnectorWorker]) -> None:
        self.connectors = {c.name: c for c in connectors}

    @classmethod
    def build(cls, ctx: KVWorkerContext) -> KVConnectorWorker:
        raise TypeError("a chain is built by build_worker_connector, from its connectors' names")

    def __getitem__(self, name: str) -> KVConnectorWorker:
        return self.connectors[name]

    def save_blocks(self, meta: dict[str, Any]) -> None:
        for name, conn in self.connectors.items():
            part = meta.get(name)
            if part is not None:
                conn.save_blocks(part)

    def load_blocks(self, meta: dict[str, Any]) -> None:
        for name, conn in self.connectors.items():
            part = meta.get(name)
            if part is not None:
                conn.load_blocks(part)

    def after_step(self, wait_s: float = 0.0) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for conn in self.connectors.values():
            o = conn.after_step(wait_s)
            out.loads_done.update(o.loads_done)
            out.sends_done.update(o.sends_done)
            out.events.update(o.events)
            out.stats.update(o.stats)
        return out

    def counters(self) -> dict[str, int]:
        return {k: v for c in self.connectors.values() for k, v in c.counters().items()}

    def describe(self) -> dict:
        return {name: c.describe() for name, c in self.connectors.items()}

    def close(self) -> None:
        for conn in self.connectors.values():
            conn.close()


def build_worker_connector(names: list[str], ctx: KVWorkerContext) -> KVConnectorWorker | None:
    """The worker side of the connectors `names` (the engine's choice, from the registry): one
    connector's own, a chain of several, or None."""
    built: list[KVConnectorWorker] = []
    try:
        for name in names:
            conn = connector_class(name, "worker").build(ctx)
            assert conn.name == name, f"{type(conn).__name__} is registered as {name!r}, named {conn.name!r}"
            built.append(conn)
    except BaseException:
        for conn in built:
            conn.close()
        raise
    if not built:
        return None
    return built[0] if len(built) == 1 else MultiConnectorWorker(built)


def describe_by_name(names: list[str], info: dict) -> dict[str, dict]:
    """A worker side's describe() as {connector name: its facts}, for one connector or a chain."""
    if len(names) == 1:
        return {names[0]: info}
    return {name: info.get(name, {}) for name in names}


# -- ranks ---------------------------------------------------------------------------------------------
class RankCombiner:
    """Joins the ranks' reports into the one the scheduler reads. Each rank moves its own part of every
    block, at its own pace, and reports for itself; what counts is which ranks reported, never how many
    reports came (a rank may report the same thing twice: a reader's `done` sent again, a block stored
    again after its eviction). A background load is done when every rank has reported it (with the
    fewest intact blocks any rank got), a reader's `done` when every rank has heard it; a block is in a
    tier once every rank holds its part, and announced gone from it as soon as one rank lost its part
    (it is announced again when every rank holds it again). Counters are the largest over the ranks:
    every rank moves (its part of) the same blocks."""

    MAX_PENDING = 100_000  # loads and sends some ranks reported and others never will
    # Blocks whose holders are tracked (those in a file tier, and parts on their way): the least recently
    # touched are forgotten past this (a later removal of one of them then goes unannounced).
    MAX_BLOCKS = 1 << 20

    def __init__(self, world_size: int) -> None:
        self.world = world_size
        self._full = (1 << world_size) - 1
        # (connector, request id) -> {rank: leading blocks it got}
        self._loads: OrderedDict[tuple[str, str], dict[int, int]] = OrderedDict()
        # (connector, request id) -> ranks that heard the reader's `done`, as bits
        self._sends: OrderedDict[tuple[str, str], int] = OrderedDict()
        # (connector, tier, key) -> [ranks holding their part, as bits; announced as stored]
        self._blocks: OrderedDict[tuple[str, str, bytes], list] = OrderedDict()

    def combine(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """`outputs`: each rank's report, in rank order (None: that rank has none this step)."""
        assert len(outputs) == self.world, f"{len(outputs)} reports for {self.world} ranks"
        if all(o is None for o in outputs):
            return None
        out = KVConnectorOutput()
        for rank, o in enumerate(outputs):
            if o is None:
                continue
            bit = 1 << rank
            for name, loads in o.loads_done.items():
                for rid, ok in loads.items():
                    got = self._loads.setdefault((name, rid), {})
                    got[rank] = min(ok, got.get(rank, ok))
                    if len(got) == self.world:
                        del self._loads[name, rid]
                        out.loads_done.setdefault(name, {})[rid] = min(got.values())
            for name, rids in o.sends_done.items():
                for rid in rids:
                    ranks = self._sends.get((name, rid), 0) | bit
                    if ranks == self._full:
                        self._sends.pop((name, rid), None)
                        out.sends_done.setdefault(name, []).append(rid)
                    else:
                        self._sends[name, rid] = ranks
            for name, events in o.events.items():
                for kind, tier, key in events:
                    if self._block_event(name, kind, tier, key, bit):
                        out.events.setdefault(name, []).append((kind, tier, key))
            for k, v in o.stats.items():
                out.stats[k] = max(out.stats.get(k, v), v)
        for pending, bound in ((self._loads, self.MAX_PENDING), (self._sends, self.MAX_PENDING),
                               (self._blocks, self.MAX_BLOCKS)):  # fmt: skip
            while len(pending) > bound:
                pending.popitem(last=False)
        return out

    def _block_event(self, name: str, kind: str, tier: str, key: bytes, bit: int) -> bool:
        """One rank's part of a block was stored in a tier or removed from it: True when that is news
        for the scheduler (every rank holds it now, or an announced block lost a part)."""
        entry = self._blocks.get((name, tier, key))
        if entry is None:
            if kind != "stored":
                return False  # a part nobody announced went: no news
            entry = self._blocks[name, tier, key] = [0, False]
        else:
            self._blocks.move_to_end((name, tier, key))
        if kind == "stored":
            entry[0] |= bit
            if entry[0] == self._full and not entry[1]:
                entry[1] = True
                return True
            return False
        entry[0] &= ~bit
        news = entry[1]
        entry[1] = False
        if not entry[0]:
            del self._blocks[name, tier, key]
        return news


def merge_outputs(
    first: KVConnectorOutput | None, then: KVConnectorOutput | None
) -> KVConnectorOutput | None:
    """Two reports as one, `first`'s before `then`'s (what a failed step's healthy ranks reported, kept
    for the next step's output)."""
    if first is None or then is None:
        return then if first is None else first
    out = KVConnectorOutput(stats={**first.stats, **then.stats})
    for part in (first, then):
        for name, loads in part.loads_done.items():
            out.loads_done.setdefault(name, {}).update(loads)
        for name, rids in part.sends_done.items():
            out.sends_done.setdefault(name, []).extend(rids)
        for name, events in part.events.items():
            out.events.setdefault(name, []).extend(events)
    return out
