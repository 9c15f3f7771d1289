"""From a use case to a hardware count: search the deployment shapes, keep those inside the limits,
pick the one that serves the peak load with the fewest servers.

Shapes: tensor parallel TP, pipeline parallel PP (TP x PP GPUs per instance, inside one server or
NVLink domain), expert parallelism for MoE models, and the concurrency C per instance. Instances per
server = GPUs per server // (TP x PP). Every feasible shape is kept as a point of the
throughput-versus-interactivity frontier (output tokens/s per GPU against output tokens/s per user).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tokenmill.bench.workload import WORDS_PER_TOKEN
from tokenmill.extras import require
from tokenmill.sizing.arch import Arch
from tokenmill.sizing.hardware import Factors, Gpu
from tokenmill.sizing.roofline import Deployment, Prediction, predict


def peak_rps(average: float, percentile: float) -> int:
    """Peak requests in a second at the given percentile for Poisson arrivals of the given mean."""
    if not 0 < percentile < 100:
        raise ValueError("the peak percentile must be between 0 and 100")
    require("bench", "the Poisson peak (tokenmill size --avg-rps)")
    from scipy.stats import poisson  # here: the rest of the sizing model imports without the extra

    return int(poisson.ppf(percentile / 100, average))


def words_to_tokens(words: float) -> int:
    return math.ceil(words / WORDS_PER_TOKEN)


@dataclass(frozen=True)
class Limits:
    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None
    mode: str = "streaming"  # streaming: TTFT and ITL matter; sequential: only the whole answer (E2E)

    def met(self, p: Prediction) -> bool:
        if self.mode == "sequential":
            limit = self.e2e_s if self.e2e_s is not None else self.ttft_s
            return limit is None or p.e2e_s <= limit
        return (
            (self.ttft_s is None or p.ttft_s <= self.ttft_s)
            and (self.itl_s is None or p.itl_s <= self.itl_s)
            and (self.e2e_s is None or p.e2e_s <= self.e2e_s)
        )


@dataclass
class Candidate:
    tp: int
    pp: int
    ep: bool
    prediction: Prediction
    instances_per_server: int
    gpus_per_instance: int

    @property
    def rps_per_server(self) -> float:
        return self.instances_per_server * self.prediction.rps

    def to_dict(self, osl: int, gpus_per_server: int) -> dict[str, Any]:
        p = self.prediction
        return {
            "tp": self.tp,
            "pp": self.pp,
            "ep": self.ep,
            "concurrency_per_instance": p.concurrency,
            "instances_per_server": self.instances_per_server,
            "gpus_per_instance": self.gpus_per_instance,
            "ttft_ms": p.ttft_s * 1e3,
            "itl_ms": p.itl_s * 1e3,
            "e2e_ms": p.e2e_s * 1e3,
            "rps_per_instance": p.rps,
            "rps_per_server": self.rps_per_server,
            "output_tps_per_user": 1 / p.itl_s,
            "output_tps_per_gpu": p.rps * osl / self.gpus_per_instance,
        }


def _concurrencies(max_c: int) -> list[int]:
    cs = {c for c in range(1, min(max_c, 64) + 1)}
    c = 64
    while c < max_c:
        c = math.ceil(c * 1.1)
        cs.add(min(c, max_c))
    return sorted(cs)


def candidates(
    arch: Arch,
    gpu: Gpu,
    precision: str,
    factors: Factors,
    isl: int,
    osl: int,
    max_concurrency: int = 4096,
    kv_cache_dtype: str = "auto",
) -> list[Candidate]:
    """Every shape that fits in memory, at every concurrency it fits."""
    out = []
    tps = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= gpu.gpus_per_server and t <= arch.heads]
    for tp in tps:
        for pp in (1, 2, 4, 8):
            if tp * pp > gpu.gpus_per_server or pp > arch.layers:
                continue
            for ep in (False, True) if arch.is_moe and tp > 1 else (False,):
                d = Deployment(arch, gpu, precision, factors, tp, pp, ep, kv_cache_dtype)
                max_c = min(d.max_seqs(isl + osl), max_concurrency)
                for c in _concurrencies(max_c):
                    p = predict(d, c, isl, osl)
                    if p.fits:
                        out.append(Candidate(tp, pp, ep, p, gpu.gpus_per_server // (tp * pp), tp * pp))
    return out


@dataclass
class SizingResult:
    feasible: list[Candidate]
    best: Candidate | None
    servers: int | None
    peak_rps: float
    notes: list[str] = field(default_factory=list)


def size(
    arch: Arch,
    gpu: Gpu,
    precision: str,
    factors: Factors,
    isl: int,
    osl: int,
    limits: Limits,
    peak: float,
    kv_cache_dtype: str = "auto",
) -> SizingResult:
    all_c = candidates(arch, gpu, precision, factors, isl, osl, kv_cache_dtype=kv_cache_dtype)
    feasible = [c for c in all_c if limits.met(c.prediction)]
    notes = []
    if not all_c:
        notes.append(
            f"{arch.name} in {precision} does not fit in {gpu.gpus_per_server} x {gpu.name} at this context"
        )
    elif not feasible:
        notes.append(
            "no shape meets the latency limits, even at concurrency 1: relax them or use faster GPUs"
        )
    if not feasible:
        return SizingResult([], None, None, peak, notes)

    def key(c: Candidate) -> tuple:
        servers = math.ceil(peak / c.rps_per_server)
        return (servers, -c.rps_per_server, c.prediction.ttft_s)

    best = min(feasible, key=key)
    return SizingResult(feasible, best, math.ceil(peak / best.rps_per_server), peak, notes)


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The Pareto frontier of (per-user tok/s, per-GPU tok/s): no other point is better in both."""
    best: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not best or y > best[-1][1]:
            best.append((x, y))
    return best
