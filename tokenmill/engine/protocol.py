"""The engine protocol: every message between a frontend (or a router) and an engine core, and the
one codec that carries them. Torch-free, so a client or router imports it without the model stack.

Messages are msgspec structs tagged by kind; requests, outputs and stats are dataclasses that msgspec
encodes and decodes by their type annotations (MessagePack on the wire), so adding a field needs no
mapping code.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.step import TokenLogprobs


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"
    ERROR = "error"  # the engine failed on this request (details in the engine's log); others go on


@dataclass
class EngineRequest:
    """What a frontend sends to the engine core (token ids, never text)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs sooner (vLLM's convention)
    cache_salt: str | None = None
    routing_key: str | None = None  # keeps a session on one worker (the router's session policy)
    # Disaggregated serving (engine/pd_connector.py): {"do_remote_decode": True} asks a prefill worker
    # to keep the prompt's blocks for a decode worker; {"remote": {...}} tells a decode worker where to
    # read them. Plain data, as vLLM's kv_transfer_params.
    kv_transfer: dict[str, Any] | None = None
    # The LoRA adapter the request runs on (None: the base model).
    lora: LoRARequest | None = None
    # W3C trace context (traceparent, tracestate) of the span the engine's span hangs from; None: the
    # request is not traced (tokenmill/tracing.py).
    trace_context: dict[str, str] | None = None
    # Who the request is served for (the server's API key name or tenant header): the fair policy's
    # shares and the per-tenant token counts (engine/fairness.py). None: the tenant "default".
    tenant: str | None = None


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_token: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    new_token_times: list[float] = field(default_factory=list)
    # A prefill worker's finished request: where its blocks can be read (see EngineRequest.kv_transfer).
    kv_transfer: dict[str, Any] | None = None
    # A request that ended with ERROR by its own doing (its grammar allows no continuation): why, in
    # words for its client. None for the engine's own faults (its log has those).
    error: str | None = None
    # The prompt's tokens' logprobs (from its second token on), with the request's first output.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # An embedding request's pooled final hidden state: float32, little-endian (compact over msgpack).
    pooled: bytes | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    num_batched_tokens_total: int
    # Speculative decoding, totals since start: draft tokens verified, and how many were accepted,
    # in all and by position in the draft (acceptance falls with the position).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # The KV connector's counters since start (offload tiers or KV transfer: the scheduler's side and the
    # worker's), empty without one.
    kv_connector: dict[str, int] = field(default_factory=dict)
    # Threads the forward passes use now, and how often the thread governor changed that count since
    # start (worker/thread_governor.py: a neighbour crowding the cores); 0 threads where not reported.
    engine_threads: int = 0
    engine_thread_changes: int = 0
    # LoRA (0 slots: off): the adapters in the workers' slots, by name, and the slots no running request
    # holds (where an adapter not resident could be read in at once). The router's LoRA affinity.
    lora_slots: int = 0
    lora_resident: list[str] = field(default_factory=list)
    lora_running: list[str] = field(default_factory=list)  # of those, the ones admitted requests hold
    lora_free_slots: int = 0
    # Tokens served per tenant since start: [prompt tokens computed, tokens generated] (fairness.py).
    tenant_tokens: dict[str, list[int]] = field(default_factory=dict)
    # The worker was told to stop (SIGTERM): it takes no new requests and finishes those it has; a
    # router stops sending it any as soon as it hears this.
    draining: bool = False


# -- frontend -> engine ---------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello", array_like=True):
    """A frontend introduces itself; the engine answers Ready (or Dead) and heartbeats it from then on.

    An engine with a shared secret (`worker_secret()`) answers a Hello without `auth` with a Challenge;
    the frontend says Hello again with auth = hello_mac(secret, the challenge's nonce). Until then the
    engine ignores everything that frontend sends."""

    auth: bytes = b""


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request: EngineRequest


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class FinishRequests(msgspec.Struct, tag="finish", array_like=True):
    """End requests whose stop string the frontend saw."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class ResetPrefixCache(msgspec.Struct, tag="reset_cache", array_like=True):
    """Forget the content of every free cached block (an operator's /flush_cache)."""


# -- engine -> frontend ---------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", array_like=True):
    info: dict[str, Any]  # max_model_len, vocab_size, num_blocks, block_size, load_seconds, model, pid


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    """A step's outputs with the engine's stats; sent empty every half second while idle or in a long
    step (a heartbeat)."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats
    # The engine's time.monotonic() when it sent this: a frontend on another host puts the outputs'
    # timestamps on its own clock with it (engine/engine_clock.py). 0: not stamped.
    sent_at: float = 0.0


class Rejected(msgspec.Struct, tag="reject", array_like=True):
    request_id: str
    message: str
    # Not the request's fault: another engine can take it (this one is draining). A router sends it on.
    retry: bool = False


class Dead(msgspec.Struct, tag="dead", array_like=True):
    message: str


class Challenge(msgspec.Struct, tag="challenge", array_like=True):
    """The engine wants proof that the frontend knows the shared secret (see Hello)."""

    nonce: bytes


ToEngine = Hello | AddRequest | AbortRequests | FinishRequests | Shutdown | ResetPrefixCache
FromEngine = Ready | StepOutputs | Rejected | Dead | Challenge

SECRET_ENV = "TOKENMILL_WORKER_SECRET"
SECRET_FILE_ENV = "TOKENMILL_WORKER_SECRET_FILE"


def worker_secret(secret_file: str | None = None) -> bytes | None:
    """The workers' shared secret: the file given, else $TOKENMILL_WORKER_SECRET_FILE's contents, else
    $TOKENMILL_WORKER_SECRET (surrounding whitespace dropped); None if none is set."""
    path = secret_file or os.environ.get(SECRET_FILE_ENV)
    if path:
        with open(path, "rb") as f:
            value = f.read().strip()
        if not value:
            raise ValueError(f"the secret file {path} is empty")
        return value
    value = os.environ.get(SECRET_ENV, "").strip()
    return value.encode() if value else None


def hello_mac(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, b"tokenmill-engine-hello-v1|" + nonce, hashlib.sha256).digest()


def curve_keys(secret: bytes) -> tuple[bytes, bytes]:
    """The engine's CURVE key pair (Z85: public, secret) derived from the shared secret: over tcp:// the
    engine protocol is encrypted, and a peer that does not know the secret cannot even finish the
    ZeroMQ handshake (it would need the engine's public key)."""
    import zmq
    from zmq.utils import z85

    sk = z85.encode(hmac.new(secret, b"tokenmill-engine-curve-v1", hashlib.sha256).digest())
    return zmq.curve_public(sk), sk


def secure_socket(sock: Any, secret: bytes | None, address: str, server: bool) -> None:
    """CURVE on a tcp:// engine-protocol socket when there is a shared secret (both ends or neither)."""
    if secret is None or not address.startswith("tcp://"):
        return
    import zmq

    public, private = curve_keys(secret)
    if server:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = public, private
    else:
        sock.curve_serverkey = public
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()  # this client's, for this session


_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: ToEngine | FromEngine) -> bytes:
    return _encoder.encode(msg)


def decode_to_engine(data: bytes) -> ToEngine:
    return _to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)
