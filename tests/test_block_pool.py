"""Unit tests of the KV block hash chain, the block pool and the KV cache manager (no model).

Block size 4 throughout unless stated; block ids are those of a fresh pool (0, 1, 2, ...).
"""

from __future__ import annotations

import pytest

from tokenmill.engine.block_hash import ROOT_HASH, extend_block_hashes, hash_block
from tokenmill.engine.block_pool import BlockPool
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import EngineRequest, Request
from tokenmill.sampling_params import SamplingParams

BS = 4
MAX_MODEL_LEN = 256


def make_request(rid: str, prompt: list[int], salt: str | None = None) -> Request:
    return Request(EngineRequest(rid, list(prompt), SamplingParams(), cache_salt=salt), MAX_MODEL_LEN)


def run_prefill(kv: KVCacheManager, req: Request, n: int | None = None) -> None:
    """Allocate the request's next n tokens (default: all of them) and pretend the step ran."""
    n = req.num_tokens - req.num_computed_tokens if n is None else n
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n


# ---------------------------------------------------------------------------------------------
# block_hash
# ---------------------------------------------------------------------------------------------


def test_hash_is_deterministic_for_same_parent_and_tokens():
    h1 = hash_block(ROOT_HASH, [1, 2, 3, 4])
    h2 = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert h1 == h2
    assert isinstance(h1, bytes) and len(h1) == 16


def test_hash_depends_on_tokens_parent_and_salt():
    base = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert hash_block(ROOT_HASH, [1, 2, 3, 5]) != base  # other tokens
    assert hash_block(ROOT_HASH, [4, 3, 2, 1]) != base  # same tokens, other order
    assert hash_block(base, [1, 2, 3, 4]) != base  # other parent
    assert hash_block(ROOT_HASH, [1, 2, 3, 4], "alice") != base  # salt
    assert hash_block(ROOT_HASH, [1, 2, 3, 4], "alice") != hash_block(ROOT_HASH, [1, 2, 3, 4], "bob")
    assert hash_block(ROOT_HASH, [1, 2, 3, 4], "alice") == hash_block(ROOT_HASH, [1, 2, 3, 4], "alice")


def test_chain_matches_manual_computation_and_salt_only_enters_first_block():
    tokens = list(range(10, 22))  # 12 tokens = 3 full blocks
    salted: list[bytes] = []
    extend_block_hashes(salted, tokens, BS, "alice")
    h0 = hash_block(ROOT_HASH, tokens[0:4], "alice")
    h1 = hash_block(h0, tokens[4:8])  # no salt after the first block
    h2 = hash_block(h1, tokens[8:12])
    assert salted == [h0, h1, h2]

    plain: list[bytes] = []
    extend_block_hashes(plain, tokens, BS, None)
    p0 = hash_block(ROOT_HASH, tokens[0:4])
    assert plain == [p0, hash_block(p0, tokens[4:8]), hash_block(hash_block(p0, tokens[4:8]), tokens[8:12])]
    # The salt, through the chain, separates every block, not just the first.
    assert all(s != p for s, p in zip(salted, plain, strict=True))


def test_same_block_under_different_prefix_gets_different_hash():
    a, b = [], []
    extend_block_hashes(a, [1, 1, 1, 1, 9, 9, 9, 9], BS, None)
    extend_block_hashes(b, [2, 2, 2, 2, 9, 9, 9, 9], BS, None)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens 9 9 9 9, different parents


def test_extend_only_hashes_full_blocks():
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(11)), BS, None)  # 11 tokens: 2 full blocks, 3 left over
    assert len(hashes) == 2
    hashes = []
    extend_block_hashes(hashes, list(range(11)), BS, None, upto=7)  # 7 tokens: 1 full block
    assert len(hashes) == 1
    hashes = []
    extend_block_hashes(hashes, list(range(11)), BS, None, upto=100)  # upto is capped at len(tokens)
    assert len(hashes) == 2
    hashes = []
    extend_block_hashes(hashes, [1, 2, 3], BS, "s")
    assert hashes == []


def test_extend_is_incremental():
    tokens = list(range(8))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, BS, None)
    first = list(hashes)
    tokens += [8, 9, 10, 11, 12]  # 13 tokens: one more full block
    extend_block_hashes(hashes, tokens, BS, None)
    assert hashes[:2] == first
    assert hashes[2] == hash_block(first[1], [8, 9, 10, 11])
    # The existing hashes are not recomputed: a fake last hash becomes the parent of the next block.
    fake = b"x" * 16
    hashes = [fake]
    extend_block_hashes(hashes, tokens, BS, "salt-not-used-after-block-0")
    h1 = hash_block(fake, [4, 5, 6, 7])
    assert hashes == [fake, h1, hash_block(h1, [8, 9, 10, 11])]


