"""The engine core in its own process, driven over ZeroMQ by the asyncio frontend."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.client import EngineDeadError, RequestRejectedError
from tokenmill.frontend.async_llm import AsyncLLM

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(coro):
    return asyncio.run(coro)


async def collect(llm: AsyncLLM, rid: str, ids: list[int], params: SamplingParams):
    last = None
    async for ro in llm.generate(rid, ids, params):
        last = ro
    return last


def test_process_engine_matches_offline_llm(llm_bf16) -> None:
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]

    async def main():
        # The reference's dtype, not "auto": on a CPU without BF16 instructions auto computes in float32.
        llm = await AsyncLLM.start(EngineConfig(max_model_len=1024, dtype="bfloat16"))
        try:
            ids = [llm.tokenizer.encode(p) for p in prompts]
            outs = await asyncio.gather(*(collect(llm, f"r{i}", x, GREEDY) for i, x in enumerate(ids)))
            n = await collect(llm, "n", ids[0], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5))
            return ids, outs, n
        finally:
            await llm.shutdown()

    ids, outs, n = run(main())
    offline = llm_bf16.generate(ids, GREEDY)
    for a, b in zip(outs, offline, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text and a.finished
    assert len(n.outputs) == 2 and all(len(o.token_ids) == 5 for o in n.outputs)


def test_reject_abort_and_engine_death() -> None:
    async def main():
        llm = await AsyncLLM.start(EngineConfig(max_model_len=256))
        try:
            with pytest.raises(RequestRejectedError, match="context length"):
                await collect(llm, "long", [100] * 300, GREEDY)
            # Abort: stop consuming a long generation early; the engine frees it.
            gen = llm.generate("abort-me", [100] * 20, SamplingParams(max_tokens=200, ignore_eos=True))
            async for _ in gen:
                break
            await gen.aclose()
            # Waited for, not timed: on a loaded machine the abort and the next stats take a while.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                if llm.client.stats.num_running == 0 and llm.client.stats.kv_cache_usage == 0:
                    break
            assert llm.client.stats.num_running == 0 and llm.client.stats.kv_cache_usage == 0
            assert llm.client.healthy
            # Death: in-flight requests get an error, not a hang; health turns false.
            pending = asyncio.create_task(
                collect(llm, "doomed", [100] * 20, SamplingParams(max_tokens=10_000))
            )
            await asyncio.sleep(0.3)
            os.kill(llm.client.engine_pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(pending, timeout=10)
            assert not llm.client.healthy
        finally:
            await llm.shutdown()

    run(main())


def test_the_client_and_protocol_import_without_torch() -> None:
    # A frontend, router or remote client talks to engines without loading the model stack.
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import tokenmill.engine.client, tokenmill.engine.protocol, tokenmill.frontend.async_llm\n"
        "heavy = ('torch', 'numpy', 'tokenmill.models', 'tokenmill.worker.worker')\n"
        "loaded = [m for m in heavy if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_protocol_round_trip() -> None:
    from tokenmill.engine.protocol import (
        AddRequest,
        EngineCoreOutput,
        EngineRequest,
        EngineStats,
        FinishReason,
        StepOutputs,
        decode_from_engine,
        decode_to_engine,
        encode,
    )
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.worker.step import TokenLogprobs

    params = SamplingParams(temperature=0.7, seed=3, logit_bias={5: -1.0}, stop=["x"])
    req = EngineRequest("r", [1, 2, 3], params, frozenset({2}), priority=-1, cache_salt="s")
    assert decode_to_engine(encode(AddRequest(req))) == AddRequest(req)
    out = EngineCoreOutput("r", [4], [TokenLogprobs(4, -0.5, [(4, -0.5), (9, -1.5)])], FinishReason.LENGTH)
    stats = EngineStats(1, 0, 0.25, 64, 10, 5, 0, 3, 30)
    back = decode_from_engine(encode(StepOutputs([out], stats)))
    assert back == StepOutputs([out], stats) and back.outputs[0].finish_reason is FinishReason.LENGTH


def test_a_remote_engines_timestamps_are_put_on_the_frontends_clock() -> None:
    """A worker on another host reads another monotonic clock (here 5000 s ahead): the client shifts its
    outputs' timestamps by the offset its messages' `sent_at` show, so TTFT and queue time stay true."""
    import zmq

    from tokenmill.engine.client import ZmqEngineClient
    from tokenmill.engine.protocol import (
        AddRequest,
        EngineCoreOutput,
        EngineRequest,
        EngineStats,
        Hello,
        Ready,
        StepOutputs,
        decode_to_engine,
        encode,
    )

    ahead = 5000.0
    ctx = zmq.Context()
    engine = ctx.socket(zmq.ROUTER)
    port = engine.bind_to_random_port("tcp://127.0.0.1")

    def fake_engine() -> None:
        ident, raw = engine.recv_multipart()
        assert isinstance(decode_to_engine(raw), Hello)
        engine.send_multipart([ident, encode(Ready({"max_model_len": 64}))])
        while True:
            ident, raw = engine.recv_multipart()
            msg = decode_to_engine(raw)
            if isinstance(msg, AddRequest):
                break
        now = time.monotonic() + ahead  # the worker's clock
        out = EngineCoreOutput("r", [7], first_scheduled_time=now - 0.2, first_token_time=now - 0.1,
                               finished_time=now, new_token_times=[now - 0.1, now])  # fmt: skip
        engine.send_multipart(
            [ident, encode(StepOutputs([out], EngineStats(0, 0, 0.0, 8, 0, 0, 0, 0, 0), sent_at=now))]
        )

    async def main() -> EngineCoreOutput:
        client = ZmqEngineClient(f"tcp://127.0.0.1:{port}", startup_timeout=10, secret=None)
        server = asyncio.get_running_loop().run_in_executor(None, fake_engine)
        await client.start()
        q = client.add_request(EngineRequest("r", [1, 2], SamplingParams(max_tokens=1)))
        got = await asyncio.wait_for(q.get(), 10)
        await server
        await client.shutdown()
        return got

    try:
        before = time.monotonic()
        out = asyncio.run(main())
        after = time.monotonic()
    finally:
        engine.close(0)
        ctx.term()
    assert before - 0.2 <= out.first_scheduled_time < out.first_token_time < out.finished_time <= after
    assert out.new_token_times == [out.first_token_time, out.finished_time]
    assert abs((out.finished_time - out.first_token_time) - 0.1) < 1e-6, "intervals are kept"


def test_an_engine_on_this_host_keeps_its_timestamps() -> None:
    """Same clock: the least shift seen is only transit time, and nothing is shifted."""
    from tokenmill.engine.engine_clock import EngineClock

    clock = EngineClock()
    assert clock.observe(100.0, 100.0004) == 0.0 and clock.observe(100.5, 100.5002) == 0.0
    assert clock.observe(0.0, 7.0) == 0.0, "an unstamped message changes nothing"
    far = EngineClock()
    assert far.observe(5100.0, 100.0003) == pytest.approx(-4999.9997)
