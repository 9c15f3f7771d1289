"""Disaggregated prefill and decode: the transfer engine, two engines handing a prompt's blocks over,
and a real fleet (one prefill and one decode worker process) behind the router.

The reference is the same model computing the whole request on one engine: greedy float32 tokens must
be identical whether the decode worker read the blocks through shared memory, over TCP, or had to
recompute them because the prefill worker was gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from pathlib import Path

import pytest
import torch

from tokenmill.cluster.disagg import DisaggSettings, parse_disaggregate
from tokenmill.cluster.fleet import LaunchingRouter, with_role, worker_config
from tokenmill.cluster.router import RouterSettings
from tokenmill.config import CacheConfig, EngineConfig, KVTransferConfig
from tokenmill.engine.client import LocalEngineLauncher
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.protocol import EngineCoreOutput, EngineRequest
from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.kv_transfer import pd_worker
from tokenmill.worker.kv_transfer.ops import RemoteLoad, TransferOps, make_grant
from tokenmill.worker.kv_transfer.pd_worker import PDWorker
from tokenmill.worker.kv_transfer.transfer_engine import (
    TransferClient,
    TransferError,
    TransferServer,
    shared_kv_tensor,
)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TEXT = (
    "Disaggregated serving runs the prompt on one worker and the answer on another. The prefill "
    "worker computes the keys and values of every prompt token; the decode worker reads them. "
) * 6


# -- the transfer engine ---------------------------------------------------------------------------
def test_parse_disaggregate() -> None:
    assert parse_disaggregate("1P1D") == (1, 1)
    assert parse_disaggregate(" 2p4d ") == (2, 4)
    assert DisaggSettings(1, 2).roles() == ["prefill", "decode", "decode"]
    for bad in ("1P", "0P1D", "PD", "1D1P"):
        with pytest.raises(ValueError, match="NPMD"):
            parse_disaggregate(bad)
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig(kv_role="middle")


@pytest.mark.parametrize("use_shm", [True, False])
@pytest.mark.parametrize("layout", ["", "int8"])  # bfloat16 values, or 8-bit rows (bytes)
def test_blocks_cross_bit_exact_by_shared_memory_and_by_tcp(use_shm: bool, layout: str) -> None:
    shape = (3, 2, 10, 4, 2, 8)  # layers, k/v, blocks, tokens, heads, dim
    dtype = torch.uint8 if layout else torch.bfloat16
    src, path = shared_kv_tensor(shape, dtype)
    src.copy_(torch.randint(0, 256, shape).to(dtype) if layout else torch.randn(shape).to(dtype))
    dst = torch.zeros(shape, dtype=dtype)
    server = TransferServer(src, path, layout=layout)
    client = TransferClient(dst, timeout_s=5, use_shm=use_shm, layout=layout)
    key, now = bytes.fromhex(server.describe()["grant_key"]), time.time()
    grant = ("req-1", [7, 2, 5, 99], make_grant(key, "req-1", [7, 2, 5, 99], now, now + 60))
    try:
        client.read(server.endpoint, [7, 2, 5], [0, 1, 9], grant)
        assert torch.equal(dst[:, :, 0], src[:, :, 7]) and torch.equal(dst[:, :, 9], src[:, :, 5])
        assert torch.equal(dst[:, :, 1], src[:, :, 2]) and not dst[:, :, 3].any()
        by = (client.blocks_by_shm, client.blocks_by_tcp)
        assert by == ((3, 0) if use_shm and path is not None else (0, 3))
        with pytest.raises(TransferError, match="out of range"):
            TransferClient(dst, 5, use_shm=False, layout=layout).read(server.endpoint, [99], [0], grant)
        client.done(server.endpoint, "req-1", grant)
        assert server.take_done() == ["req-1"] and server.take_done() == []
        # Once the reader is done the grant is void, by either path: a second read of the same answer
        # (a proxy that passed it twice) fails, and its reader recomputes.
        with pytest.raises(TransferError, match="grant"):
            client.read(server.endpoint, [7], [0], grant)
        with pytest.raises(TransferError, match="no grant"):  # blocks it never granted
            client.read(server.endpoint, [3], [0], grant)
    finally:
        client.close()
        server.close()
    if path is not None:  # the region was never a file in /dev/shm; its descriptor is closed now
        assert not path.exists() and not list(Path("/dev/shm").glob(f"tokenmill-kv-{os.getpid()}-*"))


def test_a_repeated_done_is_answered_but_counted_once() -> None:
    """A reader that used the same answer twice tells the prefill worker it is done after each read
    (the second read fails: the grant is void). The second `done` must not count again: under tensor
    parallelism the engine joins its ranks' `done`s, and a rank's repeat would stand in for another
    rank still reading, freeing blocks under it."""
    shape = (1, 2, 4, 4, 1, 8)
    server = TransferServer(torch.zeros(shape, dtype=torch.bfloat16), None)
    client = TransferClient(torch.zeros(shape, dtype=torch.bfloat16), timeout_s=5, use_shm=False)
    key, now = bytes.fromhex(server.describe()["grant_key"]), time.time()
    grant = ("req-1", [1, 2], make_grant(key, "req-1", [1, 2], now, now + 60))
    try:
        client.done(server.endpoint, "req-1", grant)
        client.done(server.endpoint, "req-1", grant)  # answered (no error for the reader)...
        assert server.take_done() == ["req-1"]  # ...but counted once
        client.done(server.endpoint, "req-1", grant)
        assert server.take_done() == []
        with pytest.raises(TransferError, match="no grant"):  # a forged one is still refused
            client.done(server.endpoint, "req-1", ("req-1", [1, 2], "0.0.0.0.x"))
    finally:
        client.close()
        server.close()


def test_a_restarted_peer_on_the_same_port_is_mapped_anew() -> None:
    """A reader keeps a peer's shared-memory region mapped. A prefill worker restarted on the same port
    has a new region: the reader must not copy from the old mapping (the dead process's blocks) under
    the new server's valid grant."""
    shape = (1, 2, 4, 4, 1, 8)
    first, path1 = shared_kv_tensor(shape, torch.bfloat16)
    first.fill_(1)
    dst = torch.zeros(shape, dtype=torch.bfloat16)
    client = TransferClient(dst, timeout_s=5)
    server = TransferServer(first, path1)
    port = int(server.endpoint.rsplit(":", 1)[1])
    if path1 is None:
        server.close()
        client.close()
        pytest.skip("no /dev/shm here: readers copy over TCP, with no mapping to go stale")

    def grant(srv: TransferServer, rid: str) -> tuple[str, list[int], str]:
        key, now = bytes.fromhex(srv.describe()["grant_key"]), time.time()
        return (rid, [0], make_grant(key, rid, [0], now, now + 60))

    try:
        client.read(server.endpoint, [0], [0], grant(server, "a"))
        assert (dst[:, :, 0] == 1).all() and client.blocks_by_shm == 1
        server.close()
        second, path2 = shared_kv_tensor(shape, torch.bfloat16)
        second.fill_(2)
        server = TransferServer(second, path2, port=port)
        with pytest.raises(TransferError, match="restarted"):
            client.read(server.endpoint, [0], [1], grant(server, "b"))
        client.read(server.endpoint, [0], [2], grant(server, "c"))  # mapped anew
        assert (dst[:, :, 2] == 2).all()
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("use_shm", [True, False])
def test_blocks_of_another_layout_are_refused(use_shm: bool) -> None:
    """int8 and fp8 blocks have the same shape and dtype: only the layout each side declares tells them
    apart, and a mismatch is an error (the decode worker recomputes), never blocks read as garbage."""
    shape = (1, 2, 4, 4, 1, 12)
    src, path = shared_kv_tensor(shape, torch.uint8)
    server = TransferServer(src, path, layout="fp8")
    dst = torch.zeros(shape, dtype=torch.uint8)
    try:
        with pytest.raises(TransferError, match="another layout"):
            TransferClient(dst, 5, use_shm=use_shm, layout="int8").read(server.endpoint, [1], [0])
        with pytest.raises(TransferError, match="another layout"):  # a bfloat16 cache of other rows
            TransferClient(torch.zeros(1, 2, 4, 4, 1, 8, dtype=torch.bfloat16), 5, use_shm).read(
                server.endpoint, [1], [0]
            )
        assert not dst.any()
    finally:
        server.close()


def test_a_peer_that_does_not_answer_is_an_error_not_a_hang() -> None:
    kv = torch.zeros((1, 2, 2, 4, 1, 8))
    server = TransferServer(kv, None)
    endpoint = server.endpoint
    server.close()
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="did not answer"):
        TransferClient(kv, timeout_s=0.3).read(endpoint, [0], [1])
    assert time.monotonic() - t0 < 5


