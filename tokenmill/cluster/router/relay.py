"""A request on its way through the router: stands in for the caller's queue at a worker's client, so the
router sees each output (or error) first: the first token moves the request's blocks from prefill to
decode load, the last frees them, and a worker lost before the first token sends the request on."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tokenmill.cluster.router.settings import MAX_RETRIES
from tokenmill.engine.client import EngineDeadError, WorkerDrainingError
from tokenmill.engine.protocol import EngineCoreOutput, EngineRequest

if TYPE_CHECKING:
    from tokenmill.cluster.router.client import RouterEngineClient


class Relay:
    __slots__ = (
        "router", "req", "queue", "slot", "started", "tries", "hashes", "sent_at", "failed", "wait_until",
        "role", "parked_since", "cold_served", "tenant",
    )  # fmt: skip

    def __init__(self, router: RouterEngineClient, req: EngineRequest, queue: asyncio.Queue) -> None:
        self.router, self.req, self.queue = router, req, queue
        self.slot = -1
        self.started = False
        self.tries = 0
        self.hashes: list[int] | None = None  # the prompt's block names, when an index needed them
        self.sent_at = 0.0  # time.monotonic() of the last dispatch
        self.failed: set[tuple[int, int]] = set()  # (slot, joins) of the workers it was lost on
        self.wait_until: float | None = None  # a retry waiting for a worker that answers: until then
        self.role: str | None = None  # the pool its first try went to ("prefill", "decode"; None: any)
        # When it first waited for a cold start (its wait is bounded from then, however often it waits
        # again), and whether that wait has been counted as served.
        self.parked_since: float | None = None
        self.cold_served = False
        # Its tenant as the router's queue counts it (fleet_queue.py: names bounded as the engine's are).
        fq = router.fleet_queue
        self.tenant = fq.tenant(req.tenant) if fq is not None else (req.tenant or "default")

    # What the router's queue orders it by, besides its tenant (the engine's FairQueue reads these).
    @property
    def priority(self) -> int:
        return self.req.priority

    @property
    def arrival_time(self) -> float:
        return self.req.arrival_time

    def put_nowait(self, item: object) -> None:
        r = self.router
        if isinstance(item, EngineCoreOutput):
            if item.new_token_ids:
                first = not self.started
                if first:
                    self.started = True
                    r.started(self)
                fq = r.fleet_queue
                if fq is not None:
                    if self.req.request_id in fq.counted:
                        # Its tenant's counter grows by what the engine served: with the first token, the
                        # prompt tokens it computed (its cache hits are free), then each token generated.
                        n_in = item.num_prompt_tokens - item.num_cached_tokens if first else 0
                        fq.charge(self, max(n_in, 0), len(item.new_token_ids))
                    r._release_soon()  # a step ended: its engine may have room again (its stats)
            if item.finish_reason is not None:
                r.release(self)
        elif (
            isinstance(item, EngineDeadError)
            and not self.started
            and (
                self.tries <= MAX_RETRIES or isinstance(item, WorkerDrainingError)  # a refusal costs no try
            )
        ):
            w = r.workers[self.slot]
            w.drop_active(self.req.request_id)  # stays findable for abort
            self.failed.add((w.slot, w.joins))  # not sent there again (but after it rejoins)
            self.wait_until = None
            r.stats_router.retries += 1
            if isinstance(item, WorkerDrainingError):
                self.tries -= 1  # the worker is leaving: the request has not failed anywhere
            asyncio.get_running_loop().call_soon(r.redispatch, self)
            return
        elif isinstance(item, Exception):
            r.release(self)
        self.queue.put_nowait(item)
