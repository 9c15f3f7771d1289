"""KV events: what the block pool emits, the vLLM wire format, and publish -> subscribe with replay."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from tokenmill.cluster.kv_index import KVIndex
from tokenmill.cluster.kv_subscriber import KVEventSubscriber
from tokenmill.config import KVEventsConfig
from tokenmill.engine.block_hash import ROOT_HASH, hash_block
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.kv_events import (
    MEDIUM_DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
    external_hash,
    stored,
)
from tokenmill.engine.kv_publisher import KVEventPublisher
from tokenmill.engine.request import EngineRequest, Request
from tokenmill.sampling_params import SamplingParams

BS = 4


# -- vLLM's decoder -----------------------------------------------------------------------------------
# vLLM's own event classes (vllm/distributed/kv_events.py in vLLM 0.32.0: BlockStored, BlockRemoved,
# AllBlocksCleared, KVEventBatch) cannot be installed here (vLLM brings its own torch), so they are
# written out as that file declares them, for what its decoder checks: the tags ("type": the class
# name), the field names, and which fields have no default there. vLLM writes a field without a default
# always (null if need be) and its decoder refuses an event that lacks one ("Object missing required
# field 'lora_id'"); fields with a default there may be absent. Unknown fields are ignored, as there.
ExternalBlockHash = int | bytes  # vLLM's: low 64 bits of the chained hash as an int, or the raw digest


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # no default in vLLM: required even as null
    medium: str | None  # no default in vLLM: required ("GPU", "CPU", ...)
    lora_name: str | None  # no default in vLLM: required even as null
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None  # no default in vLLM: required
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


vllm_decoder = msgspec.msgpack.Decoder(VllmKVEventBatch)


def request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(EngineRequest(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt), 1024)


def chain(tokens: list[int], salt: str | None = None, bs: int = BS) -> list[int]:
    """Published names of the full blocks, computed independently of the cache manager."""
    out, parent = [], ROOT_HASH
    for i in range(len(tokens) // bs):
        parent = hash_block(parent, tokens[i * bs : (i + 1) * bs], salt if i == 0 else None)
        out.append(external_hash(parent))
    return out


def test_stored_events_name_full_blocks_with_tokens_and_parent() -> None:
    kv = KVCacheManager(16, BS, kv_events=True)
    tokens = list(range(100, 110))  # 2 full blocks and 2 tokens
    r = request("a", tokens)
    assert kv.allocate_slots(r, len(tokens))
    (ev,) = kv.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == chain(tokens) and ev.parent_block_hash is None
    assert ev.token_ids == tokens[:8] and ev.block_size == BS and ev.medium == "GPU"
    # The request grows past its third block: one more event, chained to the second block.
    r.num_computed_tokens = 10
    r.all_token_ids.extend([110, 111])
    assert kv.allocate_slots(r, 2)
    (ev2,) = kv.take_events()
    assert ev2.block_hashes == chain(tokens + [110, 111])[2:]
    assert ev2.parent_block_hash == chain(tokens)[1] and ev2.token_ids == [108, 109, 110, 111]
    assert kv.take_events() == []


def test_evictions_and_cache_resets_are_removed_events() -> None:
    kv = KVCacheManager(4, BS, kv_events=True)
    a = request("a", list(range(8)) + [99])
    assert kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.free(a)
    kv.take_events()
    # A request with other content needs every block: the two cached ones are evicted.
    b = request("b", list(range(50, 66)))
    assert kv.allocate_slots(b, 16)
    events = kv.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(chain(list(range(8))))
    assert isinstance(events[-1], BlockStored)
    b.num_computed_tokens = 16
    kv.free(b)
    kv.take_events()
    kv.pool.reset_prefix_cache()
    (ev,) = kv.take_events()
    assert isinstance(ev, BlockRemoved) and sorted(ev.block_hashes) == sorted(chain(list(range(50, 66))))


def test_salt_changes_every_name_and_travels_in_extra_keys() -> None:
    kv = KVCacheManager(8, BS, kv_events=True)
    tokens = list(range(8)) + [1]
    assert kv.allocate_slots(request("a", tokens, salt="tenant-a"), 9)
    (ev,) = kv.take_events()
    assert ev.block_hashes == chain(tokens, "tenant-a") != chain(tokens)
    assert ev.extra_keys == [["tenant-a"], None]


def test_no_events_unless_asked() -> None:
    kv = KVCacheManager(8, BS)
    assert kv.allocate_slots(request("a", list(range(9))), 9)
    assert kv.take_events() == []


def test_wire_format_is_vllms() -> None:
    """[ts, [event maps tagged "type"], dp_rank]; hashes as unsigned 64-bit ints; every field vLLM's
    decoder requires is written, null or not."""
    h = 0xF000_0000_0000_0001  # >= 2**63: must travel as uint64
    events = [
        stored([h], None, [1, 2, 3, 4], 4),
        stored([h + 1], h, [5, 6, 7, 8], 4, "CPU", [["salt"]]),
        BlockRemoved([h], MEDIUM_DEVICE),
        AllBlocksCleared(),
    ]
    payload = encode_batch(events)
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and isinstance(raw[0], float)
    assert raw[1][0] == {
        "type": "BlockStored",
        "block_hashes": [h],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }  # extra_keys, at its default, is omitted as vLLM's omit_defaults does
    assert raw[1][2:] == [
        {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]
    batch = vllm_decoder.decode(payload)
    s0, s1, r, c = batch.events
    assert (s0.block_hashes, s0.parent_block_hash, s0.token_ids) == ([h], None, [1, 2, 3, 4])
    assert (s0.block_size, s0.lora_id, s0.medium, s0.lora_name, s0.extra_keys) == (4, None, "GPU", None, None)
    assert (s1.parent_block_hash, s1.medium, s1.extra_keys) == (h, "CPU", [("salt",)])
    assert (r.block_hashes, r.medium) == ([h], "GPU") and isinstance(c, VllmAllBlocksCleared)
    assert decode_batch(payload).events == events


def test_our_consumer_still_reads_what_older_workers_sent() -> None:
    """Workers before issue 50 left lora_id, medium and lora_name out (vLLM's decoder refuses that);
    the router reads them during an upgrade all the same, as the device pool's."""
    old = msgspec.msgpack.encode(
        [
            1.0,
            [
                {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": [1, 2],
                 "block_size": 2},
                {"type": "BlockStored", "block_hashes": [6], "parent_block_hash": None, "token_ids": [],
                 "block_size": 2, "medium": "CPU"},
                {"type": "BlockRemoved", "block_hashes": [5]},
            ],
            None,
        ]
    )  # fmt: skip
    with pytest.raises(msgspec.ValidationError, match="missing required field"):
        vllm_decoder.decode(old)
    assert decode_batch(old).events == [
        stored([5], None, [1, 2], 2),
        stored([6], None, [], 2, "CPU"),
        BlockRemoved([5], MEDIUM_DEVICE),
    ]


def test_decodes_legacy_arrays_signed_hashes_and_unknown_fields() -> None:
    legacy = msgspec.msgpack.encode(
        [1.5, [["BlockStored", [-1], None, [7, 8], 2, None, "GPU"], ["BlockRemoved", [-2]]], 0]
    )
    b = decode_batch(legacy)
    assert b.data_parallel_rank == 0
    assert b.events == [stored([2**64 - 1], None, [7, 8], 2), BlockRemoved([2**64 - 2], MEDIUM_DEVICE)]
    newer = msgspec.msgpack.encode(
        {
            "ts": 2.0,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"\x00" * 24 + b"\x01" * 8],  # a raw digest: its low 64 bits
                    "parent_block_hash": None,
                    "token_ids": [1],
                    "block_size": 1,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                },
                {"type": "SomethingNew", "x": 1},
            ],
        }
    )
    (ev,) = decode_batch(newer).events
    assert ev.block_hashes == [0x0101010101010101]


