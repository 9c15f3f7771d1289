"""The scheduler's half of KV offloading (Dynamo's KV block manager, tiers G2-G4 below the pool).

Blocks leave the pool when it evicts them, not as they are computed: only what the pool cannot keep
costs a copy. An evicted block goes to host memory (G2) when there is a host tier, else straight to
the file tiers; a host slot that must be reused spills its block to the file tiers first (disk G3,
then shared G4: the disk tier passes on what it evicts). This side keeps the host tier's index (which
slot holds which block, least recently used first) so the worker's side only copies bytes; the file
tiers are looked up on the filesystem, where other workers' blocks (the shared tier) and those of an
earlier run (warm start) are too. Under tensor or pipeline parallelism each rank keeps its own part of
every block under a namespace of its own (its rank and shard): a block is in a file tier when every
rank's part is.

Admission asks for the blocks after the pool's own hits: a leading run found in host memory is
copied in before the step's forward pass; a run that reaches the file tiers is read in the
background while the request waits. A block that fails to load (missing, corrupt) only ends the run:
the request recomputes from there.

KV events name every tier a block is in: the pool's ("GPU", engine/kv_cache_manager.py), host memory
("CPU", as vLLM's offloading connector), and the file tiers ("DISK", "SHARED") as the workers report
their writes and evictions (a block another process wrote to the shared tier is not announced).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill.engine.block_pool import KVBlock
from tokenmill.engine.kv_connector import KVConnectorScheduler, KVSchedulerContext
from tokenmill.engine.kv_events import BlockRemoved, KVEvent, external_hash, stored
from tokenmill.engine.request import Request
from tokenmill.worker.kv_offload.file_store import block_path
from tokenmill.worker.kv_offload.ops import OffloadOps
from tokenmill.worker.kv_offload.tiers import OffloadTiers, parse_tiers

MEDIUM_HOST = "CPU"  # vLLM's name for the host tier in KV events
MEDIUM_FILES = {"disk": "DISK", "shared": "SHARED"}  # the file tiers' (by the worker's tier names)
EventInfo = tuple[Any, list[int], Any, Any]  # a block's (parent, tokens, extra keys, lora) for BlockStored


class HostIndex:
    """Which host slot holds which block, least recently used first; slots pinned for this step's loads
    are never handed to a save of the same step."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slots: OrderedDict[bytes, int] = OrderedDict()
        self.free = list(range(num_slots - 1, -1, -1))
        self.pinned: set[int] = set()

    def __len__(self) -> int:
        return len(self.slots)

    def lookup(self, key: bytes) -> int | None:
        return self.slots.get(key)

    def touch(self, key: bytes) -> None:
        self.slots.move_to_end(key)

    def take(self, key: bytes) -> tuple[int, bytes | None] | None:
        """A slot for a new block, and the block it held before (None: it was free); None when every
        slot is pinned. The slot stays pinned for the rest of the step: the worker spills every slot
        before it saves into any, so a slot refilled twice in one step would spill the wrong block."""
        if self.free:
            slot = self.free.pop()
            self.slots[key] = slot
            self.pinned.add(slot)
            return slot, None
        for old, slot in self.slots.items():
            if slot not in self.pinned:
                del self.slots[old]
                self.slots[key] = slot
                self.pinned.add(slot)
                return slot, old
        return None


