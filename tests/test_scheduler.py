"""Unit tests of the token-budget scheduler, driven by hand (no model).

Each test builds requests, a KV cache manager and a scheduler, calls `schedule()` (a plain-data
SchedulerOutput), and stands in for the workers by calling `update()` with one sampled token for every
request whose step completes its known tokens. Block size 4 unless stated.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import EngineRequest, FinishReason, Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerOutput
from tokenmill.sampling_params import SamplingParams

BS = 4
MAX_MODEL_LEN = 512
TOKEN = 7  # what the fake model samples unless told otherwise (never an EOS or stop token here)

_prompt_base = itertools.count(1)


def prompt_of(n: int) -> list[int]:
    """n token ids that no other prompt of the module shares (no accidental prefix hits)."""
    base = next(_prompt_base) * 10_000
    return list(range(base, base + n))


def make_req(
    rid: str,
    n_prompt: int = 4,
    *,
    prompt: list[int] | None = None,
    max_tokens: int | None = 16,
    min_tokens: int = 0,
    eos: tuple[int, ...] = (),
    stop_token_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
    priority: int = 0,
    arrival: float = 0.0,
    salt: str | None = None,
    max_model_len: int = MAX_MODEL_LEN,
) -> Request:
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
    )
    er = EngineRequest(
        rid,
        prompt if prompt is not None else prompt_of(n_prompt),
        params,
        eos_token_ids=frozenset(eos),
        arrival_time=arrival,
        priority=priority,
        cache_salt=salt,
    )
    return Request(er, max_model_len)


def make_sched(
    num_blocks: int = 64,
    *,
    block_size: int = BS,
    budget: int = 64,
    max_num_seqs: int = 16,
    policy: str = "fcfs",
    threshold: int | None = None,
    prefix_caching: bool = True,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        policy=policy,
        long_prefill_token_threshold=threshold,
    )
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(cfg, kv, MAX_MODEL_LEN)


@dataclass
class Sched:
    """One scheduled request as the tests look at it (read from the plain output and the scheduler)."""

    request: Request
    start: int
    num_new_tokens: int
    samples: bool  # the step completes the request's known tokens, so it yields a new token


def scheduled_of(sched: Scheduler, out: SchedulerOutput) -> list[Sched]:
    """Valid between `schedule()` and `update()` (whether a request samples depends on its token count)."""
    starts = out.num_computed_before()
    got = []
    for rid, n in out.num_scheduled_tokens.items():
        req = sched.requests[rid]
        got.append(Sched(req, starts[rid], n, starts[rid] + n == req.num_tokens))
    return got


@dataclass
class Stepped:
    """A step's output with what was scheduled captured before `update`."""

    out: SchedulerOutput
    scheduled: list[Sched]
    preempted: list[Request]

    @property
    def plan(self) -> list[tuple[str, int, int, bool]]:
        return [(s.request.request_id, s.start, s.num_new_tokens, s.samples) for s in self.scheduled]

    @property
    def num_batched_tokens(self) -> int:
        return self.out.num_batched_tokens


def look(sched: Scheduler, out: SchedulerOutput, preempted: list[Request]) -> Stepped:
    return Stepped(out, scheduled_of(sched, out), preempted)


def schedule(sched: Scheduler) -> Stepped:
    """`schedule()` with the preempted requests named (the output carries only their ids)."""
    before = {**sched.requests}
    out = sched.schedule()
    return look(sched, out, [before[r] for r in out.preempted_req_ids])


def step(sched: Scheduler, token: int | dict[str, int] = TOKEN) -> Stepped:
    """One scheduling step plus the fake forward pass."""
    done = schedule(sched)
    finish(sched, done, token)
    return done


def finish(sched: Scheduler, done: Stepped, token: int | dict[str, int] = TOKEN) -> None:
    """The fake forward pass: a token for each request that samples."""
    sampled = {}
    for s in done.scheduled:
        if s.samples:
            rid = s.request.request_id
            sampled[rid] = [token if isinstance(token, int) else token.get(rid, TOKEN)]
    sched.update(done.out, sampled)


