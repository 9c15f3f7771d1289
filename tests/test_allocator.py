"""worker/allocator.py: glibc keeps a step's freed activations mapped, so the next step does not fault
them in again. Checked by the process's own minor page-fault count (getrusage), in a child process so
that this one's malloc settings stay as they were."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = r"""
import resource, sys, torch
from tokenmill.worker.allocator import keep_freed_memory
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
x = torch.ones(2048, 576, dtype=torch.bfloat16)
w = torch.ones(3072, 576, dtype=torch.bfloat16)
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
    plain, tuned = faults("plain"), faults("tuned")
    # 60 steps x 12 MB at 4 KB a page: ~180k faults if every block is mapped afresh. Tuned, the block
    # comes back from the heap: what faults is a one-time growth of the heaps (~7k here, whatever the
    # number of steps).
    assert plain > 60_000, plain
    assert tuned < plain / 10, (plain, tuned)


def test_a_users_malloc_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    import tokenmill.worker.allocator as allocator

    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert allocator.keep_freed_memory() is False
