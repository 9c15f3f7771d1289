"""Issue 51 item 1: a worker served with `tokenmill worker --listen tcp://...` against clients that
attack it. Each test here is the attacking client: a malformed kv_transfer, a transfer peer that names
a file of ours as its shared memory, a frontend without the shared secret, one that aborts or stops
what is not its own. The worker must go on serving the frontend that is allowed to use it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
from procs import stop, worker_process
from server_fixture import free_port

from tokenmill import SamplingParams
from tokenmill.engine.block_hash import extend_block_hashes
from tokenmill.engine.client import EngineDeadError, ZmqEngineClient
from tokenmill.engine.protocol import (
    AbortRequests,
    AddRequest,
    Challenge,
    Dead,
    EngineRequest,
    Hello,
    Ready,
    Rejected,
    Shutdown,
    StepOutputs,
    decode_from_engine,
    encode,
    hello_mac,
    secure_socket,
)
from tokenmill.worker.kv_transfer.ops import make_grant
from tokenmill.worker.kv_transfer.transfer_engine import TransferClient, TransferError, TransferServer

SECRET = b"correct horse battery staple"
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)


# -- a transfer peer that lies -------------------------------------------------------------------------
class FakePeer:
    """A transfer server that answers `meta` with what the test says (a path of its choosing as the
    shared-memory region) and refuses reads: an attacker a worker was told to read blocks from."""

    def __init__(self, meta: dict, secret: bytes | None = None) -> None:
        self.meta = meta
        self.asked: list[bytes] = []
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_socket(self.sock, secret, "tcp://", server=True)  # an insider: it knows the secret
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, *frames = self.sock.recv_multipart()
            env = [ident, b""] if frames and frames[0] == b"" else [ident]
            frames = frames[len(env) - 1 :]
            self.asked.append(frames[0])
            if frames[0] == b"meta":
                reply = [b"ok", msgspec.msgpack.encode(self.meta)]
            elif frames[0] == b"done":
                reply = [b"ok"]
            else:
                reply = [b"err", b"no"]
            self.sock.send_multipart([*env, *reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def _victim(tmp_path: Path) -> tuple[Path, bytes]:
    victim = tmp_path / "victim.txt"
    content = b"precious data the worker must never touch\n"  # 42 bytes, as in the report
    victim.write_bytes(content)
    return victim, content


def test_a_peer_naming_a_file_as_its_shared_memory_gets_it_neither_mapped_nor_changed(tmp_path) -> None:
    shape = (2, 2, 64, 4, 2, 8)
    victim, content = _victim(tmp_path)
    held = os.open(victim, os.O_RDWR)  # /proc/PID/fd/N of a file that is not a KV region
    meta = {"shape": list(shape), "dtype": "torch.float32", "layout": "torch.float32",
            "host": __import__("socket").gethostname()}  # fmt: skip
    # A file of /dev/shm named like a region but not one (still linked: anyone's file of that name).
    nbytes = 4 * torch.zeros(shape).numel()
    fake = Path("/dev/shm") / f"tokenmill-kv-{os.getpid()}-notaregion"
    fake.write_bytes(b"x" * nbytes)
    held_fake = os.open(fake, os.O_RDWR)
    try:
        for path in (str(victim), f"/proc/{os.getpid()}/fd/{held}", f"/proc/self/fd/{held}",
                     f"/proc/{os.getpid()}/fd/{held}/../{held}", str(fake),
                     f"/proc/{os.getpid()}/fd/{held_fake}"):  # fmt: skip
            peer = FakePeer({**meta, "shm": path})
            client = TransferClient(torch.zeros(shape), timeout_s=3)
            try:
                with pytest.raises(TransferError):  # no region: the read goes to the socket, refused
                    client.read(peer.endpoint, [0, 1], [0, 1])
                assert client.blocks_by_shm == 0
            finally:
                client.close()
                peer.close()
            assert victim.stat().st_size == len(content) and victim.read_bytes() == content, path
            assert fake.read_bytes() == b"x" * nbytes
    finally:
        os.close(held)
        os.close(held_fake)
        fake.unlink()


def test_kv_block_reads_need_the_grant_of_a_request() -> None:
    """The transfer port serves a block only to a reader holding the grant the prefill worker gave out
    with that request's blocks; other blocks (other tenants' live KV) are refused, and so is a grant
    made up, expired, or of a request its reader said it is done with."""
    shape = (1, 2, 8, 4, 1, 8)
    kv = torch.randn(shape)
    server = TransferServer(kv, None)
    key = bytes.fromhex(server.describe()["grant_key"])
    now = time.time()
    grant = ("req-1", [2, 3], make_grant(key, "req-1", [2, 3], now, now + 60))
    dst = torch.zeros(shape)
    client = TransferClient(dst, timeout_s=3, use_shm=False)
    try:
        for ids, g in [
            ([5], ("", [], "")),  # no grant at all
            ([5], grant),  # a grant for other blocks
            ([5], ("req-1", [2, 3, 5], grant[2])),  # a grant stretched to other blocks
            ([2], ("req-1", [2, 3], "1.0.9999999999.0." + "0" * 64)),  # a made-up grant
            ([2], ("req-1", [2, 3], make_grant(b"k" * 32, "req-1", [2, 3], now, now + 60))),  # another key
            ([2], ("req-1", [2, 3], make_grant(key, "req-1", [2, 3], now - 9, now - 1))),  # expired
        ]:
            with pytest.raises(TransferError, match="grant"):
                client.read(server.endpoint, ids, [0], g)
        with pytest.raises(TransferError, match="grant"):  # nobody else may end the hold either
            client.done(server.endpoint, "req-1")
        assert not dst.any() and server.take_done() == []
        client.read(server.endpoint, [3, 2], [0, 1], grant)
        assert torch.equal(dst[:, :, 0], kv[:, :, 3]) and torch.equal(dst[:, :, 1], kv[:, :, 2])
        client.done(server.endpoint, "req-1", grant)
        assert server.take_done() == ["req-1"]
        with pytest.raises(TransferError, match="grant"):  # done: the blocks may hold others' KV soon
            client.read(server.endpoint, [2], [0], grant)
    finally:
        client.close()
        server.close()


# -- a worker process and clients of its engine protocol -----------------------------------------------
class RawClient:
    """A DEALER speaking the engine protocol by hand, with or without the secret (`secret` for the
    Hello's proof; `curve`: the secret its CURVE keys come from, by default the same)."""

    def __init__(self, url: str, secret: bytes | None = None, curve: bytes | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_socket(self.sock, curve or secret, url, server=False)
        self.sock.connect(url)
        self.secret = secret
        self.msgs: list = []

    def send(self, msg) -> None:
        with contextlib.suppress(zmq.Again):  # no connection (a refused handshake): nothing goes out
            self.sock.send(encode(msg), zmq.NOBLOCK)

    def recv(self, timeout: float):
        if not self.sock.poll(int(timeout * 1000)):
            return None
        msg = decode_from_engine(self.sock.recv())
        self.msgs.append(msg)
        return msg

    def hello(self, timeout: float = 600):
        """Ready, a Challenge this client cannot answer, Dead, or None (no answer in time)."""
        self.send(Hello())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.recv(0.5)
            if isinstance(msg, Challenge):
                if self.secret is None:
                    return msg
                self.send(Hello(hello_mac(self.secret, msg.nonce)))
            elif isinstance(msg, (Ready, Dead)):
                return msg
        return None

    def outcome(self, rid: str, timeout: float = 60) -> str | list[int]:
        """The tokens of request `rid`, or 'rejected: ...', or 'nothing' (no word of it in time)."""
        tokens: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.recv(0.2)
            if isinstance(msg, Rejected) and msg.request_id == rid:
                return f"rejected: {msg.message}"
            if isinstance(msg, StepOutputs):
                for out in msg.outputs:
                    if out.request_id == rid:
                        tokens += out.new_token_ids
                        if out.finish_reason is not None:
                            return tokens if out.finish_reason != "abort" else "aborted"
        return "nothing"

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def worker():
    events, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    with worker_process(
        "--dtype", "float32", "--kv-role", "both",
        "--kv-events", "--kv-events-endpoint", events, "--kv-events-replay-endpoint", replay,
        env={"TOKENMILL_WORKER_SECRET": SECRET.decode()},
    ) as (url, proc):  # fmt: skip
        front = RawClient(url, SECRET)
        try:
            ready = front.hello()
            assert isinstance(ready, Ready), ready
            yield url, proc, front, ready.info
        finally:
            front.close()


def _prompt(n: int = 70, seed: int = 3) -> list[int]:
    """A prompt of its own for each seed (no prefix cache hits between tests)."""
    return [(7 * i + seed) % 500 + 10 for i in range(n)]


@pytest.mark.slow  # a worker process with the embedded model
def test_malformed_kv_transfer_fails_its_request_not_the_engine(worker) -> None:
    url, proc, front, info = worker
    bs = info["block_size"]
    ok = {"endpoint": "tcp://127.0.0.1:1", "request_id": "p", "block_ids": [0, 1], "block_size": bs}
    bad = [
        {"remote": "tcp://x"},
        {"remote": {**ok, "block_ids": None}},
        {"remote": {**ok, "block_ids": [-1, 2]}},
        {"remote": {**ok, "block_ids": ["a"]}},
        {"remote": {**ok, "endpoint": 5}},
        {"remote": {**ok, "endpoint": "ipc:///tmp/x"}},
        {"remote": {k: v for k, v in ok.items() if k != "request_id"}},
        {"remote": {**ok, "block_size": bs + 1}},
        {"do_remote_decode": "yes"},
        {"remote": [1, 2]},
        {"surprise": 1},
    ]
    for i, kt in enumerate(bad):
        front.send(AddRequest(EngineRequest(f"bad-{i}", _prompt(), GREEDY, kv_transfer=kt)))
        got = front.outcome(f"bad-{i}", timeout=30)
        assert isinstance(got, str) and got.startswith("rejected: kv_transfer"), (kt, got)
    front.send(AddRequest(EngineRequest("good-after-bad", _prompt(), GREEDY)))
    got = front.outcome("good-after-bad")
    assert isinstance(got, list) and len(got) == 4
    assert proc.poll() is None


@pytest.mark.slow  # a worker process with the embedded model
def test_a_remote_that_names_a_file_of_the_workers_leaves_it_untouched(worker, tmp_path, monkeypatch) -> None:
    """The reported attack: an AddRequest whose remote endpoint is the attacker, who answers with a
    path of the worker's user as its shared memory. The worker must not map it (the file keeps its size
    and bytes): it recomputes the prompt and answers."""
    url, proc, front, info = worker
    victim, content = _victim(tmp_path)
    # The worker's own transfer server says what shape its KV cache has; the attacker (who knows the
    # secret: without it the worker would not even finish a handshake with it) copies it.
    monkeypatch.setenv("TOKENMILL_WORKER_SECRET", SECRET.decode())
    real = TransferClient(torch.zeros(1), 3, use_shm=False)._call(info["kv_transfer"]["endpoint"], b"meta")[0]
    meta = msgspec.msgpack.decode(real)
    peer = FakePeer({**meta, "shm": str(victim)}, SECRET)
    try:
        # The attacker knows the prompt, so it names the right last block: the worker goes on to read.
        prompt, hashes = _prompt(seed=11), []
        extend_block_hashes(hashes, prompt, info["block_size"], None)
        remote = {"endpoint": peer.endpoint, "request_id": "evil", "block_ids": [0, 1, 2, 3],
                  "block_size": info["block_size"], "block_hash": hashes[3].hex()}  # fmt: skip
        front.send(AddRequest(EngineRequest("lured", prompt, GREEDY, kv_transfer={"remote": remote})))
        got = front.outcome("lured")
        assert isinstance(got, list) and len(got) == 4, got
        assert b"meta" in peer.asked
    finally:
        peer.close()
    assert victim.stat().st_size == len(content) and victim.read_bytes() == content
    assert proc.poll() is None


@pytest.mark.slow  # a worker process with the embedded model
def test_a_client_without_the_secret_can_do_nothing(worker) -> None:
    url, proc, front, _ = worker
    front.send(AddRequest(EngineRequest("front-long", _prompt(), LONG)))
    # Without the secret, in clear or with CURVE keys of another secret: the handshake never completes.
    for curve in (None, b"guess"):
        stranger = RawClient(url, curve=curve)
        try:
            assert stranger.hello(timeout=3) is None
            stranger.send(AddRequest(EngineRequest("stranger", _prompt(), GREEDY)))
            stranger.send(AbortRequests(["front-long"]))
            stranger.send(Shutdown())
            assert stranger.outcome("stranger", timeout=2) == "nothing"
        finally:
            stranger.close()
    # One that got past the encryption (say the engine's public key leaked) still has to prove it knows
    # the secret: until then nothing it sends has any effect, and a wrong proof is refused.
    stranger = RawClient(url, curve=SECRET)
    try:
        assert isinstance(stranger.hello(), Challenge)
        stranger.send(AddRequest(EngineRequest("stranger", _prompt(), GREEDY)))
        stranger.send(AbortRequests(["front-long"]))
        stranger.send(Shutdown())
        assert stranger.outcome("stranger", timeout=3) == "nothing"
        stranger.secret = b"guess"
        assert isinstance(stranger.hello(), Dead)
        stranger.send(AddRequest(EngineRequest("stranger-2", _prompt(), GREEDY)))
        assert stranger.outcome("stranger-2", timeout=2) == "nothing"
    finally:
        stranger.close()
    got = front.outcome("front-long", timeout=120)
    assert isinstance(got, list) and len(got) == LONG.max_tokens  # neither aborted nor stopped
    assert proc.poll() is None


@pytest.mark.slow  # a worker process with the embedded model
def test_an_authenticated_front_ends_only_its_own_requests_and_cannot_stop_the_worker(worker) -> None:
    url, proc, front, _ = worker
    other = RawClient(url, SECRET)
    try:
        assert isinstance(other.hello(), Ready)
        front.send(AddRequest(EngineRequest("front-owned", _prompt(), LONG)))
        time.sleep(0.3)
        other.send(AbortRequests(["front-owned"]))
        other.send(AddRequest(EngineRequest("front-owned", _prompt(), GREEDY)))  # its id, to take its outputs
        assert other.outcome("front-owned", timeout=10).startswith("rejected: request id already in use")
        other.send(Shutdown())
        got = front.outcome("front-owned", timeout=120)
        assert isinstance(got, list) and len(got) == LONG.max_tokens
        # Its own request it may abort.
        other.send(AddRequest(EngineRequest("other-own", _prompt(), LONG)))
        time.sleep(0.3)
        other.send(AbortRequests(["other-own"]))
        assert other.outcome("other-own", timeout=30) == "aborted"
    finally:
        other.close()
    time.sleep(0.5)
    assert proc.poll() is None


@pytest.mark.slow  # a worker process with the embedded model
def test_a_hello_with_a_wrong_proof_takes_away_a_fronts_say(worker) -> None:
    """Any Hello starts over: a frontend that proved the secret, then says Hello with a wrong proof (its
    connection taken over, or confused), is refused and has no say until it proves the secret again."""
    url, proc, front, _ = worker
    other = RawClient(url, SECRET)
    try:
        assert isinstance(other.hello(), Ready)
        other.send(Hello(b"\x01" * 32))
        assert isinstance(other.recv(10), Dead)
        other.send(AddRequest(EngineRequest("after-bad-hello", _prompt(seed=41), GREEDY)))
        assert other.outcome("after-bad-hello", timeout=3) == "nothing"
        assert isinstance(other.hello(), Ready)  # proved again: served again
        other.send(AddRequest(EngineRequest("after-good-hello", _prompt(seed=41), GREEDY)))
        assert isinstance(other.outcome("after-good-hello"), list)
    finally:
        other.close()
    assert proc.poll() is None


@pytest.mark.slow  # a worker process with the embedded model
def test_the_transfer_port_and_kv_events_answer_only_who_knows_the_secret(worker) -> None:
    """With a secret, the worker's other sockets use its CURVE too: a stranger gets no `meta` from the
    transfer port (it said where the KV lives), no KV events (which prompts were seen), no replay."""
    url, proc, front, info = worker
    transfer, events = info["kv_transfer"]["endpoint"], info["kv_events"]
    ctx = zmq.Context()
    socks = {}
    try:
        for who, secret in (("stranger", None), ("peer", SECRET)):
            req = ctx.socket(zmq.REQ)
            sub = ctx.socket(zmq.SUB)
            dealer = ctx.socket(zmq.DEALER)
            for sock, endpoint in (
                (req, transfer),
                (sub, events["endpoint"]),
                (dealer, events["replay_endpoint"]),
            ):
                sock.setsockopt(zmq.LINGER, 0)
                secure_socket(sock, secret, endpoint, server=False)
                sock.connect(endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            socks[who] = req, sub, dealer
        time.sleep(0.5)  # subscriptions reach the publisher
        front.send(AddRequest(EngineRequest("events", _prompt(seed=29), GREEDY)))
        assert isinstance(front.outcome("events"), list)
        for who, (req, sub, dealer) in socks.items():
            with contextlib.suppress(zmq.Again):  # a stranger's frames may find no connection to go out on
                req.send(b"meta", zmq.NOBLOCK)
                dealer.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
            answered = [bool(s.poll(3000)) for s in (req, sub, dealer)]
            assert answered == ([True] * 3 if who == "peer" else [False] * 3), (who, answered)
        assert socks["peer"][0].recv_multipart()[0] == b"ok"
    finally:
        for group in socks.values():
            for sock in group:
                sock.close(0)
        ctx.term()
    assert proc.poll() is None


@pytest.mark.slow  # a worker process with the embedded model
def test_the_engine_client_answers_the_challenge_and_without_the_secret_says_why(worker, monkeypatch) -> None:
    url, *_ = worker

    async def run(secret: bytes | None, startup_timeout: float = 60) -> list[int]:
        client = ZmqEngineClient(url, startup_timeout=startup_timeout, secret=secret)
        try:
            await client.start()
            q = client.add_request(EngineRequest("via-client", _prompt(), GREEDY))
            tokens: list[int] = []
            while True:
                out = await asyncio.wait_for(q.get(), 60)
                tokens += out.new_token_ids
                if out.finish_reason is not None:
                    return tokens
        finally:
            await client.shutdown()

    assert len(asyncio.run(run(SECRET))) == 4
    monkeypatch.delenv("TOKENMILL_WORKER_SECRET", raising=False)
    monkeypatch.delenv("TOKENMILL_WORKER_SECRET_FILE", raising=False)
    with pytest.raises(EngineDeadError, match="shared secret"):  # no handshake: it says what may be wrong
        asyncio.run(run(None, startup_timeout=3))


# -- loopback unless told otherwise ---------------------------------------------------------------------
def test_sockets_bind_to_loopback_by_default() -> None:
    from tokenmill.cli.main import is_loopback
    from tokenmill.config import KVEventsConfig, KVTransferConfig

    ev = KVEventsConfig()
    assert ev.kv_events_endpoint.startswith("tcp://127.0.0.1:")
    assert ev.kv_events_replay_endpoint is not None and ev.kv_events_replay_endpoint.startswith(
        "tcp://127.0.0.1:"
    )
    assert KVTransferConfig().kv_transfer_host == "127.0.0.1"
    for address in ("tcp://127.0.0.1:7100", "tcp://localhost:1", "tcp://[::1]:7100", "ipc:///tmp/x"):
        assert is_loopback(address), address
    for address in (
        "tcp://0.0.0.0:7100",
        "tcp://*:7100",
        "tcp://10.0.0.5:7100",
        "tcp://[::]:7100",
        "tcp://host:1",
    ):
        assert not is_loopback(address), address


def test_a_worker_listening_beyond_loopback_without_a_secret_warns() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_WORKER_SECRET")}
    url = f"tcp://0.0.0.0:{free_port()}"
    cmd = [sys.executable, "-m", "tokenmill.cli.main", "worker", "--listen", url, "--max-model-len", "256"]
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            deadline = time.monotonic() + 120
            said = ""
            while (
                "without a shared secret" not in said and time.monotonic() < deadline and proc.poll() is None
            ):
                time.sleep(0.2)
                log.seek(0)
                said = log.read()
            assert "without a shared secret" in said and "TOKENMILL_WORKER_SECRET" in said, said[-2000:]
        finally:
            stop(proc)


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path, monkeypatch) -> None:
    from tokenmill.engine.protocol import worker_secret

    monkeypatch.delenv("TOKENMILL_WORKER_SECRET", raising=False)
    monkeypatch.delenv("TOKENMILL_WORKER_SECRET_FILE", raising=False)
    assert worker_secret() is None
    monkeypatch.setenv("TOKENMILL_WORKER_SECRET", " from-env\n")
    assert worker_secret() == b"from-env"
    f = tmp_path / "secret"
    f.write_bytes(b"from-file\n")
    monkeypatch.setenv("TOKENMILL_WORKER_SECRET_FILE", str(f))
    assert worker_secret() == b"from-file"
    assert worker_secret(str(f)) == b"from-file"
    f.write_bytes(b"\n")
    with pytest.raises(ValueError, match="empty"):
        worker_secret()
