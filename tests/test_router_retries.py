"""The router's retries and lost requests, with stand-in worker clients (no processes): a retry goes
only to a worker that answers now, waits a bounded time for one, and a request whose worker says nothing
is taken as lost well before the client's heartbeat timeout (issue 51, item 4)."""

from __future__ import annotations

import asyncio
import time

from tokenmill.cluster.router import RouterEngineClient, RouterSettings
from tokenmill.engine.client import EngineDeadError
from tokenmill.engine.protocol import EngineCoreOutput, EngineRequest
from tokenmill.sampling_params import SamplingParams


class FakeClient:
    """A worker's client as the router sees it: when it was last heard from, what it was sent."""

    def __init__(self, heard_ago: float) -> None:
        self.last_heard = time.monotonic() - heard_ago
        self.dead_reason: str | None = None
        self.stats = None
        self.queues: dict[str, object] = {}
        self.sent: list[str] = []
        self.aborted: list[str] = []

    def add_request(self, req: EngineRequest, queue: object) -> object:
        self.sent.append(req.request_id)
        self.queues[req.request_id] = queue
        return queue

    def abort(self, ids: list[str]) -> None:
        self.aborted += ids
        for rid in ids:
            self.queues.pop(rid, None)

    def finish(self, ids: list[str]) -> None:
        self.abort(ids)

    def die(self, reason: str = "killed") -> None:
        self.dead_reason = reason
        for q in self.queues.values():
            q.put_nowait(EngineDeadError(reason))  # type: ignore[attr-defined]
        self.queues.clear()


def fleet(heard_ago: list[float], **settings: float) -> tuple[RouterEngineClient, list[FakeClient]]:
    router = RouterEngineClient(
        [f"tcp://w{i}:1" for i in range(len(heard_ago))], RouterSettings("kv", **settings)
    )
    router.block_size = 16
    router.prefix.set_block_size(16)
    clients = []
    for w, ago in zip(router.workers, heard_ago, strict=True):
        c = FakeClient(ago)
        w.client, w.up, w.joins = c, True, 1  # type: ignore[assignment]
        clients.append(c)
    return router, clients


def request(rid: str) -> EngineRequest:
    return EngineRequest(rid, list(range(40)), SamplingParams(temperature=0, max_tokens=4))


def test_a_retry_never_goes_to_a_silent_worker_and_ends_within_its_bound() -> None:
    async def main() -> None:
        # Worker 0 answers; worker 1 has said nothing for 5 s (a restarted worker gone quiet, say).
        router, (c0, c1) = fleet([0.0, 5.0], retry_wait_s=0.5)
        q = router.add_request(request("r"))
        assert c0.sent == ["r"], "a new request goes to the worker that answers"
        c0.die()  # killed before the first token: the request is to be retried ...
        await asyncio.sleep(0.2)
        assert c1.sent == [], "... but never on a worker that has not proven it answers"
        assert router.stats_router.retries == 1
        t0 = time.monotonic()
        err = await asyncio.wait_for(q.get(), 10)  # a guard only
        assert isinstance(err, EngineDeadError), err
        assert time.monotonic() - t0 < 5
        assert "r" not in router._where and not router.workers[1].active

    asyncio.run(main())


def test_a_waiting_retry_goes_to_a_worker_once_it_answers() -> None:
    async def main() -> None:
        router, (c0, c1) = fleet([0.0, 5.0], retry_wait_s=30.0)
        q = router.add_request(request("r"))
        c0.die()
        await asyncio.sleep(0.3)
        assert c1.sent == [] and q.empty(), "waiting, without blocking the loop"
        c1.last_heard = time.monotonic()  # it speaks (a heartbeat)
        await asyncio.sleep(0.3)
        assert c1.sent == ["r"]
        assert router.placements["r"][0] == 1
        # ... and its output reaches the caller.
        router._where["r"].put_nowait(EngineCoreOutput("r", [7]))
        out = q.get_nowait()
        assert isinstance(out, EngineCoreOutput) and out.new_token_ids == [7]

    asyncio.run(main())


