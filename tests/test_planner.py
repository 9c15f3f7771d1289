"""The planner's decisions, by hand: bounds, hysteresis, cool-downs, draining, stale or missing signals,
the SLA mode's forecast and capacity; the connectors' requests (Kubernetes through a stand-in for the
official client: no cluster runs here)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tokenmill.cluster.planner.capacity import sizing_capacity
from tokenmill.cluster.planner.connectors import FleetConnector, KubernetesConnector
from tokenmill.cluster.planner.forecast import HoltForecaster
from tokenmill.cluster.planner.policy import Planner, PlannerConfig
from tokenmill.cluster.planner.signals import FleetSnapshot, WorkerLoad
from tokenmill.cluster.router import Worker
from tokenmill.server.config import ServerConfig
from tokenmill.sizing import arch, hardware
from tokenmill.sizing.roofline import Deployment


def snap(
    t: float, serving: int, *, qc: float | None = 0.0, waiting: int = 0, kv: float = 0.1, **kw
) -> FleetSnapshot:
    loads = [WorkerLoad(1, waiting // max(serving, 1), kv) for _ in range(serving)]
    return FleetSnapshot(time=t, serving=serving, loads=loads, queue_to_compute=qc, **kw)


def load_planner(**kw) -> Planner:
    base = {"min_workers": 1, "max_workers": 4, "interval_s": 10, "up_cooldown_s": 30, "down_cooldown_s": 60,
            "up_intervals": 2, "down_intervals": 3}  # fmt: skip
    return Planner(PlannerConfig(**{**base, **kw}))


def test_scales_up_only_after_pressure_persists_and_then_cools_down() -> None:
    p = load_planner()
    assert p.decide(snap(0, 1, qc=2.0), 0).target == 1  # one pressured reading is not enough
    d = p.decide(snap(10, 1, qc=2.0), 10)
    assert d.target == 2 and "queue/compute" in d.reason
    # Still pressured, but the new worker is starting: no second worker on top of it.
    assert p.decide(FleetSnapshot(20, 1, starting=1, queue_to_compute=2.0), 20).target == 2
    # Up and serving, still pressured: the cool-down holds it until 30 s after the change.
    assert p.decide(snap(20, 2, qc=2.0), 20).target == 2
    assert p.decide(snap(30, 2, qc=2.0), 30).target == 2  # pressure count restarted at the change
    assert p.decide(snap(40, 2, qc=2.0), 40).target == 3


def test_a_single_calm_reading_between_pressured_ones_resets_the_count() -> None:
    p = load_planner()
    p.decide(snap(0, 1, qc=2.0), 0)
    p.decide(snap(10, 1, qc=0.1), 10)
    assert p.decide(snap(20, 1, qc=2.0), 20).target == 1
    assert p.decide(snap(30, 1, qc=2.0), 30).target == 2


@pytest.mark.parametrize(
    ("kw", "why"),
    [({"waiting": 20}, "waiting per worker"), ({"kv": 0.95}, "KV usage")],
)
def test_waiting_requests_and_kv_usage_are_pressure_too(kw: dict, why: str) -> None:
    p = load_planner(up_intervals=1)
    d = p.decide(snap(0, 2, **kw), 0)
    assert d.target == 3 and why in d.reason


def test_scales_down_one_at_a_time_when_one_fewer_would_still_be_quiet() -> None:
    p = load_planner()
    # KV use 0.3 on 3 workers is 0.45 on 2: under down_kv_usage (0.5), so quiet.
    for t in (0, 10):
        assert p.decide(snap(t, 3, kv=0.3), t).target == 3
    d = p.decide(snap(20, 3, kv=0.3), 20)
    assert d.target == 2 and "quiet" in d.reason
    # A worker is draining: nothing more goes until it is gone, and the cool-down runs.
    assert p.decide(FleetSnapshot(30, 2, draining=1, queue_to_compute=0.0), 30).target == 2
    for t in (40, 50, 60, 70):
        assert p.decide(snap(t, 2, kv=0.1), t).target == 2  # 70 < 20 + 60: still cooling
    assert p.decide(snap(80, 2, kv=0.1), 80).target == 1
    # At the floor, quiet changes nothing.
    for t in range(200, 300, 10):
        assert p.decide(snap(t, 1, kv=0.0), t).target == 1


def test_no_scale_down_when_the_rest_would_be_too_full() -> None:
    p = load_planner(down_intervals=1)
    assert p.decide(snap(0, 2, kv=0.4), 0).target == 2  # 0.4 on 2 is 0.8 on 1: not quiet


def test_a_few_waiting_requests_in_a_large_fleet_are_still_quiet() -> None:
    # 3 waiting over 7 workers left (one fewer) is under 1 per worker: a busy fleet of 8 still shrinks.
    p = load_planner(max_workers=8, down_intervals=1)
    loads = [WorkerLoad(1, 1 if i < 3 else 0, 0.2) for i in range(8)]
    assert p.decide(FleetSnapshot(0, 8, loads=loads, queue_to_compute=0.0), 0).target == 7
    # 2 waiting on the one worker that would be left is not quiet.
    p = load_planner(down_intervals=1)
    assert p.decide(snap(0, 2, waiting=2, kv=0.1), 0).target == 2


def test_bounds_are_kept_whatever_the_signals() -> None:
    p = load_planner(max_workers=2, up_intervals=1)
    assert p.decide(snap(0, 2, qc=9.0), 0).target == 2
    assert load_planner(min_workers=2).decide(snap(0, 1), 0).target == 2  # below the floor: back up at once
    assert load_planner(max_workers=2).decide(snap(0, 3), 0).target == 2
    with pytest.raises(ValueError, match="min workers"):
        PlannerConfig(min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="mode"):
        PlannerConfig(mode="magic")


def test_no_decision_from_stale_or_missing_signals() -> None:
    p = load_planner(up_intervals=1)
    d = p.decide(None, 100)
    assert d.delta == 0 and d.reason == "no signals"
    d = p.decide(snap(0, 1, qc=9.0), 100)  # 100 s old, the limit is 3 intervals (30 s)
    assert d.delta == 0 and "old" in d.reason
    assert p.decide(snap(95, 1, qc=9.0), 100).target == 2


def test_sla_mode_provisions_the_forecast_over_capacity_with_headroom() -> None:
    cfg = PlannerConfig(mode="sla", min_workers=1, max_workers=10, interval_s=10, up_cooldown_s=0,
                        down_cooldown_s=0, headroom=0.1, startup_s=0, down_intervals=2)  # fmt: skip
    p = Planner(cfg, capacity=lambda isl, osl: 2.0)  # each worker: 2 requests/s
    # 6 req/s steady: ceil(6 * 1.1 / 2) = 4.
    d = p.decide(snap(0, 1, window_s=10, requests=60, mean_isl=100, mean_osl=50), 0)
    assert d.target == 4
    # A rising rate: Holt's trend looks ahead of the last reading.
    p2 = Planner(cfg, capacity=lambda isl, osl: 2.0)
    serving = 1
    for t in range(10):  # 1, 2, ..., 10 req/s
        d = p2.decide(
            snap(t * 10, serving, window_s=10, requests=10 * (t + 1), mean_isl=100, mean_osl=50), t * 10
        )
        serving = d.target
    assert d.target >= 7  # ceil(10 * 1.1 / 2) = 6 for the last reading; the forecast is ahead of it
    # Down only after down_intervals readings agree.
    p3 = Planner(cfg, capacity=lambda isl, osl: 2.0)
    assert p3.decide(snap(0, 4, window_s=10, requests=10, mean_isl=100, mean_osl=50), 0).target == 4
    assert p3.decide(snap(10, 4, window_s=10, requests=10, mean_isl=100, mean_osl=50), 10).target == 3


def test_sla_mode_scales_down_only_past_a_band_below_its_scale_up_point() -> None:
    cfg = PlannerConfig(mode="sla", min_workers=1, max_workers=10, interval_s=10, up_cooldown_s=0,
                        down_cooldown_s=0, headroom=0.1, down_band=0.1, startup_s=0,
                        down_intervals=2)  # fmt: skip

    def run(requests: int) -> list[int]:
        p = Planner(cfg, capacity=lambda isl, osl: 2.0)
        return [
            p.decide(snap(t, 4, window_s=10, requests=requests, mean_isl=100, mean_osl=50), t).target
            for t in (0, 10)
        ]

    # 5.2 req/s: 3 workers would do with 10% headroom (5.72 <= 6), but not with 20% (6.24): keep 4.
    assert run(52) == [4, 4]
    # 4.8 req/s: 3 workers keep 20% headroom (5.76): down once two readings agree.
    assert run(48) == [4, 3]
    with pytest.raises(ValueError, match="band"):
        PlannerConfig(mode="sla", down_band=-0.1)


def test_sla_mode_believes_measured_latency_over_its_model() -> None:
    cfg = PlannerConfig(mode="sla", min_workers=1, max_workers=4, interval_s=10, up_cooldown_s=0, startup_s=0)
    p = Planner(cfg, capacity=lambda isl, osl: 100.0)  # the model says one worker is plenty
    d = p.decide(snap(0, 1, window_s=10, requests=10, mean_isl=100, mean_osl=50, ttft_p95_s=3.0), 0)
    assert d.target == 2 and "TTFT" in d.reason
    with pytest.raises(ValueError, match="capacity"):
        Planner(PlannerConfig(mode="sla"))


def test_holt_forecast_follows_a_ramp() -> None:
    f = HoltForecaster()
    for v in (1, 2, 3, 4, 5):
        f.observe(v)
    assert 5.5 < f.forecast(1) < 7 and f.forecast(3) > f.forecast(1)


def test_sizing_capacity_falls_with_longer_prompts_and_tighter_targets() -> None:
    d = Deployment(
        arch.resolve("llama3-8b"),
        hardware.resolve("h100-sxm"),
        "fp8",
        hardware.default_factors("h100-sxm", "fp8"),
    )
    loose, tight = sizing_capacity(d, 2.0, 0.1), sizing_capacity(d, 0.2, 0.02)
    assert loose(500, 200) > loose(4000, 200) > 0
    assert loose(2000, 200) > tight(2000, 200)
    # Between the 16-token grid points the capacity is interpolated, not rounded: no jump at 200
    # (halfway between 192 and 208), the grid values at the grid points.
    assert abs(loose(2000, 199.9) / loose(2000, 200.1) - 1) < 0.002
    a, b = loose(2000, 192), loose(2000, 208)
    assert min(a, b) <= loose(2000, 200) <= max(a, b)


def test_worker_ranges() -> None:
    assert ServerConfig(workers="1..4").worker_range == (1, 1, 4)
    assert ServerConfig(workers="2").worker_range == (2, 2, 2)
    assert ServerConfig(workers="0..2").worker_range == (0, 0, 2)  # a fleet that scales to zero
    for bad in ("4..1", "x", "0..0", "-1..2"):
        with pytest.raises(ValueError, match="--workers"):
            _ = ServerConfig(workers=bad).worker_range


# -- connectors ----------------------------------------------------------------------------------------
class FakeApps:
    """Stands in for kubernetes.client.AppsV1Api: records the calls."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.calls: list[tuple] = []

    def read_namespaced_stateful_set_scale(self, name: str, namespace: str) -> SimpleNamespace:
        self.calls.append(("read", name, namespace))
        return SimpleNamespace(spec=SimpleNamespace(replicas=self.replicas))

    def patch_namespaced_stateful_set_scale(self, name: str, namespace: str, body: dict) -> None:
        self.calls.append(("patch", name, namespace, body))
        self.replicas = body["spec"]["replicas"]


