"""What one worker serves within the latency targets, from the sizing model (tokenmill size's roofline,
its efficiency factors calibrated by `tokenmill size calibrate` on `tokenmill bench` results): the
largest concurrency whose predicted TTFT and ITL meet the targets, as requests per second."""

from __future__ import annotations

import functools

from tokenmill.cluster.planner.policy import Capacity
from tokenmill.sizing.roofline import Deployment, predict


def sizing_capacity(d: Deployment, ttft_s: float, itl_s: float, max_concurrency: int = 1024) -> Capacity:
    """Requests/s per worker for requests of (isl, osl) tokens, 0 when even one request misses."""

    @functools.lru_cache(maxsize=4096)
    def rps(isl: int, osl: int) -> float:
        best = 0.0
        c = 1
        while c <= max_concurrency:
            p = predict(d, c, max(isl, 1), max(osl, 1))
            if not p.fits or p.ttft_s > ttft_s or p.itl_s > itl_s:
                break
            best = max(best, p.rps)
            c = c * 2 if c < 16 else int(c * 1.25)
        return best

    # Lengths are rounded to 16 tokens: a cache keyed on them stays small.
    return lambda isl, osl: rps(int(round(isl / 16)) * 16, int(round(osl / 16)) * 16 or 1)
