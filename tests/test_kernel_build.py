"""The first start's kernel build (tokenmill/kernels/build.py): it says what it is doing, it stops with
whoever started it, and only the bindings pay for torch's full headers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from procs import session_processes

from tokenmill.kernels.build import CSRC, SOURCES, UNITS
from tokenmill.kernels.isa import get_level, is_x86

LINUX = sys.platform.startswith("linux")
pytestmark = [
    pytest.mark.skipif(not LINUX, reason="reads /proc; the parent-death signal is Linux's"),
    pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine"),
    pytest.mark.skipif(not is_x86() or not get_level("avx2").supported(), reason="the kernels need AVX2"),
]


def test_only_the_bindings_include_torchs_full_headers() -> None:
    """<torch/extension.h> cost 3-5 minutes a file on a loaded 2-core machine (issue #50: 21 of a first
    start's 25 minutes); the kernels need only csrc/tensor.h's, the bindings only torch's pybind casters."""
    texts = {p.name: p.read_text() for p in CSRC.iterdir()}
    assert not [name for name, text in texts.items() if "#include <torch/extension.h>" in text]
    python_side = sorted(name for name, text in texts.items() if "#include <torch/csrc/" in text)
    assert python_side == ["bindings.cpp"]
    assert {p.name for p in CSRC.glob("*.cpp")} == set(SOURCES)


def _build_child(folder: Path, timeout: float) -> int:
    """The pid of the build child working in `folder`, once it has started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    cmd = (entry / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if any(b"tokenmill.kernels.build" in part for part in cmd) and str(folder).encode() in cmd:
                    return int(entry.name)
        time.sleep(0.1)
    raise AssertionError("no build child started")


def test_a_killed_caller_takes_its_build_with_it(tmp_path: Path) -> None:
    """A server killed during its first start (SIGKILL: nothing of it runs after) leaves no compiler
    running; before that, its build said what it was doing, a line per compiled source."""
    folder = tmp_path / "build"
    folder.mkdir()
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                from pathlib import Path
                from tokenmill.kernels.build import build
                build("avx2", Path({str(folder)!r}))
            """),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        child = _build_child(folder, timeout=60)
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(caller.stderr), daemon=True).start()  # type: ignore[arg-type]
        deadline = time.monotonic() + 240
        while (
            not any("compiled" in x for x in lines) and caller.poll() is None and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        said = "".join(lines)
        assert "building the CPU kernels (avx2)" in said, said
        assert f"/{len(UNITS)}] compiled" in said, said
        assert len(session_processes(child)) > 1, "the compilers run in the build's session"
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 20
        while session_processes(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert session_processes(child) == [], "compilers outlived the process that started them"
    finally:
        if caller.poll() is None:
            caller.kill()
        for line in session_processes(child) if "child" in locals() else []:
            os.kill(int(line.split()[0]), signal.SIGKILL)
