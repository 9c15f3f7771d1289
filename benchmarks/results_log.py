"""The results log: one JSON line per benchmark run in benchmarks/results/<benchmark>.jsonl, with what is
needed to attribute the figures (CPU model and instruction sets, commit, date, command, versions).

docs/performance.md is generated from these lines by scripts/figures_page.py, so a figure printed by a
benchmark reaches the figures page only through here. Recording is on by default; `--no-record` on a
benchmark's command line (see `add_flag`) or TOKENMILL_NO_RECORD=1 skips it, for trial runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # machine.py, beside this file
from machine import cpu_fields  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent

Metric = float | int | str | None

# (vendor, family, model) -> the name the project's docs give the CPU. A cloud VM's model name often says
# only "Intel(R) Xeon(R) Processor" or "AMD EPYC", which cannot tell a Zen 4 from a Zen 5.
_KNOWN: dict[tuple[str, int, int | None], str] = {
    ("GenuineIntel", 6, 143): "Intel Sapphire Rapids",
    ("GenuineIntel", 6, 167): "Intel Sapphire Rapids",  # what this project's Intel VMs report
    ("AuthenticAMD", 25, 1): "AMD Zen 3",
    ("AuthenticAMD", 25, 17): "AMD Zen 4",
    ("AuthenticAMD", 26, None): "AMD Zen 5",
}


def _lscpu_model_name() -> str | None:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in text.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return None


def cpu_label(vendor: str | None, family: int | None, model: int | None, model_name: str | None) -> str:
    """The CPU's name as the figures page groups it: a known generation, else the model name."""
    for (v, f, m), name in _KNOWN.items():
        if vendor == v and family == f and m in (None, model):
            return name
    return model_name or "unknown CPU"


def _int(s: str | None) -> int | None:
    try:
        return int(s) if s is not None else None
    except ValueError:
        return None


def cpu_record() -> dict[str, Any]:
    """The CPU this run is on, and whether its kernels were held to AVX2 (TOKENMILL_MAX_ISA): an
    AVX-512 machine so held takes an AVX2-only CPU's paths, and its figures must say so."""
    info = cpu_fields()
    flags = set(info.get("flags", "").split())
    vendor, family, model = info.get("vendor_id"), _int(info.get("cpu family")), _int(info.get("model"))
    name = _lscpu_model_name() or info.get("model name")
    isa = [
        level
        for level, present in (
            ("avx2", "avx2" in flags),
            ("avx512", "avx512f" in flags),
            ("avx512_bf16", "avx512_bf16" in flags),
            ("amx", "amx_tile" in flags),
        )
        if present
    ]
    max_isa = os.environ.get("TOKENMILL_MAX_ISA", "").lower() or None
    return {
        "label": cpu_label(vendor, family, model, name),
        "model_name": name,
        "vendor": vendor,
        "family": family,
        "model": model,
        "isa": isa,
        "max_isa": max_isa,
        "cores": os.cpu_count(),
    }


def git_commit() -> str | None:
    """The short commit of the checkout, "-dirty" when it has changes; None without git or a repo."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
        if head.returncode != 0:
            return None
        status = subprocess.run(
            # The log's own files left out: a run earlier in a session must not mark the next one dirty.
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no",
             "--", ".", ":!benchmarks/results"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def _versions() -> dict[str, str | None]:
    try:
        import torch

        torch_version: str | None = torch.__version__
    except ImportError:
        torch_version = None
    return {"python": platform.python_version(), "torch": torch_version}


def add_flag(ap: argparse.ArgumentParser) -> None:
    """`--no-record` on a benchmark's parser."""
    ap.add_argument("--no-record", action="store_true", help="do not append this run to benchmarks/results/")


def disabled(args: argparse.Namespace | None = None) -> bool:
    off = os.environ.get("TOKENMILL_NO_RECORD", "") not in ("", "0")
    return off or bool(getattr(args, "no_record", False))


def record(
    benchmark: str,
    metrics: dict[str, Metric],
    *,
    command: list[str] | str | None = None,
    notes: str = "",
    args: argparse.Namespace | None = None,
    max_isa: str | None = None,
    commit: str | None = None,
) -> Path | None:
    """Append one run's figures to benchmarks/results/<benchmark>.jsonl; the file written, or None when
    recording is off. `max_isa`: the cap the measured processes ran under, where it is set in their
    environment rather than this one's (TOKENMILL_MAX_ISA). `commit`: the one measured, where that is not
    this checkout's (a fresh clone's). Never raises for the log's sake: a finished
    benchmark's printed figures matter more than its line here, so a failure to write is reported on
    stderr and the run goes on."""
    if disabled(args):
        return None
    if command is None:
        script = Path(sys.argv[0]).resolve()
        # A path from the repository's root, so that the command reads the same on every checkout.
        shown = script.relative_to(REPO).as_posix() if script.is_relative_to(REPO) else sys.argv[0]
        command = [shown, *sys.argv[1:]]
    line = {
        "benchmark": benchmark,
        "metrics": metrics,
        "cpu": {**cpu_record(), **({"max_isa": max_isa} if max_isa else {})},
        "commit": commit or git_commit(),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command if isinstance(command, str) else shlex.join(["python", *command]),
        **_versions(),
        "notes": notes,
        "source": None,  # measured by this run; transcribed lines name where they were taken from
    }
    path = RESULTS_DIR / f"{benchmark}.jsonl"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")
    except OSError as e:
        print(f"results log: not written ({e})", file=sys.stderr)
        return None
    print(f"results log: appended to {path}", file=sys.stderr)
    return path
