"""Warnings a stranger can provoke are logged at a bounded rate, and say how many were left out."""

from __future__ import annotations

import logging

import pytest

from tokenmill.engine.throttled_log import ThrottledWarnings


def test_a_flood_of_one_warning_is_one_line_per_period_with_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    warn = ThrottledWarnings(logging.getLogger("throttle-test"), every_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="throttle-test"):
        for i in range(1000):  # 1,000 junk frames within the same second
            warn.warning("dropped a frame from %s", f"peer-{i}")
        warn.warning("another kind of warning")  # kinds are throttled apart
        now[0] += 10.0
        warn.warning("dropped a frame from %s", "peer-late")
    assert [r.getMessage() for r in caplog.records] == [
        "dropped a frame from peer-0",
        "another kind of warning",
        "dropped a frame from peer-late (and 999 more like it in the 10 s before)",
    ]