def test_kubernetes_connector_patches_the_scale_subresource() -> None:
    api = FakeApps(2)
    k = KubernetesConnector("tokenmill-worker", "llm", api=api)
    assert k.counts() == (2, 0, 0)
    asyncio.run(k.scale_to(3))
    assert api.calls[-1] == ("patch", "tokenmill-worker", "llm", {"spec": {"replicas": 3}})
    with pytest.raises(ValueError, match="kind"):
        KubernetesConnector("x", api=api, kind="ReplicaSet")


def test_fleet_connector_launches_and_drains_the_least_busy() -> None:
    class FakeRouter:
        def __init__(self) -> None:
            self.workers = [Worker(i, f"tcp://w{i}:1", up=True) for i in range(3)]
            self.workers[0].active = {"a": 1, "b": 1}
            self.workers[2].active = {"c": 1}
            self.added = 0
            self.removed: list[int] = []

        def fleet_counts(self, pool: str | None = None) -> tuple[int, int, int]:
            return sum(1 for w in self.workers if not w.retired), 0, 0

        async def add_worker(self) -> None:
            self.added += 1

        async def remove_worker(self, w, timeout: float) -> None:  # noqa: ANN001
            self.removed.append(w.slot)

    async def main() -> None:
        r = FakeRouter()
        c = FleetConnector(r)
        await c.scale_to(5)
        assert r.added == 2
        await c.scale_to(2)
        await asyncio.sleep(0)
        assert r.removed == [1]  # the idle one

    asyncio.run(main())