class OffloadConnector(KVConnectorScheduler):
    name = "offload"

    def __init__(
        self,
        tiers: OffloadTiers,
        block_size: int,
        block_bytes: int,
        namespace: str | list[str],
        events: list[KVEvent] | None = None,
        is_cached: Callable[[bytes], bool] | None = None,
    ) -> None:
        """`block_bytes`: one block over all ranks; `namespace`: each rank's, in rank order (one for a
        single worker)."""
        self.tiers = tiers
        self.block_size = block_size
        self.namespaces = [namespace] if isinstance(namespace, str) else list(namespace)
        self.namespace = self.namespaces[0]
        self.host = HostIndex(tiers.host_bytes // block_bytes) if tiers.host_bytes else None
        if self.host is not None and self.host.num_slots == 0:
            raise ValueError(
                f"--kv-offload host={tiers.host_bytes} bytes holds no block of {block_bytes} bytes"
            )
        self.file_roots = [Path(p) for p in (tiers.disk_path, tiers.shared_path) if p is not None]
        # The engine's event list: host-tier blocks are published beside the pool's, as vLLM's
        # offloading connector does (medium "CPU"), so a router credits what this worker can load.
        self.events = events
        self.is_cached = is_cached  # whether the pool still holds a hash (its removal is then not news)
        # With events on: what each block in host memory, or on its way to or in the file tiers, was
        # published with, so that its later tiers publish it as fully. Entries for the file tiers go
        # once nothing more can happen to the block there that needs them (bounded besides).
        self._host_info: dict[bytes, EventInfo] = {}
        self._file_info: OrderedDict[bytes, EventInfo] = OrderedDict()
        disk_blocks = (tiers.disk_bytes or 0) // block_bytes if tiers.disk_path else 0
        self._max_file_info = disk_blocks + 65_536
        self.ops = OffloadOps()
        # request id -> (its first block loaded, whether each block comes from the file tiers)
        self._loading: dict[str, tuple[int, list[bool]]] = {}
        self.c = {
            "host_hit_blocks": 0, "file_load_blocks": 0, "file_loaded_blocks": 0, "host_saved_blocks": 0,
            "file_saved_blocks": 0, "host_evicted_blocks": 0, "save_skipped_blocks": 0,
        }  # fmt: skip

    @classmethod
    def build(cls, ctx: KVSchedulerContext) -> OffloadConnector:
        return cls(
            parse_tiers(ctx.config.offload.kv_offload),  # type: ignore[arg-type]
            ctx.block_size,
            ctx.engine_block_bytes,
            [info["namespace"] for info in ctx.worker_info],
            ctx.events,
            ctx.is_cached,
        )

    # -- lookups -------------------------------------------------------------------------------------
    def _tier_of(self, key: bytes) -> int | None:
        """The first file tier (index into file_roots) where every rank's part of the block is."""
        for i, root in enumerate(self.file_roots):
            if all(os.path.exists(block_path(root, ns, key)) for ns in self.namespaces):
                return i
        return None

    def _in_files(self, key: bytes) -> bool:
        if len(self.namespaces) == 1:  # one stat per tier
            return any(os.path.exists(block_path(root, self.namespace, key)) for root in self.file_roots)
        # A block whose parts sit in different tiers (a rank's disk evicted its part to the shared tier
        # before another's) loads too: each rank reads its part from whichever tier holds it.
        return all(
            any(os.path.exists(block_path(root, ns, key)) for root in self.file_roots)
            for ns in self.namespaces
        )

    def num_external_blocks(self, req: Request, num_local_blocks: int) -> tuple[int, bool]:
        # As with the pool's own hits, the last prompt token is always computed (its logits are needed).
        limit = (req.num_tokens - 1) // self.block_size
        n, background = 0, False
        for key in req.block_hashes[num_local_blocks:limit]:
            slot = self.host.lookup(key) if self.host is not None else None
            if slot is not None:
                self.host.pinned.add(slot)  # type: ignore[union-attr]
            elif self.file_roots and self._in_files(key):
                background = True
            else:
                break
            n += 1
        return n, background

    def after_alloc(self, req: Request, blocks: list[KVBlock], first: int, background: bool) -> None:
        keys = req.block_hashes[first : first + len(blocks)]
        files: list[tuple[bytes, int]] = []
        from_files: list[bool] = []
        for key, block in zip(keys, blocks, strict=True):
            slot = self.host.lookup(key) if self.host is not None else None
            if slot is not None:
                self.host.touch(key)  # type: ignore[union-attr]
                self.ops.host_loads.append((slot, block.block_id))
                self.c["host_hit_blocks"] += 1
            else:
                files.append((key, block.block_id))
            from_files.append(slot is None)
        if files:
            assert background, "file-tier blocks are only loaded in the background"
            self.ops.file_loads[req.request_id] = files
            self.c["file_load_blocks"] += len(files)
        if background:
            self._loading[req.request_id] = (first, from_files)

    def loaded(self, request_id: str, num_ok: int) -> tuple[int, int]:
        """The worker read the first `num_ok` file blocks of a background load: the request's first
        block given, and how many leading blocks from there hold their content (a host block copied
        before the forward pass always does; the run ends at the first file block that did not come)."""
        first, from_files = self._loading.pop(request_id)
        self.c["file_loaded_blocks"] += num_ok
        seen = valid = 0
        for is_file in from_files:
            if is_file:
                if seen == num_ok:
                    break
                seen += 1
            valid += 1
        return first, valid

    # -- leaving the pool ----------------------------------------------------------------------------
    def on_evicted(self, block: KVBlock) -> None:
        block_hash, block_id = block.block_hash, block.block_id
        assert block_hash is not None, "the pool evicts named blocks only"
        host = self.host
        if host is not None:
            if host.lookup(block_hash) is not None:
                host.touch(block_hash)
                self._stored(
                    block_hash, block.event_info, MEDIUM_HOST
                )  # the pool's removal went out: still here
                return
            taken = host.take(block_hash)
            if taken is None:  # every slot is busy this step: straight to the files, keeping the chain whole
                self._save_to_files(block)
                return
            slot, old = taken
            if old is not None:
                self.c["host_evicted_blocks"] += 1
                info = self._host_info.pop(old, None)
                if self.file_roots:
                    self.ops.spills.append((slot, old))
                    self.c["file_saved_blocks"] += 1
                    self._expect_files(old, info)
                if self.events is not None and not (self.is_cached and self.is_cached(old)):
                    self.events.append(BlockRemoved([external_hash(old)], MEDIUM_HOST))
            self.ops.saves.append((block_id, slot, block_hash))
            self.c["host_saved_blocks"] += 1
            if self.events is not None and block.event_info is not None:
                self._host_info[block_hash] = block.event_info
            self._stored(block_hash, block.event_info, MEDIUM_HOST)
        else:
            self._save_to_files(block)

    def _save_to_files(self, block: KVBlock) -> None:
        block_hash, block_id = block.block_hash, block.block_id
        assert block_hash is not None
        if not self.file_roots:
            self.c["save_skipped_blocks"] += 1
            return
        tier = self._tier_of(block_hash)
        if tier is None:
            self.ops.file_saves.append((block_id, block_hash))
            self.c["file_saved_blocks"] += 1
            self._expect_files(block_hash, block.event_info)
        else:  # the pool's removal went out just before: still loadable from this tier
            self._stored(block_hash, block.event_info, MEDIUM_FILES[self._tier_names[tier]])

    @property
    def _tier_names(self) -> list[str]:
        return [n for n, p in (("disk", self.tiers.disk_path), ("shared", self.tiers.shared_path)) if p]

    def _expect_files(self, key: bytes, info: EventInfo | None) -> None:
        """A block is on its way to the file tiers: keep what to publish it with when a worker says so."""
        if self.events is None or info is None:
            return
        self._file_info[key] = info
        self._file_info.move_to_end(key)
        while len(self._file_info) > self._max_file_info:
            self._file_info.popitem(last=False)

    def on_worker_events(self, events: list[tuple[str, str, bytes]]) -> None:
        """The file tiers' writes and evictions, as the workers report them (on every rank)."""
        if self.events is None:
            return
        last_tier = self._tier_names[-1] if self.file_roots else None
        for kind, tier, key in events:
            medium = MEDIUM_FILES.get(tier)
            if medium is None:
                continue
            if kind == "stored":
                # A block may still move from the disk tier on to the shared one: its entry stays.
                info = self._file_info.pop(key, None) if tier == last_tier else self._file_info.get(key)
                self._stored(key, info, medium)
            elif kind == "removed":
                if tier == last_tier:
                    self._file_info.pop(key, None)
                held = (self.is_cached and self.is_cached(key)) or (
                    self.host is not None and self.host.lookup(key) is not None
                )
                if not held:  # else the pool or host memory still serves it: no news for a router
                    self.events.append(BlockRemoved([external_hash(key)], medium))

    def _stored(self, key: bytes, info: EventInfo | None, medium: str) -> None:
        """A tier's BlockStored, as full as the pool's was: a consumer that indexes blocks by their
        parent and tokens (Dynamo hashes the tokens itself) drops one without them."""
        if self.events is None or info is None:
            return
        parent, tokens, extra, lora = info
        self.events.append(
            stored(
                [external_hash(key)],
                parent,
                tokens,
                self.block_size,
                medium,
                None if extra is None else [extra],
                lora,
            )
        )

    def build_meta(self) -> OffloadOps | None:
        ops, self.ops = self.ops, OffloadOps()
        if self.host is not None:
            self.host.pinned.clear()
        return ops or None

    def flush_meta(self, cached: list[tuple[bytes, int]]) -> OffloadOps | None:
        """At shutdown: the pool's named blocks and the host tier's go to the file tiers, so a restart
        starts warm."""
        if not self.file_roots:
            return None
        ops = self.build_meta() or OffloadOps()
        ops.file_saves.extend((block_id, key) for key, block_id in cached)
        if self.host is not None:
            ops.spills.extend((slot, key) for key, slot in self.host.slots.items())
        return ops or None

    def counters(self) -> dict[str, int]:
        out = dict(self.c)
        out["host_blocks"] = len(self.host) if self.host is not None else 0
        out["host_capacity_blocks"] = self.host.num_slots if self.host is not None else 0
        return out
