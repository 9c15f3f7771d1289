"""KServe v2 / Triton protocol on `tokenmill serve --model-repository`, with the official tritonclient."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_fixture import example_repository, free_port, running_server

tritonclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is a dev dependency")
from tritonclient.utils import InferenceServerException  # noqa: E402

W = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 2.0]], dtype=np.float32)
B = np.array([0.5, -0.5], dtype=np.float32)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return example_repository(tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="module")
def server(repo):
    grpc_port = free_port()
    with running_server(
        "--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", "*",
        "--grpc-port", str(grpc_port),
    ) as proc:  # fmt: skip
        proc.grpc_url = f"127.0.0.1:{grpc_port}"
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return tritonclient.InferenceServerClient(server.base_url.removeprefix("http://"), concurrency=16)


def x_input(x: np.ndarray, binary: bool = True):
    inp = tritonclient.InferInput("X", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    return inp


@pytest.mark.parametrize("binary", [True, False])
def test_infer_json_and_binary(client, binary: bool) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = tritonclient.InferRequestedOutput("Y", binary_data=binary)
    r = client.infer("linear_onnx", [x_input(x, binary)], outputs=[out], request_id="r1")
    np.testing.assert_allclose(r.as_numpy("Y"), x @ W + B, rtol=1e-6)
    assert r.get_response()["id"] == "r1" and r.get_response()["model_version"] == "1"


def test_health_and_metadata(client, server) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("linear_onnx") and not client.is_model_ready("nope")
    meta = client.get_server_metadata()
    assert "model_repository" in meta["extensions"] and "binary_tensor_data" in meta["extensions"]
    m = client.get_model_metadata("linear_onnx")
    assert m["platform"] == "onnxruntime_onnx" and m["inputs"] == [
        {"name": "X", "datatype": "FP32", "shape": [-1, 4]}
    ]
    cfg = client.get_model_config("accumulator")
    assert cfg["max_batch_size"] == 4 and "sequence_batching" in cfg
    # The LLM keeps its OpenAI API on the same server.
    assert httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"] == "smollm2-135m"


def test_ensemble_runs_python_then_onnx(client) -> None:
    raw = np.array([[2, 4, 6, 8], [0, 0, 0, 2]], dtype=np.int32)
    inp = tritonclient.InferInput("RAW", [2, 4], "INT32")
    inp.set_data_from_numpy(raw)
    r = client.infer("pipeline", [inp])
    np.testing.assert_allclose(r.as_numpy("Y"), (raw * 0.5).astype(np.float32) @ W + B, rtol=1e-6)


def test_sequences_keep_state_per_correlation_id(client) -> None:
    def send(seq: int, value: int, start: bool = False, end: bool = False) -> int:
        inp = tritonclient.InferInput("VALUE", [1, 1], "INT32")
        inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
        r = client.infer("accumulator", [inp], sequence_id=seq, sequence_start=start, sequence_end=end)
        return int(r.as_numpy("SUM")[0, 0])

    # Two interleaved sequences, each in order on its own instance's state.
    assert send(11, 1, start=True) == 1
    assert send(22, 100, start=True) == 100
    assert send(11, 2) == 3
    assert send(22, 5) == 105
    assert send(11, 3, end=True) == 6
    assert send(22, 1, end=True) == 106
    with pytest.raises(InferenceServerException, match="START flag"):
        send(33, 1)  # never started
    with pytest.raises(InferenceServerException, match="correlation ID"):
        send(0, 1, start=True)


def test_repository_load_unload_and_index(client) -> None:
    client.unload_model("sleeper")
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["sleeper"]["state"] == "UNAVAILABLE" and index["linear_onnx"]["state"] == "READY"
    assert not client.is_model_ready("sleeper")
    with pytest.raises(InferenceServerException, match="not ready"):
        client.infer("sleeper", [x_input(np.zeros(1, np.float32))])
    client.load_model("sleeper")
    assert client.is_model_ready("sleeper")
    with pytest.raises(InferenceServerException, match="failed to load 'missing'"):
        client.load_model("missing")


def test_statistics_count_requests_and_executions(client) -> None:
    before = client.get_inference_statistics("linear_onnx")["model_stats"][0]
    for _ in range(3):
        client.infer("linear_onnx", [x_input(np.ones((2, 4), np.float32))])
    s = client.get_inference_statistics("linear_onnx")["model_stats"][0]
    assert s["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 3
    assert s["inference_count"] == before["inference_count"] + 6  # batch-weighted
    assert s["execution_count"] >= before["execution_count"] + 1
    assert s["inference_stats"]["compute_infer"]["ns"] > 0 and s["batch_stats"]
    assert any(m["name"] == "pipeline" for m in client.get_inference_statistics()["model_stats"])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ("linear_onnx", [x_input(np.zeros((1, 3), np.float32))]), "shape"),
        (lambda: ("linear_onnx", [x_input(np.zeros((1, 4), np.float64).astype(np.float32)[:, :0])]), "shape"),
        (lambda: ("nope", [x_input(np.zeros((1, 4), np.float32))]), "unknown model"),
        (lambda: ("linear_onnx", [x_input(np.zeros((17, 4), np.float32))]), "batch size"),
    ],
)
def test_bad_requests_get_protocol_errors(client, make, match) -> None:
    name, inputs = make()
    with pytest.raises(InferenceServerException, match=match):
        client.infer(name, inputs)


def test_wrong_datatype_and_raw_errors(client, server) -> None:
    inp = tritonclient.InferInput("X", [1, 4], "INT32")
    inp.set_data_from_numpy(np.zeros((1, 4), np.int32))
    with pytest.raises(InferenceServerException, match="datatype INT32, expected FP32"):
        client.infer("linear_onnx", [inp])
    r = httpx.post(f"{server.base_url}/v2/models/linear_onnx/infer", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = httpx.post(f"{server.base_url}/v2/models/nope/infer", json={"inputs": []})
    assert r.status_code == 404 and r.json() == {"error": "unknown model: 'nope'"}


def test_dynamic_batching_forms_batches(client) -> None:
    # 16 concurrent requests to a model with preferred sizes 4 and 8 and a 100 ms delay.
    # (tritonclient.http is gevent-based: concurrency through async_infer, not threads.)
    before = client.get_inference_statistics("batch_probe")["model_stats"][0]["execution_count"]
    pending = [client.async_infer("batch_probe", [x_input(np.zeros((1, 1), np.float32))]) for _ in range(16)]
    results = [int(p.get_result().as_numpy("BATCH")[0, 0]) for p in pending]
    execs = client.get_inference_statistics("batch_probe")["model_stats"][0]["execution_count"] - before
    assert len(results) == 16 and execs < 16
    assert set(results) <= {1, 2, 3, 4, 5, 6, 7, 8} and max(results) in (4, 8)


def test_instances_run_concurrently(client) -> None:
    # sleeper sleeps 100 ms per execution with 2 instances: 8 concurrent requests take ~400 ms. One
    # instance at a time could not take less than 800 ms (8 sleeps), so any time below proves overlap,
    # and the margin absorbs a busy machine.
    t0 = time.perf_counter()
    pending = [client.async_infer("sleeper", [x_input(np.zeros(1, np.float32))]) for _ in range(8)]
    for p in pending:
        p.get_result()
    assert time.perf_counter() - t0 < 0.8


def test_metrics_use_triton_names(client, server) -> None:
    client.infer("linear_onnx", [x_input(np.ones((1, 4), np.float32))])
    text = httpx.get(f"{server.base_url}/metrics").text
    assert 'nv_inference_request_success_total{model="linear_onnx",version="1"}' in text
    for name in (
        "nv_inference_count_total",
        "nv_inference_exec_count_total",
        "nv_inference_queue_duration_us_total",
        "nv_inference_compute_infer_duration_us_total",
        "nv_inference_pending_request_count",
        "tokenmill:model_queue_to_compute_ratio",
        "tokenmill:request_success",
    ):
        assert name in text, name


def test_grpc_front(server) -> None:
    grpc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is a dependency")
    c = grpc.InferenceServerClient(server.grpc_url)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("linear_onnx")
    assert c.get_server_metadata().name == "tokenmill"
    meta = c.get_model_metadata("linear_onnx", as_json=True)
    assert meta["inputs"] == [{"name": "X", "datatype": "FP32", "shape": ["-1", "4"]}]
    cfg = c.get_model_config("pipeline", as_json=True)["config"]
    assert cfg["ensemble_scheduling"]["step"][1]["input_map"] == {"X": "scaled"}
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    inp = grpc.InferInput("X", [2, 4], "FP32")
    inp.set_data_from_numpy(x)
    r = c.infer("linear_onnx", [inp], outputs=[grpc.InferRequestedOutput("Y")])
    np.testing.assert_allclose(r.as_numpy("Y"), x @ W + B, rtol=1e-6)
    # Sequences over gRPC, and errors with gRPC status codes.
    for value, start, end, want in ((5, True, False, 5), (6, False, True, 11)):
        v = grpc.InferInput("VALUE", [1, 1], "INT32")
        v.set_data_from_numpy(np.array([[value]], dtype=np.int32))
        res = c.infer("accumulator", [v], sequence_id=77, sequence_start=start, sequence_end=end)
        assert int(res.as_numpy("SUM")[0, 0]) == want
    bad = grpc.InferInput("X", [1, 3], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 3), np.float32))
    with pytest.raises(InferenceServerException, match="shape"):
        c.infer("linear_onnx", [bad])
    with pytest.raises(InferenceServerException, match="unknown model"):
        c.get_model_metadata("nope")
    assert any(m.name == "pipeline" for m in c.get_model_repository_index().models)
    stats = c.get_inference_statistics("linear_onnx", as_json=True)["model_stats"][0]
    assert int(stats["inference_count"]) >= 2
    c.close()
