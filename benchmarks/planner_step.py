"""The load planner on this machine: a step in the request rate against `tokenmill serve --workers 1..2
--planner load`. Three phases of `tokenmill bench` at a fixed Poisson rate (low, high, low); the
planner's worker counts are read from /metrics every second. Reported: failed requests (must be 0), the
workers over time, and TTFT p95 per phase, with the high phase split into before and after the second
worker serves (the TTFT target must hold again after the step). A plot of the timeline goes to --plot.

`--burst RATE,SECONDS` makes the middle phase a burst instead of the step: RATE for SECONDS (a short
high-rate phase, as the simulated day's bursts are), between the two low phases of --phase-s (its middle
figure is then unused). The report is the same: TTFT p95 before, during (split at the second worker's
arrival) and after the burst, and when the second worker served.

    python benchmarks/planner_step.py [--low 1 --high 4 --phase-s 120,180,180] [--plot out.png]
    python benchmarks/planner_step.py --low 0.4 --burst 1.6,60 --phase-s 90,0,150 [--surge]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from machine import cpu_description  # noqa: E402
from server_fixture import running_server  # noqa: E402


def planner_workers(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {
        m[0]: float(m[1])
        for m in re.findall(r'tokenmill:planner_workers\{[^}]*state="(\w+)"[^}]*\} ([\d.]+)', text)
    }


def p95(xs: list[float]) -> float | None:
    return sorted(xs)[min(int(0.95 * len(xs)), len(xs) - 1)] if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--low", type=float, default=1.0, help="requests/s before and after the step")
    ap.add_argument("--high", type=float, default=4.0, help="requests/s during the step")
    ap.add_argument("--phase-s", default="120,180,180", help="seconds of the low, high and low phases")
    ap.add_argument("--burst", default=None, help="RATE,SECONDS: a burst as the middle phase instead")
    ap.add_argument("--isl", type=int, default=256)
    ap.add_argument("--osl", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--ttft-target-s", type=float, default=2.0)
    ap.add_argument("--surge", action="store_true", help="burst detection on (serve --planner-surge)")
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    phases = [float(x) for x in args.phase_s.split(",")]
    rates = [args.low, args.high, args.low]
    if args.burst:
        burst_rate, burst_s = (float(x) for x in args.burst.split(","))
        rates[1], phases[1] = burst_rate, burst_s
    print(f"CPU: {cpu_description()}")
    serve = ["--workers", "1..2", "--planner", "load", "--planner-interval-s", "5",
             "--planner-window-s", "30", "--planner-up-cooldown-s", "20", "--planner-down-cooldown-s", "60",
             "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "1024",
             *(["--planner-surge"] if args.surge else [])]  # fmt: skip
    timeline: list[tuple[float, float, float, float]] = []  # (t, serving, starting, draining)
    results = []
    with running_server(*serve, timeout=300) as proc, tempfile.TemporaryDirectory() as tmp:
        base = proc.base_url
        t0 = time.monotonic()
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                try:
                    w = planner_workers(base)
                    timeline.append((time.monotonic() - t0, w.get("serving", 0), w.get("starting", 0),
                                     w.get("draining", 0)))  # fmt: skip
                except httpx.HTTPError:
                    pass
                stop.wait(1.0)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        for i, (rate, secs) in enumerate(zip(rates, phases, strict=True)):
            out = Path(tmp) / f"phase{i}"
            start = time.monotonic() - t0
            cmd = [sys.executable, "-m", "tokenmill.cli.main", "bench", "--url", f"{base}/v1",
                   "--request-rate", str(rate), "--duration", str(secs), "--isl", str(args.isl),
                   "--osl", str(args.osl), "--seed", str(i), "--output", str(out)]  # fmt: skip
            r = subprocess.run(cmd, capture_output=True, text=True)
            run = json.loads((out / "run.json").read_text())
            recs = [x for x in run["records"] if not x.get("warmup")]
            ok = [x for x in recs if x.get("error") is None and x.get("ttft_ms") is not None]
            results.append({"phase": i, "rate": rate, "start": start, "end": time.monotonic() - t0,
                            "exit": r.returncode, "requests": len(recs), "failed": len(recs) - len(ok),
                            "records": ok})  # fmt: skip
            failed = len(recs) - len(ok)
            print(f"phase {i}: {rate} req/s for {secs:.0f}s: {len(recs)} requests, {failed} failed "
                  f"(bench exit {r.returncode})", flush=True)  # fmt: skip
        stop.set()
        poller.join()
    # When did the second worker start serving in the high phase?
    hi = results[1]
    up_at = next((t for t, s, _, _ in timeline if s >= 2 and t >= hi["start"]), None)
    print(f"\nTTFT p95 by phase (target {args.ttft_target_s:.1f}s)")
    for r in results:
        ttfts = [x["ttft_ms"] / 1e3 for x in r["records"]]
        print(
            f"  phase {r['phase']} ({r['rate']} req/s): p95 {p95(ttfts) or 0:.2f}s over {len(ttfts)} requests"
        )
    if up_at is not None:
        # Requests of the high phase are in send order; split them at the second worker's arrival by
        # the fraction of the phase that had passed (the bench's clock is its own).
        frac = (up_at - hi["start"]) / (hi["end"] - hi["start"])
        recs = sorted(hi["records"], key=lambda x: x["index"])
        cut = int(frac * len(recs))
        before = [x["ttft_ms"] / 1e3 for x in recs[:cut]]
        after = [x["ttft_ms"] / 1e3 for x in recs[cut + len(recs) // 10 :]]  # after a short settling tenth
        b, a = p95(before) or 0.0, p95(after) or 0.0
        print(f"  high phase before 2 workers served ({up_at - hi['start']:.0f}s in): "
              f"p95 {b:.2f}s; after: p95 {a:.2f}s ({len(after)} requests)")  # fmt: skip
    else:
        print("  the planner never brought a second worker up in the high phase")
    downs = [t for t, s, _, d in timeline if t >= results[2]["start"] and s == 1 and d == 0]
    print(f"back to one worker at {downs[0] - results[2]['start']:.0f}s into the last phase" if downs
          else "still two workers at the end")  # fmt: skip
    print(f"failed requests in all: {sum(r['failed'] for r in results)}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
        for r in results:
            ax[0].axvspan(
                r["start"], r["end"], alpha=0.08 if r["rate"] == args.low else 0.2, color="tab:blue"
            )
            n = len(r["records"])
            ts = [r["start"] + (r["end"] - r["start"]) * k / max(n, 1) for k in range(n)]
            ax[0].scatter(
                ts, [x["ttft_ms"] / 1e3 for x in sorted(r["records"], key=lambda x: x["index"])], s=4
            )
        ax[0].axhline(args.ttft_target_s, color="red", linestyle="--", label="TTFT target")
        ax[0].set_ylabel("TTFT (s)")
        ax[0].legend()
        ax[1].step([t for t, *_ in timeline], [s for _, s, _, _ in timeline], where="post", label="serving")
        ax[1].step([t for t, *_ in timeline], [s + st for _, s, st, _ in timeline], where="post",
                   linestyle=":", label="serving + starting")  # fmt: skip
        ax[1].set_ylabel("workers")
        ax[1].set_xlabel("seconds")
        ax[1].legend()
        fig.suptitle(
            f"load planner{' with burst detection' if args.surge else ''}, "
            f"{rates[0]} -> {rates[1]} ({phases[1]:.0f} s) -> {rates[2]} req/s "
            f"({cpu_description()})",
            fontsize=9,
        )
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
