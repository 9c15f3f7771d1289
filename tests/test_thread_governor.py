"""The adaptive thread count's decisions, on a fake clock and fake scheduler readings."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tokenmill.worker.thread_governor import (
    ThreadGovernor,
    available,
    others_cpu_s,
    others_runnable,
    run_delay_ns,
)


class Fake:
    def __init__(self) -> None:
        self.now = 0.0
        self.delay_ns = 0
        self.others = 0
        self.others_cores = 0.0  # CPU that processes outside the server use, in cores
        self.others_s = 0.0
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
            others_cpu=lambda: self.others_s,
            set_threads=self.set_to.append,
        )

    def run(self, g: ThreadGovernor, seconds: float, waited_share: float, threads: int | None = None) -> None:
        """Advance in steps of 0.1 s with our threads waiting `waited_share` of the time."""
        for _ in range(round(seconds / 0.1)):
            self.now += 0.1
            self.delay_ns += int(0.1 * waited_share * (threads or g.threads) * 1e9)
            self.others_s += 0.1 * self.others_cores
            g.tick()


def test_quiet_machine_keeps_every_thread() -> None:
    f = Fake()
    g = f.governor()
    f.run(g, 60, waited_share=0.05)  # the HTTP process's own bursts: not crowding
    assert g.threads == 2 and f.set_to == []


def test_crowded_threads_step_down_then_back_up_once_the_neighbour_leaves() -> None:
    f = Fake()
    g = f.governor()
    f.others, f.others_cores = 1, 1.0  # a busy loop: a whole core
    f.run(g, 1.0, waited_share=0.5)
    assert g.threads == 1 and f.set_to == [1]
    f.run(g, 30, waited_share=0.0)  # alone on its core now; the neighbour is still runnable
    assert g.threads == 1, "no probe while something else is runnable"
    f.others = 0
    f.run(g, 1.0, waited_share=0.0)
    assert g.threads == 2 and f.set_to == [1, 2] and g.changes == 2


def test_no_probe_before_the_cool_down() -> None:
    f = Fake()
    g = f.governor()
    f.others_cores = 1.0
    f.run(g, 1.0, waited_share=0.9)
    assert g.threads == 1
    f.others_cores = 0.0
    f.run(g, 5.0, waited_share=0.0)  # quiet, but only 5 s since the change
    assert g.threads == 1
    f.run(g, 6.0, waited_share=0.0)
    assert g.threads == 2


def test_bounds() -> None:
    f = Fake()
    g = f.governor(max_threads=4)
    f.others_cores = 3.0
    f.run(g, 10, waited_share=0.9)
    assert g.threads == 1, "never below one thread"
    f.others_cores = 0.0
    f.run(g, 200, waited_share=0.0)
    assert g.threads == 4, "never above the configured count"


def test_waiting_without_a_neighbour_keeps_every_thread() -> None:
    """The server's own HTTP process and a load generator's bursts make our threads wait too; a
    thread dropped for them cost a served 32-stream run ~30% (benchmarks/governor_trips.py)."""
    f = Fake()
    g = f.governor()
    f.others_cores = 0.15  # a 32-stream `tokenmill bench` client, measured
    f.run(g, 30, waited_share=0.35)
    assert g.threads == 2 and f.set_to == []
    f.others_cores = 1.0  # now a busy loop as well
    f.run(g, 1.0, waited_share=0.35)
    assert g.threads == 1 and f.set_to == [1]


def test_a_neighbour_that_leaves_our_threads_alone_is_not_crowding() -> None:
    f = Fake()
    g = f.governor()
    f.others_cores = 1.0  # busy on a core of its own: our threads do not wait
    f.run(g, 30, waited_share=0.05)
    assert g.threads == 2 and f.set_to == []


@pytest.mark.skipif(not available(), reason="the readings come from Linux's /proc")
def test_readings_come_from_this_machine() -> None:
    assert run_delay_ns() >= 0 and others_runnable() >= 0 and others_cpu_s() >= 0


@pytest.mark.skipif(not available(), reason="the readings come from Linux's /proc")
def test_a_busy_child_counts_as_a_neighbour() -> None:
    """A child of this process is outside it and its parent: its CPU is a neighbour's."""
    before = others_cpu_s()
    t = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass",
        ],
        check=True,
    )
    used = others_cpu_s() - before
    assert used >= 0.4, f"a child's 0.5 s of CPU read as {used:.2f} s in {time.monotonic() - t:.2f} s"