def test_a_dead_peer_holds_up_neither_live_peers_nor_its_own_later_loads() -> None:
    """A decode worker's loads from a killed prefill worker queued one after another on one thread, each
    waiting out a read and a `done` timeout, and held every later load, from live peers too (issue 51's
    reliability run: 8 of 139 1P1D requests hung, one answered after 104 s). Loads from a live peer now
    finish while the dead one's first read still waits; after that read times out, the dead peer's
    other loads fail at once (recomputed) and nobody waits to tell it it is done."""
    shape = (2, 2, 16, 4, 1, 8)
    src, path = shared_kv_tensor(shape, torch.bfloat16)
    src.copy_(torch.randn(shape))
    live = TransferServer(src, path)
    gone = TransferServer(torch.zeros(shape, dtype=torch.bfloat16), None)
    dead = gone.endpoint
    gone.close()  # a killed prefill worker: its port is closed
    dst = torch.zeros(shape, dtype=torch.bfloat16)
    pd = PDWorker(dst, serve=False, shm_path=None, timeout_s=2.0)
    try:
        now = time.time()
        key = bytes.fromhex(live.describe()["grant_key"])
        ops = TransferOps()
        for i in range(3):
            ops.loads[f"dead-{i}"] = RemoteLoad(dead, f"p{i}", [1], [i], (f"p{i}", [1], "x"))
        grant = make_grant(key, "q", [2], now, now + 600)
        ops.loads["live"] = RemoteLoad(live.endpoint, "q", [2], [5], ("q", [2], grant))
        pd.apply(ops)
        order: list[tuple[str, int]] = []
        deadline = time.monotonic() + 60  # a guard against a hang, not a timing claim
        while len(order) < 4 and time.monotonic() < deadline:
            order += sorted(pd.take_finished_loads(wait_s=0.5).items())
        assert order[0] == ("live", 1), order  # first: the dead peer's first read takes its full timeout
        assert sorted(order[1:]) == [("dead-0", 0), ("dead-1", 0), ("dead-2", 0)], order
        assert torch.equal(dst[:, :, 5], src[:, :, 2])
        counters = pd.counters()
        assert counters["remote_read_failures"] == 1 and counters["remote_reads_skipped"] == 2, counters
    finally:
        pd.close()
        live.close()