# ---------------------------------------------------------------------------------------------
# BlockPool
# ---------------------------------------------------------------------------------------------


def test_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_and_free_ref_counts():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    assert [b.block_id for b in blocks] == [0, 1]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert pool.num_free == 2
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    assert pool.num_free == 2  # a failed allocation takes nothing

    pool.touch([blocks[0]])  # a second user
    assert blocks[0].ref_cnt == 2 and pool.num_free == 2
    pool.free([blocks[0]])
    assert blocks[0].ref_cnt == 1 and pool.num_free == 2  # still held once
    pool.free(blocks)
    assert [b.ref_cnt for b in blocks] == [0, 0]
    assert pool.num_free == 4


def test_double_free_raises():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])


def test_touch_of_cached_free_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.cache(b, b"h" * 16)
    pool.free([b])
    assert pool.num_free == 4 and pool.lookup(b"h" * 16) is b  # free but still cached
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.num_free == 3
    others = pool.allocate(3)
    assert b not in others
    assert pool.num_evictions == 0 and pool.lookup(b"h" * 16) is b


def test_eviction_is_lru_among_cached_free_blocks():
    pool = BlockPool(4)
    a, b = pool.allocate(2)  # blocks 0, 1; free queue [2, 3]
    pool.cache(a, b"A" * 16)
    pool.cache(b, b"B" * 16)
    pool.free([a])  # free queue [2, 3, 0]
    pool.free([b])  # free queue [2, 3, 0, 1]
    assert [x.block_id for x in pool.allocate(2)] == [2, 3]  # never-cached blocks first: no eviction
    assert pool.num_evictions == 0 and pool.num_cached == 2
    (x,) = pool.allocate(1)
    assert x is a and x.block_hash is None  # A, freed first, is evicted first
    assert pool.lookup(b"A" * 16) is None and pool.lookup(b"B" * 16) is b
    assert pool.num_evictions == 1
    (y,) = pool.allocate(1)
    assert y is b and pool.lookup(b"B" * 16) is None and pool.num_evictions == 2
    assert pool.num_cached == 0


def test_touch_refreshes_lru_position():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, b"A" * 16)
    pool.cache(b, b"B" * 16)
    pool.free([a, b])  # free queue [0, 1]: A is the LRU
    pool.touch([a])  # A reused...
    pool.free([a])  # ...and freed again: free queue [1, 0]
    (x,) = pool.allocate(1)
    assert x is b
    assert pool.lookup(b"A" * 16) is a


def test_uncached_free_blocks_are_handed_out_before_cached_ones():
    pool = BlockPool(4)
    a, b = pool.allocate(2)  # free queue [2, 3]
    pool.cache(a, b"A" * 16)
    pool.free([a])  # cached: goes to the tail -> [2, 3, 0]
    pool.free([b])  # no content: goes to the head -> [1, 2, 3, 0]
    assert [x.block_id for x in pool.allocate(3)] == [1, 2, 3]
    assert pool.lookup(b"A" * 16) is a and pool.num_evictions == 0


def test_cache_keeps_the_first_block_for_a_hash():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, b"H" * 16)
    pool.cache(b, b"H" * 16)  # identical content already indexed
    assert pool.lookup(b"H" * 16) is a and b.block_hash is None
    pool.cache(a, b"G" * 16)  # already named: no rename
    assert a.block_hash == b"H" * 16 and pool.lookup(b"G" * 16) is None
    pool.uncache(a)
    assert a.block_hash is None and pool.lookup(b"H" * 16) is None and pool.num_cached == 0


def test_reset_prefix_cache_forgets_only_free_blocks():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, b"A" * 16)
    pool.cache(b, b"B" * 16)
    pool.free([a])
    pool.reset_prefix_cache()
    assert pool.lookup(b"A" * 16) is None and a.block_hash is None
    assert pool.lookup(b"B" * 16) is b  # still held by a request
    assert pool.num_cached == 1 and pool.num_free == 2


def test_pool_usage():
    pool = BlockPool(4)
    assert pool.usage() == 0.0
    (a,) = pool.allocate(1)
    assert pool.usage() == 0.25
    pool.cache(a, b"A" * 16)
    pool.free([a])
    assert pool.usage() == 0.0  # cached free blocks count as free


# ---------------------------------------------------------------------------------------------
# KVCacheManager
# ---------------------------------------------------------------------------------------------


