"""What machine a benchmark ran on, printed at its top so every figure can be attributed."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_description() -> str:
    """The CPU model with its family and model numbers (a virtual machine's model name may say only "AMD
    EPYC": family 25 is Zen 4, 26 Zen 5), whether it has AVX512-BF16, and whether it has AMX (tokenmill's
    bf16 matmuls use both)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    fields = [ln.split(":", 1) for ln in text.splitlines() if ":" in ln]

    def first(key: str) -> str:
        return next((v.strip() for k, v in fields if k.strip() == key), "?")

    flags = first("flags").split()
    amx = sorted(f for f in flags if f.startswith("amx"))
    bf16 = "avx512_bf16" if "avx512_bf16" in flags else "no avx512_bf16"
    return (
        f"{first('model name')} (family {first('cpu family')} model {first('model')}),"
        f" {os.cpu_count()} cores, {bf16}, AMX: {' '.join(amx) if amx else 'no'}"
    )
