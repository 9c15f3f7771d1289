"""The file tier of the KV offload hierarchy: format checks, LRU by bytes, warm start, sharing."""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import random
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest

from tokenmill.worker.kv_offload.file_store import FORMAT_VERSION, FileStore, block_path

NS = "m-test-fp16-b16-r0"


def key_of(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def payload_of(i: int, size: int = 1000) -> bytes:
    return random.Random(i).randbytes(size)


def file_size(store: FileStore, key: bytes) -> int:
    return store.path(key).stat().st_size


def kvb_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.kvb"))


def test_roundtrip_and_layout(tmp_path: Path) -> None:
    store = FileStore(tmp_path, NS)
    k, p = key_of(1), payload_of(1)
    assert store.put(k, p)
    assert store.path(k) == tmp_path / NS / k.hex()[:2] / (k.hex() + ".kvb") == block_path(tmp_path, NS, k)
    assert store.path(k).read_bytes()[:4] == b"TMKV"
    assert store.get(k) == p
    assert store.contains(k) and len(store) == 1
    assert store.used_bytes == file_size(store, k) > len(p)
    # bytearray and (multi-byte-format) memoryview payloads store their raw bytes
    assert store.put(key_of(2), bytearray(p))
    assert store.put(key_of(3), memoryview(p).cast("I"))
    assert store.get(key_of(2)) == p and store.get(key_of(3)) == p
    assert store.get(key_of(4)) is None
    s = store.stats()
    assert (s["hits"], s["misses"], s["writes"], s["blocks"]) == (3, 1, 3, 3)
    assert not list(tmp_path.rglob("*.tmp"))


def test_dedup(tmp_path: Path) -> None:
    store = FileStore(tmp_path, NS)
    assert store.put(key_of(1), payload_of(1))
    mtime = store.path(key_of(1)).stat().st_mtime_ns
    assert not store.put(key_of(1), payload_of(1))
    assert store.writes == 1 and len(store) == 1
    assert store.path(key_of(1)).stat().st_mtime_ns == mtime  # not rewritten


def test_lru_eviction_by_bytes_calls_on_evict(tmp_path: Path) -> None:
    evicted: list[tuple[bytes, bytes]] = []
    probe = FileStore(tmp_path / "probe", NS)
    probe.put(key_of(0), payload_of(0))
    block = probe.used_bytes
    store = FileStore(tmp_path, NS, capacity_bytes=3 * block, on_evict=lambda k, p: evicted.append((k, p)))
    for i in range(3):
        assert store.put(key_of(i), payload_of(i))
    assert store.used_bytes == 3 * block and not evicted
    assert not store.put(key_of(0), payload_of(0))  # a dedup is a use: 0 is now the newest
    store.put(key_of(3), payload_of(3))
    assert evicted == [(key_of(1), payload_of(1))]
    store.put(key_of(4), payload_of(4))
    assert evicted[-1] == (key_of(2), payload_of(2))
    assert not store.path(key_of(1)).exists() and not store.path(key_of(2)).exists()
    assert store.evictions == 2 and store.used_bytes == 3 * block <= store.capacity_bytes
    assert {p.name for p in kvb_files(tmp_path / NS)} == {key_of(i).hex() + ".kvb" for i in (0, 3, 4)}


def test_get_refreshes_lru(tmp_path: Path) -> None:
    evicted: list[bytes] = []
    store = FileStore(tmp_path, NS, capacity_bytes=10_000, on_evict=lambda k, p: evicted.append(k))
    for i in range(3):
        store.put(key_of(i), payload_of(i, 3000))
    assert store.get(key_of(0)) == payload_of(0, 3000)
    store.put(key_of(3), payload_of(3, 3000))
    assert evicted == [key_of(1)]
    assert store.contains(key_of(0)) and not store.contains(key_of(1))


def test_block_larger_than_capacity_refused(tmp_path: Path) -> None:
    store = FileStore(tmp_path, NS, capacity_bytes=500)
    assert not store.put(key_of(1), payload_of(1, 1000))
    assert not store.path(key_of(1)).exists() and len(store) == 0 and store.writes == 0
    assert store.put(key_of(2), payload_of(2, 100))


def test_warm_start_mtime_order_and_trim(tmp_path: Path) -> None:
    first = FileStore(tmp_path, NS)
    for i in range(5):
        first.put(key_of(i), payload_of(i))
    block = first.used_bytes // 5
    # mtimes decide the order, not write order: 3 is the oldest, then 1, 4, 0, 2
    base = time.time() - 1000
    for rank, i in enumerate((3, 1, 4, 0, 2)):
        os.utime(first.path(key_of(i)), (base + rank, base + rank))

    again = FileStore(tmp_path, NS)
    assert len(again) == 5 and again.used_bytes == first.used_bytes
    assert again.get(key_of(3)) == payload_of(3)  # a hit makes it the newest, on disk too
    assert again.path(key_of(3)).stat().st_mtime > base + 100

    evicted: list[bytes] = []
    small = FileStore(tmp_path, NS, capacity_bytes=2 * block, on_evict=lambda k, p: evicted.append(k))
    assert evicted == [key_of(1), key_of(4), key_of(0)]
    assert len(small) == 2 and small.used_bytes == 2 * block
    assert {p.name for p in kvb_files(tmp_path / NS)} == {key_of(i).hex() + ".kvb" for i in (2, 3)}
    assert small.get(key_of(2)) == payload_of(2) and small.get(key_of(3)) == payload_of(3)


def test_stray_tmp_removed_at_start(tmp_path: Path) -> None:
    store = FileStore(tmp_path, NS)
    store.put(key_of(1), payload_of(1))
    shard = store.path(key_of(1)).parent
    old, fresh = shard / ".dead.1.2.3.tmp", shard / ".live.1.2.4.tmp"
    old.write_bytes(b"half a block")
    fresh.write_bytes(b"being written")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    again = FileStore(tmp_path, NS)
    assert not old.exists() and fresh.exists()  # a live writer's file is left alone
    assert len(again) == 1 and again.get(key_of(1)) == payload_of(1)


def _rewrite_version(data: bytes) -> bytes:
    return data[:4] + struct.pack("<H", FORMAT_VERSION + 1) + data[6:]


def _flip_payload_byte(data: bytes) -> bytes:
    buf = bytearray(data)
    buf[-10] ^= 0x01
    return bytes(buf)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(_flip_payload_byte, id="payload-bit-flip"),
        pytest.param(lambda d: d[:-1], id="truncated"),
        pytest.param(lambda d: d[:20], id="truncated-in-header"),
        pytest.param(lambda d: d + b"\0", id="trailing-bytes"),
        pytest.param(lambda d: b"", id="empty"),
        pytest.param(_rewrite_version, id="other-version"),
        pytest.param(lambda d: b"XXXX" + d[4:], id="bad-magic"),
    ],
)
def test_damaged_file_is_dropped(tmp_path: Path, damage) -> None:
    store = FileStore(tmp_path, NS)
    k, p = key_of(1), payload_of(1)
    store.put(k, p)
    path = store.path(k)
    path.write_bytes(damage(path.read_bytes()))
    assert store.get(k) is None
    assert not path.exists() and store.corrupt == 1 and len(store) == 0 and store.used_bytes == 0
    assert store.put(k, p) and store.get(k) == p  # the tier recovers on the next write


