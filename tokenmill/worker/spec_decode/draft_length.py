"""How many tokens to draft for a request: as many as are likely to be accepted, fewer when the batch
is large.

Acceptance is tracked per request as a geometric rate: each step's drafts are accepted up to the first
rejection, so a step with `a` accepted out of `k` adds `a` successes and one failure if a < k (none if
all passed). Counts decay so the rate follows the text (a copied passage, then free prose). The j-th
draft token is accepted with probability about rate**j; it costs a row of the verifying pass whatever
happens, so drafting stops where that chance falls below `min_gain`. The batch cap keeps the verifying
pass in the range where extra rows cost little (see SpeculativeConfig.max_batch_tokens).

Guesses that cost a pass each (a draft model) are weighed differently: the length that gives the most
tokens per unit of time (whether to draft at all is measured for the batch: draft_cost.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class _Rate:
    accepted: float = 1.0  # prior: one success, one failure (rate 0.5)
    rejected: float = 1.0

    @property
    def value(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


class DraftLength:
    DECAY = 0.8
    MIN_GAIN = 0.15
    # What one more verified row adds to a target step at small batches (benchmarks/spec_decode.py's
    # cost curve: 9 rows cost 1.3 steps).
    ROW_COST = 0.04

    def __init__(self, k_max: int, max_batch_tokens: int) -> None:
        self.k_max = k_max
        self.max_batch_tokens = max_batch_tokens
        self.rates: dict[str, _Rate] = {}

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        r = self.rates.setdefault(request_id, _Rate())
        r.accepted = r.accepted * self.DECAY + accepted
        r.rejected = r.rejected * self.DECAY + (1 if accepted < drafted else 0)

    def cap(self, batch_size: int) -> int:
        """The most drafts any request may have with this many requests sampling (0: speculation off)."""
        return min(self.k_max, self.max_batch_tokens // max(batch_size, 1) - 1)

    def length(self, request_id: str, cap: int, cost: float | None = 0.0) -> int:
        """`cost`: what proposing one token costs, as a share of a target step: 0 for lookups; for a
        draft model, which runs a pass per guess, the measured share, or None until measured."""
        if cap <= 0:
            return 0
        r = self.rates.get(request_id)
        rate = r.value if r else 0.5
        if cost is None:
            return 1  # one guess, to measure what guesses cost
        if cost:
            return self._costly_length(rate, cap, cost)
        k, chance = 1, rate  # always at least one: a request must draft to learn its rate
        while k < cap and chance * rate >= self.MIN_GAIN:
            k += 1
            chance *= rate
        return k

    def _costly_length(self, rate: float, cap: int, cost: float) -> int:
        # Tokens per unit of time with k guesses: the expected tokens of a step (1 + rate + ... +
        # rate**k) over its cost (one target step, k guesses, k more rows to verify). At least one:
        # whether drafting pays at all is measured for the batch (DraftCost), and a request left out
        # would have to be caught up on later.
        best_k, best = 1, 0.0
        tokens, time_, chance = 1.0, 1.0, 1.0
        for k in range(1, cap + 1):
            chance *= rate
            tokens += chance
            time_ += cost + self.ROW_COST
            if tokens / time_ > best:
                best_k, best = k, tokens / time_
        return best_k

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.rates.pop(rid, None)
