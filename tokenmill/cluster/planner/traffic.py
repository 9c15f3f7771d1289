"""Traffic for the planner's simulator: the requests of a day, each an arrival time and its lengths.

`diurnal` draws traffic on the clock of a day: a smooth daily curve (a cosine, lowest at `trough_hour`,
highest twelve hours later) with a few short bursts a day on top, sampled as a non-homogeneous Poisson
process (by thinning), with prompt and output lengths drawn from lognormal distributions around their
means. A period shorter than a day is that stretch of the day (from `start_hour`), with the bursts that
fall in it: the same curve and bursts as the whole day, not a day squeezed into it. The same seed gives
the same requests.

`from_trace` reads recorded traffic. The format, one request per line:

- CSV with a header naming the columns `timestamp,isl,osl` (any order; other columns are ignored), or
- JSONL (file name ending in .jsonl or .ndjson): one object per line, `{"timestamp": 12.5, "isl": 2000,
  "osl": 200}`.

`timestamp` is seconds (a float); a trace in epoch seconds (any timestamp past ten days) is shifted so
that its first request arrives at 0, otherwise the timestamps are taken as seconds since the start of the
simulated period. `isl` and `osl` are the prompt and output lengths in tokens (integers >= 1). Lines may
come in any order: the requests are sorted by arrival.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DAY_S = 86400.0
EPOCH_AFTER_S = 10 * DAY_S  # timestamps past this are epoch seconds, not seconds since the start


@dataclass(frozen=True)
class Burst:
    start_s: float
    duration_s: float
    factor: float  # the rate is multiplied by this while the burst lasts


@dataclass
class Traffic:
    """Requests sorted by arrival: three columns of the same length."""

    t: np.ndarray  # arrival times, seconds (float64, non-decreasing)
    isl: np.ndarray  # prompt tokens (int64)
    osl: np.ndarray  # output tokens (int64)
    duration_s: float  # the period the traffic covers (the simulation runs this long)
    bursts: tuple[Burst, ...] = ()
    rate_fn: object = None  # the arrival rate (req/s) as a function of time (numpy in, numpy out), if known
    clock_start_s: float | None = None  # time of day at t = 0 (seconds after midnight), if known

    def __post_init__(self) -> None:
        if not (len(self.t) == len(self.isl) == len(self.osl)):
            raise ValueError("arrival times, prompt lengths and output lengths differ in length")

    def __len__(self) -> int:
        return len(self.t)

    def __getitem__(self, i: int) -> tuple[float, int, int]:
        return float(self.t[i]), int(self.isl[i]), int(self.osl[i])

    def window(self, start_s: float, end_s: float) -> Traffic:
        """The requests arriving in [start_s, end_s), shifted to start at 0."""
        lo, hi = np.searchsorted(self.t, [start_s, end_s], side="left")
        clock = None if self.clock_start_s is None else (self.clock_start_s + start_s) % DAY_S
        return Traffic(
            self.t[lo:hi] - start_s,
            self.isl[lo:hi],
            self.osl[lo:hi],
            end_s - start_s,
            rate_fn=None,
            clock_start_s=clock,
        )

    def rate(self, bin_s: float = 300.0) -> tuple[np.ndarray, np.ndarray]:
        """Arrivals per second in bins of `bin_s`: (bin centres, rates), for plots."""
        edges = np.arange(0.0, self.duration_s + bin_s, bin_s)
        counts, _ = np.histogram(self.t, bins=edges)
        return (edges[:-1] + edges[1:]) / 2, counts / bin_s

    def to_csv(self, path: str | Path) -> None:
        """Write the trace format `from_trace` reads."""
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["timestamp", "isl", "osl"])
            for t, i, o in zip(self.t.tolist(), self.isl.tolist(), self.osl.tolist(), strict=True):
                w.writerow([repr(t), i, o])


def diurnal_rate(
    peak_rps: float,
    peak_to_trough: float = 4.0,
    trough_hour: float = 4.0,
    bursts: tuple[Burst, ...] = (),
    start_hour: float = 0.0,
):
    """The arrival rate (req/s) at times t (seconds from `start_hour` o'clock): trough at `trough_hour`
    o'clock, peak twelve hours later, peak / trough = `peak_to_trough`; bursts multiply it."""
    trough = peak_rps / peak_to_trough

    def rate(t: np.ndarray) -> np.ndarray:
        t = np.asarray(t, dtype=float)
        phase = 2 * math.pi * ((t / 3600.0 + start_hour - trough_hour) / 24.0)
        r = trough + (peak_rps - trough) * (1 - np.cos(phase)) / 2
        for b in bursts:
            r = np.where((t >= b.start_s) & (t < b.start_s + b.duration_s), r * b.factor, r)
        return r

    return rate


def diurnal(
    duration_s: float = DAY_S,
    peak_rps: float = 10.0,
    peak_to_trough: float = 4.0,
    bursts: int | tuple[Burst, ...] = 3,
    burst_factor: float = 2.0,
    burst_minutes: tuple[float, float] = (5.0, 15.0),
    isl: float = 2000,
    osl: float = 200,
    isl_sigma: float = 0.3,
    osl_sigma: float = 0.3,
    max_isl: int | None = None,
    max_osl: int | None = None,
    trough_hour: float = 4.0,
    start_hour: float = 0.0,
    seed: int = 0,
) -> Traffic:
    """Traffic from `start_hour` o'clock for `duration_s` (module docstring). `bursts`: how many random
    bursts a day (each `burst_factor` x the curve for `burst_minutes` minutes, starting anywhere in its
    day; the period gets those that overlap it), or the bursts themselves (times from the period's start).
    Lengths are lognormal with means `isl`/`osl` and log-space deviations `isl_sigma`/`osl_sigma` (0: fixed
    lengths), clipped to [1, max] (max: 4 x the mean unless given)."""
    if duration_s <= 0 or peak_rps <= 0:
        raise ValueError("the duration and the peak rate must be positive")
    if peak_to_trough < 1:
        raise ValueError("the peak-to-trough ratio must be at least 1")
    if isl < 1 or osl < 1:
        raise ValueError("mean prompt and output lengths must be at least 1 token")
    if not 0 <= start_hour < 24:
        raise ValueError("the start hour must be in [0, 24)")
    rng = np.random.default_rng(seed)
    if isinstance(bursts, int):
        if bursts < 0:
            raise ValueError("the number of bursts must be >= 0")
        bursts = _daily_bursts(bursts, burst_factor, burst_minutes, start_hour * 3600, duration_s, seed)
    rate = diurnal_rate(peak_rps, peak_to_trough, trough_hour, bursts, start_hour)
    top = peak_rps * max([1.0] + [b.factor for b in bursts])
    # Thinning: a homogeneous Poisson process at the top rate, each arrival kept with rate(t) / top.
    n = rng.poisson(top * duration_s)
    t = np.sort(rng.uniform(0.0, duration_s, size=n))
    t = t[rng.uniform(0.0, top, size=n) < rate(t)]
    return Traffic(
        t,
        _lengths(rng, len(t), isl, isl_sigma, max_isl or int(4 * isl)),
        _lengths(rng, len(t), osl, osl_sigma, max_osl or int(4 * osl)),
        float(duration_s),
        bursts,
        rate,
        start_hour * 3600,
    )


def _daily_bursts(
    per_day: int,
    factor: float,
    minutes: tuple[float, float],
    start_s: float,
    duration_s: float,
    seed: int,
) -> tuple[Burst, ...]:
    """`per_day` bursts in each calendar day the period touches, those overlapping it, with times from the
    period's start. Each day's bursts come from their own generator (the seed and the day), so that any
    stretch of a day has the bursts the whole day has there: a shorter run does not crowd them in."""
    lo, hi = minutes
    out = []
    end_s = start_s + duration_s
    for day in range(int(start_s // DAY_S), math.ceil(end_s / DAY_S)):
        g = np.random.default_rng([seed, day])
        starts = day * DAY_S + g.uniform(0.0, DAY_S, size=per_day)
        lengths = g.uniform(lo * 60, hi * 60, size=per_day)
        for b0, d in zip(starts.tolist(), lengths.tolist(), strict=True):
            if b0 < end_s and b0 + d > start_s:
                out.append(Burst(b0 - start_s, d, factor))
    return tuple(sorted(out, key=lambda b: b.start_s))


def constant(
    duration_s: float, rps: float, isl: int, osl: int, seed: int = 0, poisson: bool = True
) -> Traffic:
    """Fixed lengths at a steady rate: Poisson arrivals, or evenly spaced ones (`poisson=False`)."""
    if rps <= 0:
        return Traffic(np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64), float(duration_s))
    if poisson:
        rng = np.random.default_rng(seed)
        t = np.sort(rng.uniform(0.0, duration_s, size=rng.poisson(rps * duration_s)))
    else:
        t = np.arange(0.0, duration_s, 1.0 / rps)
    n = len(t)
    return Traffic(
        t,
        np.full(n, isl, np.int64),
        np.full(n, osl, np.int64),
        float(duration_s),
        rate_fn=lambda x: np.full_like(np.asarray(x, float), rps),
    )


def concat(parts: list[Traffic]) -> Traffic:
    """Traffic pieces one after the other (each shifted by the durations before it)."""
    ts, offset = [], 0.0
    for p in parts:
        ts.append(p.t + offset)
        offset += p.duration_s
    return Traffic(
        np.concatenate(ts),
        np.concatenate([p.isl for p in parts]),
        np.concatenate([p.osl for p in parts]),
        offset,
    )


def _lengths(rng: np.random.Generator, n: int, mean: float, sigma: float, top: int) -> np.ndarray:
    if sigma <= 0:
        return np.full(n, max(1, round(mean)), np.int64)
    mu = math.log(mean) - sigma**2 / 2  # a lognormal of this mu and sigma has the mean `mean`
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), 1, max(top, 1)).astype(np.int64)


