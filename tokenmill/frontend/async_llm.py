"""The asyncio frontend over an EngineClient: prompt ids in, RequestOutputs (with text) streamed out.

Detokenization, stop strings and the n sequences of a request are handled here, in the frontend
process; the engine core only ever sees token ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill import tracing
from tokenmill.config import EngineConfig
from tokenmill.engine.client import (
    EngineClient,
    MPEngineClient,
    RequestFailedError,
    RequestInvalidError,
    ZmqEngineClient,
)
from tokenmill.engine.protocol import EngineCoreOutput, EngineRequest, FinishReason
from tokenmill.frontend.output_processor import OutputProcessor
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer.tokenizer import Tokenizer
from tokenmill.weights import catalog


class OutputQueue(asyncio.Queue):
    """The queue a request's engine outputs arrive on; it notes when the first of them has arrived,
    read or not."""

    arrived = False

    def put_nowait(self, item: Any) -> None:
        if not isinstance(item, BaseException):
            self.arrived = True
        super().put_nowait(item)


@dataclass
class Submitted:
    """Requests handed to the engine (one, or a batch added to the same Submitted): their frontend
    state and the one queue their engine outputs arrive on."""

    request_id: str  # the first one's
    proc: OutputProcessor
    queue: OutputQueue
    live: set[str]  # engine ids of their sequences still running

    @property
    def started(self) -> bool:
        """An engine output arrived (whether read yet or not): the engine is past queueing them."""
        return self.queue.arrived


class RequestShedError(RuntimeError):
    """The server gave this request's place to a more urgent one while it was still queued."""


@dataclass
class RequestScope:
    """One API request as the server sees it beyond its body: the tenant its sequences are served for,
    the most urgent priority they may have (`floor`: a lower one is raised to it), and the sequences it
    submitted, so that it can be shed while it has not started. Requests submitted while a scope is
    current (`request_scope`) join it."""

    tenant: str | None = None
    floor: int = 0
    subs: list[Submitted] = field(default_factory=list)
    shed: Exception | None = None
    # Its answer has begun (a stream's 200, a background response's id): a client told "200" is not
    # told "retry" afterwards, so it is never shed.
    responded: bool = False

    def clamp(self, priority: int) -> int:
        return max(priority, self.floor)

    @property
    def started(self) -> bool:
        """Its answer has begun, or any engine output of it has arrived (read or not)."""
        return self.responded or any(s.started for s in self.subs)

    def cut_off(self, error: Exception) -> None:
        """End its sequences that have produced nothing with `error` (raised in their streams, which
        abort them in the engine); what it submits from now on is refused with it."""
        self.shed = error
        for sub in self.subs:
            if not sub.started:
                sub.queue.put_nowait(error)


_SCOPE: ContextVar[RequestScope | None] = ContextVar("tokenmill_request_scope", default=None)


@contextlib.contextmanager
def request_scope(scope: RequestScope) -> Iterator[RequestScope]:
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        with contextlib.suppress(ValueError):  # an async generator closed from another context
            _SCOPE.reset(token)


