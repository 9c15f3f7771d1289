"""Triton's system shared-memory extension on `tokenmill serve --model-repository`, driven by the
official tritonclient (HTTP and gRPC) and its own `tritonclient.utils.shared_memory` regions."""

from __future__ import annotations

import os
import re
import subprocess
import textwrap
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_fixture import example_repository, free_port, perf_analyzer_path, running_server

tritonhttp = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is a dev dependency")
import tritonclient.grpc as tritongrpc  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402
from tritonclient.utils import InferenceServerException, serialize_byte_tensor  # noqa: E402

from tokenmill.triton.shm import Registry, ShmError  # noqa: E402

W = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 2.0]], dtype=np.float32)  # linear_onnx
B = np.array([0.5, -0.5], dtype=np.float32)

# Two inputs, two outputs (as Triton's `simple`): mixes tensors in shared memory with tensors in the body.
SIMPLE_CONFIG = """
name: "simple"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
         { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""
SIMPLE_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            a = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(r, "INPUT1").as_numpy()
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
        return out
"""
ECHO_CONFIG = """
name: "echo_bytes"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] } ]
"""
ECHO_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            words = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", words)]))
        return out
"""


def _add_model(root: Path, name: str, config: str, model: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(textwrap.dedent(config))
    (root / name / "1" / "model.py").write_text(textwrap.dedent(model))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = example_repository(tmp_path_factory.mktemp("repo"))
    _add_model(root, "simple", SIMPLE_CONFIG, SIMPLE_MODEL)
    _add_model(root, "echo_bytes", ECHO_CONFIG, ECHO_MODEL)
    grpc_port = free_port()
    models = [arg for m in ("linear_onnx", "simple", "echo_bytes") for arg in ("--load-model", m)]
    with running_server(
        "--model-repository", str(root), "--model-control-mode", "explicit", *models,
        "--grpc-port", str(grpc_port), "--allow-client-shm",
    ) as proc:  # fmt: skip
        proc.grpc_url = f"127.0.0.1:{grpc_port}"
        yield proc


@pytest.fixture(scope="module")
def clients(server):
    h = tritonhttp.InferenceServerClient(server.base_url.removeprefix("http://"))
    g = tritongrpc.InferenceServerClient(server.grpc_url)
    yield {"http": h, "grpc": g}
    g.close()


@pytest.fixture
def region(clients):
    """make(name, byte_size) -> (handle, key): a region created by tritonclient, destroyed after the
    test; every registration is dropped after the test too."""
    made = []

    def make(name: str, byte_size: int):
        key = f"/tmshm_test_{os.getpid()}_{uuid.uuid4().hex[:8]}_{name}"
        handle = shm.create_shared_memory_region(name, key, byte_size)
        made.append(handle)
        return handle, key

    yield make
    clients["http"].unregister_system_shared_memory()
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def _module(protocol: str):
    return tritongrpc if protocol == "grpc" else tritonhttp


def _status(clients, protocol: str, name: str = "") -> dict[str, dict]:
    """Region name -> {key, offset, byte_size}, over either protocol."""
    if protocol == "http":
        return {
            r["name"]: {k: r[k] for k in ("key", "offset", "byte_size")}
            for r in clients["http"].get_system_shared_memory_status(name)
        }
    regions = clients["grpc"].get_system_shared_memory_status(name).regions
    return {n: {"key": r.key, "offset": r.offset, "byte_size": r.byte_size} for n, r in regions.items()}


# --- inference with tensors in shared memory ----------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_input_and_output_in_one_object_at_offsets(clients, region, protocol: str) -> None:
    """Both regions in one object: the input 16 bytes into its region, the output's region registered
    at an offset that is not on a page boundary (mmap's offsets must be; Triton's fail there)."""
    handle, key = region("io", 8192)
    c, mod = clients[protocol], _module(protocol)
    x = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    shm.set_shared_memory_region(handle, [x], offset=16)
    c.register_system_shared_memory("in", key, 16 + x.nbytes)
    c.register_system_shared_memory("out", key, 100, offset=4100)

    inp = mod.InferInput("X", [3, 4], "FP32")
    inp.set_shared_memory("in", x.nbytes, offset=16)
    out = mod.InferRequestedOutput("Y")
    out.set_shared_memory("out", 100)
    r = c.infer("linear_onnx", [inp], outputs=[out])

    np.testing.assert_allclose(shm.get_contents_as_numpy(handle, np.float32, [3, 2], offset=4100), x @ W + B)
    meta = r.get_output("Y")
    if protocol == "http":  # metadata only, as Triton answers (no data, no parameters)
        assert meta == {"name": "Y", "datatype": "FP32", "shape": [3, 2]}
    else:
        assert (meta.datatype, list(meta.shape)) == ("FP32", [3, 2])
        assert list(r.get_response().raw_output_contents) == [b""]
    assert _status(clients, protocol) == {
        "in": {"key": key, "offset": 0, "byte_size": 16 + x.nbytes},
        "out": {"key": key, "offset": 4100, "byte_size": 100},
    }


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_shared_memory_mixed_with_tensors_in_the_message(clients, region, protocol: str) -> None:
    """INPUT0 and OUTPUT0 in shared memory, INPUT1 and OUTPUT1 in the message; the regions are
    registered over the other protocol (one registry for both fronts, as in Triton)."""
    other = "grpc" if protocol == "http" else "http"
    a, b = np.arange(16, dtype=np.int32), np.full(16, 3, dtype=np.int32)
    h_in, key_in = region("in0", a.nbytes)
    h_out, key_out = region("out0", 64)
    shm.set_shared_memory_region(h_in, [a])
    clients[other].register_system_shared_memory("in0", key_in, a.nbytes)
    clients[other].register_system_shared_memory("out0", key_out, 64)

    c, mod = clients[protocol], _module(protocol)
    in0, in1 = mod.InferInput("INPUT0", [16], "INT32"), mod.InferInput("INPUT1", [16], "INT32")
    in0.set_shared_memory("in0", a.nbytes)
    in1.set_data_from_numpy(b)
    out0, out1 = mod.InferRequestedOutput("OUTPUT0"), mod.InferRequestedOutput("OUTPUT1")
    out0.set_shared_memory("out0", 64)
    r = c.infer("simple", [in0, in1], outputs=[out0, out1])

    np.testing.assert_array_equal(shm.get_contents_as_numpy(h_out, np.int32, [16]), a + b)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bytes_tensors_in_shared_memory(clients, region, protocol: str) -> None:
    """BYTES in tritonclient's serialized form (4-byte length, then the bytes) both ways."""
    words = np.array([b"shared", b"", b"memory \xe2\x9c\x93"], dtype=np.object_)
    data = serialize_byte_tensor(words)  # one object: the serialized bytes
    size = len(data.item())
    h_in, key_in = region("words", size)
    h_out, key_out = region("echo", 256)
    shm.set_shared_memory_region(h_in, [data])
    c, mod = clients[protocol], _module(protocol)
    c.register_system_shared_memory("words", key_in, size)
    c.register_system_shared_memory("echo", key_out, 256)
    inp = mod.InferInput("IN", [3], "BYTES")
    inp.set_shared_memory("words", size)
    out = mod.InferRequestedOutput("OUT")
    out.set_shared_memory("echo", 256)
    c.infer("echo_bytes", [inp], outputs=[out])
    assert list(shm.get_contents_as_numpy(h_out, np.object_, [3])) == list(words)


