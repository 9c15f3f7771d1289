"""glibc's malloc told to keep the memory a step frees, rather than hand it back to the kernel.

A CPU step allocates its activations fresh (a 2048-token prefill: 12 MB for the gate/up output of each
of 30 layers, 6 MB after silu, logits...), and PyTorch's CPU allocator asks malloc for each. By
default glibc serves blocks above its mmap threshold (128 KB, rising with use to at most 32 MB) with
mmap and returns them on free, and trims the top of its heap once more than twice that lies free: the
next step then faults every 4 KB page in again and the kernel zeroes it. On an offline prefill of 69k
tokens that was 880k page faults, ~3.5 GB re-zeroed, 13% of the process's CPU time (`perf stat`,
Intel Xeon with AMX, 2 cores; docs/history/benchmarks.md, eighth sitting). Blocks up to 32 MB now come from
the heap, and up to 1 GB of freed heap stays mapped: the resident size settles at the peak a step
needs instead of rising and falling every step.

PyTorch's CUDA caching allocator already does this on a GPU; vLLM's CPU build asks for tcmalloc in
LD_PRELOAD for the same reason. mallopt needs no extra library. A user's own MALLOC_*_ environment
settings win: nothing is changed when any is set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from typing import Any

log = logging.getLogger(__name__)

# <malloc.h> parameter numbers.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2: 32 MiB on 64-bit.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20
ENV_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's thresholds once for this process; True if they are set (now or before)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if any(k in os.environ for k in ENV_SETTINGS):
        return False
    mallopt = _glibc("mallopt")
    if mallopt is None:  # not Linux, or musl and others: no mallopt, nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    ok = all(mallopt(param, value) == 1 for param, value in settings)
    if not ok:
        log.debug("mallopt refused a setting; malloc keeps its defaults for those")
    _applied = ok
    return ok


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel once (glibc's malloc_trim), after the model is
    loaded: quantizing, smoothing and packing free hundreds of MB of transients, which the thresholds
    above would otherwise keep resident for good. A step's activations take what they need back on the
    first steps and keep it from then on. True if it ran."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def _glibc(name: str) -> Any:
    """One of glibc's malloc functions, or None where there is none (not Linux; musl and others)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
