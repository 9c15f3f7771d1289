"""What the planner sees of the fleet at one moment: plain data, built from the router and the
server's request records in a live fleet, and from the simulated fleet in the simulator, so that one
planner decides in both."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerLoad:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of the worker's KV blocks held by requests


@dataclass
class FleetSnapshot:
    time: float  # when the signals were read (seconds; monotonic in a fleet, simulated time in the simulator)
    serving: int  # workers taking requests (not starting, not draining)
    starting: int = 0  # workers launched and not yet serving
    draining: int = 0  # workers finishing their requests before they stop
    loads: list[WorkerLoad] = field(default_factory=list)  # one per serving worker
    window_s: float = 60.0  # the window the rates and latencies below cover
    requests: int = 0  # requests that arrived in the window
    queue_to_compute: float | None = None  # queue time / compute time of requests finished in the window
    mean_isl: float | None = None  # prompt tokens of requests in the window
    mean_osl: float | None = None  # output tokens
    ttft_p95_s: float | None = None
    itl_p95_s: float | None = None
    # Arrivals in the last `recent_s` (one planner interval): a burst shows here within one interval, in
    # the window's count only a fraction of it. None where the source cannot tell (Prometheus).
    recent_requests: int | None = None
    recent_s: float = 0.0

    @property
    def request_rate(self) -> float:
        return self.requests / self.window_s if self.window_s > 0 else 0.0

    @property
    def waiting(self) -> int:
        return sum(w.num_waiting for w in self.loads)

    @property
    def mean_kv_usage(self) -> float:
        return sum(w.kv_usage for w in self.loads) / len(self.loads) if self.loads else 0.0
