"""A fleet that changes without losing requests: a worker told to stop (SIGTERM) drains under load, and a
router killed and started again rebuilds its prefix index from the workers before it serves.

Real processes throughout: two `tokenmill worker`s, the router as `tokenmill serve --worker-url ...`,
clients over HTTP."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import httpx
import pytest
from procs import worker_process
from server_fixture import free_port, running_server
from stream_clients import stream_until

pytestmark = pytest.mark.slow

MAX_TOKENS = 24


def events_args() -> list[str]:
    ev, rp = free_port(), free_port()
    return [
        "--kv-events",
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{ev}",
        "--kv-events-replay-endpoint",
        f"tcp://127.0.0.1:{rp}",
    ]


def metric(base: str, name: str) -> float:
    """The sum of a metric's series on the server's /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(
        float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


def test_a_sigterm_drains_a_worker_under_load_and_no_request_is_lost() -> None:
    with (
        worker_process("--max-num-seqs", "16", "--drain-timeout", "120") as (url_a, proc_a),
        worker_process("--max-num-seqs", "16", "--drain-timeout", "120") as (url_b, proc_b),
        running_server("--worker-url", url_a, "--worker-url", url_b, "--router", "round-robin") as server,
    ):
        base = server.base_url

        async def main() -> list[str]:
            stop, results = asyncio.Event(), []
            clients = [
                asyncio.create_task(
                    stream_until(base, stop, results, f"Story {i}: once upon a time", MAX_TOKENS)
                )
                for i in range(16)
            ]
            deadline = time.monotonic() + 120
            while len(results) < 16:  # every client has finished a request: both workers are busy
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
            proc_b.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc_b.wait, 150)
            after = len(results)
            while len(results) < after + 16:  # the fleet goes on with one worker
                assert time.monotonic() < deadline + 150
                await asyncio.sleep(0.2)
            stop.set()
            await asyncio.gather(*clients)
            assert code == 0, proc_b.said()[-3000:]
            return results

        results = asyncio.run(main())
        failed = [r for r in results if r != "ok"]
        assert not failed, failed[:5]
        said = proc_b.said()
        m = re.search(r"SIGTERM: draining \((\d+) requests to finish", said)
        assert m and int(m.group(1)) > 0, said[-3000:]  # it was stopped with requests under way
        assert "drained in" in said
        assert metric(base, "tokenmill:router_worker_losses_total") == 0  # a planned departure
        # Stopping an idle worker is planned too: it says it drains before it goes.
        proc_a.send_signal(signal.SIGTERM)
        assert proc_a.wait(60) == 0
        time.sleep(1.0)
        assert metric(base, "tokenmill:router_worker_losses_total") == 0


def test_a_killed_router_started_again_has_its_index_before_it_serves() -> None:
    """The workers keep their caches while the router is gone; the new router reads each worker's whole
    state (their replay buffers have long turned over: 4 batches) before it reports ready, and credits
    cached prefixes from its first request."""
    stories = [
        f"Chapter {i}. " + "The river ran past the mill and the miller counted sacks of grain. " * 12
        for i in range(3)
    ]
    args = ("--kv-events-buffer-steps", "4", "--max-num-seqs", "8")
    with (
        worker_process(*args, *events_args()) as (url_a, _),
        worker_process(*args, *events_args()) as (url_b, _),
    ):
        fleet = ("--worker-url", url_a, "--worker-url", url_b)
        with running_server(*fleet) as first:
            for story in stories:
                for question in ("Who counted?", "What ran past?"):
                    body = {"model": "smollm2-135m", "prompt": story + question, "max_tokens": 2}
                    assert (
                        httpx.post(f"{first.base_url}/v1/completions", json=body, timeout=120).status_code
                        == 200
                    )
            held, seen = -1.0, time.monotonic()
            while time.monotonic() - seen < 1.0:  # the last events have arrived: no change for a second
                now = metric(first.base_url, "tokenmill:router_indexed_blocks")
                if now != held:
                    held, seen = now, time.monotonic()
                time.sleep(0.1)
            assert held >= 3 * 8  # each story is some 10 blocks of 16 tokens
            first.kill()  # no goodbye: the workers see their front vanish
            first.wait(30)
        started = time.monotonic()
        with running_server(*fleet) as second:
            ready_s = time.monotonic() - started
            base = second.base_url
            assert metric(base, "tokenmill:router_indexed_blocks") == held  # before any request
            credited = metric(base, "tokenmill:router_overlap_blocks_total")

            async def load() -> list[int]:
                async with httpx.AsyncClient(base_url=base, timeout=120) as c:
                    bodies = [
                        {"model": "smollm2-135m", "prompt": s + "Where was the mill?", "max_tokens": 4}
                        for s in stories
                    ] * 3
                    return [
                        r.status_code
                        for r in await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
                    ]

            assert asyncio.run(load()) == [200] * 9
            # every story's prefix was credited where it is cached: prefix hits resume at once
            assert metric(base, "tokenmill:router_overlap_blocks_total") - credited >= 9 * 8
        print(f"router restarted: ready in {ready_s:.1f}s with {held:.0f} blocks indexed")
