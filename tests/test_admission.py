"""Bounded admission bookkeeping (requests and prompt tokens in flight)."""

from __future__ import annotations

import pytest

from tokenmill.server.admission import Admission
from tokenmill.server.errors import APIError


def test_request_limit_and_release() -> None:
    a = Admission(max_requests=2, max_tokens=100)
    t1, t2 = a.admit(), a.admit()
    with pytest.raises(APIError) as e:
        a.admit()
    assert e.value.status == 429 and e.value.headers["Retry-After"]
    a.release(t1)
    a.release(t1)  # idempotent
    t3 = a.admit()
    assert a.requests == 2
    a.release(t2)
    a.release(t3)
    assert a.requests == 0


def test_token_limit_lets_a_lone_request_through() -> None:
    a = Admission(max_requests=10, max_tokens=100)
    big = a.admit()
    a.add_tokens(big, 500)  # alone: admitted although over the limit
    other = a.admit()
    with pytest.raises(APIError, match="prompt tokens"):
        a.add_tokens(other, 10)
    a.release(other)
    a.release(big)
    small = a.admit()
    a.add_tokens(small, 60)
    second = a.admit()
    a.add_tokens(second, 40)
    assert a.tokens == 100
    with pytest.raises(APIError):
        a.add_tokens(a.admit(), 1)
