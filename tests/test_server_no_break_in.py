"""Nobody breaks in, nothing wedges (issue #51): against the real server, with real clients.

- Model names in the repository API are plain names of folders in the repository: `..`, paths and
  symlinks out of it load nothing (their model.py never runs) and answer as any unknown name does.
- A 5,000-digit integer or a 100,000-deep body is a 400 in the protocol's own shape, never a 500.
- Tool-call arguments handed to clients are JSON (no NaN or Infinity).
- Error messages name no ipc:// socket; /v1/metadata has no engine pid when an API key is set; a
  string sequence_id gets a clear error and later sequence requests still run.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_fixture import example_repository, free_port, running_server

from tokenmill.server.tool_calls import ArrayParser, HermesParser, parse_complete

pytestmark = pytest.mark.slow

KEY = "open-sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = {"authorization": f"Bearer {KEY}"}

# A Python model whose import leaves a file beside it: proof that the server ran it.
EVIL_MODEL = """
import pathlib
pathlib.Path(__file__).with_name("RAN").write_text("ran")


class TritonPythonModel:
    def execute(self, requests):
        return []
"""
EVIL_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def plant(folder: Path) -> Path:
    """A loadable model in `folder` (config without a name: it takes the folder's); its RAN marker."""
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(EVIL_CONFIG)
    (folder / "1" / "model.py").write_text(EVIL_MODEL)
    return folder / "1" / "RAN"


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("breakin")
    root = example_repository(base)  # base/model_repository
    markers = [plant(base), plant(base / "outside" / "evil")]  # <repo>/.. and a folder beside it
    (root / "escape").symlink_to(base / "outside" / "evil", target_is_directory=True)
    return {"base": base, "root": root, "outside": base / "outside" / "evil", "markers": markers}


@pytest.fixture(scope="module")
def server(layout):
    grpc_port = free_port()
    with running_server(
        "--model-repository", str(layout["root"]), "--model-control-mode", "explicit",
        "--load-model", "*", "--grpc-port", str(grpc_port), api_key=KEY,
    ) as proc:  # fmt: skip
        proc.grpc_url = f"127.0.0.1:{grpc_port}"
        yield proc


def grpc_client(server):
    tg = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is a dependency")
    return tg, tg.InferenceServerClient(server.grpc_url)


def nothing_ran(layout) -> None:
    ran = [str(m) for m in layout["markers"] if m.exists()]
    assert not ran, f"a model.py outside the repository ran: {ran}"


# --- item 2: names that leave the repository ------------------------------------------------------


@pytest.mark.parametrize("name", ["%2e%2e", "..", "escape", "%2e", "a%5c..%5c..", "x%00y"])
def test_http_load_of_a_name_outside_the_repository_runs_nothing(server, layout, name: str) -> None:
    url = f"{server.base_url}/v2/repository/models/{name}/load"
    r = httpx.post(url, headers=AUTH, timeout=60)
    assert r.status_code in (400, 404), (r.status_code, r.text)
    assert set(r.json()) == {"error"}
    assert "no such model" in r.json()["error"] or r.status_code == 404, r.text
    nothing_ran(layout)


def test_http_model_routes_give_no_existence_oracle(server, layout) -> None:
    # `..` is a folder that exists; `nonexistent` is not: the answers must not differ.
    for route in ("", "/ready", "/config", "/stats"):
        answers = set()
        for name in ("%2e%2e", "escape", "nonexistent"):
            r = httpx.get(f"{server.base_url}/v2/models/{name}{route}", headers=AUTH, timeout=30)
            answers.add(r.status_code)
            assert r.status_code in (400, 404), (name, route, r.status_code, r.text)
        assert len(answers) == 1, (route, answers)
    unload = httpx.post(f"{server.base_url}/v2/repository/models/%2e%2e/unload", headers=AUTH, timeout=30)
    missing = httpx.post(
        f"{server.base_url}/v2/repository/models/nonexistent/unload", headers=AUTH, timeout=30
    )
    assert unload.status_code == missing.status_code == 400
    index = httpx.post(f"{server.base_url}/v2/repository/index", headers=AUTH, timeout=30).json()
    assert "escape" not in {m["name"] for m in index}, "a symlink out of the repository is no model of it"
    nothing_ran(layout)


def test_grpc_load_of_a_path_outside_the_repository_runs_nothing(server, layout) -> None:
    from tritonclient.utils import InferenceServerException

    _, c = grpc_client(server)
    names = ["../outside/evil", str(layout["outside"]), "..", "escape", "/etc", "nonexistent", "a\\b"]
    statuses = set()
    for name in names:
        with pytest.raises(InferenceServerException) as err:
            c.load_model(name, headers=GRPC_AUTH)
        statuses.add(err.value.status())
        assert "no such model" in err.value.message(), (name, err.value.message())
    assert statuses == {"StatusCode.INVALID_ARGUMENT"}
    nothing_ran(layout)
    # No existence oracle: an outside folder that exists answers as one that does not.
    for call in (c.get_model_metadata, c.get_model_config):
        codes = set()
        for name in ("/etc", "/nonexistent", "..", "../outside/evil"):
            with pytest.raises(InferenceServerException) as err:
                call(name, headers=GRPC_AUTH)
            codes.add(err.value.status())
        assert codes == {"StatusCode.NOT_FOUND"}, (call.__name__, codes)
    assert not c.is_model_ready("/etc", headers=GRPC_AUTH)
    # The repository's own models still load.
    c.load_model("linear_onnx", headers=GRPC_AUTH)
    assert c.is_model_ready("linear_onnx", headers=GRPC_AUTH)
    c.close()


# --- item 7: numbers and nesting the JSON decoder refuses -----------------------------------------

BIG = b"1" * 5000
DEEP = b"[" * 100_000 + b"]" * 100_000


def raw_post(server, path: str, body: bytes) -> httpx.Response:
    headers = {**AUTH, "Content-Type": "application/json"}
    return httpx.post(f"{server.base_url}{path}", content=body, headers=headers, timeout=60)


OPENAI_BODIES = {
    "completions-seed": ("/v1/completions", b'{"prompt": "hi", "seed": ' + BIG + b"}"),
    "completions-nested": ("/v1/completions", b'{"prompt": "hi", "x": [[' + BIG + b"]]}"),
    "chat-max-tokens": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + BIG + b"}",
    ),
    "tokenize": ("/tokenize", b'{"prompt": "hi", "add_special_tokens": ' + BIG + b"}"),
    "detokenize": ("/detokenize", b'{"tokens": [' + BIG + b"]}"),
}


