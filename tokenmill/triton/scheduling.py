"""How requests reach a model's instances: one at a time, or through the dynamic batcher.

Both run on the server's event loop and hand batches to the model's instances on worker threads;
`instance_group.count` instances execute at once. The dynamic batcher follows Triton's rules: when
an instance is free, send the largest preferred batch size that the queued requests form; otherwise
wait until the oldest request has waited max_queue_delay_microseconds (or a full batch is there) and
send what there is. Priority levels (1 = highest) are served in order; a queue policy bounds each
level's queue (max_queue_size: rejected at once) and its waiting time (timeout: REJECT or DELAY).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tokenmill.triton.backends import InferRequest, Instance, Outputs
from tokenmill.triton.config import TritonModelConfig
from tokenmill.triton.stats import ModelStats


class InferError(Exception):
    """An error with its HTTP status, reported as {"error": message}."""

    def __init__(self, status: int, message: str, reason: str = "OTHER") -> None:
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason


@dataclass
class Pending:
    req: InferRequest
    size: int
    future: asyncio.Future
    t_arrival: int = field(default_factory=time.perf_counter_ns)
    level: int = 1
    deadline_ns: int | None = None


class BatchScheduler(ABC):
    """Base: a pool of instances on worker threads, and how a batch runs on one of them."""

    def __init__(self, cfg: TritonModelConfig, instances: list[Instance], stats: ModelStats) -> None:
        self.cfg, self.instances, self.stats = cfg, instances, stats
        self.executor = ThreadPoolExecutor(max_workers=len(instances), thread_name_prefix=f"model-{cfg.name}")
        self.free: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(instances)):
            self.free.put_nowait(i)

    @abstractmethod
    async def submit(self, req: InferRequest) -> Outputs:
        """Queue the request; return its outputs once a batch holding it has run."""

    async def run_batch(self, idx: int, batch: list[Pending]) -> None:
        """Execute on instance idx and settle every request's future (never raises)."""
        t0 = time.perf_counter_ns()
        for p in batch:
            self.stats.dequeued(t0 - p.t_arrival)
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(
                self.executor, self.instances[idx].execute, [p.req for p in batch]
            )
        except Exception as e:  # the model's own code failed: every request of the batch fails
            results = [e] * len(batch)
        t1 = time.perf_counter_ns()
        self.stats.executed(sum(p.size for p in batch), 0, t1 - t0, 0)
        for p in batch:  # each request of the batch took the batch's time (as Triton reports it)
            p.req.times.infer_ns += t1 - t0
        for p, r in zip(batch, results, strict=True):
            if p.future.done():
                continue
            if isinstance(r, Exception):
                p.future.set_exception(InferError(500, f"model {self.cfg.name!r} failed: {r}", "BACKEND"))
            else:
                p.future.set_result(r)

    async def close(self) -> None:
        for inst in self.instances:
            await asyncio.get_running_loop().run_in_executor(self.executor, inst.finalize)
        self.executor.shutdown(wait=False)


