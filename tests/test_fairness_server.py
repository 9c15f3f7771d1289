"""Tenants, fair shares and load shedding at the server.

In process (no model): keys are matched whole, a named key (`--named-api-key NAME=KEY`) names its
tenant, the tenant header may not name a named key's tenant, `default` or `other` (400 in OpenAI's
shape), and a priority below the tenant's floor is raised to it.

Through the real server (`tokenmill serve` on 127.0.0.1, the embedded model) and the real `openai`
client, with asserts that hold on a CPU of any speed: nothing is timed. The engine's state is driven
into a known shape by waiting on its own gauges (`tokenmill:num_requests_running` and `_waiting`),
never by sleeping, and what is measured is counted by the engine (`tokenmill:tenant_tokens`,
`tokenmill:engine_steps`). Long requests ask for thousands of tokens, far more steps than a test takes,
and are cancelled explicitly.

- Fair shares: tenant A holds every place with long streams and has more requests queued; tenant B
  (a named key) then queues one. Under `fair` the first place A frees goes to B (B was served least),
  under `fcfs` to A's older requests, place after place. B's tokens per engine step while it runs are
  what they are when B is alone.
- Shedding: with every place taken, a more urgent request sheds the latest queued request of the
  highest band below it (503 with Retry-After); a priority under the tenant's floor is raised to the
  floor first, so it sheds nothing of its own band; a stream whose 200 has gone out is never shed;
  under `fcfs` nothing is shed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from types import SimpleNamespace

import httpx
import openai
import pytest
from server_fixture import running_server
from test_server_behaviour import metric, wait_until

from tokenmill.server.config import ServerConfig

MODEL = "smollm2-135m"
LONG = 8000  # tokens a long request asks for: thousands of steps more than any test here runs
_rng = random.Random(0)


def prompt(n: int) -> list[int]:
    """Token ids no other prompt shares (no prefix-cache hits to skew the counts)."""
    return [_rng.randrange(1000, 40_000) for _ in range(n)]


# -- in process ---------------------------------------------------------------------------------------
def run_middleware(config: ServerConfig, key: str | None) -> tuple[int, dict]:
    """The API key middleware on one request presenting `key`: (status, the scope the app saw)."""
    from tokenmill.server.guards import ApiKeyMiddleware

    seen: dict = {}
    sent: list[dict] = []

    async def app(scope, receive, send) -> None:  # noqa: ANN001
        seen.update(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"authorization", f"Bearer {key}".encode())] if key is not None else []
    scope = {"type": "http", "path": "/v1/completions", "headers": headers, "method": "POST"}
    asyncio.run(ApiKeyMiddleware(app, config.api_keys())(scope, receive, send))
    return sent[0]["status"], seen


def test_keys_are_matched_whole_and_a_named_key_names_its_tenant() -> None:
    from tokenmill.server.tenants import KEY_NAME_SCOPE

    config = ServerConfig(api_key="plain:with:colon, other-plain", named_api_key=["alice=key=alice"])
    assert run_middleware(config, None)[0] == 401
    assert run_middleware(config, "with:colon")[0] == 401  # a suffix of a plain key is not a key
    assert run_middleware(config, "plain")[0] == 401
    status, scope = run_middleware(config, "plain:with:colon")
    assert status == 200 and KEY_NAME_SCOPE not in scope  # a plain key names no tenant
    assert run_middleware(config, "other-plain")[0] == 200
    status, scope = run_middleware(config, "key=alice")
    assert status == 200 and scope[KEY_NAME_SCOPE] == "alice"
    assert run_middleware(config, "alice=key=alice")[0] == 401  # the key is what follows the first `=`
    assert ServerConfig(named_api_key=["bob=k"]).requires_key and not ServerConfig().requires_key


def header_scope(key_name: str | None = None, **headers: str) -> dict:
    from tokenmill.server.tenants import KEY_NAME_SCOPE

    scope: dict = {"headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}
    if key_name:
        scope[KEY_NAME_SCOPE] = key_name
    return scope


def test_the_tenant_header_may_not_name_a_reserved_tenant_and_a_floor_clamps_the_band() -> None:
    from tokenmill.server.app import _scope
    from tokenmill.server.errors import APIError

    config = ServerConfig(
        named_api_key=["alice=ka"], tenant_header="x-tenant-id", tenant_priority_floor="ops=-5,default=-1"
    )
    state = SimpleNamespace(
        config=config,
        reserved_tenants=frozenset({"default", "other", "alice"}),
        priority_floors={"ops": -5, "default": -1},
    )

    def scope_of(scope: dict, priority: int) -> tuple[str | None, int, int]:
        body = SimpleNamespace(priority=priority)
        s, band = _scope(SimpleNamespace(scope=scope), state, body)  # type: ignore[arg-type]
        assert body.priority == band  # what the engine will be told
        return s.tenant, s.floor, band

    assert scope_of(header_scope(x_tenant_id="team-7"), -100) == ("team-7", 0, 0)
    assert scope_of(header_scope(x_tenant_id="team-7"), 3) == ("team-7", 0, 3)  # less urgent: as asked
    assert scope_of(header_scope(x_tenant_id="ops"), -100) == ("ops", -5, -5)
    assert scope_of(header_scope(), -100) == (None, -1, -1)  # the tenant default's floor
    assert scope_of(header_scope("alice", x_tenant_id="mallory"), -3) == ("alice", 0, 0)  # the key wins
    for name in ("alice", "default", "other"):
        with pytest.raises(APIError) as e:
            scope_of(header_scope(x_tenant_id=name), 0)
        assert e.value.status == 400 and "reserved" in e.value.message
    with pytest.raises(APIError) as e:
        scope_of(header_scope(x_tenant_id="no spaces, please"), 0)
    assert e.value.status == 400 and "x-tenant-id" in e.value.message


def test_a_reserved_tenant_in_the_header_gets_a_400_in_openai_shape() -> None:
    """The whole app in process (no model: the request is refused before anything reaches the engine)."""
    from fastapi.testclient import TestClient

    from tokenmill.server.app import build_app

    config = ServerConfig(api_key="shared", named_api_key=["alice=ka"], tenant_header="x-tenant-id")
    stand_in = SimpleNamespace(client=SimpleNamespace(info={}), tokenizer=SimpleNamespace(chat_template=None))
    client = TestClient(build_app(stand_in, config))  # type: ignore[arg-type]
    for name in ("alice", "default", "other"):
        r = client.post(
            "/v1/completions",
            headers={"Authorization": "Bearer shared", "x-tenant-id": name},
            json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "BadRequestError" and err["code"] == 400 and "reserved" in err["message"]


def test_the_grpc_front_takes_the_same_keys() -> None:
    pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is a dependency")
    from tokenmill.triton.grpc_front import ApiKeyInterceptor

    config = ServerConfig(api_key="plain:with:colon", named_api_key=["alice=ka"])
    interceptor = ApiKeyInterceptor(config.api_keys())

    async def continuation(details: object) -> str:
        return "served"

    def call(auth: str) -> object:
        details = SimpleNamespace(
            method="/inference.GRPCInferenceService/ModelInfer",
            invocation_metadata=(("authorization", auth),),
        )
        return asyncio.run(interceptor.intercept_service(continuation, details))

    assert call("Bearer ka") == call("Bearer plain:with:colon") == "served"
    for wrong in ("Bearer with:colon", "Bearer alice=ka", "Bearer alice", ""):
        assert call(wrong) is interceptor._deny, wrong
    assert ApiKeyInterceptor("a, b").expected == [b"Bearer a", b"Bearer b"]  # --api-key's text alone


# -- through the real server --------------------------------------------------------------------------
def scrape(base: str) -> str:
    return httpx.get(f"{base}/metrics").text


async def until(base: str, what: Callable[[str], bool], timeout: float = 300.0) -> str:
    """Wait until the /metrics text satisfies `what` (a generous bound: only a broken server exceeds it);
    return that text."""
    got: list[str] = []

    def check() -> bool:
        text = scrape(base)
        if what(text):
            got.append(text)
            return True
        return False

    assert await asyncio.to_thread(wait_until, check, timeout), f"the server never got there:\n{scrape(base)}"
    return got[0]


def gauges(running: int, waiting: int) -> Callable[[str], bool]:
    return lambda t: (
        metric(t, "tokenmill:num_requests_running") == running
        and metric(t, "tokenmill:num_requests_waiting") == waiting
    )


def served(text: str, tenant: str, kind: str) -> float:
    return metric(text, "tokenmill:tenant_tokens_total", 0.0, tenant=tenant, kind=kind)


class Streams:
    """Long streamed completions consumed in the background, each cancelled explicitly."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task] = []
        self.errors: list[BaseException] = []

    def start(
        self, c: openai.AsyncOpenAI, n_prompt: int = 8, max_tokens: int = LONG, **extra
    ) -> asyncio.Task:
        async def consume() -> int:
            chunks = 0
            stream = await c.completions.create(
                model=MODEL, prompt=prompt(n_prompt), max_tokens=max_tokens, stream=True,
                extra_body={"ignore_eos": True, **extra},
            )  # fmt: skip
            async for _ in stream:
                chunks += 1
            return chunks

        task = asyncio.create_task(consume())
        self.tasks.append(task)
        return task

    async def cancel(self, task: asyncio.Task) -> None:
        assert not task.done(), task  # a long one ends only when cancelled
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def cancel_all(self) -> None:
        for task in self.tasks:
            if not task.done():
                await self.cancel(task)


