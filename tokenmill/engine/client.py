"""EngineClient: how an asyncio frontend talks to an engine core, wherever the core runs.

`ZmqEngineClient` talks the engine protocol (engine/protocol.py) to an engine served at an address:
ipc:// for one this host launched, tcp:// for a worker started elsewhere (`tokenmill worker --listen`).
`MPEngineClient` is that client plus `LocalEngineLauncher`, which starts the engine in its own process,
so HTTP handling, tokenization and detokenization never wait behind a forward pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.engine.engine_clock import EngineClock
from tokenmill.engine.protocol import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    AbortRequests,
    AddRequest,
    Challenge,
    Dead,
    EngineRequest,
    EngineStats,
    FinishRequests,
    Hello,
    Ready,
    Rejected,
    ResetPrefixCache,
    Shutdown,
    StepOutputs,
    ToEngine,
    decode_from_engine,
    encode,
    hello_mac,
    secure_socket,
    worker_secret,
)
from tokenmill.worker.lifetime import interrupts_held

# Contexts of clients not yet shut down. A context collected as garbage runs zmq_ctx_term in its
# __del__, which waits for sockets the collector has already cut loose: it would hang the process (a
# client dropped without shutdown(), say after an exception). Held here, a forgotten one only leaks.
_LIVE_CONTEXTS: set[zmq.asyncio.Context] = set()


def new_context() -> zmq.asyncio.Context:
    ctx = zmq.asyncio.Context()
    # Messages to an engine that is gone are worth nothing: never wait to deliver them.
    ctx.linger = 0
    _LIVE_CONTEXTS.add(ctx)
    return ctx


def destroy_context(ctx: zmq.asyncio.Context) -> None:
    ctx.destroy(linger=0)
    _LIVE_CONTEXTS.discard(ctx)


HEARTBEAT_TIMEOUT_ENV = "TOKENMILL_ENGINE_HEARTBEAT_TIMEOUT_S"


def default_heartbeat_timeout() -> float:
    """How long an engine may stay silent before its requests fail: $TOKENMILL_ENGINE_HEARTBEAT_TIMEOUT_S
    seconds, else 40. Engines heartbeat every half second, during steps too (engine_server.py)."""
    return float(os.environ.get(HEARTBEAT_TIMEOUT_ENV) or 40.0)


class EngineDeadError(RuntimeError):
    """The engine process is gone (or never came up); in-flight requests cannot complete."""


class WorkerDrainingError(EngineDeadError):
    """The engine is shutting down and takes no new requests (it finishes those it has): another may."""


class RequestRejectedError(ValueError):
    """The engine refused a request (e.g. a prompt longer than the context)."""


class RequestFailedError(RuntimeError):
    """The engine failed on this request (details in its log, under the request id); others go on."""


class RequestInvalidError(RequestFailedError):
    """The request failed by its own doing, found only while it ran (its grammar allows no continuation):
    a client error, the message for the client."""


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

    def reset_prefix_cache(self) -> None:
        """The engine forgets the content of its free cached blocks (an operator's /flush_cache)."""
        raise NotImplementedError(f"{type(self).__name__} cannot reset its engine's cache")

    @property
    @abstractmethod
    def healthy(self) -> bool: ...

    @property
    @abstractmethod
    def stats(self) -> EngineStats | None: ...


class ZmqEngineClient(EngineClient):
    """Talks the engine protocol to an engine served at `address` (ipc:// on this host, tcp:// from
    anywhere). It does not start the engine: see MPEngineClient for one it launches itself.

    An engine that stops answering (no heartbeat for `heartbeat_timeout` seconds; it heartbeats during
    long steps too) is hung or out of reach: its requests fail rather than wait forever, and it is out
    of service until it speaks again. Only its exit, a lost connection or its Dead end it for good.
    """

    def __init__(
        self,
        address: str,
        startup_timeout: float = 600.0,
        heartbeat_timeout: float | None = None,
        launcher: LocalEngineLauncher | None = None,
        secret: bytes | None = None,
    ) -> None:
        """`secret`: the workers' shared secret, for an engine that asks for it (default:
        protocol.worker_secret(), from the environment).
        `launcher`: the engine's process, when this client's owner started it: its exit is noticed
        at once, and shutdown() stops it. `heartbeat_timeout`: None reads default_heartbeat_timeout()."""
        self.address = address
        self.secret = secret if secret is not None else worker_secret()
        self.launcher = launcher
        self.startup_timeout = startup_timeout
        if heartbeat_timeout is None:
            heartbeat_timeout = default_heartbeat_timeout()
        self.heartbeat_timeout = heartbeat_timeout
        self.info = {}
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats: EngineStats | None = None
        self._dead: str | None = None
        self._silent: str | None = None  # why the engine is out of service until it speaks again
        self._last_heard = 0.0
        self.clock = EngineClock()  # the engine's timestamps on this process's clock
        self._tasks: list[asyncio.Task] = []
        self._ctx: zmq.asyncio.Context | None = None

    def _process_exit(self) -> str | None:
        """Why the engine's process is gone, when this client knows its process (else None)."""
        return None if self.launcher is None else self.launcher.exit_reason()

    async def start(self) -> None:
        self._ctx = new_context()
        self._sock = self._ctx.socket(zmq.DEALER)
        secure_socket(self._sock, self.secret, self.address, server=False)
        self._sock.connect(self.address)
        self._sock.send(encode(Hello()))
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if await self._sock.poll(200):
                msg = decode_from_engine(await self._sock.recv())
                if isinstance(msg, Ready):
                    self.info = msg.info
                    break
                if isinstance(msg, Challenge):
                    if self.secret is None:
                        self._dead = (
                            f"the engine at {self.address} wants the workers' shared secret: set "
                            f"{SECRET_ENV} or {SECRET_FILE_ENV}"
                        )
                        raise EngineDeadError(self._dead)
                    self._sock.send(encode(Hello(hello_mac(self.secret, msg.nonce))))
                if isinstance(msg, Dead):
                    self._dead = msg.message
                    raise EngineDeadError(msg.message)
            if (gone := self._process_exit()) is not None:
                self._dead = f"{gone} while starting"
                raise EngineDeadError(self._dead)
            if time.monotonic() > deadline:
                hint = ""  # a worker with a secret finishes no handshake with a front that lacks it
                if self.secret is None and self.address.startswith("tcp://"):
                    hint = f" (if it has a shared secret, set {SECRET_ENV} or {SECRET_FILE_ENV} here too)"
                raise EngineDeadError(
                    f"no engine answered at {self.address} within {self.startup_timeout:.0f}s{hint}"
                )
        self._last_heard = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._receive()),
            asyncio.create_task(self._watch()),
            asyncio.create_task(self._watch_connection()),
        ]

    async def _receive(self) -> None:
        while True:
            msg = decode_from_engine(await self._sock.recv())
            self._last_heard = time.monotonic()
            self._silent = None  # an engine that speaks is back in service
            if isinstance(msg, StepOutputs):
                shift = self.clock.observe(msg.sent_at, self._last_heard)
                for out in msg.outputs:
                    if shift:
                        EngineClock.translate(out, shift)
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
                        if out.finish_reason is not None:
                            del self._queues[out.request_id]
                self._stats = msg.stats
            elif isinstance(msg, Rejected):
                q = self._queues.pop(msg.request_id, None)
                if q is not None:
                    q.put_nowait(
                        WorkerDrainingError(msg.message) if msg.retry else RequestRejectedError(msg.message)
                    )
            elif isinstance(msg, Dead):
                self._fail(f"engine died: {msg.message}")

    async def _watch(self) -> None:
        while self._dead is None:
            await asyncio.sleep(0.25)
            if (gone := self._process_exit()) is not None:
                self._fail(gone)
            elif self._silent is None and time.monotonic() - self._last_heard > self.heartbeat_timeout:
                why = f"no word from the engine at {self.address} for {self.heartbeat_timeout:.0f}s"
                self._go_silent(why)

    def _go_silent(self, reason: str) -> None:
        """The engine is hung or out of reach, but maybe not gone: its requests fail now (and are
        aborted there, should it come back), and it is out of service until its next message."""
        self._silent = reason
        ids = list(self._queues)
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(reason))
        self._queues.clear()
        if ids:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send(encode(AbortRequests(ids)))

    async def _watch_connection(self) -> None:
        """A dropped connection (the engine's process died, its host closed it) fails requests at
        once; a heartbeat timeout would take far longer."""
        mon = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while self._dead is None:
                event = await mon.recv_multipart()
                if int.from_bytes(event[0][:2], "little") == zmq.EVENT_DISCONNECTED:
                    self._fail(f"the connection to the engine at {self.address} was lost")
        finally:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            mon.close(linger=0)

    def fail(self, reason: str) -> None:
        """Declare the engine dead: every pending request gets EngineDeadError."""
        self._fail(reason)

    def _fail(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(reason))
        self._queues.clear()

    def _send(self, msg: ToEngine) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        self._sock.send(encode(msg))  # a DEALER send on an asyncio socket never blocks here

    def add_request(self, req: EngineRequest, queue: asyncio.Queue | None = None) -> asyncio.Queue:
        if self._silent is not None and self._dead is None:
            raise EngineDeadError(self._silent)  # it would wait for an engine that may never answer
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

    def reset_prefix_cache(self) -> None:
        self._send(ResetPrefixCache())

    @property
    def healthy(self) -> bool:
        fresh = time.monotonic() - self._last_heard < self.heartbeat_timeout  # a long step is not death
        return self._dead is None and self._silent is None and self._process_exit() is None and fresh

    @property
    def last_heard(self) -> float:
        """time.monotonic() of the engine's last message (outputs, or the idle heartbeat)."""
        return self._last_heard

    @property
    def engine_pid(self) -> int | None:
        return self.info.get("pid")

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is out of service: gone for good, or silent until it speaks again."""
        return self._dead or self._silent

    @property
    def stats(self) -> EngineStats | None:
        return self._stats

    @property
    def num_pending(self) -> int:
        return len(self._queues)

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Leave the engine; an engine this client does not own keeps running for others."""
        # An engine this client's owner launched is told to stop, and waited for before the socket
        # closes (closing drops unsent messages: linger 0).
        launcher = self.launcher
        told = False
        # (a silent engine is not told: it may be back soon, and serve another client of its launcher)
        alive = self._ctx is not None and self.dead_reason is None and self._process_exit() is None
        if launcher is not None and alive:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send(encode(Shutdown()))
                told = True
        for t in self._tasks:
            t.cancel()
        if told:
            await launcher.wait_exit(timeout)  # type: ignore[union-attr]
        if self._ctx is not None:
            destroy_context(self._ctx)