# --- registry: status, unregister, errors -------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_status_and_unregister(clients, region, protocol: str) -> None:
    c = clients[protocol]
    _, key = region("obj", 256)
    c.register_system_shared_memory("a", key, 128)
    c.register_system_shared_memory("b", key, 64, offset=128)
    assert _status(clients, protocol, "b") == {"b": {"key": key, "offset": 128, "byte_size": 64}}
    c.unregister_system_shared_memory("a")
    c.unregister_system_shared_memory("never-registered")  # no error, as in Triton
    assert list(_status(clients, protocol)) == ["b"]
    with pytest.raises(InferenceServerException, match="Unable to find system shared memory region: 'a'"):
        _status(clients, protocol, "a")
    c.unregister_system_shared_memory()
    assert _status(clients, protocol) == {}
    # A region unregistered is no longer usable for inference.
    inp = _module(protocol).InferInput("X", [1, 4], "FP32")
    inp.set_shared_memory("b", 16)
    with pytest.raises(InferenceServerException, match="Unable to find shared memory region: 'b'"):
        c.infer("linear_onnx", [inp])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_register_errors(clients, region, protocol: str) -> None:
    c = clients[protocol]
    _, key = region("small", 64)
    missing = f"/tmshm_test_{os.getpid()}_absent"
    cases = [
        (lambda: c.register_system_shared_memory("r", missing, 64), "Unable to open shared memory region"),
        (lambda: c.register_system_shared_memory("r", key, 65), "invalid args"),
        (lambda: c.register_system_shared_memory("r", key, 32, offset=48), "invalid args"),
        (lambda: c.register_system_shared_memory("r", "/../etc/passwd", 8), "invalid shm key"),
        (lambda: c.register_system_shared_memory("r", "/a/b", 8), "invalid shm key"),
        (lambda: c.register_system_shared_memory("r", "/tokenmill-kv-0", 8), "reserved"),
    ]
    for call, match in cases:
        with pytest.raises(InferenceServerException, match=match) as e:
            call()
        assert e.value.status() == ("400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT")
    c.register_system_shared_memory("r", key, 64)
    with pytest.raises(InferenceServerException, match="shared memory region 'r' already in manager") as e:
        c.register_system_shared_memory("r", key, 8)
    # Triton's codes: ALREADY_EXISTS has no HTTP code of its own, 400 there.
    assert e.value.status() == ("400" if protocol == "http" else "StatusCode.ALREADY_EXISTS")
    assert _status(clients, protocol) == {"r": {"key": key, "offset": 0, "byte_size": 64}}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inference_errors(clients, region, protocol: str) -> None:
    c, mod = clients[protocol], _module(protocol)
    handle, key = region("obj", 64)  # zeros
    c.register_system_shared_memory("tiny", key, 32)
    c.register_system_shared_memory("whole", key, 64)

    def infer(in_region: str, in_size: int, out_region: str | None = None, out_size: int = 0):
        inp = mod.InferInput("X", [2, 4], "FP32")
        inp.set_shared_memory(in_region, in_size)
        out = mod.InferRequestedOutput("Y")
        if out_region:
            out.set_shared_memory(out_region, out_size)
        return c.infer("linear_onnx", [inp], outputs=[out])

    for args, match in [
        (("tiny", 48), r"Invalid offset \+ byte size for shared memory region: 'tiny'"),
        (("whole", 28), r"has 7 values but shape \[2, 4\] needs 8"),
        (("whole", 30), "not a whole number of FP32 values"),
        (("nope", 32), "Unable to find shared memory region: 'nope'"),
        (("whole", 32, "nope", 16), "Unable to find shared memory region: 'nope'"),
        (("whole", 32, "tiny", 64), r"Invalid offset \+ byte size for shared memory region: 'tiny'"),
        (("whole", 32, "tiny", 8), r"output 'Y' \(8 bytes\) should be at least 16 bytes"),
    ]:
        with pytest.raises(InferenceServerException, match=match):
            infer(*args)
    # The same regions still serve a valid request: 32 bytes are the 8 values X needs.
    infer("tiny", 32, "whole", 16)
    np.testing.assert_allclose(
        shm.get_contents_as_numpy(handle, np.float32, [2, 2]), np.zeros((2, 4)) @ W + B
    )


