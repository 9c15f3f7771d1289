"""An engine's clock read on the frontend's: the timestamps of a remote engine made comparable.

Engines stamp their outputs with `time.monotonic()`, whose zero is each host's boot. A frontend on the
same host reads the same clock; one talking to a worker on another host (`tokenmill worker`, a Ray
actor on another node) would subtract its own arrival time from the worker's first-token time and get
hours. So each StepOutputs carries the engine's clock at sending (`sent_at`), and the frontend keeps the
smallest `received - sent` of the recent messages: the offset between the two clocks plus the least
transit time seen. Engine timestamps plus that shift are on the frontend's clock. On one host the shift
is the transit time alone (microseconds), and is not applied.
"""

from __future__ import annotations

import time
from collections import deque

from tokenmill.engine.protocol import EngineCoreOutput

WINDOW = 64  # messages (a heartbeat goes every half second at least): clocks drift by ppm, not faster
# Below this the clocks are one (the same host: the shift is only the transit time): outputs are left
# as they are, and the per-output work is skipped where nearly every engine runs.
SAME_CLOCK_S = 1e-3


class EngineClock:
    def __init__(self) -> None:
        self._shifts: deque[float] = deque(maxlen=WINDOW)
        self.shift = 0.0

    def observe(self, sent_at: float, received_at: float | None = None) -> float:
        """Note one message's sending time (the engine's clock); returns the shift now in force."""
        if sent_at > 0:
            self._shifts.append((time.monotonic() if received_at is None else received_at) - sent_at)
            least = min(self._shifts)
            self.shift = 0.0 if abs(least) < SAME_CLOCK_S else least
        return self.shift

    @staticmethod
    def translate(out: EngineCoreOutput, shift: float) -> None:
        """The engine's timestamps of `out` on the frontend's clock (arrival_time is the frontend's own)."""
        if out.first_scheduled_time is not None:
            out.first_scheduled_time += shift
        if out.first_token_time is not None:
            out.first_token_time += shift
        if out.finished_time is not None:
            out.finished_time += shift
        if out.new_token_times:
            out.new_token_times = [t + shift for t in out.new_token_times]
