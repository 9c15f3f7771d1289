"""What machine a benchmark ran on, printed at its top so every figure can be attributed."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_description() -> str:
    """The CPU model and whether it has AMX (tokenmill's bf16 matmuls use it)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    fields = [ln.split(":", 1) for ln in text.splitlines() if ":" in ln]
    model = next((v.strip() for k, v in fields if k.strip() == "model name"), "?")
    flags = next((v.split() for k, v in fields if k.strip() == "flags"), [])
    amx = sorted(f for f in flags if f.startswith("amx"))
    return f"{model}, {os.cpu_count()} cores, AMX: {' '.join(amx) if amx else 'no'}"
