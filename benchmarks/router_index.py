"""How cheap the router's prefix index is at fleet scale: decisions per second and memory per block.

A synthetic event stream fills the index for 64 workers: `--groups` shared system prompts, each held
by a few workers, plus a long tail of private conversation blocks, up to `--blocks` distinct blocks.
Then routing decisions are timed on one core, each the whole path the router takes for a request:
hash the prompt's blocks (the same SHA-256 chain the workers publish), look up every worker's
overlap, and pick by the kv cost. The baseline in the same run is the decision without the index
(round-robin), so the ratio says what the KV awareness costs.

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
from tokenmill.cluster.policies import Candidate, Picker
from tokenmill.engine.block_hash import ROOT_HASH, extend_block_hashes, hash_block
from tokenmill.engine.kv_events import BlockStored, external_hash

BS = 16


def chain(tokens: list[int]) -> list[int]:
    raw: list[bytes] = []
    extend_block_hashes(raw, tokens, BS, None)
    return [external_hash(h) for h in raw]


def fill(index: KVIndex, workers: int, blocks: int, groups: list[list[int]], rng: random.Random) -> None:
    """Each group prompt on 4 random workers; then private blocks, each on one worker, in batches."""
    for g in groups:
        hashes = chain(g)
        for w in rng.sample(range(workers), 4):
            index.apply(w, [BlockStored(hashes, None, g, BS)])
    parent = ROOT_HASH
    batch: list[int] = []
    i = 0
    while len(index) < blocks:
        parent = hash_block(parent, [i] * BS)  # fast stand-in for distinct content
        batch.append(external_hash(parent))
        i += 1
        if len(batch) == 64:
            index.apply(rng.randrange(workers), [BlockStored(batch, None, [], BS)])
            batch = []
            if i % 4096 == 0:
                parent = ROOT_HASH  # a new conversation


def decide(index: KVIndex | None, picker: Picker, workers: int, prompt: list[int]) -> int:
    if index is None:
        cands = [Candidate(w, 0, 0, 0, 0, 0) for w in range(workers)]
        return picker.pick(cands, len(prompt) // BS).slot
    hashes = chain(prompt)
    overlaps = index.overlaps(hashes, (1 << workers) - 1)
    cands = [Candidate(w, overlaps.get(w, 0), 0, 0, 0, 0) for w in range(workers)]
    return picker.pick(cands, len(hashes)).slot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--groups", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--decisions", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    groups = [[rng.randrange(50_000) for _ in range(512)] for _ in range(args.groups)]

    gc.collect()
    tracemalloc.start()
    index = KVIndex()
    t0 = time.perf_counter()
    fill(index, args.workers, args.blocks, groups, rng)
    fill_s = time.perf_counter() - t0
    mem, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    prompts = [
        rng.choice(groups) + [rng.randrange(50_000) for _ in range(args.prompt_tokens - 512)]
        for _ in range(256)
    ]
    results = {}
    for name, idx, policy in (("round-robin (no index)", None, "round-robin"), ("kv", index, "kv")):
        picker = Picker(policy)
        t0 = time.perf_counter()
        for i in range(args.decisions):
            decide(idx, picker, args.workers, prompts[i % len(prompts)])
        dt = time.perf_counter() - t0
        results[name] = args.decisions / dt
    out = {
        "workers": args.workers,
        "indexed_blocks": len(index),
        "bytes_per_block": round(mem / len(index), 1),
        "index_mb": round(mem / 2**20, 1),
        "events_applied_per_s": round(len(index) / fill_s),
        "prompt_tokens": args.prompt_tokens,
        "decisions_per_s": {k: round(v) for k, v in results.items()},
        "kv_vs_round_robin": round(results["kv"] / results["round-robin (no index)"], 3),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
