"""The scheduler's half of disaggregated prefill and decode: the same connector seam as the offload
tiers, with another worker's pool as the place blocks come from.

A prefill worker gets a request marked `kv_transfer={"do_remote_decode": True}` (and max_tokens 1):
it computes the prompt and, when the request finishes, keeps its blocks and answers with where they
can be read (`request_finished`). A decode worker gets the same request with `{"remote": <that
answer>}`: at admission the prompt's blocks past its own prefix hits are read in the background from
the prefill worker, and the request goes on with the rest (at least the last prompt token, whose
logits give the first output token). A failed or slow read ends the run of good blocks where it
failed: the decode worker recomputes from there, so no request is lost. The prefill worker frees the
blocks when the reader says it is done, or after `hold_timeout_s` if nobody comes.

Under tensor or pipeline parallelism each rank holds its heads' or layers' part of every block and
serves it from a transfer server of its own: the answer lists every rank's endpoint and the engine's
layout, and rank i of the decode engine reads from rank i of the prefill engine. Both engines must
have the same layout; a request whose answer names another is refused on arrival (`check_request`).
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from tokenmill.engine.block_hash import extend_block_hashes
from tokenmill.engine.block_pool import KVBlock
from tokenmill.engine.kv_connector import KVConnectorScheduler, KVSchedulerContext
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.worker.kv_transfer.ops import RemoteLoad, RemoteRelease, TransferOps, make_grant, rank_port

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig

# -- what a request's kv_transfer may say (checked when the request arrives, never in schedule()) ----------
_ENDPOINT = re.compile(r"tcp://[A-Za-z0-9.\-]{1,253}:[0-9]{1,5}|tcp://\[[0-9A-Fa-f:.]{2,45}\]:[0-9]{1,5}")
_MAX_ID = 1 << 31
# Ranks of a prefill engine, at most (tensor x pipeline parallel): a client's answer naming more is
# refused before anything is done per rank.
MAX_RANKS = 1024


class RemoteBlocks(msgspec.Struct, forbid_unknown_fields=True):
    """A prefill worker's answer (`request_finished`), passed on to a decode worker as `remote`."""

    endpoint: str
    request_id: str
    block_ids: list[int]
    block_size: int
    grant: str = ""  # the prefill worker's token for reading these blocks (its transfer port checks it)
    # The chained hash (hex) of the last block: a decode worker reads only if its own prompt hashes the
    # same, so an answer passed with another prompt (a proxy's mistake) is recomputed, never decoded on.
    block_hash: str = ""
    # A prefill engine of several ranks: each rank's transfer server, in rank order, and its layout
    # (a decode engine of another layout cannot read its blocks). Left out by a single-rank engine.
    endpoints: Annotated[list[str], msgspec.Meta(max_length=MAX_RANKS)] = msgspec.field(default_factory=list)
    tp_size: int = 1
    pp_size: int = 1


class KVTransferParams(msgspec.Struct, forbid_unknown_fields=True):
    do_remote_decode: bool = False
    remote: RemoteBlocks | None = None


def validate_kv_transfer(kt: Any, block_size: int, max_model_len: int) -> dict[str, Any] | None:
    """A request's kv_transfer as plain data of the allowed shape, or ValueError (that request fails,
    the engine goes on): known keys of the right types, a tcp:// endpoint, block ids in range and no
    more than a prompt can have, the block size this engine uses."""
    if kt is None:
        return None
    try:
        p = msgspec.convert(kt, KVTransferParams)
    except msgspec.ValidationError as e:
        raise ValueError(f"kv_transfer: {e}") from None
    r = p.remote
    if r is not None:
        port = r.endpoint.rsplit(":", 1)[-1]
        if not _ENDPOINT.fullmatch(r.endpoint) or not 0 < int(port) < 65536:
            raise ValueError(f"kv_transfer.remote.endpoint must be tcp://HOST:PORT, got {r.endpoint[:80]!r}")
        if not 0 < len(r.request_id) <= 1024:
            raise ValueError("kv_transfer.remote.request_id must be 1 to 1024 characters")
        if r.block_size != block_size:
            raise ValueError(f"kv_transfer.remote.block_size is {r.block_size}, this engine's {block_size}")
        too_many = len(r.block_ids) > max_model_len // block_size + 1
        if too_many or any(not 0 <= i < _MAX_ID for i in r.block_ids):
            raise ValueError("kv_transfer.remote.block_ids: too many, or out of range")
        if len(r.grant) > 256 or len(r.block_hash) > 128:
            raise ValueError("kv_transfer.remote.grant or block_hash is too long")
        # The layout is bounded before anything is done per rank: a client's answer costs nothing more.
        world = r.tp_size * r.pp_size
        if r.tp_size < 1 or r.pp_size < 1 or world > MAX_RANKS:
            raise ValueError(
                f"kv_transfer.remote.tp_size and pp_size must be at least 1, tp_size x pp_size at most "
                f"{MAX_RANKS}"
            )
        # Several ranks each serve their own part of the blocks: without every rank's endpoint a rank
        # here would read another's part (of the same shape under tensor parallelism).
        if (r.endpoints or world > 1) and len(r.endpoints) != world:
            raise ValueError(
                "kv_transfer.remote.endpoints must name one endpoint per rank (tp_size x pp_size)"
            )
        for e in r.endpoints:
            if not _ENDPOINT.fullmatch(e) or not 0 < int(e.rsplit(":", 1)[-1]) < 65536:
                raise ValueError(f"kv_transfer.remote.endpoints must be tcp://HOST:PORT, got {e[:80]!r}")
    return msgspec.to_builtins(p)