class LocalEngineLauncher:
    """Starts an engine process on this host serving at an ipc:// address, and stops it."""

    def __init__(self, config: EngineConfig) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="tokenmill-")
        self.address = f"ipc://{Path(self._dir.name) / 'engine'}"
        self.config = config
        self.proc: Any = None

    def start(self) -> None:
        # spawn: a fresh interpreter, not a fork of an asyncio process with threads and sockets.
        self.proc = mp.get_context("spawn").Process(
            target=_engine_process_main,
            args=(self.config, self.address),
            name="tokenmill-engine",
            daemon=True,  # its rank processes (parallelism) are started by subprocess: allowed
        )
        with interrupts_held():  # a Ctrl-C while it imports is this process's to act on, not its
            self.proc.start()

    def exit_reason(self) -> str | None:
        if self.proc is not None and not self.proc.is_alive():
            return f"engine process exited with code {self.proc.exitcode}"
        return None

    async def wait_exit(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the process to exit; True if it has."""
        deadline = time.monotonic() + timeout
        while self.proc is not None and self.proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.proc is None or not self.proc.is_alive()

    async def stop(self, timeout: float) -> None:
        """Wait for the process to exit (it was told to), kill it past `timeout`, remove its folder."""
        if not await self.wait_exit(timeout):
            self.proc.kill()
        self._dir.cleanup()


def _engine_process_main(config: EngineConfig, address: str) -> None:
    from tokenmill.engine.engine_server import serve_engine

    raise SystemExit(serve_engine(config, address, launched_by_parent=True))


class MPEngineClient(ZmqEngineClient):
    """The server's default: an engine process of its own, launched here and talked to over ipc://."""

    def __init__(self, config: EngineConfig, startup_timeout: float = 600.0) -> None:
        launcher = LocalEngineLauncher(config)
        super().__init__(launcher.address, startup_timeout, launcher=launcher)

    async def start(self) -> None:
        self.launcher.start()
        await super().start()

    @property
    def engine_pid(self) -> int | None:
        return None if self.launcher.proc is None else self.launcher.proc.pid

    async def shutdown(self, timeout: float = 5.0) -> None:
        await super().shutdown(timeout)
        await self.launcher.stop(timeout)  # gone by now, unless it would not stop: then killed


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"
