"""How cheap the router's choice of a worker is at fleet scale: decisions per second on one core, per
prefix shape, and the index's memory per block.

A synthetic event stream fills the index for 64 workers up to `--blocks` distinct blocks: shared system
prompts (each on 4 workers), private documents (each on one worker) and a long tail of private
conversation blocks. Then decisions are timed through the router's own path: a request arrives
(its Relay), the router picks a worker (candidates, the prefix index, the policy's cost), and the load
it puts there is kept (the request is added to the worker, and an older one there ends), as a live
router does per request. Every worker has requests in flight, so costs differ.

Shapes (what part of the prompt some worker already holds):
  shared-512    1024-token prompts whose first 512 tokens are one of 256 system prompts
  shared-2048   2304-token prompts whose first 2048 tokens are one of 256 system prompts
  document      4096-token prompts that are one of 256 private documents, each held whole by one worker
  unseen        1024-token prompts nobody holds any block of

Baselines in the same run: round-robin (no index at all), and kv over the hashed index (every prompt's
blocks named by the SHA-256 chain and looked up by name; the design before the radix tree).

    python benchmarks/router_index.py [--workers 64] [--blocks 1000000] [--decisions 20000]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description  # noqa: E402
from results_log import add_flag, record  # noqa: E402

from tokenmill.cluster.kv_index import KVIndex  # noqa: E402
from tokenmill.cluster.prefix_hasher import PrefixHasher  # noqa: E402
from tokenmill.cluster.router import RouterEngineClient, RouterSettings  # noqa: E402
from tokenmill.cluster.router.prefix_index import EventIndex  # noqa: E402
from tokenmill.cluster.router.relay import Relay  # noqa: E402
from tokenmill.cluster.router.worker import Active  # noqa: E402
from tokenmill.engine.block_hash import extend_block_hashes  # noqa: E402
from tokenmill.engine.kv_events import KVEvent, external_hash, stored  # noqa: E402
from tokenmill.engine.protocol import EngineRequest  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

BS = 16
PARAMS = SamplingParams(max_tokens=16)
SHAPES = {  # name: (prompt tokens, tokens of it some worker holds, kind)
    "shared-512": (1024, 512, "group"),
    "shared-2048": (2304, 2048, "group"),
    "document": (4096, 4096, "document"),
    "unseen": (1024, 0, "none"),
}


class Hashed:
    """The index before the radix tree, asked the router's way: each prompt's blocks named by the SHA-256
    chain (lazily) and looked up by name."""

    def __init__(self, block_size: int) -> None:
        self.index, self.hasher = KVIndex(), PrefixHasher(block_size)

    def __len__(self) -> int:
        return len(self.index)

    def apply(self, worker: int, events: list[KVEvent]) -> None:
        self.index.apply(worker, events)

    def remove_worker(self, worker: int) -> None:
        self.index.remove_worker(worker)

    def overlaps(self, tokens: list[int], salt: str | None, workers: int) -> dict[int, int]:
        return self.index.overlaps(self.hasher.iter_hashes(tokens, salt), workers)


def chain(tokens: list[int]) -> list[int]:
    raw: list[bytes] = []
    extend_block_hashes(raw, tokens, BS, None)
    return [external_hash(h) for h in raw]


def place(index: EventIndex, worker: int, tokens: list[int]) -> None:
    """A worker stores a prompt's blocks as an engine publishes them: one event per 512-token chunk."""
    hashes = chain(tokens)
    parent = None
    for k in range(0, len(hashes), 32):
        part = hashes[k : k + 32]
        index.apply(worker, [stored(part, parent, tokens[k * BS : (k + len(part)) * BS], BS)])
        parent = part[-1]


def fill(
    index: EventIndex, workers: int, blocks: int, prompts: dict[str, list[list[int]]], rng: random.Random
) -> None:
    for name, (_, held, kind) in SHAPES.items():
        for p in prompts[name]:
            if kind == "group":
                for w in rng.sample(range(workers), 4):
                    place(index, w, p[:held])
            elif kind == "document":
                place(index, rng.randrange(workers), p)
    i = 0
    while len(index) < blocks:  # private conversations: 64-block runs on one worker each
        tokens = [rng.randrange(50_000) for _ in range(64 * BS)]
        place(index, rng.randrange(workers), tokens)
        i += 1


class _AnsweringClient:
    """Stands in for a worker's connection: the decision reads only that it answers."""

    healthy = True
    dead_reason = None
    stats = None
    last_heard = float("inf")  # always just heard from


