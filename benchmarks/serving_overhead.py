"""The same workload through the HTTP server and through `LLM.generate`, in one run.

32 (by default) concurrent streaming clients send completions with fixed output lengths; the offline
baseline generates the same prompts with the same parameters in one `generate` call. The report is
the server's output-token throughput as a share of the offline one (goal: at least 90%).

    python benchmarks/serving_overhead.py [--concurrency 32] [--num-requests 128] [--quantization int4]
        [--model FILE.gguf]

It also reports the CPU time each process spent per output token while the HTTP run lasted: the
server's API process, its engine process, and this load generator. On a 2-core machine whatever the
API process and the client spend is taken from the engine's two compute threads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from results_log import add_flag, record  # noqa: E402
from server_fixture import running_server  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402


def workload(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "engines",
        "serve",
        "many",
        "tokens",
    ]
    return [(" ".join(rng.choices(words, k=rng.randint(20, 200))), rng.randint(32, 128)) for _ in range(n)]


async def run_http(base: str, reqs: list[tuple[str, int]], concurrency: int) -> tuple[float, int]:
    """Stream every request, counting completion tokens from the final usage chunk.

    The load generator shares the 2 cores with the server, so it does as little as it can: raw
    HTTP/1.1 over asyncio streams, reading each response in large pieces and parsing it once at the
    end (an httpx client reading line by line cost the server several percent of throughput).
    """
    host, port = base.removeprefix("http://").split(":")
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(prompt: str, n: int) -> None:
        nonlocal tokens
        body = json.dumps(
            {
                "prompt": prompt,
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        async with sem:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(head + body)
            await writer.drain()
            chunks = []
            while piece := await reader.read(1 << 16):
                chunks.append(piece)
            writer.close()
        data = b"".join(chunks)
        i = data.rfind(b'"usage":')
        if b" 200 OK" not in data[:20] or i < 0:
            raise RuntimeError(f"bad response: {data[:200]!r}")
        tokens += json.loads(data[i + 8 : data.index(b"}", data.index(b"completion_tokens", i)) + 1] + b"}")[
            "completion_tokens"
        ]

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p, n) for p, n in reqs))
    return time.perf_counter() - t0, tokens


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-threads", type=int, default=None, help="torch threads of the engine process")
    ap.add_argument("--quantization", default=None, help="as the server's --quantization (int4, int8, fp8)")
    ap.add_argument("--model", default=None, help="as the server's --model (default: the embedded one)")
    add_flag(ap)
    args = ap.parse_args()
    reqs = workload(args.num_requests, args.seed)

    # Offline first, in this process; then the server (its own processes) with this one idle.
    model = {"model": args.model} if args.model else {}
    llm = LLM(max_num_seqs=args.concurrency, quantization=args.quantization, max_model_len=1024, **model)
    llm.generate(reqs[0][0], SamplingParams(max_tokens=4))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    offline_s = time.perf_counter() - t0
    offline_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm, outs

    extra = ["--threads", str(args.server_threads)] if args.server_threads else []
    extra += ["--quantization", args.quantization] if args.quantization else []
    extra += ["--model", args.model] if args.model else []
    with running_server("--max-num-seqs", str(args.concurrency), "--max-model-len", "1024", *extra) as srv:
        asyncio.run(run_http(srv.base_url, reqs[:4], 4))  # warm-up
        procs = {"API process": srv.pid, "engine process": max(children(srv.pid), default=srv.pid)}
        before = {name: cpu_seconds(pid) for name, pid in procs.items()}
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        http_s, http_tokens = asyncio.run(run_http(srv.base_url, reqs, args.concurrency))
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        spent = {name: cpu_seconds(pid) - before[name] for name, pid in procs.items()}
    client_cpu = (cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime) / http_s
    spent["load generator"] = client_cpu * http_s

    offline_tps, http_tps = offline_tokens / offline_s, http_tokens / http_s
    print(f"offline LLM.generate : {offline_tokens} tokens in {offline_s:.1f}s = {offline_tps:.1f} tok/s")
    print(
        f"HTTP, {args.concurrency} streams   : {http_tokens} tokens in {http_s:.1f}s = {http_tps:.1f} tok/s"
    )
    print(f"server / offline     : {http_tps / offline_tps:.3f}")
    print(f"load generator CPU   : {client_cpu:.1%} of one core (it shares the 2 cores with the server)")
    print(f"offline ms per token : {1e3 / offline_tps * args.concurrency:.2f} (per stream)")
    print(f"HTTP ms per token    : {1e3 / http_tps * args.concurrency:.2f} (per stream)")
    for name, seconds in spent.items():
        print(f"CPU ms per token     : {1e3 * seconds / http_tokens:6.2f}  {name}")
    figures = {"server_over_offline": http_tps / offline_tps, "offline_tok_s": offline_tps}
    figures["http_tok_s"] = http_tps
    record("serving_overhead", figures, args=args)


if __name__ == "__main__":
    main()
