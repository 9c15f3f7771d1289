"""Per-request block tables over the block pool, with prefix reuse through block hashes; optionally
the KV events (engine/kv_events.py) that tell a router which blocks this engine holds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.engine.block_hash import extend_block_hashes
from tokenmill.engine.block_pool import BlockPool, KVBlock
from tokenmill.engine.kv_events import MEDIUM_DEVICE, BlockRemoved, KVEvent, external_hash, stored
from tokenmill.engine.request import Request

if TYPE_CHECKING:
    from tokenmill.engine.kv_connector import KVConnectorScheduler


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        kv_events: bool = False,
        window: int = 0,
    ) -> None:
        """`window`: the sliding window of a model whose every layer has one (0: none). A request's
        blocks that fall wholly before its window are then returned to the pool as it moves on."""
        # Events only mean something with prefix caching: without it no block is ever named.
        self.events: list[KVEvent] | None = [] if kv_events and enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self._removed if self.events is not None else None)
        self.connector: KVConnectorScheduler | None = None
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.window = window
        # How many of a request's first blocks went back to the pool behind its window. They stay in its
        # list (and in the workers' block tables, which read them only under a mask that hides them),
        # so that positions and block indices keep lining up.
        self.released: dict[str, int] = {}
        # Counters in tokens, as vLLM reports them: hit rate = hits / queries. The scheduler counts a
        # request once, when it is admitted (not at every lookup while it waits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of the request in full blocks, and its length in tokens.

        At least one token is always left to compute: its logits give the next token.
        """
        if not self.enable_prefix_caching:
            return [], 0
        extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, req.hash_salt)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in req.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def attach_connector(self, connector: KVConnectorScheduler) -> None:
        """Blocks the pool evicts are offered to the connector before their content is overwritten."""
        self.connector = connector
        self.pool.on_evicted = connector.on_evicted

    def allocate_for_load(self, req: Request, computed: list[KVBlock], n: int) -> list[KVBlock] | None:
        """Take the request's pool hits and `n` fresh blocks after them for a background load, without
        naming the fresh ones (their content arrives later); None (and no change) if blocks are short."""
        if n + sum(1 for b in computed if b.ref_cnt == 0) > self.pool.num_free:
            return None
        blocks = self.req_blocks.setdefault(req.request_id, [])
        assert not blocks, "a background load is for a request that holds no blocks"
        self.pool.touch(computed)
        fresh = self.pool.allocate(n)
        blocks.extend(computed)
        blocks.extend(fresh)
        return fresh

    def cache_loaded(self, req: Request, first: int, n: int) -> None:
        """Name the request's blocks first..first+n-1, whose content a background load brought."""
        blocks = self.req_blocks.get(req.request_id, [])
        named = [
            i
            for i in range(first, first + n)
            if blocks[i].block_hash is None and self.pool.cache(blocks[i], req.block_hashes[i])
        ]
        if named and self.events is not None:
            self._stored(req, blocks, named)

    def can_allocate(self, req: Request, num_new_tokens: int, computed: list[KVBlock] | None = None) -> bool:
        return self._blocks_to_take(req, num_new_tokens, computed or []) <= self.pool.num_free

    def _blocks_to_take(self, req: Request, num_new_tokens: int, computed: list[KVBlock]) -> int:
        have = self.req_blocks.get(req.request_id, [])
        total = len(computed) * self.block_size if computed else req.num_computed_tokens
        need = self.blocks_needed(total + num_new_tokens) - len(have) - len(computed)
        # Reused blocks that sit in the free queue stop being free when taken.
        return max(need, 0) + sum(1 for b in computed if b.ref_cnt == 0)

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed: list[KVBlock] | None = None
    ) -> bool:
        """Give the request room for num_new_tokens more tokens; False (and no change) if blocks are short.

        `computed` are prefix-cache hits found for a request that has none yet.
        """
        computed = computed or []
        if self._blocks_to_take(req, num_new_tokens, computed) > self.pool.num_free:
            return False
        blocks = self.req_blocks.setdefault(req.request_id, [])
        if computed:
            self.pool.touch(computed)
            blocks.extend(computed)
            start = len(computed) * self.block_size
        else:
            start = req.num_computed_tokens
        end = start + num_new_tokens
        extra = self.blocks_needed(end) - len(blocks)
        if extra > 0:
            blocks.extend(self.pool.allocate(extra))
        if self.enable_prefix_caching:
            # Name every block that is full once this step runs: other requests can reuse it at once
            # (their attention reads it after this step's keys and values are written).
            # Only real tokens name a block: draft tokens past num_tokens may yet be rejected.
            known = min(end, req.num_tokens)
            extend_block_hashes(
                req.block_hashes, req.all_token_ids, self.block_size, req.hash_salt, upto=known
            )
            # Blocks that were already full before `start` were named when their step was scheduled.
            named = [
                i
                for i in range(start // self.block_size, known // self.block_size)
                if blocks[i].block_hash is None and self.pool.cache(blocks[i], req.block_hashes[i])
            ]
            if named and self.events is not None:
                self._stored(req, blocks, named)
        if self.window and self.connector is None:
            self._release_behind_window(req.request_id, blocks, start)
        return True

    def _release_behind_window(self, rid: str, blocks: list[KVBlock], start: int) -> None:
        """Return the blocks no query of the request reads again: this step's first query sits at
        `start` and sees positions start - window + 1 on, and later ones only later positions. Each is
        computed, so it stays named for other requests' prefix hits. Not with a KV connector, which may
        hand a finished request's blocks on (offload, disaggregation)."""
        behind = max(0, start - self.window + 1) // self.block_size
        done = self.released.get(rid, 0)
        if behind > done:
            self.pool.free(reversed(blocks[done:behind]))
            self.released[rid] = behind

    def _stored(self, req: Request, blocks: list[KVBlock], named: list[int]) -> None:
        """BlockStored events for newly named blocks, one per run of consecutive blocks; each block
        keeps its own part (parent, tokens, extra keys) for the tier it may be evicted to."""
        bs, hashes, tokens = self.block_size, req.block_hashes, req.all_token_ids
        lora = (req.lora.lora_int_id, req.lora.lora_name) if req.lora is not None else None
        for i in named:
            parent = external_hash(hashes[i - 1]) if i else None
            extra = [req.cache_salt] if i == 0 and req.cache_salt is not None else None
            blocks[i].event_info = (parent, list(tokens[i * bs : (i + 1) * bs]), extra, lora)
        runs: list[list[int]] = []
        for i in named:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            salted = first == 0 and req.cache_salt is not None
            self.events.append(  # type: ignore[union-attr]
                stored(
                    block_hashes=[external_hash(hashes[i]) for i in run],
                    parent_block_hash=external_hash(hashes[first - 1]) if first else None,
                    token_ids=list(tokens[first * bs : (last + 1) * bs]),
                    block_size=bs,
                    extra_keys=[[req.cache_salt]] + [None] * (len(run) - 1) if salted else None,
                    lora=lora,
                )
            )

    def _removed(self, block_hash: bytes) -> None:
        events = self.events
        assert events is not None
        if events and isinstance(events[-1], BlockRemoved) and events[-1].medium == MEDIUM_DEVICE:
            events[-1].block_hashes.append(external_hash(block_hash))
        else:
            events.append(BlockRemoved([external_hash(block_hash)], MEDIUM_DEVICE))

    def take_events(self) -> list[KVEvent]:
        """The events since the last call (empty when events are off)."""
        if not self.events:
            return []
        # Emptied in place: a KV connector appends its own events (offload tiers) to this same list.
        out = list(self.events)
        self.events.clear()
        return out

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, [])
        released = self.released.pop(req.request_id, 0)
        # A block named at scheduling time whose step never ran (the request was preempted while
        # being scheduled) must not be found by later lookups: its content was never written.
        full_computed = req.num_computed_tokens // self.block_size
        for b in blocks[full_computed:]:
            if b.block_hash is not None and b.ref_cnt == 1:
                self.pool.uncache(b)
        # Tail blocks first: they hold the longest, least shared prefixes, so they go first.
        self.pool.free(reversed(blocks[released:]))

    @property
    def usage(self) -> float:
        return self.pool.usage()
