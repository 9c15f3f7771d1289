"""How many tokens to draft for a request: as many as are likely to be accepted, fewer when the batch
is large.

Acceptance is tracked per request as a geometric rate: each step's drafts are accepted up to the first
rejection, so a step with `a` accepted out of `k` adds `a` successes and one failure if a < k (none if
all passed). Counts decay so the rate follows the text (a copied passage, then free prose). The j-th
draft token is accepted with probability about rate**j; it costs a row of the verifying pass whatever
happens, so drafting stops where that chance falls below `min_gain`. The batch cap keeps the verifying
pass in the range where extra rows cost little (see SpeculativeConfig.max_batch_tokens).
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

    def length(self, request_id: str, cap: int) -> int:
        if cap <= 0:
            return 0
        r = self.rates.get(request_id)
        rate = r.value if r else 0.5
        k, chance = 1, rate  # always at least one: a request must draft to learn its rate
        while k < cap and chance * rate >= self.MIN_GAIN:
            k += 1
            chance *= rate
        return k

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.rates.pop(rid, None)