def test_other_namespace_file_rejected(tmp_path: Path) -> None:
    # A file from another layout copied into this namespace's directory (its header says otherwise).
    other = FileStore(tmp_path, "another-layout")
    store = FileStore(tmp_path, NS)
    k = key_of(1)
    other.put(k, payload_of(1))
    store.path(k).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(other.path(k), store.path(k))
    assert store.contains(k)  # cheap: existence only
    assert store.get(k) is None and store.corrupt == 1 and not store.path(k).exists()
    assert other.get(k) == payload_of(1)  # the other namespace is untouched
    # and the namespaces' directories are disjoint to begin with
    assert FileStore(tmp_path, "third").get(k) is None


def test_file_renamed_to_other_key_rejected(tmp_path: Path) -> None:
    store = FileStore(tmp_path, NS)
    a, b = key_of(1), key_of(2)
    store.put(a, payload_of(1))
    store.path(b).parent.mkdir(parents=True, exist_ok=True)
    os.rename(store.path(a), store.path(b))
    assert store.get(b) is None and store.corrupt == 1 and not store.path(b).exists()
    assert store.get(a) is None and store.misses == 1 and len(store) == 0 and store.used_bytes == 0


def block_payload(data: bytes) -> bytes:
    """The payload of a block file (format 1 or 2), read as anyone can: the header is in the clear."""
    prefix = 14 if struct.unpack_from("<H", data, 4)[0] == 1 else 30  # magic, version, digest(s)
    (key_len,) = struct.unpack_from("<H", data, prefix)
    (length,) = struct.unpack_from("<Q", data, prefix + 2 + key_len)
    return data[len(data) - length :]


