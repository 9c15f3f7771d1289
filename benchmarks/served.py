"""A real `tokenmill serve` for the benchmarks that drive one (disaggregation, reliability), and its
/metrics read back as numbers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_fixture import free_port  # noqa: E402


def scrape(base: str) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Each metric summed over its series (and by `path` as NAME:PATH), and per worker (the `worker`
    label) where it has one."""
    total: dict[str, float] = {}
    per_worker: dict[str, dict[str, float]] = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        key = name.split("{", 1)[0]
        total[key] = total.get(key, 0.0) + float(value)
        if 'path="' in name:  # the KV transfer's read blocks, by shm or tcp
            path = name.split('path="', 1)[1].split('"', 1)[0]
            total[f"{key}:{path}"] = total.get(f"{key}:{path}", 0.0) + float(value)
        if 'worker="' in name:
            worker = name.split('worker="', 1)[1].split('"', 1)[0]
            per_worker.setdefault(key, {})
            per_worker[key][worker] = per_worker[key].get(worker, 0.0) + float(value)
    return total, per_worker


def workers_up(base: str, default: float = 0.0) -> float:
    """The router's workers up (`default` where there is no router)."""
    return scrape(base)[0].get("tokenmill:router_workers_up", default)


@contextmanager
def serving(
    serve_args: list[str],
    log_path: Path,
    ready: Callable[[str, subprocess.Popen], bool],
    timeout: float = 300.0,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """A `tokenmill serve` subprocess on 127.0.0.1 (its output in log_path): its base URL and process,
    once /v1/health/ready answers 200 and `ready(base, proc)` holds; stopped after."""
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli.main", "serve", "--port", str(port), *serve_args]
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    env.pop("TOKENMILL_API_KEY", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited early:\n{log_path.read_text()[-4000:]}")
                try:
                    if httpx.get(f"{base}/v1/health/ready", timeout=2).status_code == 200 and ready(
                        base, proc
                    ):
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not ready in {timeout:.0f}s:\n{log_path.read_text()[-4000:]}")
                time.sleep(0.5)
            yield base, proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
