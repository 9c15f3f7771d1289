"""What the scheduler's half of the offload connector tells the worker's half each step: plain data
(block ids, host slots, keys), carried in SchedulerOutput.kv_connector_metadata.

The worker carries the lists out in this order, which is what makes one step's moves safe together:
spills read host slots that saves of this step may then refill; saves read pool blocks before loads
(or the forward pass) overwrite them; host loads read slots the scheduler pinned for this step, so no
save of this step touches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OffloadOps:
    # (host slot, key): copy the slot to the file tiers (the slot is about to be reused).
    spills: list[tuple[int, bytes]] = field(default_factory=list)
    # (pool block id, host slot, key): an evicted pool block into host memory.
    saves: list[tuple[int, int, bytes]] = field(default_factory=list)
    # (pool block id, key): an evicted pool block straight to the file tiers (no host tier).
    file_saves: list[tuple[int, bytes]] = field(default_factory=list)
    # (host slot, pool block id): loaded before this step's forward pass.
    host_loads: list[tuple[int, int]] = field(default_factory=list)
    # request id -> [(key, pool block id)] read from the file tiers in the background; the worker
    # reports each request once, with how many leading blocks arrived intact.
    file_loads: dict[str, list[tuple[bytes, int]]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.spills or self.saves or self.file_saves or self.host_loads or self.file_loads)
