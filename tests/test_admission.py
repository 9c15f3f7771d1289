"""Bounded admission bookkeeping (sequences and prompt tokens in flight)."""

from __future__ import annotations

import pytest

from tokenmill.server.admission import Admission
from tokenmill.server.errors import APIError


def test_request_limit_and_release() -> None:
    a = Admission(max_sequences=2, max_tokens=100)
    t1, t2 = a.admit(), a.admit()
    with pytest.raises(APIError) as e:
        a.admit()
    assert e.value.status == 429 and e.value.headers["Retry-After"]
    a.release(t1)
    a.release(t1)  # idempotent
    t3 = a.admit()
    assert a.sequences == 2 and a.full
    a.release(t2)
    a.release(t3)
    assert a.sequences == 0 and not a.full


def test_token_limit_lets_a_lone_request_through() -> None:
    a = Admission(max_sequences=10, max_tokens=100)
    big = a.admit()
    a.add_work(big, 1, 500)  # alone: admitted although over the limit
    other = a.admit()
    with pytest.raises(APIError, match="prompt tokens"):
        a.add_work(other, 1, 10)
    a.release(other)
    a.release(big)
    small = a.admit()
    a.add_work(small, 1, 60)
    second = a.admit()
    a.add_work(second, 1, 40)
    assert a.tokens == 100
    with pytest.raises(APIError):
        a.add_work(a.admit(), 1, 1)


def test_sequences_not_requests_are_counted() -> None:
    a = Admission(max_sequences=10, max_tokens=10**6)
    t = a.admit()
    a.add_work(t, 8, 100)  # e.g. 4 prompts x n=2
    assert a.sequences == 8
    other = a.admit()
    with pytest.raises(APIError) as e:
        a.add_work(other, 4, 10)  # 8 + 4 > 10: wait for capacity
    assert e.value.status == 429 and e.value.headers["Retry-After"]
    a.release(other)
    assert a.sequences == 8
    with pytest.raises(APIError) as e:
        a.add_work(a.admit(), 2000, 10)  # more than the server ever runs: no retry can help
    assert e.value.status == 400 and "at most 10" in e.value.message
    a.release(t)


class Scope:
    """A stand-in for the frontend's RequestScope: whether it has begun, and what cut it off."""

    def __init__(self, started: bool = False) -> None:
        self.started, self.error = started, None

    def cut_off(self, error: Exception) -> None:
        self.error = error


def test_a_more_urgent_request_sheds_the_latest_queued_one_of_the_highest_band() -> None:
    shed = []
    a = Admission(max_sequences=4, max_tokens=10**6, on_shed=shed.append)
    running = a.admit(5, Scope(started=True))  # generating: never shed
    b1 = a.admit(1, Scope())
    b5_old = a.admit(5, Scope())
    b5_new = a.admit(5, Scope())
    assert a.full
    with pytest.raises(APIError) as e:  # the same band sheds nothing
        a.admit(5, Scope())
    assert e.value.status == 429 and shed == []
    with pytest.raises(APIError):  # nor does a request without a scope (tokenize, count_tokens)
        a.admit(0)
    urgent = a.admit(0, Scope())
    assert shed == [b5_new] and b5_new.shed and b5_new.released
    assert b5_new.scope.error is not None and "more urgent" in str(b5_new.scope.error)
    assert a.sequences == 4 and not running.shed
    a.admit(2, Scope())  # band 2 sheds band 5 (the one left queued), not band 1
    assert shed == [b5_new, b5_old] and not b1.shed
    with pytest.raises(APIError) as e:  # nothing queued above band 2 is left: refused itself
        a.admit(2, Scope())
    assert e.value.status == 429 and len(shed) == 2
    with pytest.raises(APIError) as e:  # what a shed request's handler meets next
        a.add_work(b5_old, 1, 10)
    assert e.value.status == 503 and e.value.headers["Retry-After"]
    a.release(b5_old)  # already released: nothing changes
    assert a.sequences == 4
    a.release(urgent)
    assert a.sequences == 3


def test_shedding_happens_only_if_it_makes_room() -> None:
    shed = []
    a = Admission(max_sequences=10, max_tokens=100, on_shed=shed.append)
    small = a.admit(3, Scope())
    a.add_work(small, 1, 30)
    big = a.admit(0, Scope(started=True))
    a.add_work(big, 1, 60)
    t = a.admit(0, Scope())
    with pytest.raises(APIError, match="prompt tokens"):  # 90 + 50 > 100 even without `small`'s 30
        a.add_work(t, 1, 50)
    assert shed == [] and not small.shed
    a.add_work(t, 1, 35)  # 90 + 35 > 100, but 60 + 35 fits once `small` is shed
    assert shed == [small] and a.tokens == 95
    # Sequences: 5 of them need 4 more places, 2 are free; the queued band-3 request frees 1: not enough
    # (the other has begun).
    a2 = Admission(max_sequences=5, max_tokens=10**6, on_shed=shed.append)
    q, r = a2.admit(3, Scope()), a2.admit(3, Scope(started=True))
    t2 = a2.admit(0, Scope())
    with pytest.raises(APIError) as e:
        a2.add_work(t2, 5, 10)
    assert e.value.status == 429 and not q.shed and not r.shed and a2.sequences == 3


