"""The worker's half of disaggregated prefill and decode: it serves this worker's KV cache to decode
workers (a TransferServer) and reads prefill workers' blocks into it, so no step waits for a transfer.

Reads run on one loader thread per peer (a lane), so a peer that has died costs only its own loads:
each lane has its own TransferClient (sockets are not thread-safe), and copies go to disjoint blocks of
the cache. A peer that did not answer is taken as unreachable for a while: its further loads fail at
once (the decode worker recomputes those prompts) and nobody waits to tell it they are done (it frees
held blocks after its hold timeout, if it lives). Before lanes, nine loads from a killed prefill worker
queued on one thread at 2 x 10 s each held every later load, from live peers too, for three minutes.

Under tensor or pipeline parallelism every rank has one of these for its own part of each block: its
own transfer server (on the configured port plus its rank), which checks grants with the key the
engine gave every rank, and rank i reads from rank i of the prefill engine (the same layout on both
sides: the engine checks it when a request arrives)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenmill.worker.kv_connector import KVConnectorWorker, KVWorkerContext
from tokenmill.worker.kv_transfer.ops import RemoteLoad, TransferOps, rank_port
from tokenmill.worker.kv_transfer.transfer_engine import TransferClient, TransferServer, TransferTimeout

log = logging.getLogger(__name__)

IDLE_LANE_S = 60.0  # a lane with nothing to do this long ends (peers come and go with restarts)
# Peers read from at once, at most: past this a load fails at once (its prompt is recomputed), so
# requests naming many peers (a client's kv_transfer_params) cannot start a thread each.
MAX_LANES = 32
Job = tuple[str, RemoteLoad | None, tuple | None]  # (request id, a load | None, a release | None)


@dataclass
class _Lane:
    """The loads and releases of one peer, in order, on a thread of their own."""

    client: TransferClient
    jobs: queue.Queue[Job | None] = field(default_factory=queue.Queue)
    unreachable_until: float = 0.0  # monotonic time until which the peer is taken as gone
    thread: threading.Thread | None = None


class PDWorker(KVConnectorWorker):
    name = "pd"

    def __init__(
        self,
        kv: torch.Tensor,
        serve: bool,
        shm_path: Path | None,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 10.0,
        use_shm: bool = True,
        layout: str = "",
        rank: int = 0,
        grant_key: bytes | None = None,
    ) -> None:
        self.rank = rank
        self.server = TransferServer(kv, shm_path, host, port, layout, grant_key) if serve else None
        self.kv, self.timeout_s, self.use_shm, self.layout = kv, timeout_s, use_shm, layout
        # A peer that did not answer gets no more tries for this long (three read timeouts).
        self.unreachable_s = 3 * timeout_s
        self.stats = {"remote_read_failures": 0, "remote_reads_skipped": 0}
        self._blocks = {"shm": 0, "tcp": 0}  # of lanes that ended
        self._lanes: dict[str, _Lane] = {}
        self._lock = threading.Lock()  # the lanes and the stats
        self._cv = threading.Condition(self._lock)
        self._loaded: dict[str, int] = {}
        self._pending = 0

    @classmethod
    def build(cls, ctx: KVWorkerContext) -> PDWorker:
        kt = ctx.config.kv_transfer
        port = rank_port(kt.kv_transfer_port, ctx.rank) if kt.serves else 0
        return cls(
            ctx.kv_caches,
            kt.serves,
            ctx.shm_path,
            kt.kv_transfer_host,
            port,
            kt.kv_transfer_timeout_s,
            kt.kv_transfer_shm,
            ctx.spec.kv_format or str(ctx.kv_caches.dtype),
            ctx.rank,
            ctx.secrets.get("grant_key"),
        )

    def describe(self) -> dict:
        return self.server.describe() if self.server is not None else {}

    def load_blocks(self, ops: TransferOps) -> None:
        """Start the step's reads (and tell peers whose blocks we did not need), each on its peer's lane."""
        with self._lock:
            for rid, load in ops.loads.items():
                lane = self._lane(load.endpoint_for(self.rank))
                if lane is None:
                    self.stats["remote_reads_skipped"] += 1
                    self._loaded[rid] = 0
                    self._cv.notify_all()
                    continue
                self._pending += 1
                lane.jobs.put((rid, load, None))
            for release in ops.releases:
                endpoint = release.endpoint_for(self.rank)
                lane = self._lane(endpoint)
                if lane is not None:  # else the prefill worker frees them after its hold timeout
                    lane.jobs.put(("", None, (endpoint, release.remote_request_id, release.grant)))

    def take_finished_loads(self, wait_s: float = 0.0) -> dict[str, int]:
        with self._cv:
            if wait_s and not self._loaded and self._pending:
                self._cv.wait(wait_s)
            out, self._loaded = self._loaded, {}
            return out

    def take_finished_sending(self) -> list[str]:
        return self.server.take_done() if self.server is not None else []

    def counters(self) -> dict[str, int]:
        with self._lock:
            lanes = [lane.client for lane in self._lanes.values()]
            return {
                **self.stats,
                "blocks_read_shm": self._blocks["shm"] + sum(c.blocks_by_shm for c in lanes),
                "blocks_read_tcp": self._blocks["tcp"] + sum(c.blocks_by_tcp for c in lanes),
                "blocks_served": self.server.blocks_served if self.server is not None else 0,
            }

    def _lane(self, endpoint: str) -> _Lane | None:
        """The peer's lane, started on first use (the lock is held); None past MAX_LANES peers."""
        lane = self._lanes.get(endpoint)
        if lane is None:
            if len(self._lanes) >= MAX_LANES:
                log.warning("KV transfer: %d peers in use, not %s: recomputing", MAX_LANES, endpoint)
                return None
            lane = self._lanes[endpoint] = _Lane(
                TransferClient(self.kv, self.timeout_s, self.use_shm, self.layout)
            )
            lane.thread = threading.Thread(
                target=self._run, args=(endpoint, lane), name="kv-transfer-loader", daemon=True
            )
            lane.thread.start()
        return lane

    def _run(self, endpoint: str, lane: _Lane) -> None:
        while True:
            try:
                job = lane.jobs.get(timeout=IDLE_LANE_S)
            except queue.Empty:
                with self._lock:  # apply() puts under this lock: an empty queue stays empty until we go
                    if not lane.jobs.empty():
                        continue
                    del self._lanes[endpoint]
                    self._retire(lane.client)
                return
            if job is None:
                return
            rid, load, release = job
            if release is not None:
                self._tell_done(lane, *release)
                continue
            assert load is not None
            ok = self._read(lane, rid, load)
            self._tell_done(lane, endpoint, load.remote_request_id, load.grant)
            with self._cv:
                self._loaded[rid] = ok
                self._pending -= 1
                self._cv.notify_all()

    def _read(self, lane: _Lane, rid: str, load: RemoteLoad) -> int:
        """Blocks that arrived (all or none); the decode worker recomputes what did not."""
        if time.monotonic() < lane.unreachable_until:
            with self._lock:
                self.stats["remote_reads_skipped"] += 1
            return 0
        try:
            lane.client.read(
                load.endpoint_for(self.rank), load.remote_block_ids, load.local_block_ids, load.grant
            )
            return len(load.local_block_ids)
        except Exception as e:
            with self._lock:
                self.stats["remote_read_failures"] += 1
            self._note_silence(lane, e)
            log.warning("KV transfer: reading %d blocks of %s from %s failed (%s): recomputing",
                        len(load.remote_block_ids), rid, load.endpoint_for(self.rank), e)  # fmt: skip
            return 0

    def _tell_done(
        self, lane: _Lane, endpoint: str, remote_request_id: str, grant: tuple[str, list[int], str]
    ) -> None:
        if time.monotonic() < lane.unreachable_until:
            return  # it did not answer a moment ago; it frees held blocks after its hold timeout
        try:
            lane.client.done(endpoint, remote_request_id, grant)
        except Exception as e:  # noqa: BLE001 - the prefill worker frees them after its hold timeout
            self._note_silence(lane, e)
            log.warning(
                "KV transfer: could not tell %s we are done with %s: %s", endpoint, remote_request_id, e
            )

    def _note_silence(self, lane: _Lane, e: Exception) -> None:
        if isinstance(e, TransferTimeout):  # not a refusal: the peer is gone or wedged
            lane.unreachable_until = time.monotonic() + self.unreachable_s

    def _retire(self, client: TransferClient) -> None:
        """A lane's client goes; its counts stay (the lock is held)."""
        self._blocks["shm"] += client.blocks_by_shm
        self._blocks["tcp"] += client.blocks_by_tcp
        client.close()

    def close(self) -> None:
        with self._lock:
            lanes = list(self._lanes.values())
            for lane in lanes:
                lane.jobs.put(None)
        for lane in lanes:
            if lane.thread is not None:
                lane.thread.join(timeout=15)
        with self._lock:
            for lane in lanes:
                self._retire(lane.client)
            self._lanes.clear()
        if self.server is not None:
            self.server.close()
