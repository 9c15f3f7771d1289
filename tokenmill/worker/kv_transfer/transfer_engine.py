"""Moving KV blocks between workers, in the shape of NVIDIA's NIXL: a worker registers its KV cache as
a memory region; a peer reads blocks of it by descriptor (block ids) and says when it is done.

Two ways across, chosen per peer: on one host the region lives in a shared-memory file that the
reader maps and copies from directly (one memcpy, no socket in the data path); otherwise blocks travel
over a ZeroMQ socket (TCP between hosts). The control messages (describe, read, done) always go over
the socket, so a reader on another host needs nothing but the address.

Messages (multipart, plain bytes and msgpack):
  [b"meta"]                      -> [b"ok", msgpack {shm, shape, dtype, host, layout}]
  [b"read", msgpack [block ids], msgpack [request id, granted block ids, grant]]
                                 -> [b"ok", the blocks' bytes, in order] | [b"err", message]
  [b"check", msgpack [request id, granted block ids, grant]]
                                 -> [b"ok", instance] | [b"err", message]   (the grant still holds)
  [b"done", request id, msgpack [request id, granted block ids, grant]]
                                 -> [b"ok"]   (the reader has what it needed: the blocks may be freed;
                                               a repeated `done` of a request is answered, not counted)

A read over the socket needs a grant: the token the prefill worker handed out with a finished request's
blocks (make_grant, keyed by a secret of this server that only its own scheduler knows), valid for those
blocks until the hold timeout or the reader's `done`. Other blocks (other requests' live KV) are refused.
Readers by shared memory are processes of the same user on the same host; they copy, then ask whether the
grant still holds (`check`): a grant never comes back once void, so one that holds after the copy held
throughout it, and the copy is of the granted request's blocks. One that does not (a proxy that passed
the same answer twice, a hold that lapsed) fails the read, and the reader recomputes. The answer names
the server's instance (a random id of the process), which must be the one whose region the reader
mapped: a server restarted on the same port has a region of its own, and the old mapping is dropped.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import socket
import stat
import threading
import time
import uuid
import warnings
from pathlib import Path

import msgspec
import torch
import zmq

from tokenmill.engine.protocol import secure_socket, worker_secret
from tokenmill.engine.throttled_log import ThrottledWarnings
from tokenmill.worker.kv_transfer.ops import check_grant

log = logging.getLogger(__name__)
_warn = ThrottledWarnings(log)  # for what anyone who reaches the port can provoke

SHM_DIR = Path("/dev/shm")
_DTYPES = {str(d): d for d in (torch.bfloat16, torch.float16, torch.float32, torch.uint8)}


def shared_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Path | None]:
    """A zeroed tensor in shared memory that other processes on this host can map, and the path they
    open it by; a private tensor (and None) where there is no /dev/shm or /proc.

    The file is unlinked at once and reached through this process's open descriptor
    (/proc/PID/fd/N): it cannot outlive the process, however the process ends."""
    proc_fd = Path(f"/proc/{os.getpid()}/fd")
    if not SHM_DIR.is_dir() or not os.access(SHM_DIR, os.W_OK) or not proc_fd.is_dir():
        return torch.zeros(shape, dtype=dtype), None
    path = SHM_DIR / f"tokenmill-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)  # a sparse file: pages are zero until written
        t = torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)
    finally:
        path.unlink()
    return t, proc_fd / str(fd)


_PEER_FD = re.compile(r"/proc/([0-9]{1,10})/fd/([0-9]{1,10})")


def is_region(target: str) -> bool:
    """`target` (a /proc/PID/fd link's) is an unlinked region of shared_kv_tensor's."""
    name = Path(target.removesuffix(" (deleted)"))
    return target.endswith(" (deleted)") and name.parent == SHM_DIR and name.name.startswith("tokenmill-kv-")


def map_peer_region(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A peer's shared KV region, mapped read-only; None (read over the socket instead) unless `path`
    is what `shared_kv_tensor` hands out: /proc/PID/fd/N of a process of this user, open on an unlinked
    `tokenmill-kv-*` file of /dev/shm that is a regular file of exactly the region's size.

    The path comes from a peer, so it is never opened for writing nor created nor grown: a path naming
    any other file (one of ours, or a link to it) is refused and left as it was."""
    if not _PEER_FD.fullmatch(path):
        log.warning("KV transfer: a peer named %r as its shared-memory region: ignored", path[:200])
        return None
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    try:  # no open at all (a FIFO, a device) unless it names a region; checked again on what was opened
        if not is_region(os.readlink(path)):
            log.warning("KV transfer: a peer named %r as its shared-memory region: ignored", path)
            return None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")  # what was opened, whatever the peer does since
        st, shm = os.fstat(fd), os.stat(SHM_DIR)
        if not (
            is_region(target)
            and stat.S_ISREG(st.st_mode)
            and st.st_nlink == 0
            and st.st_uid == os.getuid()
            and st.st_dev == shm.st_dev
            and st.st_size == nbytes
            and nbytes > 0
        ):
            log.warning("KV transfer: a peer named a shared-memory region %r (%s) that is not one: ignored",
                        path, target[:200])  # fmt: skip
            return None
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # read-only memory: this side only ever reads it
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mm, dtype=torch.uint8)
    return flat.view(dtype).view(shape)