def plan(out: Stepped) -> list[tuple[str, int, int, bool]]:
    """(request id, start, num_new_tokens, samples) for each scheduled request, in order."""
    return out.plan


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


# ---------------------------------------------------------------------------------------------
# The token budget, chunked prefill, in-flight batching
# ---------------------------------------------------------------------------------------------


def test_token_budget_respected_every_step():
    sched = make_sched(256, budget=16, max_num_seqs=8)
    for i, (n, m) in enumerate([(5, 3), (30, 2), (3, 6), (17, 1), (9, 4), (40, 2), (1, 5)]):
        sched.add_request(make_req(f"r{i}", n, max_tokens=m))
    first = step(sched)
    # r0 takes its 5 tokens, r1 the 11 left of the budget (a chunk), the others wait.
    assert plan(first) == [("r0", 0, 5, True), ("r1", 0, 11, False)]
    for _ in range(100):
        if not sched.has_unfinished():
            break
        out = step(sched)
        assert 0 < out.num_batched_tokens <= 16
        assert len(out.scheduled) <= 8
    assert not sched.has_unfinished()
    assert sched.kv.pool.num_free == 256


def test_running_requests_are_served_before_waiting_ones():
    sched = make_sched(budget=6)
    sched.add_request(make_req("a", 4))
    sched.add_request(make_req("b", 10))
    assert plan(step(sched)) == [("a", 0, 4, True), ("b", 0, 2, False)]  # 4 + 2 = 6
    assert plan(step(sched)) == [("a", 4, 1, True), ("b", 2, 5, False)]  # decode 1 + chunk 5
    sched.add_request(make_req("c", 3))
    # Running a (1) and b (the 3 tokens left) come first; c gets the 2 tokens left of the budget.
    assert plan(step(sched)) == [("a", 5, 1, True), ("b", 7, 3, True), ("c", 0, 2, False)]


def test_chunked_prefill_of_a_long_prompt():
    sched = make_sched(64, block_size=16, budget=32)
    req = make_req("long", 100)
    sched.add_request(req)
    # 100 = 32 + 32 + 32 + 4; only the last chunk completes the prompt and samples.
    assert plan(step(sched)) == [("long", 0, 32, False)]
    assert req.num_computed_tokens == 32 and req.output_token_ids == []
    assert plan(step(sched)) == [("long", 32, 32, False)]
    assert plan(step(sched)) == [("long", 64, 32, False)]
    assert plan(step(sched)) == [("long", 96, 4, True)]
    assert req.num_computed_tokens == 100 and req.output_token_ids == [TOKEN]
    assert plan(step(sched)) == [("long", 100, 1, True)]  # then decode
    assert sched.kv.block_ids("long") == [0, 1, 2, 3, 4, 5, 6]  # ceil(101 / 16) = 7 blocks


def test_decode_and_prefill_share_a_step():
    sched = make_sched(budget=10)
    sched.add_request(make_req("a", 3))
    assert plan(step(sched)) == [("a", 0, 3, True)]
    sched.add_request(make_req("b", 20))
    out = step(sched)
    assert plan(out) == [("a", 3, 1, True), ("b", 0, 9, False)]
    assert out.num_batched_tokens == 10


def test_max_num_seqs_is_respected():
    sched = make_sched(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_req(rid, 3))
    assert ids(s.request for s in step(sched).scheduled) == ["a", "b"]
    assert ids(sched.running) == ["a", "b"] and sched.num_waiting == 1
    assert ids(s.request for s in step(sched).scheduled) == ["a", "b"]
    assert sched.num_waiting == 1


