"""The memory a server holds: every process of its process group (compare.py starts each server in its
own session, so vLLM's engine core and tokenmill's engine process are counted with their API server),
read from /proc (Linux only).

PSS (proportional set size) is the fair sum over several processes: a page two of them map counts half
in each, so the group's PSS is what the machine would get back if the server stopped. RSS counts such a
page in every process; peak is the sum of each process's own high-water mark (VmHWM), an upper bound of
the group's peak, since the processes need not peak at once.
"""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


def _group_of(pid_dir: Path) -> int | None:
    try:
        stat = (pid_dir / "stat").read_text()
    except OSError:  # gone, or not ours to read
        return None
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses; it ends at the last ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[2])


def _kb(text: str, key: str) -> int:
    for line in text.splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    return 0


def group_memory_mb(pgid: int) -> dict[str, float] | None:
    """{"pss", "rss", "peak"} in MB (10^6 bytes) and "processes" over the process group `pgid`; None
    where /proc cannot tell (not Linux, or no process of the group left)."""
    if not (PROC / "self" / "smaps_rollup").exists():
        return None
    pss = rss = peak = count = 0
    for pid_dir in PROC.iterdir():
        if not pid_dir.name.isdigit() or _group_of(pid_dir) != pgid:
            continue
        try:
            rollup = (pid_dir / "smaps_rollup").read_text()
            status = (pid_dir / "status").read_text()
        except OSError:
            continue
        pss += _kb(rollup, "Pss:")
        rss += _kb(rollup, "Rss:")
        peak += _kb(status, "VmHWM:")
        count += 1
    if not count:
        return None
    return {"pss": pss * 1024 / 1e6, "rss": rss * 1024 / 1e6, "peak": peak * 1024 / 1e6, "processes": count}
