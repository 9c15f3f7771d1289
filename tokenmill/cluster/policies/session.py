"""`session`: requests of one session (the body's `user`, or an x-session-id header) to one worker, by
rendezvous hashing, so a session stays put while its worker lives and only the sessions of a worker
that leaves move. Requests without a session go to the least loaded worker."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from tokenmill.cluster.policies.base import Candidates
from tokenmill.cluster.policies.least_load import LeastLoadPolicy

if TYPE_CHECKING:
    from tokenmill.cluster.router.worker import Worker
    from tokenmill.engine.protocol import EngineRequest


def rendezvous_score(key: str, slot: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\x00{slot}".encode(), digest_size=8).digest(), "big")


class SessionPolicy(LeastLoadPolicy):
    name = "session"

    def choose(
        self, cands: Candidates, overlaps: dict[int, int], blocks: int, req: EngineRequest | None
    ) -> Worker:
        key = req.routing_key if req is not None else None
        if key is None:
            return super().choose(cands, overlaps, blocks, req)
        return max(cands.workers, key=lambda w: rendezvous_score(key, w.slot))
