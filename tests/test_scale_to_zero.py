"""Scale to zero. The router's waiting room for cold starts with stand-in worker clients (fast), then a
real fleet: `tokenmill serve --workers 0..1 --planner load` with real worker
processes. The fleet starts one worker (the front learns the model's shape from it) and stops it once
idle; at zero it stays ready, a request waits at the router while the planner starts a worker at once,
and is served; idle again, it goes back to zero; a burst at zero beyond the waiting bound gets a clear
503 at once while the requests within the bound are served: none hangs, none is lost."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
from server_fixture import running_server

from tokenmill.cluster.fleet import engine_client_for
from tokenmill.cluster.router import RouterEngineClient, RouterSettings
from tokenmill.cluster.router.cold_start import ColdStartFullError
from tokenmill.cluster.router.relay import Relay
from tokenmill.engine.client import EngineDeadError
from tokenmill.engine.protocol import EngineRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.config import FleetConfig, ServerConfig

MODEL = "smollm2-135m"
MAX_WAITING = 3


class StandIn:
    """A worker's client as the router sees it: heard from now, keeps what it is sent."""

    def __init__(self) -> None:
        self.last_heard = time.monotonic()
        self.dead_reason: str | None = None
        self.stats = None
        self.sent: list[str] = []

    def add_request(self, req: EngineRequest, queue: object) -> object:
        self.sent.append(req.request_id)
        return queue

    def abort(self, ids: list[str]) -> None:
        pass


def at_zero_router(**settings: float) -> RouterEngineClient:
    """A router over one worker slot that the planner has drained away (retired): a fleet at zero."""
    router = RouterEngineClient(["tcp://w0:1"], RouterSettings("kv", scale_to_zero=True, **settings))
    router.block_size = 16
    router.prefix.set_block_size(16)
    router.workers[0].retired = True
    return router


def request(rid: str) -> EngineRequest:
    return EngineRequest(rid, list(range(40)), SamplingParams(temperature=0, max_tokens=4))


def test_requests_wait_for_a_cold_start_bounded_in_number_and_time() -> None:
    async def main() -> None:
        router = at_zero_router(cold_start_max_waiting=2, cold_start_timeout_s=5.0)
        assert router.healthy and router.scaled_to_zero and router.dead_reason is None
        woken: list[int] = []
        assert router.cold_start is not None
        router.cold_start.on_wait = lambda: woken.append(1)
        q1, q2 = router.add_request(request("a")), router.add_request(request("b"))
        assert len(router.cold_start) == 2 and len(woken) == 2  # the planner is told at once, each time
        with pytest.raises(ColdStartFullError, match="wait for one to start"):
            router.add_request(request("c"))
        router.abort(["b"])  # a client gone while it waited: forgotten, not sent later
        assert len(router.cold_start) == 1
        # A worker joins (the planner's): the waiting request goes to it.
        w = router.workers[0]
        w.retired, w.client, w.up, w.joins = False, StandIn(), True, 1  # type: ignore[assignment]
        router.board.invalidate()
        router._joined()
        assert w.client.sent == ["a"] and len(router.cold_start) == 0  # type: ignore[union-attr]
        st = router.cold_start.stats
        assert (st.served, st.refused, st.timed_out) == (1, 1, 0)
        assert st.buckets()[-1] == ("+Inf", 1)
        assert q1.empty() and q2.empty()

    asyncio.run(main())


def test_a_request_waiting_past_the_timeout_ends_with_an_error() -> None:
    async def main() -> None:
        router = at_zero_router(cold_start_timeout_s=5.0)
        q = router.add_request(request("a"))
        router._expire_cold_waits(time.monotonic() + 1.0)
        assert q.empty(), "within the timeout it waits on"
        router._expire_cold_waits(time.monotonic() + 6.0)
        err = q.get_nowait()
        assert isinstance(err, EngineDeadError) and "no worker started within 5s" in str(err)
        assert "a" not in router._where and router.cold_start is not None
        assert router.cold_start.stats.timed_out == 1

    asyncio.run(main())