class PoolRouter:
    """A stand-in for a disaggregated fleet's router: workers with roles and engine stats."""

    def __init__(self, roles: list[str], waiting: list[int]) -> None:
        self.workers = [self._worker(i, r, n) for i, (r, n) in enumerate(zip(roles, waiting, strict=True))]
        self.arrivals: list[tuple[float, int]] = []
        self.added: list[str | None] = []
        self.removed: list[int] = []

    @staticmethod
    def _worker(i: int, role: str, waiting: int) -> Worker:
        stats = SimpleNamespace(num_running=1, num_waiting=waiting, kv_cache_usage=0.1, draining=False)
        client = SimpleNamespace(last_heard=1e12, stats=stats)
        return Worker(i, f"tcp://w{i}:1", role=role, up=True, client=client)  # type: ignore[arg-type]

    def fleet_counts(self, pool: str | None = None) -> tuple[int, int, int]:
        from tokenmill.cluster.router import in_pool

        return sum(1 for w in self.workers if not w.retired and in_pool(w, pool)), 0, 0

    async def add_worker(self, role: str | None = None) -> None:
        self.added.append(role)
        self.workers.append(self._worker(len(self.workers), role or "both", 0))

    async def remove_worker(self, w, timeout: float) -> None:  # noqa: ANN001
        self.removed.append(w.slot)
        w.retired = True


