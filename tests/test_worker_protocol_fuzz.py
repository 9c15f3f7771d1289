"""Issue 51: the engine worker protocol is fuzzed, as `tokenmill worker --listen tcp://...` speaks it.

A real worker process (the embedded model, a shared secret, `--kv-role both` so it also opens its KV
transfer port) gets bounded, seeded batches of junk from clients that attack it:

- on the engine port, from a frontend that got past the CURVE encryption (as if the engine's public key
  had leaked) but never proved it knows the secret, and from one that did authenticate: random bytes,
  truncated and bit-flipped valid frames, wrong multipart frame counts, frames of megabytes, and
  structurally valid MessagePack with a wrong value in each field of every message, down to the
  sampling parameters and the kv_transfer parameters, generated from the message definitions themselves
  (so a field added later is fuzzed too, and the test says so if it is not);
- on the engine port below ZeroMQ: raw TCP bytes and broken ZMTP greetings;
- on the KV transfer port: reads and dones with no grant, mutated grants, and malformed frames.

After each batch the properties are: the worker process is alive; an authenticated legitimate client
(tokenmill's own ZmqEngineClient) still gets the same greedy answer the fresh worker gave; nothing
unauthenticated was ever answered with Ready, StepOutputs or Rejected; every request the authenticated
fuzzer got accepted ends (rejected, finished or aborted, never with an engine error: the engine checks a
request's inputs when it arrives); the transfer port serves blocks only for a genuine grant, and the
blocks it serves are the worker's. Everything is bounded (hypothesis with derandomize and a few examples,
or random.Random with a fixed seed) and takes about a minute on two cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import random
import socket
import time
import typing
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from procs import worker_process

from tokenmill import SamplingParams
from tokenmill.engine.client import EngineDeadError, ZmqEngineClient
from tokenmill.engine.pd_connector import KVTransferParams, RemoteBlocks
from tokenmill.engine.protocol import (
    SECRET_ENV,
    AbortRequests,
    AddRequest,
    Challenge,
    Dead,
    EngineRequest,
    FinishReason,
    FinishRequests,
    FromEngine,
    Hello,
    Ready,
    Rejected,
    Shutdown,
    StepOutputs,
    ToEngine,
    decode_from_engine,
    decode_to_engine,
    encode,
    hello_mac,
    secure_socket,
)
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import StructuredOutputs
from tokenmill.worker.kv_transfer.transfer_engine import TransferClient, map_peer_region

pytestmark = pytest.mark.slow  # a worker process with the embedded model

SECRET = b"the fuzzer knows this only when it plays the legitimate frontend"
# The legitimate client's request: shorter than a KV block and salted per check, so no answer comes from
# the prefix cache and every check computes the same thing the same way as the first.
CHECK_PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]
CHECK_PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
SETTINGS = settings(
    derandomize=True,  # the same batches every run
    database=None,
    deadline=None,  # an example is a batch plus an end-to-end check: seconds, and that is fine
    # No shrinking: once the worker is dead every smaller batch fails too, and shrinking would report an
    # empty one. The failing batch is reported as generated.
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)
Path = tuple[str | int, ...]


# -- the worker and its legitimate client ----------------------------------------------------------------
@dataclasses.dataclass
class Worker:
    url: str
    proc: Any  # subprocess.Popen
    info: dict[str, Any]  # the Ready's: block_size, kv_transfer endpoint, ...
    baseline: list[int]  # the greedy answer of the fresh worker to the legitimate request
    checks: int = 0


async def _ask(url: str, rid: str) -> tuple[list[int], dict[str, Any]]:
    client = ZmqEngineClient(url, startup_timeout=60, secret=SECRET)
    try:
        await client.start()
        q = client.add_request(EngineRequest(rid, CHECK_PROMPT, CHECK_PARAMS, cache_salt=rid))
        tokens: list[int] = []
        while True:
            out = await asyncio.wait_for(q.get(), 120)  # a bound, so a hung worker fails the test
            tokens += out.new_token_ids
            if out.finish_reason is not None:
                assert out.finish_reason == FinishReason.LENGTH, out
                return tokens, client.info
    finally:
        await client.shutdown()


def still_serves(w: Worker, after: str) -> None:
    """The property after each batch: the worker lives and answers the legitimate client as at first."""
    assert w.proc.poll() is None, f"the worker exited ({w.proc.returncode}) after {after}"
    w.checks += 1
    try:
        tokens, _ = asyncio.run(_ask(w.url, f"legit-{w.checks}"))
    except EngineDeadError as e:  # say whether it died meanwhile (its log is printed at teardown)
        raise AssertionError(f"after {after}: {e} (worker exit code {w.proc.poll()})") from None
    assert tokens == w.baseline, f"after {after} the legitimate client got {tokens}, not {w.baseline}"


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    args = ("--dtype", "float32", "--kv-role", "both")  # --kv-role both: it opens its KV transfer port too
    with worker_process(*args, env={SECRET_ENV: SECRET.decode()}) as (url, proc):
        tokens, info = asyncio.run(_ask(url, "legit-baseline"))
        assert len(tokens) == CHECK_PARAMS.max_tokens
        yield Worker(url, proc, info, tokens)
        # Raised inside worker_process, so a worker that died says why (its log) in the test output.
        assert proc.poll() is None, f"the worker exited ({proc.returncode}) during the fuzz tests"


# -- fuzzing clients of the engine port ------------------------------------------------------------------
class FuzzClient:
    """A DEALER with CURVE keys from the secret (past the encryption, as if the engine's public key had
    leaked); `authenticate`: it also proves it knows the secret, else it only says Hello and is
    challenged. Whatever the worker answers must be a message of the protocol."""

    def __init__(self, url: str, authenticate: bool) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)  # keep every answer: none may be dropped before we count it
        # A worker that stops reading shows as a send that cannot complete (zmq.Again), not a hang here.
        self.sock.setsockopt(zmq.SNDTIMEO, 60_000)
        secure_socket(self.sock, SECRET, url, server=False)
        self.sock.connect(url)
        self.got: list[FromEngine] = []
        self.hello(authenticate)
        self.got.clear()

    def hello(self, authenticate: bool = True) -> None:
        """Say Hello, and prove the secret if `authenticate` (again: any Hello starts over). Challenges
        to Hellos of a batch may still be on their way: the last one is ours (the worker answers in
        order), and if a late one came after it the proof is refused and we ask again."""
        for _ in range(5):
            since = len(self.got)
            self.send([encode(Hello())])
            self.wait_for(Challenge, since)
            self.drain(0.5)
            challenge = [m for m in self.got[since:] if isinstance(m, Challenge)][-1]
            if not authenticate:
                return
            mark = len(self.got)
            self.send([encode(Hello(hello_mac(SECRET, challenge.nonce)))])
            if isinstance(self.wait_for((Ready, Dead), mark), Ready):
                return
        raise AssertionError("the worker refused five proofs of the secret")

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)
        self.drain(0)  # answers are read as they come, so neither side's queue fills up

    def drain(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            data = self.sock.recv()
            self.got.append(decode_from_engine(data))  # anything else from the worker fails the test

    def wait_for(self, kind: type | tuple[type, ...], since: int = 0) -> Any:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self.drain(0.2)
            for msg in self.got[since:]:
                if isinstance(msg, kind):
                    return msg
        raise AssertionError(f"no {kind} from the worker; got {self.got[-5:]}")

    def ends(self) -> dict[str, str]:
        """request id -> how it ended (a finish reason, or "rejected"), from what was received."""
        out: dict[str, str] = {}
        for msg in self.got:
            if isinstance(msg, Rejected):
                out[msg.request_id] = "rejected"
            elif isinstance(msg, StepOutputs):
                for o in msg.outputs:
                    if o.finish_reason == FinishReason.ERROR and getattr(o, "error", None):
                        out[o.request_id] = "error of its own"  # e.g. a grammar that allows no token
                    elif o.finish_reason is not None:
                        out[o.request_id] = str(o.finish_reason)
        return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _local_decode(frame: bytes) -> ToEngine | None:
    """What the worker makes of a frame (the same decoder): the oracle for what it must answer."""
    try:
        return decode_to_engine(frame)
    except Exception:  # whatever a frame is, the worker must drop it and go on (RecursionError too)
        return None


Batch = list[list[bytes] | str]  # multipart messages; a str names one of HUGE's frames


def _materialize(item: list[bytes] | str) -> list[bytes]:
    return [huge_frames()[item]] if isinstance(item, str) else item


def _describe(batch: Batch) -> str:
    return "a batch of " + ", ".join(
        item
        if isinstance(item, str)
        else "+".join(f[:24].hex() + (".." if len(f) > 24 else "") for f in item)
        for item in batch[:40]
    )


def fuzz_unauthenticated(w: Worker, batch: Batch) -> None:
    """A frontend that never proved it knows the secret: it is answered, at most, Challenge or Dead."""
    client = FuzzClient(w.url, authenticate=False)
    try:
        for item in batch:
            client.send(_materialize(item))
        client.drain(0.5)
        still_serves(w, _describe(batch))
        client.drain(0.5)  # anything the batch caused has had a second to arrive
        wrong = [m for m in client.got if not isinstance(m, (Challenge, Dead))]
        assert not wrong, f"an unauthenticated frontend was answered {wrong[:3]} to {_describe(batch)}"
    finally:
        client.close()


def fuzz_authenticated(w: Worker, batch: Batch) -> None:
    """A frontend that knows the secret and sends junk: each request that decodes ends (rejected,
    finished, or aborted by us at the end), never with an engine error, and others are served as before."""
    client = FuzzClient(w.url, authenticate=True)
    try:
        added: set[str] = set()
        finished: set[str] = set()  # ended by the fuzzer's own FinishRequests: no output says so
        authed = True
        for item in batch:
            frames = _materialize(item)
            client.send(frames)
            msg = _local_decode(frames[0]) if len(frames) == 1 else None  # [ident, more]: dropped
            if isinstance(msg, Hello):
                authed = False  # a Hello starts over, and the fuzzer cannot answer the new challenge
            elif isinstance(msg, AddRequest) and authed:
                added.add(msg.request.request_id)
            elif isinstance(msg, FinishRequests) and authed:
                finished.update(msg.request_ids)
        if not authed:
            client.hello()
        client.send([encode(AbortRequests(sorted(added)))])  # what still runs ends now
        want = added - finished
        deadline = time.monotonic() + 120
        while not want <= client.ends().keys() and time.monotonic() < deadline:
            client.drain(0.2)
        ends = client.ends()
        missing = sorted(want - ends.keys())
        assert not missing, f"no end for requests {[m[:40] for m in missing[:5]]} of {_describe(batch)}"
        # Inputs are checked on arrival: a request that got in may fail of its own doing (and is told why),
        # never by an engine fault, which would take the other requests of its step down with it.
        errors = [r for r, e in ends.items() if e == FinishReason.ERROR]
        assert not errors, f"requests ended with an engine error: {errors[:5]} in {_describe(batch)}"
        still_serves(w, _describe(batch))
    finally:
        client.close()


# -- messages as plain data, mutated field by field --------------------------------------------------------
def plain(msg: Any) -> Any:
    """A message as the plain data MessagePack carries (bytes stay bytes, as on the wire)."""
    return msgspec.to_builtins(msg, builtin_types=(bytes,))


def _record(tp: Any) -> Any:
    """`tp`, or the record type inside an optional `tp` (X | None): a dataclass or a msgspec Struct."""
    for t in (tp, *typing.get_args(tp)):
        if (
            typing.get_origin(t) is None
            and isinstance(t, type)
            and (dataclasses.is_dataclass(t) or issubclass(t, msgspec.Struct))
        ):
            return t
    return None


# Fields declared as free-form data whose shape is checked elsewhere: their content is fuzzed by that shape.
FREE_FORM_SCHEMAS: dict[tuple[type, str], type] = {(EngineRequest, "kv_transfer"): KVTransferParams}


def declared_paths(tp: type, prefix: Path = ()) -> list[Path]:
    """Where each field of record type `tp` (and of the records inside it) sits in its plain-data form:
    a tagged array-like Struct is [tag, field, ...], a dataclass or other Struct a map by field name."""
    hints = typing.get_type_hints(tp)
    if dataclasses.is_dataclass(tp):
        names, array_like = [f.name for f in dataclasses.fields(tp)], False
    else:
        names, array_like = list(tp.__struct_fields__), tp.__struct_config__.array_like
    out: list[Path] = []
    for i, name in enumerate(names):
        path = (*prefix, i + 1 if array_like else name)
        out.append(path)
        inner = FREE_FORM_SCHEMAS.get((tp, name)) or _record(hints[name])
        if inner is not None:
            out += declared_paths(inner, path)
    return out


def all_paths(tree: Any, prefix: Path = ()) -> list[Path]:
    """Every place in a plain-data tree (a list's first and last element only: the rest are alike)."""
    out: list[Path] = []
    if isinstance(tree, dict):
        items: list[tuple[Any, Any]] = list(tree.items())
    elif isinstance(tree, list):
        items = [(i, tree[i]) for i in sorted({0, len(tree) - 1})] if tree else []
    else:
        return out
    for key, value in items:
        out.append((*prefix, key))
        out += all_paths(value, (*prefix, key))
    return out


def replaced(tree: Any, path: Path, value: Any) -> Any:
    tree = copy.deepcopy(tree)
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return tree


def removed(tree: Any, path: Path) -> Any:
    tree = copy.deepcopy(tree)
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    return tree


def extended(tree: Any, path: Path, value: Any) -> Any:
    """An unknown key (a map) or one element more (an array) at `path`."""
    tree = copy.deepcopy(tree)
    node = tree
    for key in path:
        node = node[key]
    if isinstance(node, dict):
        node["zz-unknown"] = value
    else:
        node.append(value)
    return tree


def _deep(depth: int) -> msgspec.Raw:
    """An array nested `depth` deep, as raw MessagePack (the encoder would not nest that far itself)."""
    return msgspec.Raw(b"\x91" * depth + b"\xc0")


# A value of each MessagePack type, edge values, and nesting deeper than a decoder's recursion limit.
WRONG_VALUES: list[Any] = [
    None,
    True,
    -1,
    2**64 - 1,
    -(2**63),
    0.5,
    float("nan"),
    float("-inf"),
    "",
    "zz",
    b"\x00\xff",
    [],
    [None, "a", 1],
    {},
    {"k": [1]},
    {1: 2},
    _deep(3000),
    msgspec.Raw(b"\xc1"),  # a byte MessagePack never uses
]


def _base_messages(block_size: int, kv_endpoint: str) -> list[tuple[ToEngine, Path]]:
    """Valid messages with every optional part filled in, and the part of each to mutate."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, stop=["zz"], stop_token_ids=[5],
                            logit_bias={5: 0.5}, seed=3, logprobs=2, min_tokens=1, top_k=4,
                            structured=StructuredOutputs(regex="[a-z ]+"))  # fmt: skip
    req = EngineRequest("base", list(range(20, 40)), params, eos_token_ids=frozenset({2}), cache_salt="s",
                        routing_key="k", priority=1, tenant="t")  # fmt: skip
    # A decode worker's request pointing at this worker's own transfer port with a grant it never gave:
    # the read is refused at once and the prompt recomputed (no timeout to wait for).
    remote = RemoteBlocks(kv_endpoint, "nobody", [0, 1], block_size, "1.000.9999999999.000." + "0" * 64)
    kt = plain(KVTransferParams(do_remote_decode=True, remote=remote))
    with_kt = EngineRequest("base-kt", list(range(40, 80)), params, kv_transfer=kt)
    # An adapter this worker does not serve (LoRA is off here): refused on arrival, however it is spelled.
    lora = LoRARequest("fuzz", 1, "/nonexistent/adapter", "0-0")
    with_lora = EngineRequest("base-lora", list(range(50, 70)), params, lora=lora)
    return [
        (AddRequest(req), ()),
        (AddRequest(with_kt), (1, "kv_transfer")),
        (AddRequest(with_lora), (1, "lora")),
        (Hello(b"not the proof"), ()),
        (AbortRequests(["nobody's"]), ()),
        (FinishRequests(["nobody's"]), ()),
        (Shutdown(), ()),
    ]


def field_frames(block_size: int, kv_endpoint: str) -> list[bytes]:
    """Every field of every message replaced by each of WRONG_VALUES, removed, and given unknown
    neighbours; the tag too. Each AddRequest gets an id of its own (unless its id is what is mutated)."""
    frames: list[bytes] = []
    declared: set[Path] = set()
    seen: set[Path] = set()
    n = 0
    for msg, under in _base_messages(block_size, kv_endpoint):
        tree = plain(msg)
        declared.update(declared_paths(type(msg)))
        paths = [p for p in all_paths(tree) if p[: len(under)] == under]
        seen.update(paths)
        variants: list[Any] = []
        for path in [*paths, ()]:
            if path:
                variants += [replaced(tree, path, v) for v in WRONG_VALUES]
                variants.append(removed(tree, path))
            if isinstance(_at(tree, path), (dict, list)):
                variants += [extended(tree, path, v) for v in WRONG_VALUES]
        variants += [replaced(tree, (0,), tag) for tag in ("add ", "ADD", "", "shutdown", 0)]
        for v in variants:
            n += 1
            request = v[1] if isinstance(msg, AddRequest) and len(v) > 1 else None
            if isinstance(request, dict) and request.get("request_id") == tree[1]["request_id"]:
                request["request_id"] = f"fz-{n}"
            frames.append(msgspec.msgpack.encode(v))
    # Built from the definitions: a field that no frame mutates (say, one added later and not filled in
    # by _base_messages) fails here rather than going unfuzzed.
    unreached = declared - seen
    assert not unreached, f"fields the fuzz frames never mutate: {sorted(map(str, unreached))}"
    return frames


def _at(tree: Any, path: Path) -> Any:
    for key in path:
        tree = tree[key]
    return tree


# -- random junk, as hypothesis draws it -------------------------------------------------------------------
def _valid_trees() -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, stop=["zz"], logit_bias={7: 1.0})
    return [
        plain(m)
        for m in (
            AddRequest(EngineRequest("hyp", list(range(30, 45)), params, cache_salt="hyp")),
            Hello(b"\x01" * 32),
            AbortRequests(["hyp", "nobody's"]),
            FinishRequests(["nobody's"]),
            Shutdown(),
        )
    ]


VALID_TREES = _valid_trees()
VALID_FRAMES = [msgspec.msgpack.encode(t) for t in VALID_TREES]
TREE_PATHS = [all_paths(t) for t in VALID_TREES]


def _cut(frame: bytes, at: int) -> bytes:
    return frame[: at % max(1, len(frame))]


def _flip(frame: bytes, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(frame)
    for at, bit in flips:
        out[at % len(out)] ^= 1 << bit
    return bytes(out)


def _mutate(which: int, at: int, value: Any) -> bytes:
    tree, paths = VALID_TREES[which], TREE_PATHS[which]
    if not paths:
        return msgspec.msgpack.encode(extended(tree, (), value))
    return msgspec.msgpack.encode(replaced(tree, paths[at % len(paths)], value))


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)
single_frames = st.one_of(
    st.binary(max_size=300),
    st.builds(_cut, st.sampled_from(VALID_FRAMES), st.integers(0, 1 << 16)),
    st.builds(
        _flip,
        st.sampled_from(VALID_FRAMES),
        st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 7)), min_size=1, max_size=6),
    ),
    st.builds(_mutate, st.integers(0, len(VALID_TREES) - 1), st.integers(0, 1 << 16), msgpack_values),
    st.sampled_from(VALID_FRAMES),
)
multipart = st.lists(st.binary(max_size=40) | st.sampled_from(VALID_FRAMES), min_size=2, max_size=4)


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    """Up to 30 messages, mostly single frames, and at times one frame of megabytes."""
    batch: Batch = [
        draw(multipart) if draw(st.integers(0, 5)) == 0 else [draw(single_frames)]
        for _ in range(draw(st.integers(1, 30)))
    ]
    if draw(st.booleans()):
        batch.insert(draw(st.integers(0, len(batch))), draw(st.sampled_from(sorted(huge_frames()))))
    return batch


_HUGE: dict[str, bytes] = {}


def huge_frames() -> dict[str, bytes]:
    """Frames of up to a few megabytes, by name (hypothesis reports the name, not the bytes)."""
    if not _HUGE:
        rng = random.Random(51)
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        _HUGE.update(
            {
                "huge:random-4MB": rng.randbytes(4 << 20),
                "huge:prompt-of-600k-tokens": encode(
                    AddRequest(EngineRequest("huge-p", [1] * 600_000, params))
                ),
                "huge:request-id-of-1MB": encode(
                    AddRequest(EngineRequest("i" * (1 << 20), [1, 2, 3], params))
                ),
                "huge:abort-200k-ids": encode(AbortRequests([f"id-{i}" for i in range(200_000)])),
                # Array headers that promise far more than the frame holds.
                "huge:array-header-4G": b"\x92\xa3add\xdd\xff\xff\xff\xff" + b"\x01" * 1000,
                "huge:map-header-4G": b"\x92\xa3add\xdf\xff\xff\xff\xff" + b"\xa1a\x01" * 1000,
                # Nesting far past any decoder's recursion limit, where the protocol lets anything be.
                "huge:nested-100k-in-hello": b"\x93\xa5hello\xc4\x00" + _deep(100_000),
                "huge:nested-100k-in-kv_transfer": msgspec.msgpack.encode(
                    replaced(VALID_TREES[0], (1, "kv_transfer"), {"remote": _deep(100_000)})
                ),
            }
        )
    return _HUGE


# -- the tests ---------------------------------------------------------------------------------------------
def test_every_field_wrong_before_authentication(worker: Worker) -> None:
    frames = field_frames(worker.info["block_size"], worker.info["kv_transfer"]["endpoint"])
    for start in range(0, len(frames), 500):
        fuzz_unauthenticated(worker, [[f] for f in frames[start : start + 500]])


def test_every_field_wrong_after_authentication(worker: Worker) -> None:
    frames = field_frames(worker.info["block_size"], worker.info["kv_transfer"]["endpoint"])
    for start in range(0, len(frames), 500):
        fuzz_authenticated(worker, [[f] for f in frames[start : start + 500]])


@settings(SETTINGS, max_examples=6)
@given(batch=batches())
def test_junk_before_authentication(worker: Worker, batch: Batch) -> None:
    fuzz_unauthenticated(worker, batch)


@settings(SETTINGS, max_examples=8)
@given(batch=batches())
def test_junk_after_authentication(worker: Worker, batch: Batch) -> None:
    fuzz_authenticated(worker, batch)


def test_huge_frames(worker: Worker) -> None:
    """Each frame of megabytes, to a frontend before and after it authenticated (the hypothesis batches
    draw some of them; here all are sent, whatever the draw)."""
    names: Batch = sorted(huge_frames())
    fuzz_unauthenticated(worker, names)
    fuzz_authenticated(worker, names)


def test_junk_below_zeromq(worker: Worker) -> None:
    """Raw TCP at the engine port: random bytes, and ZMTP greetings that are cut, lie about their
    version or mechanism, or go on with junk. libzmq drops such peers; the worker must not notice."""
    host, port = worker.url.removeprefix("tcp://").rsplit(":", 1)
    rng = random.Random(51)
    signature = b"\xff" + b"\x00" * 8 + b"\x7f"
    for i in range(60):
        mechanism = rng.choice([b"CURVE", b"NULL", b"PLAIN", rng.randbytes(5)]).ljust(20, b"\x00")
        greeting = signature + bytes([rng.choice([3, 2, 1, 255]), rng.randrange(256)]) + mechanism
        greeting += bytes([rng.randrange(2)]) + b"\x00" * 31
        payload = [
            rng.randbytes(rng.randrange(1, 4096)),
            greeting[: rng.randrange(1, len(greeting))],
            greeting + rng.randbytes(rng.randrange(1, 2048)),
            # A READY command's frame header claiming a huge body, after a valid-looking greeting.
            greeting + b"\x06" + b"\xff" * 8 + rng.randbytes(64),
        ][i % 4]
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(payload)
            with contextlib.suppress(OSError):
                s.recv(64)  # the greeting libzmq sends, or nothing
    still_serves(worker, "raw TCP junk at the engine port")


# -- the KV transfer port ------------------------------------------------------------------------------
class TransferFuzzer:
    """A DEALER at the worker's transfer port. Each request is followed by a `meta` probe, whose answer
    marks where the request's answers end (a request that was not answered shows as none)."""

    def __init__(self, endpoint: str, curve: bytes | None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, 30_000)
        secure_socket(self.sock, curve, endpoint, server=False)
        self.sock.connect(endpoint)
        self.sock.send_multipart([b"meta"])
        self.meta = self._recv(5)[1] if self.sock.poll(5000) else b""

    def _recv(self, timeout_s: float = 30) -> list[bytes]:
        assert self.sock.poll(int(timeout_s * 1000)), "the KV transfer port stopped answering"
        reply = self.sock.recv_multipart()
        return reply[1:] if reply[:1] == [b""] else reply  # a request that looked like a REQ's

    def ask(self, frames: list[bytes]) -> list[list[bytes]]:
        """The answers to `frames` (without the probe's)."""
        self.sock.send_multipart(frames)
        self.sock.send_multipart([b"meta"])
        # A request that is itself a `meta` is answered just like the probe: wait for both.
        markers = 1 + (_as_read(frames)[:1] == [b"meta"])
        replies = [self._recv()]
        while sum(r == [b"ok", self.meta] for r in replies) < markers:
            replies.append(self._recv())
        return replies[:-1]

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _as_read(frames: list[bytes]) -> list[bytes]:
    """The request the transfer server reads in `frames`: a leading empty frame is a REQ's envelope."""
    return frames[1:] if frames[:1] == [b""] else frames


def _granted_blocks(w: Worker, rid: str, seed: int) -> dict[str, Any]:
    """A prefill request's answer as a decode worker would get it: endpoint, block ids, and the grant."""
    client = FuzzClient(w.url, authenticate=True)
    try:
        prompt = [(31 * i + seed) % 400 + 20 for i in range(3 * w.info["block_size"] + 5)]
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        client.send(
            [encode(AddRequest(EngineRequest(rid, prompt, params, kv_transfer={"do_remote_decode": True})))]
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            client.drain(0.2)
            for msg in client.got:
                for out in msg.outputs if isinstance(msg, StepOutputs) else []:
                    if out.request_id == rid and out.finish_reason is not None:
                        assert out.kv_transfer is not None, out
                        return out.kv_transfer
        raise AssertionError(f"the prefill request {rid} did not finish")
    finally:
        client.close()


def _read_is_served(w: Worker, meta: dict[str, Any], remote: dict[str, Any]) -> None:
    """A reader with the grant gets the blocks over TCP, and they are the worker's (its shared region)."""
    shape, dtype = tuple(meta["shape"]), getattr(torch, meta["dtype"].removeprefix("torch."))
    ids = remote["block_ids"]
    grant = (remote["request_id"], ids, remote["grant"])
    dst = torch.zeros(shape, dtype=dtype)
    client = TransferClient(dst, timeout_s=30, use_shm=False)
    try:
        client.read(remote["endpoint"], ids, ids, grant)
        region = map_peer_region(meta["shm"], shape, dtype)
        assert region is not None, meta
        assert torch.equal(dst[:, :, ids], region[:, :, ids])
        assert dst[:, :, ids].abs().sum() > 0  # real KV, not a zeroed cache
        client.done(remote["endpoint"], remote["request_id"], grant)
    finally:
        client.close()


def _kv_requests(remote: dict[str, Any], rng: random.Random) -> list[list[bytes]]:
    """Requests at the transfer port built from a genuine grant: each part of [ids] and [request id,
    granted ids, grant] replaced by wrong values, stretched, or swapped for random bytes; frame counts off."""
    ids: list[int] = list(remote["block_ids"])
    triple = [remote["request_id"], ids, remote["grant"]]
    grant = remote["grant"]
    triples: list[Any] = [
        ["", [], ""],
        [triple[0], [*ids, ids[-1] + 1], grant],
        [triple[0], ids, grant[:-1] + ("1" if grant.endswith("0") else "0")],  # a different last digit
    ]
    triples += [replaced(triple, p, v) for p in all_paths(triple) for v in WRONG_VALUES]
    triples += [[triple[0], ids, grant.replace(grant.split(".")[2], "9999999999", 1)]]  # a later expiry
    triples += [[triple[0], ids, "1.0.9999999999.0." + "é" * 64], [triple[0], ids, "." * 4 + "x"]]
    reads: list[list[int] | Any] = [ids, [ids[-1] + 1], [-1], [2**63 - 1], [], *WRONG_VALUES[:8]]
    out: list[list[bytes]] = []
    for t in triples:
        tb = msgspec.msgpack.encode(t)
        out.append([b"read", msgspec.msgpack.encode(rng.choice(reads)), tb])
        out.append([b"done", rng.choice([triple[0], "", "x"]).encode(), tb])
    for _ in range(40):
        kind = rng.choice([b"read", b"done", b"meta", b"", rng.randbytes(4)])
        parts = [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(0, 4))]
        out.append([kind, *parts])
    out.append([b"done", b"\xff\xfe", msgspec.msgpack.encode(triple)])  # a request id that is not UTF-8
    out.append([b"read", b"\xdd\xff\xff\xff\xff", msgspec.msgpack.encode(triple)])
    genuine = msgspec.msgpack.encode(triple)
    out += [[b"read", msgspec.msgpack.encode(ids[:1]), genuine], [b"done", triple[0].encode(), genuine]]
    rng.shuffle(out)
    # The genuine grant, first and last: its blocks are served, until its `done` (somewhere between).
    return [
        [b"read", msgspec.msgpack.encode(ids), genuine],
        *out,
        [b"read", msgspec.msgpack.encode(ids), genuine],
    ]


def _transfer_fuzzer(endpoint: str) -> TransferFuzzer:
    """A peer that knows the secret: past the port's CURVE handshake where it has one (keys from the
    workers' secret, as the engine port's), in clear where it has none."""
    for curve in (SECRET, None):
        fuzzer = TransferFuzzer(endpoint, curve)
        if fuzzer.meta:
            return fuzzer
        fuzzer.close()
    raise AssertionError(f"the KV transfer port {endpoint} does not answer `meta`")


def test_kv_transfer_port_serves_only_granted_blocks(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())  # for TransferClient, the legitimate reader
    fuzzer = _transfer_fuzzer(worker.info["kv_transfer"]["endpoint"])
    rng = random.Random(51)
    try:
        meta = msgspec.msgpack.decode(fuzzer.meta)
        block_bytes = 1
        for n in (*meta["shape"][:2], *meta["shape"][3:]):
            block_bytes *= n
        block_bytes *= torch.empty(
            0, dtype=getattr(torch, meta["dtype"].removeprefix("torch."))
        ).element_size()
        for round_ in range(2):
            remote = _granted_blocks(worker, f"prefill-{round_}", seed=round_)
            genuine = (remote["request_id"], list(remote["block_ids"]), remote["grant"])
            revoked, served = False, 0
            for sent in _kv_requests(remote, rng):
                answers, frames = fuzzer.ask(sent), _as_read(sent)
                # Every request is answered, once: a malformed one with an error, not with silence.
                assert len(answers) == 1 and answers[0][0] in (b"ok", b"err"), (sent, answers)
                if answers[0][0] == b"err" or frames[:1] == [b"meta"]:
                    continue
                # An "ok" is right only for the genuine grant, unrevoked, over blocks it covers.
                assert len(frames) == 3, (sent, answers)
                triple = msgspec.msgpack.decode(frames[2], type=tuple[str, list[int], str])
                assert triple == genuine and not revoked, (frames, answers)
                if frames[0] == b"read":
                    asked = msgspec.msgpack.decode(frames[1], type=list[int])
                    assert set(asked) <= set(genuine[1]), frames
                    assert len(answers[0]) == 2 and len(answers[0][1]) == len(asked) * block_bytes
                    served += 1
                else:
                    assert frames[0] == b"done" and frames[1] == genuine[0].encode(), frames
                    revoked = True  # the blocks may hold others' KV from now on
            assert served and revoked  # the genuine grant was honoured, then its `done` ended it
            # A fresh grant still reads, and what it reads is the worker's KV.
            _read_is_served(
                worker, meta, _granted_blocks(worker, f"prefill-check-{round_}", seed=10 + round_)
            )
            still_serves(worker, f"round {round_} of junk at the KV transfer port")
    finally:
        fuzzer.close()
