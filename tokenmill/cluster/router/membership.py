"""Who is in the fleet, and whether they answer: joining workers (and rejoining lost ones, with their
part of the index rebuilt from their events), discovery, supervision, draining, and the requests of a
worker gone silent.

A mixin of RouterEngineClient: launchers (cluster/fleet.py, cluster/ray_launcher.py) override its hooks
(`_client_for`, `_resolve`) to start and find the workers they run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

import zmq

from tokenmill.cluster.kv_subscriber import KVEventSubscriber
from tokenmill.cluster.router.settings import REJOIN_EVERY_S
from tokenmill.cluster.router.worker import Worker, in_pool, reachable
from tokenmill.engine.client import EngineDeadError, ZmqEngineClient, new_context

if TYPE_CHECKING:
    import zmq.asyncio

    from tokenmill.cluster.discovery import Discovery
    from tokenmill.cluster.router.board import Board
    from tokenmill.cluster.router.metrics import RouterStats
    from tokenmill.cluster.router.prefix_index import PrefixIndex
    from tokenmill.cluster.router.relay import Relay
    from tokenmill.cluster.router.settings import RouterSettings

log = logging.getLogger(__name__)


def startup_timeout_rejoin(startup_timeout: float) -> float:
    return min(startup_timeout, 5.0)


class Membership:
    workers: list[Worker]
    settings: RouterSettings
    prefix: PrefixIndex
    board: Board
    stats_router: RouterStats
    discovery: Discovery | None
    discovery_interval_s: float
    startup_timeout: float
    heartbeat_timeout: float | None
    info: dict
    block_size: int
    _where: dict[str, Relay]
    _joins: set[asyncio.Task]
    _ctx: zmq.asyncio.Context | None
    _task: asyncio.Task | None
    _last_discovery: float

    # -- the fleet's size (the planner) -----------------------------------------------------------------
    def fleet_counts(self, pool: str | None = None) -> tuple[int, int, int]:
        """Workers (serving, starting, draining): those that take requests, those launched that do not
        yet, and those finishing their requests before they stop; of one pool of a disaggregated fleet
        ("prefill" or "decode") when `pool` is given."""
        live = [w for w in self.workers if not w.retired and in_pool(w, pool)]
        serving = sum(1 for w in live if w.serving())
        starting = sum(1 for w in live if not w.up and not w.draining)
        return serving, starting, len(live) - serving - starting

    def join_new(self, w: Worker) -> None:
        """Join a worker just launched, allowing it the whole start-up time (a rejoin allows 5 s)."""
        w.joining, w.last_attempt = True, time.monotonic()
        task = asyncio.get_running_loop().create_task(self._join(w, self.startup_timeout))
        self._joins.add(task)
        task.add_done_callback(self._joins.discard)

    async def drain(self, w: Worker, timeout_s: float = 600.0) -> None:
        """Take a worker out of rotation, let its requests finish (or time out), then drop it."""
        w.draining = True
        self.board.invalidate()
        log.info(
            "draining worker %s (%d requests to finish, at most %.0fs)", w.name, len(w.active), timeout_s
        )
        self.stats_router.drains += 1
        self.stats_router.drain_requests += len(w.active)
        deadline = time.monotonic() + timeout_s
        while w.active and w.up and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if w.active:
            log.warning(
                "worker %s still had %d requests after draining %.0fs", w.name, len(w.active), timeout_s
            )
        w.retired = True
        if w.up:
            await self._leave(w, "drained (scaled down)", planned=True)
        if w.subscriber is not None:
            await w.subscriber.stop()
            w.subscriber = None

    # -- health -------------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return any(w.up for w in self.workers) or self.scaled_to_zero

    @property
    def scaled_to_zero(self) -> bool:
        """No worker up by design: a fleet that scales to zero whose workers were all drained away, or
        whose only ones are starting for a cold start; a request now waits for one (not a dead fleet).
        A worker that was up and was lost (or one whose start failed) makes it not so: that is a
        failure, said as one."""
        if not self.settings.scale_to_zero or any(w.up for w in self.workers):
            return False
        return all(w.retired or w.draining or (w.joins == 0 and not w.start_failed) for w in self.workers)

    @property
    def dead_reason(self) -> str | None:
        return None if self.healthy else "no worker is up"

    @property
    def requests_in_flight(self) -> int:
        """Requests the router holds: sent to a worker, waiting for a retry or for a cold start."""
        return len(self._where)

    def _joined(self) -> None:
        """A hook: a worker has just joined (the router sends it the requests waiting for one)."""

    def _expire_cold_waits(self, now: float) -> None:
        """A hook: end the requests that waited too long for a cold start."""

    def _release_held(self) -> None:
        """A hook: send the requests waiting in the router's queue to workers that have room."""

    @property
    def num_up(self) -> int:
        return sum(w.up for w in self.workers)

    @property
    def num_answering(self) -> int:
        """Workers that get new requests now (up, and heard from within SUSPECT_AFTER_S)."""
        now = time.monotonic()
        return sum(w.answering(now) for w in self.workers)

    # -- joining and leaving ------------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = new_context()
        if self.discovery is not None:
            await self._discover()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            pending = [w for w in self.workers if not w.retired]
            left = max(1.0, deadline - time.monotonic())
            # Failures are said once the round is over: each worker's warning where others came up,
            # else the reasons in the one error (every worker of a bad model file fails alike).
            await asyncio.gather(*(self._join(w, left, report=False) for w in pending))
            if any(w.up for w in self.workers):
                for w in pending:
                    if not w.up and w.last_error is not None:
                        log.warning("worker %s is not up: %s", w.url, w.last_error)
                break
            if self.discovery is None or time.monotonic() > deadline:
                reasons = sorted({w.last_error for w in pending if w.last_error is not None})
                raise EngineDeadError(
                    f"no worker answered ({', '.join(w.url for w in pending) or 'none found'})"
                    + (f": {'; '.join(reasons)}" if reasons else "")
                )
            await asyncio.sleep(self.discovery_interval_s)  # none found or ready yet: look again
            await self._discover()
        self._task = asyncio.create_task(self._supervise())

    async def _discover(self) -> None:
        """Make the discovered part of the fleet match what discovery says now."""
        assert self.discovery is not None
        self._last_discovery = time.monotonic()
        try:
            found = await asyncio.to_thread(self.discovery.addresses)
        except Exception as e:  # noqa: BLE001 - a failed look-up changes nothing; try again later
            log.warning("worker discovery failed: %s", e)
            return
        current = {w.url: w for w in self.workers if not w.retired}
        for url, w in current.items():
            if w.discovered and url not in found and not w.draining:
                if w.up and w.active:
                    # A terminating pod leaves discovery at once but drains on its SIGTERM: its streams
                    # finish there, and it gets nothing new meanwhile.
                    log.info("worker %s is no longer discovered: draining it", url)
                    task = asyncio.get_running_loop().create_task(self.drain(w))
                    self._joins.add(task)
                    task.add_done_callback(self._joins.discard)
                    continue
                if w.up:
                    await self._leave(w, "no longer discovered", planned=True)
                w.retired = True
        for url in sorted(found - current.keys()):
            free = next((w.slot for w in self.workers if w.retired), len(self.workers))
            w = Worker(free, url, url, discovered=True)
            if free == len(self.workers):
                self.workers.append(w)
            else:
                self.workers[free] = w
            log.info("discovered worker %s (slot %d)", url, free)
        self.board.invalidate()

    def _client_for(self, w: Worker, timeout: float) -> ZmqEngineClient:
        """A client for a worker (a hook: launched workers also watch their process)."""
        return ZmqEngineClient(w.url, startup_timeout=timeout, heartbeat_timeout=self.heartbeat_timeout)

    async def _resolve(self, w: Worker) -> None:
        """Where the worker listens now (a hook: a launcher may move a restarted worker); raises
        EngineDeadError while it cannot say."""

    async def _join(self, w: Worker, timeout: float, report: bool = True) -> None:
        """Start a client for the worker and put it in rotation; on failure its reason is kept in
        `w.last_error` (and logged, with `report`)."""
        w.joining, w.last_attempt, w.last_error = True, time.monotonic(), None
        try:
            await self._resolve(w)
        except EngineDeadError as e:
            w.last_error = str(e)
            w.start_failed = w.start_failed or w.joins == 0
            if report:
                log.warning("worker %s is not up: %s", w.name, e)
            w.joining = False
            return
        client = self._client_for(w, timeout)
        try:
            await client.start()
            info = client.info
            if w.retired:
                raise EngineDeadError("dropped from the fleet while it joined")
            if info.get("draining"):
                raise EngineDeadError("it is draining (stopping)")
            bs = int(info.get("block_size", 0))
            if self.block_size and bs != self.block_size:
                raise EngineDeadError(f"block size {bs} differs from the fleet's {self.block_size}")
            self.block_size = self.block_size or bs or 16  # the first to join says it: the rest must match
            if self.info and info.get("model") != self.info.get("model"):
                raise EngineDeadError(f"serves {info.get('model')!r}, the fleet {self.info.get('model')!r}")
            self.prefix.set_block_size(self.block_size)
            self.prefix.remove_worker(w.slot)
            ev = info.get("kv_events")
            if ev and self.settings.policy == "kv":
                assert self._ctx is not None and self.prefix.events is not None
                w.subscriber = KVEventSubscriber(
                    self._ctx,
                    w.slot,
                    reachable(ev["endpoint"], w.url),
                    reachable(ev["replay_endpoint"], w.url) if ev.get("replay_endpoint") else None,
                    ev.get("topic", ""),
                    self.prefix.events,
                )
                w.subscriber.start()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(w.subscriber.synced.wait(), 5.0)
            elif self.settings.policy == "kv":
                log.warning("worker %s publishes no KV events: routed by load alone", w.url)
        except (EngineDeadError, OSError, zmq.ZMQError) as e:
            w.last_error = str(e)
            w.start_failed = w.start_failed or w.joins == 0
            if report:  # (quietly after it left as planned: it was stopped, not lost)
                (log.debug if w.left_planned else log.warning)("worker %s is not up: %s", w.url, e)
            client.fail(f"not joined: {e}")  # and so not told to shut down: it may be starting still
            await client.shutdown()
            w.joining = False
            return
        if not self.info:
            self.info = dict(info)
        self.info["max_model_len"] = min(int(self.info["max_model_len"]), int(info["max_model_len"]))
        w.client, w.info, w.up, w.joining = client, info, True, False
        w.joins += 1
        w.left_planned = False
        w.weigh(self.settings.prefill_weight)
        self.info["workers"] = sum(x.up for x in self.workers)
        self.board.invalidate()
        log.info("worker %s joined (slot %d)", w.url, w.slot)
        self._joined()

    async def _leave(self, w: Worker, reason: str, planned: bool = False) -> None:
        w.left_planned = planned or w.stopping()  # scaled down, or drained on a SIGTERM: not a loss
        if w.left_planned:
            log.info("worker %s left rotation: %s", w.url, reason)
        else:
            log.warning("worker %s left rotation: %s", w.url, reason)
            self.stats_router.worker_losses += 1
        w.up = False
        self.board.invalidate()
        self.prefix.remove_worker(w.slot)
        if w.subscriber is not None:
            await w.subscriber.stop()
            w.subscriber = None
        if w.client is not None:
            # Its requests get EngineDeadError through their relays: retried, or ended with an error.
            if w.client.dead_reason is None:
                w.client.fail(f"worker {w.url} left: {reason}")
            await w.client.shutdown()
            w.client = None
        w.clear_active()
        self.info["workers"] = sum(x.up for x in self.workers)

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            if self.discovery is not None and now - self._last_discovery >= self.discovery_interval_s:
                await self._discover()
            for w in self.workers:
                if w.retired:
                    continue
                if w.up and w.client is not None and w.client.dead_reason is not None:
                    await self._leave(w, w.client.dead_reason)
                elif not w.up and not w.joining and now - w.last_attempt >= REJOIN_EVERY_S:
                    asyncio.create_task(self._join(w, startup_timeout_rejoin(self.startup_timeout)))
            self._find_lost(time.monotonic())
            self._expire_cold_waits(time.monotonic())
            self._release_held()  # workers that joined, left, or whose engine queue emptied

    def _find_lost(self, now: float) -> None:
        """Requests whose worker has sent nothing (no output, no heartbeat) for settings.lost_after_s
        since they were sent are lost: aborted there (should it speak again), then retried if they have
        no token yet, else ended with EngineDeadError; the worker gets no retries while it is silent."""
        bound = self.settings.lost_after_s
        for w in self.workers:
            c = w.client
            # (a client known dead has failed its requests already)
            if not w.active or c is None or c.dead_reason is not None or now - c.last_heard <= bound:
                continue
            lost = [
                relay
                for rid in w.active
                if (relay := self._where.get(rid)) is not None
                and relay.slot == w.slot
                and now - relay.sent_at > bound
            ]
            if not lost:
                continue
            why = f"no word from worker {w.name} for {now - c.last_heard:.0f}s (lost after {bound:g}s)"
            log.warning("%d requests on worker %s are lost: %s", len(lost), w.name, why)
            with contextlib.suppress(EngineDeadError, zmq.ZMQError):
                c.abort([relay.req.request_id for relay in lost])  # its late outputs go nowhere
            for relay in lost:
                relay.put_nowait(EngineDeadError(why))