def from_trace(path: str | Path, duration_s: float | None = None) -> Traffic:
    """Requests from a CSV or JSONL trace (module docstring); the duration defaults to the last arrival
    rounded up to a whole minute."""
    path = Path(path)
    rows: list[tuple[float, int, int]] = []
    try:
        with open(path, newline="") as f:
            if path.suffix.lower() in (".jsonl", ".ndjson"):
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            o = json.loads(line)
                            rows.append(_row(o["timestamp"], o["isl"], o["osl"], path, n))
                        except (json.JSONDecodeError, KeyError, TypeError) as e:
                            raise ValueError(f"{path}:{n}: not a trace record ({e})") from None
            else:
                reader = csv.DictReader(f)
                missing = {"timestamp", "isl", "osl"} - set(reader.fieldnames or [])
                if missing:
                    raise ValueError(
                        f"{path}: the CSV header must name timestamp, isl and osl (missing "
                        f"{', '.join(sorted(missing))})"
                    )
                for n, rec in enumerate(reader, 2):
                    rows.append(_row(rec["timestamp"], rec["isl"], rec["osl"], path, n))
    except OSError as e:
        raise ValueError(f"cannot read the trace {path}: {e.strerror or e}") from None
    if not rows:
        raise ValueError(f"{path}: no requests in the trace")
    a = np.array(rows, dtype=float)
    order = np.argsort(a[:, 0], kind="stable")
    t = a[order, 0]
    if t[0] > EPOCH_AFTER_S:
        t = t - t[0]
    if duration_s is None:
        duration_s = max(60.0, math.ceil((t[-1] + 1e-9) / 60.0) * 60.0)
    return Traffic(t, a[order, 1].astype(np.int64), a[order, 2].astype(np.int64), float(duration_s))


def _row(ts: object, isl: object, osl: object, path: Path, n: int) -> tuple[float, int, int]:
    try:
        t, i, o = float(ts), int(isl), int(osl)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{path}:{n}: timestamp must be a number, isl and osl integers") from None
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"{path}:{n}: timestamp {ts!r} is not a time >= 0")
    if i < 1 or o < 1:
        raise ValueError(f"{path}:{n}: isl and osl must be at least 1 token")
    return t, i, o
