"""A whole benchmark: one or more load levels (a sweep), or a search for the highest good rate.

Each level gets its own prompts (the workload seed plus the level's number), so that a level never
finds the previous level's prompts in the server's prefix cache. The client's own CPU use is
measured per level and reported, as evidence that the load generator was not the bottleneck.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.bench.client import ClientConfig, OpenAIClient, discover_model
from tokenmill.bench.load import LoadConfig, run_level
from tokenmill.bench.records import RequestRecord
from tokenmill.bench.stats import Slo, summarize
from tokenmill.bench.workload import TokenCounter, WorkloadConfig, sessions


@dataclass
class LevelResult:
    load: LoadConfig
    records: list[RequestRecord]
    summary: dict[str, Any]


@dataclass
class GoodputSearch:
    """Find the highest request rate at which at least `target` of requests meet every SLO."""

    target: float = 0.9
    # A rate also fails if the server completes requests slower than this share of the arrival
    # rate: its queue is growing, and a longer run would break the SLOs too.
    keep_up: float = 0.9
    start_rate: float = 1.0
    max_doublings: int = 8
    bisect_steps: int = 4


@dataclass
class BenchResult:
    levels: list[LevelResult]
    search: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


ProgressFn = Callable[[str, int | None, float | None], Callable[[RequestRecord], None]]


async def _run_levels(
    client_cfg: ClientConfig,
    workload: WorkloadConfig,
    loads: list[LoadConfig],
    slos: list[Slo],
    counter: TokenCounter | None,
    progress: ProgressFn,
    search: GoodputSearch | None,
) -> BenchResult:
    count = (lambda text: len(counter.encode(text, add_special_tokens=False))) if counter else None
    if not client_cfg.model:
        client_cfg.model = await asyncio.to_thread(
            discover_model, client_cfg.base_url, client_cfg.api_key, client_cfg.timeout_s
        )
    client = OpenAIClient(client_cfg, count)
    try:
        levels: list[LevelResult] = []

        async def level(load: LoadConfig) -> LevelResult:
            n = len(levels)
            stream = sessions(replace(workload, seed=workload.seed + 1000 * n), counter)
            on_done = progress(load.label, load.num_requests, load.duration_s)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            records = await run_level(client, stream, load, on_done, single_turn=workload.turns <= 1)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            summary = summarize(records, slos)
            summary["label"] = load.label
            summary["concurrency"] = load.concurrency
            summary["request_rate"] = load.request_rate
            summary["client_cpu_pct"] = 100.0 * cpu / wall if wall else 0.0
            result = LevelResult(load, records, summary)
            levels.append(result)
            return result

        if search is None:
            for load in loads:
                await level(load)
            return BenchResult(levels)
        return BenchResult(levels, await _search(level, loads[0], search))
    finally:
        await client.aclose()


async def _search(level, base: LoadConfig, s: GoodputSearch) -> dict[str, Any]:
    """Double the rate until attainment drops below the target, then bisect (DistServe's goodput)."""
    probes: list[dict[str, Any]] = []

    async def probe(rate: float) -> bool:
        r = await level(replace(base, concurrency=None, request_rate=rate))
        att = r.summary["slo_attainment"]
        arrival, completion = r.summary.get("arrival_rate"), r.summary.get("completion_rate")
        keeps_up = arrival is None or (completion is not None and completion >= s.keep_up * arrival)
        probes.append(
            {
                "request_rate": rate,
                "slo_attainment": att,
                "goodput": r.summary["goodput"],
                "arrival_rate": arrival,
                "completion_rate": completion,
                "keeps_up": keeps_up,
            }
        )
        return att >= s.target and keeps_up

    lo, hi = None, None
    rate = s.start_rate
    for _ in range(s.max_doublings):
        if await probe(rate):
            lo = rate
            if hi is not None:
                break
            rate *= 2
        else:
            hi = rate
            if lo is not None:
                break
            rate /= 2
    if lo is not None and hi is not None:
        for _ in range(s.bisect_steps):
            mid = (lo + hi) / 2
            if await probe(mid):
                lo = mid
            else:
                hi = mid
    return {
        "target_attainment": s.target,
        "max_good_rate": lo,  # None: no probed rate met the target
        "first_failing_rate": hi,
        "probes": probes,
    }


def run_bench(
    client_cfg: ClientConfig,
    workload: WorkloadConfig,
    loads: list[LoadConfig],
    slos: list[Slo],
    counter: TokenCounter | None,
    progress: ProgressFn,
    search: GoodputSearch | None = None,
) -> BenchResult:
    return asyncio.run(_run_levels(client_cfg, workload, loads, slos, counter, progress, search))
