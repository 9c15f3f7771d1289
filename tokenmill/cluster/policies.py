"""How the router picks a worker for a request: each policy is a function of plain numbers.

`kv` is Dynamo's cost: prefill_weight x max(0, active prefill blocks + the request's blocks - blocks
the worker already holds) + active decode blocks; the lowest cost wins, or with a temperature a
softmax over the costs samples among near-equal workers.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

POLICIES = ("kv", "kv-approx", "round-robin", "random", "least-load", "session")


@dataclass(slots=True)
class Candidate:
    slot: int
    overlap_blocks: int  # leading blocks of the request this worker holds
    active_prefill_blocks: float  # uncached prompt blocks of its requests that have no token yet
    active_decode_blocks: float  # blocks of its requests that are generating
    in_flight: int  # requests the router has on it
    num_waiting: int  # the worker's own queue, from its last stats


def kv_costs(
    loads: list[tuple[int, float, float]], request_blocks: int, prefill_weight: float
) -> list[float]:
    """Dynamo's cost of sending a request of `request_blocks` to each worker, given per worker (blocks
    of the request it holds, its active prefill blocks, its active decode blocks). One call per
    decision: the router's hot path at fleet scale."""
    return [prefill_weight * (e if (e := p + request_blocks - o) > 0 else 0.0) + d for o, p, d in loads]


def kv_cost(c: Candidate, request_blocks: int, prefill_weight: float) -> float:
    load = (c.overlap_blocks, c.active_prefill_blocks, c.active_decode_blocks)
    return kv_costs([load], request_blocks, prefill_weight)[0]


class Picker:
    """Stateful choices (round-robin's turn, the random source)."""

    def __init__(self, policy: str, temperature: float = 0.0, prefill_weight: float = 1.0, seed: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; available: {', '.join(POLICIES)}")
        if temperature < 0:
            raise ValueError("router temperature must be >= 0")
        self.policy, self.temperature, self.prefill_weight = policy, temperature, prefill_weight
        self.rng = random.Random(seed)
        self._turn = 0

    def pick(self, cands: list[Candidate], request_blocks: int, session_key: str | None = None) -> Candidate:
        if not cands:
            raise ValueError("no worker to pick from")
        p = self.policy
        if p in ("kv", "kv-approx"):
            loads = [(c.overlap_blocks, c.active_prefill_blocks, c.active_decode_blocks) for c in cands]
            costs = kv_costs(loads, request_blocks, self.prefill_weight)
            slot = self.pick_by_cost([c.slot for c in cands], costs, [c.in_flight for c in cands])
            return next(c for c in cands if c.slot == slot)
        if p == "round-robin":
            self._turn += 1
            return sorted(cands, key=lambda c: c.slot)[self._turn % len(cands)]
        if p == "random":
            return self.rng.choice(cands)
        if p == "least-load":
            return self._lowest(cands, [c.in_flight + c.num_waiting for c in cands])
        # session: rendezvous hashing, so a session stays put while its worker lives and only the
        # sessions of a worker that leaves move.
        if session_key is None:
            return self._lowest(cands, [c.in_flight + c.num_waiting for c in cands])
        return max(cands, key=lambda c: _score(session_key, c.slot))

    def _lowest(self, cands: list[Candidate], costs: list[float]) -> Candidate:
        slot = self.pick_by_cost([c.slot for c in cands], costs, [c.in_flight for c in cands])
        return next(c for c in cands if c.slot == slot)

    def pick_by_cost(self, slots: list[int], costs: list[float], in_flight: list[int]) -> int:
        """The slot of the lowest cost (ties: fewer requests in flight, then chance), or with a
        temperature a softmax draw. Columns, not objects: the router's hot path at fleet scale."""
        if self.temperature > 0 and len(slots) > 1:
            # Softmax over costs normalised by their spread: the temperature means the same at any load.
            lo, hi = min(costs), max(costs)
            span = (hi - lo) or 1.0
            weights = [math.exp(-(c - lo) / span / self.temperature) for c in costs]
            return self.rng.choices(slots, weights)[0]
        best = min(costs)
        if costs.count(best) == 1:  # the usual case, without building the list of ties
            return slots[costs.index(best)]
        tied = [i for i, cost in enumerate(costs) if cost == best]
        fewest = min(in_flight[i] for i in tied)
        return slots[self.rng.choice([i for i in tied if in_flight[i] == fewest])]


def _score(key: str, slot: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\x00{slot}".encode(), digest_size=8).digest(), "big")
