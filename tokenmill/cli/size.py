"""`tokenmill size`: how many servers for a use case; `size predict` for one shape; `size calibrate`."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from tokenmill.cli.common import console, err, fail, need_extra

size_app = typer.Typer(
    invoke_without_command=True,
    help="Size a deployment: GPUs and servers for a model, lengths, peak load and latency limits.",
)

MODEL_HELP = "catalog name (e.g. llama3-8b, gpt-43b, mixtral-8x7b), config.json or .gguf"


KV_DTYPE_HELP = "the KV cache's own dtype: auto (the precision's), fp16, bf16, fp8, int8 (1 byte)"
# The key under which `size calibrate --output` keeps the fit's error beside the factors (load_factors
# reads the factors only), so that a sizing made from them can report its own error.
FIT_ERROR = "fit_error"


def _common(
    model: str,
    gpu: str,
    precision: str,
    factors_file: Path | None,
    profile: str,
    kv_cache_dtype: str = "auto",
):
    from tokenmill.sizing import arch as arch_mod
    from tokenmill.sizing import hardware
    from tokenmill.sizing.calibrate import load_factors

    try:
        a = arch_mod.resolve(model)
        g = hardware.resolve(gpu)
        if precision not in hardware.PRECISIONS:
            fail(f"--precision {precision!r}: use one of {', '.join(hardware.PRECISIONS)}")
        if kv_cache_dtype not in hardware.KV_CACHE_DTYPES:
            fail(f"--kv-cache-dtype {kv_cache_dtype!r}: use {', '.join(hardware.KV_CACHE_DTYPES)}")
        if factors_file is not None:
            f = load_factors(factors_file)
        elif profile == "nim":
            if g.name != "h100-sxm":
                fail("--factor-profile nim has fits for h100-sxm only")
            f = hardware.NIM_H100[hardware.precision_class(precision)]
        elif profile == "default":
            f = hardware.default_factors(g.name, precision)
        else:
            fail(f"--factor-profile {profile!r}: use default or nim")
    except ValueError as e:
        fail(str(e))
    return a, g, f


def _tokens(tokens: int | None, words: float | None, name: str) -> tuple[int, str | None]:
    from tokenmill.sizing.search import WORDS_PER_TOKEN, words_to_tokens

    if (tokens is None) == (words is None):
        fail(f"give --{name} (tokens) or --{name}-words, one of them")
    if words is not None:
        t = words_to_tokens(words)
        return t, f"{words:g} words / {WORDS_PER_TOKEN} words per token = {t} tokens"
    if tokens < 1:
        fail(f"--{name} must be at least 1")
    return tokens, None


@size_app.callback()
def size_cmd(
    ctx: typer.Context,
    model: str | None = typer.Option(None, help=MODEL_HELP),
    gpu: str = typer.Option("h100-sxm", help="a100-80gb, h100-sxm, h200, l40s, b200, gb200-nvl72, cpu-2c"),
    precision: str = typer.Option("fp16", help="fp16, bf16, fp8, int8, int4 (weight-only)"),
    kv_cache_dtype: str = typer.Option("auto", help=KV_DTYPE_HELP),
    isl: int | None = typer.Option(None, help="input tokens per request (include the system prompt)"),
    isl_words: float | None = typer.Option(None, help="input length in words (0.75 words per token)"),
    osl: int | None = typer.Option(None, help="output tokens per request"),
    osl_words: float | None = typer.Option(None, help="output length in words"),
    rps: float | None = typer.Option(None, help="peak requests/s to serve"),
    avg_rps: float | None = typer.Option(None, help="average requests/s: the peak is its Poisson percentile"),
    peak_percentile: float = typer.Option(95.0, help="percentile of per-second arrivals sized for"),
    ttft_ms: float | None = typer.Option(None, help="time-to-first-token limit"),
    itl_ms: float | None = typer.Option(None, help="inter-token latency limit"),
    e2e_ms: float | None = typer.Option(None, help="end-to-end latency limit"),
    mode: str = typer.Option("streaming", help="streaming (TTFT, ITL count) or sequential (only E2E)"),
    factors: Path | None = typer.Option(None, help="efficiency factors from `tokenmill size calibrate`"),
    factor_profile: str = typer.Option("default", help="default (TRT-LLM fits) or nim (NIM 1.0, H100)"),
    gpu_hour_price: float | None = typer.Option(None, help="USD per GPU-hour (default: the catalog's)"),
    json_out: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    plot: Path | None = typer.Option(None, help="write the throughput-vs-interactivity frontier PNG here"),
    output: Path | None = typer.Option(
        None, help="folder for sizing.json (what --json prints), frontier.png and report.html"
    ),
) -> None:
    """How many servers serve this use case inside the limits (and on which shape)."""
    if ctx.invoked_subcommand is not None:
        return
    need_extra("bench", "tokenmill size")  # the sizing model fits with scipy, plots with matplotlib
    from tokenmill.sizing.report import plot_frontier, sizing_summary
    from tokenmill.sizing.search import Limits, peak_rps, size

    if model is None:
        fail("--model is required, e.g. tokenmill size --model llama3-8b --isl 2000 --osl 200 --rps 31")
    a, g, f = _common(model, gpu, precision, factors, factor_profile, kv_cache_dtype)
    isl_t, isl_note = _tokens(isl, isl_words, "isl")
    osl_t, osl_note = _tokens(osl, osl_words, "osl")
    if (rps is None) == (avg_rps is None):
        fail("give --rps (peak) or --avg-rps (average; the peak comes from the Poisson percentile)")
    if mode not in ("streaming", "sequential"):
        fail(f"--mode {mode!r}: use streaming or sequential")
    try:
        peak = rps if rps is not None else peak_rps(avg_rps, peak_percentile)
    except ValueError as e:
        fail(str(e))
    if peak <= 0:
        fail("the peak request rate must be positive")
    limits = Limits(*(v / 1e3 if v is not None else None for v in (ttft_ms, itl_ms, e2e_ms)), mode=mode)
    result = size(a, g, precision, f, isl_t, osl_t, limits, peak, kv_cache_dtype)
    inputs = {
        "isl": isl_t,
        "osl": osl_t,
        "isl_conversion": isl_note,
        "osl_conversion": osl_note,
        "peak_rps": peak,
        "average_rps": avg_rps,
        "peak_percentile": peak_percentile if avg_rps is not None else None,
        "ttft_ms": ttft_ms,
        "itl_ms": itl_ms,
        "e2e_ms": e2e_ms,
        "mode": mode,
        "kv_cache_dtype": kv_cache_dtype,
    }
    price = g.gpu_hour_price if gpu_hour_price is None else gpu_hour_price
    s = sizing_summary(result, a, g, precision, f, isl_t, osl_t, avg_rps, price, inputs)
    s["factor_fit_error"] = _fit_error(factors)
    title = f"{a.name} {precision} on {g.name}, ISL {isl_t} / OSL {osl_t}"
    png = plot_frontier(result, osl_t, plot, title) if plot is not None or output is not None else None
    if json_out:
        print(json.dumps(s, indent=2))
    else:
        _print_sizing(s, g.gpus_per_server)
    if output is not None:
        report = _write_outputs(output, s, png)
        # Named on stderr under --json: stdout stays one JSON document.
        (err if json_out else console).print(f"report: {report}", highlight=False)
    if s["servers"] is None:
        raise typer.Exit(1)


def _fit_error(factors_file: Path | None) -> dict | None:
    """The calibration fit's error that `size calibrate --output` stored with the factors, if any."""
    if factors_file is None:
        return None
    try:
        error = json.loads(factors_file.read_text()).get(FIT_ERROR)
    except (OSError, ValueError, AttributeError):  # load_factors accepted the file: it just keeps no error
        return None
    return error if isinstance(error, dict) and all(isinstance(v, dict) for v in error.values()) else None


