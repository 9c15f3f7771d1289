"""The planner's decision: how many workers the fleet should run, every `interval_s`.

Two modes, as Dynamo's planner has them:
- load: scale on pressure read from the fleet: the queue-to-compute ratio (the source documents'
  autoscaling signal), requests waiting per worker, KV cache usage. Up after `up_intervals` pressured
  readings in a row, down after `down_intervals` quiet ones, and only when one worker fewer would still
  be quiet (hysteresis: the thresholds for up and down are far apart).
- sla: forecast the arrival rate one worker start-up ahead, divide by what one worker serves within the
  TTFT and ITL targets (a capacity function: the sizing model calibrated by `tokenmill bench`, or a
  measured figure), add headroom; a reading over a target adds a worker whatever the forecast says.

Both: bounds, a cool-down after every change (longer for scaling down), at most one worker removed per
decision, and no decision at all from stale or missing signals.

Burst detection (`surge`, off by default): a burst doubles the arrival rate in seconds, and both modes
above see it late (the window's rate moves by a sixth of the jump per interval; pressure needs two
readings; workers are added one at a time). With `surge` the planner also counts the arrivals of the last
interval against what the fleet (serving and starting) is sized for, and when there are more than
`surge_ratio` above it, and more than Poisson noise explains (`surge_sigmas` standard deviations), it
scales at once to the workers that rate needs, whatever workers are starting and whatever the up
cool-down. What a worker is sized for: in sla mode the capacity over the headroom; in load mode the most
arrivals per worker the fleet has carried without pressure in the last `surge_memory_s` (the load
planner's own operating point, learnt; no surge before it has one).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.cluster.planner.forecast import HoltForecaster
from tokenmill.cluster.planner.signals import FleetSnapshot

# Requests/s one worker serves within the latency targets, for requests of (mean isl, mean osl).
Capacity = Callable[[float, float], float]


@dataclass
class PlannerConfig:
    mode: str = "load"  # "load" or "sla"
    min_workers: int = 1
    max_workers: int = 4
    interval_s: float = 10.0
    up_cooldown_s: float = 30.0  # after any change, before the next scale-up
    down_cooldown_s: float = 120.0  # after any change, before the next scale-down
    max_signal_age_s: float | None = None  # older readings are ignored (default: 3 intervals)
    # load mode
    up_queue_ratio: float = 0.5  # queue time / compute time above this is pressure
    down_queue_ratio: float = 0.05
    up_waiting_per_worker: float = 4.0
    down_waiting_per_worker: float = 1.0  # ... what one worker fewer would see
    up_kv_usage: float = 0.9
    down_kv_usage: float = 0.5  # ... what one worker fewer would see
    up_intervals: int = 2
    down_intervals: int = 6
    # sla mode
    ttft_target_s: float = 1.0
    itl_target_s: float = 0.1
    headroom: float = 0.1  # provision this much above the forecast
    down_band: float = 0.1  # scale down only when the rest keep headroom + this above the forecast
    startup_s: float = 30.0  # how long a new worker takes to serve: the forecast looks this far ahead
    # burst detection (module docstring)
    surge: bool = False
    surge_ratio: float = 0.3  # last interval's arrivals this much above what the fleet is sized for
    surge_sigmas: float = 3.0  # ... and this many Poisson standard deviations above it
    surge_memory_s: float = 3600.0  # load: how long a calm reading's arrivals per worker are remembered

    def __post_init__(self) -> None:
        if self.mode not in ("load", "sla"):
            raise ValueError(f'the planner mode must be "load" or "sla", got {self.mode!r}')
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"need 1 <= min workers <= max workers, got {self.min_workers}..{self.max_workers}"
            )
        if self.headroom < 0 or self.down_band < 0:
            raise ValueError("the headroom and the scale-down band cannot be negative")
        if self.interval_s <= 0:
            raise ValueError("the planner interval must be positive")
        if self.surge_ratio <= 0 or self.surge_sigmas < 0 or self.surge_memory_s <= 0:
            raise ValueError("need a positive surge ratio and memory, and surge sigmas >= 0")
        if self.max_signal_age_s is None:
            self.max_signal_age_s = 3 * self.interval_s


@dataclass
class Decision:
    time: float
    current: int  # workers serving or starting when it was made
    target: int
    reason: str

    @property
    def delta(self) -> int:
        return self.target - self.current


class Planner:
    def __init__(self, config: PlannerConfig, capacity: Capacity | None = None) -> None:
        if config.mode == "sla" and capacity is None:
            raise ValueError("the sla planner needs a capacity (requests/s per worker within the targets)")
        self.config = config
        self.capacity = capacity
        self.forecaster = HoltForecaster()
        self.last_change: float | None = None
        self.up_streak = 0
        self.down_streak = 0
        self.decisions: deque[Decision] = deque(maxlen=100_000)  # for plots and /metrics; bounded
        # load mode's surge reference: (time, arrivals/s per serving worker) of calm readings, the
        # running maximum kept at the front (a monotone deque)
        self.calm_rates: deque[tuple[float, float]] = deque()
        self.calm = False  # load mode: the last reading showed no pressure

    def decide(self, snap: FleetSnapshot | None, now: float) -> Decision:
        """The target for now; `snap` None or older than max_signal_age_s changes nothing."""
        c = self.config
        if snap is None:
            return self._keep(now, -1, "no signals")
        current = snap.serving + snap.starting
        if now - snap.time > c.max_signal_age_s:  # type: ignore[operator]
            return self._keep(now, current, f"signals {now - snap.time:.0f}s old")
        if current < c.min_workers or current > c.max_workers:
            return self._change(now, current, min(max(current, c.min_workers), c.max_workers), "bounds")
        if c.mode == "load":
            target, reason = self._load(snap, current)
        else:
            target, reason = self._sla(snap, current)
        target = min(max(target, c.min_workers), c.max_workers)
        if c.surge:
            burst = self._surge(snap, current, now)
            if burst is not None and min(burst[0], c.max_workers) > max(target, current):
                # Scale by the whole jump now: the workers already starting are counted in `current`,
                # and waiting out a cool-down would leave the burst queueing for a start-up more.
                return self._change(now, current, min(burst[0], c.max_workers), burst[1])
            if c.mode == "load" and self.calm and snap.serving and not snap.starting and snap.requests:
                # What a worker carries without pressure: the reference a burst is measured against. Not
                # while workers start (the fleet is changing) nor from a reading that was a burst.
                self._remember_calm(snap.time, snap.request_rate / snap.serving)
        if target > current:
            if snap.starting:
                return self._keep(now, current, f"{reason}; {snap.starting} worker(s) still starting")
            if self._cooling(now, c.up_cooldown_s):
                return self._keep(now, current, f"{reason}; cooling down")
            return self._change(now, current, target, reason)
        if target < current:
            if snap.draining or snap.starting:
                return self._keep(now, current, f"{reason}; a worker is starting or draining")
            if self._cooling(now, c.down_cooldown_s):
                return self._keep(now, current, f"{reason}; cooling down")
            return self._change(now, current, current - 1, reason)  # one at a time: drains are slow
        return self._keep(now, current, reason)

    # -- the two modes -------------------------------------------------------------------------------
    def _load(self, snap: FleetSnapshot, current: int) -> tuple[int, str]:
        c = self.config
        qc = snap.queue_to_compute
        waiting = snap.waiting / max(snap.serving, 1)
        kv = snap.mean_kv_usage
        pressure = []
        if qc is not None and qc > c.up_queue_ratio:
            pressure.append(f"queue/compute {qc:.2f}")
        if waiting > c.up_waiting_per_worker:
            pressure.append(f"{waiting:.1f} waiting per worker")
        if kv > c.up_kv_usage:
            pressure.append(f"KV usage {kv:.0%}")
        # Quiet means one worker fewer would still be quiet. A busy fleet of many workers nearly always
        # has some request between arrival and its first step, so "nothing waiting anywhere" would
        # never hold at scale: the test is per worker, as the up test is.
        fewer = snap.serving - 1
        one_fewer_kv = kv * snap.serving / fewer if fewer else math.inf
        one_fewer_waiting = snap.waiting / fewer if fewer else math.inf
        quiet = (
            (qc is None or qc < c.down_queue_ratio)
            and one_fewer_waiting < c.down_waiting_per_worker
            and one_fewer_kv < c.down_kv_usage
        )
        self.up_streak = self.up_streak + 1 if pressure else 0
        self.down_streak = self.down_streak + 1 if quiet and not pressure else 0
        self.calm = not pressure
        if pressure and self.up_streak >= c.up_intervals:
            return current + 1, "; ".join(pressure)
        if self.down_streak >= c.down_intervals:
            return current - 1, f"quiet for {self.down_streak} intervals"
        if pressure:
            return current, f"{'; '.join(pressure)} ({self.up_streak}/{c.up_intervals})"
        return current, "steady"

    def _sla(self, snap: FleetSnapshot, current: int) -> tuple[int, str]:
        c = self.config
        assert self.capacity is not None
        self.forecaster.observe(snap.request_rate)
        rate = self.forecaster.forecast((c.startup_s + c.interval_s) / c.interval_s)
        isl = snap.mean_isl or 0.0
        osl = snap.mean_osl or 1.0
        per_worker = self.capacity(isl, osl) if snap.requests else 0.0
        if per_worker <= 0:
            needed = current if snap.requests else c.min_workers
        else:
            needed = math.ceil(rate * (1 + c.headroom) / per_worker)
        reason = f"forecast {rate:.2f} req/s, {per_worker:.2f} per worker"
        late = [
            name
            for name, got, target in (
                ("TTFT", snap.ttft_p95_s, c.ttft_target_s),
                ("ITL", snap.itl_p95_s, c.itl_target_s),
            )
            if got is not None and got > target
        ]
        if late and needed <= current:
            # The model under-estimates what this traffic costs: the measurement wins.
            return current + 1, f"p95 {' and '.join(late)} over target ({reason})"
        if needed < current:
            # Hysteresis: a forecast hovering near a multiple of one worker's capacity would otherwise
            # add and remove a worker every few minutes.
            needed = (
                math.ceil(rate * (1 + c.headroom + c.down_band) / per_worker) if per_worker > 0 else needed
            )
            if needed >= current:
                self.down_streak = 0
                return current, f"{reason}: within the scale-down band"
            self.down_streak += 1
            if self.down_streak < c.down_intervals:
                return current, f"{reason}: {needed} needed ({self.down_streak}/{c.down_intervals})"
        else:
            self.down_streak = 0
        return needed, reason

    # -- burst detection -----------------------------------------------------------------------------
    def _remember_calm(self, t: float, per_worker: float) -> None:
        calm = self.calm_rates
        while calm and calm[-1][1] <= per_worker:
            calm.pop()
        calm.append((t, per_worker))

    def _sized_per_worker(self, snap: FleetSnapshot, now: float) -> float | None:
        """Arrivals/s one worker of the fleet is sized for, None when unknown."""
        c = self.config
        if c.mode == "sla":
            assert self.capacity is not None
            per = self.capacity(snap.mean_isl or 0.0, snap.mean_osl or 1.0) / (1 + c.headroom)
            return per if per > 0 else None
        calm = self.calm_rates
        while calm and calm[0][0] < now - c.surge_memory_s:
            calm.popleft()
        return calm[0][1] if calm and calm[0][1] > 0 else None

    def _surge(self, snap: FleetSnapshot, current: int, now: float) -> tuple[int, str] | None:
        """(workers the last interval's arrival rate needs, why) when it is a burst, else None."""
        c = self.config
        if snap.recent_requests is None or snap.recent_s <= 0 or current < 1:
            return None
        per = self._sized_per_worker(snap, now)
        if per is None:
            return None
        expected = per * current * snap.recent_s  # arrivals the fleet is sized for in that time
        k = snap.recent_requests
        if k <= expected * (1 + c.surge_ratio) or k <= expected + c.surge_sigmas * math.sqrt(expected):
            return None
        rate = k / snap.recent_s
        need = math.ceil(rate / per)
        return need, (
            f"burst: {rate:.2f} req/s in the last {snap.recent_s:.0f}s, {k / expected:.2f}x what "
            f"{current} worker(s) are sized for ({per:.2f} req/s each)"
        )

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _cooling(self, now: float, cooldown: float) -> bool:
        return self.last_change is not None and now - self.last_change < cooldown

    def _keep(self, now: float, current: int, reason: str) -> Decision:
        d = Decision(now, current, current, reason)
        self.decisions.append(d)
        return d

    def _change(self, now: float, current: int, target: int, reason: str) -> Decision:
        self.last_change = now
        self.up_streak = self.down_streak = 0
        d = Decision(now, current, target, reason)
        self.decisions.append(d)
        return d
