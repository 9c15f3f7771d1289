"""The worker's glibc thresholds (tokenmill/worker/malloc_tuning.py): freed step buffers are reused
without the kernel zeroing fresh pages for them again."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")

# In a fresh interpreter, so that no earlier test has set the thresholds: allocate, touch and free a
# 16 MB buffer twice, and count the page faults of the second round.
PROBE = r"""
import os, resource, sys
import torch
if sys.argv[1] == "tuned":
    from tokenmill.worker.malloc_tuning import keep_freed_memory
    assert keep_freed_memory()
def faults_of_one_round():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(16 << 20, dtype=torch.uint8)
    t.fill_(1)
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_one_round()
print(faults_of_one_round())
"""


def _second_round_faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    return int(out.stdout.split()[-1])


def test_a_freed_buffer_comes_back_without_page_faults() -> None:
    pages = (16 << 20) // resource.getpagesize()
    plain = _second_round_faults("plain")
    tuned = _second_round_faults("tuned")
    # glibc's defaults hand a 16 MB buffer back to the kernel on free: every page faults again.
    assert plain > pages // 2, f"glibc kept the buffer even untuned ({plain} faults): the probe shows nothing"
    assert tuned < pages // 20, f"{tuned} page faults re-touching a freed 16 MB buffer ({pages} pages)"


def test_it_leaves_a_users_own_malloc_settings_alone(monkeypatch) -> None:
    from tokenmill.worker import malloc_tuning

    monkeypatch.setattr(malloc_tuning, "_done", False)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert malloc_tuning.keep_freed_memory() is False
