"""EngineClient: how an asyncio frontend talks to an engine core, wherever the core runs.

`MPEngineClient` starts the engine core in its own process and talks to it over ZeroMQ, so HTTP
handling, tokenization and detokenization never wait behind a forward pass. The same interface can
later reach a remote worker (tcp:// instead of ipc://).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.engine.core_proc import HEARTBEAT_S, run_engine_process
from tokenmill.engine.protocol import (
    AbortRequests,
    AddRequest,
    Dead,
    EngineRequest,
    EngineStats,
    FinishRequests,
    Ready,
    Rejected,
    Shutdown,
    StepOutputs,
    ToEngine,
    decode_from_engine,
    encode,
)


class EngineDeadError(RuntimeError):
    """The engine process is gone (or never came up); in-flight requests cannot complete."""


class RequestRejectedError(ValueError):
    """The engine refused a request (e.g. a prompt longer than the context)."""


class RequestFailedError(RuntimeError):
    """The engine failed on this request (details in its log, under the request id); others go on."""


class EngineClient(ABC):
    """Requests in, per-request streams of EngineCoreOutput back."""

    info: dict[str, Any]

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def shutdown(self) -> None: ...

    @abstractmethod
    def add_request(self, req: EngineRequest, queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """Queue that receives this request's EngineCoreOutputs (or an exception instance). Several
        requests may share one queue (the n sequences of one API request)."""

    @abstractmethod
    def abort(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def finish(self, request_ids: list[str]) -> None:
        """End sequences that the frontend saw hit a stop string."""

    @property
    @abstractmethod
    def healthy(self) -> bool: ...

    @property
    @abstractmethod
    def stats(self) -> EngineStats | None: ...


class MPEngineClient(EngineClient):
    def __init__(self, config: EngineConfig, startup_timeout: float = 600.0) -> None:
        self.config = config
        self.startup_timeout = startup_timeout
        self.info = {}
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats: EngineStats | None = None
        self._dead: str | None = None
        self._last_heard = 0.0
        self._tasks: list[asyncio.Task] = []
        self._proc: Any = None
        self._dir = tempfile.TemporaryDirectory(prefix="tokenmill-")
        base = Path(self._dir.name)
        self.input_addr = f"ipc://{base / 'in'}"
        self.output_addr = f"ipc://{base / 'out'}"

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._to_engine.bind(self.input_addr)
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._from_engine.bind(self.output_addr)
        # spawn: a fresh interpreter, not a fork of an asyncio process with threads and sockets.
        self._proc = mp.get_context("spawn").Process(
            target=run_engine_process,
            args=(self.config, self.input_addr, self.output_addr),
            name="tokenmill-engine",
            daemon=True,
        )
        self._proc.start()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if await self._from_engine.poll(200):
                msg = decode_from_engine(await self._from_engine.recv())
                if isinstance(msg, Ready):
                    self.info = msg.info
                    break
                if isinstance(msg, Dead):
                    self._dead = msg.message
                    raise EngineDeadError(msg.message)
            if not self._proc.is_alive():
                self._dead = f"engine process exited with code {self._proc.exitcode} while starting"
                raise EngineDeadError(self._dead)
            if time.monotonic() > deadline:
                raise EngineDeadError(f"engine did not start within {self.startup_timeout:.0f}s")
        self._last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def _receive(self) -> None:
        while True:
            msg = decode_from_engine(await self._from_engine.recv())
            self._last_heard = time.monotonic()
            if isinstance(msg, StepOutputs):
                for out in msg.outputs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
                        if out.finish_reason is not None:
                            del self._queues[out.request_id]
                self._stats = msg.stats
            elif isinstance(msg, Rejected):
                q = self._queues.pop(msg.request_id, None)
                if q is not None:
                    q.put_nowait(RequestRejectedError(msg.message))
            elif isinstance(msg, Dead):
                self._fail(f"engine died: {msg.message}")

    async def _watch(self) -> None:
        while self._dead is None:
            await asyncio.sleep(0.25)
            if not self._proc.is_alive():
                self._fail(f"engine process exited with code {self._proc.exitcode}")

    def _fail(self, reason: str) -> None:
        self._dead = reason
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(reason))
        self._queues.clear()

    def _send(self, msg: ToEngine) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        self._to_engine.send(encode(msg))  # a PUSH send on an asyncio socket never blocks here

    def add_request(self, req: EngineRequest, queue: asyncio.Queue | None = None) -> asyncio.Queue:
        q: asyncio.Queue = queue if queue is not None else asyncio.Queue()
        self._queues[req.request_id] = q
        self._send(AddRequest(req))
        return q

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._queues.pop(rid, None)
        if request_ids and self._dead is None:
            self._send(AbortRequests(request_ids))

    def finish(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._queues.pop(rid, None)
        if request_ids and self._dead is None:
            self._send(FinishRequests(request_ids))

    @property
    def healthy(self) -> bool:
        fresh = time.monotonic() - self._last_heard < 10 * HEARTBEAT_S + 30  # a long step is not death
        return self._dead is None and self._proc is not None and self._proc.is_alive() and fresh

    @property
    def engine_pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    @property
    def stats(self) -> EngineStats | None:
        return self._stats

    @property
    def num_pending(self) -> int:
        return len(self._queues)

    async def shutdown(self, timeout: float = 5.0) -> None:
        for t in self._tasks:
            t.cancel()
        if self._proc is not None and self._proc.is_alive():
            with contextlib.suppress(Exception):
                self._to_engine.send(encode(Shutdown()))
            deadline = time.monotonic() + timeout
            while self._proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self._proc.is_alive():
                self._proc.kill()
        self._ctx.destroy(linger=0)
        self._dir.cleanup()


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"
