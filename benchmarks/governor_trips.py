"""Served 32-stream throughput beside a neighbour that takes a given share of a core, per thread option.

The thread governor (tokenmill/worker/thread_governor.py) drops an engine thread when a neighbour
crowds the cores: beside a busy loop, two OpenMP threads stall each other at every barrier (a request
58x slower, benchmarks/neighbour_load.py). But a served engine's threads also wait for the server's
own HTTP process and for the load generator, and one thread fewer costs a third of the throughput; so
the governor should drop a thread only for a neighbour big enough that one thread is the faster choice.

For each neighbour share (a process in a session of its own that spins `share` of every 20 ms and
sleeps the rest) and each option, a fresh server and 15 s of 32-stream load from `tokenmill bench` (the
client `benchmarks/peers/compare.py` uses, on a fresh server as there; no warm-up, since a stalled
engine would never finish one): output tok/s, the ratio to
`--no-adaptive-threads` (all threads always) beside the same neighbour, and the governor's changes of
the thread count (from /metrics). Options take turns at going first.

    python benchmarks/governor_trips.py [--shares 0,0.25,0.5,1] [--rounds 1] [--duration 15]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_fixture import running_server  # noqa: E402

OPTIONS: dict[str, list[str]] = {
    "default": [],  # the governor
    "fixed": ["--no-adaptive-threads"],  # every thread always
    "threads1": ["--threads", "1"],
}
PERIOD_S = 0.02


def neighbour(share: float) -> subprocess.Popen | None:
    if share <= 0:
        return None
    code = (
        "import time\n"
        f"busy, idle = {share * PERIOD_S}, {(1 - share) * PERIOD_S}\n"
        "while True:\n"
        "    t = time.perf_counter()\n"
        "    while time.perf_counter() - t < busy: pass\n"
        "    if idle > 0: time.sleep(idle)\n"
    )
    # A session of its own, as another user's job would be (see benchmarks/neighbour_load.py).
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def bench(base: str, concurrency: int, duration: float, seed: int, out: Path) -> float:
    tokenmill = Path(sys.executable).with_name("tokenmill")
    cmd = [
        str(tokenmill), "bench", "--url", base, "--model", "smollm2-135m", "--endpoint", "completions",
        "--concurrency", str(concurrency), "--isl", "32", "--osl", "64", "--fixed-osl",
        "--tokenizer", "smollm2-135m", "--warmup-requests", "0", "--seed", str(seed),
        "--duration", str(duration), "--grace-period", "20", "--output", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    if summary["failed"]:
        raise SystemExit(f"{summary['failed']} requests failed: {summary['errors']}")
    return float(summary["output_token_throughput"])


def thread_changes(base: str) -> int:
    """The governor's changes of the engine's thread count since the server started (/metrics)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    m = re.search(r"^tokenmill:engine_thread_changes_total\{[^}]*\} (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shares", default="0,0.25,0.5,1", help="the neighbour's share of a core")
    ap.add_argument("--rounds", type=int, default=1, help="runs per share and option (medians)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of load per run")
    args = ap.parse_args()
    shares = [float(s) for s in args.shares.split(",")]
    tput: dict[tuple[float, str], list[float]] = {}
    changes: dict[tuple[float, str], int] = {}
    k = 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, share in enumerate(shares):
                # Each option first, second and last in turn, from share to share and round to round.
                names = list(OPTIONS)
                turn = (r + i) % len(names)
                order = names[turn:] + names[:turn]
                k += 1
                for name in order:
                    with running_server(
                        "--dtype", "bfloat16", "--max-model-len", "8192", *OPTIONS[name]
                    ) as srv:
                        hog = neighbour(share)
                        try:
                            time.sleep(0.5)
                            # Fresh prompts each run: none found in a prefix cache.
                            t = bench(
                                srv.base_url, args.concurrency, args.duration, k, Path(tmp) / f"{k}{name}"
                            )
                        finally:
                            if hog is not None:
                                hog.kill()
                                hog.wait()
                        n = thread_changes(srv.base_url)
                    tput.setdefault((share, name), []).append(t)
                    changes[share, name] = changes.get((share, name), 0) + n
                    print(
                        f"share {share:.2f} {name}: {t:.1f} tok/s, thread count changed {n} times", flush=True
                    )
    print(
        f"{args.concurrency} streams, {args.rounds} round(s), medians; "
        "ratios against `fixed` beside the same load:"
    )
    print(
        "| neighbour's share of a core | "
        + " | ".join(f"{n} tok/s (vs fixed; changes)" for n in OPTIONS)
        + " |"
    )
    print("|---|" + "---|" * len(OPTIONS))
    for share in shares:
        fixed = tput[share, "fixed"]
        cells = []
        for name in OPTIONS:
            # A stalled `fixed` run may finish nothing: any throughput is then infinitely better.
            q = statistics.median(
                a / b if b else float("inf") for a, b in zip(tput[share, name], fixed, strict=True)
            )
            cells.append(f"{statistics.median(tput[share, name]):.1f} ({q:.2f}x; {changes[share, name]})")
        print(f"| {share:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
