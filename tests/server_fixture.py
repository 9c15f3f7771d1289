"""Start a real `tokenmill serve` on 127.0.0.1 in a subprocess and wait until it is ready."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now, and never one this test process handed out before: the OS may give a just
    closed port again, and two endpoints of one test (a worker's socket, its KV-event sockets) on
    the same port would make one of them fail to bind."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@contextmanager
def running_server(*args: str, api_key: str | None = None, timeout: float = 180.0, new_session: bool = False):
    """`new_session`: the server leads a process group of its own, as a terminal's foreground job
    (its Ctrl-C is os.killpg(proc.pid, SIGINT)), and its engine processes are in it."""
    port = free_port()
    env = dict(os.environ)
    env.pop("TOKENMILL_API_KEY", None)
    if api_key:
        env["TOKENMILL_API_KEY"] = api_key
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.cli.main",
        "serve",
        "--port",
        str(port),
        "--max-model-len",
        "1024",
        *args,
    ]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_session,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early: {proc.stdout.read() if proc.stdout else ''}")
            try:
                if httpx.get(f"{base}/v1/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                proc.kill()  # its output is what tells why: read it once the pipe closes
                out = proc.communicate(timeout=30)[0]
                raise RuntimeError(f"server did not become ready in {timeout:.0f}s; it said:\n{out[-4000:]}")
            time.sleep(0.2)
        proc.base_url = base  # type: ignore[attr-defined]
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def example_repository(dest: Path) -> Path:
    """A copy of examples/model_repository under `dest`, with its ONNX model built."""
    examples = Path(__file__).resolve().parent.parent / "examples"
    root = dest / "model_repository"
    shutil.copytree(examples / "model_repository", root)
    sys.path.insert(0, str(examples))
    try:
        import make_onnx_model

        make_onnx_model.make(root)
    finally:
        sys.path.remove(str(examples))
    return root


def perf_analyzer_path() -> str | None:
    """Triton's perf_analyzer: $TOKENMILL_PERF_ANALYZER, on PATH, or where tests/get_perf_analyzer.sh
    puts it. No PyPI package installs it cleanly (see that script), so it is not a dev dependency."""
    from tokenmill.paths import default_cache_dir

    cached = default_cache_dir() / "perf_analyzer" / "perf_analyzer"
    found = os.environ.get("TOKENMILL_PERF_ANALYZER") or shutil.which("perf_analyzer")
    return found or (str(cached) if cached.is_file() else None)