def test_a_disaggregated_fleet_is_two_pools_each_scaled_on_its_own_workers() -> None:
    from tokenmill.cluster.planner.loop import PlannerLoop, Pool

    # Prompts pile up on the one prefill worker; the two decode workers are idle.
    router = PoolRouter(["prefill", "decode", "decode"], [9, 0, 0])

    def pool(name: str) -> Pool:
        cfg = PlannerConfig(min_workers=1, max_workers=3, interval_s=1, up_intervals=1, down_intervals=1,
                            up_cooldown_s=0, down_cooldown_s=0)  # fmt: skip
        return Pool(name, Planner(cfg), FleetConnector(router, pool=name))

    loop = PlannerLoop([pool("prefill"), pool("decode")], router, window_s=10, max_workers=3)
    snap = loop.snapshot(0.0, loop.pools[0])
    assert snap is not None and snap.serving == 1 and snap.waiting == 9
    assert loop.snapshot(0.0, loop.pools[1]).waiting == 0

    async def tick() -> None:
        await loop.tick()
        await asyncio.sleep(0)  # the drain task runs

    # First interval: the fleet is at its bound (3), so the prefill pool's ceiling is 3 - 2 = 1 and it
    # cannot grow; the idle decode pool gives a worker back (drained: the least busy decode worker).
    asyncio.run(tick())
    assert loop.pools[0].planner.config.max_workers == 1
    assert router.added == [] and router.removed in ([1], [2])
    # Next interval: the prefill pool grows into what decode left, by a prefill worker.
    asyncio.run(tick())
    assert router.added == ["prefill"] and len(router.removed) == 1
    assert router.fleet_counts("prefill")[0] == 2 and router.fleet_counts("decode")[0] == 1
    text = "".join(str(m) for m in loop.collect())
    assert "prefill" in text and "decode" in text
    with pytest.raises(ValueError, match="one pool"):
        PlannerLoop([], router)