def tokens_per_step(base: str, tenant: str) -> float:
    """The tenant's generated tokens per engine step over 10 steps or more. Each scrape's figures are of
    one engine snapshot, so the ratio is exact whatever happens between the scrapes."""
    first = scrape(base)
    steps = metric(first, "tokenmill:engine_steps_total")
    assert wait_until(lambda: metric(scrape(base), "tokenmill:engine_steps_total") >= steps + 10, 300)
    last = scrape(base)
    d_steps = metric(last, "tokenmill:engine_steps_total") - steps
    return (served(last, tenant, "output") - served(first, tenant, "output")) / d_steps


N_SEQS, A_QUEUED = 4, 6
SERVER = ["--tenant-header", "x-tenant-id", "--max-num-seqs", str(N_SEQS), "--max-num-batched-tokens", "64"]
# Every place of admission taken by the flood: A's N_SEQS running and A_QUEUED queued, and B's one.
SERVER += ["--max-model-len", "8192", "--max-queued-requests", str(A_QUEUED + 1)]


def client(base: str, key: str, tenant: str | None = None) -> openai.AsyncOpenAI:
    headers = {"x-tenant-id": tenant} if tenant else None
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, default_headers=headers)


async def flood_then_free(base: str, policy: str) -> dict:
    """A (header-named, a plain key) takes every place and queues A_QUEUED more; B (the named key alice)
    queues one; then A's running streams are cancelled one at a time. What B got, place by place."""
    a, b = client(base, "key-shared", "A"), client(base, "key-alice", tenant="mallory")
    streams, result = Streams(), {}
    try:
        # B alone: its tokens per step.
        alone = streams.start(b, 16, priority=5)
        await until(base, lambda t: served(t, "alice", "output") >= 1)
        result["alone"] = await asyncio.to_thread(tokens_per_step, base, "alice")
        await streams.cancel(alone)
        await until(base, gauges(0, 0))
        # A's flood, in band 5, queued in a known order: each request is in the engine before the next.
        running = [streams.start(a, 24, priority=5) for _ in range(N_SEQS)]
        await until(base, gauges(N_SEQS, 0))
        for i in range(A_QUEUED):  # the last ones whole (not streamed): what shedding could take
            if i < A_QUEUED // 2:
                streams.start(a, 24, priority=5)
            else:
                streams.tasks.append(asyncio.create_task(whole_long(a)))
            await until(base, gauges(N_SEQS, i + 1))
        b_task = streams.start(b, 16, priority=5)  # A's band: a lower one would go first under fair
        text = await until(base, gauges(N_SEQS, A_QUEUED + 1))
        b_before = served(text, "alice", "input")  # its prompt when it ran alone
        # Every place taken: a more urgent request sheds nothing under fcfs (429). (Under fair it would
        # shed one of A's queued whole requests: not here, where the queue is what is measured.)
        if policy == "fcfs":
            with pytest.raises(openai.RateLimitError):
                await client(base, "key-shared", "C").completions.create(
                    model=MODEL, prompt=prompt(4), max_tokens=1, extra_body={"priority": 0}
                )
        # Free A's places one at a time: who gets each?
        result["b_admitted_after"] = None
        for freed, task in enumerate(running, 1):
            await streams.cancel(task)
            text = await until(base, gauges(N_SEQS, A_QUEUED + 1 - freed))
            if served(text, "alice", "input") > b_before:
                result["b_admitted_after"] = freed
                break
        result["a_waiting_then"] = metric(text, "tokenmill:num_requests_waiting")
        if result["b_admitted_after"] is not None:
            result["flooded"] = await asyncio.to_thread(tokens_per_step, base, "alice")
        assert not b_task.done()
        result["metrics"] = scrape(base)
    finally:
        await streams.cancel_all()
    return result


