"""The planner's simulator and traffic: closed forms on tiny cases, the planner's reactions, traces, seeds,
and `tokenmill plan simulate` end to end on a short day. Pure Python/numpy: seconds, no model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from tokenmill.cli.main import app
from tokenmill.cluster.planner import traffic as T
from tokenmill.cluster.planner.baselines import busiest_window, measure_capacity, static_peak_workers
from tokenmill.cluster.planner.policy import Planner, PlannerConfig
from tokenmill.cluster.planner.simulator import SimConfig, simulate
from tokenmill.sizing import arch, hardware
from tokenmill.sizing.roofline import Deployment

LLAMA = arch.resolve("llama3-8b")
H100 = hardware.resolve("h100-sxm")


def deployment(tp: int = 1, profile: str = "default") -> Deployment:
    f = hardware.NIM_H100["fp8"] if profile == "nim" else hardware.default_factors("h100-sxm", "fp8")
    return Deployment(LLAMA, H100, "fp8", f, tp)


def one(t: float, isl: int, osl: int, duration: float = 60.0) -> T.Traffic:
    return T.Traffic(np.array([t]), np.array([isl]), np.array([osl]), duration)


def steps(parts: list[tuple[float, float]], isl: int = 2000, osl: int = 200, seed: int = 0) -> T.Traffic:
    """Steady Poisson stretches one after the other: [(seconds, req/s), ...]."""
    return T.concat([T.constant(s, r, isl, osl, seed=seed + i) for i, (s, r) in enumerate(parts)])


# -- closed forms ----------------------------------------------------------------------------------------
def test_one_request_alone_ttft_is_prefill_plus_client_and_itl_one_decode_step() -> None:
    d = deployment(profile="nim")  # client_s > 0: TTFT includes it
    assert d.factors.client_s > 0
    r = simulate(one(5.0, 2000, 101), d, workers=1)
    assert r.finished == 1 and r.attainment == 1.0
    assert r.ttft[0] == pytest.approx(d.prefill_s(1, 2000) + d.factors.client_s, rel=1e-12)
    # 100 decode steps of one sequence, its context growing 2000 -> 2100 (costed at the run's mean
    # context, rounded to 16 tokens: within a fraction of a percent of the per-step sum)
    exact = sum(d.decode_step_s(1, 2000 + k) for k in range(100)) / 100
    assert r.itl[0] == pytest.approx(exact, rel=3e-3)


def test_one_token_output_finishes_at_its_first_token() -> None:
    d = deployment()
    r = simulate(one(0.0, 512, 1), d, workers=1)
    assert r.ttft[0] == pytest.approx(d.prefill_s(1, 512))
    assert r.itl[0] == 0.0


def test_a_long_prompt_is_prefilled_in_chunks_of_the_step_budget() -> None:
    d = deployment()
    cfg = SimConfig(max_batch_tokens=4096)
    r = simulate(one(0.0, 10_000, 2), d, workers=1, config=cfg)
    chunks = [4096, 4096, 1808]
    assert r.ttft[0] == pytest.approx(sum(d.prefill_s(1, c) for c in chunks))


def test_static_gpu_hours_are_workers_times_gpus_times_duration() -> None:
    d = deployment(tp=2)
    tr = T.constant(600.0, 3.0, 1000, 100, seed=1)
    r = simulate(tr, d, workers=3)
    assert r.gpu_hours == pytest.approx(3 * 2 * 600 / 3600)
    assert r.worker_hours == pytest.approx(0.5) and r.mean_workers == pytest.approx(3)
    assert r.timeline[0] == (0.0, 3, 0, 0) and r.peak_workers == 3 and not r.decisions


def test_overload_misses_and_a_bigger_static_fleet_does_not() -> None:
    d = deployment()
    tr = T.constant(300.0, 60.0, 2000, 200, seed=3)
    small, big = simulate(tr, d, workers=1), simulate(tr, d, workers=4)
    assert small.attainment < 0.5 < 0.99 <= big.attainment
    assert small.ttft_p95_s > 10 * big.ttft_p95_s


# -- the planner in the loop ------------------------------------------------------------------------------
def test_light_steady_load_attains_everything_and_the_planner_settles_at_its_minimum() -> None:
    d = deployment()
    tr = T.constant(1800.0, 2.0, 2000, 200, seed=4)
    for mode in ("load", "sla"):
        pc = PlannerConfig(mode=mode, min_workers=1, max_workers=4, itl_target_s=0.05, startup_s=90)
        planner = Planner(pc, (lambda i, o: 20.0) if mode == "sla" else None)
        r = simulate(tr, d, planner=planner, config=SimConfig(initial_workers=4))
        assert r.attainment == 1.0, mode
        assert r.timeline[-1][1:] == (1, 0, 0), mode  # one serving, none starting or draining
        assert all(dec.delta == -1 for dec in r.decisions), mode  # one at a time, never up
        assert len(r.decisions) == 3
        assert r.decide_calls == 180
        # four workers for a while, then fewer: less than 4 x 0.5 h of GPU time
        assert 0.5 < r.gpu_hours < 1.2


@pytest.mark.parametrize("mode", ["load", "sla"])
def test_a_step_up_is_followed_within_a_few_intervals_and_undone_after(mode: str) -> None:
    d = deployment()
    tr = steps([(600.0, 4.0), (900.0, 60.0), (1800.0, 4.0)])
    pc = PlannerConfig(mode=mode, min_workers=1, max_workers=6, itl_target_s=0.05, startup_s=60)
    planner = Planner(pc, (lambda i, o: 20.0) if mode == "sla" else None)
    r = simulate(tr, d, planner=planner, config=SimConfig(startup_s=60, initial_workers=1))
    ups = [x for x in r.decisions if x.delta > 0]
    assert ups and 600 < ups[0].time <= 600 + 4 * pc.interval_s  # within a few intervals of the step
    peak = max(s for _, s, _, _ in r.timeline)
    assert peak >= 3  # 60 req/s needs at least 3 workers of ~20
    assert r.timeline[-1][1] == 1  # back at the minimum after the step down
    assert any(x.delta < 0 and x.time > 1500 for x in r.decisions)
    # three serving within a few start-ups (a scale-up waits for the workers still starting)
    assert min(t for t, s, _, _ in r.timeline if s >= 3) < 600 + 4 * 60 + 6 * pc.interval_s
    # and the fleet served the 60 req/s once the new workers were up (misses only around the step)
    late = (tr.t > 600 + 300) & (tr.t < 1500)
    assert r.met()[late].mean() > 0.99


def test_a_worker_drains_before_it_stops_and_its_gpu_time_counts_until_then() -> None:
    d = deployment()
    tr = steps([(300.0, 30.0), (600.0, 0.5)])
    pc = PlannerConfig(mode="sla", min_workers=1, max_workers=3, down_intervals=1, down_cooldown_s=0)
    r = simulate(tr, d, planner=Planner(pc, lambda i, o: 20.0), config=SimConfig(initial_workers=3))
    assert r.finished == len(tr)  # nothing lost in a drain
    drains = [row for row in r.timeline if row[3] > 0]
    assert drains  # seen draining at some point
    assert r.timeline[-1][1:] == (1, 0, 0)
    assert r.gpu_hours < 3 * 900 / 3600


# -- traffic ----------------------------------------------------------------------------------------------
def test_diurnal_curve_has_its_peak_to_trough_and_mean() -> None:
    tr = T.diurnal(peak_rps=2.0, peak_to_trough=4.0, bursts=0, seed=1)
    x = np.linspace(0, 86400, 10_001)
    r = tr.rate_fn(x)
    assert r.max() == pytest.approx(2.0, rel=1e-4) and r.min() == pytest.approx(0.5, rel=1e-4)
    assert x[np.argmin(r)] / 3600 == pytest.approx(4.0, abs=0.01)  # trough at 4 am, peak at 4 pm
    assert len(tr) == pytest.approx(86400 * 1.25, rel=0.02)  # mean = (peak + trough) / 2
    assert tr.isl.mean() == pytest.approx(2000, rel=0.02) and tr.osl.min() >= 1
    assert np.all(np.diff(tr.t) >= 0)


def test_bursts_multiply_the_rate_while_they_last() -> None:
    tr = T.diurnal(peak_rps=5.0, bursts=2, burst_factor=2.0, seed=7)
    assert len(tr.bursts) == 2
    for b in tr.bursts:
        assert 300 <= b.duration_s <= 900
        inside = b.start_s + b.duration_s / 2
        base = T.diurnal_rate(5.0, 4.0)(np.array([inside]))[0]
        assert tr.rate_fn(np.array([inside]))[0] == pytest.approx(2 * base)


def test_the_same_seed_gives_the_same_day_and_the_same_simulation() -> None:
    a = T.diurnal(duration_s=1800, peak_rps=20, bursts=1, seed=5)
    b = T.diurnal(duration_s=1800, peak_rps=20, bursts=1, seed=5)
    c = T.diurnal(duration_s=1800, peak_rps=20, bursts=1, seed=6)
    assert np.array_equal(a.t, b.t) and np.array_equal(a.isl, b.isl) and np.array_equal(a.osl, b.osl)
    assert len(a) != len(c) or not np.array_equal(a.t, c.t)
    d = deployment()
    runs = [
        simulate(a, d, planner=Planner(PlannerConfig(mode="load", max_workers=4)), config=SimConfig())
        for _ in range(2)
    ]
    assert runs[0].summary() == runs[1].summary()
    assert np.array_equal(runs[0].ttft, runs[1].ttft, equal_nan=True)


def test_a_shorter_period_is_that_stretch_of_the_day_not_a_day_squeezed_into_it() -> None:
    hour = 3600.0
    day = T.diurnal(peak_rps=5.0, bursts=8, seed=3)
    part = T.diurnal(duration_s=2 * hour, start_hour=14, peak_rps=5.0, bursts=8, seed=3)
    # The same curve at the same time of day...
    x = np.linspace(0.0, 2 * hour, 501)
    assert np.allclose(part.rate_fn(x), day.rate_fn(x + 14 * hour), rtol=1e-12)
    # ...and the day's own bursts in those hours (times from the period's start), not 8 crowded in.
    inside = [
        (b.start_s, b.duration_s)
        for b in day.bursts
        if b.start_s < 16 * hour and b.start_s + b.duration_s > 14 * hour
    ]
    got = [(b.start_s + 14 * hour, b.duration_s) for b in part.bursts]
    assert inside and np.allclose(got, inside, rtol=0, atol=1e-6)
    early = T.diurnal(duration_s=2 * hour, peak_rps=5.0, bursts=8, seed=3)
    assert len(early.bursts) < 8
    assert len(early.bursts) == sum(1 for b in day.bursts if b.start_s < 2 * hour)
    assert part.clock_start_s == 14 * hour and day.clock_start_s == 0.0
    # Arrivals over the two hours follow the afternoon's rate, near the peak (16:00).
    assert len(part) == pytest.approx(2 * hour * float(part.rate_fn(x).mean()), rel=0.05)
    with pytest.raises(ValueError, match="start hour"):
        T.diurnal(duration_s=hour, start_hour=24)


def test_trace_round_trip_csv_and_jsonl(tmp_path) -> None:
    tr = T.diurnal(duration_s=600, peak_rps=3, bursts=0, seed=2)
    path = tmp_path / "trace.csv"
    tr.to_csv(path)
    back = T.from_trace(path, duration_s=600)
    assert np.array_equal(back.t, tr.t) and np.array_equal(back.isl, tr.isl)
    assert np.array_equal(back.osl, tr.osl)
    jl = tmp_path / "trace.jsonl"
    # out of order and in epoch seconds: sorted and shifted to start at 0
    cols = zip(tr.t.tolist(), tr.isl.tolist(), tr.osl.tolist(), strict=True)
    recs = [{"timestamp": 1.7e9 + t, "isl": i, "osl": o} for t, i, o in cols]
    jl.write_text("\n".join(json.dumps(r) for r in reversed(recs)) + "\n")
    again = T.from_trace(jl)
    assert again.t[0] == 0.0 and np.allclose(again.t, tr.t - tr.t[0], atol=1e-6)
    assert again.duration_s % 60 == 0 and again.duration_s >= again.t[-1]
    d = deployment()
    assert simulate(back, d, workers=1).summary() == simulate(tr, d, workers=1).summary()


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.csv", "time,isl,osl\n1,2,3\n", "must name timestamp, isl and osl"),
        ("b.csv", "timestamp,isl,osl\n1,0,3\n", "b.csv:2: isl and osl must be at least 1"),
        ("c.csv", "timestamp,isl,osl\nx,2,3\n", "c.csv:2: timestamp must be a number"),
        ("d.jsonl", '{"timestamp": 1, "isl": 2}\n', "d.jsonl:1: not a trace record"),
        ("e.csv", "timestamp,isl,osl\n", "no requests"),
    ],
)
def test_trace_errors_name_the_line(tmp_path, name: str, text: str, message: str) -> None:
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ValueError, match=message):
        T.from_trace(p)


# -- baselines --------------------------------------------------------------------------------------------
def test_capacity_and_static_peak_sizing() -> None:
    d = deployment()
    cap = measure_capacity(d, SimConfig(), 2000, 200, workers=1, duration_s=300)
    assert 10 < cap < 30  # Llama 3 8B fp8 on an H100, 2000/200, ITL 50 ms (the sizing model says ~13)
    tr = steps([(600.0, 5.0), (600.0, 3.5 * cap), (600.0, 5.0)])
    assert busiest_window(tr, 600.0) == pytest.approx(600.0, abs=60)
    n, att = static_peak_workers(tr, d, SimConfig(), slo=0.99, window_s=600.0, warmup_s=120.0, guess=1)
    assert n == 4 and att >= 0.99  # 3.5 workers' worth of traffic


# -- the command ------------------------------------------------------------------------------------------
def test_plan_simulate_cli_short_day(tmp_path) -> None:
    out = tmp_path / "day.png"
    res = CliRunner().invoke(
        app,
        [
            "plan",
            "simulate",
            "--duration-h",
            "0.5",
            "--peak-rps",
            "30",
            "--bursts",
            "1",
            "--plot",
            str(out),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    o = json.loads(res.stdout)  # the progress goes to stderr
    assert o["period"] == "00:00-00:30 of a simulated day"
    # the default model's weights take two H100s to leave half of each GPU for the KV cache
    assert o["deployment"]["model"] == "llama3-70b" and o["deployment"]["tp"] == 2
    names = [r["name"] for r in o["results"]]
    assert names[0].startswith("static") and names[1:] == ["load planner", "sla planner"]
    assert o["static"]["workers"] >= 1 and o["capacity_rps_per_worker"]["measured"] > 0
    assert all(0 <= r["attainment"] <= 1 for r in o["results"])
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"


def test_plan_simulate_default_tp_leaves_half_the_memory_for_the_kv_cache() -> None:
    from tokenmill.cli.plan import _default_tp

    f = hardware.default_factors("h100-sxm", "fp8")
    tps = {
        m: _default_tp(arch.resolve(m), H100, "fp8", f) for m in ("llama3-8b", "llama3-70b", "llama3.1-405b")
    }
    assert tps == {"llama3-8b": 1, "llama3-70b": 2, "llama3.1-405b": 8}  # 8, 35 and 51 GB a GPU of 80


def test_plan_simulate_cli_errors_are_one_line(tmp_path) -> None:
    runner = CliRunner()
    for args, message in [
        (["--mode", "both-ways"], "--mode"),
        (["--trace", str(tmp_path / "missing.csv")], "cannot read the trace"),
        (["--precision", "fp3"], "--precision"),
        (["--capacity", "lots", "--duration-h", "0.1", "--peak-rps", "2"], "--capacity"),
        (["--start-hour", "25", "--duration-h", "0.1"], "the start hour must be in [0, 24)"),
        (["--trace", str(tmp_path / "t.csv"), "--start-hour", "3"], "--start-hour places the daily curve"),
    ]:
        res = runner.invoke(app, ["plan", "simulate", *args])
        assert res.exit_code == 2, (args, res.output)
        assert message in res.output and "Traceback" not in res.output


def test_plan_simulate_prints_whole_tables_when_not_on_a_terminal() -> None:
    """Under a pipe or a parent process: the result on stdout, its table uncut and titled with what was
    simulated (two hours of the day, not "a simulated day"), the progress as plain lines on stderr."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    args = ["plan", "simulate", "--duration-h", "2", "--peak-rps", "4", "--bursts", "0"]
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(ln.strip() == "00:00-02:00 of a simulated day" for ln in lines), r.stdout
    assert "\u2026" not in r.stdout, r.stdout  # nothing cut with an ellipsis
    header = next(ln for ln in lines if "fleet" in ln and "GPU-hours" in ln)
    for col in ("workers mean / max", "SLO attainment", "vs static", "TTFT p95 ms", "decisions (up/down)"):
        assert col in header, header
    for name in ("static", "load planner", "sla planner"):
        assert any(name in ln and "%" in ln for ln in lines), (name, r.stdout)
    assert "measuring a worker's capacity ..." in r.stderr and "sla planner: done in" in r.stderr, r.stderr
    assert "\x1b[" not in r.stderr


