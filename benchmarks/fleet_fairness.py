"""Fair shares across a fleet (issue 59): does a tenant within its share keep its service when another
floods the fleet at ten times its own?

A real `tokenmill serve --workers 2 --policy fair --max-num-seqs 4` (each worker gets one core, so the
fleet runs 8 requests at once), with tenants named by a header. Tenant B runs a closed loop of 4
streams (its share: half the fleet's places), each a 512-token system prompt of B's own, a short
question and 32 tokens of answer. Tenant A floods: 40 streams (ten times its share) of private 64-token
prompts, 32 tokens each. Measured, for B, in one run per setting: TTFT p50 and output tokens/s with A
flooding, over the same figures with B alone on the same server.

Two settings: `--router-queue on` (requests wait at the router while every worker is full, and each
freed place goes to the tenant served least across the fleet) and `off` (each worker's own fair queue
only). With kv routing, B's shared system prompt keeps B's requests on the worker that holds it, so
without the router's queue B gets half of that one worker: a quarter of the fleet, half its share.

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
B_STREAMS, A_STREAMS = SEQS, 10 * SEQS
B_PREFIX, B_QUESTION, A_PROMPT, OSL = 512, 16, 64, 32


class Tenant:
    def __init__(self, name: str, seed: int) -> None:
        self.name, self.rng = name, random.Random(seed)
        self.ttft: list[float] = []
        self.tokens = 0

    async def stream(self, http: httpx.AsyncClient, prompt: list[int]) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": OSL, "stream": True, "ignore_eos": True}
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
        await Tenant("B", 99).stream(http, prefix)  # warm: B's prompt cached where it landed
        alone_b = Tenant("B", 1)
        alone = summary(alone_b, await b_loop(http, alone_b, prefix, n))
        a, flooded_b, stop = Tenant("A", 2), Tenant("B", 3), asyncio.Event()
        flood = asyncio.create_task(a_flood(http, a, stop))
        while a.tokens < A_STREAMS * OSL:  # A's flood under way (and queued) before B starts
            await asyncio.sleep(0.1)
        flooded = summary(flooded_b, await b_loop(http, flooded_b, prefix, n))
        stop.set()
        await flood
    return {"alone": alone, "flooded": flooded}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--b-requests", type=int, default=48, help="B's requests per phase")
    ap.add_argument("--settings", default="on,off", help="--router-queue settings to run")
    add_flag(ap)
    args = ap.parse_args()
    cpu = cpu_description()
    print(f"CPU: {cpu}")
    serve = ["--workers", "2", "--policy", "fair", "--tenant-header", "x-tenant-id", "--router", "kv"]
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
            f"({r['ttft_ratio']:.2f}x), {r['flooded']['tok_s']:.1f} tok/s ({r['tok_s_ratio']:.2f}x)",
            flush=True,
        )
    metrics: dict[str, float | int | str | None] = {"b_requests": args.b_requests}
    for setting, r in results.items():
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
        notes=f"2 workers x {SEQS} places, B {B_STREAMS} streams, A {A_STREAMS}; kv routing",
    )


if __name__ == "__main__":
    main()
