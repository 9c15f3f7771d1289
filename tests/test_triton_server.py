"""KServe v2 / Triton protocol on `tokenmill serve --model-repository`, with the official tritonclient."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_fixture import example_repository, free_port, perf_analyzer_path, running_server

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


# --- ensembles as perf_analyzer sees them (issue 50) ----------------------------------------------


def _grpc_client(server):
    grpc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is a dependency")
    return grpc, grpc.InferenceServerClient(server.grpc_url)


def _count(d: dict, *keys: str) -> int:
    """A statistics field from either client: gRPC's JSON writes int64 as strings and drops zeros."""
    for k in keys:
        d = d.get(k, {})
    return int(d or 0)


def _all_stats(protocol: str, client, gclient) -> dict[tuple[str, str], dict]:
    """Every model's statistics, as perf_analyzer reads them for an ensemble (no name, no version)."""
    if protocol == "http":
        stats = client.get_inference_statistics()["model_stats"]
    else:
        stats = gclient.get_inference_statistics(as_json=True)["model_stats"]
    return {(s["name"], s["version"]): s for s in stats}


def _stats_version(name: str, version: str, start: dict, end: dict) -> str | None:
    """perf_analyzer's choice of the statistics to read for (name, version) (its
    DetermineStatsModelVersion): a given version must be in the statistics; with none given, the
    highest version whose queue count grew during the measurement. None stands for its
    "failed to find the requested model version"."""
    if version:
        return version if (name, version) in end else None
    grew = [
        int(v)
        for (n, v), s in end.items()
        if n == name
        and _count(s, "inference_stats", "queue", "count")
        > _count(start.get((n, v), {}), "inference_stats", "queue", "count")
    ]
    return str(max(grew)) if grew else None


def _pipeline_input(protocol: str, batch: int):
    raw = np.arange(4 * batch, dtype=np.int32).reshape(batch, 4)
    mod = tritonclient if protocol == "http" else pytest.importorskip("tritonclient.grpc")
    inp = mod.InferInput("RAW", [batch, 4], "INT32")
    inp.set_data_from_numpy(raw)
    return inp


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("version", ["", "1"])
def test_perf_analyzer_calls_on_an_ensemble(client, server, protocol: str, version: str) -> None:
    """The calls perf_analyzer makes for `-m pipeline` (with `-x 1` and without), in its order: the
    model's metadata and config, each composing model's config (version "" for a step's -1), then all
    models' statistics around the measurement, where it must find the ensemble's and every composing
    model's version."""
    _, gclient = _grpc_client(server)
    if protocol == "http":
        meta = client.get_model_metadata("pipeline", version)
        cfg = client.get_model_config("pipeline", version)

        def step_config(name: str, v: str) -> dict:
            return client.get_model_config(name, v)

        def ready(name: str, v: str) -> bool:
            return client.is_model_ready(name, v)

        def infer() -> None:
            client.infer("pipeline", [_pipeline_input("http", 1)], model_version=version)
    else:
        meta = gclient.get_model_metadata("pipeline", version, as_json=True)
        cfg = gclient.get_model_config("pipeline", version, as_json=True)["config"]

        def step_config(name: str, v: str) -> dict:
            return gclient.get_model_config(name, v, as_json=True)["config"]

        def ready(name: str, v: str) -> bool:
            return gclient.is_model_ready(name, v)

        def infer() -> None:
            gclient.infer("pipeline", [_pipeline_input("grpc", 1)], model_version=version)

    assert meta["name"] == "pipeline" and meta["versions"] == ["1"] and meta["platform"] == "ensemble"
    assert cfg["platform"] == "ensemble" and ready("pipeline", version)
    steps = {}
    for step in cfg["ensemble_scheduling"]["step"]:
        v = "" if int(step["model_version"]) == -1 else str(step["model_version"])
        name = step["model_name"]
        assert step_config(name, v)["name"] == name and ready(name, v)
        steps[name] = v
    assert steps == {"preprocess": "", "linear_onnx": ""}

    start = _all_stats(protocol, client, gclient)
    for _ in range(3):
        infer()
    end = _all_stats(protocol, client, gclient)
    for name, v in [("pipeline", version), *steps.items()]:
        assert _stats_version(name, v, start, end) == "1", name
    gclient.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ensemble_statistics_count_its_own_requests(client, server, protocol: str) -> None:
    """As Triton counts an ensemble: each request once (batch-weighted inference_count, one execution,
    queue and compute counts), its compute times the sums of its steps' (the steps run one request
    at a time here, so each step's batch is that request alone)."""
    _, gclient = _grpc_client(server)
    start = _all_stats(protocol, client, gclient)
    for _ in range(3):
        if protocol == "http":
            client.infer("pipeline", [_pipeline_input("http", 2)])
        else:
            gclient.infer("pipeline", [_pipeline_input("grpc", 2)])
    end = _all_stats(protocol, client, gclient)
    gclient.close()

    def delta(name: str, *keys: str) -> int:
        return _count(end[(name, "1")], *keys) - _count(start.get((name, "1"), {}), *keys)

    assert delta("pipeline", "inference_stats", "success", "count") == 3
    assert delta("pipeline", "inference_count") == 6 and delta("pipeline", "execution_count") == 3
    for k in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert delta("pipeline", "inference_stats", k, "count") == 3, k
    for k in ("compute_input", "compute_infer", "compute_output"):
        steps = sum(delta(m, "inference_stats", k, "ns") for m in ("preprocess", "linear_onnx"))
        assert delta("pipeline", "inference_stats", k, "ns") == steps, k
    assert delta("pipeline", "inference_stats", "compute_infer", "ns") > 0
    assert _count(end[("pipeline", "1")], "last_inference") > 0
    batches = {int(b["batch_size"]): b for b in end[("pipeline", "1")]["batch_stats"]}
    assert _count(batches[2], "compute_infer", "count") >= 3
    assert delta("preprocess", "inference_count") == 6 and delta("linear_onnx", "inference_count") == 6


