"""RadixKVIndex against the reference KVIndex (+ PrefixHasher) on random event streams built as workers
publish them; snapshots; orphan events. `python tests/test_radix_index.py` times both at fleet scale."""

from __future__ import annotations

import random
from array import array

import msgspec
import pytest

from tokenmill.cluster.kv_index import KVIndex
from tokenmill.cluster.prefix_hasher import PrefixHasher
from tokenmill.cluster.radix_index import RadixKVIndex, _first_token
from tokenmill.engine.block_hash import extend_block_hashes
from tokenmill.engine.kv_events import (
    MEDIUM_DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    external_hash,
    stored,
)

# Token values of every msgpack int width (1, 2, 3, 5 and 9 bytes), few enough that blocks and their
# first tokens repeat across prompts (sibling runs sharing a first token).
VALUES = [0, 1, 2, 127, 128, 255, 256, 300, 65535, 65536, 70000, 2**32 + 7]
SALTS = [None, "tenant-a"]


def chain(tokens: list[int], bs: int, salt: str | None) -> list[int]:
    """The published names of a prompt's full blocks, as a worker computes them."""
    raw: list[bytes] = []
    extend_block_hashes(raw, tokens, bs, salt)
    return [external_hash(h) for h in raw]


def engine_stored(
    tokens: list[int], names: list[int], bs: int, a: int, b: int, salt: str | None, medium: str
):
    """A BlockStored of blocks a..b-1 of a prompt, filled as kv_cache_manager does."""
    return stored(
        names[a:b],
        names[a - 1] if a else None,
        tokens[a * bs : b * bs],
        bs,
        medium,
        extra_keys=[[salt]] + [None] * (b - a - 1) if a == 0 and salt is not None else None,
    )


def check_tree(idx: RadixKVIndex) -> None:
    """The tree's invariants: every block mapped to its node, children keyed by their first token,
    no prunable leaf, no node that should have been joined with its only child."""
    live = 0
    seen = 0
    for node in idx._nodes.values():
        assert len(node.ends) == len(node.hashes) > 0 and node.ends[-1] == len(node.data)
        tokens = msgspec.msgpack.decode(
            b"\xdd" + (len(node.hashes) * idx.block_size).to_bytes(4, "big") + node.data
        )
        assert node.ends == array("I", idx._block_ends(tokens, 0))
        for h in node.hashes:
            assert idx._where[h] == node.id
        seen += len(node.hashes)
        if node.mask:
            live += len(node.hashes)
        assert node.mask or node.children, "an empty leaf was not pruned"
        kids = [c for v in node.children.values() for c in (v if isinstance(v, list) else [v])]
        for key, v in node.children.items():
            for c in v if isinstance(v, list) else [v]:
                assert _first_token(c.data) == key and c.parent is node and idx._nodes[c.id] is c
            if isinstance(v, list):
                assert len(v) > 1
        if len(kids) == 1:
            assert kids[0].mask != node.mask, "a single child of the same mask was not joined"
        if node.parent is None:
            assert idx._roots[node.hashes[0]] is node
    assert seen == len(idx._where)
    assert live == len(idx)
    assert sum(idx._firsts.values()) == len(idx._roots)


