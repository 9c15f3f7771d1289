"""Routers of other projects (from PyPI, Rust, written by others) in front of tokenmill servers.

vLLM's router (vllm-router):

- kv_aware: the router subscribes to each server's KV events (vLLM's wire format, ZeroMQ), decodes them
  with its own decoder, indexes them by their token ids, and sends a prompt to the server holding its
  prefix. Checked by the router's own counters (placement hits) and by the servers' prefix-cache hits.
- P/D: the router sends a prompt to a prefill server with vLLM's kv_transfer_params, hands the answer's
  kv_transfer_params to a decode server, which reads the prompt's blocks instead of computing them
  (counted in its /metrics). Greedy text equals one server's.

SGLang's router (sglang-router) reads a worker's model from /get_server_info and serves its requests;
the other probes routers and gateways send (vLLM's and SGLang's names) answer in their shapes.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from importlib.util import find_spec
from pathlib import Path

import httpx
import pytest
from server_fixture import free_port, running_server

import tokenmill

pytestmark = pytest.mark.slow
needs_vllm_router = pytest.mark.skipif(find_spec("vllm_router") is None, reason="dev dependency vllm-router")

MODEL = "smollm2-135m"


def scrape(url: str, prefix: str) -> dict[str, float]:
    """The samples of /metrics whose name starts with `prefix`, by their whole series name."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(prefix) and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def total(url: str, name: str) -> float:
    return sum(v for k, v in scrape(url, name).items() if k.split("{")[0] == name)


@contextmanager
def vllm_router(*args: str) -> Iterator[tuple[str, str]]:
    """vllm-router on free loopback ports: its URL and that of its Prometheus listener."""
    with router_process("vllm_router", "--worker-startup-check-interval", "1", *args) as urls:
        yield urls


