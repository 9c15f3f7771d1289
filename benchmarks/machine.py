"""What machine a benchmark ran on, printed at its top so every figure can be attributed, and how busy
other processes kept it meanwhile."""

from __future__ import annotations

import os
import time
from pathlib import Path


def cpu_fields() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            out.setdefault(k.strip(), v.strip())
    return out


def cpu_description() -> str:
    """The CPU model with its family and model numbers (a virtual machine's model name may say only "AMD
    EPYC": family 25 is Zen 4, 26 Zen 5), whether it has AVX512-BF16, and whether it has AMX (tokenmill's
    bf16 matmuls use both)."""
    fields = cpu_fields()
    if not fields:
        return "unknown CPU"

    def first(key: str) -> str:
        return fields.get(key, "?")

    flags = first("flags").split()
    amx = sorted(f for f in flags if f.startswith("amx"))
    bf16 = "avx512_bf16" if "avx512_bf16" in flags else "no avx512_bf16"
    return (
        f"{first('model name')} (family {first('cpu family')} model {first('model')}),"
        f" {os.cpu_count()} cores, {bf16}, AMX: {' '.join(amx) if amx else 'no'}"
    )


CLK_TCK = os.sysconf("SC_CLK_TCK")


def busy_cpu_s() -> float:
    """CPU seconds this machine has spent busy since boot (all cores)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


def tree_cpu_s(root: int) -> float:
    """CPU seconds of process `root` and everything under it (children reaped included)."""
    stats: dict[int, tuple[int, float]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            rest = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after the name: state ppid ... utime(12) stime(13) cutime(14) cstime(15)
        stats[int(d.name)] = (int(rest[1]), sum(int(x) for x in rest[11:15]) / CLK_TCK)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo += [p for p, (ppid, _) in stats.items() if ppid == pid]
    return total


class ForeignLoad:
    """The share of this machine's cores that other processes kept busy during a `with` block: the
    machine is shared, and a figure measured beside a busy neighbour says so next to itself."""

    share = 0.0

    def __enter__(self) -> ForeignLoad:
        self._cpu, self._ours, self._t = busy_cpu_s(), tree_cpu_s(os.getpid()), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        foreign = (busy_cpu_s() - self._cpu) - (tree_cpu_s(os.getpid()) - self._ours)
        self.share = max(foreign, 0.0) / ((time.perf_counter() - self._t) * (os.cpu_count() or 1))
