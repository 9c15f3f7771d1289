"""The router's queue (`--router-queue`, cluster/router/fleet_queue.py): while every worker is full, new
requests wait at the router and each place that frees anywhere in the fleet goes to the lowest band,
then to the tenant served fewest tokens across the fleet.

First with stand-in worker clients (fast, exact): what waits, what goes where, in which order, and that a
request waiting here is never lost (aborted: never sent; no worker left: an error at once). Then the real
thing: `tokenmill serve --workers 2 --policy fair --max-num-seqs 1` with real worker processes and the
`openai` client, driven by the server's own gauges, never by sleeping: tenant A holds both places and
queues more; B's two requests take the first place freed on each worker while A's older ones wait on.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from server_fixture import running_server
from test_fairness_server import Streams, client, scrape, served, until

from tokenmill.cluster.fleet import router_settings
from tokenmill.cluster.router import RouterEngineClient, RouterSettings
from tokenmill.engine.client import EngineDeadError
from tokenmill.engine.protocol import EngineCoreOutput, EngineRequest, EngineStats, FinishReason
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.config import FleetConfig, ServerConfig


class StandIn:
    """A worker's client as the router sees it: heard from now, keeps what it is sent (and the relay
    that stands for each request's caller)."""

    def __init__(self) -> None:
        self.last_heard = time.monotonic()
        self.dead_reason: str | None = None
        self.stats: EngineStats | None = None
        self.sent: list[str] = []
        self.relays: dict[str, object] = {}

    def add_request(self, req: EngineRequest, queue: object) -> object:
        self.sent.append(req.request_id)
        self.relays[req.request_id] = queue
        return queue

    def abort(self, ids: list[str]) -> None:
        pass


def waiting_stats(running: int, waiting: int) -> EngineStats:
    return EngineStats(running, waiting, 0.5, 100, 0, 0, 0, 10, 100)


def fleet(places: int = 1, workers: int = 2, fair: bool = True) -> RouterEngineClient:
    settings = RouterSettings("round-robin", queue=True, queue_fair=fair, queue_max_in_flight=99)
    router = RouterEngineClient([f"tcp://w{i}:1" for i in range(workers)], settings)
    router.block_size = 16
    router.prefix.set_block_size(16)
    for w in router.workers:
        w.client, w.up, w.joins = StandIn(), True, 1  # type: ignore[assignment]
        w.info = {"max_num_seqs": places}  # the worker says how many it runs at once
    return router


def request(rid: str, tenant: str = "A", priority: int = 0, prompt: int = 40) -> EngineRequest:
    return EngineRequest(
        rid,
        list(range(prompt)),
        SamplingParams(temperature=0, max_tokens=4),
        priority=priority,
        tenant=tenant,
    )


def sent(router: RouterEngineClient) -> list[list[str]]:
    return [list(w.client.sent) for w in router.workers]  # type: ignore[union-attr]


def output(rid: str, tokens: int, done: bool = False, prompt: int = 0, cached: int = 0) -> EngineCoreOutput:
    return EngineCoreOutput(
        rid,
        list(range(tokens)),
        finish_reason=FinishReason.LENGTH if done else None,
        num_prompt_tokens=prompt,
        num_cached_tokens=cached,
    )


def emit(router: RouterEngineClient, rid: str, item: object) -> None:
    """What the worker that has `rid` sends back for it."""
    for w in router.workers:
        if rid in w.client.relays:  # type: ignore[union-attr]
            w.client.relays[rid].put_nowait(item)  # type: ignore[union-attr]
            return
    raise AssertionError(f"{rid} was never sent")


async def settle() -> None:
    """Let the queue hand out the places freed by the outputs just handled (it does so on the next
    turn of the loop)."""
    for _ in range(3):
        await asyncio.sleep(0)


def test_nothing_waits_while_a_worker_has_room_and_a_full_worker_is_passed_over() -> None:
    async def main() -> None:
        router = fleet(places=2)
        fq = router.fleet_queue
        assert fq is not None
        for i in range(4):
            router.add_request(request(f"a{i}"))
        assert sorted(map(len, sent(router))) == [2, 2] and len(fq) == 0
        router.add_request(request("a4"))
        assert len(fq) == 1 and sum(map(len, sent(router))) == 4, "every place taken: it waits here"
        assert router.requests_in_flight == 5  # findable for abort while it waits
        # A worker whose engine queues (KV ran short) is full whatever the router counts on it.
        router2 = fleet(places=8)
        router2.workers[0].client.stats = waiting_stats(running=3, waiting=1)  # type: ignore[union-attr]
        for i in range(3):
            router2.add_request(request(f"b{i}"))
        assert sent(router2) == [[], ["b0", "b1", "b2"]]

    asyncio.run(main())