def test_loads_naming_more_peers_than_the_lanes_fail_at_once(monkeypatch) -> None:
    """Each peer gets a reader thread; a client naming many peers must not start a thread each."""
    monkeypatch.setattr(pd_worker, "MAX_LANES", 1)
    shape = (1, 2, 4, 4, 1, 8)
    src, path = shared_kv_tensor(shape, torch.bfloat16)
    src.fill_(3)
    live = TransferServer(src, path)
    pd = PDWorker(torch.zeros(shape, dtype=torch.bfloat16), serve=False, shm_path=None, timeout_s=2.0)
    try:
        now = time.time()
        grant = make_grant(bytes.fromhex(live.describe()["grant_key"]), "q", [1], now, now + 600)
        ops = TransferOps()
        ops.loads["first"] = RemoteLoad(live.endpoint, "q", [1], [0], ("q", [1], grant))
        ops.loads["second"] = RemoteLoad("tcp://127.0.0.1:9", "r", [1], [1], ("r", [1], "x"))
        pd.apply(ops)
        done: dict[str, int] = {}
        deadline = time.monotonic() + 30  # a guard against a hang, not a timing claim
        while len(done) < 2 and time.monotonic() < deadline:
            done.update(pd.take_finished_loads(wait_s=0.5))
        assert done == {"first": 1, "second": 0} and pd.counters()["remote_reads_skipped"] == 1
        assert len(pd._lanes) <= 1
    finally:
        pd.close()
        live.close()