class Stream:
    """Random events of a few workers, kept in step with the reference index."""

    def __init__(self, seed: int, bs: int, workers: int = 5) -> None:
        self.rng = rng = random.Random(seed)
        self.bs, self.workers = bs, workers
        self.ref, self.idx, self.hasher = KVIndex(), RadixKVIndex(bs), PrefixHasher(bs)
        bases = [[rng.choice(VALUES) for _ in range(bs * rng.randint(1, 6))] for _ in range(4)]
        self.prompts: list[tuple[list[int], str | None]] = []
        for _ in range(24):
            p = list(rng.choice(bases))
            if rng.random() < 0.3:  # a system prompt edited midway
                p[rng.randrange(len(p))] = rng.choice(VALUES)
            p += [rng.choice(VALUES) for _ in range(bs * rng.randint(0, 5) + rng.randrange(bs))]
            self.prompts.append((p, rng.choice(SALTS)))
        self.names = [chain(p, bs, s) for p, s in self.prompts]

    def step(self) -> None:
        """One batch of 1-3 events of a worker (or a worker removed). Each store starts at a prompt's
        first block or after a block some worker holds when it arrives, as the engine's do (a worker
        names a block only while it holds its parent): no orphans."""
        rng, bs = self.rng, self.bs
        w = rng.randrange(self.workers)
        if rng.random() < 0.03:
            self.ref.remove_worker(w)
            self.idx.remove_worker(w)
            return
        sim = KVIndex()  # the reference as it will be at each event of the batch
        sim._holders, sim.blocks_per_worker = dict(self.ref._holders), dict(self.ref.blocks_per_worker)
        batch = []
        for _ in range(rng.randint(1, 3)):
            r = rng.random()
            if r < 0.6:
                k = rng.randrange(len(self.prompts))
                (tokens, salt), names = self.prompts[k], self.names[k]
                if not names:
                    continue
                starts = [a for a in range(len(names)) if a == 0 or names[a - 1] in sim._holders]
                a = rng.choice(starts)
                b = rng.randint(a + 1, len(names))
                ev = engine_stored(tokens, names, bs, a, b, salt, rng.choice([MEDIUM_DEVICE, "CPU"]))
            elif r < 0.94:
                held = [h for h, m in sim._holders.items() if m >> w & 1]
                if rng.random() < 0.5 and held:  # some of them, in any order (and some it does not hold)
                    gone = rng.sample(held, rng.randint(1, len(held)))
                    gone += rng.sample(list(sim._holders), min(2, len(sim._holders)))
                else:  # a run of a prompt's blocks, usually tail first as the engine evicts them
                    names = rng.choice(self.names)
                    a = rng.randrange(len(names) + 1)
                    gone = names[a : rng.randint(a, len(names))]
                    if rng.random() < 0.7:
                        gone.reverse()
                ev = BlockRemoved(gone, rng.choice([MEDIUM_DEVICE, "CPU"]))
            else:
                ev = AllBlocksCleared()
            sim.apply(w, [ev])
            batch.append(ev)
        self.ref.apply(w, batch)
        self.idx.apply(w, batch)

    def queries(self) -> list[tuple[list[int], str | None]]:
        rng, out = self.rng, []
        for p, salt in self.prompts:
            out.append((p, salt))
            out.append((p, SALTS[1] if salt is None else None))  # the other tenant shares nothing
            cut = rng.randrange(len(p) + 1)
            out.append((p[:cut] + [rng.choice(VALUES) for _ in range(rng.randrange(3 * self.bs))], salt))
        return out

    def check(self, idx: RadixKVIndex | None = None) -> None:
        idx = idx or self.idx
        assert idx.orphans == 0
        assert len(idx) == len(self.ref)
        assert idx.blocks_per_worker == self.ref.blocks_per_worker
        full = (1 << self.workers) - 1
        for tokens, salt in self.queries():
            for mask in (full, self.rng.randrange(1, full + 1)):
                want = self.ref.overlaps(self.hasher.hashes(tokens, salt), mask)
                assert idx.overlaps(tokens, salt, mask) == want, (tokens, salt, mask)


@pytest.mark.parametrize(("seed", "bs"), [(0, 1), (1, 2), (2, 4), (3, 4), (4, 3), (5, 16)])
def test_matches_the_reference_index(seed: int, bs: int) -> None:
    s = Stream(seed, bs)
    for i in range(250):
        s.step()
        s.check()
        if i % 10 == 0:
            check_tree(s.idx)
    check_tree(s.idx)