async def whole_long(c: openai.AsyncOpenAI) -> None:
    await c.completions.create(
        model=MODEL, prompt=prompt(24), max_tokens=LONG, extra_body={"ignore_eos": True, "priority": 5}
    )


def run_flood(policy: str) -> dict:
    args = ["--policy", policy, *SERVER, "--named-api-key", "alice=key-alice"]
    with running_server(*args, api_key="key-shared") as p:
        result = asyncio.run(flood_then_free(p.base_url, policy))
    print(f"\n{policy}: { ({k: v for k, v in result.items() if k != 'metrics'}) }")
    return result


@pytest.mark.slow
def test_fair_gives_the_first_free_place_to_the_tenant_served_least() -> None:
    r = run_flood("fair")
    # B's request queued behind all of A's, yet the first place A freed went to B, and A's stay queued.
    assert r["b_admitted_after"] == 1 and r["a_waiting_then"] == A_QUEUED
    # While A floods, B is served a token every engine step: as when B was alone.
    assert r["alone"] == r["flooded"] == 1.0
    # Both tenants counted under their names; the named key beat B's header (no tenant "mallory").
    text = r["metrics"]
    assert served(text, "A", "input") > 0 and served(text, "alice", "output") > 0
    assert metric(text, "tokenmill:tenant_tokens_total", -1.0, tenant="mallory", kind="input") == -1.0