def forge_block_file(template: bytes, key: bytes, payload: bytes) -> bytes:
    """What a writer of the directory who holds no key can make of a valid file: its header labelled for
    `key`, its payload replaced, and the checksum recomputed as a plain hash (format 1: BLAKE2b of the
    payload, which format 1 accepted; format 2: SHA-256 where the HMAC goes)."""
    version = struct.unpack_from("<H", template, 4)[0]
    prefix = 14 if version == 1 else 30
    signed = template[:prefix] + struct.pack("<H", len(key)) + key + struct.pack("<Q", len(payload))
    if version == 1:
        return signed + hashlib.blake2b(payload, digest_size=16).digest() + payload
    return signed + hashlib.sha256(signed + payload).digest() + payload


def test_forged_block_with_a_plain_checksum_is_refused(tmp_path: Path) -> None:
    store = FileStore(tmp_path, NS)
    k = key_of(1)
    store.put(k, payload_of(1))
    path = store.path(k)
    assert block_payload(path.read_bytes()) == payload_of(1)
    path.write_bytes(forge_block_file(path.read_bytes(), k, payload_of(2)))
    assert store.get(k) is None and store.corrupt == 1 and not path.exists()
    assert store.put(k, payload_of(1)) and store.get(k) == payload_of(1)


def test_block_relabelled_for_another_key_is_refused(tmp_path: Path) -> None:
    # A's valid file copied to B's name, its header's key rewritten to B's (the checksum recomputed).
    store = FileStore(tmp_path, NS)
    a, b = key_of(1), key_of(2)
    store.put(a, payload_of(1))
    store.path(b).parent.mkdir(parents=True, exist_ok=True)
    store.path(b).write_bytes(forge_block_file(store.path(a).read_bytes(), b, payload_of(1)))
    assert store.get(b) is None and store.corrupt == 1 and not store.path(b).exists()
    # and copied as it is
    shutil.copy(store.path(a), store.path(b))
    assert store.get(b) is None and store.corrupt == 2
    assert store.get(a) == payload_of(1)


