"""KV connectors composed: offload tiers and prefill/decode transfer on one engine, under tensor and
pipeline parallelism.

The model is a tiny random Llama (2 layers, 2 key/value heads) saved as a Hugging Face directory, so
that tensor parallel 2 gives each rank one head and pipeline parallel 2 one layer. The reference is
the same model on one plain engine whose pool never evicts (itself checked against transformers):
greedy float32 tokens must be identical when a decode engine read a prompt's blocks from a prefill
engine, took them back from its own offload tiers, or both in one request. The bookkeeping (the
registry, the chain's block ranges, the ranks' reports joined) is tested by hand without a model.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from pathlib import Path

import pytest
import torch
from test_disaggregation import _run

from tokenmill.config import (
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    KVOffloadConfig,
    KVTransferConfig,
    ParallelConfig,
)
from tokenmill.engine.block_hash import extend_block_hashes
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.kv_connector import MultiConnector
from tokenmill.engine.kv_events import BlockRemoved, BlockStored, external_hash
from tokenmill.engine.offload_connector import OffloadConnector
from tokenmill.engine.pd_connector import PDConnector, validate_kv_transfer
from tokenmill.engine.protocol import EngineRequest
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.kv_connector import (
    KVConnectorWorker,
    MultiConnectorWorker,
    RankCombiner,
    connector_class,
    connector_names,
)
from tokenmill.worker.kv_offload.tiers import OffloadTiers
from tokenmill.worker.kv_offload.worker_connector import OffloadWorker
from tokenmill.worker.kv_transfer.pd_worker import PDWorker
from tokenmill.worker.step import KVConnectorOutput

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SHARED_KEY = "TOKENMILL_KV_SHARED_KEY"
_rng = random.Random(0)
# Six prompts of 6 full blocks and 4 tokens: a 24-block pool holds about three of them (with their
# outputs), so by the second round every prompt's blocks have left the pool for the offload tiers.
PROMPTS = [[_rng.randrange(3, 49000) for _ in range(100)] for _ in range(6)]
# The second round's prompts: the first round's and three more blocks (a conversation's next turn).
LONGER = [p + [_rng.randrange(3, 49000) for _ in range(48)] for p in PROMPTS]


# -- the registry and the bookkeeping, no model --------------------------------------------------------
def test_the_registry_picks_the_connectors_the_configuration_turns_on() -> None:
    def names(**kw) -> list[str]:
        return connector_names(
            EngineConfig(
                offload=KVOffloadConfig(kv_offload=kw.get("offload")),
                kv_transfer=KVTransferConfig(kv_role=kw.get("role")),
            )
        )

    assert names() == []
    assert names(offload="host=1MB") == ["offload"]
    assert names(role="decode") == ["pd"]
    # Chain order: the engine's own tiers first, another engine's pool for what they lack.
    assert names(offload="host=1MB", role="decode") == ["offload", "pd"]
    assert connector_class("offload", "scheduler") is OffloadConnector
    assert connector_class("offload", "worker") is OffloadWorker
    assert connector_class("pd", "scheduler") is PDConnector
    assert connector_class("pd", "worker") is PDWorker
    with pytest.raises(ValueError, match="unknown KV connector"):
        connector_class("lmcache", "worker")


def test_rank_combiner_joins_reports_only_when_every_rank_has_them() -> None:
    """Each rank moves its own heads' or layers' part of a block: a load is done when every rank has
    it (with the fewest good blocks any got), a reader's `done` when every rank heard it, a block is in
    a tier when every rank stored its part and gone as soon as one lost it."""
    ranks = RankCombiner(2)
    k = b"\x01" * 8
    a = KVConnectorOutput(
        loads_done={"offload": {"r": 3}},
        sends_done={"pd": ["x"]},
        events={"offload": [("stored", "disk", k)]},
        stats={"disk_hits": 3},
    )
    out = ranks.combine([a, KVConnectorOutput(stats={"disk_hits": 5})])
    assert out is not None and not out.loads_done and not out.sends_done and not out.events
    assert out.stats == {"disk_hits": 5}  # blocks, not parts: the largest over the ranks
    b = KVConnectorOutput(
        loads_done={"offload": {"r": 2}},
        sends_done={"pd": ["x"]},
        events={"offload": [("stored", "disk", k)]},
    )
    out = ranks.combine([KVConnectorOutput(), b])
    assert out is not None
    assert out.loads_done == {"offload": {"r": 2}} and out.sends_done == {"pd": ["x"]}
    assert out.events == {"offload": [("stored", "disk", k)]}
    gone = KVConnectorOutput(events={"offload": [("removed", "disk", k)]})
    out = ranks.combine([gone, KVConnectorOutput()])
    assert out is not None and out.events == {"offload": [("removed", "disk", k)]}
    out = ranks.combine([KVConnectorOutput(), gone])
    assert out is not None and not out.events  # told once
    assert ranks.combine([None, None]) is None


def test_rank_combiner_counts_ranks_not_reports() -> None:
    """A rank that reports the same thing twice never stands in for another rank: a reader's `done`
    heard twice by rank 0 (the same answer used twice) must not free blocks rank 1 is still reading."""
    ranks = RankCombiner(2)
    done0 = KVConnectorOutput(sends_done={"pd": ["x", "x"]}, loads_done={"pd": {"r": 4}})
    out = ranks.combine([done0, None])
    assert out is not None and not out.sends_done and not out.loads_done
    out = ranks.combine([done0, None])  # and again, in a later step
    assert out is not None and not out.sends_done and not out.loads_done
    out = ranks.combine([None, KVConnectorOutput(sends_done={"pd": ["x"]}, loads_done={"pd": {"r": 3}})])
    assert out is not None and out.sends_done == {"pd": ["x"]} and out.loads_done == {"pd": {"r": 3}}
    # Three ranks: rank 0 twice and rank 1 once is still not every rank.
    three = RankCombiner(3)
    for reports in ([done0, None, None], [done0, done0, None]):
        out = three.combine(reports)
        assert out is not None and not out.sends_done and not out.loads_done
    out = three.combine(
        [None, None, KVConnectorOutput(sends_done={"pd": ["x"]}, loads_done={"pd": {"r": 9}})]
    )
    assert out is not None and out.sends_done == {"pd": ["x"]} and out.loads_done == {"pd": {"r": 4}}


def test_rank_combiner_announces_a_block_by_its_holders() -> None:
    """A block is in a file tier while every rank holds its part: stored twice by one rank is not every
    rank, a part lost before the block was announced is no news (and keeps the others' parts), and a
    block removed and stored again is announced again."""
    k, j = b"\x01" * 8, b"\x02" * 8

    def ev(*events: tuple[str, bytes]) -> KVConnectorOutput:
        return KVConnectorOutput(events={"offload": [(kind, "disk", key) for kind, key in events]})

    def news(out: KVConnectorOutput | None) -> list[tuple[str, bytes]]:
        assert out is not None
        return [(kind, key) for kind, _, key in out.events.get("offload", [])]

    ranks = RankCombiner(2)
    assert news(ranks.combine([ev(("stored", k), ("stored", k)), None])) == []  # one rank, twice
    assert news(ranks.combine([ev(("stored", k)), None])) == []
    assert news(ranks.combine([None, ev(("stored", k))])) == [("stored", k)]
    assert news(ranks.combine([ev(("stored", k)), ev(("stored", k))])) == []  # told once
    # Removed from one rank, then stored there again: gone, then back.
    assert news(ranks.combine([ev(("removed", k)), None])) == [("removed", k)]
    assert news(ranks.combine([None, ev(("removed", k))])) == []
    assert news(ranks.combine([ev(("stored", k)), None])) == []  # rank 1 lost its part too
    assert news(ranks.combine([None, ev(("stored", k))])) == [("stored", k)]
    # In one step: rank 0 loses its part and stores it again, then rank 1 loses its part (taken in rank
    # order, as a consumer applies them: gone in the end).
    out = ranks.combine([ev(("removed", k), ("stored", k)), ev(("removed", k))])
    assert news(out) == [("removed", k), ("stored", k), ("removed", k)]
    assert news(ranks.combine([None, ev(("stored", k))])) == [("stored", k)]
    # A part lost before the block was announced: no news, and the other rank's part still counts.
    assert news(ranks.combine([ev(("stored", j)), None])) == []
    assert news(ranks.combine([None, ev(("removed", j))])) == []  # rank 1 never had it
    assert news(ranks.combine([None, ev(("stored", j))])) == [("stored", j)]
    assert news(ranks.combine([ev(("removed", j)), ev(("removed", j))])) == [("removed", j)]
    # Every removal of a block that was announced is told, however many blocks came and went before.
    assert news(ranks.combine([ev(("removed", k)), None])) == [("removed", k)]


def test_a_failed_step_keeps_the_healthy_ranks_connector_reports() -> None:
    """Under tensor parallelism a step that fails on one rank must not drop what the others' connectors
    reported (taken from them already): a load that rank 1 finished in the failed step and rank 0 in
    the next is done, or its request would wait for it forever."""
    from tokenmill.worker.multiproc_executor import MultiprocExecutor
    from tokenmill.worker.step import ModelRunnerOutput, SchedulerOutput

    class Rank:
        def __init__(self) -> None:
            self.answers: list[tuple[str, object]] = []

        def send(self, msg: object) -> None:
            return None

        def poll(self, timeout: float = 0.0) -> bool:
            return True

        def recv(self) -> tuple[str, object]:
            return self.answers.pop(0)

    class Alive:
        def poll(self) -> None:
            return None

    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    r0, r1 = Rank(), Rank()
    executor.conns, executor.procs = [r0, r1], [Alive(), Alive()]  # type: ignore[list-item]
    executor.sampler_rank, executor.kv_ranks, executor._kv_carry = 0, RankCombiner(2), None
    # Step 1: rank 0 (the sampling rank) fails; rank 1 finished its part of r's load and a reader's done.
    r0.answers.append(("error", "rank 0: RuntimeError: boom"))
    r1.answers.append(("ok", KVConnectorOutput(loads_done={"offload": {"r": 6}}, sends_done={"pd": ["x"]})))
    with pytest.raises(RuntimeError, match="boom"):
        executor.execute_model(SchedulerOutput())
    # Step 2: rank 0 reports them (its connectors kept them: its step failed before it took them).
    kvo0 = KVConnectorOutput(loads_done={"offload": {"r": 5}}, sends_done={"pd": ["x"]}, stats={"n": 1})
    r0.answers.append(("ok", ModelRunnerOutput(kv_connector_output=kvo0)))
    r1.answers.append(("ok", KVConnectorOutput(stats={"n": 2})))
    out = executor.execute_model(SchedulerOutput()).kv_connector_output
    assert out is not None
    assert out.loads_done == {"offload": {"r": 5}} and out.sends_done == {"pd": ["x"]}
    assert out.stats == {"n": 2}
    # A report that completes in the failed step itself goes out with the next step's output.
    r0.answers.append(("error", "rank 0: RuntimeError: boom"))
    r1.answers.append(("ok", KVConnectorOutput(events={"offload": [("stored", "disk", b"k")]})))
    with pytest.raises(RuntimeError):
        executor.execute_model(SchedulerOutput())
    r0.answers.append(("ok", ModelRunnerOutput(kv_connector_output=KVConnectorOutput(
        events={"offload": [("stored", "disk", b"k")]}))))  # fmt: skip
    r1.answers.append(("ok", KVConnectorOutput(loads_done={"offload": {"s": 1}})))
    out = executor.execute_model(SchedulerOutput()).kv_connector_output
    assert out is not None and out.events == {"offload": [("stored", "disk", b"k")]}
    assert not out.loads_done  # rank 0 has not reported s yet


def test_save_before_load_holds_whatever_the_chain_order() -> None:
    """One connector's copies of evicted blocks are taken before any connector loads into the blocks
    the pool gave out in their place, even when the loading connector comes first in the chain."""
    calls: list[str] = []

    class Loader(KVConnectorWorker):
        name = "loader"

        @classmethod
        def build(cls, ctx):  # noqa: ANN001, ANN206
            raise NotImplementedError

        def load_blocks(self, meta) -> None:  # noqa: ANN001
            calls.append(f"load {meta}")

    class Saver(Loader):
        name = "saver"

        def save_blocks(self, meta) -> None:  # noqa: ANN001
            calls.append(f"save {meta}")

    chain = MultiConnectorWorker([Loader(), Saver()])
    chain.apply({"loader": 1, "saver": 2})
    assert calls == ["save 2", "load 1", "load 2"]
    calls.clear()
    Saver().apply(3)
    assert calls == ["save 3", "load 3"]


def _req(rid: str, tokens: list[int], kv_transfer: dict | None = None) -> Request:
    return Request(EngineRequest(rid, tokens, SamplingParams(max_tokens=4), kv_transfer=kv_transfer), 512)


def test_a_chain_takes_leading_blocks_from_offload_and_the_rest_from_the_prefill_engine() -> None:
    bs = 4
    kv = KVCacheManager(16, bs)
    offload = OffloadConnector(OffloadTiers(host_bytes=8 * 100), bs, 100, "ns")
    pd = PDConnector(bs, {})
    chain = MultiConnector([offload, pd])
    kv.attach_connector(chain)
    tokens = list(range(1, 26))  # six full blocks and one token
    probe = _req("probe", tokens)
    kv.get_computed_blocks(probe)  # names its blocks
    hashes = probe.block_hashes
    for key in hashes[:3]:  # the first three were evicted to host memory earlier
        offload.host.take(key)  # type: ignore[union-attr]
    chain.build_meta()
    remote = {
        "endpoint": "tcp://127.0.0.1:9", "request_id": "p-1", "block_ids": [10, 11, 12, 13, 14, 15],
        "block_size": bs, "grant": "g", "block_hash": hashes[5].hex(),
    }  # fmt: skip
    req = _req("d-1", tokens, {"remote": remote})
    computed, _ = kv.get_computed_blocks(req)
    assert computed == []
    assert chain.num_external_blocks(req, 0) == (6, True)
    fresh = kv.allocate_for_load(req, computed, 6)
    assert fresh is not None
    chain.after_alloc(req, fresh, 0, background=True)
    meta = chain.build_meta()
    assert meta is not None and set(meta) == {"offload", "pd"}
    # Host memory gives blocks 0-2 before the step's forward pass; the prefill engine 3-5, in the background.
    assert [dst for _, dst in meta["offload"].host_loads] == [b.block_id for b in fresh[:3]]
    load = meta["pd"].loads["d-1"]
    assert load.remote_block_ids == [13, 14, 15] and load.local_block_ids == [b.block_id for b in fresh[3:]]
    # The read brought two of its three blocks: five leading blocks hold their content.
    done, released = chain.update_from_workers(KVConnectorOutput(loads_done={"pd": {"d-1": 2}}))
    assert done == {"d-1": 5} and released == []
    assert chain.loaded("d-1", 5) == (0, 5)
    c = chain.counters()
    assert c["host_hit_blocks"] == 3 and c["remote_load_blocks"] == 3 and c["remote_loaded_blocks"] == 2
    # When the engine's own tiers hold every block, the prefill engine is let go at once.
    again = _req("d-2", tokens, {"remote": {**remote, "request_id": "p-2"}})
    for key in hashes[3:6]:
        offload.host.take(key)  # type: ignore[union-attr]
    assert kv.get_computed_blocks(again) == ([], 0)
    assert chain.num_external_blocks(again, 0) == (6, False)
    meta = chain.build_meta()  # an admission that found no room: not yet (it asks again)
    assert meta is None or "pd" not in meta
    assert chain.num_external_blocks(again, 0) == (6, False)
    fresh = kv.allocate_for_load(again, [], 6)
    assert fresh is not None
    chain.after_alloc(again, fresh, 0, background=False)
    again.status = RequestStatus.RUNNING  # in: once
    assert [r.remote_request_id for r in chain.build_meta()["pd"].releases] == ["p-2"]  # type: ignore[index]
    assert chain.build_meta() is None


def test_a_decode_engine_lets_the_prefill_engine_go_once_the_request_is_in() -> None:
    """A request whose blocks are all here already needs none of the prefill engine's: the release goes
    out when the request is in (not at each admission that found no room, nor while another
    connector's load of its blocks may still come up short), once."""
    bs = 4
    pd = PDConnector(bs, {})
    tokens = list(range(1, 26))  # six full blocks and one token
    remote = {
        "endpoint": "tcp://127.0.0.1:9",
        "request_id": "p-1",
        "block_ids": list(range(6)),
        "block_size": bs,
    }
    req = _req("d-1", tokens, {"remote": remote})
    assert pd.num_external_blocks(req, 6) == (0, False)  # the pool (or a tier before it) has all six
    assert pd.build_meta() is None  # no room this step: it waits, and is asked again
    assert pd.num_external_blocks(req, 6) == (0, False)
    req.status = RequestStatus.WAITING_FOR_KV  # the offload tiers' load of its blocks is under way
    assert pd.build_meta() is None
    req.status = RequestStatus.WAITING  # the load ended; admitted again
    assert pd.build_meta() is None
    req.status = RequestStatus.RUNNING
    meta = pd.build_meta()
    assert meta is not None and [r.remote_request_id for r in meta.releases] == ["p-1"]
    req.status = RequestStatus.PREEMPTED  # preempted, and admitted again: the prefill engine knows
    assert pd.num_external_blocks(req, 6) == (0, False)
    req.status = RequestStatus.RUNNING
    assert pd.build_meta() is None
    # A request that ends while it waits (aborted) lets its prefill engine go too.
    other = _req("d-2", tokens, {"remote": {**remote, "request_id": "p-2"}})
    assert pd.num_external_blocks(other, 6) == (0, False)
    other.status = RequestStatus.FINISHED
    meta = pd.build_meta()
    assert meta is not None and [r.remote_request_id for r in meta.releases] == ["p-2"]


def test_a_chain_forgets_a_load_the_scheduler_does_not_ask_about() -> None:
    bs = 4
    kv = KVCacheManager(16, bs)
    chain = MultiConnector(
        [OffloadConnector(OffloadTiers(host_bytes=800), bs, 100, "ns"), PDConnector(bs, {})]
    )
    kv.attach_connector(chain)
    tokens = list(range(1, 26))
    probe = _req("probe", tokens)
    kv.get_computed_blocks(probe)
    remote = {
        "endpoint": "tcp://127.0.0.1:9", "request_id": "p-1", "block_ids": list(range(6)), "block_size": bs,
        "block_hash": probe.block_hashes[5].hex(),
    }  # fmt: skip
    req = _req("d-1", tokens, {"remote": remote})
    assert chain.num_external_blocks(req, 0) == (6, True)
    fresh = kv.allocate_for_load(req, [], 6)
    assert fresh is not None
    chain.after_alloc(req, fresh, 0, background=True)
    chain.build_meta()
    assert chain.update_from_workers(KVConnectorOutput(loads_done={"pd": {"d-1": 6}})) == ({"d-1": 6}, [])
    # The scheduler skipped it (it no longer waited for the request): nothing stays behind.
    chain.update_from_workers(KVConnectorOutput())
    assert chain._done == {}


def test_a_clients_layout_is_bounded_before_anything_is_done_per_rank() -> None:
    one = {"endpoint": "tcp://127.0.0.1:7200", "request_id": "p", "block_ids": [1], "block_size": 16}
    many = {**one, "tp_size": 64, "pp_size": 32, "endpoints": ["tcp://127.0.0.1:7200"] * 2048}
    with pytest.raises(ValueError, match="1024"):
        validate_kv_transfer({"remote": many}, 16, 512)
    with pytest.raises(ValueError, match="at most 1024"):
        validate_kv_transfer({"remote": {**one, "tp_size": 1024, "pp_size": 1024}}, 16, 512)
    from tokenmill.server.errors import APIError
    from tokenmill.server.kv_transfer_params import to_engine

    params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "remote_request_id": "p",
              "remote_block_ids": [1], "remote_endpoints": ["h:1"] * 2048}  # fmt: skip
    with pytest.raises(APIError, match="1024"):
        to_engine(params, 16, {"h:1"})


def test_a_transfer_port_that_leaves_a_rank_past_65535_is_refused_at_start() -> None:
    config = EngineConfig(
        kv_transfer=KVTransferConfig(kv_role="prefill", kv_transfer_port=65535),
        parallel=ParallelConfig(tensor_parallel_size=2),
    )
    with pytest.raises(ValueError, match="rank 1's transfer server would listen on port 65536"):
        PDConnector.check_config(config)
    with pytest.raises(ValueError, match="65536"):  # before any rank starts
        EngineCore(config)
    PDConnector.check_config(dataclasses.replace(config, parallel=ParallelConfig()))  # one rank: fine
    decode = dataclasses.replace(
        config, kv_transfer=KVTransferConfig(kv_role="decode", kv_transfer_port=65535)
    )
    PDConnector.check_config(decode)  # serves nothing


def test_a_chain_keeps_a_finished_prefill_until_its_reader_is_done() -> None:
    bs = 4
    kv = KVCacheManager(16, bs)
    pd = PDConnector(bs, {"endpoint": "tcp://127.0.0.1:7200", "grant_key": "00" * 32})
    chain = MultiConnector([OffloadConnector(OffloadTiers(host_bytes=800), bs, 100, "ns"), pd])
    kv.attach_connector(chain)
    req = _req("p", list(range(1, 14)), {"do_remote_decode": True})
    assert kv.allocate_slots(req, 13)
    keep, answer = chain.request_finished(req, kv.block_ids("p"))
    assert keep and answer is not None and len(answer["block_ids"]) == 3
    assert chain.update_from_workers(KVConnectorOutput(sends_done={"pd": ["p"]})) == ({}, ["p"])


def test_mismatched_layouts_are_refused_with_the_request() -> None:
    """Rank i of a decode engine reads its part of each block from rank i of the prefill engine: an
    answer from a prefill engine of another tensor x pipeline layout is refused on arrival."""
    one = {"endpoint": "tcp://127.0.0.1:7200", "request_id": "p", "block_ids": [1], "block_size": 16}
    two = {**one, "endpoints": ["tcp://127.0.0.1:7200", "tcp://127.0.0.1:7201"], "tp_size": 2}
    checked_one = validate_kv_transfer({"remote": one}, 16, 512)
    checked_two = validate_kv_transfer({"remote": two}, 16, 512)
    PDConnector(16, {}).check_request(checked_one)
    PDConnector(16, {}, endpoints=two["endpoints"], layout=(2, 1)).check_request(checked_two)
    with pytest.raises(ValueError, match=r"tensor x pipeline parallel 2 x 1, this one 1 x 1.*same layout"):
        PDConnector(16, {}).check_request(checked_two)
    with pytest.raises(ValueError, match=r"tensor x pipeline parallel 1 x 1, this one 1 x 2.*same layout"):
        PDConnector(16, {}, layout=(1, 2)).check_request(checked_one)
    with pytest.raises(ValueError, match="one endpoint per rank"):
        validate_kv_transfer({"remote": {**two, "pp_size": 2}}, 16, 512)
    with pytest.raises(ValueError, match="one endpoint per rank"):  # rank 1 would read rank 0's heads
        validate_kv_transfer({"remote": {**one, "tp_size": 2}}, 16, 512)
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        validate_kv_transfer({"remote": {**two, "endpoints": ["tcp://127.0.0.1:7200", "file:///x"]}}, 16, 512)


def test_an_outside_proxy_carries_every_ranks_endpoint_and_the_layout() -> None:
    """vLLM's kv_transfer_params as a proxy passes them on: a prefill engine of two ranks names both
    transfer servers and its layout, and a decode server reads only from peers it trusts, every one."""
    from tokenmill.server.errors import APIError
    from tokenmill.server.kv_transfer_params import from_engine, to_engine

    answer = {
        "endpoint": "tcp://10.0.0.1:7200", "request_id": "p", "block_ids": [3, 4], "block_size": 16,
        "grant": "g", "block_hash": "ab", "endpoints": ["tcp://10.0.0.1:7200", "tcp://10.0.0.1:7201"],
        "tp_size": 1, "pp_size": 2,
    }  # fmt: skip
    params = from_engine(answer)
    assert params is not None and params["remote_endpoints"] == ["10.0.0.1:7200", "10.0.0.1:7201"]
    assert (params["tp_size"], params["remote_pp_size"]) == (1, 2)
    remote = to_engine(params, 16, {"10.0.0.1:7200", "10.0.0.1:7201"})["remote"]  # type: ignore[index]
    assert remote == answer
    with pytest.raises(APIError, match="10.0.0.1:7201 is not a prefill server"):
        to_engine(params, 16, {"10.0.0.1:7200"})
    # A single-rank engine's answer stays as vLLM's NIXL connector shapes it.
    single = from_engine({k: v for k, v in answer.items() if k not in ("endpoints", "tp_size", "pp_size")})
    assert single is not None and single["tp_size"] == 1 and "remote_endpoints" not in single


# -- engines -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, model_path: Path) -> Path:
    transformers = pytest.importorskip("transformers", reason="transformers is the reference implementation")
    from tokenmill.weights.tokenizer_source import load_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.2, tie_word_embeddings=True,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(
        path, safe_serialization=True
    )
    load_tokenizer(model_path, None).save(path)  # the embedded model's tokenizer (the vocabulary matches)
    return path


def _config(model: Path, role: str | None = None, offload: str | None = None, tp: int = 1, pp: int = 1,
            num_blocks: int = 24, events: bool = False) -> EngineConfig:  # fmt: skip
    return EngineConfig(
        model=str(model), dtype="float32", max_model_len=256, cache=CacheConfig(num_blocks=num_blocks),
        parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        kv_transfer=KVTransferConfig(kv_role=role, kv_transfer_timeout_s=5.0),
        offload=KVOffloadConfig(kv_offload=offload), kv_events=KVEventsConfig(enable_kv_events=events),
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy tokens on one plain engine whose pool keeps everything, checked against
    transformers on the same weights."""
    from reference import hf_greedy
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    engine = EngineCore(_config(tiny_model, num_blocks=400))
    try:
        out = {}
        for i, p in enumerate(PROMPTS + LONGER):
            out[tuple(p)] = _run(engine, EngineRequest(f"ref-{i}", p, GREEDY)).new_token_ids
            assert out[tuple(p)] == hf_greedy(hf, p, GREEDY.max_tokens)[0]
        return out
    finally:
        engine.shutdown()


def _drain_writes(*engines: EngineCore) -> None:
    """Wait until every rank's offload writer has put every queued block in its file tier."""
    deadline = time.monotonic() + 60
    for engine in engines:
        while engine.poll_kv_connector().get("file_writes_queued", 0):
            assert time.monotonic() < deadline, "the offload writers did not catch up"
            time.sleep(0.01)


def _free_held(engine: EngineCore) -> None:
    deadline = time.monotonic() + 20
    while engine.scheduler.held:  # the reader's `done`, from every rank, lets the prefill engine go
        assert time.monotonic() < deadline, "the prefill engine kept blocks its reader is done with"
        engine.step()


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)], ids=["one-rank", "tp2", "pp2"])
def test_offload_and_disaggregation_on_one_engine_pair(
    tp: int, pp: int, tiny_model: Path, reference: dict, tmp_path: Path
) -> None:
    """A prefill and a decode engine, both with host and disk tiers, of the same layout. Round one: the
    decode engine reads each prompt's blocks from the prefill engine, and both pools evict to their
    tiers. Round two, each prompt three blocks longer: the prefill engine loads the old prefix from its
    tiers, and the decode engine takes it from its own tiers and only the new blocks over the transfer,
    in the same request. Every answer is the plain engine's."""
    world = tp * pp
    tiers = "host=40KB,disk={}:10MB"  # host memory for 4 blocks of 8 KB, so most go on to disk
    pre = EngineCore(_config(tiny_model, "prefill", tiers.format(tmp_path / "p"), tp, pp))
    dec = None
    try:
        dec = EngineCore(_config(tiny_model, "decode", tiers.format(tmp_path / "d"), tp, pp, events=True))
        endpoints = pre.describe()["kv_transfer"].get(
            "endpoints", [pre.describe()["kv_transfer"]["endpoint"]]
        )
        assert len(set(endpoints)) == world  # a transfer server per rank
        one = dataclasses.replace(GREEDY, max_tokens=1)
        seen: list[dict[str, int]] = []
        for rnd, prompts in enumerate((PROMPTS, LONGER)):
            for i, p in enumerate(prompts):
                answer = _run(
                    pre, EngineRequest(f"p{rnd}-{i}", p, one, kv_transfer={"do_remote_decode": True})
                )
                assert answer.kv_transfer is not None
                got = _run(
                    dec, EngineRequest(f"d{rnd}-{i}", p, GREEDY, kv_transfer={"remote": answer.kv_transfer})
                )
                assert got.new_token_ids == reference[tuple(p)], (rnd, i)
                _free_held(pre)
            seen.append({**dec.stats().kv_connector})
            # Round two counts on the blocks round one evicted being in the file tiers by then.
            _drain_writes(pre, dec)
        first, second = seen
        p_kv = pre.stats().kv_connector
        events = dec.kv.take_events()
    finally:
        pre.shutdown()
        if dec is not None:
            dec.shutdown()
    # Round one: every prompt's blocks came over the transfer (through shared memory), none failed.
    assert first["remote_loaded_blocks"] == first["remote_load_blocks"] == 6 * 6, first
    assert first["blocks_read_shm"] == 6 * 6 and first["remote_read_failures"] == 0
    # Round two: the old prefixes came back from the decode engine's own tiers (most from disk), and
    # the three new blocks of each prompt over the transfer.
    back = second["file_loaded_blocks"] + second["host_hit_blocks"]
    assert back >= 6 * 5 and second["disk_hits"] > 0, second
    assert second["remote_loaded_blocks"] - first["remote_loaded_blocks"] >= 6 * 3, second
    assert second["corrupt_blocks"] == 0 and second["file_load_failures"] == 0
    # The prefill engine loaded its old prefixes from its own tiers too.
    assert p_kv["file_loaded_blocks"] + p_kv["host_hit_blocks"] >= 6 * 5 and p_kv["disk_hits"] > 0, p_kv
    # Its disk tier's writes were announced, as every tier's are.
    media = {(type(e).__name__, e.medium) for e in events}
    assert {("BlockStored", "DISK"), ("BlockStored", "CPU"), ("BlockRemoved", "GPU")} <= media, media
    # Each rank kept its own part of every block under its own namespace, in each engine's directory.
    for side in ("p", "d"):
        spaces = [d for d in (tmp_path / side).iterdir() if d.is_dir()]
        assert len(spaces) == world, spaces
        keys = [{f.name for f in d.rglob("*.kvb")} for d in spaces]
        assert all(len(k) >= 6 * 6 for k in keys), [len(k) for k in keys]
    if world > 1:  # the same blocks, each rank's part of them: the same names in each rank's namespace
        assert keys[0] == keys[1]