def test_index_overlaps_follow_the_chain() -> None:
    idx = KVIndex()
    a = [1, 2, 3, 4]
    idx.apply(0, [stored(a, None, [], 4)])
    idx.apply(1, [stored(a[:2], None, [], 4)])
    idx.apply(2, [stored([9], None, [], 4)])
    assert idx.overlaps(a, 0b111) == {0: 4, 1: 2}
    assert idx.overlaps(a, 0b010) == {1: 2}
    assert idx.overlaps([1, 7, 3], 0b111) == {0: 1, 1: 1}  # a chain is matched from its start only
    idx.apply(0, [BlockRemoved([2], MEDIUM_DEVICE)])
    assert idx.overlaps(a, 0b111) == {0: 1, 1: 2}
    idx.apply(1, [AllBlocksCleared()])
    assert idx.overlaps(a, 0b111) == {0: 1}
    idx.remove_worker(0)
    assert idx.overlaps(a, 0b111) == {} and len(idx) == 1 and idx.blocks_per_worker == {2: 1}


def events_for(i: int) -> list[BlockStored]:
    return [stored([1000 + i], None, [i] * 4, 4)]


async def _subscribe(pub: KVEventPublisher, index: KVIndex, **kw) -> KVEventSubscriber:
    d = pub.describe()
    sub = KVEventSubscriber(zmq.asyncio.Context.instance(), 0, d["endpoint"], d["replay_endpoint"], "", index)
    for k, v in kw.items():
        setattr(sub, k, v)
    sub.start()
    await asyncio.wait_for(sub.synced.wait(), 5)
    return sub