def test_finished_request_leaves_and_waiting_one_joins_next_step():
    sched = make_sched(max_num_seqs=2)
    a, b, c = make_req("a", 3, max_tokens=2), make_req("b", 3, max_tokens=5), make_req("c", 3)
    for r in (a, b, c):
        sched.add_request(r)
    assert plan(step(sched)) == [("a", 0, 3, True), ("b", 0, 3, True)]
    assert plan(step(sched)) == [("a", 3, 1, True), ("b", 3, 1, True)]
    assert a.is_finished and a.finish_reason == FinishReason.LENGTH and a.output_token_ids == [TOKEN] * 2
    assert ids(sched.running) == ["b"] and "a" not in sched.requests
    assert sched.kv.pool.num_free == 64 - 1  # a's block is back; b holds 1 block (4 computed tokens)
    assert plan(step(sched)) == [("b", 4, 1, True), ("c", 0, 3, True)]


def test_long_prefill_token_threshold_caps_each_request():
    sched = make_sched(budget=64, threshold=8)
    sched.add_request(make_req("a", 20))
    sched.add_request(make_req("b", 20))
    assert plan(step(sched)) == [("a", 0, 8, False), ("b", 0, 8, False)]  # 16 of the 64 tokens used
    assert plan(step(sched)) == [("a", 8, 8, False), ("b", 8, 8, False)]
    assert plan(step(sched)) == [("a", 16, 4, True), ("b", 16, 4, True)]
    assert plan(step(sched)) == [("a", 20, 1, True), ("b", 20, 1, True)]


# ---------------------------------------------------------------------------------------------
# Preemption (FCFS)
# ---------------------------------------------------------------------------------------------


def test_fcfs_preemption_victim_is_last_admitted_and_recomputes():
    sched = make_sched(5, prefix_caching=False)
    a = make_req("a", 4, max_tokens=3)
    b = make_req("b", 6, max_tokens=4)
    c = make_req("c", 6, max_tokens=3)
    for r in (a, b, c):
        sched.add_request(r)
    # Step 1: a 1 block, b 2, c 2: the pool (5) is full.
    out = step(sched, 1001)
    assert plan(out) == [("a", 0, 4, True), ("b", 0, 6, True), ("c", 0, 6, True)]
    assert sched.kv.pool.num_free == 0
    d = make_req("d", 2, max_tokens=1)
    sched.add_request(d)

    # Step 2: a (5 tokens) needs a 2nd block; the victim is c, the last admitted (not b, not a).
    out = step(sched, 1002)
    assert out.preempted == [c]
    assert plan(out) == [("a", 4, 1, True), ("b", 6, 1, True)]  # nobody admitted in a preempting step
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert c.output_token_ids == [1001]  # generated tokens are kept
    assert sched.kv.block_ids("c") == []
    assert ids(sched.waiting) == ["c", "d"]  # the victim goes back to the front
    assert sched.kv.pool.num_free == 1

    # Step 3: c needs 2 blocks for its 7 tokens, 1 free: it waits, and d behind it too.
    out = step(sched, 1003)
    assert plan(out) == [("a", 5, 1, True), ("b", 7, 1, True)]
    assert a.is_finished and a.output_token_ids == [1001, 1002, 1003]
    assert sched.kv.pool.num_free == 3

    # Step 4: c recomputes its prompt and its generated token (6 + 1 = 7) and samples.
    out = step(sched, 1004)
    assert plan(out) == [("b", 8, 1, True), ("c", 0, 7, True)]
    assert b.is_finished and b.output_token_ids == [1001, 1002, 1003, 1004]

    out = step(sched, 1005)
    assert plan(out) == [("c", 7, 1, True), ("d", 0, 2, True)]
    assert c.is_finished and c.finish_reason == FinishReason.LENGTH
    assert c.output_token_ids == [1001, 1004, 1005]
    assert c.all_token_ids == c.prompt_token_ids + [1001, 1004, 1005]
    assert d.is_finished
    assert not sched.has_unfinished() and sched.kv.pool.num_free == 5
    assert sched.num_preemptions == 1


