"""Keep freed memory in the process instead of handing it back to the kernel after every step.

A step allocates activations of a few MB to a few tens of MB (a 2048-token prefill's MLP input is
12 MB) and frees them when it ends. glibc serves such sizes with mmap, or trims them off the top of
the heap on free, so the next step gets fresh pages and the kernel zeroes each one on first touch: an
offline run of 256 requests took ~490k page faults in its timed part (`getrusage`), ~2 GB zeroed on
the critical path. With a fixed mmap threshold of 32 MB (glibc's largest) and no trimming, the same
run took ~125k and ran ~1% faster (Intel AMX, 2 cores, docs/benchmarks.md). The cost is that a
process keeps its peak heap, which a serving worker reaches in its first minutes anyway.
Does nothing off glibc (musl, macOS, Windows), or when the user set MALLOC_* variables themselves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
NO_TRIM = 2**31 - 1  # mallopt takes an int: a free top of the heap never reaches this

_done = False


def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; True if they were set."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux") or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
    ok = mallopt(M_TRIM_THRESHOLD, NO_TRIM) == 1 and ok
    if not ok:
        log.debug("mallopt refused the thresholds; allocations stay as glibc sets them")
    _done = ok
    return ok
