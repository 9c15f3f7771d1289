"""Bounded admission: past a number of requests or prompt tokens in flight, new requests get 429.

Nothing in the server grows without limit: a request is counted from its arrival until its last
byte is sent, its prompt tokens from the moment they are known until then.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.server.errors import APIError

RETRY_AFTER = {"Retry-After": "1"}


@dataclass
class Ticket:
    tokens: int = 0
    released: bool = False


class Admission:
    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.requests = 0
        self.tokens = 0

    def admit(self) -> Ticket:
        if self.requests >= self.max_requests:
            raise APIError(
                429,
                f"the server is at capacity ({self.requests} requests in flight); retry shortly",
                headers=RETRY_AFTER,
            )
        self.requests += 1
        return Ticket()

    def add_tokens(self, ticket: Ticket, n: int) -> None:
        # A request alone may exceed the limit (else it could never run); with others it waits its turn.
        if self.tokens > 0 and self.tokens + n > self.max_tokens:
            raise APIError(
                429,
                f"the server is at capacity ({self.tokens} prompt tokens in flight); retry shortly",
                headers=RETRY_AFTER,
            )
        self.tokens += n
        ticket.tokens += n

    def release(self, ticket: Ticket) -> None:
        if not ticket.released:
            ticket.released = True
            self.requests -= 1
            self.tokens -= ticket.tokens