def test_preempted_request_reuses_its_cached_prefix():
    sched = make_sched(4)
    a = make_req("a", 7, max_tokens=5)
    b = make_req("b", 4, max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)
    assert plan(step(sched)) == [("a", 0, 7, True), ("b", 0, 4, True)]  # a: 2 blocks, b: 1; 1 free
    assert plan(step(sched)) == [("a", 7, 1, True), ("b", 4, 1, True)]  # b (5 tokens) takes the last
    assert sched.kv.pool.num_free == 0
    # Step 3: a (9 tokens) needs a 3rd block; b, the last admitted, is preempted.
    out = step(sched)
    assert out.preempted == [b] and plan(out) == [("a", 8, 1, True)]
    # b's computed full block (its 4 prompt tokens) stays cached; its half block went to a.
    assert sched.kv.pool.lookup(b.block_hashes[0]) is not None
    # a runs to the end (b needs 2 blocks: 1 new + its cached one, only 1 free meanwhile), then b
    # comes back with 6 tokens and hits its first block (cap: (6-1)//4 = 1 block).
    while not a.is_finished:
        assert not step(sched).preempted
    out = step(sched)
    assert plan(out) == [("b", 4, 2, True)]
    assert b.num_cached_tokens == 0  # the hit at *first* scheduling
    assert b.num_preemptions == 1


# ---------------------------------------------------------------------------------------------
# Priority policy
# ---------------------------------------------------------------------------------------------


def test_priority_waiting_order_is_priority_then_arrival():
    sched = make_sched(policy="priority")
    sched.add_request(make_req("r1", 2, priority=1, arrival=0.0))
    sched.add_request(make_req("r2", 2, priority=0, arrival=2.0))
    sched.add_request(make_req("r3", 2, priority=0, arrival=1.0))
    sched.add_request(make_req("r4", 2, priority=1, arrival=-1.0))
    assert ids(sched.waiting) == ["r3", "r2", "r4", "r1"]
    assert ids(s.request for s in step(sched).scheduled) == ["r3", "r2", "r4", "r1"]


def test_fcfs_waiting_order_ignores_priority():
    sched = make_sched()
    sched.add_request(make_req("r1", 2, priority=5, arrival=3.0))
    sched.add_request(make_req("r2", 2, priority=0, arrival=1.0))
    assert ids(sched.waiting) == ["r1", "r2"]


def test_priority_victim_is_the_least_urgent_running_request():
    sched = make_sched(4, policy="priority")
    low = make_req("low", 4, priority=2, arrival=0.0)
    sched.add_request(low)
    step(sched)  # low: 1 block, 5 tokens
    high = make_req("high", 4, priority=0, arrival=1.0)
    mid = make_req("mid", 4, priority=1, arrival=2.0)
    sched.add_request(high)
    sched.add_request(mid)
    out = step(sched)  # low takes its 2nd block, high and mid one each: the pool is full
    assert plan(out) == [("low", 4, 1, True), ("high", 0, 4, True), ("mid", 0, 4, True)]
    assert ids(sched.running) == ["low", "high", "mid"] and sched.kv.pool.num_free == 0
    # Step 3: low fits; high (5 tokens) needs a block: the victim is low (max (priority, arrival)),
    # although it was admitted first and already scheduled in this step (FCFS would take mid).
    out = step(sched)
    assert out.preempted == [low]
    assert plan(out) == [("high", 4, 1, True), ("mid", 4, 1, True)]
    assert out.num_batched_tokens == 2  # low's token was given back
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert low.output_token_ids == [TOKEN, TOKEN]
    assert ids(sched.waiting) == ["low"]


