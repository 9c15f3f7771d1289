"""Bounded admission: past a number of sequences or prompt tokens in flight, new requests get 429.

Nothing in the server grows without limit. What the engine holds is sequences (a completion with 1,000
prompts and n=2 is 2,000 of them), so sequences are what is counted: one from a request's arrival
(every request is at least one), all of them once its prompts and n are known, until its last byte
is sent; its prompt tokens likewise.

Load shedding by band, with `shedding` on (the server's `priority` and `fair` policies): a request's
band is its `priority` (lower is more urgent; the server clamps it to the tenant's floor first). When a
request would be refused, requests of a strictly higher band that have not started (no engine output
has arrived for them, and their answer has not begun: a stream's 200 or a background response's id is
never followed by a shedding) are shed instead, the highest band and the latest arrival first, if that
makes room: each ends with 503 and is counted (`on_shed`). A candidate that frees nothing of what is
short (prompt tokens, when only sequences are) is passed over. Otherwise the new request gets its 429
as before, and nothing is shed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.frontend.async_llm import RequestShedError
from tokenmill.server.errors import APIError

RETRY_AFTER = {"Retry-After": "1"}


@dataclass(eq=False)
class Ticket:
    sequences: int = 0
    tokens: int = 0
    released: bool = False
    band: int = 0  # the request's priority (clamped to its tenant's floor)
    # What sheds it while queued (a frontend RequestScope: `started`, `cut_off`); None: never shed.
    scope: Any = None
    shed: bool = False
    order: int = 0  # arrival order


def shed_error(band: int) -> APIError:
    return APIError(
        503,
        f"the server is overloaded and gave this request's place (priority {band}) to a more urgent one; "
        "retry shortly",
        headers=RETRY_AFTER,
    )


class Admission:
    def __init__(
        self,
        max_sequences: int,
        max_tokens: int,
        on_shed: Callable[[Ticket], None] | None = None,
        shedding: bool = True,
    ) -> None:
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self.sequences = 0
        self.tokens = 0
        self.on_shed = on_shed
        self.shedding = shedding
        self._live: dict[int, Ticket] = {}  # by order: tickets that could be shed
        self._order = itertools.count()

    @property
    def full(self) -> bool:
        return self.sequences >= self.max_sequences

    def admit(self, band: int = 0, scope: Any = None) -> Ticket:
        """A ticket for one request (one sequence). With a `scope` the request may shed queued requests
        of higher bands to get in, and be shed itself."""
        ticket = Ticket(sequences=1, band=band, scope=scope, order=next(self._order))
        # Only a place is wanted here: the prompt tokens are counted (and may be short) in add_work.
        if self.full and not self._shed_for(ticket, 1, None):
            raise APIError(
                429,
                f"the server is at capacity ({self.sequences} sequences in flight); retry shortly",
                headers=RETRY_AFTER,
            )
        self.sequences += 1
        if scope is not None:
            self._live[ticket.order] = ticket
        return ticket

    def add_work(self, ticket: Ticket, sequences: int, tokens: int) -> None:
        """Count a request's sequences (prompts x n) and prompt tokens, or raise (the request is not run)."""
        if ticket.shed:
            raise shed_error(ticket.band)
        more = max(0, sequences - ticket.sequences)
        if sequences > self.max_sequences:
            # It could never run, however long the client waits: a 429 would only invite retries.
            raise APIError(
                400,
                f"the request has {sequences} sequences (prompts x n); this server runs at most "
                f"{self.max_sequences} at once: split it",
            )
        if not self._fits(more, tokens) and not self._shed_for(ticket, more, tokens):
            if self.sequences + more > self.max_sequences:
                raise APIError(
                    429,
                    f"the server is at capacity ({self.sequences} sequences in flight); retry shortly",
                    headers=RETRY_AFTER,
                )
            raise APIError(
                429,
                f"the server is at capacity ({self.tokens} prompt tokens in flight); retry shortly",
                headers=RETRY_AFTER,
            )
        self.sequences += more
        ticket.sequences += more
        self.tokens += tokens
        ticket.tokens += tokens

    def _seqs_fit(self, sequences: int, freed: int = 0) -> bool:
        return self.sequences - freed + sequences <= self.max_sequences

    def _tokens_fit(self, tokens: int, freed: int = 0) -> bool:
        # A request alone may exceed the token limit (else it could never run); with others it waits.
        held = self.tokens - freed
        return held == 0 or held + tokens <= self.max_tokens

    def _fits(self, sequences: int, tokens: int, freed_seqs: int = 0, freed_tokens: int = 0) -> bool:
        return self._seqs_fit(sequences, freed_seqs) and self._tokens_fit(tokens, freed_tokens)

    def _shed_for(self, ticket: Ticket, sequences: int, tokens: int | None) -> bool:
        """Shed queued requests of higher bands than `ticket`'s until `sequences` more (and `tokens`
        more prompt tokens; None: tokens do not matter) fit; False (shedding nothing) if even all of them
        would not make room."""
        if ticket.scope is None or not self.shedding:
            return False
        victims = sorted(
            (
                t
                for t in self._live.values()
                if t is not ticket and t.band > ticket.band and not t.released and not t.scope.started
            ),
            key=lambda t: (t.band, t.order),
            reverse=True,
        )
        chosen: list[Ticket] = []
        freed_seqs = freed_tokens = 0

        def short() -> tuple[bool, bool]:
            return (
                not self._seqs_fit(sequences, freed_seqs),
                tokens is not None and not self._tokens_fit(tokens, freed_tokens),
            )

        for victim in victims:
            seqs_short, tokens_short = short()
            if not seqs_short and not tokens_short:
                break
            if not (seqs_short and victim.sequences) and not (tokens_short and victim.tokens):
                continue  # it frees nothing that is short
            chosen.append(victim)
            freed_seqs += victim.sequences
            freed_tokens += victim.tokens
        if any(short()):
            return False
        for victim in chosen:
            victim.shed = True
            self.release(victim)
            victim.scope.cut_off(RequestShedError(shed_error(victim.band).message))
            if self.on_shed is not None:
                self.on_shed(victim)
        return True

    def release(self, ticket: Ticket) -> None:
        if not ticket.released:
            ticket.released = True
            self.sequences -= ticket.sequences
            self.tokens -= ticket.tokens
            self._live.pop(ticket.order, None)
