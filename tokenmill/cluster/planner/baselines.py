"""Baselines for the planner's day: what one worker serves within the targets (the simulator's analogue
of `tokenmill bench --goodput-search`), and the static fleet provisioned for the busiest stretch of a day,
the fleet the planner is compared against."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tokenmill.cluster.planner.simulator import SimConfig, simulate
from tokenmill.cluster.planner.traffic import Traffic
from tokenmill.sizing.roofline import Deployment


def measure_capacity(
    deployment: Deployment,
    config: SimConfig | None = None,
    isl: np.ndarray | int = 2000,
    osl: np.ndarray | int = 200,
    slo: float = 0.99,
    workers: int = 4,
    duration_s: float = 600.0,
    warmup_s: float = 60.0,
    seed: int = 0,
    max_rps: float = 1e4,
) -> float:
    """What a worker serves within the targets: the highest steady Poisson rate per worker (req/s) at which
    a fleet of `workers` attains `slo` (requests arriving after `warmup_s`). Lengths are drawn from
    `isl`/`osl` (arrays sampled together, e.g. a traffic's columns, or fixed values). The simulator's
    analogue of benchmarking workers (`tokenmill bench`); 0 when even a light load misses. A few workers
    rather than one: a router spreading requests over several serves each a little more within the same
    targets, as the fleets being planned do."""
    cfg = config or SimConfig()
    isl_a = np.atleast_1d(np.asarray(isl, dtype=np.int64))
    osl_a = np.atleast_1d(np.asarray(osl, dtype=np.int64))
    if len(isl_a) != len(osl_a) or not len(isl_a):
        raise ValueError("isl and osl samples differ in length (or are empty)")

    def attains(rps: float) -> bool:
        rng = np.random.default_rng(seed)  # the same draws at every rate: a monotone search
        total = rps * workers
        n = rng.poisson(total * duration_s)
        t = np.sort(rng.uniform(0.0, duration_s, size=n))
        pick = rng.integers(0, len(isl_a), size=n)
        tr = Traffic(t, isl_a[pick], osl_a[pick], duration_s)
        r = simulate(tr, deployment, workers=workers, config=cfg)
        scored = t >= warmup_s
        return bool(scored.any()) and float(r.met()[scored].mean()) >= slo

    lo, hi = 0.0, 1.0
    while attains(hi):
        lo, hi = hi, hi * 2
        if hi > max_rps:
            return lo
    if lo == 0.0:  # even 1 req/s misses: look lower
        x = hi
        while not attains(x):
            x /= 2
            if x < 1e-3:
                return 0.0
        lo, hi = x, x * 2
    while hi - lo > 0.005 * hi:
        mid = (lo + hi) / 2
        if attains(mid):
            lo = mid
        else:
            hi = mid
    return lo


def busiest_window(traffic: Traffic, window_s: float, step_s: float = 60.0) -> float:
    """The start of the `window_s` stretch with the most arrivals (on a grid of `step_s`)."""
    if window_s >= traffic.duration_s or not len(traffic):
        return 0.0
    starts = np.arange(0.0, traffic.duration_s - window_s + 1e-9, step_s)
    counts = np.searchsorted(traffic.t, starts + window_s) - np.searchsorted(traffic.t, starts)
    return float(starts[int(np.argmax(counts))])


def static_peak_workers(
    traffic: Traffic,
    deployment: Deployment,
    config: SimConfig | None = None,
    slo: float = 0.99,
    window_s: float = 1800.0,
    warmup_s: float = 600.0,
    guess: int | None = None,
    max_workers: int = 10_000,
    progress: Callable[[float], None] | None = None,
) -> tuple[int, float]:
    """Static provisioning for the peak: the fewest workers for which the busiest `window_s` of the
    traffic (bursts included) attains `slo`, simulated from `warmup_s` before it with that many workers.
    Returns (workers, the window's attainment)."""
    cfg = config or SimConfig()
    start = busiest_window(traffic, window_s)
    warm = min(warmup_s, start)
    piece = traffic.window(start - warm, start + window_s)
    scored = piece.t >= warm
    tried: dict[int, float] = {}

    def attainment(n: int) -> float:
        if n not in tried:
            r = simulate(piece, deployment, workers=n, config=cfg, keep_requests=True)
            ok = (r.ttft[scored] <= cfg.ttft_target_s) & (r.itl[scored] <= cfg.itl_target_s)
            tried[n] = float(ok.mean()) if scored.any() else 1.0
            if progress is not None:
                progress(len(tried))
        return tried[n]

    n = max(1, guess or 1)
    if attainment(n) >= slo:
        while n > 1 and attainment(n - 1) >= slo:
            n -= 1
        return n, tried[n]
    lo = n  # fails
    hi = n * 2
    while attainment(hi) < slo:
        lo, hi = hi, hi * 2
        if hi > max_workers:
            raise ValueError(f"even {max_workers} workers do not attain the SLO at the peak")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if attainment(mid) >= slo:
            hi = mid
        else:
            lo = mid
    return hi, tried[hi]