class PDConnector(KVConnectorScheduler):
    name = "pd"

    def __init__(
        self,
        block_size: int,
        transfer_info: dict[str, Any],
        hold_timeout_s: float = 60.0,
        max_held_blocks: int | None = None,
        endpoints: list[str] | None = None,
        layout: tuple[int, int] = (1, 1),
    ) -> None:
        """`transfer_info`: rank 0's transfer server (endpoint, shm, grant key), if it serves;
        `endpoints`: every rank's, in rank order, for an engine of `layout` (tp, pp) ranks."""
        self.block_size = block_size
        self.transfer_info = transfer_info
        self.endpoints = list(endpoints or [])
        self.layout = layout
        self.hold_timeout_s = hold_timeout_s
        self.ops = TransferOps()
        self._loading: dict[str, int] = {}  # request id -> the first block being read
        # Requests that need none of their prefill engine's blocks: the release goes out once the request
        # is in (computing, or gone), not while it waits (a failed admission asks again) or while another
        # connector's load of its blocks is under way. And only once for each prefill request.
        self._unneeded: dict[str, tuple[Request, RemoteRelease]] = {}
        self._released: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.held: dict[str, float] = {}  # request id -> when its kept blocks are freed regardless
        self.max_held_blocks = max_held_blocks
        self._held_blocks: dict[str, int] = {}  # request id -> its kept blocks
        self.c = {"remote_load_blocks": 0, "remote_loaded_blocks": 0, "remote_load_failures": 0,
                  "remote_load_mismatches": 0, "requests_held": 0, "hold_timeouts": 0,
                  "holds_refused": 0}  # fmt: skip

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        """Every rank's transfer server listens on the configured port plus its rank (when one is set):
        the last one's must be a port."""
        kt = config.kv_transfer
        if kt.serves and kt.kv_transfer_port:
            rank_port(kt.kv_transfer_port, config.parallel.world_size - 1)

    @classmethod
    def build(cls, ctx: KVSchedulerContext) -> PDConnector:
        kt = ctx.config.kv_transfer
        return cls(
            ctx.block_size,
            ctx.worker_info[0],
            kt.kv_hold_timeout_s,
            # Finished prefills waiting for their readers hold at most half the pool: the rest serves
            # the requests running here, whoever sends do_remote_decode.
            max_held_blocks=ctx.num_blocks // 2,
            endpoints=[info.get("endpoint", "") for info in ctx.worker_info] if ctx.world_size > 1 else [],
            layout=(ctx.tp_size, ctx.pp_size),
        )

    def check_request(self, kv_transfer: dict[str, Any] | None) -> None:
        """Blocks of a prefill engine of another tensor x pipeline layout are cut otherwise than ours:
        no rank here could read its part. Refused with the request, not recomputed quietly."""
        remote = (kv_transfer or {}).get("remote")
        if remote is None:
            return
        theirs = (remote.get("tp_size", 1), remote.get("pp_size", 1))
        if theirs != self.layout:
            raise ValueError(
                f"kv_transfer: the prefill engine runs tensor x pipeline parallel {theirs[0]} x {theirs[1]}, "
                f"this one {self.layout[0]} x {self.layout[1]}: disaggregated prefill and decode engines "
                "need the same layout (rank i reads its part of the blocks from rank i)"
            )

    @staticmethod
    def _remote(req: Request) -> dict[str, Any] | None:
        kt = req.kv_transfer
        return kt.get("remote") if kt else None

    @staticmethod
    def _grant(remote: dict[str, Any]) -> tuple[str, list[int], str]:
        return remote["request_id"], list(remote["block_ids"]), remote.get("grant", "")

    def num_external_blocks(self, req: Request, num_local_blocks: int) -> tuple[int, bool]:
        remote = self._remote(req)
        if remote is None:
            return 0, False
        sent = len(remote.get("block_ids", ()))
        limit = min(sent, (req.num_tokens - 1) // self.block_size)
        if limit > num_local_blocks and not self._same_prompt(req, sent, remote.get("block_hash", "")):
            self.c["remote_load_mismatches"] += 1
            limit = 0
        n = max(limit - num_local_blocks, 0)
        if n == 0:  # everything it needs is here already: the prefill worker may let go once it is in
            self._unneeded[req.request_id] = (
                req,
                RemoteRelease(
                    remote["endpoint"], remote["request_id"], self._grant(remote), remote.get("endpoints", [])
                ),
            )
        else:
            self._unneeded.pop(req.request_id, None)
        return n, n > 0

    def _same_prompt(self, req: Request, sent: int, block_hash: str) -> bool:
        """The remote blocks are of this request's prompt: its own chain names the last one the same."""
        extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, req.hash_salt)
        hashes = req.block_hashes
        return bool(block_hash) and len(hashes) >= sent and hashes[sent - 1].hex() == block_hash

    def after_alloc(self, req: Request, blocks: list[KVBlock], first: int, background: bool) -> None:
        remote = self._remote(req)
        assert remote is not None and background
        self._unneeded.pop(req.request_id, None)
        self._released[remote["endpoint"], remote["request_id"]] = None  # its reader tells it when done
        ids = list(remote["block_ids"][first : first + len(blocks)])
        self.ops.loads[req.request_id] = RemoteLoad(
            remote["endpoint"],
            remote["request_id"],
            ids,
            [b.block_id for b in blocks],
            self._grant(remote),
            list(remote.get("endpoints", [])),
        )
        self._loading[req.request_id] = first
        self.c["remote_load_blocks"] += len(blocks)

    def loaded(self, request_id: str, num_ok: int) -> tuple[int, int]:
        first = self._loading.pop(request_id)
        self.c["remote_loaded_blocks"] += num_ok
        return first, num_ok

    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        kt = req.kv_transfer
        if not kt or not kt.get("do_remote_decode") or not self.transfer_info.get("endpoint"):
            return False, None
        # Only full prompt blocks travel: the decode worker computes the partial last block itself.
        full = min(len(block_ids), req.num_prompt_tokens // self.block_size)
        if full == 0:
            return False, None  # a prompt shorter than a block: nothing to read, nothing to keep
        if self.max_held_blocks is not None and sum(self._held_blocks.values()) + full > self.max_held_blocks:
            self.c["holds_refused"] += 1  # the decode side computes this prompt itself
            return False, None
        self._held_blocks[req.request_id] = full
        self.held[req.request_id] = time.monotonic() + self.hold_timeout_s
        self.c["requests_held"] += 1
        now = time.time()
        key = bytes.fromhex(self.transfer_info.get("grant_key", ""))
        extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, req.hash_salt)
        # The grant lapses a little before the scheduler frees the blocks at the hold timeout, so no
        # reader's copy can overlap their reuse.
        expires = now + self.hold_timeout_s - min(1.0, self.hold_timeout_s / 10)
        answer = {
            "endpoint": self.transfer_info["endpoint"],
            "request_id": req.request_id,
            "block_ids": block_ids[:full],
            "block_size": self.block_size,
            # Reading these blocks takes this token; it lapses when they are freed (the hold timeout, or
            # the reader's `done`), so nobody reads them once they hold another request's KV. Every rank's
            # server checks it with the same key.
            "grant": make_grant(key, req.request_id, block_ids[:full], now, expires),
            "block_hash": req.block_hashes[full - 1].hex(),
        }
        if self.endpoints:
            answer.update(endpoints=self.endpoints, tp_size=self.layout[0], pp_size=self.layout[1])
        return True, answer

    def expired(self, now: float) -> list[str]:
        """Held requests nobody came for in time: their blocks are freed."""
        out = [rid for rid, t in self.held.items() if t <= now]
        for rid in out:
            del self.held[rid]
            self._held_blocks.pop(rid, None)
        self.c["hold_timeouts"] += len(out)
        return out

    def released(self, request_ids: list[str]) -> list[str]:
        """Readers said they are done with these: those that were held."""
        out = [rid for rid in request_ids if self.held.pop(rid, None) is not None]
        for rid in out:
            self._held_blocks.pop(rid, None)
        return out

    def on_evicted(self, block: KVBlock) -> None:
        return None  # blocks evicted here are not kept anywhere else

    # Bounded memory of the prefill requests let go (a request preempted and admitted again finds its
    # blocks here again: the prefill engine was told already).
    MAX_RELEASED = 65_536

    def _release_unneeded(self) -> None:
        """Let the prefill engines go of the requests that are in without their blocks: admitted (their
        own tiers' loads ended, or came in within the step) or ended; each prefill request once."""
        waiting = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.WAITING_FOR_KV)
        for rid, (req, release) in list(self._unneeded.items()):
            if req.status in waiting:
                continue
            del self._unneeded[rid]
            key = (release.endpoint, release.remote_request_id)
            if key in self._released:
                continue
            self._released[key] = None
            while len(self._released) > self.MAX_RELEASED:
                self._released.popitem(last=False)
            self.ops.releases.append(release)

    def build_meta(self) -> TransferOps | None:
        if self._unneeded:
            self._release_unneeded()
        ops, self.ops = self.ops, TransferOps()
        return ops or None

    def counters(self) -> dict[str, int]:
        return {**self.c, "held_now": len(self.held)}
