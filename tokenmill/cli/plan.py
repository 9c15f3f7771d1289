"""`tokenmill plan simulate`: a day of traffic on a simulated fleet, static peak provisioning against the
planner (tokenmill/cluster/planner: the same Planner class the fleet runs).

The defaults simulate a whole day in seconds: Llama 3 70B in FP8 on two H100s a worker, a few requests
a second at the peak, so that the fleet grows to several workers from a few hundred thousand requests
(the simulator's cost is per request). An 8B model's workers serve ~20 requests/s each: a fleet of the
same size then means millions of requests and minutes (docs/history/benchmarks.md's day: 17 M, ~4 minutes).
"""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from pathlib import Path

import typer
from rich.table import Table

from tokenmill.cli.common import Steps, console, fail, need_extra
from tokenmill.cli.size import MODEL_HELP, _common

PEAK_RPS = 6.0  # the default: a fleet of several 70B workers at the peak (module docstring)
DAY_S = 86400.0

plan_app = typer.Typer(
    no_args_is_help=True,
    help="The planner: simulate a day of traffic, static provisioning against autoscaling.",
)


@plan_app.callback()
def plan_cmd() -> None:
    """The planner: how many workers the fleet runs (`plan simulate` to see it over a day)."""


@plan_app.command("simulate")
def simulate_cmd(
    model: str = typer.Option("llama3-70b", help=MODEL_HELP),
    gpu: str = typer.Option("h100-sxm", help="a100-80gb, h100-sxm, h200, l40s, b200, gb200-nvl72, cpu-2c"),
    precision: str = typer.Option("fp8", help="fp16, bf16, fp8, int8, int4 (weight-only)"),
    tp: int | None = typer.Option(
        None,
        help="tensor parallel GPUs per worker (default: the fewest of 1, 2, 4, 8 whose share of the "
        "weights leaves half of each GPU's memory for the KV cache)",
    ),
    factors: Path | None = typer.Option(None, help="efficiency factors from `tokenmill size calibrate`"),
    factor_profile: str = typer.Option("default", help="default (TRT-LLM fits) or nim (NIM 1.0, H100)"),
    peak_rps: float = typer.Option(PEAK_RPS, help="requests/s at the daily peak (before bursts)"),
    peak_to_trough: float = typer.Option(4.0, help="peak / trough of the daily curve"),
    bursts: int = typer.Option(3, help="random bursts a day (a shorter period gets those that fall in it)"),
    burst_factor: float = typer.Option(2.0, help="a burst multiplies the rate by this for 5-15 minutes"),
    isl: int = typer.Option(2000, help="mean prompt tokens"),
    osl: int = typer.Option(200, help="mean output tokens"),
    length_sigma: float = typer.Option(0.3, help="lognormal spread of the lengths (0: fixed lengths)"),
    duration_h: float | None = typer.Option(
        None, help="simulated hours of the daily curve, from --start-hour (default 24, or the trace's span)"
    ),
    start_hour: float = typer.Option(0.0, help="time of day the simulated period starts (0-24, curve only)"),
    trace: Path | None = typer.Option(None, help="CSV or JSONL of timestamp,isl,osl instead of the curve"),
    seed: int = typer.Option(0, help="traffic seed"),
    ttft_ms: float = typer.Option(1000.0, help="TTFT target"),
    itl_ms: float = typer.Option(50.0, help="inter-token latency target (a request's mean)"),
    mode: str = typer.Option("both", help="planner mode: load, sla or both"),
    min_workers: int = typer.Option(1, help="planner's lower bound"),
    max_workers: int | None = typer.Option(None, help="planner's upper bound (default: the static fleet)"),
    static_workers: int | None = typer.Option(
        None, help="static fleet size (default: the fewest for the peak)"
    ),
    static_slo: float = typer.Option(
        99.0, help="% of requests the static fleet attains in the busiest window"
    ),
    static_window_min: float = typer.Option(30.0, help="the busiest window the static fleet is sized on"),
    capacity: str = typer.Option(
        "measured",
        help="sla mode's req/s per worker: measured (simulated worker), sizing (roofline) or a number",
    ),
    startup_s: float = typer.Option(90.0, help="launch to serving of a worker"),
    interval_s: float = typer.Option(10.0, help="planner interval"),
    window_s: float = typer.Option(60.0, help="the window of the planner's signals"),
    max_batch_tokens: int = typer.Option(8192, help="tokens per engine step (chunked prefill budget)"),
    max_seqs: int = typer.Option(256, help="running requests per worker"),
    headroom: float = typer.Option(0.1, help="sla: provision this much above the forecast"),
    down_band: float = typer.Option(
        0.1, help="sla: scale down only when the rest keep headroom + this above the forecast"
    ),
    up_queue_ratio: float = typer.Option(0.5, help="load: queue/compute above this is pressure"),
    down_queue_ratio: float = typer.Option(0.05, help="load: queue/compute below this is quiet"),
    up_waiting: float = typer.Option(4.0, help="load: waiting requests per worker above this is pressure"),
    up_kv: float = typer.Option(0.9, help="load: KV usage above this is pressure"),
    down_kv: float = typer.Option(0.5, help="load: KV usage one worker fewer would see, below: quiet"),
    up_intervals: int = typer.Option(2, help="load: pressured intervals in a row before scaling up"),
    down_intervals: int = typer.Option(6, help="quiet intervals in a row before scaling down"),
    up_cooldown_s: float = typer.Option(30.0, help="after a change, before the next scale-up"),
    surge: bool = typer.Option(
        False,
        "--surge/--no-surge",
        help="burst detection: when the last interval's arrivals jump past what the fleet is sized for, "
        "scale at once to what that rate needs",
    ),
    surge_ratio: float = typer.Option(0.3, help="with --surge: how far above, as a fraction"),
    standby: int = typer.Option(
        0, help="warm standby pool: workers kept with their weights in host memory, started in seconds"
    ),
    standby_h2d_gbps: float = typer.Option(
        25.0, help="standby: host-to-device GB/s a worker's weights are copied at (warm start)"
    ),
    standby_engine_s: float = typer.Option(
        10.0, help="standby: the rest of a warm start (CUDA context, KV cache, CUDA graphs, joining)"
    ),
    warm_start_s: float | None = typer.Option(
        None, help="standby: launch to serving (default: weights / --standby-h2d-gbps + --standby-engine-s)"
    ),
    standby_refill_s: float | None = typer.Option(
        None, help="standby: a used one is ready again after this (default: --startup-s, a cold load)"
    ),
    standby_holds_gpu: bool = typer.Option(
        False, help="standby: an idle engine holding its own GPUs (counted in the GPU-hours) instead"
    ),
    down_cooldown_s: float = typer.Option(120.0, help="after a change, before the next scale-down"),
    plot: Path | None = typer.Option(None, help="write the day's plot here (PNG)"),
    json_out: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
) -> None:
    """Simulate a day: static provisioning for the peak against the planner (GPU-hours, SLO, decisions)."""
    need_extra("bench", "tokenmill plan simulate")  # the sizing model (scipy) and the day's plot (matplotlib)
    from tokenmill.cluster.planner import baselines
    from tokenmill.cluster.planner import simulator as sim
    from tokenmill.cluster.planner import traffic as tr_mod
    from tokenmill.cluster.planner.capacity import sizing_capacity
    from tokenmill.cluster.planner.day_plot import plot_day
    from tokenmill.cluster.planner.policy import Planner, PlannerConfig
    from tokenmill.sizing.roofline import Deployment

    argv = sys.argv[1:]
    command = "tokenmill " + " ".join(shlex.quote(a) for a in argv) if "simulate" in argv else None
    modes = {"both": ["load", "sla"], "load": ["load"], "sla": ["sla"]}.get(mode)
    if modes is None:
        fail(f"--mode {mode!r}: use load, sla or both")
    if tp is not None and tp < 1:
        fail("--tp must be at least 1")
    if trace is not None and start_hour:
        fail("--start-hour places the daily curve; a --trace has its own times")
    if not 0 < static_slo <= 100:
        fail("--static-slo is a percentage in (0, 100]")
    if standby < 0:
        fail("--standby must be >= 0")
    if capacity not in ("measured", "sizing"):
        _capacity(capacity, None, 0.0, 0.0)  # a number, or a one-line error now rather than after a day
    a, g, f = _common(model, gpu, precision, factors, factor_profile)
    if tp is None:
        tp = _default_tp(a, g, precision, f)
    if tp > g.gpus_per_server:
        fail(f"--tp {tp} is more than the {g.gpus_per_server} GPUs of a {g.name} server")
    d = Deployment(a, g, precision, f, tp)
    if d.max_seqs(isl + osl) < 1:
        fail(f"{a.name} in {precision} does not fit on {tp} x {g.name} with a {isl + osl}-token context")
    try:
        warm_s = (
            warm_start_s
            if warm_start_s is not None
            else sim.warm_start_s(d, standby_h2d_gbps, standby_engine_s)
        )
    except ValueError as e:
        fail(str(e))
    try:
        cfg = sim.SimConfig(
            ttft_target_s=ttft_ms / 1e3,
            itl_target_s=itl_ms / 1e3,
            max_batch_tokens=max_batch_tokens,
            max_seqs=max_seqs,
            startup_s=startup_s,
            window_s=window_s,
        )
        if trace is not None:
            traffic = tr_mod.from_trace(trace, duration_h * 3600 if duration_h else None)
            source = f"trace {trace} ({len(traffic):,} requests)"
        else:
            traffic = tr_mod.diurnal(
                duration_s=(duration_h or 24.0) * 3600,
                peak_rps=peak_rps,
                peak_to_trough=peak_to_trough,
                bursts=bursts,
                burst_factor=burst_factor,
                isl=isl,
                osl=osl,
                isl_sigma=length_sigma,
                osl_sigma=length_sigma,
                start_hour=start_hour,
                seed=seed,
            )
            spikes = (
                f"bursts x{burst_factor:g}: {len(traffic.bursts)} in the period ({bursts} a day)"
                if bursts
                else "no bursts"
            )
            source = (
                f"diurnal curve, peak {peak_rps:g} req/s, peak/trough {peak_to_trough:g}, {spikes} "
                f"({len(traffic):,} requests)"
            )
    except ValueError as e:
        fail(str(e))
    if not len(traffic):
        fail("the traffic has no requests")

    period = _period(traffic, trace is not None)
    progress = Steps()  # on stderr, so that stdout is the result alone (JSON with --json)
    t0 = time.perf_counter()
    results: list = []
    with progress:
        # What a worker serves within the targets (a simulated fleet of 4 at steady rates): the
        # simulator's analogue of `tokenmill bench`; it calibrates the sla planner's capacity and gives
        # the static search its first guess.
        task = progress.add_task("measuring a worker's capacity", total=None)
        sample = slice(0, min(len(traffic), 50_000))  # lengths are drawn independently of time
        measured = baselines.measure_capacity(
            d, cfg, traffic.isl[sample], traffic.osl[sample], slo=static_slo / 100, workers=4
        )
        progress.update(task, total=1, completed=1)
        if measured <= 0:
            fail(f"one worker cannot meet TTFT {ttft_ms:g} ms and ITL {itl_ms:g} ms even at a light load")
        mean_isl, mean_osl = float(traffic.isl.mean()), float(traffic.osl.mean())
        sizing = sizing_capacity(d, ttft_ms / 1e3, itl_ms / 1e3)
        sizing_at_mean = sizing(mean_isl, mean_osl)

        if static_workers is None:
            task = progress.add_task("sizing the static fleet", total=None)
            _, rates = traffic.rate(300)
            guess = max(1, math.ceil(rates.max() / measured))
            try:
                n_static, window_att = baselines.static_peak_workers(
                    traffic,
                    d,
                    cfg,
                    slo=static_slo / 100,
                    window_s=static_window_min * 60,
                    guess=guess,
                    progress=lambda k: progress.update(
                        task, description=f"sizing the static fleet ({k} tried)"
                    ),
                )
            except ValueError as e:
                fail(str(e))
            progress.update(task, total=1, completed=1)
        else:
            if static_workers < 1:
                fail("--static-workers must be at least 1")
            n_static, window_att = static_workers, None

        def run(label: str, **kw):
            task = progress.add_task(label, total=1.0)
            r = sim.simulate(
                traffic,
                d,
                config=kw.pop("config", cfg),
                name=label,
                progress=lambda x: progress.update(task, completed=x),
                keep_requests=True,
                **kw,
            )
            results.append(r)
            return r

        static = run(f"static {n_static} (peak)", workers=n_static)
        upper = max_workers if max_workers is not None else n_static
        if not 1 <= min_workers <= upper:
            fail(f"need 1 <= --min-workers <= --max-workers, got {min_workers}..{upper}")
        cap_fn, cap_desc = _capacity(capacity, sizing, sizing_at_mean, measured)
        for m in modes:
            try:
                pc = PlannerConfig(
                    mode=m,
                    min_workers=min_workers,
                    max_workers=upper,
                    interval_s=interval_s,
                    up_cooldown_s=up_cooldown_s,
                    down_cooldown_s=down_cooldown_s,
                    up_queue_ratio=up_queue_ratio,
                    down_queue_ratio=down_queue_ratio,
                    up_waiting_per_worker=up_waiting,
                    up_kv_usage=up_kv,
                    down_kv_usage=down_kv,
                    up_intervals=up_intervals,
                    down_intervals=down_intervals,
                    ttft_target_s=ttft_ms / 1e3,
                    itl_target_s=itl_ms / 1e3,
                    headroom=headroom,
                    down_band=down_band,
                    startup_s=startup_s,
                    surge=surge,
                    surge_ratio=surge_ratio,
                )
                planner = Planner(pc, cap_fn if m == "sla" else None)
            except ValueError as e:
                fail(str(e))
            # The day starts with the fleet the planner settles on for the first minutes' traffic
            # (from the measured capacity), as after a previous day; not with the static fleet.
            first = traffic.window(0.0, min(600.0, traffic.duration_s))
            rate0 = len(first) / max(first.duration_s, 1.0)
            init = min(max(math.ceil(rate0 * (1 + headroom) / measured), min_workers), upper)
            try:
                run_cfg = sim.SimConfig(
                    **{
                        **cfg.__dict__,
                        "initial_workers": init,
                        "standby": standby,
                        "warm_start_s": warm_s,
                        "standby_refill_s": standby_refill_s,
                        "standby_holds_gpu": standby_holds_gpu,
                    }
                )
            except ValueError as e:
                fail(str(e))
            run(f"{m} planner", planner=planner, config=run_cfg)
    elapsed = time.perf_counter() - t0

    rows = [_row(r, static) for r in results]
    out = {
        "command": command,
        "period": period,
        "traffic": source,
        "deployment": {"model": a.name, "gpu": g.name, "precision": precision, "tp": tp, "factors": f.source},
        "targets": {"ttft_ms": ttft_ms, "itl_ms": itl_ms},
        "capacity_rps_per_worker": {
            "measured": measured,
            "sizing_model": sizing_at_mean,
            "sla_planner_uses": cap_desc,
            "at_mean_lengths": [mean_isl, mean_osl],
        },
        "static": {
            "workers": n_static,
            "sized_on": None
            if window_att is None
            else f"busiest {static_window_min:g} min, attainment {window_att:.4f} >= {static_slo / 100:g}",
        },
        "startup_s": startup_s,
        "burst_handling": {
            "surge": surge,
            "surge_ratio": surge_ratio if surge else None,
            "standby": standby,
            "warm_start_s": warm_s if standby else None,
            "standby_refill_s": (standby_refill_s if standby_refill_s is not None else startup_s)
            if standby
            else None,
            "standby_holds_gpu": standby_holds_gpu if standby else None,
        },
        "results": rows,
        "elapsed_s": elapsed,
    }
    if plot is not None:
        try:
            plot_day(traffic, results, plot, f"{period}, {a.name} {precision} on {g.name} (TP{tp}): {source}")
        except OSError as e:
            fail(f"cannot write the plot {plot}: {e.strerror or e}")
        out["plot"] = str(plot)
    if json_out:
        print(json.dumps(out, indent=2))
        return
    _print(out, rows)


