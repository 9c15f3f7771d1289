"""KV offload tiers (host, disk, shared) behind the KV connector seam.

The reference for every output is the same engine with a pool big enough that nothing is evicted:
greedy float32 token ids must be identical when blocks came back from host memory, from disk, from the
shared directory, after a restart (warm start), and when a damaged block on disk had to be recomputed.
The bookkeeping (host slots, pins, events, the request waiting for a background load) is tested by hand
without a model.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path

import pytest
from test_kv_file_store import block_payload, forge_block_file, key_of, payload_of

from tokenmill import LLM, SamplingParams
from tokenmill.config import KVOffloadConfig
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.kv_events import BlockRemoved, BlockStored, external_hash, stored
from tokenmill.engine.offload_connector import HostIndex, OffloadConnector
from tokenmill.engine.protocol import EngineStats
from tokenmill.engine.request import EngineRequest, Request
from tokenmill.server.metrics import _EngineCollector
from tokenmill.worker.kv_offload.file_store import FileStore
from tokenmill.worker.kv_offload.tiers import OffloadTiers, parse_size, parse_tiers

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "judge",
    "boxing",
    "matches",
]
# Six prompts of ~230 tokens (15 blocks each): a 40-block pool holds two of them, so by the time a
# prompt comes back, its blocks have left the pool for the tiers.
PROMPTS = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(220)) + f" story {i}:" for i in range(6)]
GREEDY = SamplingParams(max_tokens=12, temperature=0)
SMALL_POOL = {"dtype": "float32", "max_model_len": 512, "num_blocks": 40}
SHARED_KEY = "TOKENMILL_KV_SHARED_KEY"


# -- configuration -----------------------------------------------------------------------------------
def test_sizes_and_tier_specs() -> None:
    assert parse_size("4GB") == 4 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5G") == int(1.5 * 2**30)
    assert parse_size("1000") == 1000
    t = parse_tiers("host=4GB,disk=/var/kv:20GB,shared=/mnt/kv")
    assert t == OffloadTiers(4 * 10**9, "/var/kv", 20 * 10**9, "/mnt/kv", None)
    assert parse_tiers("shared=/mnt/a:b:1GiB").shared_path == "/mnt/a:b"
    assert parse_tiers("disk=/d:1MB").host_bytes is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("host=lots", "not a size"),
        ("disk=/var/kv", "needs a size"),
        ("gpu=1GB", "unknown tier"),
        ("host=1GB,host=2GB", "given twice"),
        ("host", "not TIER=VALUE"),
        ("disk=/a:1GB,shared=/a", "different directories"),
        (",", "names no tier"),
        ("host=0", "positive"),
    ],
)
def test_bad_tier_specs_fail_when_the_config_is_built(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVOffloadConfig(kv_offload=spec)


def test_offload_refuses_what_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match="prefix caching"):
        LLM(kv_offload="host=1MB", enable_prefix_caching=False)


# -- bookkeeping, no model ---------------------------------------------------------------------------
def test_host_index_is_lru_and_never_reuses_a_pinned_slot() -> None:
    h = HostIndex(2)
    assert h.take(b"a") == (0, None) and h.take(b"b") == (1, None)
    assert h.take(b"c") is None  # both taken this step
    h.pinned.clear()  # the next step
    h.touch(b"a")
    assert h.take(b"c") == (1, b"b")  # b was the least recently used
    h.pinned = {0, 1}
    assert h.take(b"d") is None


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(EngineRequest(rid, tokens, SamplingParams(max_tokens=4)), 512)


def test_pool_evictions_become_host_saves_spills_and_events(tmp_path: Path) -> None:
    bs = 4
    kv = KVCacheManager(4, bs, kv_events=True)
    tiers = OffloadTiers(host_bytes=2 * 100, disk_path=str(tmp_path), disk_bytes=10**6)
    conn = OffloadConnector(tiers, bs, 100, "ns", kv.events, lambda h: kv.pool.lookup(h) is not None)
    kv.attach_connector(conn)
    a = _req("a", list(range(1, 13)))  # three full blocks
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12  # its step ran: the blocks hold their content
    a_ids = kv.block_ids("a")
    kv.free(a)
    kv.take_events()
    b = _req("b", list(range(100, 113)))  # four blocks: every cached block of a is evicted
    assert kv.allocate_slots(b, 13)
    b.num_computed_tokens = 13
    ops = conn.build_meta()
    assert ops is not None
    # Two host slots: the first two evictions go to host memory, the third straight to the disk tier
    # (both slots were filled this step, so neither may be spilled and refilled in the same step).
    assert len(ops.saves) == 2 and len(ops.file_saves) == 1 and not ops.spills
    moved = {(block_id, key) for block_id, _, key in ops.saves} | set(ops.file_saves)
    assert moved == set(zip(a_ids, a.block_hashes, strict=True))
    events = kv.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU"]
    stored_host = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert len(removed) == 3 and len(stored_host) == 2
    # Each host-tier event names its block as the pool's did: its parent and its tokens (a consumer that
    # hashes tokens itself, as Dynamo does, drops a block stored without them).
    names = [external_hash(h) for h in a.block_hashes]
    for e in stored_host:
        (k,) = [names.index(h) for h in e.block_hashes]
        assert e.parent_block_hash == (names[k - 1] if k else None)
        assert e.token_ids == a.all_token_ids[k * bs : (k + 1) * bs] and e.block_size == bs
    # The next step may spill a host slot: the slot's old block goes to the files before it is refilled.
    kv.free(b)
    c = _req("c", list(range(200, 209)))  # three blocks: b's unnamed tail block, then two evictions
    assert kv.allocate_slots(c, 9)
    ops = conn.build_meta()
    assert ops is not None and len(ops.spills) == len(ops.saves) == 2
    assert {k for _, k in ops.spills} <= set(a.block_hashes)


def test_admission_finds_host_blocks_after_the_pool_hits(tmp_path: Path) -> None:
    bs = 4
    kv = KVCacheManager(8, bs)
    conn = OffloadConnector(OffloadTiers(host_bytes=10 * 100), bs, 100, "ns")
    kv.attach_connector(conn)
    a = _req("a", list(range(1, 18)))  # four full blocks and one token
    assert kv.allocate_slots(a, 17)
    a.num_computed_tokens = 17
    kv.free(a)
    for _, block_id in kv.pool.cached_blocks()[2:]:  # the pool forgets blocks 2 and 3 (as if evicted)
        conn.on_evicted(kv.pool.blocks[block_id])
        kv.pool.uncache(kv.pool.blocks[block_id])
    conn.build_meta()
    again = _req("a2", list(range(1, 18)))
    computed, hit = kv.get_computed_blocks(again)
    assert hit == 2 * bs
    assert conn.num_external_blocks(again, len(computed)) == (2, False)  # in memory: loaded in-step


# -- the engine ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(dtype="float32", max_model_len=512, num_blocks=400)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.close()


def _rounds(llm: LLM, rounds: int = 2) -> list[list[list[int]]]:
    """Each prompt alone, in turn, `rounds` times: every later round finds its blocks in the tiers."""
    return [
        [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
        for _ in range(rounds)
    ]


@pytest.mark.parametrize("tiers", ["host", "disk", "shared", "host+disk+shared"])
def test_greedy_output_is_identical_when_blocks_come_back_from_a_tier(
    tiers: str, reference: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SHARED_KEY, "a-test-deployment-secret")
    spec = {
        "host": "host=200MB",
        "disk": f"disk={tmp_path / 'disk'}:100MB",
        "shared": f"shared={tmp_path / 'shared'}",
        # A host tier of 5 blocks and a disk tier of 8 blocks: most blocks end up in the shared tier.
        "host+disk+shared": f"host=2MB,disk={tmp_path / 'disk'}:3MB,shared={tmp_path / 'shared'}",
    }[tiers]
    llm = LLM(**SMALL_POOL, kv_offload=spec)
    try:
        for outputs in _rounds(llm):
            assert outputs == reference
        kv = llm.engine.stats().kv_connector
    finally:
        llm.close()
    loaded = {"host": kv["host_loads"], "disk": kv["disk_hits"], "shared": kv["shared_hits"]}
    if tiers == "host+disk+shared":
        assert loaded["shared"] > 0 and kv["host_evicted_blocks"] > 0
    else:
        # The second round's six prompts each find about 14 of their 15 blocks in the tier.
        assert loaded[tiers] >= 6 * 12, kv
    assert kv["corrupt_blocks"] == 0


def test_warm_restart_and_a_damaged_block_is_recomputed(reference: list[list[int]], tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    llm = LLM(**SMALL_POOL, kv_offload=f"disk={disk}:100MB")
    try:
        assert _rounds(llm, 1)[0] == reference
    finally:
        llm.close()  # the pool's blocks are written out too
    files = sorted(disk.rglob("*.kvb"))
    assert len(files) >= 6 * 14
    # Damage one block of every prompt's chain: the payload's last byte, past the header.
    store_dirs = {f.parent.parent for f in files}
    assert len(store_dirs) == 1
    damaged: dict[Path, bytes] = {}
    for f in files[::7]:
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
        damaged[f] = bytes(data)
    llm = LLM(**SMALL_POOL, kv_offload=f"disk={disk}:100MB")
    try:
        assert _rounds(llm, 1)[0] == reference
        kv = llm.engine.stats().kv_connector
        layout = llm.engine.executor.worker.kv_connector.disk.layout  # the payload's dtype and shape
    finally:
        llm.close()
    assert kv["disk_hits"] > 0  # a warm start: the first round already loads from disk
    assert kv["corrupt_blocks"] >= 1 and kv["file_load_failures"] >= 1
    # A damaged file that was read was removed, and the recomputed block written again whole when the
    # pool evicted it; one never read (past an earlier failure in its chain) is still refused.
    store = FileStore(disk, files[0].parent.parent.name, layout=layout)
    rewritten = [f for f, data in damaged.items() if f.exists() and f.read_bytes() != data]
    assert rewritten
    for f in damaged:
        if f.exists():
            assert (store.get(bytes.fromhex(f.stem)) is None) == (f not in rewritten)


def _round_stats(reference: list[list[int]], offload: str) -> dict:
    """One round on a fresh engine with `offload`: its tokens must equal the reference; its KV
    connector's stats."""
    llm = LLM(**SMALL_POOL, kv_offload=offload)
    try:
        assert _rounds(llm, 1)[0] == reference
        return llm.engine.stats().kv_connector
    finally:
        llm.close()


