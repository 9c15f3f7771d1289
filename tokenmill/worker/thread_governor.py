"""Torch's intra-op thread count, adapted to neighbours that compete for the machine's cores.

OpenMP threads meet at the end of every parallel op, and the first to arrive spins. When another
process keeps one core busy, the engine thread on that core gets a share of it, and the thread
spinning on the other core keeps its core from ever looking idle, so the scheduler never moves the
slowed thread there: every op then waits up to a scheduler slice. Measured on 2 cores
(benchmarks/neighbour_load.py): a 32-token request went from 0.55 s to 38.6 s beside one busy core.
Passive waiting avoids that but costs 15-20% on a quiet machine and 70% on a lone request.

So: every thread while the machine is quiet; one fewer while our threads wait in run queues (they are
being crowded) and something outside the server takes a real share of our cores; and back up, after
a while, once nothing else is runnable. The second condition matters: waiting alone also comes from
the server's own HTTP process and from a load generator's bursts (a 32-stream client uses ~0.15 of a
core), and a thread dropped for those for 10 s cost a served 32-stream run up to a third. A busy
neighbour takes a whole core; below ~0.4 of one, two threads still beat one
(benchmarks/governor_trips.py). Linux only (it reads /proc); elsewhere the thread count stays as set.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def run_delay_ns() -> int:
    """Time this process's threads have spent runnable but waiting for a CPU, summed (schedstat)."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that just ended
    return total


def _family() -> tuple[int, int]:
    """This process and its parent (the HTTP frontend, whose work is ours)."""
    return os.getpid(), os.getppid()


def _stat_fields(path: Path) -> list[str]:
    """A /proc stat file's fields after the parenthesized command name, which may itself hold spaces
    (so the first is the state, field 3 of proc(5))."""
    return path.read_text().rsplit(")", 1)[1].split()


def _family_cpu_ticks() -> int:
    """CPU time of this process (every thread) and its parent, in clock ticks."""
    total = 0
    for pid in _family():
        try:
            fields = _stat_fields(Path(f"/proc/{pid}/stat"))
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            continue
    return total


def others_cpu_s() -> float:
    """CPU seconds spent so far on the cores this process may use by everything outside this process
    and its parent (a running total: the governor takes differences)."""
    cores = {f"cpu{c}" for c in os.sched_getaffinity(0)}
    busy = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, _, rest = line.partition(" ")
        if name in cores:
            f = [int(x) for x in rest.split()]
            busy += f[0] + f[1] + f[2] + f[5] + f[6]  # user, nice, system, irq, softirq: not idle, iowait
    return max(busy - _family_cpu_ticks(), 0) / os.sysconf("SC_CLK_TCK")


def _procs_running() -> int:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("procs_running"):
            return int(line.split()[1])
    return 0


def _running_threads(pid: int) -> int:
    n = 0
    for task in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            n += _stat_fields(task)[0] == "R"
        except (OSError, IndexError):
            continue
    return n


def others_runnable(samples: int = 5) -> int:
    """Runnable threads on the machine outside this process and its parent, the least of a few quick
    samples: a busy loop is there in every sample."""
    family = set(_family())
    least = 1 << 30
    for i in range(samples):
        if i:
            time.sleep(0.001)
        least = min(least, _procs_running() - sum(_running_threads(p) for p in family))
    return max(least, 0)


def available() -> bool:
    return Path("/proc/self/task").is_dir() and Path("/proc/stat").is_file()


class ThreadGovernor:
    """Call `tick()` after each engine step; it changes torch's thread count when it should."""

    def __init__(
        self,
        max_threads: int,
        interval_s: float = 0.5,
        crowded: float = 0.2,
        neighbour_cores: float = 0.4,
        probe_after_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        delay: Callable[[], int] = run_delay_ns,
        others: Callable[[], int] = others_runnable,
        others_cpu: Callable[[], float] = others_cpu_s,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.max_threads, self.threads = max_threads, max_threads
        self.interval_s, self.crowded, self.probe_after_s = interval_s, crowded, probe_after_s
        self.neighbour_cores = neighbour_cores
        self._clock, self._delay, self._others, self._set = clock, delay, others, set_threads
        self._others_cpu = others_cpu
        self._t = clock()
        self._d = delay()
        self._o = others_cpu()
        self._changed = -float("inf")
        self.changes = 0

    def tick(self) -> None:
        now = self._clock()
        if now - self._t < self.interval_s:
            return
        d, o = self._delay(), self._others_cpu()
        # Share of our threads' time spent waiting for a CPU over the interval, and the cores that
        # everything outside the server used meanwhile.
        waited = (d - self._d) / 1e9 / ((now - self._t) * self.threads)
        neighbours = (o - self._o) / (now - self._t)
        self._t, self._d, self._o = now, d, o
        if self.threads > 1 and waited > self.crowded and neighbours >= self.neighbour_cores:
            why = f"threads waited {waited:.0%} of the time for a CPU, others used {neighbours:.1f} cores"
            self._change(self.threads - 1, why)
        elif (
            self.threads < self.max_threads
            and now - self._changed >= self.probe_after_s
            and self._others() == 0
        ):
            self._change(self.threads + 1, "nothing else is runnable")

    def _change(self, n: int, why: str) -> None:
        log.info("engine threads %d -> %d: %s", self.threads, n, why)
        self.threads = n
        self._set(n)
        self._changed = self._clock()
        self._d = self._delay()  # the new count's own interval starts now
        self._o = self._others_cpu()
        self._t = self._changed
        self.changes += 1


def make_governor(enabled: bool) -> ThreadGovernor | None:
    if not enabled or not available() or torch.get_num_threads() < 2:
        return None
    return ThreadGovernor(torch.get_num_threads())
