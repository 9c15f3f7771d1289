"""Disaggregated prefill and decode against aggregated workers, on this machine, in one run.

Part 1, KV transfer bandwidth: a child process (spawn) holds a KV cache of the model's shape in
shared memory behind a TransferServer; this process reads batches of N random blocks into its own
cache with a TransferClient, by shared memory and over ZeroMQ TCP (use_shm=False). Baselines measured
in the same run, in this process: a plain memcpy of the same bytes (contiguous tensor copy) and the
same gather/scatter the shared-memory path does (index_select + index_copy_) with no second process.
Median of --repeats reads, each of different blocks; the copied blocks are checked against the data.

Part 2, mixed workload: a real `tokenmill serve --workers 2` (two aggregated workers behind the KV-aware
router, one core each), then `tokenmill serve --workers 2 --disaggregate 1P1D` (worker 0 prefills,
worker 1 decodes and reads the prefill worker's blocks), same model and flags otherwise. Each gets the
same load, replayed from the same seed: --streams steady decode streams (short prompts, long outputs, a
new request as soon as one finishes) and, among them, long prompts (short outputs) arriving as a Poisson
process (or at a fixed interval); every prompt is its own seeded word salad, so no prefix cache makes
one free. Reported for the decode streams: per-request ITL p50/p99 ((e2e - ttft) / (osl-1)), the pooled
gaps between streamed chunks (where a prefill stalls a stream), TTFT; for the long prompts: TTFT; total
output tokens/s; goodput = decode-stream requests per second whose ITL is within --itl-limit-ms
(default: 2x the aggregated run's ITL p50), and stall-free requests/s (no chunk gap above --max-gap-ms:
a per-request mean ITL hides a stall of one prefill); ratios disaggregated / aggregated; and, from
/metrics, how many prompts the router disaggregated. Before the load, --checks long prompts sent alone
(greedy) give the unloaded TTFT and outputs to compare: disaggregated against aggregated with the
prompt's full blocks cached (the same arithmetic: a wrong block shows), and against an aggregated
one-shot prefill (bf16 near ties may flip). CPU time other processes took during each load is measured
(/proc) and flagged: on a shared machine it disturbs the figures more than anything here.

What to expect, and why: an aggregated worker that takes a long prompt runs its prefill in the same
steps as its decode streams, so those streams stall for the whole prefill (the chunk-gap tail, stall-
free share, ITL p99); with 1P1D the decode worker never prefills a long prompt, so its streams keep a
steady ITL, and a long prompt's TTFT is its prefill on a core of its own plus a block copy (but bursts
of long prompts queue on one prefill core where two aggregated workers would take one each: TTFT p99).
Disaggregation buys steadier ITL and TTFT control, not raw throughput: the prefill core idles between
long prompts and one core decodes every stream. Whether that costs tokens/s depends on whether the
decode core saturates: a decode step of a few streams of a small model costs about what one of half as
many does, and aggregated streams lose time to prefill stalls, so at --streams 4 it may not; raise
--streams (e.g. 16) or --long-interval to see the cost. The load generator runs on the same cores.

    python benchmarks/disaggregation.py [--duration 90] [--streams 4] [--long-isl 1500] [--long-interval 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import shlex
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from machine import busy_cpu_s, cpu_description, tree_cpu_s
from served import scrape, serving, workers_up

from tokenmill.bench.client import ClientConfig, OpenAIClient, discover_model
from tokenmill.bench.records import RequestRecord
from tokenmill.tokenizer.tokenizer import Tokenizer
from tokenmill.weights import catalog
from tokenmill.weights.tokenizer_source import load_tokenizer
from tokenmill.worker.kv_transfer.transfer_engine import TransferClient, TransferServer, shared_kv_tensor

_WORD_LINES = (
    "the a of and to in is that for on with as by at from it this which be are was an or not have has",
    "river city market garden engine signal letter winter harbour valley bridge station library museum",
    "village forest council school factory island mountain railway window kitchen orchard lantern ledger",
    "report budget contract meeting committee archive survey measure record schedule inventory shipment",
    "customer supplier teacher student farmer captain doctor engineer clerk painter baker merchant sailor",
    "north south eastern western old new small large quiet busy early late careful rapid narrow broad",
    "wooden iron silver golden ancient modern public private local regional annual monthly weekly daily",
    "built opened closed moved carried counted repaired painted measured signed delivered recorded planned",
    "because although after before while during since until unless however therefore meanwhile",
    "three four seven twelve twenty hundred",
)
WORDS = [w for line in _WORD_LINES for w in line.split()]


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


# ---------------------------------------------------------------------------------------------------
# Part 1: transfer bandwidth


def cache_data(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The cache's contents, the same in both processes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def serve_cache(shape: tuple[int, ...], seed: int, threads: int, conn: Connection) -> None:
    """The child: a shared-memory KV cache behind a TransferServer, until the parent says stop."""
    torch.set_num_threads(threads)
    kv, path = shared_kv_tensor(shape, torch.bfloat16)
    kv.copy_(cache_data(shape, seed))  # every page written: none is a sparse zero page
    server = TransferServer(kv, path)
    conn.send((server.endpoint, str(path) if path else None))
    conn.recv()
    server.close()


def gather_scatter(dst: torch.Tensor, src: torch.Tensor, remote: list[int], local: list[int]) -> None:
    """What TransferClient.read does with a mapped region, without the second process."""
    blocks = src.index_select(2, torch.tensor(remote)).movedim(2, 0)
    dst.index_copy_(2, torch.tensor(local), blocks.movedim(0, 2))


def bandwidth(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    shape = (args.layers, 2, args.cache_blocks, args.block_size, args.kv_heads, args.head_dim)
    block_bytes = args.layers * 2 * args.block_size * args.kv_heads * args.head_dim * 2
    print(f"\n== KV transfer bandwidth: cache {list(shape)} bf16, block {block_bytes / 1e6:.3f} MB, "
          f"{args.cache_blocks} blocks; {args.threads} torch thread(s); median of {args.repeats} "
          "reads")  # fmt: skip
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=serve_cache, args=(shape, args.seed, args.threads, child_conn), daemon=True)
    child.start()
    try:
        if not parent_conn.poll(300):
            raise RuntimeError("the transfer server process did not start")
        endpoint, shm = parent_conn.recv()
        print(f"server in pid {child.pid} at {endpoint}, shared memory: {shm or 'none (TCP only)'}")
        data = cache_data(shape, args.seed)
        local = torch.full(shape, 0.5, dtype=torch.bfloat16)
        by_shm = TransferClient(local, timeout_s=60, use_shm=True)
        by_tcp = TransferClient(local, timeout_s=60, use_shm=False)
        src_flat, dst_flat = data.view(-1).view(torch.uint8), local.view(-1).view(torch.uint8)
        rng = random.Random(args.seed)

        def memcpy(remote: list[int], local_ids: list[int]) -> None:
            n = len(remote) * block_bytes
            a = rng.randrange(0, src_flat.numel() - n + 1, 4096)
            b = rng.randrange(0, dst_flat.numel() - n + 1, 4096)
            dst_flat[b : b + n].copy_(src_flat[a : a + n])

        modes = {
            "memcpy": memcpy,
            "gather": lambda r, loc: gather_scatter(local, data, r, loc),
            "shm": lambda r, loc: by_shm.read(endpoint, r, loc),
            "tcp": lambda r, loc: by_tcp.read(endpoint, r, loc),
        }
        if shm is None:
            del modes["shm"]
        for mode in ("shm", "tcp"):  # first reads: connect, map the region
            if mode in modes:
                modes[mode]([0], [0])
        print(f"{'blocks':>6} {'MB':>7} {'memcpy GB/s':>11} {'gather GB/s':>11} {'x':>5} {'shm GB/s':>9} "
              f"{'x':>5} {'tcp GB/s':>9} {'x':>5} {'shm ms':>7} {'tcp ms':>7}  checked")  # fmt: skip
        for n in args.batch_blocks:
            n = min(n, args.cache_blocks)
            times: dict[str, list[float]] = {m: [] for m in modes}
            checked: list[str] = []
            for _ in range(args.repeats):
                for mode, fn in modes.items():
                    remote = rng.sample(range(args.cache_blocks), n)
                    local_ids = rng.sample(range(args.cache_blocks), n)
                    t = time.perf_counter()
                    fn(remote, local_ids)
                    times[mode].append(time.perf_counter() - t)
                    if mode in ("shm", "tcp") and len(times[mode]) == 1:
                        same = torch.equal(local[:, :, local_ids], data[:, :, remote])
                        checked.append(f"{mode} {'ok' if same else 'WRONG DATA'}")
            med = {m: statistics.median(ts) for m, ts in times.items()}
            gbs = {m: n * block_bytes / t / 1e9 for m, t in med.items()}
            base = gbs["memcpy"]
            nan = float("nan")
            print(f"{n:6d} {n * block_bytes / 1e6:7.2f} {base:11.2f} {gbs['gather']:11.2f} "
                  f"{gbs['gather'] / base:5.2f} {gbs.get('shm', nan):9.2f} {gbs.get('shm', nan) / base:5.2f} "
                  f"{gbs['tcp']:9.2f} {gbs['tcp'] / base:5.2f} {med.get('shm', nan) * 1e3:7.2f} "
                  f"{med['tcp'] * 1e3:7.2f}  {', '.join(checked)}", flush=True)  # fmt: skip
        print("x: GB/s / memcpy GB/s, same run. A block is strided in the cache ([layers, k/v, blocks, "
              "...]): gather and shm copy it twice (index_select, index_copy_), tcp four times and the "
              "socket")  # fmt: skip
        by_shm.close()
        by_tcp.close()
    finally:
        parent_conn.send("stop")
        child.join(timeout=30)
        if child.is_alive():
            child.kill()


# ---------------------------------------------------------------------------------------------------
# Part 2: mixed workload


def prompt(rng: random.Random, tok: Tokenizer, n: int) -> list[int]:
    """Exactly n tokens of seeded word salad: unique, so no prefix of one is cached for another."""
    ids: list[int] = []
    while len(ids) < n:
        words = []
        for _ in range(n):
            words.append(rng.choice(WORDS) if rng.random() > 0.1 else str(rng.randint(2, 2000)))
            if rng.random() < 0.08:
                words[-1] += "."
        ids += tok.encode(" ".join(words).capitalize(), add_special_tokens=False)
    return ids[:n]


@dataclass
class Result:
    name: str
    streams: list[RequestRecord] = field(default_factory=list)
    longs: list[RequestRecord] = field(default_factory=list)
    elapsed: float = 0.0
    check_texts: list[str] = field(default_factory=list)
    check_ttfts: list[float] = field(default_factory=list)
    check_again: list[str] = field(default_factory=list)  # the check prompts sent a second time
    foreign_cpu_s: float = 0.0  # CPU time of processes not ours during the load
    metrics: dict[str, float] = field(default_factory=dict)
    per_worker: dict[str, dict[str, float]] = field(default_factory=dict)

    def ok(self, kind: str) -> list[RequestRecord]:
        return [r for r in (self.streams if kind == "stream" else self.longs) if r.ok]

    def itls_ms(self) -> list[float]:
        return [v for r in self.ok("stream") if (v := r.metric_ms("itl")) is not None]

    def gaps_ms(self) -> list[float]:
        return [g * 1e3 for r in self.ok("stream") for g in r.chunk_gaps_s]

    def ttfts_ms(self, kind: str) -> list[float]:
        return [v for r in self.ok(kind) if (v := r.metric_ms("ttft")) is not None]

    def output_tok_s(self) -> float:
        return sum(r.osl or 0 for r in self.ok("stream") + self.ok("long")) / self.elapsed

    def goodput(self, limit_ms: float) -> tuple[float, float]:
        """Decode-stream requests per second within the ITL limit, and their share of all sent."""
        good = sum(1 for v in self.itls_ms() if v <= limit_ms)
        return good / self.elapsed, good / max(len(self.streams), 1)

    def stall_free(self, limit_ms: float) -> tuple[float, float]:
        """Decode-stream requests per second none of whose chunks came more than limit_ms after the one
        before, and their share of all sent."""
        good = sum(1 for r in self.ok("stream") if max(r.chunk_gaps_s, default=0.0) * 1e3 <= limit_ms)
        return good / self.elapsed, good / max(len(self.streams), 1)

    def errors(self) -> str:
        kinds: dict[str, int] = {}
        for r in self.streams + self.longs:
            if not r.ok:
                kinds[r.error or "?"] = kinds.get(r.error or "?", 0) + 1
        return ", ".join(f"{k}={v}" for k, v in sorted(kinds.items())) or "none"


async def one(client: OpenAIClient, ids: list[int], osl: int, t0: float, index: int) -> RequestRecord:
    rec = RequestRecord(index=index, t_send=0.0)
    await client.send(rec, {"prompt": ids, "temperature": 0}, osl, t0)
    return rec


async def load(base: str, args: argparse.Namespace, tok: Tokenizer, res: Result) -> None:
    """Warm-up, the check prompts alone, then the mixed workload for --duration seconds."""
    model = discover_model(f"{base}/v1")
    client = OpenAIClient(
        ClientConfig(base_url=f"{base}/v1", model=model, endpoint="completions", timeout_s=600), None
    )
    try:
        warm = random.Random(f"warm-up {args.seed}")  # unrelated to the measured prompts
        for _ in range(2):
            shorts = [prompt(warm, tok, args.stream_isl) for _ in range(2 * args.streams)]
            await asyncio.gather(*(one(client, ids, 8, 0.0, -1) for ids in shorts))
        longs = [prompt(warm, tok, args.long_isl) for _ in range(2)]
        await asyncio.gather(*(one(client, ids, 4, 0.0, -1) for ids in longs))
        # Check prompts, one at a time: a long prompt's unloaded TTFT, and greedy outputs to compare.
        for i in range(args.checks):
            ids = prompt(random.Random(f"check {args.seed} {i}"), tok, args.long_isl)
            check = await one(client, ids, args.long_osl, 0.0, -1)
            if not check.ok:
                raise RuntimeError(f"check prompt failed: {check.error} {check.error_detail}")
            res.check_texts.append(check.output_text)
            res.check_ttfts.append(check.ttft_s or float("nan"))
            # Again, now that its full blocks are cached: the last partial block is computed over them.
            res.check_again.append((await one(client, ids, args.long_osl, 0.0, -1)).output_text)
        rng = random.Random(f"long prompts {args.seed}")
        arrivals, at = [], 0.0
        while True:
            at += args.long_interval if args.arrivals == "fixed" else rng.expovariate(1 / args.long_interval)
            if at >= args.duration:
                break
            arrivals.append((at, prompt(rng, tok, args.long_isl)))
        await asyncio.sleep(1.5)  # workers report their stats once a second
        before, before_w = scrape(base)
        cpu0, ours0 = busy_cpu_s(), tree_cpu_s(os.getpid())

        t0 = time.perf_counter()
        index = iter(range(1 << 30))

        async def stream(i: int) -> None:
            rng = random.Random(f"stream {args.seed} {i}")
            await asyncio.sleep(i * 0.05)
            while time.perf_counter() - t0 < args.duration:
                ids = prompt(rng, tok, round(args.stream_isl * rng.uniform(0.75, 1.25)))
                rec = await one(client, ids, args.stream_osl, t0, next(index))
                res.streams.append(rec)
                if not rec.ok:  # no busy loop on a failing server
                    await asyncio.sleep(0.5)

        async def long_prompts() -> None:
            tasks = []
            for at, ids in arrivals:
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                tasks.append(asyncio.create_task(one(client, ids, args.long_osl, t0, next(index))))
            res.longs.extend(await asyncio.gather(*tasks))

        await asyncio.gather(long_prompts(), *(stream(i) for i in range(args.streams)))
        res.elapsed = time.perf_counter() - t0
        res.foreign_cpu_s = (busy_cpu_s() - cpu0) - (tree_cpu_s(os.getpid()) - ours0)
        await asyncio.sleep(1.5)
        after, after_w = scrape(base)
        res.metrics = {k: v - before.get(k, 0.0) for k, v in after.items()}
        res.per_worker = {
            k: {w: v - before_w.get(k, {}).get(w, 0.0) for w, v in ws.items()} for k, ws in after_w.items()
        }
    finally:
        await client.aclose()


def run_config(name: str, serve_args: list[str], args: argparse.Namespace, tok: Tokenizer,
               folder: Path) -> Result:  # fmt: skip
    res = Result(name)
    log = folder / f"{name}.log"
    t = time.perf_counter()

    def whole(base: str, _: object) -> bool:
        return workers_up(base, default=2) >= 2  # a lone engine has no router, and no such metric

    with serving(serve_args, log, whole) as (base, _):
        started = time.perf_counter() - t
        asyncio.run(load(base, args, tok, res))
    m = res.metrics
    queries = res.per_worker.get("tokenmill:prefix_cache_queries_total", {})
    foreign = res.foreign_cpu_s / (res.elapsed * (os.cpu_count() or 1))
    print(f"{name}: server ready in {started:.0f}s; {len(res.streams)} stream + {len(res.longs)} long "
          f"requests in {res.elapsed:.1f}s; errors: {res.errors()}; check prompts alone: TTFT "
          f"{statistics.median(res.check_ttfts) * 1e3:.0f} ms")  # fmt: skip
    print(f"  router: disaggregated {m.get('tokenmill:router_disaggregated_total', 0):.0f}, fallbacks "
          f"{m.get('tokenmill:router_disagg_fallbacks_total', 0):.0f}; prompt tokens looked up per worker "
          f"{ {w: round(v) for w, v in sorted(queries.items())} }; preemptions "
          f"{m.get('tokenmill:num_preemptions_total', 0):.0f}; server log {log}")  # fmt: skip
    if "tokenmill:kv_transfer_read_blocks_total" in m:
        read, served = "tokenmill:kv_transfer_read_blocks_total", "tokenmill:kv_transfer_served_blocks_total"
        print(f"  KV transfer: blocks read by shm {m.get(read + ':shm', 0):.0f}, by tcp "
              f"{m.get(read + ':tcp', 0):.0f} (served over tcp {m.get(served, 0):.0f}); read failures "
              f"{m.get('tokenmill:kv_transfer_read_failures_total', 0):.0f}")  # fmt: skip
    flag = "  <-- DISTURBED: rerun on a quiet machine" if foreign > 0.05 else ""
    print(f"  other processes used {res.foreign_cpu_s:.1f} core-s = {foreign:.0%} of the machine during the "
          f"load{flag}", flush=True)  # fmt: skip
    return res


def mixed(args: argparse.Namespace) -> None:
    common = ["--model", args.model, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    common += shlex.split(args.serve_args)
    configs = {
        "aggregated": ["--workers", "2", *common],
        "disaggregated": [
            "--workers", "2", "--disaggregate", "1P1D",
            "--disagg-min-prefill-tokens", str(args.min_prefill_tokens), *common,
        ],
    }  # fmt: skip
    print(f"\n== mixed workload, {args.duration:.0f}s per configuration: {args.streams} decode streams "
          f"(prompt ~{args.stream_isl} tokens, {args.stream_osl} out, back to back) + long prompts of "
          f"{args.long_isl} tokens ({args.long_osl} out), {args.arrivals} arrivals every "
          f"{args.long_interval:g}s on average; model {args.model} {args.dtype}, max-model-len "
          f"{args.max_model_len}")  # fmt: skip
    for name, a in configs.items():
        print(f"{name}: tokenmill serve {' '.join(a)}")
    tok = load_tokenizer(catalog.resolve(args.model), None)
    results: dict[str, Result] = {}
    with tempfile.TemporaryDirectory(prefix="disaggregation_") as tmp:
        folder = Path(args.log_dir) if args.log_dir else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name, a in configs.items():
            results[name] = run_config(name, a, args, tok, folder)

    agg, dis = results["aggregated"], results["disaggregated"]
    limit = args.itl_limit_ms or 2 * percentile(agg.itls_ms(), 0.5)
    print(f"\nstream: the decode streams; ITL per request = (e2e - ttft) / (osl - 1); gap: between streamed "
          f"chunks, pooled; long: the long prompts; goodput: stream requests/s with ITL <= {limit:.1f} ms"
          f"{'' if args.itl_limit_ms else ' (2x the aggregated ITL p50)'}; stall-free: stream requests "
          f"with no gap > {args.max_gap_ms:g} ms")  # fmt: skip
    rows = [
        ("stream ITL p50 ms", lambda r: percentile(r.itls_ms(), 0.5)),
        ("stream ITL p99 ms", lambda r: percentile(r.itls_ms(), 0.99)),
        ("stream gap p50 ms", lambda r: percentile(r.gaps_ms(), 0.5)),
        ("stream gap p99 ms", lambda r: percentile(r.gaps_ms(), 0.99)),
        ("stream gap max ms", lambda r: max(r.gaps_ms(), default=float("nan"))),
        ("stream TTFT p50 ms", lambda r: percentile(r.ttfts_ms("stream"), 0.5)),
        ("stream TTFT p99 ms", lambda r: percentile(r.ttfts_ms("stream"), 0.99)),
        ("long TTFT p50 ms", lambda r: percentile(r.ttfts_ms("long"), 0.5)),
        ("long TTFT p99 ms", lambda r: percentile(r.ttfts_ms("long"), 0.99)),
        ("output tokens/s", lambda r: r.output_tok_s()),
        ("goodput requests/s", lambda r: r.goodput(limit)[0]),
        ("goodput share of sent", lambda r: r.goodput(limit)[1]),
        ("stall-free requests/s", lambda r: r.stall_free(args.max_gap_ms)[0]),
        ("stall-free share", lambda r: r.stall_free(args.max_gap_ms)[1]),
        ("stream requests ok", lambda r: float(len(r.ok("stream")))),
        ("long requests ok", lambda r: float(len(r.ok("long")))),
    ]
    print(f"{'':22} {'aggregated':>11} {'disaggregated':>13} {'disagg/agg':>10}")
    for label, f in rows:
        print(f"{label:22} {f(agg):11.2f} {f(dis):13.2f} {ratio(f(dis), f(agg)):10.2f}")
    # Disaggregated, a prompt's full blocks come from the prefill worker and the decode worker computes the
    # partial last block over them: the arithmetic of an aggregated worker that has those blocks cached
    # (the second send), not quite that of a one-shot prefill (the first), where a near tie may flip.
    same = sum(a == b for a, b in zip(agg.check_again, dis.check_texts, strict=True))
    one_shot = sum(a == b for a, b in zip(agg.check_texts, dis.check_texts, strict=True))
    flag = "" if same == args.checks else "  <-- differs: KV transfer suspect"
    print(f"\ncheck prompts ({args.long_isl} tokens, alone, greedy, {args.long_osl} out): disaggregated "
          f"output = aggregated with the prompt's blocks cached: {same}/{args.checks}{flag}; = aggregated "
          f"one-shot prefill: {one_shot}/{args.checks} (bf16 near ties may differ)")  # fmt: skip
    for a, b in zip(agg.check_again, dis.check_texts, strict=True):
        if a != b:
            print(f"  aggregated (cached) {a!r}\n  disaggregated      {b!r}")
    n_dis = dis.metrics.get("tokenmill:router_disaggregated_total", 0)
    busy = len(dis.ok("long")) * statistics.median(dis.check_ttfts) / dis.elapsed
    print(f"disaggregated run: {n_dis:.0f} of {len(dis.longs)} long prompts prefilled on the prefill worker; "
          f"its core was busy ~{busy:.0%} of the time (long prompts x their unloaded TTFT)")  # fmt: skip
    gap50 = ratio(percentile(dis.gaps_ms(), 0.5), percentile(agg.gaps_ms(), 0.5))
    tput = ratio(dis.output_tok_s(), agg.output_tok_s())
    if tput >= 1:
        verdict = "one decode core keeps up at this load (more streams would show the cost)"
    else:
        verdict = "the idle prefill core and the one decode core cost throughput"
    nan = float("nan")
    print(f"why: aggregated workers run each long prefill in the steps of their decode streams (gap max "
          f"{max(agg.gaps_ms(), default=nan):.0f} ms against {max(dis.gaps_ms(), default=nan):.0f} ms); "
          f"the one decode worker's steps for all {args.streams} streams took {gap50:.2f}x the aggregated "
          f"workers' (gap p50), and output tokens/s is {tput:.2f}x: {verdict}.")  # fmt: skip
    summary = {
        "itl_limit_ms": round(limit, 1),
        "disaggregated_over_aggregated": {label: round(ratio(f(dis), f(agg)), 3) for label, f in rows},
        "long_disaggregated": n_dis,
        "check_outputs_identical": f"{same}/{args.checks}",
        "check_outputs_identical_to_one_shot": f"{one_shot}/{args.checks}",
    }
    print(json.dumps(summary))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="bandwidth,mixed", help="comma-separated: bandwidth, mixed")
    ap.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("bandwidth")
    g.add_argument("--layers", type=int, default=30, help="cache shape: SmolLM2-135M's by default")
    g.add_argument("--kv-heads", type=int, default=3)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--cache-blocks", type=int, default=512)
    g.add_argument("--batch-blocks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 128])
    g.add_argument("--repeats", type=int, default=9)
    g.add_argument("--threads", type=int, default=1, help="torch threads (a worker of 2 on 2 cores has 1)")
    g = ap.add_argument_group("mixed workload")
    g.add_argument("--duration", type=float, default=90.0, help="seconds of load per configuration")
    g.add_argument("--streams", type=int, default=4, help="concurrent decode streams")
    g.add_argument("--stream-isl", type=int, default=64, help="decode streams' prompt tokens (x0.75-1.25)")
    g.add_argument("--stream-osl", type=int, default=128)
    g.add_argument("--long-isl", type=int, default=1500)
    g.add_argument("--long-osl", type=int, default=16)
    g.add_argument("--long-interval", type=float, default=4.0, help="mean seconds between long prompts")
    g.add_argument("--arrivals", choices=("poisson", "fixed"), default="poisson")
    g.add_argument("--checks", type=int, default=3, help="long prompts sent alone first, outputs compared")
    g.add_argument("--itl-limit-ms", type=float, help="goodput's ITL limit (default: 2x aggregated ITL p50)")
    g.add_argument("--max-gap-ms", type=float, default=250.0, help="stall-free: no chunk gap above this")
    g.add_argument("--min-prefill-tokens", type=int, default=512, help="--disagg-min-prefill-tokens")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--serve-args", default="", help="more `tokenmill serve` flags, for both configurations")
    g.add_argument("--log-dir", help="keep the servers' logs here (default: a temporary directory)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if unknown := parts - {"bandwidth", "mixed"}:
        ap.error(f"unknown parts {sorted(unknown)}")
    if args.long_isl + args.long_osl > args.max_model_len:
        ap.error("--long-isl + --long-osl exceed --max-model-len")

    print(f"CPU: {cpu_description()}; load average {os.getloadavg()[0]:.2f}")
    if "bandwidth" in parts:
        bandwidth(args)
    if "mixed" in parts:
        mixed(args)


if __name__ == "__main__":
    main()