def _get_within(store: FileStore, key: bytes, release: Path | None = None) -> list[bytes | None]:
    """store.get(key) on a thread, given 60 s (a hang guard, not a timing); a FIFO left in the way
    is opened for writing afterwards so that a reader blocked on it ends."""
    got: list[bytes | None] = []
    t = threading.Thread(target=lambda: got.append(store.get(key)), daemon=True)
    t.start()
    t.join(60)
    if t.is_alive() and release is not None:
        with contextlib.suppress(OSError):
            os.close(os.open(release, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail("get() blocked on a FIFO in a block file's place")
    assert not t.is_alive()
    return got


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_only_regular_files_are_opened(tmp_path: Path, kind: str) -> None:
    store = FileStore(tmp_path / "store", NS)
    k = key_of(1)
    store.put(k, payload_of(1))
    path = store.path(k)
    elsewhere = tmp_path / "elsewhere.kvb"
    os.rename(path, elsewhere)  # a valid block file, outside the store
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        path.symlink_to(elsewhere)
    else:
        path.mkdir()
    assert _get_within(store, k, release=path if kind == "fifo" else None) == [None]
    assert store.corrupt == 1
    assert elsewhere.read_bytes()  # what a symlink pointed to is left alone
    if kind != "directory":
        assert not os.path.lexists(path)  # removed: the block can be written again
    # A put replaces whatever is in the block's place with a regular file, when it can.
    if kind == "fifo":
        os.mkfifo(path)
    if kind != "directory":
        assert store.put(k, payload_of(1)) and store.get(k) == payload_of(1)


def test_stores_with_different_secrets_refuse_each_others_blocks(tmp_path: Path) -> None:
    # Two workers of a shared directory configured with different keys (two deployments, or a forger).
    mine = FileStore(tmp_path, NS, secret=b"deployment-key-one-0123456789")
    theirs = FileStore(tmp_path, NS, secret=b"deployment-key-two-0123456789")
    k = key_of(1)
    theirs.put(k, payload_of(1))
    assert mine.get(k) is None and mine.corrupt == 1
    mine.put(k, payload_of(1))
    assert theirs.get(k) is None and theirs.corrupt == 1
    again = FileStore(tmp_path, NS, secret=b"deployment-key-two-0123456789")
    again.put(k, payload_of(1))
    assert theirs.get(k) == payload_of(1)  # the same key reads what another store wrote
    with pytest.raises(ValueError, match="bytes"):
        FileStore(tmp_path, NS, secret=b"short")


def test_a_file_of_another_layout_is_refused(tmp_path: Path) -> None:
    f32 = FileStore(tmp_path, NS, layout="torch.float32|30x2x16x3x64|368640")
    bf16 = FileStore(tmp_path, NS, layout="torch.bfloat16|30x2x16x3x128|368640")
    k = key_of(1)
    f32.put(k, payload_of(1))
    assert bf16.get(k) is None and bf16.corrupt == 1


def test_a_private_directorys_key_file(tmp_path: Path) -> None:
    store = FileStore(tmp_path, NS)
    key_file = tmp_path / ".tokenmill-kv-key"
    st = key_file.stat()
    assert st.st_mode & 0o777 == 0o600 and st.st_size == 32
    k = key_of(1)
    store.put(k, payload_of(1))
    assert FileStore(tmp_path, NS).get(k) == payload_of(1)  # a restart reads its blocks: the key is kept
    os.chmod(key_file, 0o644)
    with pytest.raises(ValueError, match="0600"):
        FileStore(tmp_path, NS)
    key_file.unlink()
    os.symlink(tmp_path / "anything", key_file)
    with pytest.raises(ValueError, match="not a regular file"):
        FileStore(tmp_path, NS)
    key_file.unlink()
    assert FileStore(tmp_path, NS).get(k) is None  # a new key: the old blocks are refused
    assert not list(tmp_path.glob(".tokenmill-kv-key.*"))


def test_discard(tmp_path: Path) -> None:
    store = FileStore(tmp_path, NS)
    store.put(key_of(1), payload_of(1))
    store.discard(key_of(1))
    store.discard(key_of(2))
    assert len(store) == 0 and store.used_bytes == 0 and not store.path(key_of(1)).exists()


def test_bad_arguments(tmp_path: Path) -> None:
    for namespace in ("", "..", "a/b"):
        with pytest.raises(ValueError):
            FileStore(tmp_path, namespace)
    store = FileStore(tmp_path, NS)
    with pytest.raises(ValueError):
        store.put(b"", b"x")
    with pytest.raises(TypeError):
        store.get("abc")  # type: ignore[arg-type]


def test_block_written_by_another_instance_is_found(tmp_path: Path) -> None:
    mine = FileStore(tmp_path, NS, capacity_bytes=10_000)
    theirs = FileStore(tmp_path, NS)  # as another process on the shared directory would
    k, p = key_of(7), payload_of(7)
    theirs.put(k, p)
    assert len(mine) == 0 and mine.contains(k)
    assert mine.get(k) == p and mine.hits == 1
    assert len(mine) == 1 and mine.used_bytes == file_size(mine, k)  # now counted against our capacity
    # a put of a block already on the shared directory adopts it instead of writing it again
    k2 = key_of(8)
    theirs.put(k2, payload_of(8))
    assert not mine.put(k2, payload_of(8)) and mine.writes == 0 and len(mine) == 2


def test_concurrent_threads(tmp_path: Path) -> None:
    keys = list(range(24))
    payloads = {i: payload_of(i, 2000) for i in keys}
    store = FileStore(tmp_path, NS, capacity_bytes=12 * 2100)
    bad: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            i = rng.choice(keys)
            if rng.random() < 0.5:
                store.put(key_of(i), payloads[i])
            else:
                got = store.get(key_of(i))
                if got is not None and got != payloads[i]:
                    bad.append(f"key {i}: wrong payload")
            if rng.random() < 0.02:
                store.discard(key_of(i))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    assert store.corrupt == 0 and store.evictions > 0 and store.hits > 0
    assert store.used_bytes <= store.capacity_bytes
    indexed = {key_of(i) for i in keys if key_of(i) in store._index}
    assert store.used_bytes == sum(store._index.values())
    assert {p.name for p in kvb_files(tmp_path / NS)} == {k.hex() + ".kvb" for k in indexed}
    assert not list(tmp_path.rglob("*.tmp"))
    for i in keys:
        assert store.get(key_of(i)) in (None, payloads[i])


def _process_writer(root: str, seed: int, rounds: int) -> None:
    store = FileStore(root, NS, capacity_bytes=8 * 4200)
    rng = random.Random(seed)
    for _ in range(rounds):
        i = rng.randrange(16)
        store.put(key_of(i), payload_of(i, 4096))
        got = store.get(key_of(rng.randrange(16)))
        if got is not None and got not in {payload_of(j, 4096) for j in range(16)}:
            raise AssertionError("a reader saw damaged data")


def test_two_processes_share_a_directory(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_process_writer, args=(str(tmp_path), s, 400)) for s in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert not list(tmp_path.rglob("*.tmp"))
    files = kvb_files(tmp_path / NS)
    assert files
    reader = FileStore(tmp_path, NS)
    assert len(reader) == len(files)
    by_hex = {key_of(i).hex(): i for i in range(16)}
    for f in files:
        i = by_hex[f.stem]
        assert reader.get(key_of(i)) == payload_of(i, 4096)
    assert reader.corrupt == 0
