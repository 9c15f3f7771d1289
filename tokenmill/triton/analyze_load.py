"""The load side of `tokenmill analyze`: the Triton server under test, and a closed-loop load generator
measuring it as perf_analyzer does (a warm-up, then time windows until the last three agree).

The server runs in a process of its own, started once over a scratch repository in explicit mode;
the sweep loads and unloads each variant through the repository API (POST .../load, .../unload) and
sends requests over HTTP, as perf_analyzer does against Triton. It serves the same KServe v2 router and
ModelRepository that `tokenmill serve --model-repository` mounts, without that command's LLM engine:
the engine would take its load time and memory and compete for the cores with the model measured,
while every layer a request crosses here (uvicorn, the /v2 routes, the scheduler, the backend) is the
one a deployment runs. In-process (ModelRepository without HTTP) would leave out the HTTP cost and put
the client and the model on one event loop and one GIL: the numbers would not be the server's.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np

from tokenmill.triton import dtypes
from tokenmill.triton.config import TritonModelConfig

HEADER_LEN = "Inference-Header-Content-Length"
# The client's sockets send each write at once, as curl's (perf_analyzer's client) do by default.
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
STRING_LENGTH = 128  # bytes of a random BYTES element (perf_analyzer's --string-length default)


class LoadError(RuntimeError):
    """The server or the model failed in a way that stops a measurement; the message is one line."""


# --- request data ----------------------------------------------------------------------------------


def input_shapes(cfg: TritonModelConfig, shapes: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each required input's full shape for a request of one (the batch dimension included when the
    model batches). A variable dimension (-1) needs its size from `shapes`, as perf_analyzer's --shape."""
    out = {}
    for t in cfg.inputs:
        if t.optional:
            continue
        dims = shapes.get(t.name, t.dims)
        if len(dims) != len(t.dims) or any(
            d < 0 or (c >= 0 and d != c) for d, c in zip(dims, t.dims, strict=True)
        ):
            given = "" if t.name not in shapes else f" (--shape gave {dims})"
            raise LoadError(
                f"input {t.name!r} has dims {t.dims}{given}: give a size for each -1 with "
                f"--shape {t.name}:{','.join('1' if d < 0 else str(d) for d in t.dims)}"
            )
        out[t.name] = ([1] if cfg.batched else []) + list(dims)
    unknown = set(shapes) - {t.name for t in cfg.inputs}
    if unknown:
        raise LoadError(f"--shape {', '.join(sorted(unknown))}: the model has no such input")
    return out


