"""The router's LoRA affinity, with stand-in worker clients (no processes): a request on an adapter goes
where the adapter is resident, else where a slot is free, never to a worker whose slots are all busy
while another has room; its prefix score counts only blocks cached under the same adapter."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from test_router_retries import fleet, request

from tokenmill.engine.block_hash import extend_block_hashes
from tokenmill.engine.kv_events import external_hash, stored
from tokenmill.engine.protocol import EngineStats
from tokenmill.lora.request import LoRARequest, kv_salt

SQL = LoRARequest("sql", 1, "/adapters/sql", "1-1")
LEGAL = LoRARequest("legal", 2, "/adapters/legal", "2-2")


def stats(resident: list[str], free: int, slots: int = 2) -> EngineStats:
    return EngineStats(
        0, 0, 0.0, 100, 0, 0, 0, 0, 0, lora_slots=slots, lora_resident=resident, lora_free_slots=free
    )


def test_requests_go_where_their_adapter_is_or_can_be() -> None:
    async def main() -> None:
        for lora, where in ((SQL, 0), (LEGAL, 1), (None, None)):
            router, clients = fleet([0.0, 0.0, 0.0])
            clients[0].stats = stats(["sql", "chat"], free=0)  # holds sql; both slots busy
            clients[1].stats = stats(["chat"], free=1)  # room for one more
            clients[2].stats = stats(["chat", "math"], free=0)  # no room
            router.add_request(replace(request("r"), lora=lora))
            sent = [i for i, c in enumerate(clients) if c.sent]
            if where is not None:  # resident beats a free slot, a free slot beats a full worker
                assert sent == [where], lora
        # The affinity is a cost, not a rule: a worker holding the adapter but far busier loses.
        router, clients = fleet([0.0, 0.0])
        clients[0].stats = stats(["sql"], free=1)
        clients[1].stats = stats([], free=2)
        for i in range(6):
            router.add_request(replace(request(f"s{i}"), lora=SQL))
        assert clients[0].sent and clients[1].sent

    asyncio.run(main())


def test_prefix_scores_count_only_blocks_of_the_same_adapter() -> None:
    """Blocks a worker published under the base model are no hit for the adapter's request, and blocks
    published under the adapter are."""

    async def main() -> None:
        router, clients = fleet([0.0, 0.0])
        for c in clients:
            c.stats = stats([], free=2)
        req = replace(request("r"), lora=SQL)
        tokens = req.prompt_token_ids
        base_hashes: list[bytes] = []
        sql_hashes: list[bytes] = []
        extend_block_hashes(base_hashes, tokens, 16, None)
        extend_block_hashes(sql_hashes, tokens, 16, kv_salt(None, SQL))
        assert base_hashes[0] != sql_hashes[0]
        for worker, hashes in ((0, base_hashes), (1, sql_hashes)):  # the base's on 0, the adapter's on 1
            names = [external_hash(h) for h in hashes]
            router.prefix.events.apply(worker, [stored(names, None, tokens[: 16 * len(names)], 16)])
        router.add_request(req)
        assert clients[1].sent == ["r"]

    asyncio.run(main())
