"""worker/allocator.py: glibc keeps a step's freed activations mapped, so the next step does not fault
them in again. Checked by the process's own minor page-fault count (getrusage), in a child process so
that this one's malloc settings stay as they were."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = r"""
import resource, sys, torch
from tokenmill.worker.allocator import keep_freed_memory
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
# float32: the same 12 MB result as a step's bf16 activations of 2048 rows, without the minute a CPU
# with no BF16 instructions spends on emulated bf16 products (the allocator is what is tested).
x = torch.ones(1024, 576)
w = torch.ones(3072, 576)
for _ in range(3):
    (x @ w.T).sum()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(60):
    y = x @ w.T  # 12 MB, fresh each time, freed at the next assignment
    y.sum()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str, env: dict[str, str] | None = None) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True, timeout=120, env=env
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is a Linux matter")
def test_freed_activations_are_reused_not_faulted_again() -> None:
    # The baseline holds glibc's mmap threshold at its initial 128 KB, so every 12 MB block is mapped and
    # unmapped: what the default does until its dynamic threshold climbs, and in some runs (heap layout,
    # ASLR) for good. Left dynamic, the default faulted 116-122k times in three children and 3k in a
    # fourth (AMD Zen 4), which made a comparison with it flaky.
    returned = faults("plain", env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072"))
    tuned = faults("tuned")
    # 60 steps x 12 MB at 4 KB a page: ~180k faults when every block is mapped afresh. Tuned, the block
    # comes back from the heap: what faults is a one-time growth of the heaps (~6-7k, whatever the
    # number of steps).
    assert returned > 150_000, returned
    assert tuned < returned / 10, (returned, tuned)


def test_a_users_malloc_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    import tokenmill.worker.allocator as allocator

    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert allocator.keep_freed_memory() is False


RELEASE_CHILD = r"""
import torch
from tokenmill.worker.allocator import keep_freed_memory, release_freed_memory
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 >> 20
assert keep_freed_memory()
held = [torch.ones(1 << 20) for _ in range(200)]  # 800 MB in 4 MB blocks, below the mmap threshold
start = rss_mib()
del held
kept = rss_mib()
assert release_freed_memory()
print(start, kept, rss_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim is a Linux matter")
def test_the_loads_transients_are_handed_back() -> None:
    """A load's freed transients stay resident under keep_freed_memory until release_freed_memory."""
    out = subprocess.run(
        [sys.executable, "-c", RELEASE_CHILD], capture_output=True, text=True, check=True, timeout=120
    )
    start, kept, released = map(int, out.stdout.split())
    assert kept > start - 100, (start, kept)  # kept: the thresholds hold freed heap resident
    assert released < kept - 600, (start, kept, released)
