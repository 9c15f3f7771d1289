"""Soak: mixed load with cancellations for a long while; memory and KV blocks in use over time.

A steady mix (short and long prompts, streamed and not, some clients hanging up mid-stream) at a fixed
concurrency against `tokenmill serve`. Every 10 s: RSS of the HTTP process and of the engine process,
KV blocks in use and requests running (from /metrics). At the end the table and a plot; the figures
to read are the RSS slope after warm-up (flat means no leak) and KV blocks in use returning to 0 once
the load stops. Exit status 1 if any request failed other than by the client's own hang-up.

    python benchmarks/soak.py [--minutes 30] [--concurrency 8] [--plot soak.png]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_fixture import running_server  # noqa: E402

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


async def client(base: str, rng: random.Random, stop: float, counts: dict[str, int]) -> None:
    async with httpx.AsyncClient(timeout=120) as c:
        while time.monotonic() < stop:
            words = rng.randint(5, 400)
            body = {
                "prompt": " ".join(rng.choice(WORDS) for _ in range(words)),
                "max_tokens": rng.randint(4, 128),
                "ignore_eos": True,
                "temperature": rng.choice([0, 0.8]),
                "stream": rng.random() < 0.7,
            }
            hang_up = body["stream"] and rng.random() < 0.2
            try:
                if body["stream"]:
                    async with c.stream("POST", f"{base}/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            counts[f"http_{r.status_code}"] = counts.get(f"http_{r.status_code}", 0) + 1
                            continue
                        n = 0
                        async for line in r.aiter_lines():
                            if '"error"' in line:
                                counts["stream_error"] = counts.get("stream_error", 0) + 1
                            n += 1
                            if hang_up and n > 3:
                                break  # leave mid-stream: the server must abort and free the blocks
                    counts["cancelled" if hang_up else "ok"] += 1
                else:
                    r = await c.post(f"{base}/v1/completions", json=body)
                    key = "ok" if r.status_code == 200 else f"http_{r.status_code}"
                    counts[key] = counts.get(key, 0) + 1
            except httpx.HTTPError as e:
                counts[type(e).__name__] = counts.get(type(e).__name__, 0) + 1


async def soak(base: str, server_pid: int, engine_pid: int, minutes: float, concurrency: int) -> list[tuple]:
    rng = random.Random(0)
    stop = time.monotonic() + minutes * 60
    counts: dict[str, int] = {"ok": 0, "cancelled": 0}
    tasks = [
        asyncio.create_task(client(base, random.Random(rng.random()), stop, counts))
        for _ in range(concurrency)
    ]
    samples: list[tuple[float, float, float, float, float]] = []
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:

        async def sample() -> None:
            m = (await c.get(f"{base}/metrics")).text
            kv, running = (
                metric(m, "tokenmill:kv_cache_blocks_in_use"),
                metric(m, "tokenmill:num_requests_running"),
            )
            samples.append((time.monotonic() - t0, rss_mb(server_pid), rss_mb(engine_pid), kv, running))
            t, http, eng = samples[-1][:3]
            print(
                f"{t:6.0f}s HTTP {http:6.1f} MB engine {eng:7.1f} MB KV {kv:4.0f} run {running:2.0f} {counts}"
            )

        while not all(t.done() for t in tasks):
            await sample()
            await asyncio.sleep(10)
        await asyncio.sleep(2)
        await sample()
    print(f"final: {counts}; after the load: KV blocks {samples[-1][3]:.0f}, running {samples[-1][4]:.0f}")
    return samples, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--plot", help="write RSS and KV blocks over time to this PNG")
    args = ap.parse_args()
    with running_server("--max-num-seqs", str(args.concurrency)) as srv:
        engine_pid = httpx.get(f"{srv.base_url}/v1/metadata").json()["engine_pid"]
        samples, counts = asyncio.run(soak(srv.base_url, srv.pid, engine_pid, args.minutes, args.concurrency))
    warm = [s for s in samples if s[0] >= min(300, samples[-1][0] / 3)]
    if len(warm) >= 2:
        hours = (warm[-1][0] - warm[0][0]) / 3600
        print(
            f"after warm-up: engine RSS {warm[0][2]:.0f} -> {warm[-1][2]:.0f} MB "
            f"({(warm[-1][2] - warm[0][2]) / max(hours, 1e-9):+.0f} MB/h), "
            f"HTTP RSS {warm[0][1]:.0f} -> {warm[-1][1]:.0f} MB"
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        t = [s[0] / 60 for s in samples]
        ax.plot(t, [s[2] for s in samples], label="engine RSS (MB)")
        ax.plot(t, [s[1] for s in samples], label="HTTP RSS (MB)")
        ax.set_xlabel("minutes")
        ax.set_ylabel("MB")
        ax2 = ax.twinx()
        ax2.plot(t, [s[3] for s in samples], color="gray", alpha=0.5, label="KV blocks in use")
        ax2.set_ylabel("KV blocks in use")
        fig.legend(loc="upper left")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
    failed = sum(v for k, v in counts.items() if k not in ("ok", "cancelled"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
