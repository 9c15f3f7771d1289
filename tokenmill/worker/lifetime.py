"""Child processes (engine, ranks) that must not outlive the process that started them."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import signal


def die_with_parent() -> None:
    """Linux: have the kernel stop this process when its parent dies, however the parent dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
