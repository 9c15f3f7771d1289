"""The command line: clear one-line errors, the catalog listing, a real generation, a port in use, a
damaged model file, Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from procs import session_processes
from server_fixture import running_server

from tokenmill.kernels.isa import best_level, is_x86


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.cli.main", *args], capture_output=True, text=True, timeout=300
    )


def test_models_lists_catalog() -> None:
    r = run("models")
    assert r.returncode == 0
    assert "smollm2-135m" in r.stdout


def test_unknown_model_is_one_line_error() -> None:
    r = run("generate", "hi", "--model", "no-such-model")
    assert r.returncode == 2
    assert "unknown model" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_bad_parameter_is_one_line_error() -> None:
    r = run("generate", "hi", "--temperature", "-3")
    assert r.returncode == 2 and "temperature" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_generate_prints_text() -> None:
    r = run("generate", "What is 2+2?", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "generated" in r.stderr


@pytest.mark.slow
def test_chat_streams_a_reply_and_exits() -> None:
    question = "What is the capital of France?"
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli.main", "chat", "--temperature", "0", "--max-tokens", "20"],
        input=f"{question}\n/exit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    # The reference is the offline API on the same settings, not what a tiny bf16 model happens to
    # say: its answer to this question hangs on a near-tie (0.08 nats in float32) that bf16 rounding
    # on one CPU or another can flip.
    from tokenmill import LLM, SamplingParams

    llm = LLM(enable_prefix_caching=False, kv_cache_memory_gb=0.1, max_model_len=1024)
    p = SamplingParams(temperature=0, max_tokens=20)
    expected = llm.chat([{"role": "user", "content": question}], p)[0].outputs[0].text
    assert expected.strip() and expected in r.stdout, (expected, r.stdout)


def test_serve_unknown_model_is_one_line_error() -> None:
    r = run("serve", "--model", "no-such-model", "--port", "1")
    assert r.returncode == 2 and "unknown model" in r.stderr and "Traceback" not in r.stderr


def test_serve_unknown_draft_model_is_one_line_error() -> None:
    r = run("serve", "--speculative", "draft:no-such-model", "--port", "1")
    assert r.returncode == 2 and "draft model: unknown model" in r.stderr and "Traceback" not in r.stderr
    r = run("worker", "--listen", "tcp://127.0.0.1:1", "--speculative", "draft:")
    assert r.returncode == 2 and "draft:MODEL needs a model" in r.stderr and "Traceback" not in r.stderr


def test_serve_bad_kv_offload_and_disaggregation_are_one_line_errors() -> None:
    r = run("serve", "--kv-offload", "disk=/tmp/x", "--port", "1")
    assert r.returncode == 2 and "disk= needs a size" in r.stderr and "Traceback" not in r.stderr
    r = run("serve", "--workers", "3", "--disaggregate", "1P1D", "--port", "1")
    assert r.returncode == 2 and "needs --workers 2" in r.stderr and "Traceback" not in r.stderr
    r = run("serve", "--workers", "2", "--disaggregate", "PD", "--port", "1")
    assert r.returncode == 2 and "NPMD" in r.stderr and "Traceback" not in r.stderr
    r = run("worker", "--listen", "tcp://127.0.0.1:1", "--kv-role", "middle")
    assert r.returncode == 2 and "kv_role must be" in r.stderr and "Traceback" not in r.stderr


def test_serve_bad_planner_settings_are_one_line_errors() -> None:
    r = run("serve", "--workers", "1..3", "--port", "1")
    assert r.returncode == 2 and "needs --planner" in r.stderr and "Traceback" not in r.stderr
    r = run("serve", "--workers", "1..3", "--planner", "sla", "--port", "1")
    assert r.returncode == 2 and "--planner-capacity-rps" in r.stderr and "Traceback" not in r.stderr
    r = run("serve", "--workers", "3..1", "--planner", "load", "--port", "1")
    assert r.returncode == 2 and "MIN <= MAX" in r.stderr and "Traceback" not in r.stderr
    # A disaggregated fleet: the bounds must allow the pools it starts with; sla needs both capacities.
    r = run("serve", "--workers", "3..4", "--disaggregate", "1P1D", "--planner", "load", "--port", "1")
    assert r.returncode == 2 and "must allow them" in r.stderr and "Traceback" not in r.stderr
    r = run("serve", "--workers", "2..4", "--disaggregate", "1P1D", "--planner", "sla",
            "--planner-capacity-rps", "1", "--port", "1")  # fmt: skip
    assert r.returncode == 2 and "--planner-prefill-capacity-rps" in r.stderr and "Traceback" not in r.stderr


# -- ports, damaged models, Ctrl-C (issue 50) ---------------------------------------------------


@pytest.fixture
def taken_port():
    """A port some other program listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def unloadable_model(tmp_path: Path) -> Path:
    """A .gguf file no engine can load: had the engine started, its error would be about this file."""
    path = tmp_path / "not-a-model.gguf"
    path.write_bytes(b"not a GGUF file at all")
    return path


@pytest.mark.parametrize("extra", [[], ["--workers", "2"]], ids=["one-engine", "fleet"])
def test_serve_on_a_port_in_use_says_so_before_loading(
    taken_port: int, unloadable_model: Path, extra: list[str]
) -> None:
    r = run("serve", "--model", str(unloadable_model), "--port", str(taken_port), *extra)
    assert r.returncode == 2, r.stderr
    # The port's error, not the model's: the port was checked before any engine started.
    assert f"port {taken_port} on 127.0.0.1 is in use: pick another with --port" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "tokenmill serving" not in r.stderr + r.stdout