class DynamicBatcher(BatchScheduler):
    def __init__(self, cfg: TritonModelConfig, instances: list[Instance], stats: ModelStats) -> None:
        super().__init__(cfg, instances, stats)
        d = cfg.dynamic_batching or {}
        self.max_batch = max(1, cfg.max_batch_size)
        self.preferred = sorted(d.get("preferred_batch_size", []))
        self.delay_ns = int(d.get("max_queue_delay_microseconds", 0)) * 1000
        self.levels = max(1, int(d.get("priority_levels", 0)))
        self.default_level = int(d.get("default_priority_level", 0)) or self.levels
        default_policy = d.get("default_queue_policy", {})
        self.policies = {lv: default_policy for lv in range(1, self.levels + 1)}
        for pq in d.get("priority_queue_policy", []):
            self.policies[pq["key"]] = pq.get("value", {})
        self.queues: dict[int, deque[Pending]] = {lv: deque() for lv in range(1, self.levels + 1)}
        self.delayed: deque[Pending] = deque()  # timed out with timeout_action DELAY: served last
        self.arrived = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._dispatch())

    def _level(self, req: InferRequest) -> int:
        pr = int(req.priority or 0)
        if pr <= 0:
            return self.default_level
        return min(pr, self.levels)

    async def submit(self, req: InferRequest) -> Outputs:
        size = req.batch_size(self.cfg)
        if size > self.max_batch:
            raise InferError(
                400, f"batch size {size} exceeds max_batch_size {self.max_batch} of {self.cfg.name!r}"
            )
        level = self._level(req)
        policy = self.policies[level]
        max_q = int(policy.get("max_queue_size", 0))
        if max_q and len(self.queues[level]) >= max_q:
            raise InferError(
                503, f"exceeds maximum queue size ({max_q}) of model {self.cfg.name!r}", "REJECTED"
            )
        timeout_us = int(policy.get("default_timeout_microseconds", 0))
        if (
            req.timeout_us
            and policy.get("allow_timeout_override")
            and (not timeout_us or req.timeout_us < timeout_us)
        ):
            timeout_us = req.timeout_us
        p = Pending(req, size, asyncio.get_running_loop().create_future(), level=level)
        if timeout_us:
            p.deadline_ns = p.t_arrival + timeout_us * 1000
        self.queues[level].append(p)
        self.stats.enqueued()
        self.arrived.set()
        return await p.future

    def _ordered(self) -> list[Pending]:
        return [p for lv in sorted(self.queues) for p in self.queues[lv]] + list(self.delayed)

    def _expire(self, now: int) -> None:
        for lv, q in self.queues.items():
            keep: deque[Pending] = deque()
            for p in q:
                if p.deadline_ns is not None and now >= p.deadline_ns:
                    if self.policies[lv].get("timeout_action", "REJECT") == "DELAY":
                        p.deadline_ns = None
                        self.delayed.append(p)
                    else:
                        self.stats.dequeued(now - p.t_arrival)
                        p.future.set_exception(
                            InferError(503, "request timeout expired in the queue", "REJECTED")
                        )
                else:
                    keep.append(p)
            self.queues[lv] = keep

    def _pick(self, must_send: bool) -> list[Pending] | None:
        """The batch to send now, or None to keep waiting."""
        order = self._ordered()
        if not order:
            return None
        sums, total = [], 0
        for p in order:
            if total + p.size > self.max_batch:
                break
            total += p.size
            sums.append(total)
        for pref in reversed(self.preferred):
            if pref in sums:
                return order[: sums.index(pref) + 1]
        if total >= self.max_batch or must_send or (not self.preferred and self.delay_ns == 0):
            return order[: len(sums)] or order[:1]
        return None

    def _remove(self, batch: list[Pending]) -> None:
        ids = {id(p) for p in batch}
        for lv in self.queues:
            self.queues[lv] = deque(p for p in self.queues[lv] if id(p) not in ids)
        self.delayed = deque(p for p in self.delayed if id(p) not in ids)

    async def _dispatch(self) -> None:
        while True:
            if not self._ordered():
                self.arrived.clear()
                await self.arrived.wait()
            idx = await self.free.get()
            batch = None
            while batch is None:
                now = time.perf_counter_ns()
                self._expire(now)
                order = self._ordered()
                if not order:
                    break
                oldest = min(p.t_arrival for p in order)
                waited = now - oldest
                batch = self._pick(must_send=waited >= self.delay_ns)
                if batch is None:
                    self.arrived.clear()
                    wait = (self.delay_ns - waited) / 1e9
                    deadlines = [p.deadline_ns for p in order if p.deadline_ns is not None]
                    if deadlines:
                        wait = min(wait, max(0.0, (min(deadlines) - now) / 1e9))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.arrived.wait(), timeout=max(wait, 0.0))
            if not batch:
                self.free.put_nowait(idx)
                continue
            self._remove(batch)
            asyncio.get_running_loop().create_task(self._run_and_release(idx, batch))

    async def _run_and_release(self, idx: int, batch: list[Pending]) -> None:
        try:
            await self.run_batch(idx, batch)
        finally:
            self.free.put_nowait(idx)

    async def close(self) -> None:
        self.task.cancel()
        for p in self._ordered():
            if not p.future.done():
                p.future.set_exception(InferError(503, f"model {self.cfg.name!r} was unloaded"))
        await super().close()


class DefaultScheduler(DynamicBatcher):
    """No dynamic batching: each request executes alone, in arrival order, on the next free instance.

    (A FIFO queue with its own dispatcher, not a free-instance queue that requests take from: with
    the latter, the request that just finished re-takes its instance before the waiting ones wake.)
    """

    def _pick(self, must_send: bool) -> list[Pending] | None:
        order = self._ordered()
        return order[:1] or None

    async def submit(self, req: InferRequest) -> Outputs:
        p = Pending(req, req.batch_size(self.cfg), asyncio.get_running_loop().create_future())
        self.queues[1].append(p)
        self.stats.enqueued()
        self.arrived.set()
        return await p.future
