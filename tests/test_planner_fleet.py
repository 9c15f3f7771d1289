"""The load planner on a real fleet: `tokenmill serve --workers 1..2 --planner load` with real worker
processes; a burst of requests queues on one worker, the planner starts a second, and once traffic
stops it drains one away again. No request fails. The same with a disaggregated fleet (1P1D), whose
decode pool grows and shrinks on its own."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
from server_fixture import running_server
from stream_clients import stream_until

pytestmark = pytest.mark.slow


def workers(base: str, pool: str = "all") -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {
        m[0]: float(m[1])
        for m in re.findall(
            rf'tokenmill:planner_workers\{{[^}}]*pool="{pool}"[^}}]*state="(\w+)"\}} ([\d.]+)', text
        )
    }


def wait_for(cond, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


async def burst(base: str, seconds: float) -> list[int]:
    """12 clients sending short completions back to back for `seconds`; the status codes."""
    codes: list[int] = []
    deadline = time.monotonic() + seconds

    async def one(client: httpx.AsyncClient, i: int) -> None:
        while time.monotonic() < deadline:
            prompt = f"Count to twenty, number {i}:"
            body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 24, "ignore_eos": True}
            r = await client.post(f"{base}/v1/completions", json=body, timeout=120)
            codes.append(r.status_code)

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(one(client, i) for i in range(12)))
    return codes


async def burst_watching(base: str, pool: str) -> tuple[list[int], set[int]]:
    """A 40 s burst; its status codes, and the pool's sizes (serving + starting) seen meanwhile."""
    seen: set[int] = set()
    task = asyncio.create_task(burst(base, 40))
    while not task.done():
        w = await asyncio.to_thread(workers, base, pool)
        seen.add(int(w.get("serving", 0) + w.get("starting", 0)))
        await asyncio.sleep(1)
    return await task, seen