@contextmanager
def router_process(module: str, *args: str) -> Iterator[tuple[str, str]]:
    port, prom = free_port(), free_port()
    cmd = [sys.executable, "-m", f"{module}.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"{module} exited: {proc.stdout.read() if proc.stdout else ''}"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{module} did not start"
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
    """A prefill server and a decode server, each publishing KV events: (url, events, replay) each. The
    decode server reads from the prefill server's transfer port, named in its --kv-transfer-peers."""
    out = []
    transfer = free_port()
    peers = {
        "prefill": ["--kv-transfer-port", str(transfer)],
        "decode": ["--kv-transfer-peers", f"127.0.0.1:{transfer}"],
    }
    with ExitStack() as stack:
        for role in ("prefill", "decode"):
            ev, rp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            args = ["--dtype", "float32", "--threads", "1", "--kv-role", role, *peers[role], "--kv-events"]
            args += ["--kv-events-endpoint", ev, "--kv-events-replay-endpoint", rp]
            srv = stack.enter_context(running_server(*args))
            out.append((srv.base_url, ev, rp))
        yield out


PREAMBLE = "You are the referee of a long game. Its rules are many and each one matters to the end. " * 6


@needs_vllm_router
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
                time.sleep(2.0)  # the first prompt's events reach the router before the next one
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


@needs_vllm_router
def test_kv_aware_reads_the_host_tiers_events_too() -> None:
    """A prompt's blocks evicted from the pool to the host tier: the events say so (BlockRemoved of the
    device pool, BlockStored with medium CPU), and the router still credits the prompt (at its host-tier
    rate) where the server loads the blocks back from host memory."""
    ev, rp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    small = ["--dtype", "float32", "--threads", "1", "--max-model-len", "512", "--kv-cache-memory-gb", "0.03"]
    events = ["--kv-events", "--kv-events-endpoint", ev, "--kv-events-replay-endpoint", rp]
    with running_server(*small, "--kv-offload", "host=64MB", *events) as srv:
        url = srv.base_url
        args = ["--policy", "kv_aware", "--worker-urls", url, "--kv-event-model", MODEL]
        args += ["--kv-event-source", f"{url}={ev}", "--kv-event-replay-source", f"{url}={rp}"]
        with vllm_router(*args) as (router, prom):

            def send(prompt: str) -> dict:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
                r = httpx.post(f"{router}/v1/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                return r.json()["usage"]

            first = send(PREAMBLE)
            for i in range(12):  # 12 prompts of ~8 blocks through a pool of ~40: the first one's are evicted
                send(f"Filler prompt number {i}, other words to push the pool's blocks out. " * 7)
            time.sleep(1.0)
            hits = scrape(prom, "vllm_router_kv_placement_lookups_total")
            again = send(PREAMBLE)
            after = scrape(prom, "vllm_router_kv_placement_lookups_total")
        loaded = scrape(url, "tokenmill:kv_offload_loaded_blocks_total")
    full = (first["prompt_tokens"] - 1) // 16
    assert loaded[f'tokenmill:kv_offload_loaded_blocks_total{{model_name="{MODEL}",tier="host"}}'] >= full
    assert again["prompt_tokens_details"]["cached_tokens"] == full * 16
    hit = 'vllm_router_kv_placement_lookups_total{result="hit"}'
    assert after.get(hit, 0) == hits.get(hit, 0) + 1, (hits, after)


@needs_vllm_router
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
    # The decode server read the prompts' full blocks (but the last token's) from the prefill server: all
    # of the completion's, and the chat's past what it held already (the template's system prompt may be).
    read = total(dec, "tokenmill:kv_transfer_read_blocks_total") - read0
    prompts = [r.json()["usage"]["prompt_tokens"], c.json()["usage"]["prompt_tokens"]]
    assert read > (prompts[0] - 1) // 16, (read, prompts)


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
    # The same answer with its own prompt, after the prefill server let its blocks go (the decode server
    # said it did not need them): the read is refused, the prompt recomputed, the failure counted.
    fail0 = total(dec, "tokenmill:kv_transfer_read_failures_total")
    got = httpx.post(f"{dec}/v1/completions", json={**body, "kv_transfer_params": kt}, timeout=120).json()
    want = httpx.post(f"{pre}/v1/completions", json=body, timeout=120).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert total(dec, "tokenmill:kv_transfer_read_failures_total") == fail0 + 1
    for bad, says in [
        ({"do_remote_prefill": True}, "remote_host"),
        ({"do_remote_decode": "yes"}, "do_remote_decode"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, "exclusive"),
        ({**kt, "remote_block_size": 32}, "block_size"),
        ({**kt, "remote_host": "not a host/"}, "not a prefill server this one reads from"),
    ]:
        r = httpx.post(f"{dec}/v1/completions", json={**body, "kv_transfer_params": bad}, timeout=60)
        assert r.status_code in (400, 403) and says in r.json()["error"]["message"], (bad, r.text)
    # Without the workers' secret, a client may send the decode server to read only from the prefill
    # servers it names: anyone else could answer with KV of their own making.
    elsewhere = {**kt, "remote_port": kt["remote_port"] + 1}
    r = httpx.post(f"{dec}/v1/completions", json={**body, "kv_transfer_params": elsewhere}, timeout=60)
    assert r.status_code == 403 and "--kv-transfer-peers" in r.json()["error"]["message"]
    r = httpx.post(f"{pre}/v1/completions", json={**body, "n": 2, "kv_transfer_params": nixl}, timeout=60)
    assert r.status_code == 400 and "n=1" in r.json()["error"]["message"]


@pytest.mark.skipif(find_spec("sglang_router") is None, reason="dev dependency sglang-router")
def test_sglang_router_names_the_model_and_serves_it(pair) -> None:
    (url, _, _), _ = pair
    with router_process("sglang_router", "--worker-urls", url) as (router, _):
        deadline = time.monotonic() + 30
        while True:  # it registers its workers in the background, after it answers /health
            workers = httpx.get(f"{router}/workers", timeout=10).json()["workers"]
            if workers and workers[0]["is_healthy"] or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert [w["model_id"] for w in workers] == [MODEL] and workers[0]["is_healthy"]
        assert workers[0]["metadata"]["served_model_name"] == MODEL
        models = httpx.get(f"{router}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == [MODEL]
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert (
        r.json()["choices"][0]["text"]
        == httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
    )


def test_the_probes_routers_send(pair) -> None:
    (url, ev, rp), _ = pair
    assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200
    assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200  # the answer of a second ago
    assert httpx.get(f"{url}/version").json() == {"version": tokenmill.__version__}
    info = httpx.get(f"{url}/get_model_info").json()
    assert info["served_model_name"] == MODEL and info["is_generation"] and info["model_type"] == "llama"
    assert Path(info["model_path"]).exists()  # a path on this host, not a name to look up on a hub
    server = httpx.get(f"{url}/get_server_info").json()
    assert server["served_model_name"] == MODEL and server["page_size"] == 16 and server["dp_size"] == 1
    assert server["kv_events"] == {"endpoint": ev, "replay_endpoint": rp, "topic": ""}
    assert server["disaggregation_mode"] == "prefill"
    (load,) = httpx.get(f"{url}/get_loads").json()["loads"]
    assert load["dp_rank"] == 0 and load["max_total_num_tokens"] == server["max_total_num_tokens"]
    # What a request would run on: the same ids /tokenize gives, and a generation counts.
    prompt = "Rendering gives the token ids a request would run on."
    render = httpx.post(f"{url}/v1/completions/render", json={"model": MODEL, "prompt": prompt}).json()
    tok = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"]
    assert render == {"token_ids": tok, "features": None}
    messages = [{"role": "user", "content": prompt}]
    render = httpx.post(f"{url}/v1/chat/completions/render", json={"model": MODEL, "messages": messages})
    tok = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    assert render.json()["token_ids"] == tok
    chat = httpx.post(
        f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1}
    )
    assert chat.json()["usage"]["prompt_tokens"] == len(tok)
    # Flushing the cache forgets the prefix: the same prompt again finds nothing cached.
    body = {"model": MODEL, "prompt": PREAMBLE, "max_tokens": 1}
    httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert (
        httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]
        > 0
    )
    flushed = httpx.post(f"{url}/flush_cache")
    assert flushed.status_code == 200
    again = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # vLLM's names for the gauges gateway schedulers read, beside ours.
    metrics = scrape(url, "")  # one scrape: the two names read the same stats
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        series = f'{{model_name="{MODEL}"}}'
        assert metrics[f"vllm:{name}{series}"] == metrics[f"tokenmill:{name}{series}"]
    assert any(k.startswith("vllm:cache_config_info{") and 'block_size="16"' in k for k in metrics)
