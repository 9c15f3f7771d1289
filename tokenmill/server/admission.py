"""Bounded admission: past a number of sequences or prompt tokens in flight, new requests get 429.

Nothing in the server grows without limit. What the engine holds is sequences (a completion with 1,000
prompts and n=2 is 2,000 of them), so sequences are what is counted: one from a request's arrival
(every request is at least one), all of them once its prompts and n are known, until its last byte
is sent; its prompt tokens likewise.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.server.errors import APIError

RETRY_AFTER = {"Retry-After": "1"}


@dataclass
class Ticket:
    sequences: int = 0
    tokens: int = 0
    released: bool = False


class Admission:
    def __init__(self, max_sequences: int, max_tokens: int) -> None:
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self.sequences = 0
        self.tokens = 0

    @property
    def full(self) -> bool:
        return self.sequences >= self.max_sequences

    def admit(self) -> Ticket:
        if self.full:
            raise APIError(
                429,
                f"the server is at capacity ({self.sequences} sequences in flight); retry shortly",
                headers=RETRY_AFTER,
            )
        self.sequences += 1
        return Ticket(sequences=1)

    def add_work(self, ticket: Ticket, sequences: int, tokens: int) -> None:
        """Count a request's sequences (prompts x n) and prompt tokens, or raise (the request is not run)."""
        more = max(0, sequences - ticket.sequences)
        if sequences > self.max_sequences:
            # It could never run, however long the client waits: a 429 would only invite retries.
            raise APIError(
                400,
                f"the request has {sequences} sequences (prompts x n); this server runs at most "
                f"{self.max_sequences} at once: split it",
            )
        if self.sequences + more > self.max_sequences:
            raise APIError(
                429,
                f"the server is at capacity ({self.sequences} sequences in flight); retry shortly",
                headers=RETRY_AFTER,
            )
        # A request alone may exceed the token limit (else it could never run); with others it waits.
        if self.tokens > 0 and self.tokens + tokens > self.max_tokens:
            raise APIError(
                429,
                f"the server is at capacity ({self.tokens} prompt tokens in flight); retry shortly",
                headers=RETRY_AFTER,
            )
        self.sequences += more
        ticket.sequences += more
        self.tokens += tokens
        ticket.tokens += tokens

    def release(self, ticket: Ticket) -> None:
        if not ticket.released:
            ticket.released = True
            self.sequences -= ticket.sequences
            self.tokens -= ticket.tokens