def test_serve_on_a_grpc_port_in_use_says_so_before_loading(
    taken_port: int, unloadable_model: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "repository"
    repo.mkdir()
    r = run("serve", "--model", str(unloadable_model), "--port", "0",
            "--model-repository", str(repo), "--grpc-port", str(taken_port))  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert f"port {taken_port} on 127.0.0.1 is in use: pick another with --grpc-port" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _damaged(model_path: Path, dest: Path, how: str) -> Path:
    data = bytearray(model_path.read_bytes())
    if how == "truncated":  # cut inside its last tensors, as an interrupted download leaves it
        del data[-5_000_000:]
    elif how == "bad-header":  # claims more tensors than it holds: the reader runs off its index
        n_tensors = struct.unpack_from("<Q", data, 8)[0]
        struct.pack_into("<Q", data, 8, n_tensors + 5)
    elif how == "empty":
        data = bytearray()
    path = dest / f"{how}.gguf"
    path.write_bytes(bytes(data))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "command"),
    [
        ("truncated", ["generate", "hi"]),
        ("bad-header", ["generate", "hi"]),
        ("empty", ["generate", "hi"]),
        ("truncated", ["serve", "--port", "0"]),
        ("bad-header", ["serve", "--port", "0", "--workers", "2"]),
    ],
)
def test_damaged_gguf_is_one_line_error(
    model_path: Path, tmp_path: Path, how: str, command: list[str]
) -> None:
    path = _damaged(model_path, tmp_path, how)
    r = run(*command, "--model", str(path))
    assert r.returncode == 2, r.stderr
    # One line of error; a serve whose load takes a few seconds says first that it is loading.
    lines = [x for x in r.stderr.strip().splitlines() if not x.startswith("tokenmill: loading")]
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert f"{path}: " in r.stderr and ("not a readable GGUF file" in r.stderr or "truncated" in r.stderr)


def test_missing_model_path_is_one_line_error(tmp_path: Path) -> None:
    for command in (["generate", "hi"], ["serve", "--port", "0"]):
        r = run(*command, "--model", str(tmp_path / "no-such.gguf"))
        assert r.returncode == 2 and "nor an existing path" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def left_behind(sid: int, timeout: float = 60.0) -> list[str]:
    """The session's processes still alive after up to `timeout` seconds (none, once all have exited)."""
    deadline = time.monotonic() + timeout
    while (alive := session_processes(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def ctrl_c(proc: subprocess.Popen) -> None:
    """What a terminal's Ctrl-C does: SIGINT to every process of the foreground group."""
    os.killpg(proc.pid, signal.SIGINT)


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["1", "2"])
def test_ctrl_c_stops_server_and_engines_without_a_traceback(workers: str) -> None:
    with running_server("--workers", workers, new_session=True) as proc:
        engines = [p for p in session_processes(proc.pid) if "spawn_main" in p]
        assert len(engines) == int(workers), session_processes(proc.pid)  # the Ctrl-C reaches them too
        ctrl_c(proc)
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert left_behind(proc.pid) == []


@pytest.mark.slow
def test_second_ctrl_c_answers_requests_in_flight_and_exits() -> None:
    """The first Ctrl-C drains (requests in flight may finish); a second ends them with a 503 in
    OpenAI's shape, streamed or not, rather than waiting for them or dropping their connections."""
    import httpx
    import openai

    with running_server(new_session=True) as proc:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="x", max_retries=0, timeout=300)
        long = {"max_tokens": 900, "extra_body": {"ignore_eos": True}}  # fits the 1024 context with a prompt
        outcome: dict[str, object] = {}
        streaming = threading.Event()

        def complete() -> None:
            try:
                outcome["completion"] = client.completions.create(model="smollm2-135m", prompt="Once", **long)
            except openai.APIError as e:
                outcome["completion"] = e

        def stream() -> None:
            try:
                chunks = client.chat.completions.create(
                    model="smollm2-135m",
                    messages=[{"role": "user", "content": "Tell a story."}],
                    stream=True,
                    **long,
                )
                for _ in chunks:
                    streaming.set()
                outcome["stream"] = "finished"
            except openai.APIError as e:
                outcome["stream"] = e

        threads = [threading.Thread(target=complete), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        assert streaming.wait(120), outcome

        def running() -> float:
            text = httpx.get(f"{proc.base_url}/metrics").text
            return float(re.search(r"^tokenmill:num_requests_running\{.*\} (\S+)$", text, re.M).group(1))

        deadline = time.monotonic() + 60
        while running() < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        ctrl_c(proc)
        deadline = time.monotonic() + 30
        while httpx.get(f"{proc.base_url}/v1/health/ready").json()["message"] != "draining":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not outcome, outcome  # draining: the requests run on
        ctrl_c(proc)
        out = proc.communicate(timeout=120)[0]
        for t in threads:
            t.join(60)
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    completion, streamed = outcome.get("completion"), outcome.get("stream")
    assert isinstance(completion, openai.APIStatusError) and completion.status_code == 503, completion
    assert set(completion.body) == {"message", "type", "param", "code"}, completion.body
    assert "shutting down" in completion.body["message"]
    assert isinstance(streamed, openai.APIError) and "shutting down" in streamed.message, streamed
    assert left_behind(proc.pid) == []


@pytest.mark.skipif(not is_x86() or best_level() is None, reason="the kernels need an x86 CPU with AVX2")
def test_kernels_builds_this_cpus_level_unless_told_all() -> None:
    """`make run`'s set-up step: the best level this CPU runs, not every level (which took three times a
    first start's build while the --all flag's name was shadowed by the function it names)."""
    r = run("kernels")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ready in") == 1 and f"CPU kernels ({best_level().name})" in r.stdout, r.stdout
