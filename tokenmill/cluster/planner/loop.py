"""The planner in a live fleet: every interval, read the fleet (the router's workers and arrivals, the
server's finished requests), decide, and have the connector carry the decision out. A disaggregated
fleet is two pools, prefill and decode workers, each with its own planner: the prefill pool scales on its
workers' queues and KV use and on TTFT, the decode pool on its workers' and on inter-token latency, both
within the bounds of the whole fleet. Decisions are in /metrics (`tokenmill:planner_*`, label `pool`)
and the log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.cluster.planner.connectors import ScaleConnector
from tokenmill.cluster.planner.policy import Planner
from tokenmill.cluster.planner.prometheus import PrometheusSignals
from tokenmill.cluster.planner.signals import FleetSnapshot, WorkerLoad
from tokenmill.cluster.router import in_pool

log = logging.getLogger(__name__)


@dataclass
class Pool:
    """Workers one planner sizes: the whole fleet ("all"), or the "prefill" or "decode" workers of a
    disaggregated one."""

    name: str
    planner: Planner
    connector: ScaleConnector
    target: int | None = None
    ups: int = 0
    downs: int = 0

    @property
    def role(self) -> str | None:
        return None if self.name == "all" else self.name


class PlannerLoop(Collector):
    def __init__(
        self,
        pools: list[Pool],
        router: Any,  # noqa: ANN401 - a RouterEngineClient
        metrics: Any = None,  # noqa: ANN401 - the server's Metrics (finished requests' latencies)
        window_s: float = 60.0,
        model: str = "",
        prometheus: PrometheusSignals | None = None,  # read the signals from Prometheus instead
        max_workers: int | None = None,  # the whole fleet's bound, shared by the pools
        scale_to_zero_after_s: float | None = None,  # --workers 0..MAX: idle seconds before none runs
    ) -> None:
        if not pools or (prometheus is not None and len(pools) > 1):
            raise ValueError("the planner needs one pool, or several without Prometheus signals")
        self.pools, self.router, self.metrics = pools, router, metrics
        self.prometheus = prometheus
        self.window_s, self.model = window_s, model
        self.max_workers = max_workers
        self.scale_to_zero_after_s = scale_to_zero_after_s
        if scale_to_zero_after_s is not None and len(pools) > 1:
            raise ValueError("a fleet that scales to zero has one pool")
        self._task: asyncio.Task | None = None
        self._idle_task: asyncio.Task | None = None
        self._waking: asyncio.Task | None = None
        self._busy_at = 0.0  # when the fleet last had a request in flight, arriving, or a worker launched

    def _held_shares(self, n: int, pool: Pool) -> list[int]:
        """The requests waiting in the router's queue, spread over n workers: they wait for the decode
        (or only) pool's places as surely as those queued in its engines."""
        fq = getattr(self.router, "fleet_queue", None)
        held = len(fq) if fq is not None and pool.role != "prefill" else 0
        return [held // n + (1 if i < held % n else 0) for i in range(n)]

    def snapshot(self, now: float, pool: Pool | None = None) -> FleetSnapshot | None:
        """The fleet (or one pool of it) as the planner sees it; None while no worker has reported
        (nothing to go on). Its time is that of the stalest serving worker's last report, so the planner
        can refuse old data."""
        pool = pool or self.pools[0]
        serving, starting, draining = pool.connector.counts()
        workers = [w for w in self.router.workers if w.serving() and not w.retired and in_pool(w, pool.role)]
        stats = [(w.client.last_heard, w.client.stats) for w in workers if w.client is not None]
        if not stats or any(st is None for _, st in stats):
            return None
        # The window is what the fleet has seen since the planner started, at most window_s.
        window = min(self.window_s, max(now - self._started, pool.planner.config.interval_s))
        arrivals = [n for t, n in self.router.arrivals if t >= now - window]
        recent = min(window, pool.planner.config.interval_s)
        lat = self.metrics.latency_window(window) if self.metrics is not None else {}
        # A pool answers for its own part of the latency: TTFT is the prefill pool's, ITL the decode
        # pool's. The queue-to-compute ratio mixes both (a request waits for a decode slot as well as
        # for its prefill), so a disaggregated pool scales on its own workers' queues instead.
        qc = (
            self.metrics.queue_to_compute_ratio(window)
            if self.metrics is not None and lat.get("finished") and pool.role is None
            else None
        )
        return FleetSnapshot(
            time=min(t for t, _ in stats),
            serving=serving,
            starting=starting,
            draining=draining,
            loads=[
                WorkerLoad(st.num_running, st.num_waiting + extra, st.kv_cache_usage)
                for (_, st), extra in zip(stats, self._held_shares(len(stats), pool), strict=True)
            ],
            window_s=window,
            requests=len(arrivals),
            queue_to_compute=qc,
            mean_isl=sum(arrivals) / len(arrivals) if arrivals else None,
            mean_osl=lat.get("mean_osl"),
            ttft_p95_s=lat.get("ttft_p95_s") if pool.role != "decode" else None,
            itl_p95_s=lat.get("itl_p95_s") if pool.role != "prefill" else None,
            # the last interval's arrivals: the planner's burst detection (policy.py, `surge`)
            recent_requests=sum(1 for t, _ in self.router.arrivals if t >= now - recent),
            recent_s=recent,
        )

    async def tick(self) -> None:
        for pool in self.pools:
            await self._tick(pool)

    async def _tick(self, pool: Pool) -> None:
        now = time.monotonic()
        if self.prometheus is not None:
            try:
                snap = await asyncio.to_thread(self.prometheus.snapshot, pool.connector.counts(), now)
            except Exception as e:  # noqa: BLE001 - Prometheus away: no decision this interval
                log.warning("planner: Prometheus query failed: %s", e)
                snap = None
        else:
            snap = self.snapshot(now, pool)
        if self.max_workers is not None and len(self.pools) > 1:
            # The pools share the fleet's bound: this one may grow into what the others leave.
            others = sum(sum(p.connector.counts()[:2]) for p in self.pools if p is not pool)
            c = pool.planner.config
            c.max_workers = max(c.min_workers, self.max_workers - others)
        d = pool.planner.decide(snap, now)
        pool.target = d.target if d.current >= 0 else pool.target
        if d.delta and d.current >= 0:
            what = "workers" if pool.role is None else f"{pool.role} workers"
            log.info("planner: %d -> %d %s (%s)", d.current, d.target, what, d.reason)
            if d.delta > 0:
                pool.ups += 1
            else:
                pool.downs += 1
            await pool.connector.scale_to(d.target)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.pools[0].planner.config.interval_s)
            try:
                await self.tick()
            except Exception:  # a failed decision or launch waits for the next interval
                log.exception("planner: this interval's decision failed")

    # -- scale to zero ------------------------------------------------------------------------------
    # The policy keeps at least one worker; going to zero and back is the loop's, on events rather than
    # signals: no request for scale_to_zero_after_s stops the last worker, and a request that finds
    # none starts one at once (it waits at the router meanwhile, router/cold_start.py).
    def wake(self) -> None:
        """A request waits with no worker in rotation: launch one now, unless one is starting."""
        if self._waking is not None and not self._waking.done():
            return
        self._waking = asyncio.get_running_loop().create_task(self._wake())

    async def _wake(self) -> None:
        pool = self.pools[0]
        serving, starting, _ = pool.connector.counts()
        if serving + starting > 0:
            return  # one is starting (or serving: the request was sent there meanwhile)
        log.info("planner: 0 -> 1 workers (a request waits for a cold start)")
        self._busy_at = time.monotonic()
        # (the policy's cool-down is not restarted: a burst that woke the fleet may need a second worker
        # as soon as the policy sees it; a worker starting already keeps it from launching twice)
        try:
            await pool.connector.scale_to(1)
        except Exception:  # the idle watcher asks again while requests wait; they time out (503) meanwhile
            log.exception("planner: launching a worker for a cold start failed")
            return
        pool.target = 1
        pool.ups += 1

    async def _watch_idle(self) -> None:
        assert self.scale_to_zero_after_s is not None
        idle_s = self.scale_to_zero_after_s
        every = min(1.0, idle_s / 4)
        pool = self.pools[0]
        while True:
            await asyncio.sleep(every)
            try:
                await self._look_idle(idle_s, pool)
            except Exception:  # noqa: BLE001 - one bad look must not end scaling to zero for good
                log.exception("planner: the idle watcher's look failed")

    async def _look_idle(self, idle_s: float, pool: Pool) -> None:
        now = time.monotonic()
        arrivals = self.router.arrivals
        if self.router.requests_in_flight or (arrivals and arrivals[-1][0] > self._busy_at):
            self._busy_at = max(now if self.router.requests_in_flight else arrivals[-1][0], self._busy_at)
        serving, starting, draining = pool.connector.counts()
        cold = getattr(self.router, "cold_start", None)
        if cold is not None and len(cold) and not serving and not starting:
            self.wake()  # requests wait and no worker is on its way (a launch failed): try again
            return
        # Only the last worker, and only once it serves: the policy takes the fleet down to one, and
        # a worker starting was launched for a request.
        if serving != 1 or starting or draining or now - self._busy_at < idle_s:
            return
        log.info("planner: 1 -> 0 workers (no request for %.0fs: scaled to zero)", now - self._busy_at)
        pool.target = 0
        pool.downs += 1
        pool.planner.last_change = now
        try:
            await pool.connector.scale_to(0)
        except Exception:  # noqa: BLE001 - tried again at the next look
            log.exception("planner: scaling to zero failed")

    def start(self) -> None:
        self._started = self._busy_at = time.monotonic()
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())
        if self.scale_to_zero_after_s is not None:
            cold = getattr(self.router, "cold_start", None)
            if cold is not None:
                cold.on_wait = self.wake
            self._idle_task = loop.create_task(self._watch_idle())

    async def stop(self) -> None:
        cold = getattr(self.router, "cold_start", None)
        if cold is not None and cold.on_wait == self.wake:
            cold.on_wait = None  # a retry parking during shutdown must not launch a worker
        for task in (self._task, self._idle_task, self._waking):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    _started = 0.0

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "pool"]
        g = GaugeMetricFamily("tokenmill:planner_workers", "Workers by state", labels=[*labels, "state"])
        t = GaugeMetricFamily("tokenmill:planner_target_workers", "The planner's last target", labels=labels)
        c = CounterMetricFamily(
            "tokenmill:planner_decisions", "Scaling decisions carried out", labels=[*labels, "direction"]
        )
        for pool in self.pools:
            serving, starting, draining = pool.connector.counts()
            for state, n in (("serving", serving), ("starting", starting), ("draining", draining)):
                g.add_metric([self.model, pool.name, state], n)
            t.add_metric(
                [self.model, pool.name], pool.target if pool.target is not None else serving + starting
            )
            c.add_metric([self.model, pool.name, "up"], pool.ups)
            c.add_metric([self.model, pool.name, "down"], pool.downs)
        yield g
        yield t
        yield c