# Loaded by the ranks of an engine started with its directory on PYTHONPATH: a slow disk, where every
# block written takes 0.4 s (the ~20 blocks written at shutdown take longer than a rank is given to exit
# when it has nothing to finish).
SLOW_DISK = """
import time

from tokenmill.worker.kv_offload import file_store

_put = file_store.FileStore.put


def _slow_put(self, key, payload):
    time.sleep(0.4)
    return _put(self, key, payload)


file_store.FileStore.put = _slow_put
"""


@pytest.mark.slow
def test_a_restart_with_the_same_layout_finds_its_ranks_files(
    tiny_model: Path, reference: dict, tmp_path: Path
) -> None:
    """Under tensor parallelism each rank writes its part of every block at shutdown under its own
    namespace, and the engine waits for every rank's writes (on a slow disk) before it stops them; a new
    engine of the same layout loads them all back from the first request on."""
    disk = f"disk={tmp_path / 'kv'}:10MB"
    slow = tmp_path / "slow-disk"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_DISK)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(slow), before) if p)
    try:
        engine = EngineCore(_config(tiny_model, offload=disk, tp=2))  # its ranks write slowly
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    try:
        for i, p in enumerate(PROMPTS[:3]):
            assert _run(engine, EngineRequest(f"a{i}", p, GREEDY)).new_token_ids == reference[tuple(p)]
    finally:
        t0 = time.monotonic()
        engine.shutdown()  # the pool's blocks are written out, every rank's part
        took = time.monotonic() - t0
    assert took > 5, f"the shutdown took {took:.1f}s: the ranks' disk was not slow, the test tests nothing"
    engine = EngineCore(_config(tiny_model, offload=disk, tp=2))
    try:
        for i, p in enumerate(PROMPTS[:3]):
            assert _run(engine, EngineRequest(f"b{i}", p, GREEDY)).new_token_ids == reference[tuple(p)]
        kv = engine.stats().kv_connector
    finally:
        engine.shutdown()
    assert kv["file_loaded_blocks"] == 3 * 6 and kv["disk_hits"] == 3 * 6, kv


