"""Latency of a fixed request alone and beside one busy core, for the engine's thread options, in one run.

A neighbour that keeps one core busy (another tenant's job, a load generator that busy-polls, here a
`nice -n 19` Python loop) should cost a request about its share of the machine, not twenty times its
time. OpenMP worker threads that spin at every barrier turn one stolen core into a stall of the
whole step. Each option below starts its own `tokenmill serve` and measures:

- alone: median latency of a 32-token completion (prompt of ~40 tokens), 5 requests, quiet machine;
- neighbour: the same beside a busy loop;
- neighbour gone: the same again 12 s after the busy loop ended;
- throughput: output tok/s of 64 requests at 16 concurrent streams, quiet machine.

    python benchmarks/neighbour_load.py [--options default,fixed,threads1,passive,spin0,spin10k]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_fixture import running_server  # noqa: E402

# name -> (extra `tokenmill serve` flags, environment of the server and its engine process)
OPTIONS: dict[str, tuple[list[str], dict[str, str]]] = {
    "default": ([], {}),  # adaptive threads (worker/thread_governor.py)
    "fixed": (["--no-adaptive-threads"], {}),  # all cores always, OpenMP's own waiting: the old default
    "threads1": (["--threads", "1"], {}),
    "passive": ([], {"OMP_WAIT_POLICY": "PASSIVE"}),
    "spin0": ([], {"GOMP_SPINCOUNT": "0"}),
    "spin10k": ([], {"GOMP_SPINCOUNT": "10000"}),
}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 3
BODY = {"prompt": PROMPT, "max_tokens": 32, "ignore_eos": True, "temperature": 0}


def latency(base: str, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        r = httpx.post(f"{base}/v1/completions", json=BODY, timeout=300)
        r.raise_for_status()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


async def throughput(base: str, requests: int = 64, concurrency: int = 16) -> float:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as c:

        async def one(i: int) -> int:
            async with sem:
                body = {**BODY, "prompt": f"{i}: {PROMPT}", "max_tokens": 64}
                r = await c.post(f"{base}/v1/completions", json=body)
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]

        t = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(requests))))
        return tokens / (time.perf_counter() - t)


def busy_neighbour() -> subprocess.Popen:
    # In a session of its own, as another user's job or terminal would be: with the kernel's
    # autogroup scheduling (on by default) `nice` only ranks processes within one session, so across
    # sessions the loop gets an equal share of its core whatever its nice value.
    cmd = ["nice", "-n", "19", sys.executable, "-c", "while True: pass"]
    return subprocess.Popen(cmd, start_new_session=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--options", default=",".join(OPTIONS))
    args = ap.parse_args()
    rows = []
    for name in args.options.split(","):
        flags, env = OPTIONS[name]
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with running_server(*flags) as srv:
                base = srv.base_url
                latency(base, 2)  # warm-up
                alone = latency(base)
                tput = asyncio.run(throughput(base))
                hog = busy_neighbour()
                try:
                    time.sleep(0.5)
                    beside = latency(base)
                finally:
                    hog.kill()
                    hog.wait()
                time.sleep(12)  # past the adaptive default's probe interval (10 s)
                latency(base, 1)
                after = latency(base)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        rows.append((name, flags, env, alone, beside, after, tput))
        print(
            f"{name}: alone {alone:.3f}s, beside a busy core {beside:.3f}s, after {after:.3f}s, "
            f"{tput:.1f} tok/s"
        )
    base_tput = rows[0][6]
    print(
        "| option | flags / environment | alone s | beside a busy core s | slowdown | neighbour gone s | "
        "quiet tok/s (16 streams) | vs default |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, flags, env, alone, beside, after, tput in rows:
        how = " ".join(flags + [f"{k}={v}" for k, v in env.items()]) or "(none)"
        print(
            f"| {name} | {how} | {alone:.3f} | {beside:.3f} | {beside / alone:.2f}x | {after:.3f} | "
            f"{tput:.1f} | {tput / base_tput:.2f} |"
        )


if __name__ == "__main__":
    main()
