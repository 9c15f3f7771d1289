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
