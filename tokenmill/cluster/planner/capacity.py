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

    def capacity(isl: float, osl: float) -> float:
        # Evaluated on a 16-token grid (the cache stays small) and interpolated between its points:
        # rounding instead would make the answer jump by a few percent when a window's mean length
        # crosses a grid line, and the planner flap between N and N+1 workers with it.
        gi, go = max(isl, 0.0) / GRID, max(osl, 0.0) / GRID
        i0, o0 = int(gi), int(go)
        fi, fo = gi - i0, go - o0
        at = lambda i, o: rps(i * GRID, max(o * GRID, 1))  # noqa: E731
        lo = at(i0, o0) * (1 - fi) + at(i0 + 1, o0) * fi if fi else at(i0, o0)
        if not fo:
            return lo
        hi = at(i0, o0 + 1) * (1 - fi) + at(i0 + 1, o0 + 1) * fi if fi else at(i0, o0 + 1)
        return lo * (1 - fo) + hi * fo

    return capacity


GRID = 16  # tokens
