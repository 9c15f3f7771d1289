"""Instruction-set levels the C++ kernels are compiled for, and which of them this CPU can run.

The kernels are built per level with fixed compiler targets rather than `-march=native`, so that a
build is named for what it needs (a cache shared by machines of different CPUs never hands one of
them instructions it lacks) and so that every lower level can be compiled and tested on a bigger
CPU: the AVX2 build a laptop would run is checked on the AVX-512 machines too.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class IsaLevel:
    name: str
    flags: tuple[str, ...]  # compiler flags on top of -O3
    requires: tuple[str, ...]  # names of torch.cpu._is_<x>_supported checks that must all pass

    def supported(self) -> bool:
        return all(_cpu_has(r) for r in self.requires)


# Best first. The AVX-512 levels keep GCC's generic preference for 256-bit vectors in auto-vectorized
# loops: on AMD Zen 4 the decode-attention kernel ran ~20% faster than with -mprefer-vector-width=512
# (its dot products are 64 floats long, and the horizontal sums cost more at 512 bits), and the
# element-wise ops were within noise (docs/history/benchmarks.md). Explicit AVX-512 intrinsics still use 512.
X86_LEVELS = (
    IsaLevel(
        "avx512_bf16",
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-DTM_AVX512_BF16=1"),
        ("avx512", "avx512_bf16", "vnni"),  # every AVX512-BF16 CPU has VNNI (Cooper Lake, SPR, Zen 4)
    ),
    IsaLevel("avx512", ("-march=x86-64-v4",), ("avx512",)),
    IsaLevel("avx2", ("-march=x86-64-v3",), ("avx2",)),
)
# Elsewhere (ARM, POWER) the compiler's own idea of this machine is the one build.
NATIVE = IsaLevel(
    "native", ("-mcpu=native",) if platform.machine() in ("aarch64", "arm64") else ("-march=native",), ()
)


# TOKENMILL_MAX_ISA caps the features tokenmill takes this CPU to have, as oneDNN's ONEDNN_MAX_CPU_ISA
# caps oneDNN's: with both at AVX2 (and ATEN_CPU_CAPABILITY=avx2), an AVX-512 machine takes every path
# an AVX2-only CPU (a laptop, AMD Zen 3) takes. `make test` runs the CPU-dependent tests so as well, so
# that an expectation that holds only on a bigger CPU fails on every machine, not only on a laptop.
_CAPS = {
    "avx2": ("avx2",),
    "avx512": ("avx2", "avx512"),
    "avx512_bf16": ("avx2", "avx512", "avx512_bf16", "vnni"),
}


def _cpu_has(feature: str) -> bool:
    cap = os.environ.get("TOKENMILL_MAX_ISA", "").lower()
    if cap and feature not in _CAPS.get(cap, (feature,)):
        return False
    check = getattr(torch.cpu, f"_is_{feature}_supported", None)
    return bool(check and check())


def cpu_has(feature: str) -> bool:
    """Whether this CPU has `feature` (avx2, avx512, avx512_bf16, vnni, amx_tile), under TOKENMILL_MAX_ISA."""
    return _cpu_has(feature)


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def all_levels() -> tuple[IsaLevel, ...]:
    """Every level the kernels have on this architecture, best first."""
    return X86_LEVELS if is_x86() else (NATIVE,)


def level_names() -> tuple[str, ...]:
    return tuple(lv.name for lv in all_levels())


def get_level(name: str) -> IsaLevel:
    for level in all_levels():
        if level.name == name:
            return level
    raise ValueError(
        f"unknown ISA level {name!r}; this machine has: {', '.join(lv.name for lv in all_levels())}"
    )


def best_level() -> IsaLevel | None:
    """The best level this CPU runs, or None (an x86 CPU without AVX2: the PyTorch ops are used)."""
    return next((lv for lv in all_levels() if lv.supported()), None)


def cpu_summary() -> str:
    """One line: what the CPU offers that matters to the kernels and to oneDNN's matmuls."""
    feats = ["avx2", "avx512", "avx512_bf16", "vnni", "amx_tile"] if is_x86() else []
    have = [f for f in feats if _cpu_has(f)]
    return f"{platform.machine()} ({', '.join(have) or 'no vector extensions detected'})"
