"""Decoupled responses: a request answered by any number of responses, sent from any thread.

A decoupled model (`model_transaction_policy { decoupled: true }`) answers through its request's
response sender, during execute() or later from a thread of its own; the last response carries the
FINAL flag (with or without outputs). The responses travel through a `ResponseStream`, read on the
server's event loop by whichever front asked: gRPC ModelStreamInfer, HTTP generate_stream, an
ensemble, or a BLS call from another model. A model that fails before its FINAL flag ends its stream
with that error, so no reader waits for a response that cannot come.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

Outputs = dict[str, np.ndarray]


class StreamClosed(Exception):
    """A response sent after the FINAL flag (the model's mistake, raised in the model's thread)."""


@dataclass
class StreamItem:
    """One response: outputs, or an error message; `final` ends the request's responses. A final item
    with neither is the FINAL flag sent alone."""

    outputs: Outputs | None = None
    error: str | None = None
    final: bool = False
    status: int = 500  # an error's HTTP status where one is said: 400 for the request's own fault


class ResponseStream:
    """The responses of one request, in the order they were sent."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._lock = threading.Lock()  # senders run on model threads; the FINAL flag is taken once
        self._closed = False
        self.cancelled = False

    @property
    def closed(self) -> bool:
        return self._closed

    def send(self, item: StreamItem) -> None:
        with self._lock:
            if self._closed:
                raise StreamClosed("this request's responses are complete: the FINAL flag was already sent")
            self._closed = item.final
            # Scheduled under the lock (from the loop's own thread too): callbacks run in the order
            # scheduled, so responses from several threads keep the order their sends took the lock.
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def fail(self, message: str, status: int = 500) -> None:
        """End the stream with an error, unless it has already ended (then there is no one to tell)."""
        with contextlib.suppress(StreamClosed):
            self.send(StreamItem(error=message, final=True, status=status))

    def cancel(self) -> None:
        """The reader is gone: the model sees it in is_cancelled() and may stop early."""
        self.cancelled = True

    async def __aiter__(self) -> AsyncIterator[StreamItem]:
        while True:
            item = await self.queue.get()
            yield item
            if item.final:
                return
