"""What a run leaves behind: summary.json, run.json (every record), CSV, PNG plots, report.html, a
console table.

One level writes straight into the output folder. A sweep or a goodput search writes each level
into a sub-folder named after it, and at the top a summary.json with every level's summary under
"runs", a sweep.csv, and the throughput-versus-interactivity curve: output tokens/s of the system
against output tokens/s per user, one point per load level. report.html (html_report.py) holds the
same tables and plots in one file that opens without a notebook or a network.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from tokenmill.bench.runner import BenchResult, LevelResult
from tokenmill.bench.stats import PERCENTILES
from tokenmill.extras import require

CURVE_PNG = "throughput_vs_interactivity.png"
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
    """Write everything; return the top summary.json and report.html."""
    out.mkdir(parents=True, exist_ok=True)
    # Each plot is drawn once: its PNG goes to a file and, from memory, into report.html.
    plots: dict[str, bytes | None] = {}  # level label (or CURVE_PNG) -> PNG; None: nothing to plot
    single = len(result.levels) == 1 and result.search is None
    if single:
        plots[result.levels[0].summary["label"]] = _write_level(result.levels[0], out, config)
    else:
        for lv in result.levels:
            plots[lv.summary["label"]] = _write_level(lv, out / lv.summary["label"], config)
        top = {"config": config, "runs": [lv.summary for lv in result.levels]}
        if result.search is not None:
            top["goodput_search"] = result.search
        (out / "summary.json").write_text(json.dumps(top, indent=2))
        _write_sweep_csv(result.levels, out / "sweep.csv")
        plots[CURVE_PNG] = _save(curve_figure([("", [lv.summary for lv in result.levels])]), out / CURVE_PNG)
    # Imported here: html_report builds on this module's figures and formats, so the import runs one way.
    from tokenmill.bench.html_report import write_html

    return [out / "summary.json", write_html(out, result, config, plots)]


def _write_level(lv: LevelResult, d: Path, config: dict[str, Any]) -> bytes | None:
    """Write one level's files; return its distribution plot's PNG (None when it has no latencies)."""
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
    return _save(distribution_figure(lv), d / "latency_distributions.png")


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


def png_bytes(fig: Any) -> bytes:
    """A figure as PNG bytes (the figure is closed: pyplot keeps every open figure alive)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    _pyplot().close(fig)
    return buf.getvalue()


def _save(fig: Any, path: Path) -> bytes | None:
    if fig is None:
        return None
    png = png_bytes(fig)
    path.write_bytes(png)
    return png


def distribution_figure(lv: LevelResult) -> Any:
    """Histograms of TTFT and ITL with p50 and p99 marked; None when the level has neither."""
    ok = [r for r in lv.records if r.ok and not r.warmup]
    ttft = [v for r in ok if (v := r.metric_ms("ttft")) is not None]
    itl = [v for r in ok if (v := r.metric_ms("itl")) is not None]
    if not ttft and not itl:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, vals, name in (
        (axes[0], ttft, "time to first token (ms)"),
        (axes[1], itl, "inter-token latency (ms)"),
    ):
        if vals:
            lo, hi = min(vals), max(vals)
            # Values equal but for float noise (a server on a fixed schedule): numpy raises when asked to
            # split a range of a few ulps into bins, so such a range is drawn as equal values are.
            span = (lo, hi) if hi - lo > 1e-9 * max(abs(hi), 1.0) else (lo - 0.5, hi + 0.5)
            bins = min(40, max(5, len(vals) // 3))
            ax.hist(vals, bins=bins, range=span, color="#3b7dd8", edgecolor="white")
            for p, style in ((50, "-"), (99, "--")):
                x = float(np.percentile(vals, p))
                ax.axvline(x, color="#d84b3b", linestyle=style, label=f"p{p} {x:.3g}")
            ax.legend()
        ax.set_xlabel(name)
        ax.set_ylabel("requests")
    fig.suptitle(f"{lv.summary['label']}: {lv.summary['completed']} requests")
    fig.tight_layout()
    return fig


def curve_points(summaries: list[dict[str, Any]]) -> list[tuple[float, float, str]]:
    """(median tokens/s per user, output tokens/s, label) of each level that has streaming metrics."""
    return [
        (s["tps_user"]["p50"], s["output_token_throughput"], s["label"])
        for s in summaries
        if s.get("tps_user")
    ]


def curve_figure(runs: list[tuple[str, list[dict[str, Any]]]]) -> Any:
    """The throughput-versus-interactivity curve of each named run (one run: no legend), overlaid on
    one pair of axes so that runs compare at a glance; None when no level has streaming metrics."""
    series = [(name, pts) for name, summaries in runs if (pts := curve_points(summaries))]
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    colors = ("#3b7dd8", "#d84b3b", "#3ba55c", "#8e44ad")
    for i, (name, pts) in enumerate(series):
        xs, ys, _ = zip(*pts, strict=True)
        ax.plot(xs, ys, "o-", color=colors[i % len(colors)], label=name or None)
        for x, y, label in pts:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("output tokens/s per user (median of 1/ITL): interactivity")
    ax.set_ylabel("output tokens/s, whole system: throughput")
    ax.set_title("throughput vs interactivity")
    ax.grid(alpha=0.3)
    if any(name for name, _ in series):
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def fmt(v: Any) -> str:
    """A number as the console tables (and report.html) show it."""
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
            table.add_row(name, *(fmt(stats[k]) for k in STAT_KEYS))
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
            return fmt((s.get(m) or {}).get(k))

        table.add_row(
            s["label"],
            str(s["completed"]),
            str(s["failed"]),
            str(s.get("cancelled_at_end", 0)),
            fmt(s["request_throughput"]),
            fmt(s["output_token_throughput"]),
            st("ttft_ms", "p50"),
            st("ttft_ms", "p99"),
            st("itl_ms", "p50"),
            st("itl_ms", "p99"),
            st("tps_user", "p50"),
            fmt(s["goodput"]),
            fmt(_kept_up(s)),
        )
    console.print(table)
    for s in levels:
        print_errors(console, s)