# -- two engines in this process ---------------------------------------------------------------------
def _engine(role: str | None, shm: bool = True, **cache) -> EngineCore:
    return EngineCore(
        EngineConfig(
            dtype="float32", max_model_len=512, cache=CacheConfig(num_blocks=64, **cache),
            kv_transfer=KVTransferConfig(kv_role=role, kv_transfer_shm=shm, kv_transfer_timeout_s=2.0),
        )
    )  # fmt: skip


def _run(engine: EngineCore, req: EngineRequest, timeout: float = 60) -> EngineCoreOutput:
    engine.add_request(req)
    tokens: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, "the request did not finish"
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            if out.finish_reason is not None:
                return dataclasses.replace(out, new_token_ids=tokens)


@pytest.fixture(scope="module")
def engines():
    ref, pre = _engine(None), _engine("prefill")
    try:
        yield ref, pre
    finally:
        ref.shutdown()
        pre.shutdown()


@pytest.mark.parametrize("shm", [True, False])
def test_decode_worker_continues_from_the_prefill_workers_blocks(engines, shm: bool) -> None:
    ref, pre = engines
    dec = _engine("decode", shm=shm)
    try:
        ids = ref.tokenizer.encode(TEXT)
        want = _run(ref, EngineRequest(f"ref-{shm}", ids, GREEDY)).new_token_ids
        one = dataclasses.replace(GREEDY, max_tokens=1)
        p_out = _run(pre, EngineRequest(f"p-{shm}", ids, one, kv_transfer={"do_remote_decode": True}))
        params = p_out.kv_transfer
        assert params is not None and len(params["block_ids"]) == len(ids) // 16
        assert pre.scheduler.held  # kept for the reader
        got = _run(dec, EngineRequest(f"d-{shm}", ids, GREEDY, kv_transfer={"remote": params}))
        assert got.new_token_ids == want
        assert got.num_cached_tokens == (len(ids) - 1) // 16 * 16  # the prompt came over, not computed
        kv = dec.stats().kv_connector
        assert kv["remote_loaded_blocks"] == (len(ids) - 1) // 16
        assert kv["blocks_read_shm" if shm else "blocks_read_tcp"] == kv["remote_loaded_blocks"]
        deadline = time.monotonic() + 10
        while pre.scheduler.held:  # the reader said it is done: the prefill worker lets go
            assert time.monotonic() < deadline
            pre.step()
        assert pre.kv.pool.num_free == pre.kv.pool.num_blocks
    finally:
        dec.shutdown()


def test_a_lost_prefill_worker_costs_recomputation_not_the_request(engines) -> None:
    ref, _ = engines
    dec = _engine("decode")
    gone = _engine("prefill")
    try:
        ids = ref.tokenizer.encode(TEXT + " And once more.")
        want = _run(ref, EngineRequest("ref-lost", ids, GREEDY)).new_token_ids
        one = dataclasses.replace(GREEDY, max_tokens=1)
        params = _run(
            gone, EngineRequest("p-lost", ids, one, kv_transfer={"do_remote_decode": True})
        ).kv_transfer
        gone.shutdown()
        got = _run(dec, EngineRequest("d-lost", ids, GREEDY, kv_transfer={"remote": params}))
        assert got.new_token_ids == want
        assert dec.stats().kv_connector["remote_read_failures"] == 1
        assert dec.kv.pool.num_free == dec.kv.pool.num_blocks
    finally:
        dec.shutdown()