def _blocks(kv: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """[n, layers, k/v, tokens, heads, dim]: the blocks of a [layers, k/v, blocks, ...] cache."""
    return kv.index_select(2, torch.tensor(ids, dtype=torch.long, device=kv.device)).movedim(2, 0)


class TransferServer:
    """Serves reads of a registered KV cache to peers, on a thread of its own; collects their `done`s."""

    def __init__(
        self,
        kv: torch.Tensor,
        shm_path: Path | None,
        host: str = "127.0.0.1",
        port: int = 0,
        layout: str = "",
        grant_key: bytes | None = None,
    ) -> None:
        # grant_key: the key grants are checked with (the engine's, the same on all its ranks; None: one
        # of this server's own). layout: what a block's bytes mean beyond shape and dtype (an 8-bit
        # cache's format: int8 and fp8 blocks have the same shape and dtype); peers must agree on it.
        self.kv, self.shm_path, self.layout = kv, shm_path, layout or str(kv.dtype)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # With the workers' shared secret only peers that know it get through the handshake (CURVE, as
        # the engine protocol), and blocks cross the wire encrypted; grants still decide which blocks.
        secure_socket(self._sock, worker_secret(), "tcp://", server=True)
        if port:
            self._bind_fixed(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        # For the scheduler of this worker only (describe()).
        self.grant_key = grant_key if grant_key is not None else secrets.token_bytes(32)
        self.instance = secrets.token_hex(8)  # this process's region, as opposed to a restarted one's
        self._revoked: dict[str, float] = {}  # request id -> its `done`: grants issued before are void
        self._done: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.blocks_served = 0
        self._thread = threading.Thread(target=self._loop, name="kv-transfer-server", daemon=True)
        self._thread.start()

    def _bind_fixed(self, addr: str) -> None:
        # zmq closes a socket on its I/O thread, after close() returns: a server of this process that
        # just closed on this port may hold it a few milliseconds longer. Wait that out, briefly; a port
        # another process holds still fails after the wait.
        deadline = time.monotonic() + 2.0
        while True:
            try:
                self._sock.bind(addr)
                return
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def describe(self) -> dict:
        """What a peer needs to read from here (plain data), and the key of the grants the scheduler
        hands out (`grant_key`: the engine keeps it out of what it tells anyone else)."""
        return {
            "endpoint": self.endpoint,
            "shm": str(self.shm_path) if self.shm_path else None,
            "host": socket.gethostname(),
            "grant_key": self.grant_key.hex(),
        }

    def take_done(self) -> list[str]:
        with self._lock:
            out, self._done = self._done, []
        return out

    def _loop(self) -> None:
        sock = self._sock
        meta = msgspec.msgpack.encode(
            {
                "shm": str(self.shm_path) if self.shm_path else None,
                "shape": list(self.kv.shape),
                "dtype": str(self.kv.dtype),
                "host": socket.gethostname(),
                "layout": self.layout,
                "instance": self.instance,
            }
        )
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            try:
                ident, *frames = sock.recv_multipart()
                # A REQ peer puts an empty frame before its message and wants one before the answer.
                envelope = [ident, b""] if frames and frames[0] == b"" else [ident]
                try:
                    reply = self._answer(frames[len(envelope) - 1 :], meta)
                except (msgspec.DecodeError, ValueError) as e:
                    # Frames that are not MessagePack of the right types, a request id that is not UTF-8:
                    # the sender is told (a REQ peer is not left waiting for its timeout), and the log
                    # gets a line rather than a traceback for each such frame anyone can send.
                    _warn.warning("KV transfer server: refused a malformed request: %s", e)
                    reply = [b"err", b"malformed request"]
                sock.send_multipart([*envelope, *reply], copy=False)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                log.exception("KV transfer server: socket error")
            except Exception:  # a bad request costs its sender an error, never the server
                log.exception("KV transfer server: request failed")

    def _answer(self, frames: list[bytes], meta: bytes) -> list:
        kind = frames[0] if frames else b""
        if kind == b"meta":
            return [b"ok", meta]
        if kind == b"read" and len(frames) == 3:
            ids = msgspec.msgpack.decode(frames[1], type=list[int])
            rid, granted, grant = msgspec.msgpack.decode(frames[2], type=tuple[str, list[int], str])
            now = time.time()
            revoked_at = self._revoked.get(rid, -1.0)
            if not set(ids) <= set(granted) or not check_grant(
                self.grant_key, rid, granted, grant, now, revoked_at
            ):
                return [b"err", b"no grant for these blocks"]
            if any(not 0 <= i < self.kv.shape[2] for i in ids):
                return [b"err", b"block id out of range"]
            data = _blocks(self.kv, ids).contiguous().cpu()
            self.blocks_served += len(ids)
            return [b"ok", data.view(torch.uint8).numpy()]
        if kind == b"check" and len(frames) == 2:
            rid, granted, grant = msgspec.msgpack.decode(frames[1], type=tuple[str, list[int], str])
            revoked_at = self._revoked.get(rid, -1.0)
            if not check_grant(self.grant_key, rid, granted, grant, time.time(), revoked_at):
                return [b"err", b"the grant for these blocks has lapsed"]
            return [b"ok", self.instance.encode()]
        if kind == b"done" and len(frames) == 3:
            rid = frames[1].decode()
            grid, granted, grant = msgspec.msgpack.decode(frames[2], type=tuple[str, list[int], str])
            now = time.time()
            if grid != rid or not check_grant(self.grant_key, rid, granted, grant, now):
                return [b"err", b"no grant for this request"]
            if rid in self._revoked:
                # Said before (a reader that used the same answer twice tells again after its second read
                # failed): the blocks are let go once, or a repeat could stand in for another rank's.
                return [b"ok"]
            if len(self._revoked) > 10_000:  # grants live for a hold timeout; an hour is far longer
                self._revoked = {r: t for r, t in self._revoked.items() if t > now - 3600}
            self._revoked[rid] = now
            with self._lock:
                self._done.append(rid)
            return [b"ok"]
        return [b"err", b"unknown request"]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.close(0)
        if self.shm_path is not None:
            with contextlib.suppress(OSError, ValueError):
                # Peers' mappings (and ours) stay valid; new peers fall back to TCP.
                os.close(int(self.shm_path.name))


class TransferError(RuntimeError):
    pass


class TransferTimeout(TransferError):
    """The peer did not answer in time: gone, or wedged (not a refusal)."""


class TransferClient:
    """Reads blocks from peers' TransferServers into a local KV cache. One thread uses it (sockets are
    not thread-safe); a peer's shared-memory region is mapped once and kept."""

    def __init__(
        self, kv: torch.Tensor, timeout_s: float = 10.0, use_shm: bool = True, layout: str = ""
    ) -> None:
        self.kv, self.timeout_s, self.use_shm = kv, timeout_s, use_shm
        self.layout = layout or str(kv.dtype)
        self._checked: set[str] = set()
        self._ctx = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket] = {}
        self._regions: dict[str, torch.Tensor | None] = {}
        self._instances: dict[str, str] = {}  # endpoint -> the instance whose region is mapped
        self.blocks_by_shm = self.blocks_by_tcp = 0

    def _call(self, endpoint: str, *frames: bytes) -> list[bytes]:
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = self._socks[endpoint] = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            secure_socket(sock, worker_secret(), endpoint, server=False)
            sock.connect(endpoint)
        sock.send_multipart(list(frames))
        if not sock.poll(int(self.timeout_s * 1000)):
            # A REQ socket that missed its answer cannot ask again: drop it (a late answer is lost).
            sock.close(0)
            del self._socks[endpoint]
            raise TransferTimeout(f"{endpoint} did not answer within {self.timeout_s:.0f}s")
        reply = sock.recv_multipart()
        if reply[0] != b"ok":
            raise TransferError(f"{endpoint}: {reply[1].decode(errors='replace') if len(reply) > 1 else '?'}")
        return reply[1:]

    def _region(self, endpoint: str) -> torch.Tensor | None:
        """The peer's cache mapped from shared memory, when it is on this host with the same layout.
        First contact with a peer checks that its blocks mean what ours do (TransferError if not)."""
        if endpoint in self._regions:
            return self._regions[endpoint]
        region = None
        meta = msgspec.msgpack.decode(self._call(endpoint, b"meta")[0])
        theirs = meta.get("layout", meta.get("dtype"))
        shape = tuple(meta["shape"])
        if theirs != self.layout or shape[:2] + shape[3:] != self.kv.shape[:2] + self.kv.shape[3:]:
            raise TransferError(
                f"{endpoint} holds KV blocks of another layout ({theirs}, rows {meta['shape'][3:]}; here "
                f"{self.layout}, rows {list(self.kv.shape[3:])}): prefill and decode workers need the same "
                "model, dtype and --kv-cache-dtype"
            )
        if self.use_shm:
            path, dtype = meta.get("shm"), _DTYPES.get(meta["dtype"])
            if isinstance(path, str) and dtype == self.kv.dtype and meta.get("host") == socket.gethostname():
                region = map_peer_region(path, shape, dtype)
        self._regions[endpoint] = region
        self._instances[endpoint] = str(meta.get("instance", ""))
        return region

    def read(
        self,
        endpoint: str,
        remote_ids: list[int],
        local_ids: list[int],
        grant: tuple[str, list[int], str] = ("", [], ""),
    ) -> None:
        """Copy the peer's blocks `remote_ids` into this cache's blocks `local_ids`; `grant`: (request
        id, its block ids, the token) as the prefill worker handed them out."""
        if not remote_ids:
            return
        kv = self.kv
        dst = torch.tensor(local_ids, dtype=torch.long, device=kv.device)
        region = self._region(endpoint)
        if region is not None:
            if not set(remote_ids) <= set(grant[1]):
                raise TransferError(f"{endpoint}: no grant for these blocks")
            kv.index_copy_(2, dst, _blocks(region, remote_ids).movedim(0, 2).to(kv.device))
            (instance,) = self._call(endpoint, b"check", msgspec.msgpack.encode(list(grant)))  # or void
            if instance.decode() != self._instances.get(endpoint):
                self._regions.pop(endpoint, None)  # a restarted server: map its region at the next read
                raise TransferError(f"{endpoint} restarted since its region was mapped")
            self.blocks_by_shm += len(remote_ids)
            return
        (data,) = self._call(
            endpoint, b"read", msgspec.msgpack.encode(remote_ids), msgspec.msgpack.encode(list(grant))
        )
        shape = (len(remote_ids), *kv.shape[:2], *kv.shape[3:])
        blocks = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kv.dtype).reshape(shape)
        kv.index_copy_(2, dst, blocks.movedim(0, 2).to(kv.device))
        self.blocks_by_tcp += len(remote_ids)

    def done(self, endpoint: str, request_id: str, grant: tuple[str, list[int], str] = ("", [], "")) -> None:
        self._call(endpoint, b"done", request_id.encode(), msgspec.msgpack.encode(list(grant)))

    def close(self) -> None:
        for s in self._socks.values():
            s.close(0)
        self._socks.clear()
        self._regions.clear()