def test_signals_from_prometheus_query_api() -> None:
    """Against a stand-in for Prometheus' /api/v1/query (its documented JSON shape; no Prometheus here)."""
    import time

    import httpx

    from tokenmill.cluster.planner.prometheus import PrometheusSignals

    now = time.time()
    series = {
        "num_requests_running": [("w0", 3), ("w1", 1)],
        "num_requests_waiting": [("w0", 5), ("w1", 0)],
        "kv_cache_usage_perc": [("w0", 0.5), ("w1", 0.25)],
    }
    scalars = {
        "request_success_total": 120, "prompt_tokens_total": 120 * 300, "generation_tokens_total": 120 * 50,
        "queue_to_compute_ratio": 0.8, "time_to_first_token": 0.9, "inter_token_latency": 0.04,
    }  # fmt: skip
    queries: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        q = request.url.params["query"]
        queries.append(q)
        assert 'model_name="m"' in q
        result = []
        for name, rows in series.items():
            if f"tokenmill:{name}{{" in q and "increase" not in q:
                result = [{"metric": {"worker": w}, "value": [now - 2, str(v)]} for w, v in rows]
        for name, v in scalars.items():
            if name in q:
                result = [{"metric": {}, "value": [now - 2, str(v)]}]
        return httpx.Response(
            200, json={"status": "success", "data": {"resultType": "vector", "result": result}}
        )

    sig = PrometheusSignals(
        "http://prom:9090", "m", 60, client=httpx.Client(transport=httpx.MockTransport(answer))
    )
    snap = sig.snapshot((2, 1, 0), now=1000.0)
    assert snap is not None and snap.serving == 2 and snap.starting == 1
    assert sorted((w.num_running, w.num_waiting) for w in snap.loads) == [(1, 0), (3, 5)]
    assert snap.requests == 120 and snap.mean_isl == 300 and snap.mean_osl == 50
    assert snap.queue_to_compute == 0.8 and snap.ttft_p95_s == 0.9 and snap.itl_p95_s == 0.04
    assert 998 - 0.5 < snap.time < 998 + 0.5  # the samples' age carries over: stale data stays stale
    assert any("histogram_quantile(0.95" in q and "[60s]" in q for q in queries)
    # Prometheus with no series for the model: nothing to decide on.
    empty = PrometheusSignals("http://prom:9090", "m", client=httpx.Client(transport=httpx.MockTransport(
        lambda r: httpx.Response(200, json={"status": "success", "data": {"result": []}}))))  # fmt: skip
    assert empty.snapshot((1, 0, 0)) is None


