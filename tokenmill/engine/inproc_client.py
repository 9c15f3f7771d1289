"""An EngineClient over an engine core in this very process: what the offline `LLM` runs on.

The same asyncio frontend (AsyncLLM: n fan-out, stop strings, detokenization, abort) drives it as
drives an engine process or a remote worker; only the transport differs. Steps run on the event loop
itself (a step blocks it): the offline API has no other I/O to serve, and no thread or process hop
costs it anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from tokenmill.engine.client import EngineClient, EngineDeadError, RequestRejectedError
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.protocol import EngineCoreOutput, EngineRequest, EngineStats, FinishReason

log = logging.getLogger(__name__)


class InprocEngineClient(EngineClient):
    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.info = engine.describe()
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._dead: str | None = None

    async def start(self) -> None:
        """Start stepping on the running event loop (again, if an earlier loop was closed)."""
        if self._task is not None and not self._task.done():
            return
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        assert self._wake is not None
        engine = self.engine
        while True:
            if not engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a worker died: no step can run any more
                log.exception("the engine failed")
                self._fail(f"engine died: {e}", e)  # the caller sees the engine's own error
                return
            self._deliver(outputs)
            # Let every consumer take its outputs (and report stop strings) before the next step.
            await asyncio.sleep(0)

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
                if out.finish_reason is not None:
                    del self._queues[out.request_id]

    def _fail(self, reason: str, error: Exception | None = None) -> None:
        self._dead = reason
        for q in self._queues.values():
            q.put_nowait(error if error is not None else EngineDeadError(reason))
        self._queues.clear()

    def add_request(self, req: EngineRequest, queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """Raises RequestRejectedError at once (not through the queue) for a request the engine refuses,
        so a batch can be refused whole before any of it runs."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        q: asyncio.Queue = queue if queue is not None else asyncio.Queue()
        try:
            self.engine.add_request(req)
        except ValueError as e:
            raise RequestRejectedError(str(e)) from None
        self._queues[req.request_id] = q
        if self._wake is not None:
            self._wake.set()
        return q

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._queues.pop(rid, None)
        if request_ids and self._dead is None:
            self.engine.abort(request_ids)

    def finish(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._queues.pop(rid, None)
        if request_ids and self._dead is None:
            self.engine.finish(request_ids, FinishReason.STOP)

    def reset_prefix_cache(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        self.engine.reset_prefix_cache()

    @property
    def healthy(self) -> bool:
        return self._dead is None

    @property
    def stats(self) -> EngineStats | None:
        return self.engine.stats()

    async def stop_loop(self) -> None:
        """Stop stepping (the engine and its requests stay; start() resumes)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def shutdown(self) -> None:
        await self.stop_loop()
        self.engine.shutdown()
