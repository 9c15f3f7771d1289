"""Child processes (engine, ranks) that must not outlive the process that started them, nor act on a
terminal's Ctrl-C themselves."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import signal
from collections.abc import Iterator
from types import FrameType


def die_with_parent() -> None:
    """Linux: have the kernel stop this process when its parent dies, however the parent dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Start child processes inside this: they begin with SIGINT blocked.

    A terminal's Ctrl-C reaches every process of the foreground group, so also a child still importing
    its modules, where it would raise KeyboardInterrupt and print a traceback. A signal mask survives
    fork and exec, so the child holds any SIGINT pending until `ignore_interrupts` takes it over. Only
    this thread's mask changes: a SIGINT meant for this process meanwhile goes to another thread or
    waits, and is not lost.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


_interrupted = False


def _note_interrupt(signum: int, frame: FrameType | None) -> None:
    global _interrupted
    _interrupted = True


def ignore_interrupts() -> None:
    """In a process whose parent governs its life: a SIGINT is noted, never raised.

    The parent, which gets the same Ctrl-C, tells this process to stop (or dies, and die_with_parent
    ends it). A handler rather than SIG_IGN: an ignored signal stays ignored in the programs this
    process runs (a compiler building the kernels), which would then outlive the Ctrl-C.
    """
    signal.signal(signal.SIGINT, _note_interrupt)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # any SIGINT held since the start: noted


def interrupted() -> bool:
    """Whether a SIGINT came since ignore_interrupts(): a failure now is likely the Ctrl-C's doing
    (a compiler it stopped), not a fault to report."""
    return _interrupted
