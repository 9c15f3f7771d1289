"""What the scheduler's half of the prefill/decode connector tells the worker's half each step (plain
data in SchedulerOutput.kv_connector_metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RemoteLoad:
    endpoint: str  # the prefill worker's transfer server
    remote_request_id: str  # its request, whose blocks it keeps until told we are done
    remote_block_ids: list[int]
    local_block_ids: list[int]


@dataclass
class TransferOps:
    # request id -> blocks to read in the background; the worker reports each request once, with how
    # many leading blocks arrived.
    loads: dict[str, RemoteLoad] = field(default_factory=dict)
    # (endpoint, remote request id): prefill workers whose blocks we did not need.
    releases: list[tuple[str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.releases)