_perf_analyzer = perf_analyzer_path


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_on_an_ensemble(server, protocol: str) -> None:
    """perf_analyzer itself on the ensemble without -x: it measured nothing before ("failed to find
    the requested model version"). Bounded: one concurrency level, 300 ms windows, at most 4 of them
    (any spread counts as stable), and a timeout."""
    exe = _perf_analyzer()
    if exe is None:
        pytest.skip("perf_analyzer not found: run tests/get_perf_analyzer.sh or set TOKENMILL_PERF_ANALYZER")
    url = server.grpc_url if protocol == "grpc" else server.base_url.removeprefix("http://")
    args = [exe, "-m", "pipeline", "-i", protocol, "-u", url, "--concurrency-range", "1"]
    args += ["--measurement-interval", "300", "--max-trials", "4", "--stability-percentage", "1000"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    server_part = out.split("Server:", 1)[1]
    assert int(re.search(r"Inference count: (\d+)", server_part).group(1)) > 0, out
    assert "Composing models" in server_part and "preprocess, version: 1" in server_part, out


# --- /v2 errors in Triton's shape -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "match"),
    [
        # System shared memory is served with --allow-client-shm (tests/test_triton_shm.py), not
        # without; CUDA's needs a GPU.
        (lambda c: c.register_system_shared_memory("r", "k", 8), "--allow-client-shm"),
        (lambda c: c.register_cuda_shared_memory("r", b"\0" * 64, 0, 8), "CUDA shared memory needs a GPU"),
        (lambda c: c.get_trace_settings(), "trace settings are not supported"),
        (lambda c: c.get_trace_settings("linear_onnx"), "trace settings are not supported"),
        (lambda c: c.update_log_settings({"log_verbose_level": 1}), "log settings are not supported"),
    ],
)
def test_unsupported_triton_routes_raise_protocol_errors(client, call, match: str) -> None:
    # tritonclient reads {"error": ...}: FastAPI's {"detail": ...} made it fail decoding the answer.
    with pytest.raises(InferenceServerException, match=match) as e:
        call(client)
    assert "decoding" not in str(e.value) and e.value.status() == "400"


@pytest.mark.parametrize(
    ("method", "path", "status", "allow"),
    [
        ("GET", "/v2/nothing/here", 404, None),
        ("GET", "/v2/models/linear_onnx/nothing", 404, None),
        ("POST", "/v2/models/linear_onnx/versions/1/nothing", 404, None),
        ("DELETE", "/v2/models/nope/config/extra", 404, None),
        ("GET", "/v2/models/linear_onnx/infer", 405, "POST"),
        ("GET", "/v2/models/linear_onnx/versions/1/infer", 405, "POST"),
        ("PUT", "/v2/models/linear_onnx", 405, "GET"),
        ("POST", "/v2/models/linear_onnx/config", 405, "GET"),
        ("POST", "/v2/health/live", 405, "GET"),
        ("POST", "/v2", 405, "GET"),
        ("GET", "/v2/repository/index", 405, "POST"),
        ("GET", "/v2/repository/models/linear_onnx/load", 405, "POST"),
        ("DELETE", "/v2/models/stats", 405, "GET"),
    ],
)
def test_unknown_v2_routes_and_methods_answer_in_triton_shape(server, method, path, status, allow) -> None:
    r = httpx.request(method, f"{server.base_url}{path}")
    assert r.status_code == status and r.headers.get("allow") == allow
    body = r.json()
    assert list(body) == ["error"] and path in body["error"] and method in body["error"]


def test_unknown_models_raise_protocol_errors(client) -> None:
    for call in (
        lambda: client.get_model_metadata("nope"),
        lambda: client.get_model_config("nope"),
        lambda: client.get_inference_statistics("nope"),
        lambda: client.get_model_metadata("linear_onnx", "9"),
    ):
        with pytest.raises(InferenceServerException, match="unknown model|no version 9") as e:
            call()
        assert "decoding" not in str(e.value) and e.value.status() == "404"


def test_unsupported_grpc_calls_say_so(server) -> None:
    _, gclient = _grpc_client(server)
    for call, match in (
        (gclient.get_trace_settings, "trace settings are not supported"),
        (gclient.get_log_settings, "log settings are not supported"),
    ):
        with pytest.raises(InferenceServerException, match=match) as e:
            call()
        assert e.value.status() == "StatusCode.UNIMPLEMENTED"
    gclient.close()