# -- bursts: detection and a warm standby pool ------------------------------------------------------------
@pytest.mark.parametrize("mode", ["load", "sla"])
def test_burst_detection_and_a_warm_standby_hold_the_slo_through_a_burst(mode: str) -> None:
    d = deployment()
    tr = steps([(600.0, 30.0), (300.0, 60.0), (300.0, 30.0)], seed=3)  # a 2x burst of 5 minutes

    def run(surge: bool, standby: int):
        pc = PlannerConfig(mode=mode, min_workers=1, max_workers=8, startup_s=90, surge=surge)
        planner = Planner(pc, (lambda i, o: 20.0) if mode == "sla" else None)
        cfg = SimConfig(startup_s=90, initial_workers=2, standby=standby, warm_start_s=10)
        return simulate(tr, d, planner=planner, config=cfg)

    old, new = run(False, 0), run(True, 4)
    burst = (tr.t >= 600) & (tr.t < 900)
    assert new.warm_starts >= 1 and old.warm_starts == 0
    # the new workers come from the pool within one interval and a warm start of the burst's start
    first_up = min(x.time for x in new.decisions if x.delta > 0 and x.time >= 600)
    assert first_up <= 600 + 2 * 10
    assert new.met()[burst].mean() > old.met()[burst].mean() + 0.05
    assert new.attainment > old.attainment
    # the pool holds no GPU: GPU-hours are the workers'; its cost is host memory, all period long
    assert new.standby_gpu_hours == 0.0
    assert new.standby_host_gb_hours == pytest.approx(4 * d.weight_gb_per_gpu() * d.gpus * 1200 / 3600)


def test_a_standby_that_holds_a_gpu_is_counted_in_the_gpu_hours_and_a_used_one_refills() -> None:
    d = deployment()
    tr = steps([(200.0, 10.0)])
    planner = Planner(PlannerConfig(mode="load", max_workers=3))
    base = {"startup_s": 90.0, "standby": 2, "warm_start_s": 5.0}
    held = simulate(tr, d, planner=planner, config=SimConfig(**base, standby_holds_gpu=True))
    assert held.standby_gpu_hours == pytest.approx(2 * 200 / 3600 * d.gpus)
    assert held.worker_hours == pytest.approx((held.gpu_hours - held.standby_gpu_hours) / d.gpus)
    # two launches at once take both standbys; a third before the refill is a cold start
    from tokenmill.cluster.planner.simulator import _Sim

    s = _Sim(tr, d, None, 1, SimConfig(**base, standby_refill_s=60.0), None)
    for now in (10.0, 10.0, 20.0, 80.0):
        s._launch(now)
    ready = sorted(t for t, _, kind, _, _ in s.heap if kind == 1)  # _READY events
    assert ready == [15.0, 15.0, 85.0, 110.0]  # warm, warm, warm (refilled at 70 s), cold (20 + 90)
    assert s.warm_starts == 3
