"""Warnings that strangers can provoke, logged at a bounded rate.

A worker reachable over the network logs what it drops (frames of peers without the secret, malformed
requests). Each such line costs nothing to send and a line of log to receive: unthrottled, a flood of
junk fills the disk and buries everything else. So each kind of warning is written at most once per
`every_s`, and the next line says how many were left out meanwhile."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable


class ThrottledWarnings:
    def __init__(
        self, log: logging.Logger, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.log, self.every_s, self.clock = log, every_s, clock
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}
        self._lock = threading.Lock()  # the transfer server and the engine loop warn from their threads

    def warning(self, fmt: str, *args: object) -> None:
        """Log `fmt % args` unless a warning of the same `fmt` went out less than every_s ago."""
        now = self.clock()
        with self._lock:
            if now - self._last.get(fmt, -math.inf) < self.every_s:
                self._left_out[fmt] = self._left_out.get(fmt, 0) + 1
                return
            self._last[fmt] = now
            left_out = self._left_out.pop(fmt, 0)
        if left_out:
            self.log.warning(
                fmt + " (and %d more like it in the %.0f s before)", *args, left_out, self.every_s
            )
        else:
            self.log.warning(fmt, *args)
