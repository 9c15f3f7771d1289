"""The planner in a live fleet: every interval, read the fleet (the router's workers and arrivals, the
server's finished requests), decide, and have the connector carry the decision out. Its decisions are
in /metrics (`tokenmill:planner_*`) and the log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.cluster.planner.connectors import ScaleConnector
from tokenmill.cluster.planner.policy import Planner
from tokenmill.cluster.planner.prometheus import PrometheusSignals
from tokenmill.cluster.planner.signals import FleetSnapshot, WorkerLoad

log = logging.getLogger(__name__)


class PlannerLoop(Collector):
    def __init__(
        self,
        planner: Planner,
        connector: ScaleConnector,
        router: Any,  # noqa: ANN401 - a RouterEngineClient
        metrics: Any = None,  # noqa: ANN401 - the server's Metrics (finished requests' latencies)
        window_s: float = 60.0,
        model: str = "",
        prometheus: PrometheusSignals | None = None,  # read the signals from Prometheus instead
    ) -> None:
        self.planner, self.connector, self.router, self.metrics = planner, connector, router, metrics
        self.prometheus = prometheus
        self.window_s, self.model = window_s, model
        self.target: int | None = None
        self.ups = self.downs = 0
        self._task: asyncio.Task | None = None

    def snapshot(self, now: float) -> FleetSnapshot | None:
        """The fleet as the planner sees it; None while no worker has reported (nothing to go on). Its
        time is that of the stalest serving worker's last report, so the planner can refuse old data."""
        serving, starting, draining = self.connector.counts()
        workers = [w for w in self.router.workers if w.up and not w.draining and not w.retired]
        stats = [(w.client.last_heard, w.client.stats) for w in workers if w.client is not None]
        if not stats or any(st is None for _, st in stats):
            return None
        # The window is what the fleet has seen since the planner started, at most window_s.
        window = min(self.window_s, max(now - self._started, self.planner.config.interval_s))
        arrivals = [n for t, n in self.router.arrivals if t >= now - window]
        lat = self.metrics.latency_window(window) if self.metrics is not None else {}
        qc = (
            self.metrics.queue_to_compute_ratio(window)
            if self.metrics is not None and lat.get("finished")
            else None
        )
        return FleetSnapshot(
            time=min(t for t, _ in stats),
            serving=serving,
            starting=starting,
            draining=draining,
            loads=[WorkerLoad(st.num_running, st.num_waiting, st.kv_cache_usage) for _, st in stats],
            window_s=window,
            requests=len(arrivals),
            queue_to_compute=qc,
            mean_isl=sum(arrivals) / len(arrivals) if arrivals else None,
            mean_osl=lat.get("mean_osl"),
            ttft_p95_s=lat.get("ttft_p95_s"),
            itl_p95_s=lat.get("itl_p95_s"),
        )

    async def tick(self) -> None:
        now = time.monotonic()
        if self.prometheus is not None:
            try:
                snap = await asyncio.to_thread(self.prometheus.snapshot, self.connector.counts(), now)
            except Exception as e:  # noqa: BLE001 - Prometheus away: no decision this interval
                log.warning("planner: Prometheus query failed: %s", e)
                snap = None
        else:
            snap = self.snapshot(now)
        d = self.planner.decide(snap, now)
        self.target = d.target if d.current >= 0 else self.target
        if d.delta and d.current >= 0:
            log.info("planner: %d -> %d workers (%s)", d.current, d.target, d.reason)
            if d.delta > 0:
                self.ups += 1
            else:
                self.downs += 1
            await self.connector.scale_to(d.target)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.planner.config.interval_s)
            try:
                await self.tick()
            except Exception:  # a failed decision or launch waits for the next interval
                log.exception("planner: this interval's decision failed")

    def start(self) -> None:
        self._started = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    _started = 0.0

    def collect(self) -> Iterator[Metric]:
        serving, starting, draining = self.connector.counts()
        g = GaugeMetricFamily("tokenmill:planner_workers", "Workers by state", labels=["model_name", "state"])
        for state, n in (("serving", serving), ("starting", starting), ("draining", draining)):
            g.add_metric([self.model, state], n)
        yield g
        t = GaugeMetricFamily(
            "tokenmill:planner_target_workers", "The planner's last target", labels=["model_name"]
        )
        t.add_metric([self.model], self.target if self.target is not None else serving + starting)
        yield t
        c = CounterMetricFamily(
            "tokenmill:planner_decisions", "Scaling decisions carried out", labels=["model_name", "direction"]
        )
        c.add_metric([self.model, "up"], self.ups)
        c.add_metric([self.model, "down"], self.downs)
        yield c
