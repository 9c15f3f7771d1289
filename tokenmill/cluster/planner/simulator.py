"""A discrete-event simulation of a fleet, to see what the planner does over a day of traffic.

Each worker is an engine with continuous batching whose speed comes from the sizing model
(`tokenmill.sizing.roofline.Deployment`). One engine step gives every running request one token and
prefills waiting requests in chunks, up to `max_batch_tokens` tokens per step (decode tokens included,
as vLLM's chunked prefill counts them). The step takes

    decode_step_s(running, their mean context) + prefill_s(pieces, chunk tokens / pieces)

where `pieces` is the number of prompts the chunk takes tokens from, each costed as a prompt of the
chunk's mean piece length. It is kept simple on purpose: the mixed step's two parts are added (the
weights are counted as read twice, a few ms), and a chunk's attention to the earlier chunks of its
prompt is not counted. A request's first token comes at the end of the step that finishes its prompt;
it then gains one token per step. A worker runs at most `max_seqs` requests and admits a request only
when its prompt and output fit in the KV cache that the GPU memory left by the weights holds
(`Deployment.max_seqs(1)` tokens), in arrival order.

Steps are the events: a step that prefills is one event; a run of decode-only steps is one event that
ends when the next request finishes (its steps all cost the same, at the run's mean context) or earlier,
at the step boundary after a new request arrives at that worker, which then joins the next step.

The router sends every arrival to the serving worker with the fewest requests in flight (the router's
`least-load` policy, which a fleet of identical workers reduces to). A worker launched by the planner
serves after `startup_s`; a worker the planner removes drains: it takes no new requests, finishes the
ones it has, then stops. A worker that is still starting when the planner scales down is stopped at
once. GPU time counts from launch to stop, starting and draining included, times the deployment's
GPUs, within the simulated period.

A warm standby pool (`standby` > 0) is that many copies of the worker kept ready to start fast: a process
with the weights already staged in host memory, holding no GPU (or, `standby_holds_gpu`, an idle engine
on a GPU of its own). A worker the planner launches takes a ready standby if there is one and serves after
`warm_start_s` instead of `startup_s`; the used standby is refilled in the background, ready again
`standby_refill_s` later (by default a cold start: the weights read from disk again). A host-memory
standby costs no GPU time and is reported as host-memory GB-hours (the weights' bytes, per standby, all
period long); a standby that holds a GPU is counted in the GPU-hours, its GPUs all period long.

Every planner interval the simulation builds a `FleetSnapshot` of the fields a live fleet fills in
(tokenmill/cluster/planner/loop.py) - per-worker running, waiting and KV usage (context tokens held over
the KV capacity); the arrivals of the last `window_s` and their mean prompt length, and those of the last
interval; the mean output
length, queue-to-compute ratio (arrival to first scheduling over first scheduling to the end) and p95
TTFT and inter-token latency of the requests that finished in that window - and asks the planner (the
very class the fleet runs) for a decision, then launches or drains workers.

TTFT is the time from arrival to the first token plus the deployment's `client_s`; a request's ITL is
its mean time between tokens after the first. A request attains the SLO when both are within their
targets; the attainment is the share of all requests that do (a request still unfinished at the end
counts as a miss).
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from heapq import heappop, heappush
from operator import attrgetter

import numpy as np

from tokenmill.cluster.planner.policy import Decision, Planner
from tokenmill.cluster.planner.signals import FleetSnapshot, WorkerLoad
from tokenmill.cluster.planner.sim_result import SimResult
from tokenmill.cluster.planner.traffic import Traffic
from tokenmill.sizing.roofline import Deployment

STARTING, SERVING, DRAINING, STOPPED = range(4)
_STEP, _READY, _TICK = range(3)
_INF = math.inf


@dataclass
class SimConfig:
    ttft_target_s: float = 1.0
    itl_target_s: float = 0.05
    max_batch_tokens: int = 8192  # tokens per engine step: one per running request + the prefill chunk
    max_seqs: int = 256  # running requests per worker (vLLM's max_num_seqs)
    startup_s: float = 90.0  # launch to serving: an 8B model's weights from local disk, engine warm-up
    window_s: float = 60.0  # the window of the planner's signals
    initial_workers: int | None = None  # workers serving at time 0 (planner runs; default: its minimum)
    kv_tokens: int | None = None  # KV cache per worker, tokens (default: what the deployment's memory holds)
    # the warm standby pool (module docstring)
    standby: int = 0
    warm_start_s: float = 10.0  # launch to serving from a standby (see `warm_start_s()` for a default)
    standby_refill_s: float | None = None  # a used standby ready again after this (default: startup_s)
    standby_holds_gpu: bool = False  # an idle engine on its own GPU(s): its GPU time counts

    def __post_init__(self) -> None:
        if self.ttft_target_s <= 0 or self.itl_target_s <= 0:
            raise ValueError("the TTFT and ITL targets must be positive")
        if self.max_batch_tokens < 2 or self.max_seqs < 1:
            raise ValueError("need max batch tokens >= 2 and max seqs >= 1")
        if self.startup_s < 0 or self.window_s <= 0:
            raise ValueError("need startup >= 0 and a positive signal window")
        if self.standby < 0 or self.warm_start_s < 0 or (self.standby_refill_s or 0.0) < 0:
            raise ValueError("need standby >= 0, and warm start and refill times >= 0")


def warm_start_s(d: Deployment, h2d_gbps: float = 25.0, engine_s: float = 10.0) -> float:
    """Launch to serving from a host-memory standby: each GPU's share of the weights copied from pinned
    host memory (`h2d_gbps`, GB/s: a PCIe Gen5 x16 link moves ~50 GB/s pinned at best; half of it is what
    model loaders reach in practice), all GPUs of a worker in parallel, plus `engine_s` for what does not
    depend on the weights: a CUDA context on the new GPU, the KV cache allocated, CUDA graphs captured and
    the worker registered with the router (an assumption, not a measurement: set it from your engine's
    start-up log)."""
    if h2d_gbps <= 0 or engine_s < 0:
        raise ValueError("need a positive host-to-device bandwidth and an engine start >= 0")
    return d.weight_gb_per_gpu() / h2d_gbps + engine_s


class _Worker:
    __slots__ = (
        "wid",
        "state",
        "launched",
        "stopped",
        "in_flight",
        "waiting",
        "pf",
        "running",
        "B",
        "S",
        "steps",
        "kv_used",
        "busy",
        "prefill_step",
        "span_start",
        "dt",
        "k",
        "ver",
    )

    def __init__(self, wid: int, launched: float, state: int) -> None:
        self.wid = wid
        self.state = state
        self.launched = launched
        self.stopped: float | None = None
        self.in_flight = 0  # routed here and not finished (the router's count)
        self.waiting: deque[tuple[int, float]] = deque()  # not admitted yet: (rid, arrival)
        self.pf: list[list] = []  # admitted, prompt unfinished: [rid, prompt tokens left, admitted, arrival]
        # heap of the generating requests: (finish step, rid, isl - step of the first token, first token
        # at, admitted at, arrival)
        self.running: list[tuple] = []
        self.B = 0  # running (generating) requests
        self.S = 0  # sum of (isl - step of the first token) over running: their contexts are S + B * steps
        self.steps = 0  # steps done (the token clock of running requests)
        self.kv_used = 0  # KV tokens reserved (prompt + output of admitted requests)
        self.busy = False
        self.prefill_step = False
        self.span_start = 0.0
        self.dt = 0.0
        self.k = 0
        self.ver = 0


class _Cost:
    """Step times from the sizing model, cached (contexts of decode steps rounded to 16 tokens)."""

    def __init__(self, d: Deployment) -> None:
        self.d = d
        self.dec: dict[tuple[int, int], float] = {}
        self.pre: dict[tuple[int, int], float] = {}

    def decode(self, seqs: int, ctx: float) -> float:
        key = (seqs, int(ctx) >> 4)
        v = self.dec.get(key)
        if v is None:
            v = self.dec[key] = self.d.decode_step_s(seqs, (key[1] << 4) + 8)
        return v

    def prefill(self, pieces: int, tokens: int) -> float:
        key = (pieces, tokens)
        v = self.pre.get(key)
        if v is None:
            v = self.pre[key] = self.d.prefill_s(pieces, tokens / pieces)
        return v


def simulate(
    traffic: Traffic,
    deployment: Deployment,
    planner: Planner | None = None,
    workers: int | None = None,
    config: SimConfig | None = None,
    name: str | None = None,
    progress: Callable[[float], None] | None = None,
    keep_requests: bool = True,
) -> SimResult:
    """Serve `traffic` with a static fleet of `workers`, or with the fleet `planner` sizes (starting at
    `config.initial_workers`, by default the planner's minimum). See the module docstring."""
    cfg = config or SimConfig()
    if (planner is None) == (workers is None):
        raise ValueError("give a planner or a static number of workers, one of them")
    if workers is not None and workers < 1:
        raise ValueError("a static fleet needs at least one worker")
    return _Sim(traffic, deployment, planner, workers, cfg, progress).run(name, keep_requests)


class _Sim:
    def __init__(self, traffic, deployment, planner, workers, cfg, progress) -> None:
        self.tr, self.d, self.planner, self.cfg, self.progress = traffic, deployment, planner, cfg, progress
        self.cost = _Cost(deployment)
        self.kv_cap = cfg.kv_tokens if cfg.kv_tokens is not None else deployment.max_seqs(1)
        if self.kv_cap < 2:
            raise ValueError(
                f"{deployment.arch.name} leaves no memory for the KV cache on {deployment.gpu.name}"
            )
        self.heap: list[tuple] = []
        self.seq_counter = itertools.count()  # ties in the event heap: first pushed, first served
        self.all: list[_Worker] = []  # every worker launched (GPU time)
        self.live: list[_Worker] = []  # those not stopped
        self.serving: list[_Worker] = []
        self.n = len(traffic)
        # lengths as machine ints (a list of Python ints would take ~4x the memory for a day's millions)
        self.isl = array("q", np.ascontiguousarray(traffic.isl, dtype=np.int64).tobytes())
        self.osl = array("q", np.ascontiguousarray(traffic.osl, dtype=np.int64).tobytes())
        self.t_arr = traffic.t
        # per request, filled in as they finish (array.array: a store costs less than into numpy)
        self.ttft_a = array("d", [math.nan]) * self.n
        self.itl_a = array("d", [math.nan]) * self.n
        self.ttft = np.frombuffer(self.ttft_a, dtype=np.float64)  # the same memory, for numpy
        self.itl = np.frombuffer(self.itl_a, dtype=np.float64)
        self.client_s = deployment.factors.client_s
        # signals for the planner: requests finished since the last tick, and the last window's ticks
        self.fin_rids: list[int] = []
        self.acc = [0.0, 0.0]  # queue and compute seconds of those requests
        self.timeline: list[tuple[float, int, int, int]] = []
        self.decisions: list[Decision] = []
        self.decide_calls = 0
        # the standby pool: when each standby is (or will be) ready; ascending
        self.standby_ready: list[float] = [0.0] * cfg.standby
        self.refill_s = cfg.standby_refill_s if cfg.standby_refill_s is not None else cfg.startup_s
        self.warm_starts = 0
        if planner is not None:
            c = planner.config
            init = cfg.initial_workers if cfg.initial_workers is not None else c.min_workers
            init = min(max(init, c.min_workers), c.max_workers)
            self.interval = c.interval_s
            self.buckets: deque = deque(maxlen=max(1, math.ceil(cfg.window_s / c.interval_s)))
        else:
            init = workers
        for _ in range(init):
            self._launch(0.0, ready=True)
        self._mark(0.0)
        self._start, self._step_end, self._arrive = self._engine()

    # -- fleet ---------------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, obj, ver: int = 0) -> None:
        heappush(self.heap, (t, next(self.seq_counter), kind, obj, ver))

    def _launch(self, now: float, ready: bool = False) -> None:
        w = _Worker(len(self.all), now, SERVING if ready else STARTING)
        self.all.append(w)
        self.live.append(w)
        if ready:
            self.serving.append(w)
            return
        pool = self.standby_ready
        if pool and pool[0] <= now:
            # A warm start; the standby is staged again in the background (a cold load into host memory).
            pool.pop(0)
            pool.append(now + self.refill_s)  # the latest refill: the list stays sorted
            self.warm_starts += 1
            self._push(now + self.cfg.warm_start_s, _READY, w)
        else:
            self._push(now + self.cfg.startup_s, _READY, w)

    def _counts(self) -> tuple[int, int, int]:
        s = st = dr = 0
        for w in self.live:
            if w.state == SERVING:
                s += 1
            elif w.state == STARTING:
                st += 1
            elif w.state == DRAINING:
                dr += 1
        return s, st, dr

    def _mark(self, now: float) -> None:
        c = self._counts()
        if not self.timeline or self.timeline[-1][1:] != c:
            self.timeline.append((now, *c))

    def _stop(self, w: _Worker, now: float) -> None:
        w.state = STOPPED
        w.stopped = now
        self.live.remove(w)
        self._mark(now)

    def _scale(self, now: float, target: int) -> None:
        s, st, _ = self._counts()
        current = s + st
        if target > current:
            for _ in range(target - current):
                self._launch(now)
        else:
            remove = current - target
            starting = [w for w in self.live if w.state == STARTING]
            for w in reversed(starting):  # not serving yet: stop the newest at once
                if remove == 0:
                    break
                self._stop(w, now)
                remove -= 1
            for _ in range(remove):
                if len(self.serving) <= 1:
                    break
                w = min(self.serving, key=attrgetter("in_flight"))
                self.serving.remove(w)
                w.state = DRAINING
                if w.in_flight == 0 and not w.busy:
                    self._stop(w, now)
        self._mark(now)

    # -- engine --------------------------------------------------------------------------------------
    def _engine(self):
        """The hot path as closures over local names (a day is millions of requests): `start(w, now)`
        plans a worker's next step (or run of decode steps), `step_end(w, now)` applies one, `arrive(rid,
        now)` routes a request."""
        heap, isl, osl, ttft_a, itl_a = self.heap, self.isl, self.osl, self.ttft_a, self.itl_a
        max_tokens, max_seqs, cap, client = (
            self.cfg.max_batch_tokens,
            self.cfg.max_seqs,
            self.kv_cap,
            self.client_s,
        )
        dec, pre = self.cost.dec, self.cost.pre
        decode_s, prefill_s = self.d.decode_step_s, self.d.prefill_s
        seq = self.seq_counter
        acc, fin = self.acc, self.fin_rids  # requests finished since the last tick: queue/compute, ids
        serving, live = self.serving, self.live
        in_flight_of = attrgetter("in_flight")
        stop = self._stop

        def start(w: _Worker, now: float) -> None:
            B = w.B
            budget = max_tokens - B
            tokens = pieces = 0
            pf = w.pf
            for e in pf:
                if budget <= 0:
                    break
                take = e[1] if e[1] < budget else budget
                e[1] -= take
                budget -= take
                tokens += take
                pieces += 1
            waiting = w.waiting
            while budget > 0 and waiting and B + len(pf) < max_seqs:
                rid, arrival = waiting[0]
                need = isl[rid] + osl[rid]
                if w.kv_used + need > cap:
                    if B == 0 and not pf:  # can never fit: dropped (counted as a miss)
                        waiting.popleft()
                        w.in_flight -= 1
                        continue
                    break
                waiting.popleft()
                w.kv_used += need
                left = isl[rid]
                take = left if left < budget else budget
                pf.append([rid, left - take, now, arrival])
                budget -= take
                tokens += take
                pieces += 1
            if tokens:
                dt = pre.get((pieces, tokens))
                if dt is None:
                    dt = pre[(pieces, tokens)] = prefill_s(pieces, tokens / pieces)
                if B:
                    key = (B, int((w.S + B * w.steps) / B) >> 4)
                    d = dec.get(key)
                    if d is None:
                        d = dec[key] = decode_s(B, (key[1] << 4) + 8)
                    dt += d
                k = 1
                w.prefill_step = True
            elif B:
                k = w.running[0][0] - w.steps
                key = (B, int((w.S + B * (w.steps + k / 2)) / B) >> 4)
                dt = dec.get(key)
                if dt is None:
                    dt = dec[key] = decode_s(B, (key[1] << 4) + 8)
                w.prefill_step = False
            else:
                w.busy = False
                if w.state == DRAINING and w.in_flight == 0:
                    stop(w, now)
                return
            w.busy = True
            w.span_start = now
            w.dt = dt
            w.k = k
            w.ver += 1
            heappush(heap, (now + k * dt, next(seq), _STEP, w, w.ver))

        def step_end(w: _Worker, now: float) -> None:
            w.steps += w.k
            steps = w.steps
            running = w.running
            if w.prefill_step:
                pf = w.pf
                done = 0
                for e in pf:
                    if e[1]:
                        break
                    done += 1
                if done:
                    for e in pf[:done]:
                        rid = e[0]
                        c = isl[rid] - steps
                        heappush(running, (steps + osl[rid] - 1, rid, c, now, e[2], e[3]))
                        w.S += c
                    w.B += done
                    del pf[:done]
            if running and running[0][0] <= steps:
                q = c_ = 0.0
                while running and running[0][0] <= steps:
                    _, rid, c, first, admitted, arrival = heappop(running)
                    w.B -= 1
                    w.S -= c
                    o = osl[rid]
                    w.kv_used -= isl[rid] + o
                    w.in_flight -= 1
                    ttft_a[rid] = first - arrival + client
                    itl_a[rid] = (now - first) / (o - 1) if o > 1 else 0.0
                    fin.append(rid)
                    q += admitted - arrival
                    c_ += now - admitted
                acc[0] += q
                acc[1] += c_
            start(w, now)

        def arrive(rid: int, now: float) -> None:
            if len(serving) > 1:
                w = min(serving, key=in_flight_of)
            elif serving:
                w = serving[0]
            else:  # only starting workers (a planner at its minimum replacing one): queue at one
                w = next(w for w in live if w.state == STARTING)
            w.in_flight += 1
            w.waiting.append((rid, now))
            if w.state != SERVING:
                return
            if not w.busy:
                start(w, now)
            elif not w.prefill_step and w.k > 1:
                # A run of decode steps: cut it at the step boundary after now; the arrival joins the next.
                j = int((now - w.span_start) / w.dt) + 1
                if j < w.k:
                    w.k = j
                    w.ver += 1
                    heappush(heap, (w.span_start + j * w.dt, next(seq), _STEP, w, w.ver))

        return start, step_end, arrive

    def _ready(self, w: _Worker, now: float) -> None:
        if w.state != STARTING:
            return
        w.state = SERVING
        self.serving.append(w)
        self._mark(now)
        if w.waiting:
            self._start(w, now)

    # -- planner -------------------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        cfg = self.cfg
        self.buckets.append((np.asarray(self.fin_rids, dtype=np.int64), *self.acc))
        self.fin_rids.clear()
        self.acc[0] = self.acc[1] = 0.0
        window = min(cfg.window_s, now)
        lo, hi = np.searchsorted(self.t_arr, [now - window, now], side="right")
        n = int(hi - lo)
        recent = min(self.interval, now)
        recent_lo = int(np.searchsorted(self.t_arr, now - recent, side="right"))
        fin = np.concatenate([b[0] for b in self.buckets])
        q = sum(b[1] for b in self.buckets)
        c = sum(b[2] for b in self.buckets)
        kv_cap = self.kv_cap
        loads = []
        for w in self.serving:
            pre = sum(self.isl[e[0]] - e[1] for e in w.pf)
            loads.append(WorkerLoad(w.B + len(w.pf), len(w.waiting), (w.S + w.B * w.steps + pre) / kv_cap))
        s, st, dr = self._counts()
        snap = FleetSnapshot(
            time=now,
            serving=s,
            starting=st,
            draining=dr,
            loads=loads,
            window_s=window,
            requests=n,
            queue_to_compute=q / c if c > 0 else None,
            # as the fleet reads them: prompt lengths of the arrivals, output lengths and latencies of the
            # finished requests, TTFT as the server measures it (without the client's share)
            mean_isl=float(self.tr.isl[lo:hi].mean()) if n else None,
            mean_osl=float(self.tr.osl[fin].mean()) if len(fin) else None,
            ttft_p95_s=float(np.percentile(self.ttft[fin], 95)) - self.client_s if len(fin) else None,
            itl_p95_s=float(np.percentile(self.itl[fin], 95)) if len(fin) else None,
            recent_requests=int(hi - recent_lo),
            recent_s=recent,
        )
        d = self.planner.decide(snap, now)
        self.decide_calls += 1
        if d.target != d.current:
            self.decisions.append(d)
            self._scale(now, d.target)

    # -- the loop ------------------------------------------------------------------------------------
    def run(self, name: str | None, keep_requests: bool) -> SimResult:
        duration = self.tr.duration_s
        heap = self.heap
        if self.planner is not None:
            self._push(self.interval, _TICK, None)
        t_list: list[float] = []
        chunk = 1 << 16
        i = base = 0
        n = self.n
        step_end, arrive = self._step_end, self._arrive
        report = self.progress
        next_report = 0.0
        while True:
            if i - base >= len(t_list) and base + len(t_list) < n:
                base += len(t_list)
                t_list = self.t_arr[base : base + chunk].tolist()
            ta = t_list[i - base] if i < n else _INF
            if heap and heap[0][0] <= ta:
                now, _, kind, w, ver = heappop(heap)
                if kind == _STEP:
                    if ver == w.ver:
                        step_end(w, now)
                elif kind == _TICK:
                    if now <= duration + 1e-9:
                        self._tick(now)
                        self._push(now + self.interval, _TICK, None)
                else:
                    self._ready(w, now)
                if report is not None and now >= next_report and now <= duration:
                    report(now / duration)
                    next_report = now + duration / 200
            elif i < n:
                arrive(i, ta)
                i += 1
                if report is not None and ta >= next_report:
                    report(min(ta / duration, 1.0))
                    next_report = ta + duration / 200
            else:
                break
        if report is not None:
            report(1.0)
        return self._result(name, duration, keep_requests)

    def _result(self, name: str | None, duration: float, keep_requests: bool) -> SimResult:
        cfg, gpus = self.cfg, self.d.gpus
        worker_s = 0.0
        for w in self.all:
            end = w.stopped if w.stopped is not None else duration
            worker_s += max(0.0, min(end, duration) - min(w.launched, duration))
        # The standby pool is kept all period long (a standby being refilled holds its memory too).
        standby_gpu_s = cfg.standby * duration if cfg.standby_holds_gpu else 0.0
        host_gb = 0.0 if cfg.standby_holds_gpu else self.d.weight_gb_per_gpu() * gpus
        ok = (self.ttft <= cfg.ttft_target_s) & (self.itl <= cfg.itl_target_s)  # nan compares False
        done = ~np.isnan(self.itl)
        ttft, itl = self.ttft[done], self.itl[done]

        def pct(a: np.ndarray, p: float) -> float | None:
            return float(np.percentile(a, p)) if len(a) else None

        timeline = [row for row in self.timeline if row[0] <= duration]  # a drain may end after it
        if timeline[-1][0] < duration:
            timeline.append((duration, *timeline[-1][1:]))
        label = name or (
            f"{self.planner.config.mode} planner" if self.planner is not None else f"static {len(self.all)}"
        )
        return SimResult(
            name=label,
            duration_s=duration,
            gpus_per_worker=gpus,
            gpu_hours=(worker_s + standby_gpu_s) * gpus / 3600,
            attainment=float(ok.mean()) if self.n else 1.0,
            requests=self.n,
            finished=int(done.sum()),
            ttft_p50_s=pct(ttft, 50),
            ttft_p95_s=pct(ttft, 95),
            itl_p50_s=pct(itl, 50),
            itl_p95_s=pct(itl, 95),
            timeline=timeline,
            decisions=self.decisions,
            decide_calls=self.decide_calls,
            ttft=self.ttft if keep_requests else np.zeros(0),
            itl=self.itl if keep_requests else np.zeros(0),
            ttft_target_s=cfg.ttft_target_s,
            itl_target_s=cfg.itl_target_s,
            standby=cfg.standby,
            warm_starts=self.warm_starts,
            standby_gpu_hours=standby_gpu_s * gpus / 3600,
            standby_host_gb_hours=cfg.standby * host_gb * duration / 3600,
        )