@pytest.fixture
def make_publisher(tmp_path: Path):
    """Publishers on ipc:// sockets in tmp_path, closed after the test."""
    made: list[KVEventPublisher] = []

    def make(buffer: int = 10_000) -> KVEventPublisher:
        cfg = KVEventsConfig(
            enable_kv_events=True,
            kv_events_endpoint=f"ipc://{tmp_path}/pub{len(made)}",
            kv_events_replay_endpoint=f"ipc://{tmp_path}/replay{len(made)}",
            kv_events_buffer_steps=buffer,
        )
        made.append(KVEventPublisher(cfg, zmq.Context()))
        return made[-1]

    yield make
    for pub in made:
        pub.close()


def lost_in_transit(pub: KVEventPublisher, batches: tuple[int, ...]) -> None:
    """Published batches that reach the replay buffer but never the subscriber (as when a full PUB
    queue drops them)."""
    for i in batches:
        pub._buffer.append((pub.seq, encode_batch(events_for(i))))
        pub._held.apply(events_for(i))
        pub.seq += 1


async def _until(cond, timeout: float = 5.0) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _following(pub: KVEventPublisher) -> tuple[KVIndex, KVEventSubscriber]:
    """A subscriber that has joined and received batch 0 on the live stream."""
    index = KVIndex()
    sub = await _subscribe(pub, index)
    await asyncio.sleep(0.2)  # let the subscription reach the publisher
    pub.publish(events_for(0))
    await _until(lambda: sub.last_seq == 0)
    return index, sub


def test_late_subscriber_catches_up_by_replay(make_publisher) -> None:
    pub = make_publisher()

    async def main() -> None:
        for i in range(5):  # before anyone listens: PUB drops these
            pub.publish(events_for(i))
        index = KVIndex()
        sub = await _subscribe(pub, index)
        assert sub.last_seq == 4 and len(index) == 5 and sub.stats.replayed == 5
        await asyncio.sleep(0.2)  # let the subscription reach the publisher
        pub.publish(events_for(5))
        await _until(lambda: len(index) == 6)
        assert sub.stats.gaps == 0
        await sub.stop()

    asyncio.run(main())


def test_gap_in_the_live_stream_is_repaired_by_replay(make_publisher) -> None:
    pub = make_publisher()

    async def main() -> None:
        index, sub = await _following(pub)
        lost_in_transit(pub, (1, 2))  # the next live one shows the gap
        pub.publish(events_for(3))
        await _until(lambda: sub.last_seq == 3)
        assert sub.stats.gaps == 1 and sub.stats.lost == 0
        assert index.overlaps([1001], 1) == {0: 1} and index.overlaps([1002], 1) == {0: 1}
        await sub.stop()

    asyncio.run(main())


def test_gap_older_than_the_buffer_is_repaired_by_the_workers_state(make_publisher) -> None:
    pub = make_publisher(buffer=2)

    async def main() -> None:
        index, sub = await _following(pub)
        lost_in_transit(pub, (1, 2, 3))  # and pushed out of a 2-batch buffer
        pub.publish(events_for(4))
        await _until(lambda: sub.last_seq == 4)
        assert sub.stats.gaps == 1 and sub.stats.lost == 0
        assert all(index.overlaps([1000 + i], 1) == {0: 1} for i in range(5)) and len(index) == 5
        await sub.stop()

    asyncio.run(main())


def test_a_router_joining_late_gets_the_workers_whole_state(make_publisher) -> None:
    """A router (re)started after the buffer has turned over: one replay brings exactly what the worker
    holds now, parents before children, on every tier, and the live stream goes on from there."""
    pub = make_publisher(buffer=3)
    rng = random.Random(5)
    follower = KVIndex()  # what a router that saw every event holds

    def publish(events: list) -> None:
        pub.publish(events)
        follower.apply(0, events)

    async def main() -> None:
        chains: list[tuple[list[int], str]] = []
        for _ in range(40):
            hashes = [rng.getrandbits(64) for _ in range(rng.randrange(1, 6))]
            medium = rng.choice(["GPU", "CPU"])
            on_tier = [c for c, m in chains if m == medium]
            parent = rng.choice(on_tier)[-1] if on_tier and rng.random() < 0.5 else None
            publish([stored(hashes, parent, list(range(4 * len(hashes))), 4, medium=medium)])
            chains.append((hashes, medium))
            if rng.random() < 0.3:
                gone, tier = rng.choice(chains)
                publish([BlockRemoved(gone[rng.randrange(len(gone)) :], tier)])
        index = KVIndex()
        sub = await _subscribe(pub, index)
        assert sub.stats.lost == 0 and sub.stats.replayed == 1 and sub.last_seq == pub.seq - 1
        assert index._holders == follower._holders
        snapshot = pub._held.snapshot()
        seen: set[tuple[int, str | None]] = set()
        for ev in snapshot[1:]:  # every block's parent is stored before it, or not held at all
            assert (
                ev.parent_block_hash is None
                or (ev.parent_block_hash, ev.medium) in seen
                or ((ev.parent_block_hash, ev.medium) not in pub._held._blocks)
            )
            seen.update((h, ev.medium) for h in ev.block_hashes)
        assert len(seen) == len(pub._held)
        await asyncio.sleep(0.2)
        publish(events_for(99))
        await _until(lambda: index.overlaps([1099], 1) == {0: 1})
        await sub.stop()

    asyncio.run(main())