def test_the_first_place_freed_anywhere_goes_to_the_tenant_served_least() -> None:
    async def main() -> None:
        router = fleet(places=1)
        fq = router.fleet_queue
        assert fq is not None
        router.add_request(request("a1"))
        router.add_request(request("a2"))
        w0, w1 = sent(router)
        assert len(w0) == len(w1) == 1
        for rid in ("a3", "a4"):
            router.add_request(request(rid))
        router.add_request(request("b1", tenant="B"))
        router.add_request(request("b2", tenant="B"))
        assert len(fq) == 4
        # A is served while B waits: A's counter grows past B's (B was lifted to A's when it came).
        emit(router, "a1", output("a1", 8))
        emit(router, "a2", output("a2", 8))
        assert fq.queue.counter(router._where["b1"]) < fq.queue.counter(router._where["a3"])
        # a1 ends on one worker: its place goes to B's oldest, not to A's older requests.
        emit(router, "a1", output("a1", 1, done=True))
        await settle()
        assert "b1" in sent(router)[router._where["b1"].slot] and len(fq) == 3
        # a2 ends on the other worker: B's second request, again before A's.
        emit(router, "a2", output("a2", 1, done=True))
        await settle()
        assert router._where["b1"].slot != router._where["b2"].slot, "a place on each worker"
        assert len(fq) == 2 and all(rid in router._where for rid in ("a3", "a4"))
        # B's requests end: A's oldest goes next, then the other.
        emit(router, "b1", output("b1", 1, done=True))
        await settle()
        assert len(fq) == 1 and router._where["a3"].slot >= 0 and "a3" in sum(sent(router), [])
        st = fq.stats
        assert (st.held, st.released) == (4, 3)

    asyncio.run(main())


def test_a_lower_band_goes_first_then_the_tenant_served_least_or_without_fair_the_oldest() -> None:
    async def main() -> None:
        for fair, expected in ((True, ["b", "a", "late"]), (False, ["a", "b", "late"])):
            router = fleet(places=1, workers=1, fair=fair)
            router.add_request(request("run"))
            router.add_request(request("late", tenant="A", priority=1))
            router.add_request(request("a", tenant="A"))
            router.add_request(request("b", tenant="B"))  # lifted to A's counter in band 0: even
            # A is served on (run is A's): under fair, B goes before A's older request in band 0
            emit(router, "run", output("run", 5))
            order = []
            for rid in ("run", *expected[:2]):
                emit(router, rid, output(rid, 1, done=True))
                await settle()
                order.append(sent(router)[0][-1])
            assert order == expected, (fair, order)

    asyncio.run(main())


def test_an_urgent_request_goes_where_the_engine_can_preempt_for_it() -> None:
    async def main() -> None:
        router = fleet(places=1)
        router.add_request(request("batch", priority=5))
        router.add_request(request("normal", priority=0))
        w_batch = router._where["batch"].slot
        router.add_request(request("waits", priority=3))  # more urgent than batch: not than normal
        assert sent(router)[w_batch] == ["batch", "waits"], "sent where the band-5 request runs"
        router.add_request(request("same", priority=5))
        router.add_request(request("urgent", priority=0))
        assert router.fleet_queue is not None and len(router.fleet_queue) == 1  # "same" waits
        assert "urgent" in sent(router)[w_batch], "a band-0 request passes the waiting band-5 one"

    asyncio.run(main())


def test_a_retried_request_pays_its_prompt_once_and_probes_never_wait() -> None:
    async def main() -> None:
        from tokenmill.engine.client import WorkerDrainingError

        router = fleet(places=1, workers=2)
        fq = router.fleet_queue
        assert fq is not None
        router.add_request(request("a", prompt=40))
        relay = router._where["a"]
        relay.put_nowait(WorkerDrainingError("leaving"))  # refused by a draining worker: sent again
        await settle()
        assert sum(map(len, sent(router))) == 2 and fq.queue.counter(relay) == 0.0
        emit(router, "a", output("a", 1, prompt=40))  # its first token, on the worker that took it over
        assert fq.queue.counter(relay) == 40.0 + 2.0
        router.add_request(request("b"))
        router.add_request(request("c"))
        assert len(fq) == 1
        router.add_request(request("health-1", prompt=1))  # a probe: sent at once, full or not
        assert "health-1" in sum(sent(router), []) and len(fq) == 1
        # the requests waiting at the router count as waiting in the fleet's stats (planner, /get_load)
        for w in router.workers:
            w.client.stats = waiting_stats(running=1, waiting=0)  # type: ignore[union-attr]
        assert router.stats is not None and router.stats.num_waiting == 1

    asyncio.run(main())