def test_a_decode_engine_refuses_an_answer_of_another_layout(tiny_model: Path) -> None:
    dec = EngineCore(_config(tiny_model, "decode"))
    try:
        remote = {
            "endpoint": "tcp://127.0.0.1:7200", "request_id": "p", "block_ids": [1, 2], "block_size": BS,
            "endpoints": ["tcp://127.0.0.1:7200", "tcp://127.0.0.1:7201"], "tp_size": 2,
        }  # fmt: skip
        with pytest.raises(ValueError, match="same layout"):
            dec.add_request(EngineRequest("d", PROMPTS[0], GREEDY, kv_transfer={"remote": remote}))
        assert not dec.has_unfinished()
    finally:
        dec.shutdown()


def test_every_tier_publishes_kv_events(
    tiny_model: Path, reference: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's blocks as "GPU", host memory's as "CPU", the disk tier's as "DISK" and the shared
    tier's as "SHARED": each BlockStored with its tokens and parent, as the pool's, and each removal
    from a tier that leaves the block nowhere else here."""
    monkeypatch.setenv(SHARED_KEY, "a-test-deployment-secret")
    # Host memory for 4 blocks, disk for about 5: most blocks end up in the shared tier.
    tiers = f"host=40KB,disk={tmp_path / 'disk'}:48KB,shared={tmp_path / 'shared'}"
    engine = EngineCore(_config(tiny_model, offload=tiers, events=True))
    events = []
    try:
        for rnd in range(2):
            for i, p in enumerate(PROMPTS):
                out = _run(engine, EngineRequest(f"{rnd}-{i}", p, GREEDY))
                assert out.new_token_ids == reference[tuple(p)]
                events += engine.kv.take_events()
        kv = engine.stats().kv_connector
    finally:
        engine.shutdown()
    assert kv["shared_hits"] > 0, kv
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert {e.medium for e in stored} == {"GPU", "CPU", "DISK", "SHARED"}
    removed = {e.medium for e in events if isinstance(e, BlockRemoved)}
    assert {"GPU", "CPU", "DISK"} <= removed, removed
    # Every tier's BlockStored names a block of one of the sequences, with its tokens and its parent.
    names: dict[int, tuple[int | None, list[int]]] = {}
    for p in PROMPTS:
        seq = p + reference[tuple(p)]
        hashes: list[bytes] = []
        extend_block_hashes(hashes, seq, BS, None)
        for k, h in enumerate(hashes):
            names[external_hash(h)] = (
                external_hash(hashes[k - 1]) if k else None,
                seq[k * BS : (k + 1) * BS],
            )
    for e in stored:
        parent = e.parent_block_hash
        for k, h in enumerate(e.block_hashes):
            assert names[h] == (parent, e.token_ids[k * BS : (k + 1) * BS]), e
            parent = h
