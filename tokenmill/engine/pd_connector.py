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
"""

from __future__ import annotations

import re
import time
from typing import Any

import msgspec

from tokenmill.engine.block_hash import extend_block_hashes
from tokenmill.engine.block_pool import KVBlock
from tokenmill.engine.kv_connector import KVConnectorScheduler
from tokenmill.engine.request import Request
from tokenmill.worker.kv_transfer.ops import RemoteLoad, TransferOps, make_grant

# -- what a request's kv_transfer may say (checked when the request arrives, never in schedule()) ----------
_ENDPOINT = re.compile(r"tcp://[A-Za-z0-9.\-]{1,253}:[0-9]{1,5}|tcp://\[[0-9A-Fa-f:.]{2,45}\]:[0-9]{1,5}")
_MAX_ID = 1 << 31


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
    return msgspec.to_builtins(p)


class PDConnector(KVConnectorScheduler):
    def __init__(
        self,
        block_size: int,
        transfer_info: dict[str, Any],
        hold_timeout_s: float = 60.0,
        max_held_blocks: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.transfer_info = transfer_info  # this worker's transfer server (endpoint, shm), if it serves
        self.hold_timeout_s = hold_timeout_s
        self.ops = TransferOps()
        self._loading: dict[str, int] = {}  # request id -> the first block being read
        self.held: dict[str, float] = {}  # request id -> when its kept blocks are freed regardless
        self.max_held_blocks = max_held_blocks
        self._held_blocks: dict[str, int] = {}  # request id -> its kept blocks
        self.c = {"remote_load_blocks": 0, "remote_loaded_blocks": 0, "remote_load_failures": 0,
                  "remote_load_mismatches": 0, "requests_held": 0, "hold_timeouts": 0,
                  "holds_refused": 0}  # fmt: skip

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
        if n == 0:  # everything it needs is here already: the prefill worker may let go at once
            self.ops.releases.append((remote["endpoint"], remote["request_id"], self._grant(remote)))
        return n, n > 0

    def _same_prompt(self, req: Request, sent: int, block_hash: str) -> bool:
        """The remote blocks are of this request's prompt: its own chain names the last one the same."""
        extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, req.hash_salt)
        hashes = req.block_hashes
        return bool(block_hash) and len(hashes) >= sent and hashes[sent - 1].hex() == block_hash

    def after_alloc(self, req: Request, blocks: list[KVBlock], first: int, background: bool) -> None:
        remote = self._remote(req)
        assert remote is not None and background
        ids = list(remote["block_ids"][first : first + len(blocks)])
        self.ops.loads[req.request_id] = RemoteLoad(
            remote["endpoint"], remote["request_id"], ids, [b.block_id for b in blocks], self._grant(remote)
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
        return True, {
            "endpoint": self.transfer_info["endpoint"],
            "request_id": req.request_id,
            "block_ids": block_ids[:full],
            "block_size": self.block_size,
            # Reading these blocks takes this token; it lapses when they are freed (the hold timeout, or
            # the reader's `done`), so nobody reads them once they hold another request's KV.
            "grant": make_grant(key, req.request_id, block_ids[:full], now, expires),
            "block_hash": req.block_hashes[full - 1].hex(),
        }

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

    def build_meta(self) -> TransferOps | None:
        ops, self.ops = self.ops, TransferOps()
        return ops or None

    def counters(self) -> dict[str, int]:
        return {**self.c, "held_now": len(self.held)}