def make_router(policy: str, workers: int, index: EventIndex, rng: random.Random) -> RouterEngineClient:
    router = RouterEngineClient(
        [f"tcp://127.0.0.1:{7000 + i}" for i in range(workers)], RouterSettings(policy)
    )
    router.block_size = BS
    router.prefix.set_block_size(BS)
    router.prefix.events = index
    for w in router.workers:
        w.up, w.client = True, _AnsweringClient()  # type: ignore[assignment]
        for j in range(rng.randrange(4, 12)):  # requests in flight, some still prefilling
            w.add_active(f"{w.slot}-{j}", Active(rng.randrange(0, 8), rng.randrange(8, 64)))
            if rng.random() < 0.7:
                w.start_active(f"{w.slot}-{j}")
    return router


def run(router: RouterEngineClient, requests: list[EngineRequest]) -> float:
    """Decisions per second, with the load each puts on its worker kept (and an older request ended)."""
    recent: list[tuple[int, str]] = []
    workers = router.workers
    gc.collect()
    t0 = time.perf_counter()
    for req in requests:
        w, overlap = router.pick(Relay(router, req, None), set())  # type: ignore[arg-type]
        blocks = -(-len(req.prompt_token_ids) // BS)
        w.add_active(req.request_id, Active(blocks - overlap, blocks))
        recent.append((w.slot, req.request_id))
        if len(recent) > 256:
            slot, rid = recent.pop(0)
            workers[slot].drop_active(rid)
    return len(requests) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--decisions", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    add_flag(ap)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    print(f"{cpu_description()}; {args.workers} workers, {args.blocks:,} blocks")
    prompts = {
        name: [[rng.randrange(50_000) for _ in range(held)] for _ in range(256)]
        for name, (_, held, _) in SHAPES.items()
    }

    indexes: dict[str, EventIndex] = {}
    memory: dict[str, dict[str, float]] = {}
    for name, make in (("radix", lambda: EventIndex(BS)), ("hashed", lambda: Hashed(BS))):
        gc.collect()
        tracemalloc.start()
        index = make()
        t0 = time.perf_counter()
        fill(index, args.workers, args.blocks, prompts, random.Random(args.seed))
        fill_s = time.perf_counter() - t0
        mem, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        indexes[name] = index
        memory[name] = {
            "bytes_per_block": round(mem / len(index), 1),
            "blocks_stored_per_s": round(len(index) / fill_s),
        }
        print(f"{name} index: {len(index):,} blocks, {mem / len(index):.0f} B/block, filled in {fill_s:.1f}s")

    results: dict[str, dict[str, float]] = {}
    for shape, (length, held, _) in SHAPES.items():
        reqs = []
        for i in range(args.decisions):
            head = rng.choice(prompts[shape]) if held else []
            reqs.append(
                EngineRequest(
                    f"{shape}-{i}", head + [rng.randrange(50_000) for _ in range(length - len(head))], PARAMS
                )
            )
        row: dict[str, float] = {}
        for label, policy, index_name in (
            ("round-robin", "round-robin", "radix"),
            ("kv hashed", "kv", "hashed"),
            ("kv radix", "kv", "radix"),
        ):
            runs = []
            for r in range(args.repeats):
                router = make_router(policy, args.workers, indexes[index_name], random.Random(args.seed + r))
                runs.append(
                    run(router, reqs if label != "kv hashed" else reqs[: max(args.decisions // 5, 1000)])
                )
            row[label] = round(statistics.median(runs))
        results[shape] = row
        print(f"{shape:12s} " + "  ".join(f"{k}: {v:>8,.0f}/s" for k, v in row.items()))

    out: dict[str, float | int] = {
        "workers": args.workers,
        "indexed_blocks": len(indexes["radix"]),
        "kv_decisions_per_s_min": min(r["kv radix"] for r in results.values()),
        "kv_decisions_per_s": results["shared-512"]["kv radix"],  # the shape of the earlier runs
        "round_robin_decisions_per_s": results["shared-512"]["round-robin"],
    }
    for shape, row in results.items():
        key = shape.replace("-", "_")
        out[f"kv_decisions_per_s_{key}"] = row["kv radix"]
        out[f"kv_hashed_decisions_per_s_{key}"] = row["kv hashed"]
        out[f"round_robin_decisions_per_s_{key}"] = row["round-robin"]
    for name, m in memory.items():
        out[f"{name}_bytes_per_block"] = m["bytes_per_block"]
        out[f"{name}_blocks_stored_per_s"] = m["blocks_stored_per_s"]
    print(json.dumps(out, indent=1))
    notes = f"{args.workers} workers, {len(indexes['radix']):,} blocks; median of {args.repeats}"
    record("router_index", out, args=args, notes=notes)


if __name__ == "__main__":
    main()