def test_a_retry_skips_a_worker_known_dead_but_not_yet_dropped() -> None:
    async def main() -> None:
        router, (c0, c1, c2) = fleet([0.0, 0.0, 0.0], retry_wait_s=0.5)
        router.workers[1].decode_blocks, router.workers[2].decode_blocks = 50, 100  # by cost: 0, 1, 2
        q = router.add_request(request("r"))
        assert c0.sent == ["r"]
        c1.dead_reason = "killed"  # heard from a moment ago, but its supervisor has not dropped it yet
        c0.die()
        await asyncio.sleep(0.2)
        assert c1.sent == [] and c2.sent == ["r"]
        assert q.empty()

    asyncio.run(main())


def test_a_request_on_a_silent_worker_is_lost_and_retried_or_ended() -> None:
    async def main() -> None:
        router, _ = fleet([0.0, 0.0], lost_after_s=1.0, retry_wait_s=5.0)
        router.set_policy("round-robin")
        qa = router.add_request(request("a"))
        qb = router.add_request(request("b"))
        qc = router.add_request(request("c"))
        quiet = router.workers[router.placements["a"][0]].client
        other = router.workers[router.placements["b"][0]].client
        assert quiet is not other and router.placements["c"][0] == router.placements["a"][0]
        router._where["c"].put_nowait(EngineCoreOutput("c", [2]))  # c is under way, a is not
        assert qc.get_nowait().new_token_ids == [2]
        now = time.monotonic()
        router._find_lost(now)
        assert quiet.aborted == [], "a worker heard from lately keeps its requests"  # type: ignore[union-attr]
        # It goes quiet (no output, no heartbeat) for longer than lost_after_s after both were sent.
        quiet.last_heard = now - 2.0  # type: ignore[union-attr]
        for rid in ("a", "c"):
            router._where[rid].sent_at = now - 2.0
        router._find_lost(now)
        assert sorted(quiet.aborted) == ["a", "c"]  # type: ignore[union-attr]
        await asyncio.sleep(0.2)
        assert other.sent == ["b", "a"], "the unstarted request is retried where it is answered"  # type: ignore[union-attr]
        assert qa.empty() and qb.empty()
        err = qc.get_nowait()
        assert isinstance(err, EngineDeadError), "the stream under way ends with an error, now"
        assert "c" not in router._where and not router.workers[router.placements["c"][0]].active

    asyncio.run(main())


def test_a_new_request_to_an_all_silent_fleet_is_sent_but_its_wait_is_bounded() -> None:
    async def main() -> None:
        # Every worker silent for 2 s: maybe a long step, so a new request is still sent ...
        router, (c0, c1) = fleet([2.0, 2.0], lost_after_s=3.0, retry_wait_s=0.3)
        q = router.add_request(request("r"))
        assert c0.sent + c1.sent == ["r"]
        router._find_lost(time.monotonic())
        assert q.empty(), "not lost yet"
        # ... but once nothing has come for lost_after_s since, it is lost; no one answers a retry.
        router._where["r"].sent_at -= 4.0
        for c in (c0, c1):
            c.last_heard -= 4.0
        router._find_lost(time.monotonic())
        err = await asyncio.wait_for(q.get(), 10)  # a guard only
        assert isinstance(err, EngineDeadError)
        assert c0.sent + c1.sent == ["r"], "the retry went nowhere silent"
        assert not router._where and not any(w.active for w in router.workers)

    asyncio.run(main())


def test_a_draining_workers_refusals_go_elsewhere_without_costing_tries() -> None:
    """A worker that has begun to drain refuses with retry: the request goes to another worker, as many
    times as workers refuse (each once), and the retry budget is left for real failures."""
    from tokenmill.engine.client import WorkerDrainingError
    from tokenmill.engine.protocol import EngineStats

    async def main() -> None:
        router, clients = fleet([0.0] * 5, retry_wait_s=0.5)
        router.set_policy("round-robin")
        q = router.add_request(request("r"))
        for _ in range(4):  # four workers in turn refuse: more than MAX_RETRIES
            c = next(c for c in clients if "r" in c.queues)
            c.queues.pop("r").put_nowait(WorkerDrainingError("draining"))
            await asyncio.sleep(0.05)
        last = next(c for c in clients if "r" in c.queues)
        assert sum(len(c.sent) for c in clients) == 5 and all(len(c.sent) == 1 for c in clients)
        assert router._where["r"].tries == 1 and q.empty()
        # A worker whose stats say draining gets no new request at all.
        last.stats = EngineStats(0, 0, 0.0, 1, 0, 0, 0, 0, 0, draining=True)
        router.board.invalidate()
        router.add_request(request("s"))
        assert "s" not in last.sent

    asyncio.run(main())
