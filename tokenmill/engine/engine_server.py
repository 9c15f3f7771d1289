"""An engine core serving the engine protocol on a ZeroMQ socket: in a process the server launched
(ipc://), or as `tokenmill worker --listen tcp://HOST:PORT` started anywhere.

The engine binds a ROUTER socket; each frontend connects a DEALER and says Hello, and is answered
Ready (or Dead, if the engine could not load). Outputs go to the frontend that added the request;
while idle, and while a step runs (from a thread of its own: a long prefill takes seconds), every
frontend gets an empty StepOutputs heartbeat every HEARTBEAT_S, so it can tell a live engine from a hung or
vanished one. Messages are engine/protocol.py's.

A worker started on its own drains on SIGTERM: its stats say `draining` (a router sends it nothing
more), a request that still reaches it is refused with `retry` (a router sends it on), the requests it
has run to their end, and blocks a decode worker has yet to read are kept until read; then it tells its
frontends it has stopped and exits 0. A drain longer than its timeout aborts what is left; a second
SIGTERM exits at once.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine.protocol import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    AbortRequests,
    AddRequest,
    Challenge,
    Dead,
    EngineCoreOutput,
    FinishReason,
    FinishRequests,
    Hello,
    Ready,
    Rejected,
    ResetPrefixCache,
    Shutdown,
    StepOutputs,
    decode_to_engine,
    encode,
    hello_mac,
    secure_socket,
)
from tokenmill.engine.throttled_log import ThrottledWarnings
from tokenmill.worker.lifetime import die_with_parent, ignore_interrupts, interrupted

if TYPE_CHECKING:
    from tokenmill.engine.engine_core import EngineCore
    from tokenmill.engine.kv_publisher import KVEventPublisher

log = logging.getLogger(__name__)
HEARTBEAT_S = 0.5  # idle beats: a router takes a worker silent for SUSPECT_AFTER_S (2 s) out of rotation
# A step running longer than this is taken as hung: its heartbeats stop, and the frontends fail its
# requests after their heartbeat timeout (a step's token budget takes seconds, a minute on a slow CPU).
HUNG_STEP_S = 600.0
# Fault injection for tests: each engine step takes this many seconds longer (a slow forward pass).
SLOW_STEP_ENV = "TOKENMILL_TEST_SLOW_STEP_S"
FAILED_START_GRACE_S = 3.0  # how long an engine that failed to load stays to tell frontends why


def serve_engine(
    config: EngineConfig,
    address: str,
    *,
    launched_by_parent: bool = False,
    bound: Callable[[str], None] | None = None,
    secret: bytes | None = None,
    allow_shutdown: bool | None = None,
    drain_timeout_s: float = 30.0,
) -> int:
    """Load the engine, serve it at `address` until told to stop; return an exit code.

    `launched_by_parent`: the engine belongs to the process that started it and stops with it.
    `secret`: frontends must prove they know it (engine/protocol.py's Hello); messages of others are
    dropped. `allow_shutdown`: obey a frontend's Shutdown (default: only when launched by the parent).
    `bound(endpoint)`: called once the socket listens, with the endpoint it took (`tcp://host:*` asks
    for any free port, chosen by the bind itself, so two engines starting at once cannot race for one).
    `drain_timeout_s`: how long a SIGTERM lets requests finish (an engine of its own; one launched by a
    parent is stopped by it).
    """
    if launched_by_parent:
        die_with_parent()
        # A terminal's Ctrl-C reaches this process too; the parent handles it and tells this one
        # to stop (or dies, and die_with_parent ends this one): no KeyboardInterrupt here.
        ignore_interrupts()
    parent = os.getppid() if launched_by_parent else None
    if secret is not None:
        # What else this process opens to peers (KV events, the KV transfer port) reads the secret from
        # the environment, as do the worker processes of a parallel engine (Ray passes it as an argument).
        os.environ.pop(SECRET_FILE_ENV, None)
        os.environb[SECRET_ENV.encode()] = secret
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    secure_socket(sock, secret, address, server=True)
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
    if allow_shutdown is None:
        allow_shutdown = launched_by_parent
    server = _Server(engine, sock, info, parent, publisher, secret=secret, allow_shutdown=allow_shutdown)
    server.drain_timeout_s = drain_timeout_s
    if not launched_by_parent and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, server.on_sigterm)
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
            ident, *_ = sock.recv_multipart()  # whatever it sent (a stranger's frames too)
            sock.send_multipart([ident, encode(Dead(message))])


class _Server:
    def __init__(
        self,
        engine: EngineCore,
        sock: zmq.Socket,
        info: dict,
        parent: int | None,
        publisher: KVEventPublisher | None = None,
        secret: bytes | None = None,
        allow_shutdown: bool = True,
    ) -> None:
        self.engine, self.sock, self.info, self.parent = engine, sock, info, parent
        self.publisher = publisher
        self.secret, self.allow_shutdown = secret, allow_shutdown
        self.nonces: dict[bytes, bytes] = {}  # frontend identity -> the challenge it has to answer
        self.authed: set[bytes] = set()  # frontends that proved they know the secret
        self.warn = ThrottledWarnings(log)  # what anyone who connects can provoke
        self.clients: dict[bytes, float] = {}  # frontend identity -> when it was last sent anything
        self.owner: dict[str, bytes] = {}  # request id -> the frontend that added it
        self.slow_step_s = float(os.environ.get(SLOW_STEP_ENV) or 0)
        # The socket is this thread's, but lent to the heartbeat thread while a step runs (a long
        # prefill takes seconds): `io` is held by whichever uses it. A ZeroMQ socket may pass between
        # threads through a full memory barrier, which taking a lock is.
        self.io = threading.Lock()
        self.stepping_since: float | None = None  # time.monotonic() the running step began
        self.last_stats = engine.stats()  # what heartbeats during a step carry
        self._stopping = threading.Event()
        self.drain_timeout_s = 30.0
        self.drain_asked = False  # set by the SIGTERM handler; the loop starts the drain
        self.draining_since: float | None = None

    def on_sigterm(self, signum: int, frame: object) -> None:
        if self.drain_asked:  # a second signal: stop now
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        self.drain_asked = True

    def _drained(self, now: float, outputs: list[EngineCoreOutput]) -> bool:
        """Start a drain that was asked for; True once it is over (nothing left, or out of time)."""
        engine = self.engine
        if self.draining_since is None:
            self.draining_since = now
            self.info["draining"] = True  # a front that says Hello from now on is told at once
            n = len(getattr(self._scheduler(), "requests", ()))
            log.info("SIGTERM: draining (%d requests to finish, at most %.0fs)", n, self.drain_timeout_s)
            # Every front hears it now (a router stops sending here before the drain can end), even if
            # nothing is left to finish: its leaving is then planned, not a loss.
            self.last_stats = engine.stats()
            self.last_stats.draining = True
            self.broadcast(StepOutputs([], self.last_stats))
        if not engine.has_unfinished() and not self._holding():
            log.info("drained in %.1fs: stopping", now - self.draining_since)
            return True
        if now - self.draining_since > self.drain_timeout_s:
            requests = getattr(self._scheduler(), "requests", {})
            # Requests that have no token yet are handed back (a router sends them elsewhere); the rest end.
            fresh = [rid for rid, r in requests.items() if not r.output_token_ids]
            left = [rid for rid in requests if rid not in fresh]
            log.warning(
                "the drain timed out after %.0fs: %d requests handed back, %d aborted",
                self.drain_timeout_s, len(fresh), len(left),
            )  # fmt: skip
            engine.abort(fresh)
            for rid in fresh:
                ident = self.owner.pop(rid, None)
                if ident is not None:
                    self.send(
                        ident, Rejected(rid, "the worker stopped before this request began", retry=True)
                    )
            outputs.extend(engine.abort(left))
            self.deliver(outputs, now)
            outputs.clear()
            return True
        return False

    def _holding(self) -> bool:
        """Finished requests' blocks kept for a reader (a decode worker) that has not said it is done."""
        return bool(getattr(self._scheduler(), "held", None))

    def _scheduler(self) -> object:
        """The engine's scheduler (None for a stand-in engine that has none)."""
        return getattr(self.engine, "scheduler", None)

    def send(self, ident: bytes, msg: Ready | StepOutputs | Rejected | Dead | Challenge) -> None:
        if isinstance(msg, StepOutputs):
            msg.sent_at = time.monotonic()
        with contextlib.suppress(zmq.ZMQError):  # a frontend that left: its messages are dropped
            self.sock.send_multipart([ident, encode(msg)], zmq.NOBLOCK)

    def broadcast(self, msg: StepOutputs | Dead) -> None:
        for ident in self.clients:
            self.send(ident, msg)

    def loop(self) -> None:
        with self._heartbeats():
            self._loop()

    @contextlib.contextmanager
    def _heartbeats(self) -> Iterator[None]:
        """This thread holds the socket (but for steps), the heartbeat thread runs, until the loop ends."""
        beat = threading.Thread(target=self._beat_during_steps, name="tokenmill-heartbeat", daemon=True)
        self.io.acquire()
        beat.start()
        try:
            yield
        finally:
            self._stopping.set()
            self.io.release()
            beat.join()

    def _beat_during_steps(self) -> None:
        """While a step runs, each frontend still gets the idle heartbeat every HEARTBEAT_S (with the stats of
        the last step): a long step is not a silent engine."""
        while not self._stopping.wait(HEARTBEAT_S / 4):
            with self.io:
                since, now = self.stepping_since, time.monotonic()
                if since is None or now - since > HUNG_STEP_S:
                    continue
                for ident, last in list(self.clients.items()):
                    if now - last >= HEARTBEAT_S:
                        self.send(ident, StepOutputs([], self.last_stats))
                        self.clients[ident] = now

    def _step(self) -> list[EngineCoreOutput]:
        """One engine step, the socket lent to the heartbeat thread meanwhile."""
        self.stepping_since = time.monotonic()
        self.io.release()
        try:
            if self.slow_step_s:
                time.sleep(self.slow_step_s)
            return self.engine.step()
        finally:
            self.io.acquire()
            self.stepping_since = None

    def _loop(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished()
            outputs: list[EngineCoreOutput] = []
            if self.drain_asked and self._drained(time.monotonic(), outputs):
                self.broadcast(Dead("the worker was stopped (SIGTERM) and has drained"))
                return
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
            # Steps also run while blocks are held for a reader: its "done" (and the holds' expiry) is
            # taken in a step, and a draining prefill worker waits for it.
            if engine.has_unfinished() or self._holding():
                outputs.extend(self._step())
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
        # RecursionError: msgspec's answer to nesting deeper than the interpreter's recursion limit (in
        # free-form fields such as kv_transfer, or in unknown fields it skips); ~1 KB of brackets in
        # any frame, even an unauthenticated one, must cost that frame, not the engine loop.
        except (msgspec.DecodeError, ValueError, RecursionError) as e:
            self.warn.warning("dropped a message the engine protocol does not allow: %s", e)
            return True
        if isinstance(msg, Hello):
            if self.secret is not None and not self.authenticate(ident, msg):
                return True
            self.clients[ident] = time.monotonic()
            self.send(ident, Ready(self.info))
        elif self.secret is not None and ident not in self.authed:
            self.warn.warning("dropped a %s from a frontend that has not proved it knows the secret",
                              type(msg).__name__)  # fmt: skip
        elif isinstance(msg, AddRequest):
            req = msg.request
            if self.draining_since is not None:
                self.send(
                    ident, Rejected(req.request_id, "the worker is shutting down (draining)", retry=True)
                )
                return True
            if self.owner.get(req.request_id, ident) != ident:  # another frontend's request id
                self.send(ident, Rejected(req.request_id, "request id already in use"))
                return True
            try:
                self.engine.add_request(req)
                self.owner[req.request_id] = ident
            except ValueError as e:
                self.send(ident, Rejected(req.request_id, str(e)))
            except Exception as e:  # a request the checks let through costs that request, not the engine
                log.exception("could not add request %s", req.request_id)
                why = f"the engine could not add it ({type(e).__name__})"
                self.send(ident, Rejected(req.request_id, why))
        elif isinstance(msg, AbortRequests):  # a frontend ends only requests it added
            outputs.extend(self.engine.abort([r for r in msg.request_ids if self.owner.get(r) == ident]))
        elif isinstance(msg, FinishRequests):
            mine = [r for r in msg.request_ids if self.owner.get(r) == ident]
            self.engine.finish(mine, FinishReason.STOP)
            for rid in mine:
                self.owner.pop(rid, None)
        elif isinstance(msg, ResetPrefixCache):
            self.engine.reset_prefix_cache()
        elif isinstance(msg, Shutdown):
            if self.allow_shutdown:
                return False
            self.warn.warning("ignored a Shutdown from a frontend: this engine stops only by a signal")
        return True

    def authenticate(self, ident: bytes, msg: Hello) -> bool:
        """A Hello without proof gets a Challenge; one with proof is checked against it (Dead if wrong)."""
        self.authed.discard(ident)  # a Hello starts over: it proves the secret again or has no say
        if not msg.auth:
            if len(self.nonces) >= 4096:  # frontends that never answer: forget the oldest
                del self.nonces[next(iter(self.nonces))]
            nonce = self.nonces[ident] = secrets.token_bytes(32)
            self.send(ident, Challenge(nonce))
            return False
        nonce = self.nonces.pop(ident, None)
        if nonce is None or not hmac.compare_digest(msg.auth, hello_mac(self.secret or b"", nonce)):
            self.warn.warning("refused a frontend that does not know the shared secret")
            self.send(ident, Dead("not authorized: the engine's shared secret is wrong or missing"))
            return False
        self.authed.add(ident)
        return True

    def deliver(self, outputs: list[EngineCoreOutput], now: float) -> None:
        """Each frontend gets its requests' outputs with the stats; one with nothing new gets the stats
        alone every HEARTBEAT_S (the heartbeat)."""
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
        stats = self.last_stats = self.engine.stats()
        stats.draining = self.draining_since is not None
        for ident, outs in by_client.items():
            self.send(ident, StepOutputs(outs, stats))
            self.clients[ident] = now
        for ident in due:
            self.send(ident, StepOutputs([], stats))
            self.clients[ident] = now
