"""The engine core in its own process, driven over ZeroMQ (msgpack messages).

Frontend -> engine (PUSH/PULL): AddRequest | AbortRequests | FinishRequests | Shutdown.
Engine -> frontend (PUSH/PULL): Ready | StepOutputs | Rejected | Dead (engine/protocol.py). While idle
the engine sends an empty StepOutputs heartbeat every second, so the frontend can tell a live engine
from a hung one.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine.protocol import (
    AbortRequests,
    AddRequest,
    Dead,
    FinishReason,
    FinishRequests,
    Ready,
    Rejected,
    Shutdown,
    StepOutputs,
    decode_to_engine,
    encode,
)

if TYPE_CHECKING:
    from tokenmill.engine.engine_core import EngineCore

log = logging.getLogger(__name__)
HEARTBEAT_S = 1.0


def run_engine_process(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """Entry point of the engine process: load, announce, then loop until told to stop."""
    _die_with_parent()
    parent = os.getppid()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(output_addr)
    from tokenmill.engine.engine_core import EngineCore  # torch and the model: only in this process

    try:
        engine = EngineCore(config)
    except Exception as e:  # report why, rather than dying silently
        outbox.send(encode(Dead(f"engine failed to start: {e}")))
        time.sleep(0.2)
        return
    info = {
        "max_model_len": engine.max_model_len,
        "vocab_size": engine.model_config.vocab_size,
        "num_blocks": engine.kv.pool.num_blocks,
        "block_size": engine.block_size,
        "load_seconds": engine.load_seconds,
    }
    outbox.send(encode(Ready(info)))
    try:
        _loop(engine, inbox, outbox, parent)
    except Exception as e:
        # The traceback goes to this process's log; clients are told only that the engine failed.
        log.exception("the engine loop failed")
        outbox.send(encode(Dead(f"the engine process failed ({type(e).__name__}); see the server log")))
        raise
    finally:
        engine.shutdown()  # worker processes of a parallel engine stop with it
        outbox.close(linger=500)
        inbox.close(linger=0)


def _die_with_parent() -> None:
    """Linux: have the kernel stop this process when the frontend dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _loop(engine: EngineCore, inbox: zmq.Socket, outbox: zmq.Socket, parent: int) -> None:
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    last_sent = 0.0
    while True:
        busy = engine.has_unfinished()
        events = dict(poller.poll(0 if busy else int(HEARTBEAT_S * 1000)))
        outputs = []
        if inbox in events:
            while True:
                try:
                    data = inbox.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = decode_to_engine(data)
                except (msgspec.DecodeError, ValueError) as e:
                    log.warning("dropped a message the engine protocol does not allow: %s", e)
                    continue
                if isinstance(msg, AddRequest):
                    req = msg.request
                    try:
                        engine.add_request(req)
                    except ValueError as e:
                        outbox.send(encode(Rejected(req.request_id, str(e))))
                elif isinstance(msg, AbortRequests):
                    outputs.extend(engine.abort(msg.request_ids))
                elif isinstance(msg, FinishRequests):
                    engine.finish(msg.request_ids, FinishReason.STOP)
                elif isinstance(msg, Shutdown):
                    return
        if engine.has_unfinished():
            outputs.extend(engine.step())
        now = time.monotonic()
        if not busy and os.getppid() != parent:
            return  # the frontend is gone (elsewhere than Linux, where PDEATHSIG would not fire)
        if outputs or now - last_sent >= HEARTBEAT_S:
            outbox.send(encode(StepOutputs(outputs, engine.stats())))
            last_sent = now