@pytest.mark.parametrize("case", list(OPENAI_BODIES))
def test_huge_integers_get_a_400_in_openai_shape(server, case: str) -> None:
    path, body = OPENAI_BODIES[case]
    r = raw_post(server, path, body)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]


def infer_body(data: bytes) -> bytes:
    return b'{"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": ' + data + b"}]}"


V2_BODIES = {
    "infer-int": ("/v2/models/linear_onnx/infer", infer_body(b"[1, 2, 3, " + BIG + b"]")),
    "infer-param": (
        "/v2/models/linear_onnx/infer",
        b'{"parameters": {"priority": ' + BIG + b'}, "inputs": []}',
    ),
    "infer-deep": ("/v2/models/linear_onnx/infer", DEEP),
    "infer-deep-data": ("/v2/models/linear_onnx/infer", infer_body(b"[" * 100_000 + b"]" * 100_000)),
    "index-int": ("/v2/repository/index", b'{"ready": ' + BIG + b"}"),
    "index-deep": ("/v2/repository/index", DEEP),
    "load-int": ("/v2/repository/models/linear_onnx/load", b'{"parameters": {"x": ' + BIG + b"}}"),
    "load-deep": ("/v2/repository/models/linear_onnx/load", DEEP),
    "unload-int": ("/v2/repository/models/nonexistent/unload", b'{"parameters": {"x": ' + BIG + b"}}"),
    "unload-deep": ("/v2/repository/models/nonexistent/unload", DEEP),
}


@pytest.mark.parametrize("case", list(V2_BODIES))
def test_huge_integers_and_deep_bodies_get_a_400_in_triton_shape(server, case: str) -> None:
    path, body = V2_BODIES[case]
    r = raw_post(server, path, body)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert set(r.json()) == {"error"} and isinstance(r.json()["error"], str)
    ok = httpx.post(
        f"{server.base_url}/v2/models/linear_onnx/infer",
        json={"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]},
        headers=AUTH,
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _strict_json(text: str) -> object:
    return json.loads(text, parse_constant=_no_constant)  # json.loads alone takes NaN and Infinity


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "[1, NaN]", '{"a": Infinity}'])
def test_tool_call_arguments_are_always_json(value: str) -> None:
    names = {"get_time"}
    texts = [
        f'<tool_call>{{"name": "get_time", "arguments": {{"x": {value}}}}}</tool_call>',
        # Arguments written as a JSON string, which holds the constant.
        "<tool_call>" + json.dumps({"name": "get_time", "arguments": f'{{"x": {value}}}'}) + "</tool_call>",
    ]
    for text in texts:
        content, calls = parse_complete(HermesParser(names), text)
        for call in calls:
            _strict_json(call["function"]["arguments"])
        assert calls or content  # not parsed: the text stays content
    element = f'[{{"arguments": {{"x": {value}}}, "name": "get_time"}}]'  # keys in the other order
    _, calls = parse_complete(ArrayParser(names), element)
    for call in calls:
        _strict_json(call["function"]["arguments"])
    # Well-formed calls still parse.
    good = '<tool_call>{"name": "get_time", "arguments": {"x": 1.5}}</tool_call>'
    _, calls = parse_complete(HermesParser(names), good)
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1.5}