def test_an_aborted_waiting_request_is_never_sent() -> None:
    async def main() -> None:
        router = fleet(places=1, workers=1)
        router.add_request(request("run"))
        q = router.add_request(request("gone", tenant="B"))
        router.add_request(request("next"))
        router.abort(["gone"])
        assert router.fleet_queue is not None and len(router.fleet_queue) == 1
        emit(router, "run", output("run", 1, done=True))
        await settle()
        assert sent(router) == [["run", "next"]] and q.empty()
        assert "gone" not in router.fleet_queue.counted  # its tenant is no longer active for it

    asyncio.run(main())


def test_with_no_worker_left_the_waiting_requests_end_with_an_error_at_once() -> None:
    async def main() -> None:
        router = fleet(places=1)
        for rid in ("a1", "a2", "a3", "b1"):
            router.add_request(request(rid))
        queues = {rid: router._where[rid].queue for rid in ("a3", "b1")}
        for w in router.workers:
            w.up = False
        router.board.invalidate()
        router._release_held()  # (the membership loop calls it every 0.1 s)
        for rid, q in queues.items():
            err = q.get_nowait()
            assert isinstance(err, EngineDeadError) and "no worker is up" in str(err), rid
            assert rid not in router._where
        assert router.fleet_queue is not None and len(router.fleet_queue) == 0

    asyncio.run(main())


def test_counters_are_charged_with_the_prompt_tokens_computed_and_the_tokens_generated() -> None:
    async def main() -> None:
        router = fleet(places=4, workers=1)
        fq = router.fleet_queue
        assert fq is not None
        router.add_request(request("a", prompt=40))
        relay = router._where["a"]
        assert fq.queue.counter(relay) == 0.0, "nothing served yet"
        # the first token's output says the engine found 32 of the 40 prompt tokens in its cache
        emit(router, "a", output("a", 3, prompt=40, cached=32))
        assert fq.queue.counter(relay) == 8 * 1.0 + 3 * 2.0  # input weight 1, output weight 2
        emit(router, "a", output("a", 2, prompt=40, cached=32))
        assert fq.queue.counter(relay) == 8.0 + 5 * 2.0  # the prompt once

    asyncio.run(main())


@pytest.mark.parametrize(
    ("policy", "flag", "queue", "fair"),
    [("fair", "auto", True, True), ("priority", "auto", True, False), ("fcfs", "auto", False, False),
     ("fcfs", "on", True, False), ("fair", "off", False, False)],
)  # fmt: skip
def test_the_queue_follows_the_engine_policy_unless_told(
    policy: str, flag: str, queue: bool, fair: bool
) -> None:
    config = ServerConfig(workers="2", fleet=FleetConfig(router_queue=flag))
    config.engine.scheduler.policy = policy
    config.engine.scheduler.tenant_weights = "alice=2"
    s = router_settings(config)
    assert (s.queue, s.queue_fair) == (queue, fair)
    if queue:
        assert (
            s.tenant_weights == {"alice": 2.0}
            and s.queue_max_in_flight == config.engine.scheduler.max_num_seqs
        )
    with pytest.raises(ValueError, match="--router-queue must be"):
        router_settings(ServerConfig(workers="2", fleet=FleetConfig(router_queue="yes")))


