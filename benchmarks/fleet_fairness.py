"""Fair shares across a fleet (issue 59): does a tenant keep its share of the fleet when another floods
it, even when routing keeps the first tenant's requests on one worker?

A real `tokenmill serve --workers 2 --policy fair --max-num-seqs 4 --tenant-weights B=3 --router
session`: the fleet runs 8 requests at once, and B's weight entitles it to 3/4 of the fleet's service
when both tenants are backlogged, 6 places. B runs a closed loop of 6 streams (its share; with
`--b-streams 12` it stays backlogged, asking for more), all in one session, so the session policy keeps
them on one worker: 512-token prompts of B's own system prompt and
a short question, 32 tokens of answer. Tenant A floods: 40 streams (ten times what it asks of a fair
fleet), 64-token private prompts in sessions of their own (spread over both workers), 32 tokens each.

Each worker's own fair queue can give B at most that one worker: 4 places, half the fleet. With the
router's queue (`--router-queue on`), a full fleet's free places go to the tenant served least wherever
they free up. Measured with A flooding, per setting: B's share of the output tokens the fleet served
(its entitlement is 75%), and B's TTFT p50 and tokens/s over B's alone on the same server. On a small
CPU machine the alone figures are of a fleet B leaves half idle (2 cores, 2 workers and the front), so
the ratios say what sharing the machine costs as well as what fairness keeps; the share says the
latter alone.

    python benchmarks/fleet_fairness.py [--b-requests 48] [--settings on,off]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from machine import cpu_description  # noqa: E402
from results_log import add_flag, record  # noqa: E402
from server_fixture import running_server  # noqa: E402

MODEL = "smollm2-135m"
SEQS = 4  # places per worker
B_STREAMS, A_STREAMS, B_WEIGHT = 6, 10 * SEQS, 3
B_PREFIX, B_QUESTION, A_PROMPT, OSL = 512, 16, 64, 32


class Tenant:
    def __init__(self, name: str, seed: int, session: str | None = None) -> None:
        self.name, self.rng, self.session = name, random.Random(seed), session
        self.ttft: list[float] = []
        self.tokens = 0

    async def stream(self, http: httpx.AsyncClient, prompt: list[int]) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": OSL, "stream": True, "ignore_eos": True}
        body["user"] = self.session or f"{self.name}-{self.rng.random()}"  # the session policy's key
        t0 = time.perf_counter()
        first = None
        async with http.stream("POST", "/v1/completions", json=body, headers={"x-tenant-id": self.name}) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if first is None:
                    first = time.perf_counter() - t0
        if first is not None:
            self.ttft.append(first)
            self.tokens += OSL  # ignore_eos: every request generates all of them


async def b_loop(http: httpx.AsyncClient, b: Tenant, prefix: list[int], n: int) -> float:
    """B's closed loop of B_STREAMS streams until n requests are done; its wall time."""
    left = [n]

    async def one() -> None:
        while left[0] > 0:
            left[0] -= 1
            await b.stream(http, prefix + [b.rng.randrange(1000, 40_000) for _ in range(B_QUESTION)])

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(B_STREAMS)))
    return time.perf_counter() - t0


async def a_flood(http: httpx.AsyncClient, a: Tenant, stop: asyncio.Event) -> None:
    async def one() -> None:
        while not stop.is_set():
            await a.stream(http, [a.rng.randrange(1000, 40_000) for _ in range(A_PROMPT)])

    await asyncio.gather(*(one() for _ in range(A_STREAMS)))


def summary(b: Tenant, wall: float) -> dict:
    return {
        "ttft_p50_ms": 1000 * statistics.median(b.ttft),
        "tok_s": b.tokens / wall,
        "requests": len(b.ttft),
    }


