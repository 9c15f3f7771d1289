"""An engine core serving the engine protocol on a ZeroMQ socket: in a process the server launched
(ipc://), or as `tokenmill worker --listen tcp://HOST:PORT` started anywhere.

The engine binds a ROUTER socket; each frontend connects a DEALER and says Hello, and is answered
Ready (or Dead, if the engine could not load). Outputs go to the frontend that added the request;
while idle every frontend gets an empty StepOutputs heartbeat each second, so it can tell a live
engine from a hung or vanished one. Messages are engine/protocol.py's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine.protocol import (
    AbortRequests,
    AddRequest,
    Dead,
    EngineCoreOutput,
    FinishReason,
    FinishRequests,
    Hello,
    Ready,
    Rejected,
    Shutdown,
    StepOutputs,
    decode_to_engine,
    encode,
)
from tokenmill.worker.lifetime import die_with_parent, ignore_interrupts, interrupted

if TYPE_CHECKING:
    from tokenmill.engine.engine_core import EngineCore
    from tokenmill.engine.kv_publisher import KVEventPublisher

log = logging.getLogger(__name__)
HEARTBEAT_S = 1.0
FAILED_START_GRACE_S = 3.0  # how long an engine that failed to load stays to tell frontends why


def serve_engine(
    config: EngineConfig,
    address: str,
    *,
    launched_by_parent: bool = False,
    bound: Callable[[str], None] | None = None,
) -> int:
    """Load the engine, serve it at `address` until told to stop; return an exit code.

    `launched_by_parent`: the engine belongs to the process that started it and stops with it.
    `bound(endpoint)`: called once the socket listens, with the endpoint it took (`tcp://host:*` asks
    for any free port, chosen by the bind itself, so two engines starting at once cannot race for one).
    """
    if launched_by_parent:
        die_with_parent()
        # A terminal's Ctrl-C reaches this process too; the parent handles it and tells this one
        # to stop (or dies, and die_with_parent ends this one): no KeyboardInterrupt here.
        ignore_interrupts()
    parent = os.getppid() if launched_by_parent else None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    if bound is not None:
        bound(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
    from tokenmill.engine.engine_core import EngineCore  # torch and the model: only in this process

    try:
        engine = EngineCore(config)
    except Exception as e:  # report why, rather than dying silently
        _log_start_failure(e, launched_by_parent)
        _refuse(sock, f"engine failed to start: {e}")
        sock.close(linger=500)
        return 1
    publisher = None
    info = engine.describe()
    if config.kv_events.enable_kv_events:
        from tokenmill.engine.kv_publisher import KVEventPublisher

        try:
            publisher = KVEventPublisher(config.kv_events, ctx)
        except zmq.ZMQError as e:  # e.g. its port taken: tell the frontends rather than leave them waiting
            log.exception("the KV event publisher failed to start")
            _refuse(sock, f"engine failed to start: KV events at {config.kv_events.kv_events_endpoint}: {e}")
            sock.close(linger=500)
            return 1
        info["kv_events"] = publisher.describe()
    server = _Server(engine, sock, info, parent, publisher)
    try:
        server.loop()
    except Exception as e:
        # The traceback goes to this process's log; clients are told only that the engine failed.
        log.exception("the engine loop failed")
        server.broadcast(Dead(f"the engine process failed ({type(e).__name__}); see its log"))
        return 1
    finally:
        engine.shutdown()  # worker processes of a parallel engine stop with it
        if publisher is not None:
            publisher.close()
        sock.close(linger=500)
    return 0


def _log_start_failure(e: Exception, launched_by_parent: bool) -> None:
    """A bad model file or setting (ValueError, OSError) is the user's to fix, and its message says
    what: one line, or none where the parent that launched this engine prints it (the frontends get
    it as Dead). Anything else is a fault, logged with its traceback."""
    if interrupted():  # a Ctrl-C stopped the load (a compiler it ran): not a fault, nothing to say
        return
    if isinstance(e, (ValueError, OSError)):
        log.debug("the engine failed to start", exc_info=e)
        if not launched_by_parent:
            log.error("the engine failed to start: %s", e)
        return
    log.error("the engine failed to start", exc_info=e)


def _refuse(sock: zmq.Socket, message: str) -> None:
    """Answer every frontend that says Hello within a short grace period with Dead(message)."""
    deadline = time.monotonic() + FAILED_START_GRACE_S
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000)):
            ident, _ = sock.recv_multipart()
            sock.send_multipart([ident, encode(Dead(message))])


class _Server:
    def __init__(
        self,
        engine: EngineCore,
        sock: zmq.Socket,
        info: dict,
        parent: int | None,
        publisher: KVEventPublisher | None = None,
    ) -> None:
        self.engine, self.sock, self.info, self.parent = engine, sock, info, parent
        self.publisher = publisher
        self.clients: dict[bytes, float] = {}  # frontend identity -> when it was last sent anything
        self.owner: dict[str, bytes] = {}  # request id -> the frontend that added it

    def send(self, ident: bytes, msg: Ready | StepOutputs | Rejected | Dead) -> None:
        with contextlib.suppress(zmq.ZMQError):  # a frontend that left: its messages are dropped
            self.sock.send_multipart([ident, encode(msg)], zmq.NOBLOCK)

    def broadcast(self, msg: StepOutputs | Dead) -> None:
        for ident in self.clients:
            self.send(ident, msg)

    def loop(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished()
            outputs: list[EngineCoreOutput] = []
            if self.sock.poll(0 if busy else int(HEARTBEAT_S * 1000)):
                while True:
                    try:
                        ident, data = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except ValueError:
                        continue  # not [identity, message]
                    if not self.handle(ident, data, outputs):
                        return
            if engine.has_unfinished():
                outputs.extend(engine.step())
            if self.publisher is not None:
                self.publisher.publish(engine.kv.take_events())
            now = time.monotonic()
            if self.parent is not None and not busy and os.getppid() != self.parent:
                return  # the frontend is gone (elsewhere than Linux, where PDEATHSIG would not fire)
            self.deliver(outputs, now)

    def handle(self, ident: bytes, data: bytes, outputs: list[EngineCoreOutput]) -> bool:
        """Act on one message; False when told to shut down."""
        try:
            msg = decode_to_engine(data)
        except (msgspec.DecodeError, ValueError) as e:
            log.warning("dropped a message the engine protocol does not allow: %s", e)
            return True
        if isinstance(msg, Hello):
            self.clients[ident] = time.monotonic()
            self.send(ident, Ready(self.info))
        elif isinstance(msg, AddRequest):
            req = msg.request
            try:
                self.engine.add_request(req)
                self.owner[req.request_id] = ident
            except ValueError as e:
                self.send(ident, Rejected(req.request_id, str(e)))
        elif isinstance(msg, AbortRequests):
            outputs.extend(self.engine.abort(msg.request_ids))
        elif isinstance(msg, FinishRequests):
            self.engine.finish(msg.request_ids, FinishReason.STOP)
            for rid in msg.request_ids:
                self.owner.pop(rid, None)
        elif isinstance(msg, Shutdown):
            return False
        return True

    def deliver(self, outputs: list[EngineCoreOutput], now: float) -> None:
        """Each frontend gets its requests' outputs with the stats; one with nothing new gets the stats
        alone once a second (the heartbeat)."""
        by_client: dict[bytes, list[EngineCoreOutput]] = {}
        for out in outputs:
            ident = self.owner.get(out.request_id)
            if out.finish_reason is not None:
                self.owner.pop(out.request_id, None)
            if ident is not None:
                by_client.setdefault(ident, []).append(out)
        due = [c for c, t in self.clients.items() if c not in by_client and now - t >= HEARTBEAT_S]
        if not by_client and not due:
            return
        stats = self.engine.stats()
        for ident, outs in by_client.items():
            self.send(ident, StepOutputs(outs, stats))
            self.clients[ident] = now
        for ident in due:
            self.send(ident, StepOutputs([], stats))
            self.clients[ident] = now
