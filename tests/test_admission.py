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
