"""The planner's signals from a Prometheus server that scrapes the fleet's /metrics, instead of from
the router in this process: the way to run the planner beside a fleet it does not front (Kubernetes,
several front ends). Queries go to Prometheus' HTTP API (/api/v1/query); a sample's own timestamp is the
snapshot's, so data Prometheus stopped getting is seen as stale, not as calm."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tokenmill.cluster.planner.signals import FleetSnapshot, WorkerLoad


class PrometheusSignals:
    def __init__(
        self, url: str, model: str, window_s: float = 60.0, client: httpx.Client | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.window_s = window_s
        self.client = client or httpx.Client(timeout=5.0)

    def _query(self, q: str) -> list[dict[str, Any]]:
        r = self.client.get(f"{self.url}/api/v1/query", params={"query": q})
        r.raise_for_status()
        body = r.json()
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus: {body.get('error', body)}")
        return body["data"]["result"]

    def _scalar(self, q: str) -> tuple[float | None, float | None]:
        """(value, sample time) of a query with one series; (None, None) when there is none or it is NaN."""
        res = self._query(q)
        if not res:
            return None, None
        ts, v = res[0]["value"]
        value = float(v)
        return (None, float(ts)) if value != value else (value, float(ts))  # NaN: no data in the window

    def snapshot(self, counts: tuple[int, int, int], now: float | None = None) -> FleetSnapshot | None:
        """The fleet's signals; `counts` (serving, starting, draining) come from the connector. None when
        Prometheus has no worker series for the model."""
        sel = f'model_name="{self.model}"'
        w = f"{int(self.window_s)}s"
        per_worker: dict[str, dict[str, float]] = {}
        oldest = None
        for name, key in (("num_requests_running", "running"), ("num_requests_waiting", "waiting"),
                          ("kv_cache_usage_perc", "kv")):  # fmt: skip
            for s in self._query(f"tokenmill:{name}{{{sel}}}"):
                ts, v = s["value"]
                per_worker.setdefault(s["metric"].get("worker", ""), {})[key] = float(v)
                oldest = float(ts) if oldest is None else min(oldest, float(ts))
        if not per_worker or oldest is None:
            return None
        finished, _ = self._scalar(f"sum(increase(tokenmill:request_success_total{{{sel}}}[{w}]))")
        prompt, _ = self._scalar(f"sum(increase(tokenmill:prompt_tokens_total{{{sel}}}[{w}]))")
        gen, _ = self._scalar(f"sum(increase(tokenmill:generation_tokens_total{{{sel}}}[{w}]))")
        qc, _ = self._scalar(f"max(tokenmill:queue_to_compute_ratio{{{sel}}})")

        def p95(hist: str) -> float | None:
            q = f"histogram_quantile(0.95, sum(rate(tokenmill:{hist}_bucket{{{sel}}}[{w}])) by (le))"
            return self._scalar(q)[0]

        n = finished or 0.0
        wall, mono = time.time(), time.monotonic() if now is None else now
        serving, starting, draining = counts
        return FleetSnapshot(
            time=mono - max(wall - oldest, 0.0),  # the stalest worker series, on this process' clock
            serving=serving,
            starting=starting,
            draining=draining,
            loads=[
                WorkerLoad(int(v.get("running", 0)), int(v.get("waiting", 0)), v.get("kv", 0.0))
                for v in per_worker.values()
            ],  # fmt: skip
            window_s=self.window_s,
            # Finished requests stand for arrivals: Prometheus sees no request before it ends.
            requests=round(n),
            queue_to_compute=qc if n else None,
            mean_isl=prompt / n if n and prompt is not None else None,
            mean_osl=gen / n if n and gen is not None else None,
            ttft_p95_s=p95("time_to_first_token_seconds") if n else None,
            itl_p95_s=p95("inter_token_latency_seconds") if n else None,
        )
