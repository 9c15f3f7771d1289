"""Which worker holds which KV blocks, fed by the workers' KV events: the router's prefix index.

Blocks are named by chained hashes (engine/block_hash.py; published as their low 64 bits), so a
block's name stands for its whole prefix: a request's overlap with a worker is the number of leading
hashes of the request's chain that the worker holds. The index maps each hash to a bitmask of the
workers holding it, which keeps it to one dict entry per distinct block however many workers share
it, and makes a lookup one dict probe and one AND per block.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenmill.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVIndex:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # block hash -> bitmask of worker slots
        self.blocks_per_worker: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def apply(self, worker: int, events: Iterable[KVEvent]) -> None:
        bit = 1 << worker
        holders = self._holders
        count = self.blocks_per_worker.get(worker, 0)
        for ev in events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    mask = holders.get(h, 0)
                    if not mask & bit:
                        holders[h] = mask | bit
                        count += 1
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    mask = holders.get(h, 0)
                    if mask & bit:
                        count -= 1
                        if mask == bit:
                            del holders[h]
                        else:
                            holders[h] = mask & ~bit
            elif isinstance(ev, AllBlocksCleared):
                self.blocks_per_worker[worker] = count
                self.remove_worker(worker)
                count = 0
        if count:
            self.blocks_per_worker[worker] = count
        else:
            self.blocks_per_worker.pop(worker, None)

    def remove_worker(self, worker: int) -> None:
        """Forget every block of a worker (it died, restarted, or its event stream cannot be repaired)."""
        if not self.blocks_per_worker.pop(worker, 0):
            return
        bit = 1 << worker
        holders = self._holders
        for h in [h for h, m in holders.items() if m & bit]:
            m = holders[h] & ~bit
            if m:
                holders[h] = m
            else:
                del holders[h]

    def overlaps(self, hashes: Iterable[int], workers: int) -> dict[int, int]:
        """For each worker slot in the bitmask `workers`, how many leading blocks of the chain it holds
        (workers holding none are left out). `hashes` may be lazy: it is read only as far as some
        worker still matches, so a prompt's unseen tail need not be hashed at all."""
        out: dict[int, int] = {}
        live = workers
        holders = self._holders
        matched = 0
        for h in hashes:
            now = live & holders.get(h, 0)
            gone = live & ~now
            while gone:  # workers whose run of matching blocks ends here
                low = gone & -gone
                if matched:
                    out[low.bit_length() - 1] = matched
                gone ^= low
            live = now
            if not live:
                return out
            matched += 1
        while live:
            low = live & -live
            out[low.bit_length() - 1] = matched
            live ^= low
        return out