def test_priority_arrival_preempts_when_max_num_seqs_is_reached():
    sched = make_sched(policy="priority", max_num_seqs=1, prefix_caching=False)
    low = make_req("low", 4, priority=5, arrival=0.0, max_tokens=3)
    sched.add_request(low)
    assert plan(step(sched)) == [("low", 0, 4, True)]
    high = make_req("high", 6, priority=0, arrival=1.0, max_tokens=1)
    sched.add_request(high)
    out = step(sched)
    assert out.preempted == [low]
    assert plan(out) == [("high", 0, 6, True)]  # low's decode token was taken back
    assert low.status == RequestStatus.PREEMPTED and low.num_preemptions == 1
    assert high.is_finished
    # low comes back and recomputes its prompt and its generated token.
    out = step(sched)
    assert plan(out) == [("low", 0, 5, True)]
    assert low.output_token_ids == [TOKEN, TOKEN]


def test_priority_no_preemption_for_equal_or_worse_priority():
    sched = make_sched(policy="priority", max_num_seqs=1)
    first = make_req("first", 4, priority=1, arrival=0.0, max_tokens=3)
    sched.add_request(first)
    step(sched)
    sched.add_request(make_req("same", 4, priority=1, arrival=1.0))
    sched.add_request(make_req("worse", 4, priority=2, arrival=0.5))
    out = step(sched)
    assert out.preempted == [] and plan(out) == [("first", 4, 1, True)]
    assert sched.num_waiting == 2 and sched.num_preemptions == 0


def test_priority_preemption_must_not_leave_reused_blocks_unwritten():
    """A block named in this step by a request that is then preempted must not be read as computed.

    `old` (priority 5) runs a second prefill chunk that names blocks 2 and 3 of its prompt. `reuse`
    (priority 1, same prompt) is admitted in the same step and hits blocks 0..2 (early reuse). Then
    `urgent` (priority 2) finds max_num_seqs reached and preempts `old`, so block 2 is never written,
    yet `reuse` starts at token 12 as if it were.
    """
    sched = make_sched(16, policy="priority", max_num_seqs=2, threshold=8)
    shared = prompt_of(16)
    old = make_req("old", prompt=shared, priority=5, arrival=0.0)
    sched.add_request(old)
    assert plan(step(sched)) == [("old", 0, 8, False)]  # blocks 0, 1 written
    reuse = make_req("reuse", prompt=list(shared), priority=1, arrival=1.0)
    urgent = make_req("urgent", 4, priority=2, arrival=2.0)
    sched.add_request(reuse)
    sched.add_request(urgent)
    before = named_blocks(sched)
    out = schedule(sched)
    # Urgent requests make room before anything is allocated in a step, so `old` is not preempted
    # after `reuse` took its freshly named blocks: `urgent` waits one step for its slot.
    assert unwritten_reads(sched, out, before) == {}
    assert out.preempted == []
    assert [s.request.request_id for s in out.scheduled] == ["old", "reuse"]
    written = before | written_in(sched, out)
    finish(sched, out)
    before = written | named_blocks(sched)
    out = schedule(sched)
    assert out.preempted == [old]
    assert "urgent" in [s.request.request_id for s in out.scheduled]
    assert unwritten_reads(sched, out, before) == {}


def named_blocks(sched: Scheduler) -> set[int]:
    """Blocks with a hash between two steps: their content was written by an earlier step."""
    return {b.block_id for b in sched.kv.pool.blocks if b.block_hash is not None}


