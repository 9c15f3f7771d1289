"""The planner over a bursty simulated day (issue 59): docs/history/benchmarks.md's day of Llama 3 8B FP8
on H100 (17 M requests, 4:1 daily curve) with its three 2x bursts of 5-15 minutes (`--bursts 3`, seed 0),
simulated twice by `tokenmill plan simulate`: the planners as they were (load and sla), and with burst
handling (burst detection, `--surge`, and a warm standby pool, `--standby N`: workers whose weights wait
in host memory and serve in ~10 s instead of 90 s). Each run has its own static fleet sized for the
busiest 30 minutes (the same traffic: the same fleet).

Reported and recorded (benchmarks/results/planner_day.jsonl): GPU-hours saving against the static fleet
and SLO attainment (share of requests within TTFT 1 s and mean ITL 50 ms) per planner, with and without
the burst handling; the goals read the worst of the two planners with it. The simulation is
deterministic for a seed: the CPU changes how long it takes, not what it finds. ~5 minutes of CPU per
run for the whole day.

    python benchmarks/planner_day.py [--duration-h 24] [--standby 12] [--plot docs/img/planner_day_bursty.png]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description  # noqa: E402
from results_log import add_flag, record  # noqa: E402

# The diary's command (docs/history/benchmarks.md, "The planner, simulated"), with the default bursts.
DAY = ["--model", "llama3-8b", "--gpu", "h100-sxm", "--precision", "fp8", "--peak-rps", "320",
       "--peak-to-trough", "4", "--bursts", "3", "--isl", "2000", "--osl", "200", "--ttft-ms", "1000",
       "--itl-ms", "50", "--mode", "both", "--min-workers", "1", "--headroom", "0.05", "--up-kv", "0.22",
       "--down-kv", "0.15", "--seed", "0"]  # fmt: skip


def simulate(extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "tokenmill.cli.main", "plan", "simulate", *DAY, *extra, "--json"]
    print("$ tokenmill plan simulate " + " ".join([*DAY, *extra]), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"plan simulate failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-h", type=float, default=24.0, help="hours of the day (shorter: a trial)")
    ap.add_argument("--start-hour", type=float, default=0.0)
    ap.add_argument("--standby", type=int, default=12, help="warm standby workers (weights in host memory)")
    ap.add_argument("--plot", type=Path, default=None, help="the day with burst handling, as a PNG")
    add_flag(ap)
    args = ap.parse_args()
    cpu = cpu_description()
    print(f"CPU: {cpu}")
    period = ["--duration-h", f"{args.duration_h:g}", "--start-hour", f"{args.start_hour:g}"]
    t0 = time.perf_counter()
    before = simulate(period)
    handling = ["--surge", "--standby", str(args.standby)]
    after = simulate([*period, *handling, *(["--plot", str(args.plot)] if args.plot else [])])
    elapsed = time.perf_counter() - t0

    static = before["results"][0]
    print(f"\n{after['period']}: {after['traffic']}")
    print(f"{'fleet':<34} {'GPU-h':>7} {'saving':>7} {'attainment':>11} {'vs static':>10} {'decisions':>9}")
    rows: dict[str, dict] = {}
    for tag, out in (("", before), ("burst handling", after)):
        for r in out["results"]:
            if tag and r["name"].startswith("static"):
                continue  # the same fleet on the same traffic as the first run's
            name = f"{r['name']}{', ' + tag if tag else ''}"
            rows[name] = r
            print(f"{name:<34} {r['gpu_hours']:>7.1f} {100 * r['saving']:>6.1f}% "
                  f"{100 * r['attainment']:>10.3f}% {r['attainment_delta_points']:>+9.3f} "
                  f"{r['decisions']:>9}")  # fmt: skip
    b = after["burst_handling"]
    warm = {r["name"]: r["warm_starts"] for r in after["results"] if r["standby"]}
    print(
        f"burst handling: detection at +{100 * b['surge_ratio']:.0f}%, {b['standby']} standby serving "
        f"{b['warm_start_s']:.1f} s after launch, refilled in {b['standby_refill_s']:.0f} s; "
        f"warm starts {warm}"
    )
    print(f"simulated in {elapsed:.0f} s on {cpu}")

    def pick(out: dict, mode: str) -> dict:
        return next(r for r in out["results"] if r["name"] == f"{mode} planner")

    metrics: dict[str, float | int | str | None] = {
        "static_workers": before["static"]["workers"],
        "static_gpu_hours": static["gpu_hours"],
        "static_attainment": static["attainment"],
        "requests": static["requests"],
        "standby": args.standby,
        "warm_start_s": b["warm_start_s"],
        "elapsed_s": elapsed,
    }
    for mode in ("load", "sla"):
        for suffix, out in (("", before), ("_burst_handling", after)):
            r = pick(out, mode)
            metrics[f"{mode}{suffix}_saving"] = r["saving"]
            metrics[f"{mode}{suffix}_attainment"] = r["attainment"]
            metrics[f"{mode}{suffix}_attainment_drop_pt"] = -r["attainment_delta_points"]
            metrics[f"{mode}{suffix}_decisions"] = r["decisions"]
            if suffix:
                metrics[f"{mode}{suffix}_warm_starts"] = r["warm_starts"]
                metrics[f"{mode}{suffix}_standby_host_gb_hours"] = r["standby_host_gb_hours"]
    # The goals: the worse of the two planners, with burst handling.
    metrics["bursty_day_saving"] = min(pick(after, m)["saving"] for m in ("load", "sla"))
    metrics["bursty_day_attainment_drop_pt"] = max(
        -pick(after, m)["attainment_delta_points"] for m in ("load", "sla")
    )
    if args.duration_h != 24.0 or args.start_hour:
        # A stretch of the day is a trial, not the day the goals are about.
        print("(a stretch of the day: not recorded)")
        return
    notes = (
        f"{after['period']}, {static['requests']:,} requests, bursts x2; "
        f"static {before['static']['workers']}; "
        f"burst handling: --surge --standby {args.standby} (warm start {b['warm_start_s']:.1f} s)"
    )
    record("planner_day", metrics, args=args, notes=notes)


if __name__ == "__main__":
    main()
