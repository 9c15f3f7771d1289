"""Requests that used to take the service down, or get a 500, against the real server (issue #11).

One server with an API key and the example model repository: every killer request is followed by a
normal one that must succeed; malformed input gets a 400 in the protocol's own error shape; the key
guards HTTP /v1, /v2 and gRPC alike; compressed bodies are capped.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_fixture import example_repository, free_port, running_server

pytestmark = pytest.mark.slow

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = example_repository(tmp_path_factory.mktemp("repo"))
    grpc_port = free_port()
    with running_server(
        "--model-repository", str(root), "--grpc-port", str(grpc_port), "--max-num-seqs", "8",
        "--max-queued-requests", "8", api_key=KEY,
    ) as proc:  # fmt: skip
        proc.grpc_url = f"127.0.0.1:{grpc_port}"
        yield proc


def chat(base: str, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Say one word."}], "max_tokens": 4, **extra}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def assert_still_serving(base: str) -> None:
    r = chat(base, temperature=0)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert httpx.get(f"{base}/v1/health/live").status_code == 200


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 1, "repetition_penalty": 1e-300},  # NaN probabilities, once
        {"temperature": 1, "top_k": 10000000000000000000},  # int64 overflow, once
        {"stop_token_ids": [1000000], "min_tokens": 2},  # IndexError, once
        {"stop_token_ids": [-1000000], "min_tokens": 2},
        {"temperature": 1e-300},  # a temperature that underflows float32
        {"logit_bias": {"5": 100, "6": -100}, "temperature": 1, "repetition_penalty": 1e-30},
    ],
    ids=["tiny-rep-penalty", "huge-top-k", "stop-id-past-vocab", "negative-stop-id", "tiny-temp", "bias"],
)
def test_killer_requests_fail_alone(server, extra: dict) -> None:
    r = chat(server.base_url, **extra)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        err = r.json()["error"]
        assert err["code"] == 400 and "Traceback" not in err["message"] and "/" not in err["message"]
    assert_still_serving(server.base_url)


def raw_post(base: str, path: str, body: bytes) -> httpx.Response:
    headers = {**AUTH, "Content-Type": "application/json"}
    return httpx.post(f"{base}{path}", content=body, headers=headers, timeout=60)


def chat_body(**extra) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **extra}).encode()


SCHEMA_OF_NUMBER_TYPE = {"name": "s", "schema": {"type": 7}}  # `type` must name a JSON type

BAD_BODIES = {
    "deep-nesting": ("/v1/completions", b"[" * 100_000),
    "deep-object": ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    "seed-2**64": ("/v1/completions", b'{"prompt": "hi", "seed": 18446744073709551616}'),
    "seed-below-int64": ("/v1/completions", b'{"prompt": "hi", "seed": -9223372036854775809}'),
    "priority-2**64": ("/v1/completions", b'{"prompt": "hi", "priority": 18446744073709551616}'),
    "stop-id-2**70": ("/v1/completions", b'{"prompt": "hi", "stop_token_ids": [1180591620717411303424]}'),
    "logit-bias-key": ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"99999999999999999999999": 1}}'),
    "surrogate-content": ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    "surrogate-prompt": ("/v1/completions", b'{"prompt": "\\ud800"}'),
    "surrogate-stop": ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"]}'),
    "surrogate-model": ("/v1/completions", b'{"prompt": "hi", "model": "\\ud800"}'),
    "tokenize-empty-message": ("/tokenize", b'{"messages": [{}]}'),
    "tokenize-surrogate": ("/tokenize", b'{"prompt": "\\udfff"}'),
    "infinite-temperature": ("/v1/completions", b'{"prompt": "hi", "temperature": 1e999}'),
    "tool-name": (
        "/v1/chat/completions",
        chat_body(tools=[{"type": "function", "function": {"name": "a b"}}]),
    ),
    "response-format": ("/v1/chat/completions", chat_body(response_format={"type": "xml"})),
    "bad-schema": (
        "/v1/chat/completions",
        chat_body(response_format={"type": "json_schema", "json_schema": SCHEMA_OF_NUMBER_TYPE}),
    ),
    "image-part": (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
    ),
    "n-times-prompts": ("/v1/completions", json.dumps({"prompt": ["hi"] * 1000, "n": 2}).encode()),
}


@pytest.mark.parametrize("case", list(BAD_BODIES), ids=list(BAD_BODIES))
def test_malformed_input_gets_a_400_in_openai_shape(server, case: str) -> None:
    path, body = BAD_BODIES[case]
    r = raw_post(server.base_url, path, body)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]


def test_tokenize_list_content_and_null_assistant_content(server) -> None:
    base = server.base_url
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
        {"role": "assistant", "content": None},  # valid OpenAI: an assistant turn that carried tool calls
        {"role": "user", "content": "And now?"},
    ]
    r = raw_post(base, "/tokenize", httpx.Request("POST", "/", json={"messages": msgs}).content)
    assert r.status_code == 200 and r.json()["count"] > 0, r.text
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 200, r.text


def test_v2_without_key_answers_in_kserve_shape_for_tritonclient(server) -> None:
    import tritonclient.http as tc
    from tritonclient.utils import InferenceServerException

    url = server.base_url.removeprefix("http://")
    with pytest.raises(InferenceServerException, match="API key"):
        tc.InferenceServerClient(url).get_model_repository_index()
    assert tc.InferenceServerClient(url).is_server_live()  # health stays open
    index = tc.InferenceServerClient(url).get_model_repository_index(headers=AUTH)
    assert any(m["name"] == "linear_onnx" for m in index)


def test_grpc_requires_the_key(server) -> None:
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException

    c = tg.InferenceServerClient(server.grpc_url)
    assert c.is_server_live()  # health stays open
    with pytest.raises(InferenceServerException, match="API key"):
        c.unload_model("linear_onnx")
    with pytest.raises(InferenceServerException, match="API key"):
        c.get_model_repository_index()
    auth = {"authorization": f"Bearer {KEY}"}
    assert c.is_model_ready("linear_onnx", headers=auth)
    assert any(m.name == "linear_onnx" for m in c.get_model_repository_index(headers=auth).models)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_gzip_bomb_is_refused_without_inflating_it(server) -> None:
    # 1 GiB of zeros compresses to ~1 MB; the server caps inflation at its body limit (64 MiB).
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(1 << 24)
    bomb = b"".join(z.compress(chunk) for _ in range(64)) + z.flush()
    assert len(bomb) < 2 << 20
    before = rss_mb(server.pid)
    r = httpx.post(
        f"{server.base_url}/v2/models/linear_onnx/infer",
        content=bomb,
        headers={**AUTH, "Content-Encoding": "gzip", "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and "limit" in r.json()["error"], r.text
    # The same bomb with its size trailer forged to 1 KiB: refused by the capped inflation instead.
    forged = bomb[:-4] + (1024).to_bytes(4, "little")
    r = httpx.post(
        f"{server.base_url}/v2/models/linear_onnx/infer",
        content=forged,
        headers={**AUTH, "Content-Encoding": "gzip", "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and "limit" in r.json()["error"], r.text
    assert rss_mb(server.pid) - before < 200, "the bomb was not inflated in memory"
    # A small honest gzip body still works.
    body = {"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    ok = httpx.post(
        f"{server.base_url}/v2/models/linear_onnx/infer",
        content=gzip.compress(httpx.Request("POST", "/", json=body).content),
        headers={**AUTH, "Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert ok.status_code == 200, ok.text
    w = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 2.0]])  # examples/make_onnx_model.py
    expected = np.array([1.0, 2.0, 3.0, 4.0]) @ w + np.array([0.5, -0.5])
    np.testing.assert_allclose(ok.json()["outputs"][0]["data"], expected, rtol=1e-5)


def test_oversized_body_gets_413(server) -> None:
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        content=b" " * (65 << 20),
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_accepted_connections_send_at_once() -> None:
    """The listening socket has TCP_NODELAY, which connections accepted from it inherit: a body written
    after its headers is not held by Nagle until the client's delayed ACK (that cost 40 ms on each
    keep-alive GET after the first few)."""
    import socket

    from tokenmill.server.main import listen_socket

    server = listen_socket("127.0.0.1", 0, "--port")
    try:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        with client, conn:
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        server.close()
