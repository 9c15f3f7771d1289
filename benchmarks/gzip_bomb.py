"""How fast and how cheaply the server refuses a gzip bomb on the KServe infer route.

A 1.04 MB gzip body that inflates to 1 GiB of zeros, posted 5 times as gzip writes it and 5 times with
its size trailer forged to 1 KiB (so only the capped inflation can catch it). Prints the median time
to the 413 and the server's RSS before and after.

    python benchmarks/gzip_bomb.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_fixture import example_repository, running_server  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = b"".join(z.compress(bytes(1 << 24)) for _ in range(64)) + z.flush()
    forged = bomb[:-4] + (1024).to_bytes(4, "little")
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_server("--model-repository", str(example_repository(Path(tmp)))) as p,
    ):
        url = f"{p.base_url}/v2/models/linear_onnx/infer"
        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        with httpx.Client(timeout=60) as c:
            for name, body in (("as gzip writes it", bomb), ("size trailer forged", forged)):
                before, times = rss_mb(p.pid), []
                for _ in range(5):
                    t = time.perf_counter()
                    r = c.post(url, content=body, headers=headers)
                    times.append(time.perf_counter() - t)
                    assert r.status_code == 413, r.text
                ms = statistics.median(times) * 1000
                print(
                    f"{name}: {len(body) / 1e6:.2f} MB body, 413 after {ms:.0f} ms (median of 5), "
                    f"server RSS {before:.0f} -> {rss_mb(p.pid):.0f} MB"
                )


if __name__ == "__main__":
    main()
