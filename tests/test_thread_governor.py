"""The adaptive thread count's decisions, on a fake clock and fake scheduler readings."""

from __future__ import annotations

import pytest

from tokenmill.worker.thread_governor import ThreadGovernor, available, others_runnable, run_delay_ns


class Fake:
    def __init__(self) -> None:
        self.now = 0.0
        self.delay_ns = 0
        self.others = 0
        self.set_to: list[int] = []

    def governor(self, max_threads: int = 2) -> ThreadGovernor:
        return ThreadGovernor(
            max_threads,
            interval_s=0.5,
            crowded=0.2,
            probe_after_s=10.0,
            clock=lambda: self.now,
            delay=lambda: self.delay_ns,
            others=lambda: self.others,
            set_threads=self.set_to.append,
        )

    def run(self, g: ThreadGovernor, seconds: float, waited_share: float, threads: int | None = None) -> None:
        """Advance in steps of 0.1 s with our threads waiting `waited_share` of the time."""
        for _ in range(round(seconds / 0.1)):
            self.now += 0.1
            self.delay_ns += int(0.1 * waited_share * (threads or g.threads) * 1e9)
            g.tick()


def test_quiet_machine_keeps_every_thread() -> None:
    f = Fake()
    g = f.governor()
    f.run(g, 60, waited_share=0.05)  # the HTTP process's own bursts: not crowding
    assert g.threads == 2 and f.set_to == []


def test_crowded_threads_step_down_then_back_up_once_the_neighbour_leaves() -> None:
    f = Fake()
    g = f.governor()
    f.others = 1
    f.run(g, 1.0, waited_share=0.5)
    assert g.threads == 1 and f.set_to == [1]
    f.run(g, 30, waited_share=0.0)  # alone on its core now; the neighbour is still runnable
    assert g.threads == 1, "no probe while something else is runnable"
    f.others = 0
    f.run(g, 1.0, waited_share=0.0)
    assert g.threads == 2 and f.set_to == [1, 2]


def test_no_probe_before_the_cool_down() -> None:
    f = Fake()
    g = f.governor()
    f.run(g, 1.0, waited_share=0.9)
    assert g.threads == 1
    f.run(g, 5.0, waited_share=0.0)  # quiet, but only 5 s since the change
    assert g.threads == 1
    f.run(g, 6.0, waited_share=0.0)
    assert g.threads == 2


def test_bounds() -> None:
    f = Fake()
    g = f.governor(max_threads=4)
    f.run(g, 10, waited_share=0.9)
    assert g.threads == 1, "never below one thread"
    f.run(g, 200, waited_share=0.0)
    assert g.threads == 4, "never above the configured count"


@pytest.mark.skipif(not available(), reason="the readings come from Linux's /proc")
def test_readings_come_from_this_machine() -> None:
    assert run_delay_ns() >= 0 and others_runnable() >= 0
