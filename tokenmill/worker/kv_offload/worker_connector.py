"""The worker's half of the offload connector: it owns the bytes of the tiers below the engine's pool
(a host-memory pool of blocks, the disk and shared directories) and moves blocks between them and the
paged cache as the scheduler's half says (ops.py).

Host moves are copies done before the forward pass. File writes go to a writer thread and file reads
to a loader thread, so a step waits for neither: a request whose blocks come from files is held back
by the scheduler until this side reports them loaded (`take_finished_loads`).

Under tensor or pipeline parallelism each rank has one of these for its own heads or layers of every
block: its own host slots (the scheduler's slot numbers, its share of the bytes), its own namespace
in each file tier, and its share of the tiers' byte budgets.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from tokenmill.worker.kv_connector import FLUSH_TIMEOUT_S, KVConnectorWorker, KVWorkerContext
from tokenmill.worker.kv_offload.block_store import BlockStore
from tokenmill.worker.kv_offload.file_store import FileStore
from tokenmill.worker.kv_offload.ops import OffloadOps
from tokenmill.worker.kv_offload.tiers import OffloadTiers, parse_tiers, shared_tier_key

log = logging.getLogger(__name__)


class OffloadWorker(KVConnectorWorker):
    name = "offload"

    def __init__(
        self,
        kv_caches: torch.Tensor,
        tiers: OffloadTiers,
        num_host_blocks: int,
        namespace: str,
        max_queued_bytes: int = 512 * 2**20,
        shared_key: bytes | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._events: list[tuple[str, str, bytes]] = []  # (kind, tier, key) since the last step
        # [layers, k/v, blocks, tokens per block, kv heads, head dim]: a block is kv[:, :, b].
        self.kv = kv_caches
        self.block_shape = (kv_caches.shape[0], kv_caches.shape[1], *kv_caches.shape[3:])
        self.block_bytes = kv_caches[:, :, 0].numel() * kv_caches.element_size()
        self.host = (
            # Pinned on a GPU machine, so device <-> host copies run as DMA.
            torch.empty(
                (num_host_blocks, *self.block_shape),
                dtype=kv_caches.dtype,
                device="cpu",
                pin_memory=kv_caches.device.type == "cuda",
            )
            if num_host_blocks
            else None
        )
        # Bound into every block file beside the namespace (which names the model and cache format).
        layout = f"{kv_caches.dtype}|{'x'.join(map(str, self.block_shape))}|{self.block_bytes}"
        # Files are HMAC-signed: the disk tier with its directory's own key, the shared tier with the
        # deployment's (TOKENMILL_KV_SHARED_KEY; without one the worker does not start).
        self.shared: BlockStore | None = (
            FileStore(
                tiers.shared_path,
                namespace,
                tiers.shared_bytes,
                name="shared",
                secret=shared_key if shared_key is not None else shared_tier_key(),
                layout=layout,
                on_dropped=self._dropped_from("shared"),
            )
            if tiers.shared_path
            else None
        )
        self.disk: BlockStore | None = (
            FileStore(
                tiers.disk_path,
                namespace,
                tiers.disk_bytes,
                name="disk",
                on_evict=self._to_shared,
                on_dropped=self._dropped_from("disk"),
                layout=layout,
            )
            if tiers.disk_path
            else None
        )
        self.namespace = namespace
        self.stats = {"host_saves": 0, "host_loads": 0, "file_writes": 0, "file_write_drops": 0,
                      "disk_hits": 0, "shared_hits": 0, "file_load_failures": 0}  # fmt: skip
        # Writes wait in memory while the disk catches up; past this many bytes a block is dropped
        # instead (it costs a later miss, not unbounded memory).
        self.max_queued_bytes = max_queued_bytes
        self._queued_bytes = 0
        self._writing: dict[bytes, bytes] = {}  # key -> bytes queued for the file tiers (loads see them)
        self._writes: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self._loads: queue.Queue[tuple[str, list[tuple[bytes, int]]] | None] = queue.Queue()
        self._loaded: dict[str, int] = {}
        self._loaded_cv = threading.Condition(self._lock)
        self._pending_loads = 0
        self._threads = []
        if self.disk is not None or self.shared is not None:
            for target in (self._write_loop, self._load_loop):
                t = threading.Thread(target=target, name=f"kv-offload-{target.__name__}", daemon=True)
                t.start()
                self._threads.append(t)

    @classmethod
    def build(cls, ctx: KVWorkerContext) -> OffloadWorker:
        """This rank's tiers: host slots as many as the scheduler counts (the engine's host budget over
        a whole block's bytes, every rank's part), file budgets in proportion to its part of a block."""
        tiers = parse_tiers(ctx.config.offload.kv_offload)  # type: ignore[arg-type]
        num_host_blocks = (tiers.host_bytes or 0) // sum(ctx.rank_block_bytes)
        if ctx.world_size > 1:
            tiers = dataclasses.replace(
                tiers,
                disk_bytes=None if tiers.disk_bytes is None else ctx.share(tiers.disk_bytes),
                shared_bytes=None if tiers.shared_bytes is None else ctx.share(tiers.shared_bytes),
            )
        return cls(ctx.kv_caches, tiers, num_host_blocks, ctx.namespace)

    def describe(self) -> dict:
        return {"namespace": self.namespace}

    # -- one step ----------------------------------------------------------------------------------
    def save_blocks(self, ops: OffloadOps) -> None:
        """A step's moves out of the pool and host memory (spills, saves, file saves), in the order ops.py
        explains, before the forward pass and before any connector loads into the pool."""
        kv, host = self.kv, self.host
        for slot, key in ops.spills:
            assert host is not None
            self._queue_write(key, self._to_bytes(host[slot]))
        if ops.saves:
            assert host is not None
            ids = torch.tensor([s[0] for s in ops.saves], dtype=torch.long, device=kv.device)
            slots = torch.tensor([s[1] for s in ops.saves], dtype=torch.long)
            host.index_copy_(0, slots, kv.index_select(2, ids).movedim(2, 0).to("cpu"))
            self.stats["host_saves"] += len(ops.saves)
        for block_id, key in ops.file_saves:
            self._queue_write(key, self._to_bytes(kv[:, :, block_id]))

    def load_blocks(self, ops: OffloadOps) -> None:
        """A step's moves into the pool: host loads now, file loads in the background."""
        kv, host = self.kv, self.host
        if ops.host_loads:
            assert host is not None
            slots = torch.tensor([s[0] for s in ops.host_loads], dtype=torch.long)
            ids = torch.tensor([s[1] for s in ops.host_loads], dtype=torch.long, device=kv.device)
            kv.index_copy_(2, ids, host.index_select(0, slots).movedim(0, 2).to(kv.device))
            self.stats["host_loads"] += len(ops.host_loads)
        for rid, blocks in ops.file_loads.items():
            with self._lock:
                self._pending_loads += 1
            self._loads.put((rid, blocks))

    def take_finished_loads(self, wait_s: float = 0.0) -> dict[str, int]:
        """Requests whose file loads ended since the last call -> leading blocks that arrived intact.
        With `wait_s`, wait that long for one when some are under way (a step with nothing else to do)."""
        with self._loaded_cv:
            if wait_s and not self._loaded and self._pending_loads:
                self._loaded_cv.wait(wait_s)
            out, self._loaded = self._loaded, {}
            return out

    def take_events(self) -> list[tuple[str, str, bytes]]:
        with self._lock:
            out, self._events = self._events, []
        return out

    def counters(self) -> dict[str, int]:
        out = dict(self.stats)
        out["corrupt_blocks"] = sum(s.corrupt for s in (self.disk, self.shared) if s is not None)
        with self._lock:  # a gauge: writes queued and not yet in a tier (0 once the writer caught up)
            out["file_writes_queued"] = len(self._writing)
        return out

    def close(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Finish queued writes (so a restart finds them), then stop the threads: all within
        `timeout_s` (the executor waits as long for the rank, registry's FLUSH_TIMEOUT_S)."""
        if not self._threads:
            return
        self._writes.put(None)
        self._loads.put(None)
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("KV offload: %s did not finish within %.0fs at shutdown", t.name, timeout_s)
        self._threads = []

    # -- bytes -------------------------------------------------------------------------------------
    def _to_bytes(self, block: torch.Tensor) -> bytes:
        return block.to("cpu").contiguous().view(torch.uint8).numpy().tobytes()

    def _from_bytes(self, data: bytes) -> torch.Tensor:
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return flat.view(self.kv.dtype).reshape(self.block_shape)

    # -- file tiers ----------------------------------------------------------------------------------
    def _queue_write(self, key: bytes, data: bytes) -> None:
        with self._lock:
            if key in self._writing:
                return
            if self._queued_bytes + len(data) > self.max_queued_bytes:
                self.stats["file_write_drops"] += 1
                return
            self._writing[key] = data
            self._queued_bytes += len(data)
        self._writes.put((key, data))

    def _write_loop(self) -> None:
        first = self.disk if self.disk is not None else self.shared
        assert first is not None
        while (item := self._writes.get()) is not None:
            key, data = item
            try:
                if first.put(key, data):
                    self.stats["file_writes"] += 1
                    self._note("stored", first.name, key)
                elif first.contains(key):  # there already (the shared tier: another worker wrote it)
                    self._note("stored", first.name, key)
            except OSError as e:  # a full or vanished disk costs the block, not the engine
                log.warning("KV offload: could not write a block to %s: %s", first.name, e)
            finally:
                with self._lock:
                    self._writing.pop(key, None)
                    self._queued_bytes -= len(data)

    def _note(self, kind: str, tier: str, key: bytes) -> None:
        with self._lock:
            self._events.append((kind, tier, key))

    def _to_shared(self, key: bytes, data: bytes) -> None:
        """The disk tier evicted a block: it goes on to the shared tier, when there is one (the disk
        tier's removal is announced by its on_dropped, for a block too damaged to pass on as well)."""
        if self.shared is not None:
            try:
                if self.shared.put(key, data) or self.shared.contains(key):
                    self._note("stored", "shared", key)
            except OSError as e:
                log.warning("KV offload: could not write a block to shared: %s", e)

    def _dropped_from(self, tier: str) -> Callable[[bytes], None]:
        """A file tier's on_dropped: every block it removes (evicted, damaged, discarded) is announced."""
        return lambda key: self._note("removed", tier, key)

    def _read(self, key: bytes) -> bytes | None:
        with self._lock:
            data = self._writing.get(key)
        if data is not None:
            return data
        for store, counter in ((self.disk, "disk_hits"), (self.shared, "shared_hits")):
            if store is None:
                continue
            data = store.get(key)
            if data is not None:
                if len(data) == self.block_bytes:
                    self.stats[counter] += 1
                    return data
                store.discard(key)  # another size under our namespace: never served (on_dropped tells)
        return None

    def _load_loop(self) -> None:
        while (item := self._loads.get()) is not None:
            rid, blocks = item
            ok = 0
            try:
                for key, block_id in blocks:
                    data = self._read(key)
                    if data is None:
                        self.stats["file_load_failures"] += 1
                        break
                    self.kv[:, :, block_id].copy_(self._from_bytes(data))
                    ok += 1
            except Exception:  # a failed load costs recomputation, never the request
                log.exception("KV offload: loading blocks for %s failed", rid)
            with self._loaded_cv:
                self._loaded[rid] = ok
                self._pending_loads -= 1
                self._loaded_cv.notify_all()
