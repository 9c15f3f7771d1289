"""What the scheduler's half of the prefill/decode connector tells the worker's half each step (plain
data in SchedulerOutput.kv_connector_metadata)."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field


@dataclass
class RemoteLoad:
    endpoint: str  # the prefill worker's transfer server
    remote_request_id: str  # its request, whose blocks it keeps until told we are done
    remote_block_ids: list[int]
    local_block_ids: list[int]
    # The prefill worker's grant: (its request id, all the block ids it granted, the token).
    grant: tuple[str, list[int], str] = ("", [], "")
    # Under tensor or pipeline parallelism, each prefill rank's transfer server in rank order: rank i
    # of this engine reads its part of the blocks from rank i there (empty: `endpoint` for all).
    endpoints: list[str] = field(default_factory=list)

    def endpoint_for(self, rank: int) -> str:
        return self.endpoints[rank] if self.endpoints else self.endpoint


@dataclass
class RemoteRelease:
    """A prefill engine's kept blocks this engine did not need: each rank tells its peer it is done."""

    endpoint: str
    remote_request_id: str
    grant: tuple[str, list[int], str] = ("", [], "")
    endpoints: list[str] = field(default_factory=list)

    def endpoint_for(self, rank: int) -> str:
        return self.endpoints[rank] if self.endpoints else self.endpoint


@dataclass
class TransferOps:
    # request id -> blocks to read in the background; the worker reports each request once, with how
    # many leading blocks arrived.
    loads: dict[str, RemoteLoad] = field(default_factory=dict)
    # Prefill workers whose blocks we did not need.
    releases: list[RemoteRelease] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.releases)


def make_grant(key: bytes, request_id: str, block_ids: list[int], issued: float, expires: float) -> str:
    """A token for reading `block_ids` (those of `request_id`) until `expires` (time.time())."""
    times = f"{issued:.3f}.{expires:.3f}"
    body = f"{request_id}|{times}|{','.join(map(str, block_ids))}".encode()
    return f"{times}.{hmac.new(key, body, hashlib.sha256).hexdigest()}"


def check_grant(
    key: bytes, request_id: str, block_ids: list[int], grant: str, now: float, revoked_at: float = -1.0
) -> bool:
    """`grant` is make_grant's for these blocks, not expired, and issued after the request's `done`."""
    try:
        a, b, c, d, _ = grant.split(".")
        issued, expires = float(f"{a}.{b}"), float(f"{c}.{d}")
    except ValueError:
        return False
    if expires < now or issued <= revoked_at or not grant.isascii():
        return False  # (hmac.compare_digest raises TypeError on a str that is not ASCII)
    return hmac.compare_digest(grant, make_grant(key, request_id, block_ids, issued, expires))


def rank_port(port: int, rank: int) -> int:
    """Rank `rank`'s transfer server's port, for a configured `port` (0: any free one), or ValueError."""
    if not port:
        return 0
    if not 0 < port + rank <= 65535:
        raise ValueError(
            f"--kv-transfer-port {port}: rank {rank}'s transfer server would listen on port {port + rank}, "
            "but ports end at 65535 (each rank listens on the port plus its rank): pick a lower port"
        )
    return port + rank