def _write_outputs(out: Path, s: dict, png: bytes | None) -> Path:
    from tokenmill.sizing.html_report import write_html

    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "sizing.json").write_text(json.dumps(s, indent=2))
        if png is not None:
            (out / "frontier.png").write_bytes(png)
        return write_html(out, s, png)
    except OSError as e:
        fail(f"--output {out}: {e}")


def _print_sizing(s: dict, per_server: int) -> None:
    from tokenmill.sizing.report import shape

    i = s["inputs"]
    for note in (i["isl_conversion"], i["osl_conversion"]):
        if note:
            console.print(f"[dim]{note}[/dim]")
    if i["average_rps"] is not None:
        console.print(
            f"average {i['average_rps']:g} req/s -> {s['peak_rps']:g} req/s at the "
            f"{i['peak_percentile']:g}th percentile of per-second Poisson arrivals"
        )
    if s["servers"] is None:
        for n in s["notes"]:
            console.print(f"[red]{n}[/red]")
        return
    c = s["chosen"]
    label = shape(c)
    console.print(
        f"[bold]{s['servers']} servers[/bold] ({s['gpus']} x {s['gpu']}, {per_server} per server) for "
        f"{s['peak_rps']:g} req/s of {s['model']['name']} in {s['precision']}"
    )
    t = Table("", "value", title="chosen configuration", title_justify="left")
    rows = [
        (
            "instance",
            f"{label}, {c['instances_per_server']} per server, {c['concurrency_per_instance']} in flight",
        ),
        ("TTFT", f"{c['ttft_ms']:.0f} ms"),
        ("inter-token latency", f"{c['itl_ms']:.1f} ms ({c['output_tps_per_user']:.0f} tok/s per user)"),
        ("end-to-end", f"{c['e2e_ms'] / 1e3:.2f} s"),
        ("requests/s per server", f"{c['rps_per_server']:.2f} (capacity {s['capacity_rps']:.1f})"),
        (f"requests per day ({s['daily_volume_basis']})", f"{s['requests_per_day']:,.0f}"),
        (
            "tokens per day (in / out)",
            f"{s['input_tokens_per_day']:,.0f} / {s['output_tokens_per_day']:,.0f}",
        ),
        ("cost per 1M output tokens", f"${s['cost_per_million_output_tokens_usd']:.3f}"),
        ("energy per output token", f"{s['energy_per_output_token_j']:.3f} J"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    alt = Table("shape", "in flight", "TTFT ms", "ITL ms", "req/s/server", "servers", title="alternatives")
    for a in s["alternatives"]:
        alt.add_row(
            shape(a),
            str(a["concurrency_per_instance"]),
            f"{a['ttft_ms']:.0f}",
            f"{a['itl_ms']:.1f}",
            f"{a['rps_per_server']:.2f}",
            str(a["servers"]),
        )
    console.print(alt)
    for a in s["assumptions"]:
        console.print(f"[dim]- {a}[/dim]")


@size_app.command("predict")
def predict_cmd(
    model: str = typer.Option(..., help=MODEL_HELP),
    gpu: str = typer.Option("h100-sxm"),
    precision: str = typer.Option("fp16"),
    kv_cache_dtype: str = typer.Option("auto", help=KV_DTYPE_HELP),
    tp: int = typer.Option(1, help="tensor parallel GPUs"),
    pp: int = typer.Option(1, help="pipeline stages"),
    concurrency: int = typer.Option(1, help="requests in flight on the instance"),
    isl: int = typer.Option(..., help="input tokens"),
    osl: int = typer.Option(..., help="output tokens"),
    factors: Path | None = typer.Option(None, help="efficiency factors from `tokenmill size calibrate`"),
    factor_profile: str = typer.Option("default", help="default (TRT-LLM fits) or nim (NIM 1.0, H100)"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Predict TTFT, ITL and throughput of one configuration (to hold against your measurements)."""
    need_extra("bench", "tokenmill size predict")
    from tokenmill.sizing.roofline import Deployment, predict

    a, g, f = _common(model, gpu, precision, factors, factor_profile, kv_cache_dtype)
    if tp < 1 or pp < 1 or concurrency < 1 or isl < 1 or osl < 1:
        fail("--tp, --pp, --concurrency, --isl and --osl must be at least 1")
    if tp * pp > g.gpus_per_server:
        fail(f"TP x PP = {tp * pp} is more than the {g.gpus_per_server} GPUs of a {g.name} server")
    d = Deployment(a, g, precision, f, tp, pp, kv_cache_dtype=kv_cache_dtype)
    p = predict(d, concurrency, isl, osl)
    out = {
        "model": a.name,
        "gpu": g.name,
        "precision": precision,
        "kv_cache_dtype": kv_cache_dtype,
        "tp": tp,
        "pp": pp,
        "concurrency": concurrency,
        "isl": isl,
        "osl": osl,
        "ttft_ms": p.ttft_s * 1e3,
        "itl_ms": p.itl_s * 1e3,
        "e2e_ms": p.e2e_s * 1e3,
        "rps": p.rps,
        "output_tps": p.rps * osl,
        "fits_in_memory": p.fits,
        "memory_gb_per_gpu": d.weight_gb_per_gpu() + d.kv_gb_per_gpu(concurrency, isl + osl),
        "prefill_s": d.prefill_s(concurrency, isl),
        "factors": f.to_dict(),
    }
    if json_out:
        print(json.dumps(out, indent=2))
        return
    console.print(
        f"{a.name} {precision} on {tp * pp} x {g.name} (TP{tp}" + (f" PP{pp}" if pp > 1 else "") + f"), "
        f"{concurrency} in flight, {isl} in / {osl} out:"
    )
    console.print(
        f"  TTFT {out['ttft_ms']:.0f} ms | ITL {out['itl_ms']:.2f} ms | E2E {out['e2e_ms'] / 1e3:.2f} s | "
        f"{p.rps:.3f} req/s | {out['output_tps']:.0f} output tok/s | "
        f"{out['memory_gb_per_gpu']:.1f} GB per GPU"
        + ("" if p.fits else " [red](does not fit in memory)[/red]")
    )
    console.print(f"[dim]factors: {f.source}[/dim]")


@size_app.command("calibrate")
def calibrate_cmd(
    results: list[Path] = typer.Argument(..., help="summary.json files of `tokenmill bench` runs"),
    model: str = typer.Option(..., help=MODEL_HELP),
    gpu: str = typer.Option(..., help="the hardware the runs were measured on"),
    precision: str = typer.Option("bf16"),
    tp: int = typer.Option(1),
    output: Path | None = typer.Option(None, help="write the fitted factors here (JSON)"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Fit the efficiency factors to benchmark results; report the fit error."""
    need_extra("bench", "tokenmill size calibrate")
    from tokenmill.sizing.calibrate import fit, measurements_from_summary
    from tokenmill.sizing.roofline import Deployment

    a, g, start = _common(model, gpu, precision, None, "default")
    try:
        ms = [m for p in results for m in measurements_from_summary(p)]
    except ValueError as e:
        fail(str(e))
    if len(ms) < 2:
        fail("calibration needs at least 2 measured load levels (e.g. a --concurrency 1,2,4,8 sweep)")
    result = fit([(Deployment(a, g, precision, start, tp), ms)], start)
    if output is not None:
        output.write_text(json.dumps({**result.factors.to_dict(), FIT_ERROR: result.errors}, indent=2))
    if json_out:
        print(
            json.dumps(
                {"factors": result.factors.to_dict(), "errors": result.errors, "levels": result.per_level},
                indent=2,
            )
        )
        return
    t = Table(
        "level", "C", "TTFT ms meas/pred", "ITL ms meas/pred", "req/s meas/pred", title="calibration fit"
    )
    for r in result.per_level:
        t.add_row(
            r["label"],
            f"{r['concurrency']:g}",
            f"{r['ttft_measured'] * 1e3:.0f} / {r['ttft_predicted'] * 1e3:.0f}",
            f"{r['itl_measured'] * 1e3:.1f} / {r['itl_predicted'] * 1e3:.1f}",
            f"{r['rps_measured']:.2f} / {r['rps_predicted']:.2f}",
        )
    console.print(t)
    f = result.factors
    console.print(
        f"MFU {f.mfu:.3f} | MBU weights {f.mbu_weights:.3f} | MBU KV {f.mbu_kv:.3f} | "
        f"overhead {f.overhead_per_layer_s * 1e6:.0f} us/layer | client {f.client_s * 1e3:.1f} ms"
    )
    console.print(
        "fit error (median / max |pred/meas - 1|): "
        + ", ".join(f"{k} {v['median'] * 100:.1f}% / {v['max'] * 100:.1f}%" for k, v in result.errors.items())
    )
    if output is not None:
        console.print(f"factors written to {output} (use: tokenmill size ... --factors {output})")