def test_the_load_planner_scales_up_under_a_burst_and_back_down_after() -> None:
    args = ["--workers", "1..2", "--planner", "load", "--planner-interval-s", "1", "--planner-window-s", "5",
            "--planner-up-cooldown-s", "2", "--planner-down-cooldown-s", "4", "--max-num-seqs", "2",
            "--planner-drain-timeout-s", "60"]  # fmt: skip
    with running_server(*args) as proc:
        base = proc.base_url
        assert workers(base) == {"serving": 1, "starting": 0, "draining": 0}

        codes, seen = asyncio.run(burst_watching(base, "all"))
        assert codes and set(codes) == {200}, f"{len(codes)} requests, codes {set(codes)}"
        assert 2 in seen, "the planner never added a worker"
        text = httpx.get(f"{base}/metrics", timeout=10).text
        assert re.search(r'tokenmill:planner_decisions_total\{[^}]*direction="up"[^}]*\} [1-9]', text)
        # Quiet now: down to one worker (after the quiet intervals, the cool-down and the drain).
        wait_for(
            lambda: workers(base).get("serving") == 1 and workers(base).get("draining") == 0,
            120,
            "scale-down",
        )
        text = httpx.get(f"{base}/metrics", timeout=10).text
        assert re.search(r'tokenmill:planner_decisions_total\{[^}]*direction="down"[^}]*\} [1-9]', text)
        # The fleet still answers after the change.
        body = {"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 4}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200


def test_a_disaggregated_fleet_grows_the_pool_under_pressure() -> None:
    """1P1D within 2..3 workers: short prompts are prefilled where they decode, so a burst queues on the
    decode worker; the decode pool gets a second worker (a decode one), the prefill pool stays, and
    after the burst the decode pool drains back to one."""
    args = ["--workers", "2..3", "--disaggregate", "1P1D", "--planner", "load", "--planner-interval-s", "1",
            "--planner-window-s", "5", "--planner-up-cooldown-s", "2", "--planner-down-cooldown-s", "4",
            "--max-num-seqs", "2", "--planner-drain-timeout-s", "60"]  # fmt: skip
    with running_server(*args) as proc:
        base = proc.base_url
        assert workers(base, "prefill") == {"serving": 1, "starting": 0, "draining": 0}
        assert workers(base, "decode") == {"serving": 1, "starting": 0, "draining": 0}
        codes, seen = asyncio.run(burst_watching(base, "decode"))
        assert codes and set(codes) == {200}, f"{len(codes)} requests, codes {set(codes)}"
        assert 2 in seen, "the planner never added a decode worker"
        assert workers(base, "prefill").get("serving") == 1
        text = httpx.get(f"{base}/metrics", timeout=10).text
        ups = re.search(r'planner_decisions_total\{direction="up",[^}]*pool="decode"\} ([\d.]+)', text)
        assert ups and float(ups[1]) >= 1, text
        wait_for(
            lambda: (
                workers(base, "decode").get("serving") == 1 and workers(base, "decode").get("draining") == 0
            ),
            120,
            "the decode pool's scale-down",
        )
        body = {"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 4}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200


STREAM_TOKENS = 32


def down_decisions(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(
        float(v)
        for v in re.findall(r'tokenmill:planner_decisions_total\{[^}]*direction="down"[^}]*\} ([\d.]+)', text)
    )


def test_the_planner_drains_a_worker_under_16_streams_and_no_stream_is_lost() -> None:
    """16 clients stream without pause throughout. On one worker of 10 sequences 6 wait: the load planner
    adds a second. On two the same 16 run with nothing waiting and (long streams, short queueing) a
    queue-to-compute ratio under the quiet bound: one worker fewer would still see nothing waiting
    (a worker may run 10), so after the quiet intervals the planner decides down by itself and drains
    one worker while streams run on it. The up cool-down keeps it from growing again before the test
    ends. Every stream ends whole: all its tokens, finish reason "length", [DONE]."""
    args = ["--workers", "1..2", "--planner", "load", "--planner-interval-s", "1", "--planner-window-s", "4",
            "--planner-up-cooldown-s", "600", "--planner-down-cooldown-s", "2", "--max-num-seqs", "10",
            "--planner-drain-timeout-s", "120"]  # fmt: skip
    with running_server(*args) as proc:
        base = proc.base_url

        async def until(cond, timeout: float, what: str) -> None:  # noqa: ANN001
            deadline = time.monotonic() + timeout
            while not await asyncio.to_thread(cond):
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(0.3)

        async def main() -> tuple[list[str], int]:
            stop, results = asyncio.Event(), []
            clients = [
                asyncio.create_task(
                    stream_until(base, stop, results, f"Story {i}: once upon a time", STREAM_TOKENS)
                )
                for i in range(16)
            ]
            try:
                await until(lambda: workers(base).get("serving") == 2, 180, "a second worker")
                # (the down decision, not the draining gauge: a drain may end between two looks)
                await until(lambda: down_decisions(base) >= 1, 180, "the planner to drain one")
                before = len(results)
                await until(
                    lambda: workers(base) == {"serving": 1, "starting": 0, "draining": 0}, 150, "the drain"
                )
                after = len(results)
                await until(lambda: len(results) >= after + 16, 150, "streams on the one worker left")
            finally:
                stop.set()
                await asyncio.gather(*clients)
            return results, before

        results, before = asyncio.run(main())
        failed = [r for r in results if r != "ok"]
        assert not failed, f"{len(failed)} of {len(results)}: {failed[:5]}"
        assert before >= 16
        text = httpx.get(f"{base}/metrics", timeout=10).text
        assert re.search(r'tokenmill:planner_decisions_total\{[^}]*direction="down"[^}]*\} 1\.0', text)

        def counter(name: str) -> float:
            m = re.search(rf"tokenmill:{name}_total\{{[^}}]*\}} ([\d.]+)", text)
            assert m, name
            return float(m[1])

        assert counter("router_worker_losses") == 0, "the drained worker was counted as lost"
        assert counter("router_drains") == 1
        # It was drained with streams under way on it (they finished there: none failed above).
        assert counter("router_drain_requests") > 0