def test_shedding_is_off_unless_bands_are_served_first() -> None:
    """Under fcfs the engine does not serve a lower band first, so a low `priority` sheds nothing."""
    shed = []
    a = Admission(max_sequences=2, max_tokens=10**6, on_shed=shed.append, shedding=False)
    a.admit(5, Scope())
    a.admit(5, Scope())
    with pytest.raises(APIError) as e:
        a.admit(-100, Scope())
    assert e.value.status == 429 and shed == []


def test_a_place_alone_is_what_the_admit_path_needs() -> None:
    """A lone request over the token limit holds more than max_tokens: a new request that wants only a
    place (its tokens are counted later) sheds a queued one for it, rather than being refused on tokens."""
    shed = []
    a = Admission(max_sequences=2, max_tokens=100, on_shed=shed.append)
    big = a.admit(0, Scope(started=True))
    a.add_work(big, 1, 500)  # alone: admitted over the limit
    queued = a.admit(5, Scope())
    urgent = a.admit(0, Scope())
    assert shed == [queued] and not urgent.shed and a.sequences == 2


def test_shedding_passes_over_requests_that_free_nothing_of_what_is_short() -> None:
    shed = []
    a = Admission(max_sequences=10, max_tokens=100, on_shed=shed.append)
    holder = a.admit(0, Scope(started=True))
    a.add_work(holder, 1, 60)
    with_tokens = a.admit(5, Scope())
    a.add_work(with_tokens, 1, 30)
    without_tokens = a.admit(5, Scope())  # the latest arrival of band 5, holding no tokens yet
    t = a.admit(0, Scope())
    a.add_work(t, 1, 35)  # only tokens are short: the one holding none would free nothing
    assert shed == [with_tokens] and not without_tokens.shed and a.tokens == 95


def test_an_output_that_arrived_unread_starts_a_request_and_is_never_lost() -> None:
    """A request is started (never shed) as soon as an engine output of it arrives, read or not; a scope
    cut off ends only its sequences that produced nothing; outputs that arrived before an error are
    handed out before the error is raised."""
    import asyncio

    from tokenmill.config import EngineConfig
    from tokenmill.engine.client import EngineDeadError
    from tokenmill.engine.protocol import EngineCoreOutput
    from tokenmill.frontend.async_llm import AsyncLLM, RequestScope, RequestShedError, request_scope
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.weights import catalog
    from tokenmill.weights.tokenizer_source import load_tokenizer

    class Client:
        def __init__(self) -> None:
            self.queues: dict = {}
            self.aborted: list[str] = []

        def add_request(self, req, queue):  # noqa: ANN001, ANN202
            self.queues[req.request_id] = queue
            self.priority = req.priority
            return queue

        def abort(self, ids: list[str]) -> None:
            self.aborted += ids

        def finish(self, ids: list[str]) -> None: ...

    async def main() -> None:
        client = Client()
        llm = AsyncLLM(client, load_tokenizer(catalog.resolve(EngineConfig().model), None))  # type: ignore[arg-type]
        scope = RequestScope("t", floor=-2)
        with request_scope(scope):
            sub = llm.submit("r", [1, 2, 3], SamplingParams(max_tokens=4), priority=-9)
            idle = llm.submit("s", [1, 2, 3], SamplingParams(max_tokens=4))
        assert client.priority == 0 and not scope.started
        (rid, queue), (sid, idle_queue) = client.queues.items()
        assert rid != sid
        # Below the floor: raised to it.
        with request_scope(RequestScope("t", floor=-2)):
            llm.submit("u", [1, 2, 3], SamplingParams(max_tokens=4), priority=-9)
        assert client.priority == -2
        queue.put_nowait(EngineCoreOutput(rid, [42]))
        assert scope.started  # not read yet
        a = Admission(max_sequences=1, max_tokens=10**6, on_shed=lambda t: None)
        a.admit(5, scope)
        with pytest.raises(APIError):  # started: not shed
            a.admit(0, Scope())
        scope.cut_off(RequestShedError("shed"))  # by hand: only the sequence with no output hears it
        assert queue.qsize() == 1 and idle_queue.qsize() == 1
        with pytest.raises(RequestShedError):
            async for _ in llm.stream(idle):
                pass
        # An output, then an error (the engine died): the output first, then the error.
        queue.put_nowait(EngineCoreOutput(rid, [43]))
        queue.put_nowait(EngineDeadError("gone"))
        got = []
        with pytest.raises(EngineDeadError):
            async for ro in llm.stream(sub):
                got += ro.outputs[0].delta_token_ids
        assert got == [42, 43] and rid in client.aborted

    asyncio.run(main())
