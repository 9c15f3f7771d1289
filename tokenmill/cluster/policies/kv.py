"""`kv`: Dynamo's cost. Sending a request of B prompt blocks to a worker that holds its first o blocks
costs prefill_weight x max(0, active prefill blocks + B - o) + active decode blocks; the lowest cost
wins, or with a temperature a softmax over the costs samples among near-equal workers.

`kv-approx` is the same cost over an index the router keeps from its own placements (for workers that
publish no KV events).

Fast path: a worker's cost for a request whose prompt it holds nothing of is prefill_weight x B plus its
`base` (prefill_weight x active prefill + active decode blocks), which the router keeps in a list as loads
change; so the best worker holding nothing is one `min` over that list, and only the few workers holding
part of the prompt are costed one by one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.cluster.policies.base import Candidates, RoutingPolicy

if TYPE_CHECKING:
    from tokenmill.cluster.router.worker import Worker
    from tokenmill.engine.protocol import EngineRequest

# LoRA affinity (llm-d's scorer in the KV cost's units): a worker whose slots hold the adapter costs
# nothing more; one with a free slot, a fifth of prefilling the prompt again (the adapter's read, and a
# slot taken from others); one with every slot busy, a whole prefill (the request would wait for a slot).
LORA_LOAD_COST, LORA_WAIT_COST = 0.2, 1.0


def kv_costs(
    loads: list[tuple[int, float, float]], request_blocks: int, prefill_weight: float
) -> list[float]:
    """The cost of sending a request of `request_blocks` to each worker, given per worker (blocks of the
    request it holds, its active prefill blocks, its active decode blocks): the reference the fast
    path is tested against. Written as the worker's base (prefill_weight x p + d) plus the prompt's
    uncached part, pw x (B - min(o, p + B)) = pw x max(0, p + B - o) - pw x p: the fast path adds the
    same floats, so both round alike and ties are ties in both."""
    pw, b = prefill_weight, request_blocks
    return [(pw * p + d) + pw * (b - (o if o < p + b else p + b)) for o, p, d in loads]


def lora_miss(w: Worker, name: str) -> float:
    stats = w.client.stats if w.client is not None else None
    if stats is None or not stats.lora_slots:  # not heard from yet (or an older worker): assume room
        return LORA_LOAD_COST
    if name in stats.lora_resident:
        return 0.0
    return LORA_LOAD_COST if stats.lora_free_slots else LORA_WAIT_COST


class KVPolicy(RoutingPolicy):
    name = "kv"
    uses_prefix = True

    def choose(
        self, cands: Candidates, overlaps: dict[int, int], blocks: int, req: EngineRequest | None
    ) -> Worker:
        pw = self.prefill_weight
        if self.temperature > 0 or (req is not None and req.lora is not None):
            return self._every_cost(cands, overlaps, blocks, req)
        bases = cands.bases
        low = min(bases)
        best = low + pw * blocks  # the cheapest worker that holds nothing (or a holder, at most this)
        by_slot = cands.by_slot
        held: list[tuple[float, Worker]] = []
        for slot, o in overlaps.items():
            w = by_slot[slot]
            top = w.prefill_blocks + blocks
            cost = w.base + pw * (blocks - (o if o < top else top))
            held.append((cost, w))
            if cost < best:
                best = cost
        tied = [w for cost, w in held if cost == best]
        if low + pw * blocks == best:  # workers holding nothing at the lowest base tie too
            if bases.count(low) == 1 and not tied:
                return cands.workers[bases.index(low)]
            tied += [
                w for w, b in zip(cands.workers, bases, strict=True) if b == low and w.slot not in overlaps
            ]
        if len(tied) == 1:
            return tied[0]
        return self.fewest_in_flight(tied)

    def _every_cost(
        self, cands: Candidates, overlaps: dict[int, int], blocks: int, req: EngineRequest | None
    ) -> Worker:
        ws = cands.workers
        loads = [(overlaps.get(w.slot, 0), w.prefill_blocks, w.decode_blocks) for w in ws]
        costs = kv_costs(loads, blocks, self.prefill_weight)
        if req is not None and req.lora is not None:
            weight = self.prefill_weight * blocks
            name = req.lora.lora_name
            costs = [c + weight * lora_miss(w, name) for c, w in zip(costs, ws, strict=True)]
        return self.lowest(ws, costs)


class KVApproxPolicy(KVPolicy):
    name = "kv-approx"
