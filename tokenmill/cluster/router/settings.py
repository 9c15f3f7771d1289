"""The router's settings and the bounds of silence it works to."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.cluster.disagg import DisaggSettings
from tokenmill.cluster.policies.base import DEFAULT_PREFILL_WEIGHT

# A worker silent this long gets no new requests: four missed heartbeats (engines beat every 0.5 s,
# during steps too), so a loaded machine's scheduling jitter does not take idle workers out of rotation.
SUSPECT_AFTER_S = 2.0
REJOIN_EVERY_S = 1.0
MAX_RETRIES = 2
RETRY_POLL_S = 0.1  # how often a retry waiting for a worker that answers looks again
# How long the candidates kept for new requests may go unchecked (who answers changes with time).
BOARD_REFRESH_S = 0.1


@dataclass
class RouterSettings:
    policy: str = "kv"
    temperature: float = 0.0
    prefill_weight: float = DEFAULT_PREFILL_WEIGHT
    approx_ttl_s: float = 120.0
    seed: int = 0
    disagg: DisaggSettings | None = None  # prefill/decode disaggregation (cluster/disagg.py)
    # A retry goes only to a worker answering now (heard from within SUSPECT_AFTER_S); with none, it
    # waits this long for one, then the request ends with EngineDeadError (the server's 503).
    retry_wait_s: float = 10.0
    # A request whose worker has sent nothing (no output, no heartbeat: engines beat every half second, during
    # steps too) for this long since the request was sent is lost: retried if it has no token yet, else
    # ended with EngineDeadError, rather than waiting for the client's heartbeat timeout (40 s).
    lost_after_s: float = 10.0
    # Scale to zero (`--workers 0..N` with a planner): with no worker in rotation, a new request waits
    # at the router for one to start rather than failing at once; at most `cold_start_max_waiting` of
    # them (more get EngineDeadError, the server's 503), each at most `cold_start_timeout_s`.
    scale_to_zero: bool = False
    cold_start_timeout_s: float = 120.0
    cold_start_max_waiting: int = 64
    # The router's waiting queue (fleet_queue.py): while every worker is full, new requests wait at the
    # router, and each place that frees goes to the lowest band, then (queue_fair) the tenant served
    # least across the fleet. queue_max_in_flight: a worker's places when it does not say its own.
    queue: bool = False
    queue_fair: bool = False
    queue_max_in_flight: int = 256
    tenant_weights: dict[str, float] | None = None
    fair_input_weight: float = 1.0
    fair_output_weight: float = 2.0