def test_blocks_needed_and_block_ids():
    kv = KVCacheManager(8, BS)
    assert [kv.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    req = make_request("a", list(range(9)))
    run_prefill(kv, req)  # 9 tokens: 3 blocks
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.block_ids("unknown") == []


def test_prefix_hit_on_shared_prefix():
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(12)))  # 3 full blocks
    run_prefill(kv, a)
    a_blocks = kv.req_blocks["a"]
    # b shares the first 8 tokens (2 blocks) then differs: 13 tokens, may hit up to (13-1)//4 = 3 blocks.
    b = make_request("b", list(range(8)) + [100, 101, 102, 103, 104])
    hits, n = kv.get_computed_blocks(b)
    assert hits == a_blocks[:2] and n == 8


def test_prefix_hit_leaves_at_least_one_token_to_compute():
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(12)))
    run_prefill(kv, a)
    # Exactly 3 full cached blocks: max_blocks = (12-1)//4 = 2, so only 8 tokens hit.
    hits, n = kv.get_computed_blocks(make_request("c", list(range(12))))
    assert len(hits) == 2 and n == 8
    # One token more: max_blocks = (13-1)//4 = 3, the whole cached prefix hits.
    hits, n = kv.get_computed_blocks(make_request("d", list(range(12)) + [99]))
    assert hits == kv.req_blocks["a"] and n == 12
    # Shorter than a block: nothing to hit.
    assert kv.get_computed_blocks(make_request("e", [0, 1, 2])) == ([], 0)


def test_prefix_hit_stops_at_first_miss():
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(12)))
    run_prefill(kv, a)
    # Block 1 differs, block 2 equals a's tokens but its parent differs: only block 0 hits.
    b = make_request("b", [0, 1, 2, 3, 50, 51, 52, 53, 8, 9, 10, 11, 12])
    hits, n = kv.get_computed_blocks(b)
    assert hits == kv.req_blocks["a"][:1] and n == 4


def test_salt_isolates_tenants():
    kv = KVCacheManager(16, BS)
    prompt = list(range(9))  # 2 full blocks; max_blocks = 8//4 = 2
    run_prefill(kv, make_request("a", prompt, salt="alice"))
    assert kv.get_computed_blocks(make_request("b", prompt, salt="bob")) == ([], 0)
    assert kv.get_computed_blocks(make_request("c", prompt)) == ([], 0)  # no salt
    hits, n = kv.get_computed_blocks(make_request("d", prompt, salt="alice"))
    assert hits == kv.req_blocks["a"][:2] and n == 8


def test_no_hits_when_prefix_caching_disabled():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    run_prefill(kv, a)
    assert kv.pool.num_cached == 0  # nothing is named either
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_early_reuse_within_the_same_step():
    kv = KVCacheManager(8, BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = make_request("a", prompt)
    assert kv.allocate_slots(a, 10)  # scheduled, not run yet: num_computed_tokens is still 0
    assert a.num_computed_tokens == 0
    a_blocks = kv.req_blocks["a"]
    assert [b.block_hash is not None for b in a_blocks] == [True, True, False]  # full blocks named at once
    b = make_request("b", prompt)
    hits, n = kv.get_computed_blocks(b)  # max_blocks = 9//4 = 2
    assert hits == a_blocks[:2] and n == 8
    assert kv.allocate_slots(b, 10 - 8, hits)
    assert kv.req_blocks["b"][:2] == a_blocks[:2]
    assert [blk.ref_cnt for blk in a_blocks] == [2, 2, 1]
    assert kv.block_ids("b") == [0, 1, 3]  # b's own third block
    assert kv.pool.num_free == 8 - 4


def test_chunk_names_only_the_blocks_full_at_its_end():
    kv = KVCacheManager(8, BS)
    prompt = list(range(10))
    a = make_request("a", prompt)
    assert kv.allocate_slots(a, 6)  # first chunk: tokens 0..5, block 0 full, block 1 half
    assert [b.block_hash is not None for b in kv.req_blocks["a"]] == [True, False]
    hits, n = kv.get_computed_blocks(make_request("b", prompt))
    assert hits == kv.req_blocks["a"][:1] and n == 4


def test_allocation_counts_reused_free_blocks():
    kv = KVCacheManager(3, BS)
    a = make_request("a", list(range(9)))  # 3 blocks, the first 2 named
    run_prefill(kv, a)
    kv.free(a)
    assert kv.pool.num_free == 3 and kv.pool.num_cached == 2
    other = make_request("o", [70, 71])
    run_prefill(kv, other)  # takes the uncached block: free 2, both cached
    b = make_request("b", list(range(8)) + [50])  # hits a's 2 blocks, needs 1 more
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    # needs blocks_needed(9) - 2 = 1 new + 2 reused blocks that stop being free = 3 > 2 free.
    assert not kv.can_allocate(b, 1, hits)
    assert not kv.allocate_slots(b, 1, hits)
    assert "b" not in kv.req_blocks and [h.ref_cnt for h in hits] == [0, 0]  # no change
    kv.free(other)
    assert kv.can_allocate(b, 1, hits)
    assert kv.allocate_slots(b, 1, hits)
    assert kv.req_blocks["b"][:2] == hits and kv.pool.num_free == 0


def test_free_releases_tail_first():
    kv = KVCacheManager(3, BS)
    a = make_request("a", list(range(12)))  # 3 full blocks, all named
    run_prefill(kv, a)
    h = list(a.block_hashes)
    kv.free(a)  # free queue: [a2, a1, a0]
    assert kv.pool.num_free == 3
    (x,) = kv.pool.allocate(1)
    assert x.block_id == 2  # the tail block is evicted first
    assert kv.pool.lookup(h[2]) is None
    assert kv.pool.lookup(h[0]) is not None and kv.pool.lookup(h[1]) is not None
    hits, n = kv.get_computed_blocks(make_request("b", list(range(12)) + [7]))
    assert [b.block_id for b in hits] == [0, 1] and n == 8


def test_free_uncaches_blocks_whose_step_never_ran():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8)  # both blocks named at scheduling time
    assert kv.pool.num_cached == 2
    kv.free(a)  # preempted before the step ran: num_computed_tokens == 0
    assert kv.pool.num_cached == 0
    assert kv.get_computed_blocks(make_request("b", list(range(8)) + [9])) == ([], 0)
    # Un-named blocks go to the head of the free queue: the next allocations take them first.
    assert [b.block_id for b in kv.pool.allocate(2)] == [0, 1]


