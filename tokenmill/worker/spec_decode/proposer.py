"""What every proposer does: given requests' contexts and a draft length each, guess the next tokens.

A proposer runs on the sampling rank after each step, for the requests that just sampled. Its drafts
go back to the scheduler, which schedules them for verification in the next step (or drops them when
the request stops or the budget is short). Drafts are deterministic guesses (no draft distribution):
the verifier accepts draft token x with the target's probability p(x), which keeps the target's
distribution exactly (distributed.md section 7.1, with q(x) = 1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class ProposeInput:
    request_id: str
    context: Sequence[int]  # prompt + every token sampled so far (including this step's)
    num_prompt_tokens: int
    k: int  # most tokens to propose (at least 1)


class Proposer(ABC):
    # True when each guessed token costs a model pass (a draft model), so that guessing can cost more
    # than it saves; lookups (n-gram, suffix) cost next to nothing.
    costly: bool = False

    @abstractmethod
    def propose(self, batch: list[ProposeInput]) -> list[list[int]]:
        """Up to `k` draft tokens for each request (an empty list: no guess this step)."""

    def held(self, request_id: str) -> int | None:
        """How many of the request's tokens the proposer has read (a draft model's cache), None if it
        keeps nothing per request or has never seen it."""
        return None

    def forget(  # noqa: B027 - an optional hook
        self, request_ids: Sequence[str], outputs: dict[str, list[int]] | None = None
    ) -> None:
        """Requests the worker dropped; `outputs` holds the output tokens of those that finished (they
        may teach the proposer), None for preempted ones (they come back)."""