def _default_tp(a, g, precision: str, f) -> int:
    """The fewest GPUs per worker (1, 2, 4, 8) whose share of the weights leaves half of each GPU's
    memory for the KV cache; the server's GPUs if none does (the fit is checked afterwards)."""
    from tokenmill.sizing.roofline import Deployment

    for tp in (1, 2, 4, 8):
        if tp > g.gpus_per_server:
            break
        if Deployment(a, g, precision, f, tp).weight_gb_per_gpu() <= g.memory_gb / 2:
            return tp
    return g.gpus_per_server


def _clock(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def _period(traffic, from_trace: bool) -> str:
    """What the run simulates, in words: the title of its results."""
    hours = traffic.duration_s / 3600
    if from_trace or traffic.clock_start_s is None:
        return f"{hours:g} h of a trace"
    start, end = traffic.clock_start_s, traffic.clock_start_s + traffic.duration_s
    days = traffic.duration_s / DAY_S
    if start == 0 and days == round(days):
        return "a simulated day" if days == 1 else f"{days:g} simulated days"
    if end <= DAY_S:
        return f"{_clock(start)}-{_clock(end)} of a simulated day"
    if end <= 2 * DAY_S:
        return f"simulated {hours:g} h, {_clock(start)} to {_clock(end - DAY_S)} the next day"
    return f"simulated {hours:g} h from {_clock(start)}"


def _capacity(spec: str, sizing, sizing_at_mean: float, measured: float):
    """The sla planner's requests/s per worker for (isl, osl)."""
    if spec == "sizing":
        return sizing, f"sizing model ({sizing_at_mean:.2f} req/s at the mean lengths)"
    if spec == "measured":
        # The sizing model's shape in (isl, osl), scaled to what the simulated worker serves at the
        # traffic's mean lengths: calibrated as `tokenmill bench` calibrates it on a real worker.
        scale = measured / sizing_at_mean if sizing_at_mean > 0 else 0.0

        def cap(i: float, o: float) -> float:
            return sizing(i, o) * scale if scale > 0 else measured

        return cap, f"measured {measured:.2f} req/s at the mean lengths (sizing model x {scale:.2f})"
    try:
        value = float(spec)
    except ValueError:
        fail(f"--capacity {spec!r}: use measured, sizing or requests/s per worker")
    if value <= 0:
        fail("--capacity must be positive")
    return (lambda i, o: value), f"{value:g} req/s per worker (given)"


def _row(r, static) -> dict:
    s = r.summary()
    s["saving"] = 1 - r.gpu_hours / static.gpu_hours if static.gpu_hours else 0.0
    s["attainment_delta_points"] = 100 * (r.attainment - static.attainment)
    return s


def _print(out: dict, rows: list[dict]) -> None:
    c = out["capacity_rps_per_worker"]
    if out["command"]:
        console.print(f"[dim]{out['command']}[/dim]", highlight=False)
    console.print(
        f"{out['traffic']}; {out['deployment']['model']} {out['deployment']['precision']} on "
        f"{out['deployment']['gpu']} (TP{out['deployment']['tp']}), targets TTFT "
        f"{out['targets']['ttft_ms']:g} ms, ITL {out['targets']['itl_ms']:g} ms",
        highlight=False,
    )
    console.print(
        f"a worker serves {c['measured']:.2f} req/s within the targets (simulated), the sizing model "
        f"{c['sizing_model']:.2f}; static fleet: {out['static']['workers']} workers"
        + (f" ({out['static']['sized_on']})" if out["static"]["sized_on"] else " (given)"),
        highlight=False,
    )
    t = Table(
        "fleet",
        "workers mean / max",
        "GPU-hours",
        "saving",
        "SLO attainment",
        "vs static",
        "TTFT p95 ms",
        "ITL p95 ms",
        "decisions (up/down)",
        title=out["period"],
        title_justify="left",
    )
    for r in rows:
        t.add_row(
            r["name"],
            f"{r['mean_workers']:.1f} / {r['peak_workers']}",
            f"{r['gpu_hours']:.1f}",
            f"{100 * r['saving']:.1f}%",
            f"{100 * r['attainment']:.2f}%",
            f"{r['attainment_delta_points']:+.2f} pt",
            f"{1e3 * r['ttft_p95_s']:.0f}" if r["ttft_p95_s"] is not None else "-",
            f"{1e3 * r['itl_p95_s']:.1f}" if r["itl_p95_s"] is not None else "-",
            f"{r['decisions']} ({r['scale_ups']}/{r['scale_downs']})",
        )
    console.print(t)
    b = out["burst_handling"]
    if b["surge"] or b["standby"]:
        parts = [f"burst detection at +{100 * b['surge_ratio']:.0f}%"] if b["surge"] else []
        if b["standby"]:
            cost = (
                "holding GPUs (in the GPU-hours)"
                if b["standby_holds_gpu"]
                else "weights in host memory, no GPU"
            )
            used = ", ".join(f"{r['name']} {r['warm_starts']}" for r in rows if r["standby"])
            parts.append(
                f"{b['standby']} warm standby ({cost}): serves {b['warm_start_s']:.1f} s after launch, "
                f"refilled in {b['standby_refill_s']:.0f} s; warm starts: {used}"
            )
        console.print("; ".join(parts), highlight=False)
    console.print(f"[dim]sla planner capacity: {c['sla_planner_uses']}[/dim]", highlight=False)
    if "plot" in out:
        console.print(f"plot: {out['plot']}", highlight=False)
    console.print(f"[dim]simulated in {out['elapsed_s']:.0f} s[/dim]")