# -- burst detection (surge) ------------------------------------------------------------------------------
def test_sla_surge_scales_by_the_whole_burst_at_once_through_starting_workers_and_cooldown() -> None:
    cfg = {"mode": "sla", "max_workers": 10, "headroom": 0.0, "up_cooldown_s": 30, "startup_s": 0}
    p = Planner(PlannerConfig(**cfg, surge=True), lambda i, o: 10.0)
    base = {"queue_to_compute": 0.0, "mean_isl": 100.0, "mean_osl": 50.0, "recent_s": 10.0}
    # 20 req/s on 2 workers of 10 req/s: sized right, no burst
    calm = FleetSnapshot(0, 2, loads=[WorkerLoad(1, 0, 0.1)] * 2, requests=1200, recent_requests=200, **base)
    assert p.decide(calm, 0).target == 2
    # the last interval brought 40 req/s: 4 workers at once, though the 60 s window says 23 req/s
    burst = FleetSnapshot(
        10, 2, loads=[WorkerLoad(1, 0, 0.1)] * 2, requests=1400, recent_requests=400, **base
    )
    d = p.decide(burst, 10)
    assert d.target == 4 and d.reason.startswith("burst")
    # 10 s later: 2 serving, 2 starting, and 70 req/s now: 7 at once, starting workers and cool-down or not
    more = FleetSnapshot(
        20, 2, starting=2, loads=[WorkerLoad(1, 0, 0.1)] * 2, requests=2100, recent_requests=700, **base
    )
    assert p.decide(more, 20).target == 7
    # without surge the same readings move one forecast step, and not while workers start
    q = Planner(PlannerConfig(**cfg), lambda i, o: 10.0)
    q.decide(calm, 0)
    assert q.decide(burst, 10).target < 4  # the window's 23 req/s, trend-extrapolated: not 40
    assert q.decide(more, 20).target == 4  # held: workers are starting


def test_surge_ignores_what_poisson_noise_explains_and_respects_the_bound() -> None:
    p = Planner(PlannerConfig(mode="sla", max_workers=3, headroom=0.0, surge=True), lambda i, o: 0.2)
    base = {"mean_isl": 100.0, "mean_osl": 50.0, "recent_s": 10.0, "loads": [WorkerLoad(1, 0, 0.1)]}
    # one worker sized for 2 arrivals in 10 s: 4 arrivals is 2x, but within 3 sigma of 2: not a burst
    d = p.decide(FleetSnapshot(0, 1, requests=12, recent_requests=4, **base), 0)
    assert not d.reason.startswith("burst")
    # 12 arrivals is far past the noise: the burst needs 6 workers, the bound gives 3
    d = p.decide(FleetSnapshot(10, 1, requests=14, recent_requests=12, **base), 10)
    assert d.target == 3 and d.reason.startswith("burst")


def test_load_surge_learns_what_a_worker_carries_without_pressure_and_scales_in_proportion() -> None:
    p = load_planner(max_workers=12, surge=True)
    # no calm reading yet: nothing to measure a burst against
    d = p.decide(snap(0, 2, kv=0.4, requests=600, window_s=60, recent_requests=300, recent_s=10), 0)
    assert d.target == 2
    # calm at 10 req/s, 5 per worker, for a while
    for t in (10, 20, 30):
        assert (
            p.decide(
                snap(t, 2, kv=0.4, requests=600, window_s=60, recent_requests=100, recent_s=10), t
            ).target
            == 2
        )
    # 30 req/s in the last interval, no pressure read yet: 6 workers (30 / 5 each) at once
    d = p.decide(snap(40, 2, kv=0.4, requests=800, window_s=60, recent_requests=300, recent_s=10), 40)
    assert d.target == 6 and d.reason.startswith("burst")
    # off: the same readings change nothing until pressure shows
    q = load_planner(max_workers=12)
    for t in (10, 20, 30):
        q.decide(snap(t, 2, kv=0.4, requests=600, window_s=60, recent_requests=100, recent_s=10), t)
    assert (
        q.decide(snap(40, 2, kv=0.4, requests=800, window_s=60, recent_requests=300, recent_s=10), 40).target
        == 2
    )


def test_surge_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="surge"):
        PlannerConfig(surge=True, surge_ratio=0)