def test_snapshot_restore_answers_identically() -> None:
    s = Stream(7, 4)
    for _ in range(150):
        s.step()
    back = RadixKVIndex.restore(s.idx.snapshot())
    check_tree(back)
    assert back.orphans == s.idx.orphans and back.block_size == s.idx.block_size
    s.check(back)
    s.idx = back  # and it carries on as the original would
    for _ in range(60):
        s.step()
        s.check()
    empty = RadixKVIndex.restore(RadixKVIndex(8).snapshot())
    assert len(empty) == 0 and empty.overlaps([1] * 16, None, 1) == {}


def test_orphans_are_counted_and_skipped() -> None:
    bs = 4
    idx, ref = RadixKVIndex(bs), KVIndex()
    tokens = list(range(100, 120))
    names = chain(tokens, bs, None)
    lost = engine_stored(tokens, names, bs, 2, 5, None, MEDIUM_DEVICE)  # its parent never arrived
    idx.apply(0, [lost])
    assert idx.orphans == 3 and len(idx) == 0 and idx.blocks_per_worker == {}
    assert idx.node_count == 0
    # without tokens (or of another block size) a new block cannot be placed either
    idx.apply(0, [stored(names[:2], None, [], bs)])
    idx.apply(0, [stored(names[:2], None, tokens[:8], 8)])
    assert idx.orphans == 7 and len(idx) == 0
    # once the chain is there, the same event places its blocks; a known block needs no tokens
    first = engine_stored(tokens, names, bs, 0, 2, None, MEDIUM_DEVICE)
    for index in (idx, ref):
        index.apply(0, [first, lost])
        index.apply(1, [stored(names[:1], None, [], 0)])
    assert idx.orphans == 7 and len(idx) == len(ref) == 5
    assert idx.overlaps(tokens, None, 0b11) == ref.overlaps(names, 0b11) == {0: 5, 1: 1}
    # a block pruned from the index is unknown again
    for index in (idx, ref):
        index.remove_worker(0)
        index.remove_worker(1)
    idx.apply(0, [lost])
    assert idx.orphans == 10 and len(idx) == 0 and idx.node_count == 0


def test_runs_sharing_a_first_token() -> None:
    """Three conversations after one system prompt whose first tokens agree and whose blocks do not."""
    bs = 4
    idx, ref, hasher = RadixKVIndex(bs), KVIndex(), PrefixHasher(bs)
    system = [5, 6, 7, 8] * 2
    tails = [[9, 1, 1, 1, 2, 2, 2, 2], [9, 1, 1, 3], [9, 4, 4, 4, 70000, 0, 0, 0]]
    for w, tail in enumerate(tails):
        tokens = system + tail
        names = chain(tokens, bs, None)
        for index in (idx, ref):
            index.apply(w, [engine_stored(tokens, names, bs, 0, len(names), None, MEDIUM_DEVICE)])
    check_tree(idx)
    for tail in [*tails, [9, 1, 1, 1, 2], [9, 1, 1, 2], [9, 4, 4, 4, 70000, 0, 0], [10, 1, 1, 1]]:
        p = system + tail
        assert idx.overlaps(p, None, 0b111) == ref.overlaps(hasher.hashes(p, None), 0b111)
    assert idx.overlaps(system + tails[0], None, 0b111) == {0: 4, 1: 2, 2: 2}
    assert idx.overlaps(system + tails[0], None, 0b111) == {0: 4, 1: 2, 2: 2}
    with pytest.raises(ValueError):
        RadixKVIndex(0)


