"""An engine served by `tokenmill worker --listen tcp://...` and reached from elsewhere: the asyncio
frontend, two frontends at once, the OpenAI server with --worker-url, and a worker that vanishes."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

import pytest
from server_fixture import free_port, running_server

from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.client import EngineDeadError, ZmqEngineClient
from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.weights import catalog, loader

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]


@contextlib.contextmanager
def worker_process(*args: str):
    url = f"tcp://127.0.0.1:{free_port()}"
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.cli.main",
        "worker",
        "--listen",
        url,
        "--max-model-len",
        "512",
        *args,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


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


def test_a_vanished_worker_fails_requests_instead_of_hanging() -> None:
    with worker_process() as (url, proc):

        async def main():
            client = ZmqEngineClient(url, heartbeat_timeout=3.0)
            await client.start()
            llm = AsyncLLM(client, loader.load_tokenizer(catalog.resolve(EngineConfig().model), None))
            proc.kill()  # SIGKILL: no goodbye
            with pytest.raises(EngineDeadError, match="no word"):
                await asyncio.wait_for(collect(llm, "x", [1, 2, 3]), 30)
            await client.shutdown()

        asyncio.run(main())


def test_worker_cli_refuses_a_bad_address() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli.main", "worker", "--listen", "http://x"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "tcp://HOST:PORT" in r.stderr and "Traceback" not in r.stderr