def make_inputs(
    cfg: TritonModelConfig, shapes: dict[str, list[int]], data: str, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """One request's input tensors: zeros, or random values (small integers, floats in [0, 1), random
    printable strings), as perf_analyzer's --input-data zero|random."""
    out = {}
    for name, shape in input_shapes(cfg, shapes).items():
        datatype = next(t.datatype for t in cfg.inputs if t.name == name)
        n = int(np.prod(shape)) if shape else 1
        if datatype == "BYTES":
            if data == "zero":
                flat = [b"0" * STRING_LENGTH] * n
            else:
                flat = [bytes(rng.integers(33, 127, STRING_LENGTH, dtype=np.uint8)) for _ in range(n)]
            out[name] = np.array(flat, dtype=object).reshape(shape)
            continue
        dt = dtypes.NUMPY[datatype]
        if data == "zero":
            arr = np.zeros(shape, dt)
        elif dt.kind == "b":
            arr = rng.integers(0, 2, shape).astype(dt)
        elif dt.kind in "iu":
            arr = rng.integers(0, 16, shape).astype(dt)  # small: valid as an index or an id in most models
        else:
            arr = rng.random(shape).astype(dt)
        out[name] = arr
    return out


def encode_request(inputs: dict[str, np.ndarray]) -> tuple[bytes, int]:
    """A KServe v2 infer body with binary tensors (the binary_tensor_data extension) and every output
    asked for in binary, and its JSON header's length: what tritonclient sends for the same tensors."""
    head: dict[str, Any] = {"inputs": [], "parameters": {"binary_data_output": True}}
    blobs = []
    for name, arr in inputs.items():
        blob = dtypes.to_binary(arr)
        head["inputs"].append(
            {
                "name": name,
                "shape": list(arr.shape),
                "datatype": dtypes.protocol_of(arr),
                "parameters": {"binary_data_size": len(blob)},
            }
        )
        blobs.append(blob)
    text = json.dumps(head).encode()
    return text + b"".join(blobs), len(text)


# --- the server -------------------------------------------------------------------------------------


class TritonServer:
    """tokenmill's KServe v2 server over `root` in explicit mode, in a child process on 127.0.0.1."""

    def __init__(self, root: Path, start_timeout_s: float = 60.0) -> None:
        self.root = root
        self.scratch = Path(tempfile.mkdtemp(prefix="tokenmill-analyze-server-"))
        self.log_path = self.scratch / "server.log"
        port_file = self.scratch / "port"
        with self.log_path.open("wb") as log:
            # Its output goes to a file, not a pipe: a chatty model would fill a pipe nobody reads.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tokenmill.triton.analyze_load", str(root), str(port_file)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + start_timeout_s
        while not port_file.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = self.log_tail()  # before close() removes the log
                self.close()
                raise LoadError(f"the Triton server did not start: {why}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"
        transport = httpx.AsyncHTTPTransport(socket_options=NODELAY)
        self.client = httpx.AsyncClient(base_url=self.url, timeout=300.0, transport=transport)

    def log_tail(self, lines: int = 1) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no output"
        return " | ".join(text[-lines:]) if text else "no output"

    async def _post(self, path: str) -> None:
        try:
            r = await self.client.post(path, json={})
        except httpx.HTTPError as e:
            raise LoadError(f"the Triton server did not answer {path}: {e} ({self.log_tail()})") from None
        if r.status_code != 200:
            raise LoadError(_message(r))

    async def load(self, model: str) -> None:
        await self._post(f"/v2/repository/models/{quote(model, safe='')}/load")

    async def unload(self, model: str) -> None:
        await self._post(f"/v2/repository/models/{quote(model, safe='')}/unload")

    async def stats(self, model: str) -> dict[str, int]:
        """The model's statistics (the KServe statistics extension), summed over its loaded versions:
        inferences, executions, and the queue and compute durations with their counts."""
        keys = (
            "inference_count",
            "execution_count",
            "queue_ns",
            "queue_count",
            "compute_ns",
            "compute_count",
        )
        total = dict.fromkeys(keys, 0)
        r = await self.client.get(f"/v2/models/{quote(model, safe='')}/stats")
        if r.status_code != 200:
            return total
        for s in r.json().get("model_stats", []):
            st = s["inference_stats"]
            total["inference_count"] += s["inference_count"]
            total["execution_count"] += s["execution_count"]
            total["queue_ns"] += st["queue"]["ns"]
            total["queue_count"] += st["queue"]["count"]
            for k in ("compute_input", "compute_infer", "compute_output"):
                total["compute_ns"] += st[k]["ns"]
            total["compute_count"] += st["compute_infer"]["count"]
        return total

    async def aclose(self) -> None:
        await self.client.aclose()
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}: {r.text[:200]}"


def _serve(root: str, port_file: str) -> None:
    """The child process: the /v2 routes over `root` in explicit mode, on a port the OS picks (written
    to `port_file` once it listens, so the parent never races another process for a port)."""
    import uvicorn
    from fastapi import FastAPI

    from tokenmill.server.main import listen_socket
    from tokenmill.triton.http import build_router
    from tokenmill.triton.repository import ModelRepository

    repo = ModelRepository(Path(root), "explicit")
    app = FastAPI()
    app.include_router(build_router(repo))
    # tokenmill serve's own socket (TCP_NODELAY, its backlog): without TCP_NODELAY every keep-alive
    # request would wait 40 ms for a delayed ACK, which is not what a deployment sees.
    sock = listen_socket("127.0.0.1", 0, "the analyze server")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    tmp = Path(port_file + ".tmp")
    tmp.write_text(str(sock.getsockname()[1]))

    async def main() -> None:
        await repo.start()
        tmp.replace(port_file)  # after the bind and the start: a connection made now waits in the backlog
        try:
            await server.serve(sockets=[sock])
        finally:
            await repo.close()

    asyncio.run(main())


# --- measuring --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadSettings:
    """How one concurrency level is measured (perf_analyzer's time_windows mode)."""

    window_s: float = 2.0  # -p/--measurement-interval
    warmup_s: float = 1.0  # requests sent first and left out (the first of a fresh instance is slow)
    stability: float = 0.10  # -s/--stability-percentage: the last 3 windows within ±10 %
    max_windows: int = 10  # -r/--max-trials
    stable_windows: int = 3


@dataclass
class Measurement:
    """One concurrency level of one configuration: client-side throughput and latency over the last
    `stable_windows` windows, and what the server's statistics say about the same time."""

    concurrency: int
    throughput: float  # infer/s (requests of one)
    latency_avg_ms: float
    latency_p50_ms: float
    latency_p90_ms: float
    latency_p95_ms: float
    latency_p99_ms: float
    requests: int
    errors: int
    stable: bool
    windows: int
    server_queue_us: float  # the statistics extension's averages: queue time of a request
    server_compute_us: float  # and compute time of an execution (a batch)
    avg_batch: float  # inferences per execution: how full the dynamic batcher's batches were
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Window:
    start: float
    end: float
    latencies: list[float] = field(default_factory=list)  # seconds
    errors: int = 0

    @property
    def throughput(self) -> float:
        return len(self.latencies) / (self.end - self.start)

    @property
    def avg(self) -> float:
        return float(np.mean(self.latencies)) if self.latencies else float("inf")


def stable(windows: list[_Window], tolerance: float) -> bool:
    """perf_analyzer's test: each window's throughput and average latency within ±tolerance of the
    windows' mean."""
    if not windows or any(not w.latencies for w in windows):
        return False
    for values in ([w.throughput for w in windows], [w.avg for w in windows]):
        mean = sum(values) / len(values)
        if any(abs(v - mean) > tolerance * mean for v in values):
            return False
    return True


class LoadGenerator:
    """Closed loop: `concurrency` clients, each sending its next request when the last one answered,
    cycling through a few pre-encoded request bodies."""

    def __init__(self, server: TritonServer, model: str, bodies: list[tuple[bytes, int]]) -> None:
        self.server, self.model, self.bodies = server, model, bodies
        self.url = f"{server.url}/v2/models/{quote(model, safe='')}/infer"

    async def probe(self) -> None:
        """One request: a model that cannot run on this data says so before a sweep is measured."""
        body, n = self.bodies[0]
        try:
            r = await self.server.client.post(self.url, content=body, headers={HEADER_LEN: str(n)})
        except httpx.HTTPError as e:
            raise LoadError(f"the Triton server did not answer: {e} ({self.server.log_tail()})") from None
        if r.status_code != 200:
            raise LoadError(_message(r))

    async def measure(self, concurrency: int, settings: LoadSettings) -> Measurement:
        done: list[tuple[float, float]] = []  # (end, latency), in the order requests ended
        failed: list[tuple[float, str]] = []
        running = True
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=NODELAY)
        async with httpx.AsyncClient(transport=transport, timeout=300.0) as client:

            async def user(i: int) -> None:
                k = i
                while running:
                    body, n = self.bodies[k % len(self.bodies)]
                    k += 1
                    t0 = time.perf_counter()
                    try:
                        r = await client.post(self.url, content=body, headers={HEADER_LEN: str(n)})
                        error = "" if r.status_code == 200 else _message(r)
                    except httpx.HTTPError as e:
                        error = f"{type(e).__name__}: {e}"
                    t1 = time.perf_counter()
                    if error:
                        failed.append((t1, error))
                    else:
                        done.append((t1, t1 - t0))

            users = [asyncio.create_task(user(i)) for i in range(concurrency)]
            try:
                await asyncio.sleep(settings.warmup_s)
                windows, snaps = await self._windows(done, failed, settings)
            finally:
                running = False
                # the requests in flight end (a closed loop sends no more); a hung one is cancelled
                _, pending = await asyncio.wait(users, timeout=60)
                for t in pending:
                    t.cancel()
        return self._result(concurrency, windows, snaps, failed, settings)

    async def _windows(
        self, done: list[tuple[float, float]], failed: list[tuple[float, str]], settings: LoadSettings
    ) -> tuple[list[_Window], list[dict[str, Any]]]:
        windows: list[_Window] = []
        snaps = [await self.server.stats(self.model)]
        start = time.perf_counter()
        seen = next((i for i, (t, _) in enumerate(done) if t >= start), len(done))
        seen_failed = len(failed)
        while len(windows) < settings.max_windows:
            await asyncio.sleep(max(0.0, start + settings.window_s - time.perf_counter()))
            end = time.perf_counter()
            upto = len(done)
            w = _Window(start, end, [lat for t, lat in done[seen:upto] if t < end])
            w.errors = len(failed) - seen_failed
            seen, seen_failed = seen + len(w.latencies), len(failed)
            windows.append(w)
            snaps.append(await self.server.stats(self.model))
            start = end
            last = windows[-settings.stable_windows :]
            if len(last) == settings.stable_windows and stable(last, settings.stability):
                break
        return windows, snaps

    def _result(
        self,
        concurrency: int,
        windows: list[_Window],
        snaps: list[dict[str, Any]],
        failed: list[tuple[float, str]],
        settings: LoadSettings,
    ) -> Measurement:
        k = min(settings.stable_windows, len(windows))
        last = windows[-k:]
        lat = np.array([x for w in last for x in w.latencies]) * 1e3
        seconds = sum(w.end - w.start for w in last)
        errors = sum(w.errors for w in last)
        if not len(lat):
            why = failed[-1][1] if failed else f"no request ended within a {settings.window_s:g} s window"
            raise LoadError(f"concurrency {concurrency}: {why}")
        before, after = snaps[-k - 1], snaps[-1]
        grew = {key: after[key] - before[key] for key in after}
        p50, p90, p95, p99 = np.percentile(lat, [50, 90, 95, 99])
        return Measurement(
            concurrency=concurrency,
            throughput=len(lat) / seconds,
            latency_avg_ms=float(lat.mean()),
            latency_p50_ms=float(p50),
            latency_p90_ms=float(p90),
            latency_p95_ms=float(p95),
            latency_p99_ms=float(p99),
            requests=int(len(lat)),
            errors=errors,
            stable=stable(last, settings.stability) and len(last) == settings.stable_windows,
            windows=len(windows),
            server_queue_us=grew["queue_ns"] / max(1, grew["queue_count"]) / 1e3,
            server_compute_us=grew["compute_ns"] / max(1, grew["compute_count"]) / 1e3,
            avg_batch=grew["inference_count"] / max(1, grew["execution_count"]),
            error=failed[-1][1] if errors else "",
        )


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tokenmill.triton.analyze_load REPOSITORY PORT_FILE")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    _serve(sys.argv[1], sys.argv[2])
