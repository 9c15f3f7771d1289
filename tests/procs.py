"""Processes of this machine as tests see them (Linux's /proc), and the worker processes tests start."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from server_fixture import free_port


def stop(proc: subprocess.Popen) -> None:
    """Ask a process to end; kill it if it has not within 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def worker_process(*args: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`tokenmill worker` on a free loopback port with `args` (and `env` over this environment): its
    url and process; what it said is printed if the test fails, and it is stopped after. The process's
    `said()` returns what it has printed so far."""
    url = f"tcp://127.0.0.1:{free_port()}"
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.cli.main",
        "worker",
        "--listen",
        url,
        "--max-model-len",
        "512",
        # stop() ends it with SIGTERM: a short drain (a test that drains sets its own, later on the line)
        "--drain-timeout",
        "5",
        *args,
    ]
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
        )

        def said() -> str:
            with open(log.fileno(), closefd=False) as f:
                f.seek(0)
                return f.read()

        proc.said = said  # type: ignore[attr-defined]
        try:
            yield url, proc
        except BaseException:
            log.seek(0)  # a worker that failed to start (a port taken, a crash) says why in the test output
            print(f"worker {url} (exit code {proc.poll()}) said:\n{log.read()[-6000:]}")
            raise
        finally:
            stop(proc)


def session_processes(sid: int) -> list[str]:
    """The live processes of session `sid` (a server started in a session of its own), as "pid command"."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Fields after the command's closing parenthesis: state, ppid, pgrp, session, ...
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(f"{entry.name} {command}")
    return found