def test_a_forged_block_file_is_refused_and_the_answer_unchanged(
    reference: list[list[int]], tmp_path: Path
) -> None:
    """Whoever can write the directory but holds no key relabels every block file with another block's
    contents and recomputes the checksum: each is refused (recomputed), never served."""
    disk = tmp_path / "disk"
    _round_stats(reference, f"disk={disk}:100MB")
    files = sorted(disk.rglob("*.kvb"))
    assert len(files) >= 6 * 14
    contents = [f.read_bytes() for f in files]
    for i, f in enumerate(files):
        other = block_payload(contents[(i + 1) % len(files)])
        f.write_bytes(forge_block_file(contents[i], bytes.fromhex(f.stem), other))
    kv = _round_stats(reference, f"disk={disk}:100MB")
    assert kv["disk_hits"] == 0 and kv["corrupt_blocks"] >= 6, kv


def test_a_fifo_in_place_of_a_block_file_does_not_hang(reference: list[list[int]], tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    llm = LLM(**SMALL_POOL, kv_offload=f"disk={disk}:100MB")
    try:
        _rounds(llm, 1)
    finally:
        llm.close()
    fifos = sorted(disk.rglob("*.kvb"))[::5]
    for f in fifos:
        f.unlink()
        os.mkfifo(f)
    llm = LLM(**SMALL_POOL, kv_offload=f"disk={disk}:100MB")
    try:
        got: list[list[list[int]]] = []
        t = threading.Thread(target=lambda: got.append(_rounds(llm, 1)[0]), daemon=True)
        t.start()
        t.join(60)  # a hang guard, not a timing: the round takes a few seconds
        if t.is_alive():
            for _ in range(600):  # let loaders blocked on the FIFOs go, so that the engine can close
                for f in fifos:
                    with contextlib.suppress(OSError):
                        os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
                t.join(0.1)
                if not t.is_alive():
                    break
            pytest.fail("a request hung on a FIFO in a block file's place")
        assert got == [reference]
        kv = llm.engine.stats().kv_connector
    finally:
        llm.close()
    assert kv["corrupt_blocks"] >= 1 and kv["disk_hits"] > 0, kv


def test_shared_tier_workers_with_different_keys_refuse_each_others_blocks(
    reference: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    monkeypatch.setenv(SHARED_KEY, "deployment-one-secret-key")
    _round_stats(reference, f"shared={shared}")
    assert len(list(shared.rglob("*.kvb"))) >= 6 * 14
    monkeypatch.setenv(SHARED_KEY, "deployment-two-secret-key")
    kv = _round_stats(reference, f"shared={shared}")
    assert kv["shared_hits"] == 0 and kv["corrupt_blocks"] >= 6, kv
    # No key, no shared tier: a key file inside the directory would be open to the writers it is
    # meant to keep out.
    monkeypatch.delenv(SHARED_KEY)
    with pytest.raises(ValueError, match=SHARED_KEY):
        LLM(**SMALL_POOL, kv_offload=f"shared={shared}")


def test_a_block_of_another_layout_is_never_found(reference: list[list[int]], tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    llm = LLM(**SMALL_POOL, kv_offload=f"disk={disk}:100MB")
    try:
        _rounds(llm, 1)
    finally:
        llm.close()
    # The same model in bfloat16 has other keys and values: its namespace is another directory.
    llm = LLM(dtype="bfloat16", max_model_len=512, num_blocks=40, kv_offload=f"disk={disk}:100MB")
    try:
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        assert llm.engine.stats().kv_connector["disk_hits"] == 0
    finally:
        llm.close()
    assert len([d for d in disk.iterdir() if d.is_dir()]) == 2


def test_8bit_blocks_come_back_from_the_tiers_as_the_pool_held_them(tmp_path: Path) -> None:
    """An int8 cache's blocks (codes and scales) return from host memory and disk byte for byte: the
    second round, loading them from the tiers, decodes exactly as an engine whose pool kept them all.
    An fp8 engine (blocks of the same shape and dtype) never finds them."""
    big = LLM(**{**SMALL_POOL, "num_blocks": 400}, kv_cache_dtype="int8")
    try:
        expected = _rounds(big)[1]
    finally:
        big.close()
    disk = tmp_path / "disk"
    llm = LLM(**SMALL_POOL, kv_cache_dtype="int8", kv_offload=f"host=1MB,disk={disk}:100MB")
    try:
        assert _rounds(llm)[1] == expected
        kv = llm.engine.stats().kv_connector
    finally:
        llm.close()
    assert kv["host_loads"] + kv["disk_hits"] >= 6 * 12 and kv["corrupt_blocks"] == 0, kv
    llm = LLM(**SMALL_POOL, kv_cache_dtype="fp8", kv_offload=f"disk={disk}:100MB")
    try:
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        assert llm.engine.stats().kv_connector["disk_hits"] == 0
    finally:
        llm.close()


def test_salted_requests_never_load_each_others_blocks(tmp_path: Path) -> None:
    llm = LLM(**SMALL_POOL, kv_offload=f"disk={tmp_path}:100MB")
    try:
        for p in PROMPTS[:4]:
            llm.generate([p], GREEDY, cache_salt="tenant-a", use_tqdm=False)
        hits = llm.engine.stats().kv_connector["disk_hits"]
        llm.generate([PROMPTS[0]], GREEDY, cache_salt="tenant-b", use_tqdm=False)
        assert llm.engine.stats().kv_connector["disk_hits"] == hits
        llm.generate([PROMPTS[0]], GREEDY, cache_salt="tenant-a", use_tqdm=False)
        assert llm.engine.stats().kv_connector["disk_hits"] > hits
    finally:
        llm.close()


def test_abort_while_loading_frees_blocks_only_when_the_load_ends(tmp_path: Path) -> None:
    llm = LLM(**SMALL_POOL, kv_offload=f"disk={tmp_path}:100MB")
    try:
        for p in PROMPTS[:4]:
            llm.generate([p], GREEDY, use_tqdm=False)
        engine = llm.engine
        tok = engine.tokenizer.encode(PROMPTS[0])
        engine.add_request(EngineRequest("x", tok, GREEDY))
        out = engine.scheduler.schedule()
        assert "x" in engine.scheduler.loading and not out.num_scheduled_tokens
        engine.abort(["x"])
        assert "x" in engine.scheduler.loading  # still holding blocks the loader may be writing
        engine.executor.execute_model(out)
        while engine.has_unfinished():
            engine.step()
        assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
        assert not engine.kv.req_blocks
    finally:
        llm.close()


def test_offload_metrics_by_tier() -> None:
    stats = EngineStats(
        0, 0, 0.0, 40, 0, 0, 0, 0, 0, kv_connector={"host_loads": 5, "disk_hits": 2, "corrupt_blocks": 1}
    )
    fams = {f.name: f for f in _EngineCollector._connector(["model_name"], [(["m"], stats)])}
    loaded = {s.labels["tier"]: s.value for s in fams["tokenmill:kv_offload_loaded_blocks"].samples}
    assert loaded == {"host": 5, "disk": 2, "shared": 0}
    assert fams["tokenmill:kv_offload_corrupt_blocks"].samples[0].value == 1
    assert "tokenmill:kv_transfer_read_blocks" not in fams  # no transfer counters, no transfer families
    assert not list(
        _EngineCollector._connector(["model_name"], [(["m"], EngineStats(0, 0, 0.0, 1, 0, 0, 0, 0, 0))])
    )


def test_shutdown_leaves_no_stray_files(tmp_path: Path) -> None:
    llm = LLM(**SMALL_POOL, kv_offload=f"disk={tmp_path}:100MB")
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    llm.close()
    assert not list(tmp_path.rglob("*.tmp"))
    shutil.rmtree(tmp_path)


def test_a_router_keeps_crediting_a_block_the_pool_evicted_to_host_memory() -> None:
    from tokenmill.cluster.kv_index import KVIndex

    index = KVIndex()
    index.apply(0, [stored([11, 12], None, [1] * 8, 4)])
    # The pool evicts block 12 and the connector saves it to host memory, in one batch, in this order.
    index.apply(0, [BlockRemoved([12], "GPU"), stored([12], 11, [1] * 4, 4, "CPU")])
    assert index.overlaps([11, 12], 0b1) == {0: 2}
    index.apply(0, [BlockRemoved([12], "CPU")])  # the host tier let it go too
    assert index.overlaps([11, 12], 0b1) == {0: 1}


def flip_last_byte(data: bytes) -> bytes:
    """A block file damaged in its payload's last byte (whatever that byte was)."""
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def test_a_file_store_tells_on_dropped_of_every_block_it_removes(tmp_path: Path) -> None:
    """Evicted (with on_evict, or too damaged to hand to it), found damaged, gone, discarded: each key
    the store no longer holds is told (the KV events announce its removal from the tier)."""
    ns = "m-test-fp16-b16-r0"
    dropped: list[bytes] = []
    evicted: list[bytes] = []
    size = len(payload_of(0)) + 200
    store = FileStore(tmp_path, ns, capacity_bytes=3 * size, on_evict=lambda k, p: evicted.append(k),
                      on_dropped=dropped.append)  # fmt: skip
    for i in range(3):
        store.put(key_of(i), payload_of(i))
    damaged = store.path(key_of(0))
    damaged.write_bytes(flip_last_byte(damaged.read_bytes()))
    store.put(key_of(3), payload_of(3))  # evicts 0, the oldest: too damaged to pass on, dropped all the same
    assert evicted == [] and dropped == [key_of(0)]
    store.put(key_of(4), payload_of(4))  # evicts 1, passed on
    assert evicted == [key_of(1)] and dropped == [key_of(0), key_of(1)]
    damaged = store.path(key_of(2))
    damaged.write_bytes(flip_last_byte(damaged.read_bytes()))
    assert store.get(key_of(2)) is None and dropped[-1] == key_of(2)
    store.path(key_of(3)).unlink()  # another process's eviction
    assert store.get(key_of(3)) is None and dropped[-1] == key_of(3)
    store.discard(key_of(4))
    assert dropped[-1] == key_of(4)
    store.discard(key_of(5))  # never here: nothing to tell
    assert dropped == [key_of(i) for i in range(5)]


def test_a_file_tier_announces_every_block_it_lets_go(tmp_path: Path) -> None:
    """The worker side reports a removal from the disk tier for each block it no longer holds: evicted
    (passed on to the shared tier, or too damaged to pass on) and dropped at a load (another size)."""
    import time

    import torch

    from tokenmill.worker.kv_offload.ops import OffloadOps
    from tokenmill.worker.kv_offload.worker_connector import OffloadWorker

    kv = torch.randn(2, 2, 8, 4, 1, 8)  # 8 blocks of 512 bytes
    keys = [bytes([i]) * 16 for i in range(8)]
    tiers = OffloadTiers(disk_path=str(tmp_path), disk_bytes=3 * 700)  # about three blocks' files
    worker = OffloadWorker(kv, tiers, 0, "ns")

    def write(*blocks: int) -> None:
        worker.apply(OffloadOps(file_saves=[(b, keys[b]) for b in blocks]))
        deadline = time.monotonic() + 30
        while worker.counters()["file_writes_queued"]:
            assert time.monotonic() < deadline, "the writer did not catch up"
            time.sleep(0.01)

    try:
        write(0, 1, 2)
        assert worker.take_events() == [("stored", "disk", keys[i]) for i in range(3)]
        path = worker.disk.path(keys[0])  # type: ignore[union-attr]
        path.write_bytes(flip_last_byte(path.read_bytes()))  # damaged on disk
        write(3)  # evicts block 0: too damaged to pass on, gone all the same
        assert sorted(worker.take_events()) == [("removed", "disk", keys[0]), ("stored", "disk", keys[3])]
        worker.disk.put(keys[4], b"short")  # type: ignore[union-attr]  # another size, our namespace
        worker.take_events()
        assert worker._read(keys[4]) is None
        assert ("removed", "disk", keys[4]) in worker.take_events()
    finally:
        worker.close()