class AsyncLLM:
    def __init__(self, client: EngineClient, tokenizer: Tokenizer) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.eos = frozenset(tokenizer.eos_token_ids)
        # Called with each finished RequestOutput (the server records metrics with it).
        self.on_finished: Callable[[RequestOutput], None] | None = None
        self.on_aborted: Callable[[int], None] | None = None  # with the number of sequences cut short
        self._in_flight: dict[int, Submitted] = {}  # by id(): what cut_off ends

    def cut_off(self, error: Exception) -> int:
        """End every request in flight with `error`, raised in its stream as an engine's would be: a
        server that must stop now answers them (and aborts them in the engine) rather than dropping
        their connections. Returns how many there were."""
        for sub in self._in_flight.values():
            sub.queue.put_nowait(error)
        return len(self._in_flight)

    @classmethod
    async def start(
        cls, config: EngineConfig, worker_url: str | None = None, client: EngineClient | None = None
    ) -> AsyncLLM:
        """Start the engine process (or reach the one serving at `worker_url`, or use `client`: a
        router over a fleet, say) and load the tokenizer here (no weights in this process)."""
        path = catalog.resolve(config.model)
        if client is None:
            client = MPEngineClient(config) if worker_url is None else ZmqEngineClient(worker_url)
        await client.start()
        served = client.info.get("model")
        if served is not None and served != config.model:
            await client.shutdown()
            where = f"the worker at {worker_url}" if worker_url else "the engine"
            raise ValueError(f"{where} serves {served!r}, not {config.model!r}: pass --model {served}")
        cache_dir = Path(config.cache_dir) if config.cache_dir else None
        # Reads the GGUF file's metadata with numpy (no torch in this process): only when starting.
        from tokenmill.weights.tokenizer_source import load_tokenizer

        return cls(client, load_tokenizer(path, cache_dir))

    @property
    def max_model_len(self) -> int:
        return int(self.client.info["max_model_len"])

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        routing_key: str | None = None,
        into: Submitted | None = None,
        lora: LoRARequest | None = None,
        kv_transfer: dict[str, Any] | None = None,
        tenant: str | None = None,
    ) -> Submitted:
        """Hand a request's n sequences to the engine; `stream` then yields its outputs. With `into`, the
        request joins that batch (one queue, one output processor: the offline API's way). A request
        the client refuses on the spot (the in-process one checks at once) raises, leaving nothing of
        the batch behind. The current RequestScope, if any, gives the tenant (unless one is given),
        raises the priority to its floor, and takes the request in."""
        scope = _SCOPE.get()
        if scope is not None:
            if scope.shed is not None:
                raise scope.shed
            tenant = tenant if tenant is not None else scope.tenant
            priority = scope.clamp(priority)
        arrival = time.monotonic()
        trace = tracing.current_carrier()  # the HTTP request's span, the engine's span's parent
        sub = into or Submitted(request_id, OutputProcessor(self.tokenizer), OutputQueue(), set())
        proc = sub.proc
        for cid, cp in proc.add_request(request_id, prompt, prompt_ids, params, arrival):
            req = EngineRequest(
                cid, prompt_ids, cp, self.eos, arrival, priority, cache_salt, routing_key, kv_transfer, lora,
                trace, tenant,
            )  # fmt: skip
            try:
                self.client.add_request(req, sub.queue)
            except Exception:
                self.client.abort(sorted(sub.live))
                raise
            sub.live.add(cid)
        if scope is not None and into is None:
            scope.subs.append(sub)
        return sub

    async def stream(
        self, sub: Submitted, errors_as_outputs: bool = False, final_only: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput each time any of the request's sequences advances (deltas inside), or
        with `final_only` once per request, when it has finished.

        A sequence the engine failed on raises RequestFailedError, or with `errors_as_outputs` ends
        with finish reason "error" like any other. An error put in the queue (the engine died, the
        request was shed) is raised after the outputs that arrived before it, unless those finished
        the request. If the consumer stops early (a client disconnected), the request is aborted in
        the engine.
        """
        queue, live, proc = sub.queue, sub.live, sub.proc
        self._in_flight[id(sub)] = sub
        try:
            while live:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                batch: list[EngineCoreOutput] = [item]
                error: Exception | None = None
                while not queue.empty():  # several sequences may have advanced in one engine step
                    nxt = queue.get_nowait()
                    if isinstance(nxt, Exception):
                        error = nxt  # after what arrived before it
                        break
                    batch.append(nxt)
                for out in batch:
                    if out.finish_reason is not None:
                        live.discard(out.request_id)
                    if out.finish_reason == FinishReason.ERROR and not errors_as_outputs:
                        if out.error is not None:
                            raise RequestInvalidError(out.error)
                        raise RequestFailedError(
                            f"the engine failed on request {sub.request_id}; the server log has the details"
                        )
                outs, stopped = proc.process(batch, final_only)
                if stopped:
                    self.client.finish(stopped)
                    live.difference_update(stopped)
                for ro in outs:
                    if ro.finished and self.on_finished is not None:
                        self.on_finished(ro)
                    yield ro
                if error is not None and live:
                    raise error
        finally:
            self._in_flight.pop(id(sub), None)
            if live:
                self.client.abort(sorted(live))
                if self.on_aborted is not None:
                    self.on_aborted(len(live))

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        routing_key: str | None = None,
        lora: LoRARequest | None = None,
        kv_transfer: dict[str, Any] | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """submit + stream: what the server calls for each API request."""
        sub = self.submit(
            request_id, prompt_ids, params, prompt, priority, cache_salt, routing_key, lora=lora,
            kv_transfer=kv_transfer, tenant=tenant,
        )  # fmt: skip
        async for ro in self.stream(sub):
            yield ro

    async def shutdown(self) -> None:
        await self.client.shutdown()
