"""What a simulated day produced: GPU-hours, per-request latencies, SLO attainment and the planner's
decisions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tokenmill.cluster.planner.policy import Decision


@dataclass
class SimResult:
    name: str
    duration_s: float
    gpus_per_worker: int
    gpu_hours: float
    attainment: float  # share of requests within both targets
    requests: int
    finished: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_p50_s: float | None
    itl_p95_s: float | None
    timeline: list[tuple[float, int, int, int]]  # (time, serving, starting, draining) at every change
    decisions: list[Decision] = field(default_factory=list)  # the planner's changes (target != current)
    decide_calls: int = 0
    ttft: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)  # per request; nan: unfinished
    itl: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    ttft_target_s: float = math.inf
    itl_target_s: float = math.inf
    standby: int = 0  # the warm standby pool's size
    warm_starts: int = 0  # workers launched from it
    standby_gpu_hours: float = 0.0  # of gpu_hours: standbys holding a GPU (0 for host-memory standbys)
    standby_host_gb_hours: float = 0.0  # host memory the staged weights take, GB x hours

    def met(self) -> np.ndarray:
        """Per request: both targets met (False for an unfinished one)."""
        return (self.ttft <= self.ttft_target_s) & (self.itl <= self.itl_target_s)

    @property
    def worker_hours(self) -> float:
        """Hours of workers serving, starting or draining (a standby holding a GPU is not a worker)."""
        return (self.gpu_hours - self.standby_gpu_hours) / self.gpus_per_worker

    @property
    def mean_workers(self) -> float:
        return self.worker_hours * 3600 / self.duration_s

    @property
    def peak_workers(self) -> int:
        return max((s + st + d for _, s, st, d in self.timeline), default=0)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "gpu_hours": self.gpu_hours,
            "worker_hours": self.worker_hours,
            "mean_workers": self.mean_workers,
            "peak_workers": self.peak_workers,
            "attainment": self.attainment,
            "requests": self.requests,
            "finished": self.finished,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p95_s": self.ttft_p95_s,
            "itl_p50_s": self.itl_p50_s,
            "itl_p95_s": self.itl_p95_s,
            "decisions": len(self.decisions),
            "scale_ups": sum(1 for d in self.decisions if d.delta > 0),
            "scale_downs": sum(1 for d in self.decisions if d.delta < 0),
            "standby": self.standby,
            "warm_starts": self.warm_starts,
            "standby_gpu_hours": self.standby_gpu_hours,
            "standby_host_gb_hours": self.standby_host_gb_hours,
        }