async def measure(base: str, n: int) -> dict:
    limits = httpx.Limits(max_connections=A_STREAMS + B_STREAMS + 8)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
        prefix = [random.Random(7).randrange(1000, 40_000) for _ in range(B_PREFIX)]
        await Tenant("B", 99, "b").stream(http, prefix)  # warm: B's prompt cached where it landed
        alone_b = Tenant("B", 1, "b")
        alone = summary(alone_b, await b_loop(http, alone_b, prefix, n))
        a, flooded_b, stop = Tenant("A", 2), Tenant("B", 3, "b"), asyncio.Event()
        flood = asyncio.create_task(a_flood(http, a, stop))
        while a.tokens < A_STREAMS * OSL:  # A's flood under way (and queued) before B starts
            await asyncio.sleep(0.1)
        a_before = a.tokens
        wall = await b_loop(http, flooded_b, prefix, n)
        flooded = summary(flooded_b, wall)
        # what the whole fleet served meanwhile, and B's part of it (entitled to B_WEIGHT / (B_WEIGHT + 1))
        flooded["a_tok_s"] = (a.tokens - a_before) / wall
        flooded["b_share"] = flooded_b.tokens / max(flooded_b.tokens + a.tokens - a_before, 1)
        stop.set()
        await flood
    return {"alone": alone, "flooded": flooded}


def main() -> None:
    global B_STREAMS  # b_loop reads it
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--b-requests", type=int, default=48, help="B's requests per phase")
    ap.add_argument("--settings", default="on,off", help="--router-queue settings to run")
    ap.add_argument("--b-streams", type=int, default=B_STREAMS, help="B's closed-loop streams (6: its share)")
    add_flag(ap)
    args = ap.parse_args()
    B_STREAMS = args.b_streams
    cpu = cpu_description()
    print(f"CPU: {cpu}")
    serve = ["--workers", "2", "--policy", "fair", "--tenant-header", "x-tenant-id", "--router", "session"]
    serve += ["--tenant-weights", f"B={B_WEIGHT}"]
    serve += ["--max-num-seqs", str(SEQS), "--max-queued-requests", "128", "--max-model-len", "2048"]
    results: dict[str, dict] = {}
    for setting in args.settings.split(","):
        with running_server(*serve, "--router-queue", setting) as proc:
            r = asyncio.run(measure(proc.base_url, args.b_requests))  # type: ignore[attr-defined]
        r["ttft_ratio"] = r["flooded"]["ttft_p50_ms"] / r["alone"]["ttft_p50_ms"]
        r["tok_s_ratio"] = r["flooded"]["tok_s"] / r["alone"]["tok_s"]
        results[setting] = r
        print(
            f"--router-queue {setting}: B alone TTFT p50 {r['alone']['ttft_p50_ms']:.0f} ms, "
            f"{r['alone']['tok_s']:.1f} tok/s; with A flooding {r['flooded']['ttft_p50_ms']:.0f} ms "
            f"({r['ttft_ratio']:.2f}x), {r['flooded']['tok_s']:.1f} tok/s ({r['tok_s_ratio']:.2f}x); "
            f"A {r['flooded']['a_tok_s']:.1f} tok/s meanwhile; "
            f"B's share {100 * r['flooded']['b_share']:.0f}% "
            f"(entitled to {100 * B_WEIGHT / (B_WEIGHT + 1):.0f}%)",
            flush=True,
        )
    metrics: dict[str, float | int | str | None] = {"b_requests": args.b_requests, "b_streams": B_STREAMS}
    for setting, r in results.items():
        metrics[f"queue_{setting}_b_share"] = round(r["flooded"]["b_share"], 3)
        metrics[f"queue_{setting}_a_flooded_tok_s"] = round(r["flooded"]["a_tok_s"], 1)
        metrics[f"queue_{setting}_b_ttft_ratio"] = round(r["ttft_ratio"], 3)
        metrics[f"queue_{setting}_b_tok_s_ratio"] = round(r["tok_s_ratio"], 3)
        metrics[f"queue_{setting}_b_alone_ttft_p50_ms"] = round(r["alone"]["ttft_p50_ms"], 1)
        metrics[f"queue_{setting}_b_flooded_ttft_p50_ms"] = round(r["flooded"]["ttft_p50_ms"], 1)
        metrics[f"queue_{setting}_b_alone_tok_s"] = round(r["alone"]["tok_s"], 1)
        metrics[f"queue_{setting}_b_flooded_tok_s"] = round(r["flooded"]["tok_s"], 1)
    record(
        "fleet_fairness",
        metrics,
        args=args,
        notes=f"2 workers x {SEQS} places; B weight {B_WEIGHT}, {B_STREAMS} streams in one session; "
        f"A {A_STREAMS} streams; --router session",
    )


if __name__ == "__main__":
    main()
