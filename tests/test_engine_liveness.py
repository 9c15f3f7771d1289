"""An engine step longer than the client's liveness timeout is not death (issue 51, item 3): the engine
heartbeats while a step runs, and a client that heard nothing for a while takes the engine back into
service as soon as it speaks again."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import zmq
from server_fixture import running_server

from tokenmill import SamplingParams
from tokenmill.engine import engine_server
from tokenmill.engine.client import HEARTBEAT_TIMEOUT_ENV, EngineDeadError, ZmqEngineClient
from tokenmill.engine.engine_server import SLOW_STEP_ENV
from tokenmill.engine.protocol import (
    EngineCoreOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    Shutdown,
    encode,
)

TIMEOUT_S = 2.0  # the client's liveness timeout here (40 s by default)
SLOW_STEP_S = 5.0  # every engine step takes this much longer: well past the timeout


def _complete(base: str, prompt: str) -> httpx.Response:
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)  # a hang guard only


@pytest.mark.slow
def test_a_step_longer_than_the_liveness_timeout_completes_and_health_stays_up(monkeypatch) -> None:
    monkeypatch.setenv(HEARTBEAT_TIMEOUT_ENV, str(TIMEOUT_S))
    monkeypatch.setenv(SLOW_STEP_ENV, str(SLOW_STEP_S))
    with running_server() as server:
        base = server.base_url
        for prompt in ("A long step, the first time.", "And again, the engine still serving."):
            r = _complete(base, prompt)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] is not None
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        assert httpx.get(f"{base}/v1/health/ready", timeout=10).status_code == 200


def _engine_pid(server_pid: int) -> int:
    """The engine process: the server's child started by multiprocessing's spawn (not its resource
    tracker)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for pid in map(int, children):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            return pid
    raise AssertionError(f"no engine process among the server's children {children}")


def _wait_status(url: str, status: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == status:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_a_silent_engine_returns_to_service_when_it_speaks_again(monkeypatch) -> None:
    monkeypatch.setenv(HEARTBEAT_TIMEOUT_ENV, str(TIMEOUT_S))
    with running_server() as server:
        base = server.base_url
        engine = _engine_pid(server.pid)
        os.kill(engine, signal.SIGSTOP)  # silent, yet alive: no heartbeat at all
        try:
            assert _wait_status(f"{base}/health", 503, 60), "a silent engine is reported unavailable"
            time.sleep(2 * TIMEOUT_S)  # and stays silent well past the timeout
        finally:
            os.kill(engine, signal.SIGCONT)
        assert _wait_status(f"{base}/health", 200, 60), "the engine speaks again: back in service"
        r = _complete(base, "Back in service.")
        assert r.status_code == 200, r.text


# -- the engine's loop with a stand-in engine (no model): fast --------------------------------------
class _SlowEngine:
    """Each step takes `step_s` and ends every request with one token."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.pending = step_s, []

    def stats(self) -> EngineStats:
        return EngineStats(len(self.pending), 0, 0.0, 1, 0, 0, 0, 0, 0)

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def add_request(self, req: EngineRequest) -> None:
        self.pending.append(req.request_id)

    def abort(self, ids: list[str]) -> list[EngineCoreOutput]:
        self.pending = [r for r in self.pending if r not in ids]
        return []

    def finish(self, ids: list[str], reason: FinishReason) -> None:
        self.abort(ids)

    def step(self) -> list[EngineCoreOutput]:
        time.sleep(self.step_s)
        done, self.pending = self.pending, []
        return [EngineCoreOutput(r, [7], finish_reason=FinishReason.LENGTH) for r in done]


@contextmanager
def _engine_thread(tmp_path: Path, step_s: float):
    """engine_server's loop over a _SlowEngine, in a thread, at an ipc:// address."""
    address = f"ipc://{tmp_path / 'engine'}"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    server = engine_server._Server(_SlowEngine(step_s), sock, {"max_model_len": 64}, None)
    thread = threading.Thread(target=server.loop, daemon=True)
    thread.start()
    try:
        yield address
    finally:
        with ctx.socket(zmq.DEALER) as stop:
            stop.connect(address)
            stop.send(encode(Shutdown()))
            thread.join(30)
        sock.close(linger=0)
        ctx.term()
    assert not thread.is_alive()


async def _one(client: ZmqEngineClient, rid: str) -> list[int]:
    q = client.add_request(EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=1)))
    out = await asyncio.wait_for(q.get(), 60)  # a hang guard only
    if isinstance(out, Exception):
        raise out
    return out.new_token_ids


def test_the_engine_heartbeats_during_a_step_longer_than_the_timeout(tmp_path) -> None:
    async def main() -> None:
        with _engine_thread(tmp_path, step_s=3.0) as address:
            client = ZmqEngineClient(address, heartbeat_timeout=1.5)
            await client.start()
            try:
                assert await _one(client, "slow") == [7]
                assert client.healthy and client.dead_reason is None
                assert await _one(client, "again") == [7]
            finally:
                await client.shutdown()

    asyncio.run(main())


def test_a_hung_step_fails_its_requests_and_the_engine_returns_when_it_speaks(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(engine_server, "HUNG_STEP_S", 0.5)  # past this, a step is taken as hung

    async def main() -> None:
        with _engine_thread(tmp_path, step_s=3.0) as address:
            client = ZmqEngineClient(address, heartbeat_timeout=1.5)
            await client.start()
            try:
                with pytest.raises(EngineDeadError, match="no word from the engine"):
                    await _one(client, "hung")
                assert not client.healthy
                with pytest.raises(EngineDeadError):
                    client.add_request(EngineRequest("meanwhile", [1], SamplingParams(max_tokens=1)))
                deadline = time.monotonic() + 30
                while not client.healthy and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert client.healthy and client.dead_reason is None, "it spoke again: back in service"
                monkeypatch.setattr(engine_server, "HUNG_STEP_S", 600.0)
                assert await _one(client, "after") == [7]
            finally:
                await client.shutdown()

    asyncio.run(main())