def test_an_answer_passed_with_another_prompt_is_recomputed_not_decoded_on(engines) -> None:
    """A prefill worker's answer names its prompt (the chained hash of its last block): a decode
    worker given it with another prompt reads nothing and computes its own prompt."""
    ref, pre = engines
    dec = _engine("decode")
    try:
        ids = ref.tokenizer.encode(TEXT)
        other = ref.tokenizer.encode(TEXT.replace("worker", "machine"))
        want = _run(ref, EngineRequest("ref-other", other, GREEDY)).new_token_ids
        one = dataclasses.replace(GREEDY, max_tokens=1)
        params = _run(
            pre, EngineRequest("p-other", ids, one, kv_transfer={"do_remote_decode": True})
        ).kv_transfer
        got = _run(dec, EngineRequest("d-other", other, GREEDY, kv_transfer={"remote": params}))
        assert got.new_token_ids == want
        kv = dec.stats().kv_connector
        assert kv["remote_load_mismatches"] == 1 and kv["remote_load_blocks"] == 0
        deadline = time.monotonic() + 10
        while pre.scheduler.held:  # told it is not needed: the prefill worker lets go at once
            assert time.monotonic() < deadline
            pre.step()
    finally:
        dec.shutdown()


def test_held_blocks_are_freed_when_nobody_comes() -> None:
    pre = EngineCore(
        EngineConfig(dtype="float32", max_model_len=512, cache=CacheConfig(num_blocks=64),
                     kv_transfer=KVTransferConfig(kv_role="prefill", kv_hold_timeout_s=0.2))
    )  # fmt: skip
    try:
        ids = pre.tokenizer.encode(TEXT)
        one = dataclasses.replace(GREEDY, max_tokens=1)
        _run(pre, EngineRequest("p", ids, one, kv_transfer={"do_remote_decode": True}))
        assert pre.kv.pool.num_free < pre.kv.pool.num_blocks
        time.sleep(0.3)
        pre.step()
        assert not pre.scheduler.held and pre.kv.pool.num_free == pre.kv.pool.num_blocks
        assert pre.stats().kv_connector["hold_timeouts"] == 1
    finally:
        pre.shutdown()


# -- a real fleet: one prefill and one decode worker process behind the router ---------------------------
@pytest.mark.slow
def test_a_1p1d_fleet_serves_long_prompts_disaggregated_and_short_ones_locally() -> None:
    config = EngineConfig(dtype="float32", max_model_len=512, cache=CacheConfig(kv_cache_memory_gb=0.05))
    settings = RouterSettings("kv", disagg=DisaggSettings(1, 1, min_prefill_tokens=64))

    async def main() -> None:
        roles = settings.disagg.roles()  # type: ignore[union-attr]
        launchers = [LocalEngineLauncher(with_role(worker_config(config, i, 2), roles[i])) for i in range(2)]
        router = LaunchingRouter(launchers, [], settings)
        llm = await AsyncLLM.start(config, client=router)
        ref = EngineCore(config)
        try:
            long_ids = llm.tokenizer.encode(TEXT)
            short_ids = llm.tokenizer.encode("Hello there, how are you?")
            for rid, ids in (("long", long_ids), ("short", short_ids), ("long-2", long_ids[5:])):
                last = None
                async for ro in llm.generate(rid, ids, GREEDY):
                    last = ro
                assert last is not None and last.finished
                want = _run(ref, EngineRequest(f"ref-{rid}", ids, GREEDY)).new_token_ids
                assert last.outputs[0].token_ids == want, rid
            st = router.stats_router
            assert st.disaggregated == 2 and st.disagg_fallbacks == 0
            decode = next(w for w in router.workers if w.info.get("kv_role") == "decode")
            assert router.placements["long"][0] == router.placements["short"][0] == decode.slot
            stats = router.worker_stats()
            assert stats[decode.name].kv_connector["remote_loaded_blocks"] > 0
        finally:
            ref.shutdown()
            await llm.shutdown()

    asyncio.run(main())
