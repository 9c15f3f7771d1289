"""Routing policies as plain arithmetic, and the approximate index."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tokenmill.cluster.approx_index import ApproxKVIndex
from tokenmill.cluster.policies import POLICIES, Candidates, make_policy
from tokenmill.cluster.policies.base import DEFAULT_PREFILL_WEIGHT
from tokenmill.cluster.policies.kv import kv_costs
from tokenmill.cluster.router import reachable
from tokenmill.cluster.router.worker import Active, Worker
from tokenmill.engine.protocol import EngineRequest
from tokenmill.sampling_params import SamplingParams


def worker(slot: int, prefill: int = 0, decode: int = 0, in_flight: int = 0) -> Worker:
    w = Worker(slot, f"tcp://w{slot}:1")
    w.prefill_blocks, w.decode_blocks = prefill, decode
    for i in range(in_flight):
        w.active[f"x{i}"] = Active(0, 0)
    return w


def choose(policy: str, workers: list[Worker], overlaps: dict[int, int], blocks: int, key: str | None = None,
           **kw: float) -> int:  # fmt: skip
    req = EngineRequest("r", [1] * blocks * 16, SamplingParams(), routing_key=key)
    for w in workers:  # as the router does when a worker joins: its base cost in the policy's weight
        w.weigh(kw.get("prefill_weight", DEFAULT_PREFILL_WEIGHT))
    return make_policy(policy, **kw).choose(Candidates(workers), overlaps, blocks, req).slot


def test_kv_cost_reproduces_dynamos_worked_example() -> None:
    # Dynamo's router docs: 10 prompt blocks; workers hold 2, 5, 8 of them and decode 10, 5, 9 blocks.
    assert kv_costs([(2, 0, 10), (5, 0, 5), (8, 0, 9)], 10, 1.0) == [18, 10, 11]
    ws = [worker(0, decode=10), worker(1, decode=5), worker(2, decode=9)]
    assert choose("kv", ws, {0: 2, 1: 5, 2: 8}, 10, prefill_weight=1.0) == 1


def test_kv_cost_counts_queued_prefill_and_never_goes_negative() -> None:
    assert kv_costs([(10, 30, 0), (0, 0, 0), (12, 0, 0)], 10, 1.0) == [30, 10, 0]
    assert choose("kv", [worker(0, prefill=30), worker(1)], {0: 10}, 10, prefill_weight=1.0) == 1


def test_ties_go_to_the_worker_with_fewer_requests() -> None:
    assert choose("kv", [worker(0, in_flight=3), worker(1, in_flight=1)], {}, 4) == 1
    # a holder and a non-holder at the same cost tie too
    assert (
        choose(
            "kv", [worker(0, decode=4, in_flight=2), worker(1, in_flight=0)], {0: 4}, 4, prefill_weight=1.0
        )
        == 1
    )


def test_the_fast_kv_choice_is_the_lowest_of_every_cost() -> None:
    """The kv policy costs only the workers holding part of the prompt one by one; it must choose as
    costing every worker (kv_costs, the reference) does, ties included."""
    rng = random.Random(3)
    for trial in range(3000):
        n = rng.randrange(1, 12)
        ws = [worker(i, rng.randrange(0, 6), rng.randrange(0, 6), rng.randrange(0, 3)) for i in range(n)]
        blocks = rng.randrange(0, 8)
        overlaps = {i: rng.randrange(1, blocks + 2) for i in rng.sample(range(n), rng.randrange(0, n + 1))}
        pw = rng.choice([1.0, 0.5, 2.0, 0.1, 0.3, 0.0])
        costs = kv_costs(
            [(overlaps.get(w.slot, 0), w.prefill_blocks, w.decode_blocks) for w in ws], blocks, pw
        )
        best = min(costs)
        tied = [w for w, c in zip(ws, costs, strict=True) if c == best]
        fewest = min(len(w.active) for w in tied)
        allowed = {w.slot for w in tied if len(w.active) == fewest}
        for w in ws:
            w.weigh(pw)
        assert choose("kv", ws, overlaps, blocks, prefill_weight=pw, seed=trial) in allowed, (trial, costs)


def test_the_kept_bases_follow_each_workers_load() -> None:
    ws = [worker(0), worker(1)]
    for w in ws:
        w.weigh(1.0)
    cands = Candidates(ws, seated=True)
    ws[0].add_active("a", Active(5, 8))
    ws[1].add_active("b", Active(2, 3))
    ws[1].start_active("b")
    assert cands.bases == [5.0, 3.0]
    ws[0].drop_active("a")
    ws[1].weigh(2.0)
    assert cands.bases == [0.0, 3.0]
    cands.unseat()
    ws[0].add_active("c", Active(7, 7))
    assert cands.bases == [0.0, 3.0] and not ws[0].seats


def test_temperature_samples_among_near_equal_workers() -> None:
    policy = make_policy("kv", temperature=1.0, seed=1)
    ws = [worker(0), worker(1), worker(2, decode=100)]
    overlaps = {0: 4, 1: 3}
    req = EngineRequest("r", [1] * 64, SamplingParams())
    got = Counter(policy.choose(Candidates(ws), overlaps, 4, req).slot for _ in range(3000))
    # Costs 0, 1 and 104, normalised by their spread: weights 1, e^(-1/104), e^-1.
    expected = [1.0, 0.9904, 0.3679]
    for slot, w in enumerate(expected):
        assert abs(got[slot] / 3000 - w / sum(expected)) < 0.04, got
    assert Counter(choose("kv", ws, overlaps, 4) for _ in range(50)) == {0: 50}


def test_round_robin_and_least_load() -> None:
    rr = make_policy("round-robin")
    ws = Candidates([worker(0), worker(1), worker(2)])
    assert [rr.choose(ws, {}, 1, None).slot for _ in range(6)] == [1, 2, 0, 1, 2, 0]
    assert choose("least-load", [worker(0, in_flight=5), worker(1, in_flight=2)], {}, 1) == 1


def test_sessions_stick_and_only_a_lost_workers_sessions_move() -> None:
    three = [worker(0), worker(1), worker(2)]
    keys = [f"user-{i}" for i in range(300)]
    before = {k: choose("session", three, {}, 1, k) for k in keys}
    assert before == {k: choose("session", three, {}, 1, k) for k in keys}, "sticky"
    assert set(Counter(before.values())) == {0, 1, 2}
    after = {k: choose("session", [three[0], three[2]], {}, 1, k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == 1 for k in moved)


def test_every_policy_is_registered_by_its_name() -> None:
    assert set(POLICIES) == {"kv", "kv-approx", "round-robin", "random", "least-load", "session"}
    for name in POLICIES:
        assert make_policy(name).name == name


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown router policy"):
        make_policy("fastest")


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
    assert reachable("tcp://0.0.0.0:5557", "tcp://10.1.2.3:7000") == "tcp://10.1.2.3:5557"
    assert reachable("tcp://127.0.0.1:5557", "tcp://10.1.2.3:7000") == "tcp://127.0.0.1:5557"
    assert reachable("ipc:///tmp/x/kv", "ipc:///tmp/x/engine") == "ipc:///tmp/x/kv"


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
