"""An engine served by `tokenmill worker --listen tcp://...` and reached from elsewhere: the asyncio
frontend, two frontends at once, the OpenAI server with --worker-url, and a worker that vanishes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from procs import worker_process
from server_fixture import free_port, running_server

from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.client import EngineDeadError, ZmqEngineClient
from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.weights import catalog
from tokenmill.weights.tokenizer_source import load_tokenizer

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]


async def collect(llm: AsyncLLM, rid: str, ids: list[int]) -> list[int]:
    last = None
    async for ro in llm.generate(rid, ids, GREEDY):
        last = ro
    assert last is not None and last.finished
    return list(last.outputs[0].token_ids)


@pytest.fixture(scope="module")
def worker():
    with worker_process("--dtype", "float32") as w:
        yield w


def test_two_frontends_share_a_remote_worker(worker, llm_fp32) -> None:
    url, _ = worker

    async def main():
        a = await AsyncLLM.start(EngineConfig(dtype="float32"), url)
        b = await AsyncLLM.start(EngineConfig(dtype="float32"), url)
        try:
            ids = [a.tokenizer.encode(p) for p in PROMPTS]
            # The same request ids from both frontends would collide in the engine: each gets its own.
            got = await asyncio.gather(
                collect(a, "a0", ids[0]),
                collect(b, "b1", ids[1]),
                collect(a, "a2", ids[2]),
                collect(b, "b0", ids[0]),
            )
            return ids, got
        finally:
            await a.shutdown()
            await b.shutdown()

    ids, got = asyncio.run(main())
    offline = [o.outputs[0].token_ids for o in llm_fp32.generate(ids, GREEDY)]
    assert got == [offline[0], offline[1], offline[2], offline[0]]


def test_a_frontend_for_another_model_is_refused_and_the_worker_goes_on(worker) -> None:
    url, proc = worker
    # The same file under another name still counts as another model: names must match exactly.
    other = str(catalog.resolve(EngineConfig().model))

    async def main():
        with pytest.raises(ValueError, match="serves"):
            await AsyncLLM.start(EngineConfig(model=other), url)

    asyncio.run(main())
    assert proc.poll() is None


def test_openai_server_on_a_remote_worker(worker, llm_fp32) -> None:
    import openai

    url, _ = worker
    with running_server("--worker-url", url, "--dtype", "float32") as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        got = client.completions.create(
            model=client.models.list().data[0].id, prompt=PROMPTS[0], max_tokens=10, temperature=0
        )
    ids = llm_fp32.tokenizer.encode(PROMPTS[0])
    ref = llm_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert got.choices[0].text == ref.text


@pytest.mark.parametrize(
    ("sig", "why", "within"),
    [
        # Killed: its host closes the connection, and the client knows at once.
        (signal.SIGKILL, "connection to the engine at .* was lost", 2.0),
        # Hung (stopped, socket still open): only the missing heartbeat tells.
        (signal.SIGSTOP, "no word from the engine", 10.0),
    ],
)
def test_a_vanished_worker_fails_requests_instead_of_hanging(sig: int, why: str, within: float) -> None:
    with worker_process() as (url, proc):

        async def main():
            client = ZmqEngineClient(url, heartbeat_timeout=3.0)
            await client.start()
            llm = AsyncLLM(client, load_tokenizer(catalog.resolve(EngineConfig().model), None))
            os.kill(proc.pid, sig)
            t0 = time.monotonic()
            try:
                with pytest.raises(EngineDeadError, match=why):
                    await asyncio.wait_for(collect(llm, "x", [1, 2, 3]), 30)
                assert time.monotonic() - t0 < within
            finally:
                await client.shutdown()
                os.kill(proc.pid, signal.SIGKILL)

        asyncio.run(main())


def test_worker_cli_refuses_a_bad_address() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli.main", "worker", "--listen", "http://x"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "tcp://HOST:PORT" in r.stderr and "Traceback" not in r.stderr


def _metric(base: str, name: str) -> float:
    import httpx

    total = 0.0
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _kv_event_flags() -> list[str]:
    return [
        "--kv-events",
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
        "--kv-events-replay-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
    ]


def test_a_fleet_of_remote_workers_behind_the_openai_server() -> None:
    """Two `tokenmill worker` processes publishing KV events over tcp, one front with two --worker-url:
    a repeated prefix is credited by the router; a killed worker leaves rotation at once (the server
    stays ready and keeps answering); the same worker started again rejoins."""
    import httpx
    import openai

    a_flags, b_flags = _kv_event_flags(), _kv_event_flags()
    with (
        worker_process(*a_flags) as (url_a, proc_a),
        worker_process(*b_flags) as (url_b, _),
        running_server("--worker-url", url_a, "--worker-url", url_b, "--max-model-len", "512") as server,
    ):
        base = server.base_url
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        prompt = "A shared system prompt about the history of bridges and tunnels. " * 6
        for q in ("When?", "Where?", "Who?"):
            client.completions.create(model=model, prompt=prompt + q, max_tokens=4, temperature=0)
            time.sleep(0.3)  # the KV events of the first reach the router
        assert _metric(base, "tokenmill:router_workers_up") == 2
        assert _metric(base, "tokenmill:router_overlap_blocks_total") > 0
        assert _metric(base, "tokenmill:prefix_cache_hits_total") > 0

        proc_a.kill()
        proc_a.wait()
        t0 = time.monotonic()
        while _metric(base, "tokenmill:router_workers_up") != 1:
            assert time.monotonic() - t0 < 1.0, "a dead worker leaves rotation within a second"
            time.sleep(0.05)
        assert httpx.get(f"{base}/v1/health/ready", timeout=5).status_code == 200
        for q in ("Again?", "Once more?"):
            got = client.completions.create(model=model, prompt=prompt + q, max_tokens=4, temperature=0)
            assert got.choices[0].text is not None

        # The same worker (same addresses) comes back and rejoins rotation.
        host_port = url_a.removeprefix("tcp://")
        again = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli.main", "worker", "--listen", f"tcp://{host_port}",
             "--max-model-len", "512", *a_flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            t0 = time.monotonic()
            while _metric(base, "tokenmill:router_workers_up") != 2:
                assert time.monotonic() - t0 < 120, "the worker did not rejoin"
                time.sleep(0.2)
        finally:
            again.terminate()
            again.wait(30)


def test_workers_found_by_discovery_join_and_leave(tmp_path) -> None:
    """`--discovery file`: the router follows a file of addresses (as it follows a headless Service's
    DNS records or EndpointSlices): a worker added joins, a worker removed leaves. `tokenmill probe`
    says whether a worker is ready."""
    import time

    with worker_process(*_kv_event_flags()) as (url_a, _), worker_process(*_kv_event_flags()) as (url_b, _):
        listing = tmp_path / "workers.txt"
        listing.write_text(f"{url_a}\n")
        args = ("--workers", "0", "--discovery", "file", "--discovery-target", str(listing))
        with running_server(*args, "--discovery-interval-s", "0.3", "--max-model-len", "512") as server:
            base = server.base_url
            assert _metric(base, "tokenmill:router_workers_up") == 1
            listing.write_text(f"{url_a}\n{url_b}\n")
            t0 = time.monotonic()
            while _metric(base, "tokenmill:router_workers_up") != 2:
                assert time.monotonic() - t0 < 60, "the added worker did not join"
                time.sleep(0.2)
            listing.write_text(f"{url_b}  # a is gone\n")
            t0 = time.monotonic()
            while _metric(base, "tokenmill:router_workers_up") != 1:
                assert time.monotonic() - t0 < 10, "the removed worker did not leave"
                time.sleep(0.1)
            import openai

            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            got = client.completions.create(model=client.models.list().data[0].id, prompt="Hi", max_tokens=3)
            assert got.usage.completion_tokens == 3
        probe = [sys.executable, "-m", "tokenmill.cli.main", "probe"]
        ready = subprocess.run([*probe, url_b, "--timeout", "30"], capture_output=True, text=True, timeout=60)
        assert ready.returncode == 0 and "ready" in ready.stdout
    gone = subprocess.run([*probe, url_b, "--timeout", "1"], capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "not ready" in gone.stderr