def written_in(sched: Scheduler, out: Stepped) -> set[int]:
    """Blocks that this step's scheduled tokens complete."""
    bs = sched.kv.block_size
    done = set()
    for s in out.scheduled:
        blocks = sched.kv.req_blocks[s.request.request_id]
        for i in range(s.start // bs, (s.start + s.num_new_tokens) // bs):
            done.add(blocks[i].block_id)
    return done


def unwritten_reads(sched: Scheduler, out: Stepped, written_before: set[int]) -> dict[str, list[int]]:
    """For each scheduled request, the blocks below its start that nobody has written by the end of the step.

    A request reads blocks [0, start // block_size) as computed. Each must have been written by an
    earlier step or be completed in this step by a request that is still scheduled.
    """
    bs = sched.kv.block_size
    written_now = set()
    for s in out.scheduled:
        blocks = sched.kv.req_blocks[s.request.request_id]
        for i in range(s.start // bs, (s.start + s.num_new_tokens) // bs):
            written_now.add(blocks[i].block_id)
    bad = {}
    for s in out.scheduled:
        blocks = sched.kv.req_blocks[s.request.request_id][: s.start // bs]
        missing = [b.block_id for b in blocks if b.block_id not in written_before | written_now]
        if missing:
            bad[s.request.request_id] = missing
    return bad


def test_early_reuse_in_the_same_step():
    sched = make_sched(16)
    shared = prompt_of(10)
    a = make_req("a", prompt=shared)
    b = make_req("b", prompt=list(shared))
    sched.add_request(a)
    sched.add_request(b)
    before = named_blocks(sched)
    out = schedule(sched)
    # b hits a's 2 full blocks, named when a was allocated in this very step: (10-1)//4 = 2 blocks.
    assert plan(out) == [("a", 0, 10, True), ("b", 8, 2, True)]
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    assert sched.kv.block_ids("b")[:2] == sched.kv.block_ids("a")[:2]
    assert unwritten_reads(sched, out, before) == {}  # a writes them in this step
    sched.update(out.out, {"a": [TOKEN], "b": [TOKEN]})
    assert sched.kv.pool.num_free == 16 - 4


def test_prefix_cache_counters_are_counted_once_upon_admission():
    sched = make_sched(16)
    shared = prompt_of(10)
    sched.add_request(make_req("a", prompt=shared, max_tokens=1))
    step(sched)
    # Queries and hits in tokens: a queried 10 tokens, hit 0.
    assert (sched.kv.prefix_cache_queries, sched.kv.prefix_cache_hits) == (10, 0)
    sched.add_request(make_req("b", prompt=list(shared), max_tokens=1))
    out = step(sched)
    assert plan(out) == [("b", 8, 2, True)]
    # b queried 10 more tokens and hit 8 of them.
    assert (sched.kv.prefix_cache_queries, sched.kv.prefix_cache_hits) == (20, 8)


def test_prefix_cache_counters_ignore_requests_not_admitted():
    sched = make_sched(2, max_num_seqs=1)
    sched.add_request(make_req("a", 4, max_tokens=2))
    sched.add_request(make_req("b", 4, max_tokens=1))
    step(sched)  # a admitted, b waits for a sequence slot
    step(sched)  # a finishes, b still waits
    assert (sched.kv.prefix_cache_queries, sched.kv.prefix_cache_hits) == (4, 0)
    step(sched)  # b admitted
    assert (sched.kv.prefix_cache_queries, sched.kv.prefix_cache_hits) == (8, 0)


# ---------------------------------------------------------------------------------------------
# Abort, finish, duplicates
# ---------------------------------------------------------------------------------------------


def test_abort_running_and_waiting_requests_frees_blocks():
    sched = make_sched(8, max_num_seqs=1)
    run = make_req("run", 6)
    wait = make_req("wait", 6)
    sched.add_request(run)
    sched.add_request(wait)
    step(sched)
    assert sched.kv.pool.num_free == 6 and run.status == RequestStatus.RUNNING
    aborted = sched.abort(["run", "wait", "nope"])
    assert aborted == [run, wait]
    for r in (run, wait):
        assert r.is_finished and r.finish_reason == FinishReason.ABORT
    assert sched.kv.pool.num_free == 8 and sched.kv.req_blocks == {}
    assert sched.running == [] and sched.num_waiting == 0 and not sched.has_unfinished()
    assert sched.schedule().num_scheduled_tokens == {}


def test_abort_preempted_request():
    sched = make_sched(2, max_num_seqs=1, policy="priority")
    low = make_req("low", 4, priority=1, arrival=0.0)
    sched.add_request(low)
    step(sched)
    sched.add_request(make_req("high", 4, priority=0, arrival=1.0, max_tokens=3))
    assert step(sched).preempted == [low]
    assert sched.abort(["low"]) == [low]
    assert low.finish_reason == FinishReason.ABORT and sched.num_waiting == 0
    assert ids(sched.running) == ["high"]


def test_finish_on_eos():
    sched = make_sched()
    req = make_req("r", 3, eos=(2,))
    sched.add_request(req)
    step(sched, 5)
    out = schedule(sched)
    assert plan(out) == [("r", 3, 1, True)]
    assert sched.update(out.out, {"r": [2]}) == [(req, 1)]
    assert req.is_finished and req.finish_reason == FinishReason.STOP and req.stop_token == 2
    assert req.output_token_ids == [5, 2]
    assert sched.kv.pool.num_free == 64 and not sched.has_unfinished()


def test_finish_on_stop_token_id():
    sched = make_sched()
    req = make_req("r", 3, stop_token_ids=(9,))
    sched.add_request(req)
    step(sched, 9)
    assert req.finish_reason == FinishReason.STOP and req.stop_token == 9 and req.output_token_ids == [9]


def test_finish_on_max_tokens():
    sched = make_sched()
    req = make_req("r", 3, max_tokens=3)
    sched.add_request(req)
    step(sched)
    step(sched)
    assert not req.is_finished
    step(sched)
    assert req.finish_reason == FinishReason.LENGTH and len(req.output_token_ids) == 3


def test_finish_at_context_length():
    sched = make_sched()
    req = make_req("r", 3, max_tokens=None, max_model_len=5)  # room for 5 - 3 = 2 tokens
    sched.add_request(req)
    step(sched)
    step(sched)
    assert req.finish_reason == FinishReason.LENGTH and req.num_tokens == 5


def test_eos_before_min_tokens_does_not_stop():
    sched = make_sched()
    req = make_req("r", 3, eos=(2,), stop_token_ids=(9,), min_tokens=3)
    sched.add_request(req)
    step(sched, 2)  # 1 output: EOS ignored
    step(sched, 9)  # 2 outputs: stop token ignored
    assert not req.is_finished
    step(sched, 2)  # 3 outputs = min_tokens: EOS stops
    assert req.finish_reason == FinishReason.STOP and req.output_token_ids == [2, 9, 2]


def test_ignore_eos():
    sched = make_sched()
    req = make_req("r", 3, eos=(2,), stop_token_ids=(9,), ignore_eos=True, max_tokens=3)
    sched.add_request(req)
    step(sched, 2)
    step(sched, 2)
    assert not req.is_finished
    step(sched, 9)  # stop_token_ids still stop
    assert req.finish_reason == FinishReason.STOP and req.stop_token == 9
    req2 = make_req("r2", 3, eos=(2,), ignore_eos=True, max_tokens=2)
    sched.add_request(req2)
    step(sched, 2)
    step(sched, 2)
    assert req2.finish_reason == FinishReason.LENGTH and req2.output_token_ids == [2, 2]


def test_finish_requests_from_outside():
    sched = make_sched(8, max_num_seqs=1)
    run = make_req("run", 4)
    wait = make_req("wait", 4)
    sched.add_request(run)
    sched.add_request(wait)
    step(sched)
    sched.finish_requests(["run", "wait", "unknown"], FinishReason.STOP)
    assert run.finish_reason == FinishReason.STOP and wait.finish_reason == FinishReason.STOP
    assert run.is_finished and wait.is_finished
    assert sched.kv.pool.num_free == 8 and not sched.has_unfinished()
    assert sched.running == [] and sched.num_waiting == 0


def test_update_returns_the_requests_that_got_a_token():
    sched = make_sched(budget=8)
    a = make_req("a", 4)
    b = make_req("b", 10)
    sched.add_request(a)
    sched.add_request(b)
    out = schedule(sched)
    assert plan(out) == [("a", 0, 4, True), ("b", 0, 4, False)]
    assert sched.update(out.out, {"a": [TOKEN]}) == [(a, 1)]
    assert b.num_computed_tokens == 4 and b.output_token_ids == []


def test_duplicate_request_id_rejected():
    sched = make_sched()
    sched.add_request(make_req("x", 3))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(make_req("x", 3))
    assert sched.num_waiting == 1


def test_unknown_policy_rejected():
    with pytest.raises(ValueError):
        make_sched(policy="lifo")


# ---------------------------------------------------------------------------------------------
# The step as plain data: what the workers are told
# ---------------------------------------------------------------------------------------------


def test_the_workers_get_a_request_whole_once_then_diffs() -> None:
    sched = make_sched(64, budget=6)
    a = make_req("a", 10)
    sched.add_request(a)
    first = schedule(sched)
    (new,) = first.out.new_requests
    assert (new.prompt_token_ids, new.output_token_ids) == (a.prompt_token_ids, [])
    assert new.block_ids == sched.kv.block_ids("a") and new.num_computed_tokens == 0
    assert first.out.num_scheduled_tokens == {"a": 6} and first.out.running_requests == []
    finish(sched, first)
    second = schedule(sched)  # the rest of the prompt: no new tokens to send, one new block
    (run,) = second.out.running_requests
    assert (run.new_token_ids, run.num_computed_tokens) == ([], 6)
    assert run.new_block_ids == sched.kv.block_ids("a")[2:]
    finish(sched, second, 42)
    (run,) = schedule(sched).out.running_requests
    assert run.new_token_ids == [42], "the sampled token travels as the next step's input"


def test_preempted_requests_come_back_whole_and_finished_ones_are_named() -> None:
    sched = make_sched(2, max_num_seqs=1, policy="priority")
    low = make_req("low", 4, priority=1, arrival=0.0)
    sched.add_request(low)
    step(sched, 9)
    sched.add_request(make_req("high", 4, priority=0, arrival=1.0, max_tokens=1))
    out = step(sched).out
    assert out.preempted_req_ids == ["low"] and [r.request_id for r in out.new_requests] == ["high"]
    out = step(sched).out  # high finished last step; low returns with the token it had sampled
    assert out.finished_req_ids == ["high"]
    (back,) = out.new_requests
    assert back.request_id == "low" and back.output_token_ids == [9]
    assert back.num_computed_tokens == 4, "its full prompt block is still in the prefix cache"


def test_on_finished_is_called_once_per_request_when_it_ends_and_never_before():
    """The hook the engine's trace spans hang on: not on a preemption, not on an admission the pool could
    not take, once on the end however it comes (finished, aborted while waiting)."""
    sched = make_sched(5, prefix_caching=False)
    seen: list[tuple[str, FinishReason | None, bool]] = []
    sched.on_finished = lambda r: seen.append((r.request_id, r.finish_reason, r.request_id in sched.requests))
    a, b, c = make_req("a", 4, max_tokens=3), make_req("b", 6, max_tokens=4), make_req("c", 6, max_tokens=3)
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    sched.add_request(make_req("d", 2, max_tokens=1))
    assert step(sched).preempted == [c]  # c preempted
    step(sched)  # c cannot be admitted again yet (2 blocks needed, 1 free): it waits, d behind it
    assert seen == [("a", FinishReason.LENGTH, False)]
    sched.add_request(make_req("e", 30, max_tokens=2))  # more blocks than the pool has: it waits
    assert [r.request_id for r in sched.abort(["e"])] == ["e"]
    while sched.has_unfinished():
        step(sched)
    assert sorted(seen) == [
        ("a", FinishReason.LENGTH, False),
        ("b", FinishReason.LENGTH, False),
        ("c", FinishReason.LENGTH, False),
        ("d", FinishReason.LENGTH, False),
        ("e", FinishReason.ABORT, False),
    ]
