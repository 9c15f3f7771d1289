"""`tokenmill analyze`: the best configuration of one model of a Triton repository under a p99 limit."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table

from tokenmill.cli.common import Steps, console, err, fail, need_extra

if TYPE_CHECKING:  # imported when the command runs: its extras are checked first
    from tokenmill.triton.analyze import Result, Row, Variant

SWEEP, LOAD = "Sweep", "Load"


def _ints(text: str, name: str, least: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"--{name} {text!r} is not a comma-separated list of integers")
    if not values or any(v < least for v in values):
        fail(f"--{name} needs integers of at least {least}, e.g. {'0,500' if least == 0 else '1,2,4'}")
    return sorted(set(values))


def _shapes(items: list[str]) -> dict[str, list[int]]:
    out = {}
    for item in items:
        name, sep, dims = item.rpartition(":")
        try:
            out[name] = [int(d) for d in dims.split(",")]
        except ValueError:
            sep = ""
        if not sep or not name or any(d < 0 for d in out.get(name, [-1])):
            fail(f"--shape {item!r}: use NAME:D1,D2 (the input's dims without the batch dimension)")
    return out


def _cell(ok: bool) -> str:
    return "[green]yes[/green]" if ok else "[red]no[/red]"


def analyze(
    repository: Path = typer.Argument(..., help="the model repository (Triton layout)"),
    model: str = typer.Argument(..., help="the model to analyze, a folder of the repository"),
    latency_limit_ms: float = typer.Option(..., help="the p99 latency a configuration must meet (ms)"),
    instances: str = typer.Option("1,2", help="instance counts to try", rich_help_panel=SWEEP),
    max_batch: str | None = typer.Option(
        None,
        help="max batch sizes to try, with dynamic batching (default 1,2,4,8,16; a model whose "
        "config says max_batch_size 0 does not batch and only its instances are swept)",
        rich_help_panel=SWEEP,
    ),
    queue_delay_us: str = typer.Option(
        "0,100,500,2000", help="dynamic batching max queue delays to try (µs)", rich_help_panel=SWEEP
    ),
    concurrency: str = typer.Option(
        "1,2,4,8,16,32", help="client concurrencies to measure each configuration at", rich_help_panel=SWEEP
    ),
    quick: bool = typer.Option(
        False,
        "--quick",
        help="prune: no higher concurrency once p99 passed the limit or throughput stopped growing; "
        "no longer delay or bigger batch once it stopped paying",
        rich_help_panel=SWEEP,
    ),
    output_dir: Path | None = typer.Option(
        None, help="where results, plot and best config go (default ./analyze-MODEL)"
    ),
    window_s: float = typer.Option(
        2.0, help="measurement window (s), as perf_analyzer's --measurement-interval", rich_help_panel=LOAD
    ),
    warmup_s: float = typer.Option(
        1.0, help="requests sent first at each level, not measured (s)", rich_help_panel=LOAD
    ),
    max_windows: int = typer.Option(
        10, help="windows at most until the last 3 agree (perf_analyzer's --max-trials)", rich_help_panel=LOAD
    ),
    stability_percentage: float = typer.Option(
        10.0, help="how close the last 3 windows' throughput and latency must be (%)", rich_help_panel=LOAD
    ),
    input_data: str = typer.Option("random", help="request data: random or zero", rich_help_panel=LOAD),
    shape: list[str] = typer.Option(
        [],
        metavar="NAME:DIMS",
        help="NAME:D1,D2: the shape of an input with a variable dimension (repeat)",
        rich_help_panel=LOAD,
    ),
) -> None:
    """Find a Triton model's best configuration under a p99 latency limit (as Model Analyzer).

    Every combination of instance count, max batch size (with dynamic batching) and queue delay is
    loaded into a tokenmill Triton server and measured at each client concurrency with a closed-loop
    client; the best is the highest throughput whose p99 meets the limit. Writes results.csv,
    results.json, a throughput-vs-p99 plot and best/config.pbtxt, then measures the best once more."""
    need_extra("triton", "tokenmill analyze")
    need_extra("bench", "tokenmill analyze")
    from tokenmill.triton.analyze import AnalyzeError, Spec, check_model, run
    from tokenmill.triton.analyze_load import LoadError, LoadSettings

    if input_data not in ("random", "zero"):
        fail(f"--input-data {input_data!r}: use random or zero")
    if window_s <= 0 or warmup_s < 0 or max_windows < 3 or stability_percentage <= 0:
        fail("--window-s and --stability-percentage must be positive, --max-windows at least 3")
    spec = Spec(
        repository=repository,
        model=model,
        latency_limit_ms=latency_limit_ms,
        output_dir=output_dir or Path(f"analyze-{model}"),
        instances=_ints(instances, "instances", 1),
        max_batch=_ints(max_batch, "max-batch", 1) if max_batch is not None else None,
        queue_delay_us=_ints(queue_delay_us, "queue-delay-us", 0),
        concurrency=_ints(concurrency, "concurrency", 1),
        load=LoadSettings(window_s, warmup_s, stability_percentage / 100, max_windows),
        quick=quick,
        input_data=input_data,
        shapes=_shapes(shape),
    )

    def on_config(variant: Variant, rows: list[Row], failure: str) -> None:
        if failure:
            err.print(
                f"[yellow]{variant.name}[/yellow] ({variant.label}): {escape(failure)}", highlight=False
            )
            return
        console.print(config_table(variant.name, variant.label, rows, latency_limit_ms))

    try:
        if not check_model(repository, model).batched:
            err.print(
                f"{model}'s config says max_batch_size 0 (it does not batch): sweeping its instances only",
                markup=False,
            )
        with Steps() as steps:
            result = asyncio.run(run(spec, steps, on_config))
    except (AnalyzeError, LoadError, OSError) as e:
        fail(str(e))
    console.print(summary_table(result))
    for kind, path in result.files.items():
        console.print(f"{kind}: {path}", highlight=False)
    best, again = result.best, result.remeasured
    if best is None:
        low = min(result.rows, key=lambda r: r.m.latency_p99_ms)
        fail(
            f"no configuration met p99 <= {latency_limit_ms:g} ms (the lowest p99 measured: "
            f"{low.m.latency_p99_ms:.2f} ms, {low.variant.name} at concurrency {low.m.concurrency}); "
            f"results are in {spec.output_dir}",
            code=1,
        )
    console.print(
        f"best: {best.variant.name} ({best.variant.label}) at concurrency {best.m.concurrency}: "
        f"{best.m.throughput:.1f} infer/s, p99 {best.m.latency_p99_ms:.2f} ms",
        highlight=False,
    )
    if again is None:
        fail(f"re-measuring {best.variant.name} failed: {result.remeasure_error}", code=1)
    verdict = "meets" if result.remeasured_meets else "[red]does not meet[/red]"
    console.print(
        f"re-measured: {again.throughput:.1f} infer/s, p99 {again.latency_p99_ms:.2f} ms: {verdict} the "
        f"{latency_limit_ms:g} ms limit",
        highlight=False,
    )


def config_table(name: str, label: str, rows: list[Row], limit_ms: float) -> Table:
    t = Table(
        "concurrency", "infer/s", "avg ms", "p50 ms", "p90 ms", "p99 ms", "batch", "queue µs", "compute µs",
        "stable", f"p99 <= {limit_ms:g} ms", title=f"{name}: {label}", title_justify="left",
    )  # fmt: skip
    for r in rows:
        m = r.m
        t.add_row(
            str(m.concurrency), f"{m.throughput:.1f}", f"{m.latency_avg_ms:.2f}", f"{m.latency_p50_ms:.2f}",
            f"{m.latency_p90_ms:.2f}", f"{m.latency_p99_ms:.2f}", f"{m.avg_batch:.2f}",
            f"{m.server_queue_us:.0f}", f"{m.server_compute_us:.0f}", "yes" if m.stable else "no",
            _cell(r.meets(limit_ms)) + (f" ({m.errors} errors)" if m.errors else ""),
        )  # fmt: skip
    return t


def summary_table(result: Result, top: int = 10) -> Table:
    """Each configuration's best within the limit, highest throughput first."""
    limit = result.spec.latency_limit_ms
    best: dict[Variant, Row] = {}
    for r in result.rows:
        if r.meets(limit) and (r.variant not in best or r.m.throughput > best[r.variant].m.throughput):
            best[r.variant] = r
    ranked = sorted(best.values(), key=lambda r: -r.m.throughput)[:top]
    t = Table(
        "config", "instances", "max batch", "queue delay µs", "concurrency", "infer/s", "p99 ms",
        title=f"top configurations with p99 <= {limit:g} ms ({len(best)} of "
        f"{len({r.variant for r in result.rows})} met it)", title_justify="left",
    )  # fmt: skip
    for r in ranked:
        v = r.variant
        delay = "-" if v.queue_delay_us is None else str(v.queue_delay_us)
        t.add_row(
            v.name, str(v.instances), str(v.max_batch_size), delay, str(r.m.concurrency),
            f"{r.m.throughput:.1f}", f"{r.m.latency_p99_ms:.2f}",
        )  # fmt: skip
    return t