# -- the real fleet ---------------------------------------------------------------------------------
def total(text: str, name: str) -> float:
    """The sum of a metric's series over the fleet's workers."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def fleet_state(running: int, held: int):  # noqa: ANN201
    return lambda t: (
        total(t, "tokenmill:num_requests_running") == running
        and total(t, "tokenmill:num_requests_waiting") == 0
        and total(t, "tokenmill:router_queue_waiting") == held
    )


def total_b_input(text: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tokenmill:tenant_tokens_total{")
        and 'tenant="B"' in line
        and 'kind="input"' in line
    )


def b_took_it(held: int, b_input_before: float):  # noqa: ANN201
    state = fleet_state(2, held)
    return lambda t: state(t) and total_b_input(t) > b_input_before


B_PROMPT = 16  # tokens of each of B's prompts
A_LEAD_TOKENS = 24  # tokens A generates while B waits, before any place frees


async def flood_the_fleet(base: str) -> dict:
    a, b = client(base, "key", "A"), client(base, "key", "B")
    streams, result = Streams(), {}
    try:
        running = [streams.start(a, 24, priority=5) for _ in range(2)]  # one place on each worker
        await until(base, fleet_state(2, 0))
        for i in range(2):  # A's flood waits at the router, in a known order
            streams.start(a, 24, priority=5)
            await until(base, fleet_state(2, i + 1))
        b_tasks = [streams.start(b, B_PROMPT, priority=5) for _ in range(2)]
        text = await until(base, fleet_state(2, 4))
        # A is served while B waits: A's counter grows past the level B was lifted to on arrival. By how
        # much is a state, not a race: B's first place charges B its prompt (16 x input weight 1) and then
        # both tenants' one stream each 2 a token, so B must still be behind A when the second place frees.
        # A's lead is 2 a token A generates from here on; 24 tokens (48) leave B's prompt a margin of 32.
        a_out = served(text, "A", "output")
        await until(base, lambda t: served(t, "A", "output") >= a_out + A_LEAD_TOKENS)
        b_in = 0.0
        for freed, task in enumerate(running, 1):  # each on its own worker
            await streams.cancel(task)
            # the place went to B: one more of B's prompts computed, and one less request waiting here
            # (had A's older request taken it, B's count would not grow and this would time out)
            text = await until(base, b_took_it(4 - freed, b_in), timeout=120)
            b_in = total_b_input(text)
        result["workers_serving_b"] = sum(
            1
            for line in text.splitlines()
            if line.startswith("tokenmill:tenant_tokens_total{")
            and 'tenant="B"' in line
            and 'kind="input"' in line
            and float(line.rsplit(" ", 1)[1]) > 0
        )
        assert not any(t.done() for t in b_tasks)
        result["metrics"] = scrape(base)
    finally:
        await streams.cancel_all()
    return result


@pytest.mark.slow
def test_a_fleet_gives_each_place_it_frees_to_the_tenant_served_least() -> None:
    args = ["--workers", "2", "--policy", "fair", "--tenant-header", "x-tenant-id", "--max-num-seqs", "1"]
    args += ["--max-num-batched-tokens", "64", "--max-model-len", "8192", "--max-queued-requests", "8"]
    with running_server(*args, api_key="key") as p:
        r = asyncio.run(flood_the_fleet(p.base_url))
    print({k: v for k, v in r.items() if k != "metrics"})
    # B's first request took the first place freed, its second the next, on the other worker (checked
    # in flood_the_fleet); A's two older requests still wait at the router.
    assert r["workers_serving_b"] == 2, "B served on both workers"
    text = r["metrics"]
    assert total(text, "tokenmill:router_queue_held_total") == 4
    assert total(text, "tokenmill:router_queue_released_total") == 2


def test_requests_that_waited_for_a_cold_start_then_wait_for_places_in_order() -> None:
    async def main() -> None:
        settings = RouterSettings("kv", scale_to_zero=True, queue=True, queue_fair=True)
        router = RouterEngineClient(["tcp://w0:1"], settings)
        router.block_size = 16
        router.prefix.set_block_size(16)
        w = router.workers[0]
        w.retired = True  # a fleet at zero
        for rid in ("a1", "a2", "a3"):
            router.add_request(request(rid))
        assert router.cold_start is not None and len(router.cold_start) == 3
        w.retired, w.client, w.up, w.joins = False, StandIn(), True, 1  # type: ignore[assignment]
        w.info = {"max_num_seqs": 1}
        router.board.invalidate()
        router._joined()
        # not all three on the new worker at once: one place, the others wait for it at the router
        assert sent(router) == [["a1"]] and router.fleet_queue is not None and len(router.fleet_queue) == 2
        assert router.cold_start.stats.served == 3
        emit(router, "a1", output("a1", 1, done=True))
        await settle()
        assert sent(router) == [["a1", "a2"]]

    asyncio.run(main())


def test_requests_prefilling_elsewhere_hold_places_on_the_decode_workers() -> None:
    async def main() -> None:
        router = fleet(places=1)
        # a disaggregated fleet's orchestrator with one request prefilling on a prefill worker
        router.pd = SimpleNamespace(phase={"p": None}, start=lambda relay: False, abort=lambda ids: None)  # type: ignore[assignment]
        router.add_request(request("a1"))
        router.add_request(request("a2"))  # one place left, promised to the request prefilling
        assert sum(map(len, sent(router))) == 1
        assert router.fleet_queue is not None and len(router.fleet_queue) == 1

    asyncio.run(main())