def test_a_fleet_that_lost_its_worker_is_not_reported_as_scaled_to_zero() -> None:
    router = at_zero_router()
    w = router.workers[0]
    w.retired, w.joins = False, 1  # it was up, and left without being drained: a failure
    assert not router.healthy and not router.scaled_to_zero
    w.joins, w.last_error = 0, None  # a worker launched for a cold start, still loading: healthy
    assert router.healthy and router.scaled_to_zero
    w.start_failed = True  # its launch failed once: down, and it stays so between its next attempts
    assert not router.healthy and not router.scaled_to_zero
    w.start_failed = False
    plain = RouterEngineClient(["tcp://w0:1"], RouterSettings("kv"))
    plain.workers[0].retired = True
    assert not plain.healthy, "a fleet that may not scale to zero is down with no worker"


@pytest.mark.parametrize(
    ("workers", "fleet", "says"),
    [
        ("1..2", {"planner": "load", "scale_to_zero_after_s": 5.0}, "needs --workers 0..MAX"),
        ("1", {"scale_to_zero_after_s": 5.0}, "needs --planner"),
        ("0..3", {"planner": "load", "disaggregate": "1P1D"}, "cannot be used with --disaggregate"),
        ("0..2", {"planner": "load", "launcher": "ray"}, "needs --launcher local"),
        ("0..2", {"planner": "load", "scale_to_zero_after_s": 0.0}, "must be positive"),
        ("0..2", {"planner": "load", "cold_start_max_waiting": 0}, "at least 1"),
    ],
)
def test_scale_to_zero_options_are_checked_before_anything_starts(
    workers: str, fleet: dict, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        engine_client_for(ServerConfig(workers=workers, fleet=FleetConfig(**fleet)))


def metric(base: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    m = re.search(rf"^tokenmill:{name}\{{[^}}]*{labels}[^}}]*\}} ([\d.e+-]+)$", text, re.M)
    assert m, f"{name} {labels} not in /metrics"
    return float(m[1])


def serving(base: str) -> int:
    return int(
        metric(base, "planner_workers", 'state="serving"')
        + metric(base, "planner_workers", 'state="starting"')
    )


def at_zero(base: str) -> bool:
    return serving(base) == 0 and metric(base, "planner_workers", 'state="draining"') == 0


def wait_for(cond, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def stream_first_token(base: str, max_tokens: int) -> tuple[float, int]:
    """A streamed completion: seconds to its first token, and the tokens it got (it must end with
    [DONE])."""
    body = {"model": MODEL, "prompt": "Count to ten:", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.monotonic()
    first, tokens, done = None, None, False
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=180) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.monotonic() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    assert done and first is not None and tokens is not None
    return first, tokens


async def burst(base: str, n: int) -> list[httpx.Response]:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    async with httpx.AsyncClient() as client:
        # Each bounded: a request that hung would fail the test here rather than hang the suite.
        return await asyncio.gather(
            *(client.post(f"{base}/v1/completions", json=body, timeout=150) for _ in range(n))
        )


@pytest.mark.slow
def test_a_fleet_scales_to_zero_and_wakes_for_requests() -> None:
    args = ["--workers", "0..1", "--planner", "load", "--planner-interval-s", "1",
            "--scale-to-zero-after", "2", "--cold-start-max-waiting", str(MAX_WAITING),
            "--cold-start-timeout", "120", "--planner-drain-timeout-s", "30"]  # fmt: skip
    with running_server(*args) as proc:
        base = proc.base_url
        # Idle from the start: the first worker is drained and stopped.
        wait_for(lambda: at_zero(base), 60, "the fleet to scale to zero")
        assert metric(base, "router_workers_up") == 0
        # At zero the fleet is healthy and ready: it takes requests (a load balancer must not drop it).
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        assert httpx.get(f"{base}/v1/health/live", timeout=10).status_code == 200
        ready = httpx.get(f"{base}/v1/health/ready", timeout=10)
        assert ready.status_code == 200 and "no worker running" in ready.json()["message"], ready.text
        # The deep probe does not start a worker (it would keep the fleet from ever staying at zero).
        assert httpx.get(f"{base}/health_generate", timeout=30).status_code == 200
        assert at_zero(base)

        # A request at zero waits for the worker it starts, then streams to the end.
        ttft, tokens = stream_first_token(base, 8)
        print(f"cold start: first token {ttft:.2f}s after the request")
        assert tokens == 8
        assert metric(base, "router_cold_start_requests_total", 'outcome="served"') == 1
        assert metric(base, "router_cold_start_wait_seconds_count") == 1
        assert metric(base, "router_cold_start_waiting") == 0
        assert metric(base, "planner_decisions_total", 'direction="up"') >= 1

        # Idle again: back to zero.
        wait_for(lambda: at_zero(base), 60, "the fleet to scale to zero again")
        downs = metric(base, "planner_decisions_total", 'direction="down"')
        assert downs >= 2, downs

        # A burst at zero, beyond the waiting bound: those within it are served once the worker is up,
        # the rest are refused at once with a 503 that says why. Every request gets its answer.
        n = MAX_WAITING + 3
        rs = asyncio.run(burst(base, n))
        codes = [r.status_code for r in rs]
        ok = [r for r in rs if r.status_code == 200]
        refused = [r for r in rs if r.status_code == 503]
        assert len(ok) + len(refused) == n, codes
        assert len(ok) >= MAX_WAITING, codes
        assert refused, f"{n} requests at zero with room for {MAX_WAITING}: none refused ({codes})"
        for r in refused:
            assert "wait for one to start" in r.json()["error"]["message"], r.text
        for r in ok:
            assert r.json()["usage"]["completion_tokens"] == 4
        assert metric(base, "router_cold_start_requests_total", 'outcome="refused"') == len(refused)
        # exactly those that waited were served from the queue (any later ones went straight to the worker)
        assert metric(base, "router_cold_start_requests_total", 'outcome="served"') == 1 + MAX_WAITING


class FailingStandIn(StandIn):
    """A worker's client that fails as a request is sent: the worker died the moment it joined."""

    def add_request(self, req: EngineRequest, queue: object) -> object:
        self.dead_reason = "it died as the request was sent"
        raise EngineDeadError(self.dead_reason)


def test_a_request_whose_worker_dies_as_it_joins_waits_on_and_can_still_end() -> None:
    """The join that sends the waiting requests finds its worker dead on the first send: the request
    waits on for the next worker, from its first arrival (not a fresh timeout), still findable, so it
    times out with an error (or is aborted) rather than hanging."""

    async def main() -> None:
        router = at_zero_router(cold_start_timeout_s=5.0)
        assert router.cold_start is not None
        q = router.add_request(request("a"))
        t0 = router.cold_start.waiting["a"][0]
        w = router.workers[0]
        w.retired, w.client, w.up, w.joins = False, FailingStandIn(), True, 1  # type: ignore[assignment]
        router.board.invalidate()
        router._joined()
        assert "a" in router.cold_start.waiting and router._where.get("a") is not None
        assert router.cold_start.waiting["a"][0] == t0, "its wait is bounded from its first arrival"
        assert router.cold_start.stats.served == 0
        w.up = False  # the supervisor notices the dead client
        router._expire_cold_waits(t0 + 6.0)
        err = q.get_nowait()
        assert isinstance(err, EngineDeadError) and "no worker started within 5s" in str(err)

    asyncio.run(main())


def test_a_retry_refused_by_a_full_waiting_room_counts_once() -> None:
    """A retry asks for a place every poll while it waits for a worker: the refusals count requests."""
    router = at_zero_router(cold_start_max_waiting=1)
    assert router.cold_start is not None
    router.add_request(request("a"))
    with pytest.raises(ColdStartFullError):
        router.add_request(request("b"))
    retry = Relay(router, request("c"), asyncio.Queue())
    retry.tries = 1
    for _ in range(5):
        with pytest.raises(ColdStartFullError):
            router.cold_start.park(retry)
    assert router.cold_start.stats.refused == 1
