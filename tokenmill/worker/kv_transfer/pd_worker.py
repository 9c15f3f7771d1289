"""The worker's half of disaggregated prefill and decode: it serves this worker's KV cache to decode
workers (a TransferServer) and reads prefill workers' blocks into it (a TransferClient on a loader
thread), so no step waits for a transfer."""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path

import torch

from tokenmill.worker.kv_transfer.ops import RemoteLoad, TransferOps
from tokenmill.worker.kv_transfer.transfer_engine import TransferClient, TransferServer

log = logging.getLogger(__name__)


class PDWorker:
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
    ) -> None:
        self.server = TransferServer(kv, shm_path, host, port, layout) if serve else None
        self.client = TransferClient(kv, timeout_s, use_shm, layout)
        self.stats = {"remote_read_failures": 0}
        self._jobs: queue.Queue[tuple[str, RemoteLoad | None, tuple | None] | None] = queue.Queue()
        self._cv = threading.Condition()
        self._loaded: dict[str, int] = {}
        self._pending = 0
        self._thread = threading.Thread(target=self._loop, name="kv-transfer-loader", daemon=True)
        self._thread.start()

    def describe(self) -> dict:
        return self.server.describe() if self.server is not None else {}

    def apply(self, ops: TransferOps) -> None:
        for rid, load in ops.loads.items():
            with self._cv:
                self._pending += 1
            self._jobs.put((rid, load, None))
        for release in ops.releases:
            self._jobs.put(("", None, release))

    def take_finished_loads(self, wait_s: float = 0.0) -> dict[str, int]:
        with self._cv:
            if wait_s and not self._loaded and self._pending:
                self._cv.wait(wait_s)
            out, self._loaded = self._loaded, {}
            return out

    def take_finished_sending(self) -> list[str]:
        return self.server.take_done() if self.server is not None else []

    def counters(self) -> dict[str, int]:
        return {
            **self.stats,
            "blocks_read_shm": self.client.blocks_by_shm,
            "blocks_read_tcp": self.client.blocks_by_tcp,
            "blocks_served": self.server.blocks_served if self.server is not None else 0,
        }

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            rid, load, release = job
            if release is not None:
                self._tell_done(*release)
                continue
            assert load is not None
            ok = 0
            try:
                self.client.read(load.endpoint, load.remote_block_ids, load.local_block_ids, load.grant)
                ok = len(load.local_block_ids)
            except Exception as e:  # the decode worker recomputes what did not arrive
                self.stats["remote_read_failures"] += 1
                log.warning("KV transfer: reading %d blocks of %s from %s failed (%s): recomputing",
                            len(load.remote_block_ids), rid, load.endpoint, e)  # fmt: skip
            self._tell_done(load.endpoint, load.remote_request_id, load.grant)
            with self._cv:
                self._loaded[rid] = ok
                self._pending -= 1
                self._cv.notify_all()

    def _tell_done(self, endpoint: str, remote_request_id: str, grant: tuple[str, list[int], str]) -> None:
        try:
            self.client.done(endpoint, remote_request_id, grant)
        except Exception as e:  # noqa: BLE001 - the prefill worker frees them after its hold timeout
            log.warning(
                "KV transfer: could not tell %s we are done with %s: %s", endpoint, remote_request_id, e
            )

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=15)
        self.client.close()
        if self.server is not None:
            self.server.close()