def test_long_prompts_and_many_runs() -> None:
    """Runs of alternating holders along a long chain, prompts longer than the part ever encoded at once."""
    bs = 16
    rng = random.Random(11)
    idx, ref, hasher = RadixKVIndex(bs), KVIndex(), PrefixHasher(bs)
    tokens = [rng.randrange(200_000) for _ in range(bs * 700)]
    names = chain(tokens, bs, None)
    for w, (a, b) in enumerate([(0, 700), (0, 300), (0, 500), (0, 650), (0, 20)]):
        ev = engine_stored(tokens, names, bs, a, b, None, MEDIUM_DEVICE)
        idx.apply(w, [ev])
        ref.apply(w, [ev])
    for index in (idx, ref):
        index.apply(0, [BlockRemoved(names[400:410], MEDIUM_DEVICE)])
    check_tree(idx)
    for n_tok in (5, bs, 100 * bs + 3, 299 * bs, 650 * bs + 1, 700 * bs, 700 * bs + 40_000):
        prompt = tokens[:n_tok] + [rng.randrange(200_000) for _ in range(max(0, n_tok - len(tokens)))]
        for extra in ([], [rng.randrange(200_000) for _ in range(30_000)]):
            for variant in (prompt, prompt[: len(prompt) // 2] + [7] + prompt[len(prompt) // 2 + 1 :]):
                p = variant + extra
                assert idx.overlaps(p, None, 0b11111) == ref.overlaps(hasher.iter_hashes(p, None), 0b11111)
    # tokens given as a tuple or an array answer the same
    assert idx.overlaps(tuple(tokens), None, 1) == idx.overlaps(array("q", tokens), None, 1) == {0: 400}
    assert idx.overlaps(tokens, None, 0) == {} and idx.overlaps(tokens, "x", 1) == {}


# -- timing by hand: python tests/test_radix_index.py ---------------------------------------------------
def _bench(
    workers: int = 64, blocks: int = 1_000_000, groups: int = 256, lookups: int = 2000, vocab: int = 50_000
) -> None:
    import gc
    import json
    import platform
    import time
    import tracemalloc

    bs = 16

    def fill(index, seed: int, timed: list[float] | None = None, convs: list | None = None) -> int:  # noqa: ANN001
        """256 system prompts of 2048 tokens, each on 4 workers; then conversations under them (2-12
        turns of 16-64 blocks, each turn one BlockStored of the worker serving it) up to `blocks`."""
        rng = random.Random(seed)
        n_blocks = 0
        systems = [rng.choices(range(vocab), k=2048) for _ in range(groups)]
        for g in systems:
            names = chain(g, bs, None)
            evs = [(w, [stored(names, None, g, bs)]) for w in rng.sample(range(workers), 4)]
            n_blocks += _apply(index, evs, timed)
        total = groups * 2048 // bs
        while total < blocks:
            g = rng.choice(systems)
            w = rng.randrange(workers)
            convo = list(g)
            raw: list[bytes] = []
            extend_block_hashes(raw, convo, bs, None)
            evs = []
            for _ in range(rng.randint(2, 12)):
                first = len(raw)
                convo += rng.choices(range(vocab), k=bs * rng.randint(16, 64))
                extend_block_hashes(raw, convo, bs, None)
                names = [external_hash(h) for h in raw[first:]]
                evs.append((w, [stored(names, external_hash(raw[first - 1]), convo[first * bs :], bs)]))
                total += len(names)
            n_blocks += _apply(index, evs, timed)
            if convs is not None:
                convs.append((w, [external_hash(h) for h in raw[len(g) // bs :]]))
        return n_blocks

    def _apply(index, evs, timed) -> int:  # noqa: ANN001
        t0 = time.perf_counter()
        for w, batch in evs:
            index.apply(w, batch)
        if timed is not None:
            timed[0] += time.perf_counter() - t0
        return sum(len(e.block_hashes) for _, b in evs for e in b)

    cpu = platform.machine()
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    out: dict = {"cpu": cpu, "workers": workers, "token_ids_below": vocab}
    for name, make in (("radix", lambda: RadixKVIndex(bs)), ("kv_index", KVIndex)):
        gc.collect()
        tracemalloc.start()
        index = make()
        fill(index, 0)
        gc.collect()
        mem = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        out[f"{name}_bytes_per_block"] = round(mem / len(index), 1)
        del index
    timed: dict[str, list[float]] = {"radix": [0.0], "kv_index": [0.0]}
    radix, ref = RadixKVIndex(bs), KVIndex()
    rng = random.Random(0)
    systems = [rng.choices(range(vocab), k=2048) for _ in range(groups)]  # as fill(seed 0) makes them
    convs: list[tuple[int, list[int]]] = []
    n = fill(radix, 0, timed["radix"], convs)
    fill(ref, 0, timed["kv_index"])
    assert len(radix) == len(ref), (len(radix), len(ref))
    out["indexed_blocks"] = len(radix)
    out["radix_nodes"] = radix.node_count
    for name in timed:
        out[f"{name}_stores_blocks_per_s"] = round(n / timed[name][0])
    hasher = PrefixHasher(bs)
    all_workers = (1 << workers) - 1
    cases = {
        "2304 tokens (2048 shared)": [
            rng.choice(systems) + rng.choices(range(vocab), k=256) for _ in range(lookups)
        ],
        "1024 tokens (512 shared, system prompt left midway)": [
            rng.choice(systems)[:512] + rng.choices(range(vocab), k=512) for _ in range(lookups)
        ],
        "2304 tokens (no known prefix)": [rng.choices(range(vocab), k=2304) for _ in range(lookups)],
    }
    # A router looks a prompt up right after decoding it (its ints are in cache): each prompt is decoded
    # afresh and only the lookup is timed. "cold": the same over prompts made beforehand (out of cache).
    encoded = {case: [msgspec.msgpack.encode(p) for p in prompts] for case, prompts in cases.items()}

    def per_call(fn, blobs: list[bytes]) -> float:  # noqa: ANN001
        spent = 0.0
        for blob in blobs:
            p = msgspec.msgpack.decode(blob)
            t0 = time.perf_counter()
            fn(p)
            spent += time.perf_counter() - t0
        return spent / len(blobs)

    def cold(fn, prompts: list[list[int]]) -> float:  # noqa: ANN001
        t0 = time.perf_counter()
        for p in prompts:
            fn(p)
        return (time.perf_counter() - t0) / len(prompts)

    calls = {
        "radix": lambda p: radix.overlaps(p, None, all_workers),
        "kv_index+hasher": lambda p: ref.overlaps(hasher.iter_hashes(p, None), all_workers),
    }
    timer_cost = min(per_call(lambda p: None, encoded[next(iter(cases))]) for _ in range(3))
    for case, prompts in cases.items():
        for p in prompts[:50]:
            assert radix.overlaps(p, None, all_workers) == ref.overlaps(hasher.hashes(p, None), all_workers)
        row = {}
        for name, fn in calls.items():
            row[f"{name}_us"] = round(
                (min(per_call(fn, encoded[case]) for _ in range(5)) - timer_cost) * 1e6, 2
            )
            row[f"{name}_cold_us"] = round(min(cold(fn, prompts) for _ in range(5)) * 1e6, 2)
        out[case] = row
    # evictions as an engine makes them: a quarter of the conversations, tail first, 8 blocks an event
    evictions = []
    for w, names in convs[: len(convs) // 4]:
        gone = names[::-1]
        evictions += [(w, [BlockRemoved(gone[i : i + 8], MEDIUM_DEVICE)]) for i in range(0, len(gone), 8)]
    n_gone = sum(len(b[0].block_hashes) for _, b in evictions)
    for name, index in (("radix", radix), ("kv_index", ref)):
        t0 = time.perf_counter()
        for w, batch in evictions:
            index.apply(w, batch)
        out[f"{name}_evictions_blocks_per_s"] = round(n_gone / (time.perf_counter() - t0))
    assert len(radix) == len(ref)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    import sys

    _bench(vocab=int(sys.argv[1]) if len(sys.argv) > 1 else 50_000)
