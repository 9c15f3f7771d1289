"""Server behaviour: metrics, client disconnect, overload (429), API key, SIGTERM drain, engine death."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time

import httpx
import openai
import pytest
from server_fixture import running_server

pytestmark = pytest.mark.slow


def metric(text: str, name: str, default: float | None = None, **labels: str) -> float:
    for line in text.splitlines():
        named = line.startswith(name) and line[len(name)] in " {"
        if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default  # a labelled series appears only once something is counted in it
    raise AssertionError(f"metric {name} {labels} not found")


def wait_until(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def server():
    with running_server("--max-num-seqs", "4", "--max-queued-requests", "4") as proc:
        yield proc


def test_metrics_reflect_requests(server) -> None:
    base = server.base_url
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    before = httpx.get(f"{base}/metrics").text
    n0 = metric(before, "tokenmill:request_success_total", 0.0, finished_reason="length")
    g0 = metric(before, "tokenmill:generation_tokens_total", 0.0)
    prompt = "A shared system prompt for the prefix cache. " * 6
    for _ in range(3):
        c.completions.create(
            model="smollm2-135m", prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True}
        )
    text = httpx.get(f"{base}/metrics").text
    assert metric(text, "tokenmill:request_success_total", finished_reason="length") == n0 + 3
    assert metric(text, "tokenmill:generation_tokens_total") == g0 + 15
    assert metric(text, "tokenmill:time_to_first_token_seconds_count") >= 3
    assert metric(text, "tokenmill:inter_token_latency_seconds_count") >= 12
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time"):
        assert metric(text, f"tokenmill:{name}_seconds_count") >= 3
    assert metric(text, "tokenmill:prefix_cache_hits_total") > 0
    assert metric(text, "tokenmill:prefix_cache_queries_total") >= metric(
        text, "tokenmill:prefix_cache_hits_total"
    )
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "queue_to_compute_ratio",
    ):
        metric(text, f"tokenmill:{name}")
    metric(text, "tokenmill:num_preemptions_total")
    # The engine runs its forward passes on at least one of the cores it may use (fewer while the
    # thread governor sees a neighbour), and says so.
    assert 1 <= metric(text, "tokenmill:engine_threads") <= len(os.sched_getaffinity(0))
    assert metric(text, "tokenmill:engine_thread_changes_total") >= 0


def test_disconnect_mid_stream_aborts_and_frees_blocks(server) -> None:
    base = server.base_url
    body = {"prompt": "Tell a very long story.", "max_tokens": 900, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break  # hang up mid-stream
    text = ""

    def idle() -> bool:
        nonlocal text
        text = httpx.get(f"{base}/metrics").text
        return metric(text, "tokenmill:num_requests_running") == 0

    assert wait_until(idle), "the aborted request should leave the engine at once"
    assert metric(text, "tokenmill:kv_cache_usage_perc") == 0
    assert metric(text, "tokenmill:request_success_total", finished_reason="abort") >= 1


def test_overload_gets_429_with_retry_after(server) -> None:
    # capacity = max_num_seqs 4 + max_queued 4 = 8 requests in flight.
    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"prompt": "Count:", "max_tokens": 60, "ignore_eos": True}
            return await asyncio.gather(
                *(c.post(f"{server.base_url}/v1/completions", json=body) for _ in range(20))
            )

    res = asyncio.run(main())
    codes = [r.status_code for r in res]
    assert codes.count(200) >= 8 and 429 in codes
    rejected = next(r for r in res if r.status_code == 429)
    assert rejected.headers["retry-after"] and rejected.json()["error"]["code"] == 429


def test_tokenize_is_under_admission(server) -> None:
    """/tokenize does work and holds a place like a generation (issue 51 item 5): at capacity it gets a
    429 with Retry-After, and a 200 again once there is room."""
    base = server.base_url
    tokenize = {"model": "smollm2-135m", "prompt": "How many tokens is this?"}

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"prompt": "Count:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            async with contextlib.AsyncExitStack() as streams:
                for _ in range(8):  # capacity: max_num_seqs 4 + max_queued 4
                    r = await streams.enter_async_context(
                        c.stream("POST", f"{base}/v1/completions", json=body)
                    )
                    assert r.status_code == 200
                full = await c.post(f"{base}/tokenize", json=tokenize)
            # The streams hung up: their places come back once the server sees it.
            deadline = time.monotonic() + 30
            while (after := await c.post(f"{base}/tokenize", json=tokenize)).status_code == 429:
                assert time.monotonic() < deadline, "places never came back"
                await asyncio.sleep(0.1)
            return full, after

    full, after = asyncio.run(main())
    assert full.status_code == 429 and full.headers["retry-after"], full.text
    assert full.json()["error"]["code"] == 429
    assert after.status_code == 200 and after.json()["count"] > 0, after.text


def test_api_key() -> None:
    with running_server("--max-num-seqs", "4", api_key="s3cret") as srv:
        base = srv.base_url
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{base}/health").status_code == 200  # health stays open
        assert httpx.get(f"{base}/v1/health/ready").status_code == 200
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        assert c.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0).models.list()


def test_sigterm_drains_in_flight_requests() -> None:
    with running_server("--max-num-seqs", "4", "--drain-timeout", "60") as srv:
        base = srv.base_url

        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                # Long enough to be still running when the late request comes (~15 ms a token here:
                # 80 tokens were over before it at 70 tok/s, and the drained server had exited).
                body = {"prompt": "Story:", "max_tokens": 400, "ignore_eos": True}
                inflight = asyncio.create_task(c.post(f"{base}/v1/completions", json=body))
                await asyncio.sleep(1.0)
                srv.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                late = await c.post(f"{base}/v1/completions", json={**body, "max_tokens": 4})
                ready = await c.get(f"{base}/v1/health/ready")
                return await inflight, late, ready

        done, late, ready = asyncio.run(main())
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 400
        # While draining the socket stays open: new work gets 503 with Retry-After, not a refusal.
        assert late.status_code == 503 and late.headers["Retry-After"]
        assert ready.status_code == 503 and ready.json()["message"] == "draining"
        assert srv.wait(timeout=60) == 0


def test_engine_death_is_detected() -> None:
    with running_server("--max-num-seqs", "4") as srv:
        base = srv.base_url
        pid = httpx.get(f"{base}/v1/metadata").json()["engine_pid"]

        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"prompt": "Story:", "max_tokens": 800, "ignore_eos": True}
                inflight = asyncio.create_task(c.post(f"{base}/v1/completions", json=body))
                await asyncio.sleep(1.0)
                import os

                os.kill(pid, signal.SIGKILL)
                return await inflight

        r = asyncio.run(main())
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        assert httpx.get(f"{base}/v1/health/ready").status_code == 503
        assert httpx.get(f"{base}/v1/health/live").status_code == 503, "a dead engine is not live"
        assert httpx.get(f"{base}/health").status_code == 503
        after = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert after.status_code == 503
        text = httpx.get(f"{base}/metrics").text
        assert re.search(r"tokenmill:engine_healthy\{[^}]*\} 0\.0", text)
        # Both refusals counted: the one in flight when the engine died and the one after it.
        assert re.search(
            r'tokenmill:request_failure_total\{[^}]*kind="engine_unavailable"[^}]*\} 2\.0', text
        ), text


def test_non_streaming_disconnect_aborts(server) -> None:
    base = server.base_url
    body = {"prompt": "Tell a very long story.", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, timeout=1.5)  # the client gives up and hangs up

    def idle() -> bool:
        return metric(httpx.get(f"{base}/metrics").text, "tokenmill:num_requests_running") == 0

    assert wait_until(idle), "a non-streaming request is aborted when its client disconnects"
