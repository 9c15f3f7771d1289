"""Routing policies as plain arithmetic, and the approximate index."""

from __future__ import annotations

from collections import Counter

import pytest

from tokenmill.cluster.approx_index import ApproxKVIndex
from tokenmill.cluster.policies import Candidate, Picker, kv_cost
from tokenmill.cluster.router import _reachable


def cand(slot: int, overlap: int = 0, prefill: float = 0, decode: float = 0, in_flight: int = 0) -> Candidate:
    return Candidate(slot, overlap, prefill, decode, in_flight, 0)


def test_kv_cost_reproduces_dynamos_worked_example() -> None:
    # Dynamo's router docs: 10 prompt blocks; workers hold 2, 5, 8 of them and decode 10, 5, 9 blocks.
    cands = [cand(0, 2, decode=10), cand(1, 5, decode=5), cand(2, 8, decode=9)]
    assert [kv_cost(c, 10, 1.0) for c in cands] == [18, 10, 11]
    assert Picker("kv").pick(cands, 10).slot == 1


def test_kv_cost_counts_queued_prefill_and_never_goes_negative() -> None:
    busy = cand(0, overlap=10, prefill=30)
    idle = cand(1, overlap=0)
    assert kv_cost(busy, 10, 1.0) == 30 and kv_cost(idle, 10, 1.0) == 10
    assert kv_cost(cand(0, overlap=12), 10, 1.0) == 0
    assert Picker("kv").pick([busy, idle], 10).slot == 1


def test_ties_go_to_the_worker_with_fewer_requests() -> None:
    assert Picker("kv").pick([cand(0, in_flight=3), cand(1, in_flight=1)], 4).slot == 1


def test_temperature_samples_among_near_equal_workers() -> None:
    picker = Picker("kv", temperature=1.0, seed=1)
    cands = [cand(0, overlap=4), cand(1, overlap=3), cand(2, decode=100)]
    got = Counter(picker.pick(cands, 4).slot for _ in range(3000))
    # Costs 0, 1 and 104, normalised by their spread: weights 1, e^(-1/104), e^-1.
    expected = [1.0, 0.9904, 0.3679]
    for slot, w in enumerate(expected):
        assert abs(got[slot] / 3000 - w / sum(expected)) < 0.04, got
    assert Counter(Picker("kv").pick(cands, 4).slot for _ in range(50)) == {0: 50}


def test_round_robin_and_least_load() -> None:
    rr = Picker("round-robin")
    assert [rr.pick([cand(0), cand(1), cand(2)], 1).slot for _ in range(6)] == [1, 2, 0, 1, 2, 0]
    assert Picker("least-load").pick([cand(0, in_flight=5), cand(1, in_flight=2)], 1).slot == 1


def test_sessions_stick_and_only_a_lost_workers_sessions_move() -> None:
    p = Picker("session")
    three = [cand(0), cand(1), cand(2)]
    keys = [f"user-{i}" for i in range(300)]
    before = {k: p.pick(three, 1, k).slot for k in keys}
    assert before == {k: p.pick(three, 1, k).slot for k in keys}, "sticky"
    assert set(Counter(before.values())) == {0, 1, 2}
    after = {k: p.pick([cand(0), cand(2)], 1, k).slot for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == 1 for k in moved)


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown router policy"):
        Picker("fastest")


def test_approximate_index_forgets_after_its_ttl() -> None:
    idx = ApproxKVIndex(ttl_s=10)
    idx.record(0, [1, 2, 3], now=0.0)
    idx.record(1, [1, 2], now=5.0)
    assert idx.overlaps([1, 2, 3], 0b11) == {0: 3, 1: 2}
    idx.expire(12.0)
    assert idx.overlaps([1, 2, 3], 0b11) == {1: 2}
    idx.record(1, [1, 2], now=14.0)  # renewed: lives past its first expiry
    idx.expire(16.0)
    assert idx.overlaps([1, 2, 3], 0b11) == {1: 2}
    idx.expire(30.0)
    assert idx.overlaps([1, 2, 3], 0b11) == {} and len(idx) == 0


def test_bound_wildcard_addresses_become_the_workers_host() -> None:
    assert _reachable("tcp://0.0.0.0:5557", "tcp://10.1.2.3:7000") == "tcp://10.1.2.3:5557"
    assert _reachable("tcp://127.0.0.1:5557", "tcp://10.1.2.3:7000") == "tcp://127.0.0.1:5557"
    assert _reachable("ipc:///tmp/x/kv", "ipc:///tmp/x/engine") == "ipc:///tmp/x/kv"


def test_the_routers_hasher_names_blocks_as_the_workers_do() -> None:
    import random

    from tokenmill.cluster.prefix_hasher import PrefixHasher
    from tokenmill.engine.block_hash import extend_block_hashes
    from tokenmill.engine.kv_events import external_hash

    rng = random.Random(0)
    hasher = PrefixHasher(16, capacity=50)
    for salt in (None, "tenant-a"):
        for n in (0, 15, 16, 100, 700):
            tokens = [rng.randrange(50_000) for _ in range(n)]
            raw: list[bytes] = []
            extend_block_hashes(raw, tokens, 16, salt)
            want = [external_hash(h) for h in raw]
            assert hasher.hashes(tokens, salt) == want
            assert hasher.hashes(tokens, salt) == want, "the same from the memo"
    assert len(hasher._memo) <= 50 + 700 // 16, "the memo stays bounded"


def test_a_session_header_keys_the_session_policy_unless_the_body_names_a_user() -> None:
    from starlette.requests import Request

    from tokenmill.server.app import _session_header
    from tokenmill.server.openai_protocol import CompletionRequest

    req = Request({"type": "http", "headers": [(b"x-session-id", b"conversation-7")]})
    body = CompletionRequest(model="m", prompt="hi")
    _session_header(req, body)
    assert body.user == "conversation-7"
    named = CompletionRequest(model="m", prompt="hi", user="alice")
    _session_header(req, named)
    assert named.user == "alice"
