"""`tokenmill bench`: measure any OpenAI-compatible server; `tokenmill bench compare A B`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from tokenmill.cli.common import Steps, console, fail, need_extra

bench_app = typer.Typer(
    invoke_without_command=True,
    help="Benchmark an OpenAI-compatible server (tokenmill, vLLM, llama.cpp, NIM): TTFT, ITL, "
    "throughput, goodput.",
)

# The panels of `bench --help`, in the order a run is described: where, how hard, with what, judged how.
TARGET, LOAD, PROMPTS, GOODPUT, RUN = "Target", "Load", "Prompts", "Goodput", "Run"
PRESET_HELP = "use-case shape: chatbot, rag, summarization, translation, generation, reasoning (sets isl/osl)"


def _numbers(text: str | None, name: str, kind: type) -> list:
    if text is None:
        return []
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"--{name} {text!r} is not a comma-separated list of numbers")
    if not values or any(v <= 0 for v in values):
        fail(f"--{name} needs positive values, e.g. 1,2,4,8")
    return values


@bench_app.callback()
def bench(
    ctx: typer.Context,
    url: str | None = typer.Option(
        None, help="base URL of the API, e.g. http://127.0.0.1:8000/v1", rich_help_panel=TARGET
    ),
    model: str | None = typer.Option(
        None, help="model name (default: the first one /v1/models lists)", rich_help_panel=TARGET
    ),
    endpoint: str = typer.Option(
        "chat", help="chat (/v1/chat/completions) or completions (/v1/completions)", rich_help_panel=TARGET
    ),
    stream: bool = typer.Option(True, help="stream tokens (needed for TTFT and ITL)", rich_help_panel=TARGET),
    api_key: str | None = typer.Option(
        None, envvar="TOKENMILL_API_KEY", help="bearer token", rich_help_panel=TARGET
    ),
    concurrency: str | None = typer.Option(
        None, help="requests in flight (closed loop); a list sweeps: 1,2,4,8", rich_help_panel=LOAD
    ),
    request_rate: str | None = typer.Option(
        None, help="requests/s (open loop); a list sweeps: 1,2,4", rich_help_panel=LOAD
    ),
    arrival: str = typer.Option(
        "poisson", help="arrivals for --request-rate: poisson or constant", rich_help_panel=LOAD
    ),
    max_concurrency: int | None = typer.Option(
        None, help="cap on requests in flight with --request-rate", rich_help_panel=LOAD
    ),
    num_requests: int | None = typer.Option(None, help="measured requests per level", rich_help_panel=LOAD),
    duration: float | None = typer.Option(
        None, help="seconds per level (no new requests after it)", rich_help_panel=LOAD
    ),
    warmup_requests: int = typer.Option(
        0, help="requests sent first at each level, left out of the statistics", rich_help_panel=LOAD
    ),
    grace_period: float = typer.Option(
        30.0, help="seconds in-flight requests get after --duration", rich_help_panel=LOAD
    ),
    isl: int = typer.Option(512, help="input tokens per request (mean)", rich_help_panel=PROMPTS),
    isl_std: float = typer.Option(0.0, help="input tokens standard deviation", rich_help_panel=PROMPTS),
    osl: int = typer.Option(128, help="output tokens per request (mean)", rich_help_panel=PROMPTS),
    osl_std: float = typer.Option(0.0, help="output tokens standard deviation", rich_help_panel=PROMPTS),
    preset: str | None = typer.Option(None, help=PRESET_HELP, rich_help_panel=PROMPTS),
    prefix_groups: int = typer.Option(
        0, help="groups of requests that share a system prompt", rich_help_panel=PROMPTS
    ),
    prefix_tokens: int = typer.Option(
        0, help="tokens of each group's shared prompt", rich_help_panel=PROMPTS
    ),
    turns: int = typer.Option(
        1, help="turns per conversation; each turn resends the history", rich_help_panel=PROMPTS
    ),
    input_file: Path | None = typer.Option(
        None, help="JSONL of prompts: {'prompt'|'text'|'messages', 'max_tokens'?}", rich_help_panel=PROMPTS
    ),
    tokenizer: str | None = typer.Option(
        None,
        help="to count tokens: catalog name, .gguf, HF dir or tokenizer.json; 'none' estimates from words",
        rich_help_panel=PROMPTS,
    ),
    fixed_osl: bool = typer.Option(
        True, help="ask for exactly the output length (ignore_eos, min_tokens)", rich_help_panel=PROMPTS
    ),
    extra_body: str | None = typer.Option(
        None, help="JSON object merged into every request body", rich_help_panel=PROMPTS
    ),
    slo: str | None = typer.Option(
        None, help="per-request SLOs for goodput, e.g. ttft=500ms,itl=50ms,e2e=5s", rich_help_panel=GOODPUT
    ),
    goodput_search: bool = typer.Option(
        False, help="search the highest request rate meeting the SLOs", rich_help_panel=GOODPUT
    ),
    target_attainment: float = typer.Option(
        0.9, help="share of requests that must meet the SLOs (search)", rich_help_panel=GOODPUT
    ),
    search_start_rate: float = typer.Option(
        1.0, help="first request rate the search tries", rich_help_panel=GOODPUT
    ),
    timeout: float = typer.Option(
        600.0, help="seconds before a request counts as timed out", rich_help_panel=RUN
    ),
    seed: int = typer.Option(0, rich_help_panel=RUN),
    output: Path | None = typer.Option(
        None, help="artifact folder (default artifacts/bench-<time>)", rich_help_panel=RUN
    ),
) -> None:
    """Run a benchmark; results go to OUTPUT/summary.json, run.json, records.csv, plots and report.html."""
    if ctx.invoked_subcommand is not None:
        return  # `bench compare` reads two summaries: no extra needed
    need_extra(
        "bench", "tokenmill bench"
    )  # said first: a run without it would end at its plots, minutes later
    from tokenmill.bench.client import ClientConfig, discover_model, normalize_base_url
    from tokenmill.bench.load import LoadConfig
    from tokenmill.bench.runner import GoodputSearch
    from tokenmill.bench.stats import parse_slos
    from tokenmill.bench.workload import PRESETS, WorkloadConfig, load_counter

    if url is None:
        fail("--url is required, e.g. tokenmill bench --url http://127.0.0.1:8000/v1")
    try:
        base = normalize_base_url(url)
        slos = parse_slos(slo)
    except ValueError as e:
        fail(str(e))
    if endpoint not in ("chat", "completions"):
        fail(f"--endpoint {endpoint!r}: use chat or completions")
    if arrival not in ("poisson", "constant"):
        fail(f"--arrival {arrival!r}: use poisson or constant")
    if preset is not None and preset not in PRESETS:
        fail(f"--preset {preset!r}: use one of {', '.join(PRESETS)}")
    if input_file is not None and not input_file.is_file():
        fail(f"--input-file {input_file}: no such file")
    if turns > 1 and input_file is not None:
        fail("--turns applies to synthetic prompts, not to --input-file")
    if isl < 1 or osl < 1 or isl_std < 0 or osl_std < 0:
        fail("--isl and --osl must be at least 1, their standard deviations not negative")
    if (num_requests is not None and num_requests < 1) or (duration is not None and duration <= 0):
        fail("--num-requests and --duration must be positive")
    if grace_period < 0:
        fail("--grace-period must not be negative")
    if goodput_search and not slos:
        fail("--goodput-search needs --slo, e.g. --slo ttft=500ms,itl=50ms")
    if not 0 < target_attainment <= 1:
        fail("--target-attainment must be in (0, 1]")
    try:
        extra = json.loads(extra_body) if extra_body else {}
    except json.JSONDecodeError as e:
        fail(f"--extra-body is not JSON: {e.msg}")
    if not isinstance(extra, dict):
        fail("--extra-body must be a JSON object")
    concurrencies = _numbers(concurrency, "concurrency", int)
    rates = _numbers(request_rate, "request-rate", float)
    if concurrencies and rates:
        fail("give --concurrency or --request-rate, not both")
    if goodput_search and concurrencies:
        fail("--goodput-search varies the request rate: leave out --concurrency")
    if not concurrencies and not rates:
        if goodput_search:
            rates = [search_start_rate]
        else:
            concurrencies = [1]

    def level(c: int | None, r: float | None) -> LoadConfig:
        n = num_requests
        if n is None and duration is None:  # defaults: enough requests to be worth a percentile
            n = max(10, 4 * c) if c is not None else max(10, round(30 * (r or 1)))
        return LoadConfig(
            concurrency=c,
            request_rate=r,
            arrival=arrival,
            num_requests=n,
            duration_s=duration,
            warmup_requests=warmup_requests,
            max_concurrency=max_concurrency,
            grace_s=grace_period,
            seed=seed,
        )

    loads = [level(c, None) for c in concurrencies] + [level(None, r) for r in rates]
    workload = WorkloadConfig(
        isl=isl,
        isl_std=isl_std,
        osl=osl,
        osl_std=osl_std,
        preset=preset,
        prefix_groups=prefix_groups,
        prefix_tokens=prefix_tokens,
        turns=turns,
        input_file=str(input_file) if input_file else None,
        seed=seed,
    )
    if model is None:  # the tokenizer choice depends on the model, so find it out first
        try:
            model = discover_model(base, api_key, timeout)
        except ValueError as e:
            fail(str(e))
    try:
        counter, counter_desc = load_counter(tokenizer, model)
        if input_file is not None:  # read it now: a bad file is a one-line error, not a failed run
            from tokenmill.bench.workload import sessions

            next(sessions(workload, counter))
    except (ValueError, OSError) as e:
        fail(str(e))
    client_cfg = ClientConfig(
        base_url=base,
        model=model or "",
        endpoint=endpoint,
        stream=stream,
        api_key=api_key,
        timeout_s=timeout,
        fixed_osl=fixed_osl,
        extra_body=extra,
    )
    search = GoodputSearch(target_attainment, start_rate=search_start_rate) if goodput_search else None
    _run(client_cfg, workload, loads, slos, counter, counter_desc, search, output)


def _run(client_cfg, workload, loads, slos, counter, counter_desc, search, output) -> None:
    import httpx

    from tokenmill.bench.report import print_level, print_sweep, write_artifacts
    from tokenmill.bench.runner import run_bench

    out = output or Path("artifacts") / time.strftime("bench-%Y%m%d-%H%M%S")
    console.print(f"tokenizer for token counts: {counter_desc}", highlight=False)
    if counter is None:
        console.print("[yellow]token counts are estimates[/yellow] (no tokenizer): lengths are approximate")
    progress = Steps()  # on stderr: stdout keeps the tables

    def on_level(label: str, total: int | None, duration: float | None):
        task = progress.add_task(label, total=total)

        def done(record) -> None:
            progress.advance(task)

        return done

    t_start = time.time()
    try:
        with progress:
            result = run_bench(client_cfg, workload, loads, slos, counter, on_level, search)
    except httpx.HTTPError as e:
        fail(f"cannot reach {client_cfg.base_url}: {e}")
    except ValueError as e:
        fail(str(e))
    config = {
        "url": client_cfg.base_url,
        "model": client_cfg.model,
        "endpoint": client_cfg.endpoint,
        "stream": client_cfg.stream,
        "fixed_osl": client_cfg.fixed_osl,
        "extra_body": client_cfg.extra_body,
        "workload": workload.__dict__,
        "tokenizer": counter_desc,
        "slos": [str(s) for s in slos],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t_start)),
    }
    report = write_artifacts(result, out, config)[-1]
    summaries = [lv.summary for lv in result.levels]
    if len(summaries) == 1 and result.search is None:
        print_level(console, summaries[0])
    else:
        print_sweep(console, summaries)
    if result.search is not None:
        s = result.search
        best = s["max_good_rate"]
        console.print(
            f"highest request rate with >= {100 * s['target_attainment']:.0f}% of requests meeting all SLOs: "
            + (f"[bold]{best:.3g} req/s[/bold]" if best is not None else "[red]none of the rates tried[/red]")
        )
    console.print(f"artifacts: {out}/ (summary.json, run.json, records.csv, plots)", highlight=False)
    console.print(f"report: {report}", highlight=False)
    empty = [s["label"] for s in summaries if s["completed"] == 0]
    # A goodput search's probes above the server's capacity may complete nothing: that is its answer.
    if empty and (result.search is None or len(empty) == len(summaries)):
        cut = any(s["cancelled_at_end"] for s in summaries if s["completed"] == 0)
        fail(
            f"no request completed at {', '.join(empty)}"
            + (" (requests slower than --duration + --grace-period are cancelled)" if cut else ""),
            code=1,
        )
    if any(s["failed"] for s in summaries):
        raise typer.Exit(1)  # the errors were printed with the table


@bench_app.command("compare")
def compare_cmd(
    a: Path = typer.Argument(..., help="summary.json of run A (the baseline)"),
    b: Path = typer.Argument(..., help="summary.json of run B"),
    json_out: Path | None = typer.Option(None, "--json", help="also write the comparison here"),
    html_out: Path | None = typer.Option(
        None, "--html", help="also write it as one HTML file: both configurations, tables, overlaid curves"
    ),
) -> None:
    """The same metrics of two runs side by side, with B/A ratios."""
    from tokenmill.bench.compare import compare, load_summary, print_comparison

    if html_out is not None:  # the curves are drawn with matplotlib; the tables alone need no extra
        need_extra("bench", "tokenmill bench compare --html")
    try:
        result = compare(a, b)
    except ValueError as e:
        fail(str(e))
    print_comparison(console, result)
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2))
    if html_out is not None:
        from tokenmill.bench.html_report import write_compare_html

        try:
            path = write_compare_html(html_out, result, load_summary(a), load_summary(b))
        except OSError as e:
            fail(f"--html {html_out}: {e}")
        console.print(f"report: {path}", highlight=False)
