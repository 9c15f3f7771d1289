"""What a run leaves behind: summary.json, run.json (every record), CSV, PNG plots, a console table.

One level writes straight into the output folder. A sweep or a goodput search writes each level
into a sub-folder named after it, and at the top a summary.json with every level's summary under
"runs", a sweep.csv, and the throughput-versus-interactivity curve: output tokens/s of the system
against output tokens/s per user, one point per load level.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from tokenmill.bench.runner import BenchResult, LevelResult
from tokenmill.bench.stats import PERCENTILES
from tokenmill.extras import require

STAT_KEYS = ("mean", "min", "max", "std", *(f"p{p}" for p in PERCENTILES))
TABLE_METRICS = (
    ("ttft_ms", "TTFT ms"),
    ("ttst_ms", "TTST ms"),
    ("itl_ms", "ITL ms"),
    ("chunk_gap_ms", "chunk gap ms"),
    ("e2e_ms", "E2E ms"),
    ("tps_user", "tok/s/user"),
    ("isl", "ISL"),
    ("osl", "OSL"),
)
LEGEND = (
    "TTFT time to first token | TTST time from 1st to 2nd token | ITL (E2E - TTFT) / (OSL - 1) per request | "
    "chunk gap: between streamed chunks | E2E end-to-end latency | tok/s/user = 1/ITL | "
    "ISL/OSL input/output tokens"
)
RECORD_COLUMNS = (
    "index",
    "conversation",
    "turn",
    "warmup",
    "t_send",
    "t_end",
    "ttft_ms",
    "ttst_ms",
    "itl_ms",
    "e2e_ms",
    "tps_user",
    "isl",
    "osl",
    "osl_source",
    "requested_osl",
    "error",
    "error_detail",
)


def write_artifacts(result: BenchResult, out: Path, config: dict[str, Any]) -> list[Path]:
    """Write everything; return the summary.json paths written (top level first)."""
    out.mkdir(parents=True, exist_ok=True)
    single = len(result.levels) == 1 and result.search is None
    if single:
        _write_level(result.levels[0], out, config)
        return [out / "summary.json"]
    for lv in result.levels:
        _write_level(lv, out / lv.summary["label"], config)
    top = {"config": config, "runs": [lv.summary for lv in result.levels]}
    if result.search is not None:
        top["goodput_search"] = result.search
    (out / "summary.json").write_text(json.dumps(top, indent=2))
    _write_sweep_csv(result.levels, out / "sweep.csv")
    _plot_curve(result.levels, out / "throughput_vs_interactivity.png")
    return [out / "summary.json"]


def _write_level(lv: LevelResult, d: Path, config: dict[str, Any]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    level_cfg = {**config, "load": lv.load.__dict__}
    (d / "summary.json").write_text(json.dumps({"config": level_cfg, **lv.summary}, indent=2))
    run = {"config": level_cfg, "summary": lv.summary, "records": [r.to_json() for r in lv.records]}
    (d / "run.json").write_text(json.dumps(run))
    with (d / "records.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RECORD_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in lv.records:
            w.writerow(r.to_json())
    _plot_distributions(lv, d / "latency_distributions.png")


def _write_sweep_csv(levels: list[LevelResult], path: Path) -> None:
    cols = [
        "label",
        "concurrency",
        "request_rate",
        "completed",
        "failed",
        "cancelled_at_end",
        "request_throughput",
        "output_token_throughput",
        "input_token_throughput",
        "goodput",
        "slo_attainment",
    ]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        stat_cols = [
            f"{m}_{k}" for m in ("ttft_ms", "itl_ms", "e2e_ms", "tps_user") for k in ("p50", "p90", "p99")
        ]
        w.writerow(cols + stat_cols)
        for lv in levels:
            s = lv.summary
            row = [s.get(c) for c in cols]
            for m in ("ttft_ms", "itl_ms", "e2e_ms", "tps_user"):
                row += [(s.get(m) or {}).get(k) for k in ("p50", "p90", "p99")]
            w.writerow(row)


def _pyplot():
    require("bench", "the plots of tokenmill bench")
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    return plt


def _plot_distributions(lv: LevelResult, path: Path) -> None:
    ok = [r for r in lv.records if r.ok and not r.warmup]
    ttft = [v for r in ok if (v := r.metric_ms("ttft")) is not None]
    itl = [v for r in ok if (v := r.metric_ms("itl")) is not None]
    if not ttft and not itl:
        return
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, vals, name in (
        (axes[0], ttft, "time to first token (ms)"),
        (axes[1], itl, "inter-token latency (ms)"),
    ):
        if vals:
            ax.hist(vals, bins=min(40, max(5, len(vals) // 3)), color="#3b7dd8", edgecolor="white")
            for p, style in ((50, "-"), (99, "--")):
                x = float(np.percentile(vals, p))
                ax.axvline(x, color="#d84b3b", linestyle=style, label=f"p{p} {x:.3g}")
            ax.legend()
        ax.set_xlabel(name)
        ax.set_ylabel("requests")
    fig.suptitle(f"{lv.summary['label']}: {lv.summary['completed']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_curve(levels: list[LevelResult], path: Path) -> None:
    pts = [
        (lv.summary["tps_user"]["p50"], lv.summary["output_token_throughput"], lv.summary["label"])
        for lv in levels
        if lv.summary.get("tps_user")
    ]
    if not pts:
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    xs, ys, labels = zip(*pts, strict=True)
    ax.plot(xs, ys, "o-", color="#3b7dd8")
    for x, y, label in pts:
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("output tokens/s per user (median of 1/ITL): interactivity")
    ax.set_ylabel("output tokens/s, whole system: throughput")
    ax.set_title("throughput vs interactivity")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def print_level(console: Console, s: dict[str, Any]) -> None:
    table = Table(
        title=f"tokenmill bench: {s['label']}", title_justify="left", caption=LEGEND, caption_justify="left"
    )
    table.add_column("metric", no_wrap=True)
    for k in STAT_KEYS:
        table.add_column(k, justify="right")
    for key, name in TABLE_METRICS:
        stats = s.get(key)
        if stats:
            table.add_row(name, *(_fmt(stats[k]) for k in STAT_KEYS))
    console.print(table)
    console.print(
        f"requests: {s['completed']} completed, {s['failed']} failed"
        + (f", {s['cancelled_at_end']} cancelled at the end" if s.get("cancelled_at_end") else "")
        + f" in {s['duration_s']:.2f} s | {s['request_throughput']:.2f} req/s | "
        f"output {s['output_token_throughput']:.1f} tok/s | input {s['input_token_throughput']:.1f} tok/s"
    )
    if s["slos"]:
        console.print(
            f"goodput ({', '.join(s['slos'])}): {s['goodput']:.2f} req/s, "
            f"{100 * s['slo_attainment']:.1f}% of requests met every SLO"
        )
    console.print(f"load generator CPU: {s['client_cpu_pct']:.1f}% of one core")
    print_errors(console, s)


def print_errors(console: Console, s: dict[str, Any]) -> None:
    if s["completed"] == 0:
        # Cancelled requests are neither successes nor failures: without this line a level whose every
        # request outlived its duration read "0 failed".
        why = []
        if s.get("cancelled_at_end"):
            why.append(f"{s['cancelled_at_end']} still running after --duration + --grace-period, cancelled")
        if s["failed"]:
            why.append(f"{s['failed']} failed")
        console.print(
            f"[bold red]{s['label']}: NO REQUEST COMPLETED[/bold red]"
            + (f" ({'; '.join(why)})" if why else ""),
            highlight=False,
        )
    if s["failed"]:
        kinds = ", ".join(f"{k}: {n}" for k, n in s["errors"].items())
        console.print(
            f"[bold red]{s['failed']} REQUESTS FAILED[/bold red] ({kinds}); see records.csv", highlight=False
        )


def _kept_up(s: dict[str, Any]) -> float | None:
    """Completion rate / arrival rate of an open-loop level (below ~0.9: the queue was growing)."""
    if s.get("request_rate") is None or not s.get("arrival_rate") or s.get("completion_rate") is None:
        return None
    return s["completion_rate"] / s["arrival_rate"]


def print_sweep(console: Console, levels: list[dict[str, Any]]) -> None:
    table = Table(title="tokenmill bench: sweep", title_justify="left")
    for col in (
        "level",
        "ok",
        "failed",
        "cancelled",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "tok/s/user p50",
        "goodput",
        "done/sent",
    ):
        table.add_column(col, justify="right")
    for s in levels:

        def st(m: str, k: str, s=s) -> str:
            return _fmt((s.get(m) or {}).get(k))

        table.add_row(
            s["label"],
            str(s["completed"]),
            str(s["failed"]),
            str(s.get("cancelled_at_end", 0)),
            _fmt(s["request_throughput"]),
            _fmt(s["output_token_throughput"]),
            st("ttft_ms", "p50"),
            st("ttft_ms", "p99"),
            st("itl_ms", "p50"),
            st("itl_ms", "p99"),
            st("tps_user", "p50"),
            _fmt(s["goodput"]),
            _fmt(_kept_up(s)),
        )
    console.print(table)
    for s in levels:
        print_errors(console, s)