def test_an_object_shrunk_after_registering_is_an_error_not_a_crash(clients, region, server) -> None:
    """Reading a mapped page past the object's end would kill the server with SIGBUS."""
    _, key = region("shrinks", 8192)
    clients["http"].register_system_shared_memory("shrinks", key, 64, offset=4096)
    os.truncate(f"/dev/shm/{key.lstrip('/')}", 100)
    inp = tritonhttp.InferInput("X", [1, 4], "FP32")
    inp.set_shared_memory("shrinks", 16)
    with pytest.raises(InferenceServerException, match="shrank"):
        clients["http"].infer("linear_onnx", [inp])
    assert server.poll() is None and clients["http"].is_server_live()


def test_bad_http_requests_answer_in_protocol_shape(server, region) -> None:
    _, key = region("obj", 64)
    base = f"{server.base_url}/v2/systemsharedmemory/region/r"
    for body, match in [
        ("not json", "JSON object"),
        ('{"byte_size": 8}', "no 'key' field"),
        (f'{{"key": "{key}"}}', "no 'byte_size' field"),
        (f'{{"key": "{key}", "byte_size": -1}}', "non-negative"),
        (f'{{"key": "{key}", "byte_size": 8, "offset": 1.5}}', "non-negative"),
    ]:
        r = httpx.post(f"{base}/register", content=body)
        assert r.status_code == 400 and list(r.json()) == ["error"] and match in r.json()["error"]
    x = {"name": "X", "shape": [1, 4], "datatype": "FP32"}
    for params, match in [
        ({"shared_memory_byte_size": 16}, "without 'shared_memory_region'"),
        ({"shared_memory_region": "r"}, "'shared_memory_byte_size' is required"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": "16"}, "non-negative integer"),
    ]:
        r = httpx.post(
            f"{server.base_url}/v2/models/linear_onnx/infer", json={"inputs": [x | {"parameters": params}]}
        )
        assert r.status_code == 400 and match in r.json()["error"]
    assert httpx.post(f"{base}/status").status_code == 405  # status is a GET


# --- the registry itself, on a directory of its own ---------------------------------------------------


def test_keys_are_names_in_the_directory_not_paths(tmp_path) -> None:
    (tmp_path / "obj").write_bytes(bytes(range(64)))
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")  # opened read/write, a FIFO does not block (Linux): refused by its type
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.write_bytes(b"\0" * 64)
    (tmp_path / "link").symlink_to(outside)  # planted in the directory, pointing out of it
    reg = Registry(shm_dir=tmp_path)
    for key in ("", "/", "//", "/.", "/..", "/../obj", "/a/b", "/ob\0j"):
        with pytest.raises(ShmError, match="invalid shm key"):
            reg.register("r", key, 0, 8)
    for key, match in [
        ("/link", "Unable to open"),
        ("/dir", "Unable to open"),
        ("/fifo", "not a shared-memory"),
    ]:
        with pytest.raises(ShmError, match=match):
            reg.register("r", key, 0, 8)
    # shm_open drops every leading slash, and so does the registry.
    reg.register("a", "obj", 3, 5)
    reg.register("b", "//obj", 60, 4)
    assert reg.get("a").read(0, 5) == bytes(range(3, 8)) and reg.get("b").read(2, 2) == bytes([62, 63])
    reg.close()
    assert reg.status() == []


def test_a_registry_that_refuses_clients(tmp_path) -> None:
    """What a server started without --allow-client-shm answers, as Triton's (status still works)."""
    (tmp_path / "obj").write_bytes(b"\0" * 64)
    reg = Registry(shm_dir=tmp_path, allow_client=False)
    for call in (lambda: reg.register("r", "/obj", 0, 64), reg.unregister):
        with pytest.raises(ShmError, match="client shared memory is disabled") as e:
            call()
        assert e.value.kind == "UNSUPPORTED"
    assert reg.status() == []


# --- CUDA shared memory: no GPU -----------------------------------------------------------------------


def test_cuda_shared_memory_needs_a_gpu(clients) -> None:
    h, g = clients["http"], clients["grpc"]
    assert h.get_cuda_shared_memory_status() == []
    assert len(g.get_cuda_shared_memory_status().regions) == 0
    with pytest.raises(InferenceServerException, match="CUDA shared memory needs a GPU") as e:
        h.register_cuda_shared_memory("r", b"\0" * 64, 0, 8)
    assert e.value.status() == "400"
    with pytest.raises(InferenceServerException, match="CUDA shared memory needs a GPU") as e:
        g.register_cuda_shared_memory("r", b"\0" * 64, 0, 8)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    # Unregistering (all, or a name) succeeds, as perf_analyzer expects at start and exit.
    for c in (h, g):
        c.unregister_cuda_shared_memory()
        c.unregister_cuda_shared_memory("r")
    with pytest.raises(InferenceServerException, match="Unable to find cuda shared memory region: 'r'"):
        h.get_cuda_shared_memory_status("r")
    assert "system_shared_memory" in h.get_server_metadata()["extensions"]


# --- perf_analyzer --shared-memory system ---------------------------------------------------------------


_perf_analyzer = perf_analyzer_path


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_with_system_shared_memory(server, clients, protocol: str) -> None:
    """perf_analyzer creates, registers and uses its own regions, then unregisters them. Bounded: one
    concurrency level, 300 ms windows, at most 4 of them, and a timeout."""
    exe = _perf_analyzer()
    if exe is None:
        pytest.skip("perf_analyzer not found: run tests/get_perf_analyzer.sh or set TOKENMILL_PERF_ANALYZER")
    url = server.grpc_url if protocol == "grpc" else server.base_url.removeprefix("http://")
    before = clients["http"].get_inference_statistics("simple")["model_stats"][0]["inference_count"]
    args = [exe, "-m", "simple", "-i", protocol, "-u", url, "--shared-memory", "system"]
    args += ["--concurrency-range", "1", "--measurement-interval", "300", "--max-trials", "4"]
    args += ["--stability-percentage", "1000"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert int(re.search(r"Inference count: (\d+)", out.split("Server:", 1)[1]).group(1)) > 0, out
    after = clients["http"].get_inference_statistics("simple")["model_stats"][0]["inference_count"]
    assert int(after) > int(before or 0)
    assert _status(clients, "http") == {}  # it unregistered what it registered
