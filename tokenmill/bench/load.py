"""Load patterns: a fixed number of requests in flight (closed loop) or arrivals at a rate (open loop).

Closed loop: C workers, each sending its next request as soon as its previous one ends. Open loop:
sessions start at arrival times drawn in advance, Poisson (exponential gaps, the default, as AIPerf)
or evenly spaced, whatever the server's state; an optional cap on requests in flight. A session's
turns always run one after another, each resending the conversation so far.

Every level is bounded by a request count and/or a duration. With a duration, nothing new starts
after it, in-flight requests get a grace period, and those still running then are cancelled and
reported as such (not as failures). Warm-up requests go first, at the same concurrency, and are
marked so the statistics leave them out.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tokenmill.bench.client import OpenAIClient
from tokenmill.bench.records import RequestRecord
from tokenmill.bench.workload import Session


@dataclass
class LoadConfig:
    concurrency: int | None = None
    request_rate: float | None = None
    arrival: str = "poisson"  # poisson | constant
    num_requests: int | None = None
    duration_s: float | None = None
    warmup_requests: int = 0
    max_concurrency: int | None = None  # cap on requests in flight in rate mode
    grace_s: float = 30.0
    seed: int = 0

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency{self.concurrency}"
        return f"rate{self.request_rate:g}"


def arrival_offsets(rate: float, kind: str, rng: random.Random, n: int | None = None) -> Iterator[float]:
    """Seconds from the start at which sessions arrive: Poisson (exponential gaps) or constant.

    With a known count n, Poisson gaps are rescaled so that the n arrivals span exactly (n - 1) / rate,
    as vLLM does: otherwise a run of a few dozen requests offers a rate off by 10-20% at random, and a
    goodput search would credit the server with a rate it never saw.
    """
    if rate <= 0:
        raise ValueError("--request-rate must be positive")
    if kind == "poisson" and n is not None and n > 1:
        gaps = [rng.expovariate(rate) for _ in range(n - 1)]
        scale = (n - 1) / rate / sum(gaps)
        t = 0.0
        yield t
        for g in gaps:
            t += g * scale
            yield t
        return
    t = 0.0
    while True:
        yield t
        t += rng.expovariate(rate) if kind == "poisson" else 1.0 / rate


class _Budget:
    """Counts requests started against the level's bounds."""

    def __init__(self, limit: int | None, deadline: float | None) -> None:
        self.limit, self.deadline, self.started = limit, deadline, 0

    def take(self) -> bool:
        if self.limit is not None and self.started >= self.limit:
            return False
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return False
        self.started += 1
        return True


async def _run_session(
    client: OpenAIClient,
    session: Session,
    budget: _Budget,
    records: list[RequestRecord],
    t0: float,
    warmup: bool,
    conversation: int,
    on_done: Callable[[RequestRecord], None],
) -> None:
    history: list[dict] = []
    for turn_no, turn in enumerate(session.turns):
        if not budget.take():
            return
        rec = RequestRecord(
            index=len(records), t_send=0.0, warmup=warmup, conversation=conversation, turn=turn_no
        )
        records.append(rec)
        payload = _payload(client, session, history, turn.text)
        if rec.isl is None:
            rec.isl = _prompt_tokens(client, session, history, turn)
        await client.send(rec, payload, turn.max_tokens, t0)
        on_done(rec)
        if not rec.ok:
            return
        history += [{"role": "user", "content": turn.text}, {"role": "assistant", "content": rec.output_text}]


def _payload(client: OpenAIClient, session: Session, history: list[dict], text: str) -> dict:
    if client.cfg.endpoint == "chat":
        if session.messages is not None:
            return {"messages": session.messages}
        sys_msg = [{"role": "system", "content": session.system}] if session.system else []
        return {"messages": sys_msg + history + [{"role": "user", "content": text}]}
    parts = [session.system] if session.system else []
    parts += [m["content"] for m in history] + [text]
    return {"prompt": "\n\n".join(parts)}


def _prompt_tokens(client: OpenAIClient, session: Session, history: list[dict], turn) -> int:
    """The prompt's tokens as the client counts them (the server's usage count replaces this)."""
    if not history and not session.system:
        return turn.prompt_tokens
    count = client.count_tokens
    texts = ([session.system] if session.system else []) + [m["content"] for m in history]
    extra = sum(count(t) for t in texts) if count else 0
    return turn.prompt_tokens + extra


async def run_level(
    client: OpenAIClient,
    sessions: Iterator[Session],
    cfg: LoadConfig,
    on_done: Callable[[RequestRecord], None] = lambda r: None,
    single_turn: bool = True,
) -> list[RequestRecord]:
    """Run one load level (after its warm-up); return every record, warm-up ones marked."""
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    conv = iter(range(1 << 62))
    if cfg.warmup_requests:
        budget = _Budget(cfg.warmup_requests, None)
        width = min(cfg.warmup_requests, cfg.concurrency or cfg.max_concurrency or 1)

        async def warm() -> None:
            while budget.limit is None or budget.started < budget.limit:
                await _run_session(
                    client, next(sessions), budget, records, t0, True, next(conv), lambda r: None
                )

        await asyncio.gather(*(warm() for _ in range(width)))
    if not cfg.num_requests and not cfg.duration_s:
        raise ValueError("a load level needs a request count, a duration or both")
    deadline = time.perf_counter() + cfg.duration_s if cfg.duration_s else None
    budget = _Budget(cfg.num_requests or None, deadline)

    def more() -> bool:
        return (budget.limit is None or budget.started < budget.limit) and (
            deadline is None or time.perf_counter() < deadline
        )

    if cfg.concurrency is not None:

        async def worker() -> None:
            while more():
                await _run_session(client, next(sessions), budget, records, t0, False, next(conv), on_done)

        tasks = [asyncio.create_task(worker()) for _ in range(cfg.concurrency)]
    else:
        assert cfg.request_rate is not None
        tasks = []
        cap = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

        async def capped(session: Session, n: int) -> None:
            if cap is None:
                return await _run_session(client, session, budget, records, t0, False, n, on_done)
            async with cap:
                return await _run_session(client, session, budget, records, t0, False, n, on_done)

        start = time.perf_counter()
        # Sessions of one turn: the request count is the arrival count, and the rate can be made exact.
        n = cfg.num_requests if cfg.duration_s is None and single_turn else None
        for offset in arrival_offsets(cfg.request_rate, cfg.arrival, random.Random(cfg.seed), n):
            delay = start + offset - time.perf_counter()
            if deadline is not None and start + offset >= deadline:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            if not more():
                break
            tasks.append(asyncio.create_task(capped(next(sessions), next(conv))))
            # Let the new request's task start now: its send time is then its arrival time.
            await asyncio.sleep(0)
    if tasks:
        # The grace period starts when the duration ends, not now: closed-loop workers are created at
        # the level's start, and a timer started here cut every level at --grace-period.
        timeout = None if deadline is None else max(0.0, deadline - time.perf_counter()) + cfg.grace_s
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)
    return records
