"""The engine's view of the workers' LoRA slots: which adapter each holds, who uses it, what to load.

A waiting request on an adapter takes a slot when it is admitted: the adapter's own if resident, else a
free one, else the least recently used idle one (evicted). When every slot is busy with running requests
of other adapters the request waits, and requests behind it (on resident adapters or the base) go on:
one adapter that cannot get in does not hold the batch. A slot given a new adapter is loaded by the
workers at the start of the next step they run (SchedulerOutput.lora_loads).
"""

from __future__ import annotations

import itertools

from tokenmill.lora.request import LoRARequest


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.ids: list[int | None] = [None] * max_loras  # lora_int_id held by each slot
        self.names: list[str | None] = [None] * max_loras  # and its name
        self.users = [0] * max_loras  # requests admitted on each slot, not finished or preempted
        self.last_used = [0] * max_loras  # a tick of the slot's last acquire: LRU among idle slots
        self._tick = itertools.count(1)
        self.pending: dict[int, tuple[int, str]] = {}  # slot -> (lora id, path) for the next step
        self.num_loads = 0

    def acquire(self, lora: LoRARequest) -> int | None:
        """A slot holding `lora` for one more request, or None if every slot is busy."""
        tick = next(self._tick)
        if lora.lora_int_id in self.ids:
            slot = self.ids.index(lora.lora_int_id)
        else:
            idle = [s for s, n in enumerate(self.users) if n == 0]
            if not idle:
                return None
            slot = min(idle, key=lambda s: (self.ids[s] is not None, self.last_used[s]))
            self.ids[slot], self.names[slot] = lora.lora_int_id, lora.lora_name
            self.pending[slot] = (lora.lora_int_id, lora.lora_path)
            self.num_loads += 1
        self.users[slot] += 1
        self.last_used[slot] = tick
        return slot

    def release(self, slot: int) -> None:
        self.users[slot] -= 1
        assert self.users[slot] >= 0, f"LoRA slot {slot} released more often than acquired"

    def take_loads(self) -> dict[int, tuple[int, str]]:
        loads, self.pending = self.pending, {}
        return loads

    def failed(self, slot: int) -> None:
        """The workers could not load the slot's adapter: it holds nothing (a later request reads it
        again)."""
        self.ids[slot] = self.names[slot] = None

    @property
    def resident(self) -> list[int]:
        return [i for i in self.ids if i is not None]

    @property
    def resident_names(self) -> list[str]:
        return [n for n in self.names if n is not None]

    @property
    def running_names(self) -> list[str]:
        return [n for n, users in zip(self.names, self.users, strict=True) if n is not None and users]

    @property
    def free(self) -> int:
        """Slots no admitted request holds: an adapter not resident can take one at once."""
        return sum(1 for n in self.users if n == 0)