def test_free_keeps_the_computed_part_and_uncaches_the_rest():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(8)))
    run_prefill(kv, a, 4)  # first chunk ran: block 0 computed
    assert kv.allocate_slots(a, 4)  # second chunk scheduled: block 1 named
    h0, h1 = a.block_hashes
    assert kv.pool.lookup(h1) is not None
    kv.free(a)  # preempted with num_computed_tokens == 4
    assert kv.pool.lookup(h0) is not None
    assert kv.pool.lookup(h1) is None
    hits, n = kv.get_computed_blocks(make_request("b", list(range(8)) + [9]))
    assert len(hits) == 1 and n == 4


def test_free_does_not_uncache_blocks_shared_with_their_writer():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(9)))
    run_prefill(kv, a)  # a computed its 2 full blocks
    b = make_request("b", list(range(9)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and kv.allocate_slots(b, 1, hits)
    kv.free(b)  # b's own num_computed_tokens is 0, but the shared blocks were written by a
    assert [blk.ref_cnt for blk in hits] == [1, 1]
    assert kv.pool.num_cached == 2
    assert kv.get_computed_blocks(make_request("c", list(range(9))))[1] == 8


def test_manager_usage():
    kv = KVCacheManager(8, BS)
    assert kv.usage == 0.0
    a = make_request("a", list(range(10)))  # 3 blocks
    run_prefill(kv, a)
    assert kv.usage == 3 / 8
    kv.free(a)
    assert kv.usage == 0.0


def test_blocks_behind_a_sliding_window_go_back_to_the_pool():
    """A model whose every layer sees the last 6 positions: a request's blocks wholly behind its window
    return to the pool as it moves on, stay named for others' prefix hits, and are freed once."""
    kv = KVCacheManager(16, BS, window=6)
    req = make_request("a", list(range(30)))
    run_prefill(kv, req, 10)  # positions 0-9, the first query at 0: nothing behind it
    assert kv.released.get("a", 0) == 0 and kv.pool.num_free == 13
    run_prefill(kv, req, 10)  # this step's first query (10) sees 5 on: block 0 (0-3) is behind
    assert kv.released["a"] == 1 and kv.pool.num_free == 16 - 5 + 1
    run_prefill(kv, req, 10)  # first query 20 sees 15 on: blocks 1 and 2 (4-11) too
    assert kv.released["a"] == 3 and kv.pool.num_free == 16 - 8 + 3
    assert len(kv.block_ids("a")) == 8  # the table keeps its length: positions and blocks still line up
    hits, n = kv.get_computed_blocks(make_request("b", list(range(12)) + [99]))
    assert n == 12 and hits == kv.req_blocks["a"][:3]  # released blocks are still found by their prefix
    kv.free(req)
    assert kv.pool.num_free == 16 and "a" not in kv.released


def test_no_block_is_released_without_a_window():
    kv = KVCacheManager(16, BS)
    req = make_request("a", list(range(30)))
    for _ in range(3):
        run_prefill(kv, req, 10)
    assert not kv.released and kv.pool.num_free == 8