@pytest.mark.parametrize("start", [0, 2, 1_000, 2**63 - 1])
def test_replay_socket_speaks_the_vllm_protocol(make_publisher, start: int) -> None:
    """A DEALER sends [b"", start]; replies are [b"", topic, seq, payload]; the end is seq -1, empty.
    Asked from a sequence number long gone (0 with a buffer of 3 of 4), it sends the worker's whole
    state as one batch (cleared, then every block held) under the last sequence number; from one not yet
    reached, only the end marker."""
    pub = make_publisher(buffer=3 if start == 0 else 10_000)
    for i in range(4):
        pub.publish(events_for(i))
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.connect(pub.describe()["replay_endpoint"])
    s.send_multipart([b"", start.to_bytes(8, "big")])
    seqs = []
    while True:
        assert s.poll(5000)
        _, topic, seq, payload = s.recv_multipart()
        n = int.from_bytes(seq, "big", signed=True)
        if n == -1:
            assert payload == b""
            break
        seqs.append(n)
        if start == 0:
            state = [AllBlocksCleared()] + [ev for i in range(4) for ev in events_for(i)]
            assert decode_batch(payload).events == state
        else:
            assert decode_batch(payload).events == events_for(n)
    assert seqs == ([3] if start == 0 else list(range(start, 4)))
    s.close(0)


def test_a_real_engines_events_decode_as_vllm_and_chain_on_every_tier(make_publisher) -> None:
    """A real engine with prefix caching and a host offload tier, its events through the real publisher
    (read back from its replay socket): every batch decodes with vLLM's classes, and every BlockStored,
    the pool's ("GPU") and the host tier's ("CPU"), names blocks with the tokens and parent of the chain
    computed from the requests' own tokens, as a consumer that hashes tokens itself (Dynamo) needs."""
    from tokenmill import LLM

    bs = 16
    # Three prompts of 15 full blocks in a 40-block pool: the third evicts the first's blocks to host
    # memory, and the first, asked again, is loaded back and evicts the second's.
    prompts = [[100 + (p * 997 + j * 31) % 4000 for j in range(15 * bs + 3)] for p in range(3)]
    llm = LLM(max_model_len=512, num_blocks=40, block_size=bs, kv_offload="host=200MB", enable_kv_events=True)
    pub = make_publisher()
    sequences = []
    try:
        for p in [*prompts, prompts[0]]:
            (out,) = llm.generate([p], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
            sequences.append(p + list(out.outputs[0].token_ids))
            pub.publish(llm.engine.kv.take_events())
        assert llm.engine.stats().kv_connector["host_loads"] > 0
    finally:
        llm.close()
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.connect(pub.describe()["replay_endpoint"])
    s.send_multipart([b"", (0).to_bytes(8, "big")])
    payloads = []
    while True:
        assert s.poll(5000)
        _, _, seq, payload = s.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        payloads.append(payload)
    s.close(0)
    events = [ev for payload in payloads for ev in vllm_decoder.decode(payload).events]

    # The reference: each published hash's parent and tokens, from the sequences' own tokens.
    ref: dict[int, tuple[int | None, list[int]]] = {}
    for toks in sequences:
        names = chain(toks, bs=bs)
        for k, h in enumerate(names):
            ref[h] = (names[k - 1] if k else None, toks[k * bs : (k + 1) * bs])
    media = set()
    for ev in events:
        if not isinstance(ev, VllmBlockStored):
            continue
        media.add(ev.medium)
        assert ev.block_size == bs and len(ev.token_ids) == bs * len(ev.block_hashes), ev
        parent = ev.parent_block_hash
        for k, h in enumerate(ev.block_hashes):
            assert h in ref, ev
            assert ref[h] == (parent, ev.token_ids[k * bs : (k + 1) * bs]), ev
            parent = h
    assert media == {"GPU", "CPU"}
    removed = {ev.medium for ev in events if isinstance(ev, VllmBlockRemoved)}
    assert "GPU" in removed
