"""How cheap the router's prefix index is at fleet scale: decisions per second and memory per block.

A synthetic event stream fills the index for 64 workers: `--groups` shared system prompts, each held
by a few workers, plus a long tail of private conversation blocks, up to `--blocks` distinct blocks.
Then routing decisions are timed on one core through the router's own `_pick` (64 workers in
rotation, each with requests in flight): hash the prompt's blocks (the same SHA-256 chain the
workers publish), look up every worker's overlap, cost each worker and pick. The baseline in the
same run is the same router deciding round-robin (no hashing, no index), so the ratio says what the
KV awareness costs.

    python benchmarks/router_index.py [--workers 64] [--blocks 1000000] [--prompt-tokens 1024]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
import tracemalloc

from tokenmill.cluster.kv_index import KVIndex
from tokenmill.cluster.router import RouterEngineClient, RouterSettings, _Active, _Relay
from tokenmill.engine.block_hash import ROOT_HASH, extend_block_hashes, hash_block
from tokenmill.engine.kv_events import external_hash, stored
from tokenmill.engine.protocol import EngineRequest
from tokenmill.sampling_params import SamplingParams

BS = 16
PARAMS = SamplingParams(max_tokens=16)


def chain(tokens: list[int]) -> list[int]:
    raw: list[bytes] = []
    extend_block_hashes(raw, tokens, BS, None)
    return [external_hash(h) for h in raw]


def fill(index: KVIndex, workers: int, blocks: int, groups: list[list[int]], rng: random.Random) -> None:
    """Each group prompt on 4 random workers; then private blocks, each on one worker, in batches."""
    for g in groups:
        hashes = chain(g)  # each group's prompt on 4 workers
        for w in rng.sample(range(workers), 4):
            index.apply(w, [stored(hashes, None, g, BS)])
    parent = ROOT_HASH
    batch: list[int] = []
    i = 0
    while len(index) < blocks:
        parent = hash_block(parent, [i] * BS)  # fast stand-in for distinct content
        batch.append(external_hash(parent))
        i += 1
        if len(batch) == 64:
            index.apply(rng.randrange(workers), [stored(batch, None, [], BS)])
            batch = []
            if i % 4096 == 0:
                parent = ROOT_HASH  # a new conversation


class _AnsweringClient:
    """Stands in for a worker's connection: the decision reads only that it answers."""

    healthy = True
    stats = None
    last_heard = float("inf")  # always just heard from


def make_router(policy: str, workers: int, index: KVIndex, rng: random.Random) -> RouterEngineClient:
    router = RouterEngineClient(
        [f"tcp://127.0.0.1:{7000 + i}" for i in range(workers)], RouterSettings(policy)
    )
    router.block_size = BS
    router.index = index
    for w in router.workers:
        w.up, w.client = True, _AnsweringClient()  # type: ignore[assignment]
        for j in range(rng.randrange(4, 12)):  # requests in flight, some still prefilling
            a = _Active(rng.randrange(0, 8), rng.randrange(8, 64))
            w.add_active(f"{w.slot}-{j}", a)
            if rng.random() < 0.7:
                w.start_active(f"{w.slot}-{j}")
    return router


def decide(router: RouterEngineClient, prompt: list[int], i: int) -> int:
    req = EngineRequest(f"r{i}", prompt, PARAMS)
    w, _ = router._pick(_Relay(router, req, None), set())  # type: ignore[arg-type]
    return w.slot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--groups", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--shared-tokens", type=int, default=512, help="the system prompt every request shares")
    ap.add_argument("--decisions", type=int, default=5_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    groups = [[rng.randrange(50_000) for _ in range(args.shared_tokens)] for _ in range(args.groups)]

    gc.collect()
    tracemalloc.start()
    index = KVIndex()
    t0 = time.perf_counter()
    fill(index, args.workers, args.blocks, groups, rng)
    fill_s = time.perf_counter() - t0
    mem, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    # Every prompt a group's system prompt (seen before) and a tail of its own (never seen:
    # its blocks are hashed afresh), so the hasher's memo helps only where a real router's would.
    prompts = [
        rng.choice(groups) + [rng.randrange(50_000) for _ in range(args.prompt_tokens - args.shared_tokens)]
        for _ in range(args.decisions)
    ]
    results = {}
    for name, policy in (("round-robin (no index)", "round-robin"), ("kv", "kv")):
        router = make_router(policy, args.workers, index, rng)
        t0 = time.perf_counter()
        for i in range(args.decisions):
            decide(router, prompts[i], i)
        dt = time.perf_counter() - t0
        results[name] = args.decisions / dt
    out = {
        "workers": args.workers,
        "indexed_blocks": len(index),
        "bytes_per_block": round(mem / len(index), 1),
        "index_mb": round(mem / 2**20, 1),
        "events_applied_per_s": round(len(index) / fill_s),
        "prompt_tokens": args.prompt_tokens,
        "shared_prefix_tokens": args.shared_tokens,
        "decisions_per_s": {k: round(v) for k, v in results.items()},
        "kv_vs_round_robin": round(results["kv"] / results["round-robin (no index)"], 3),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