# --- item 9: what clients see ---------------------------------------------------------------------


def test_metadata_has_no_engine_pid_with_an_api_key(server) -> None:
    r = httpx.get(f"{server.base_url}/v1/metadata", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert "engine_pid" not in r.json() and str(r.json().get("model"))


def test_v2_health_answers_200_and_4xx(server, layout) -> None:
    base = server.base_url
    live = httpx.get(f"{base}/v2/health/live", timeout=30)
    ready = httpx.get(f"{base}/v2/health/ready", timeout=30)
    assert (live.status_code, ready.status_code) == (200, 200)
    # A model that fails to load makes the server not ready (400, as Triton) until it is unloaded.
    broken = layout["root"] / "broken"
    (broken / "1").mkdir(parents=True)
    (broken / "config.pbtxt").write_text('backend: "no_such_backend"\n')
    try:
        r = httpx.post(f"{base}/v2/repository/models/broken/load", headers=AUTH, timeout=60)
        assert r.status_code == 400 and "broken" in r.json()["error"], r.text
        assert httpx.get(f"{base}/v2/health/ready", timeout=30).status_code == 400
        assert httpx.get(f"{base}/v2/health/live", timeout=30).status_code == 200
        r = httpx.post(f"{base}/v2/repository/models/broken/unload", headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{base}/v2/health/ready", timeout=30).status_code == 200
    finally:
        (broken / "config.pbtxt").unlink()
        (broken / "1").rmdir()
        broken.rmdir()


def test_string_sequence_id_gets_an_error_and_sequences_go_on(server) -> None:
    from tritonclient.utils import InferenceServerException

    tg, c = grpc_client(server)

    def send(seq, value: int, start: bool = False, end: bool = False) -> int:
        v = tg.InferInput("VALUE", [1, 1], "INT32")
        v.set_data_from_numpy(np.array([[value]], dtype=np.int32))
        r = c.infer(
            "accumulator", [v], sequence_id=seq, sequence_start=start, sequence_end=end,
            headers=GRPC_AUTH, client_timeout=60,
        )  # fmt: skip
        return int(r.as_numpy("SUM")[0, 0])

    # The accumulator's CORRID input is TYPE_UINT64: a string ID cannot reach it.
    with pytest.raises(InferenceServerException, match="string sequence_id") as err:
        send("abc", 1, start=True)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    r = httpx.post(
        f"{server.base_url}/v2/models/accumulator/infer",
        json={
            "parameters": {"sequence_id": "xyz", "sequence_start": True},
            "inputs": [{"name": "VALUE", "shape": [1, 1], "datatype": "INT32", "data": [1]}],
        },
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 400 and "string sequence_id" in r.json()["error"], r.text
    for bad in (-1, 2**64):
        r = httpx.post(
            f"{server.base_url}/v2/models/accumulator/infer",
            json={
                "parameters": {"sequence_id": bad, "sequence_start": True},
                "inputs": [{"name": "VALUE", "shape": [1, 1], "datatype": "INT32", "data": [1]}],
            },
            headers=AUTH,
            timeout=60,
        )
        assert r.status_code == 400 and "does not fit" in r.json()["error"], r.text
    # Later sequences run on every instance (three live at once: both instances get one).
    ids = (9101, 9102, 9103)
    for i, seq in enumerate(ids):
        assert send(seq, i + 1, start=True) == i + 1
    for i, seq in enumerate(ids):
        assert send(seq, 10, end=True) == i + 11
    c.close()


def test_stream_errors_name_no_engine_socket() -> None:
    with running_server("--max-num-seqs", "4") as srv:
        base = srv.base_url
        pid = httpx.get(f"{base}/v1/metadata", timeout=30).json()["engine_pid"]  # no key: the operator's
        body = {"prompt": "Story:", "max_tokens": 800, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            killed = False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if not killed:
                    os.kill(pid, signal.SIGKILL)
                    killed = True
        errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
        assert errors, events[-3:]
        after = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert after.status_code == 503
        for message in [e["message"] for e in errors] + [after.json()["error"]["message"]]:
            assert "engine" in message
            assert "ipc://" not in message and "tcp://" not in message and "/tmp" not in message, message
            assert "tokenmill-" not in message, message
