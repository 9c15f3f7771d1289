"""vLLM's own router (vllm-router, from PyPI: Rust, written by others) in front of tokenmill servers.

- kv_aware: the router subscribes to each server's KV events (vLLM's wire format, ZeroMQ), decodes them
  with its own decoder, indexes them by their token ids, and sends a prompt to the server holding its
  prefix. Checked by the router's own counters (placement hits) and by the servers' prefix-cache hits.
- P/D: the router sends a prompt to a prefill server with vLLM's kv_transfer_params, hands the answer's
  kv_transfer_params to a decode server, which reads the prompt's blocks instead of computing them
  (counted in its /metrics). Greedy text equals one server's.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from importlib.util import find_spec

import httpx
import pytest
from server_fixture import free_port, running_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_spec("vllm_router") is None, reason="dev dependency vllm-router"),
]

MODEL = "smollm2-135m"


def scrape(url: str, prefix: str) -> dict[str, float]:
    """The samples of /metrics whose name starts with `prefix`, by their whole series name."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def total(url: str, name: str) -> float:
    return sum(v for k, v in scrape(url, name).items() if k.split("{")[0] == name)


@contextmanager
def vllm_router(*args: str) -> Iterator[tuple[str, str]]:
    """vllm-router on free loopback ports: its URL and that of its Prometheus listener."""
    port, prom = free_port(), free_port()
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prometheus-host", "127.0.0.1"]
    cmd += ["--prometheus-port", str(prom), "--worker-startup-check-interval", "1", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"vllm-router exited: {proc.stdout.read() if proc.stdout else ''}"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vllm-router did not start"
            time.sleep(0.3)
        yield url, f"http://127.0.0.1:{prom}"
    finally:
        proc.terminate()  # by its handle: it renames its process (setproctitle), so no name finds it
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def pair() -> Iterator[list[tuple[str, str, str]]]:
    """A prefill server and a decode server, each publishing KV events: (url, events, replay) each."""
    out = []
    with ExitStack() as stack:
        for role in ("prefill", "decode"):
            ev, rp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            srv = stack.enter_context(
                running_server(
                    "--dtype",
                    "float32",
                    "--threads",
                    "1",
                    "--kv-role",
                    role,
                    "--kv-events",
                    "--kv-events-endpoint",
                    ev,
                    "--kv-events-replay-endpoint",
                    rp,
                )  # fmt: skip
            )
            out.append((srv.base_url, ev, rp))
        yield out


PREAMBLE = "You are the referee of a long game. Its rules are many and each one matters to the end. " * 6


def test_kv_aware_sends_a_repeated_prefix_to_the_server_holding_it(pair) -> None:
    urls = [u for u, _, _ in pair]
    args = ["--policy", "kv_aware", "--worker-urls", *urls, "--kv-event-model", MODEL]
    args += ["--kv-event-block-size", "16"]
    for url, ev, rp in pair:
        args += ["--kv-event-source", f"{url}={ev}", "--kv-event-replay-source", f"{url}={rp}"]
    served0 = [total(u, "tokenmill:request_success_total") for u in urls]
    with vllm_router(*args) as (router, prom):
        for i in range(5):
            body = {"model": MODEL, "prompt": f"{PREAMBLE} Question {i}: who wins?", "max_tokens": 2}
            r = httpx.post(f"{router}/v1/completions", json={**body, "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            if i == 0:
                time.sleep(1.0)  # the first prompt's events reach the router before the next one
        chat = {"model": MODEL, "messages": [{"role": "user", "content": PREAMBLE}], "max_tokens": 2}
        for _ in range(2):
            assert httpx.post(f"{router}/v1/chat/completions", json=chat, timeout=120).status_code == 200
            time.sleep(1.0)
        lookups = scrape(prom, "vllm_router_kv_placement_lookups_total")
    hits = lookups.get('vllm_router_kv_placement_lookups_total{result="hit"}', 0)
    # The router credited the prefix it learned from our events: every completion after the first, and
    # the chat sent a second time.
    assert hits >= 5, lookups
    served = [total(u, "tokenmill:request_success_total") - s for u, s in zip(urls, served0, strict=True)]
    assert sorted(served)[-1] >= 5, served  # the repeated prompts went where their prefix was


def test_vllm_router_pd_drives_a_tokenmill_prefill_and_decode_pair(pair) -> None:
    (pre, _, _), (dec, _, _) = pair
    read0 = total(dec, "tokenmill:kv_transfer_read_blocks_total")
    args = ["--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", pre, "--decode", dec]
    args += ["--policy", "round_robin"]
    prompt = "In the valley of the three rivers the harvest came late that year, and the mills " * 5
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt + "?"}], "max_tokens": 12}
    with vllm_router(*args) as (router, _):
        r = httpx.post(f"{router}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        c = httpx.post(f"{router}/v1/chat/completions", json={**chat, "temperature": 0}, timeout=120)
        assert c.status_code == 200, c.text
    # One server computing all of it (the prefill server, without kv_transfer_params) is the reference.
    want = httpx.post(f"{pre}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    assert r.json()["choices"][0]["text"] == want
    want_chat = httpx.post(f"{pre}/v1/chat/completions", json={**chat, "temperature": 0}, timeout=120)
    assert c.json()["choices"][0]["message"] == want_chat.json()["choices"][0]["message"]
    # The decode server read both prompts' full blocks (but the last token's) from the prefill server.
    read = total(dec, "tokenmill:kv_transfer_read_blocks_total") - read0
    prompts = [r.json()["usage"]["prompt_tokens"], c.json()["usage"]["prompt_tokens"]]
    assert read >= sum((n - 1) // 16 for n in prompts), (read, prompts)


def test_kv_transfer_params_in_vllms_shape_and_their_errors(pair) -> None:
    (pre, _, _), (dec, _, _) = pair
    prompt = "A prompt about the sea, its fishes and the boats that go after them at dawn. " * 5
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    nixl = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}
    p = httpx.post(f"{pre}/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": nixl})
    kt = p.json()["kv_transfer_params"]
    assert kt["do_remote_prefill"] and not kt["do_remote_decode"] and kt["tp_size"] == 1
    assert len(kt["remote_block_ids"]) == p.json()["usage"]["prompt_tokens"] // 16
    assert isinstance(kt["remote_host"], str) and isinstance(kt["remote_port"], int)
    # The answer passed on with another prompt (a proxy's mistake): not read, recomputed, counted.
    other = {**body, "prompt": "Something else entirely, about mountains and their snow. " * 6}
    mism0 = total(dec, "tokenmill:kv_transfer_mismatched_prompts_total")
    got = httpx.post(f"{dec}/v1/completions", json={**other, "kv_transfer_params": kt}, timeout=120).json()
    want = httpx.post(f"{pre}/v1/completions", json=other, timeout=120).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert total(dec, "tokenmill:kv_transfer_mismatched_prompts_total") == mism0 + 1
    for bad, says in [
        ({"do_remote_prefill": True}, "remote_host"),
        ({"do_remote_decode": "yes"}, "do_remote_decode"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, "exclusive"),
        ({**kt, "remote_block_size": 32}, "block_size"),
        ({**kt, "remote_host": "not a host/"}, "endpoint"),
    ]:
        r = httpx.post(f"{dec}/v1/completions", json={**body, "kv_transfer_params": bad}, timeout=60)
        assert r.status_code == 400 and says in r.json()["error"]["message"], (bad, r.text)
    r = httpx.post(f"{pre}/v1/completions", json={**body, "n": 2, "kv_transfer_params": nixl}, timeout=60)
    assert r.status_code == 400 and "n=1" in r.json()["error"]["message"]