@pytest.mark.slow
def test_fcfs_gives_the_free_places_to_the_flood_and_sheds_nothing() -> None:
    r = run_flood("fcfs")
    # Four places freed, four of A's older requests took them: B still waits behind two more.
    assert r["b_admitted_after"] is None and r["a_waiting_then"] == A_QUEUED + 1 - N_SEQS
    assert r["alone"] == 1.0
    text = r["metrics"]
    assert metric(text, "tokenmill:request_failure_total", kind="rejected_overload") == 1
    assert metric(text, "tokenmill:requests_shed_total", 0.0, band="5") == 0


@pytest.mark.slow
def test_overload_sheds_the_lowest_band_first_within_each_tenants_floor() -> None:
    args = [
        "--policy",
        "fair",
        "--max-num-seqs",
        "2",
        "--max-queued-requests",
        "3",
        "--max-model-len",
        "8192",
    ]
    args += ["--tenant-header", "x-tenant-id", "--tenant-priority-floor", "ops=-5"]
    with running_server(*args) as proc:
        asyncio.run(_shedding(proc.base_url))


async def _shedding(base: str) -> None:
    c = client(base, "x")
    ops = client(base, "x", "ops")
    streams = Streams()

    async def whole(c: openai.AsyncOpenAI, priority: int, max_tokens: int = 4) -> object:
        try:
            return await c.completions.create(
                model=MODEL, prompt=prompt(8), max_tokens=max_tokens,
                extra_body={"ignore_eos": True, "priority": priority},
            )  # fmt: skip
        except openai.APIStatusError as e:
            return e

    try:
        # Both places: two long band-0 streams. Queued after them (in this order, each in the engine
        # before the next is sent): a band-0 request, a band-5 one, a band-5 stream. Five of five taken.
        for _ in range(2):
            streams.start(c)
        await until(base, gauges(2, 0))
        q0 = asyncio.create_task(whole(c, 0))
        await until(base, gauges(2, 1))
        q5 = asyncio.create_task(whole(c, 5))
        await until(base, gauges(2, 2))
        s5 = streams.start(c, max_tokens=4, priority=5)  # the latest of band 5, but its 200 went out
        await until(base, gauges(2, 3))

        # A request of the same band is refused itself, shedding nothing.
        err = await whole(c, 5)
        assert isinstance(err, openai.RateLimitError)
        # Priority -100 from a tenant with no floor is band 0: it sheds the latest queued request of the
        # highest band above 0 that has not begun its answer: q5, not the stream s5.
        urgent = asyncio.create_task(whole(c, -100))
        err = await asyncio.wait_for(q5, 300)
        assert isinstance(err, openai.InternalServerError) and err.status_code == 503
        assert err.response.headers["retry-after"] and err.body["code"] == 503
        assert err.body["type"] == "ServiceUnavailableError" and "more urgent" in err.body["message"]
        await until(base, gauges(2, 3))  # `urgent` queued in band 0 (the streams are band 0 too)
        # Full again: -100 is still band 0, so the band-0 requests queued are safe from it: 429.
        err = await whole(c, -100)
        assert isinstance(err, openai.RateLimitError)
        # The tenant ops may go to band -5: it sheds the latest band-0 request still queued (`urgent`),
        # then runs at once (its band preempts a band-0 stream, which resumes after).
        done = await whole(ops, -100, max_tokens=3)
        assert done.usage.completion_tokens == 3, done
        err = await asyncio.wait_for(urgent, 300)
        assert isinstance(err, openai.InternalServerError) and err.status_code == 503
        assert not q0.done() and not s5.done()

        text = scrape(base)
        assert metric(text, "tokenmill:requests_shed_total", band="5") == 1
        assert metric(text, "tokenmill:requests_shed_total", band="0") == 1
        assert metric(text, "tokenmill:request_failure_total", kind="rejected_overload") == 2
        assert metric(text, "tokenmill:request_failure_total", 0.0, kind="engine_unavailable") == 0
        # The long streams give their places up: what was queued runs to its end, unshed.
        for task in streams.tasks[:2]:
            await streams.cancel(task)
        assert (await asyncio.wait_for(q0, 300)).usage.completion_tokens == 4
        assert await asyncio.wait_for(s5, 300) > 0
    finally:
        await streams.cancel_all()
