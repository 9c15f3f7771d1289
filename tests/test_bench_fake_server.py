"""`tokenmill bench` against a fake server with known delays: every metric equals its known value.

The fake server (tokenmill/bench/fake_server.py) runs in its own process and streams each request's
first token X ms after it arrives, then one every Y ms, on an absolute schedule. The client adds a
little of its own (HTTP handling on both sides: ~1-3 ms on an idle machine, p50 8 ms with the other
core busy; a stall of the busy machine adds hundreds of ms to a few requests), so a latency is checked
from below exactly (nothing arrives before its schedule) and, for the best request, from above within
less than one inter-token interval, which still catches a metric that is off by a chunk; intervals
between chunks, which that overhead does not shift, by their median, more tightly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager

import pytest
from typer.testing import CliRunner

from tokenmill.bench.client import ClientConfig, normalize_base_url
from tokenmill.bench.load import LoadConfig
from tokenmill.bench.runner import run_bench
from tokenmill.bench.stats import parse_slos
from tokenmill.bench.workload import WorkloadConfig
from tokenmill.cli.main import app

FIRST_MS, ITL_MS, OSL = 120.0, 30.0, 8
OVERHEAD_MS = 20.0  # allowed client + server overhead on top of a known latency: less than ITL_MS


@contextmanager
def fake_server(first_ms: float, itl_ms: float, *extra: str):
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.bench.fake_server",
        "--port",
        "0",
        "--first-token-ms",
        str(first_ms),
        "--itl-ms",
        str(itl_ms),
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("fake server on "), line
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server_url():
    with fake_server(FIRST_MS, ITL_MS) as url:
        yield url


def noop(label, total, duration):
    return lambda r: None


def bench(
    url: str,
    load: LoadConfig,
    stream: bool = True,
    endpoint: str = "chat",
    slo: str | None = None,
    **workload,
):
    cfg = ClientConfig(base_url=url, model="", endpoint=endpoint, stream=stream)
    wl = WorkloadConfig(**{"isl": 20, "osl": OSL, **workload})
    return run_bench(cfg, wl, [load], parse_slos(slo), None, noop).levels[0]


def test_streaming_metrics_equal_the_known_delays(server_url) -> None:
    lv = bench(server_url, LoadConfig(concurrency=4, num_requests=24, warmup_requests=4), slo="ttft=200ms")
    s = lv.summary
    assert s["completed"] == 24 and s["failed"] == 0
    assert len([r for r in lv.records if r.warmup]) == 4
    # Nothing arrives before its schedule; the best request shows the metric is not off by a chunk (a
    # stall of the busy machine delays some requests by hundreds of ms, never all of them).
    assert FIRST_MS <= s["ttft_ms"]["min"] <= FIRST_MS + OVERHEAD_MS
    # ITL = (E2E - TTFT) / (OSL - 1) = Y exactly on the server's schedule.
    assert s["itl_ms"]["p50"] == pytest.approx(ITL_MS, abs=1.0)
    assert s["ttst_ms"]["p50"] == pytest.approx(ITL_MS, abs=3.0)
    assert s["chunk_gap_ms"]["p50"] == pytest.approx(ITL_MS, abs=2.0)
    e2e = FIRST_MS + (OSL - 1) * ITL_MS
    assert e2e <= s["e2e_ms"]["min"] <= e2e + OVERHEAD_MS
    assert s["tps_user"]["p50"] == pytest.approx(1000 / ITL_MS, rel=0.07)
    assert s["osl"]["mean"] == OSL and s["osl_sources"] == {"usage": 24}
    # Closed loop at 4: each worker does back-to-back requests of ~E2E each (a stall costs a few percent;
    # a wrong concurrency costs a factor).
    assert s["request_throughput"] == pytest.approx(4 / (e2e / 1e3), rel=0.25)
    assert s["output_token_throughput"] == pytest.approx(s["request_throughput"] * OSL, rel=1e-6)
    assert s["goodput"] == pytest.approx(s["request_throughput"]) and s["slo_attainment"] == 1.0


def test_constant_rate_sends_at_the_rate(server_url) -> None:
    lv = bench(server_url, LoadConfig(request_rate=20.0, arrival="constant", num_requests=30))
    sends = sorted(r.t_send for r in lv.records)
    gaps = [b - a for a, b in zip(sends, sends[1:], strict=False)]
    # Bounds wide enough for a 2-core machine busy with other tests (a stall delays a send, and the one
    # after it catches up), narrow enough that a closed loop (a send per E2E) or a drifting clock fails.
    assert sum(gaps) / len(gaps) == pytest.approx(0.05, rel=0.1)
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(0.05, abs=0.01)
    # Open loop: 30 arrivals 50 ms apart; the last one ends ~E2E after it was sent.
    e2e = (FIRST_MS + (OSL - 1) * ITL_MS) / 1e3
    assert lv.summary["duration_s"] == pytest.approx(29 * 0.05 + e2e, abs=0.2)


def test_poisson_rate_and_duration_bound(server_url) -> None:
    lv = bench(server_url, LoadConfig(request_rate=40.0, duration_s=2.0, seed=5))
    sent = [r for r in lv.records if not r.warmup]
    assert 40 <= len(sent) <= 120  # ~80 expected
    assert max(r.t_send for r in sent) < 2.0 + 0.05
    assert lv.summary["failed"] == 0


def test_non_streaming_keeps_what_still_makes_sense(server_url) -> None:
    lv = bench(server_url, LoadConfig(concurrency=2, num_requests=4), stream=False, endpoint="completions")
    s = lv.summary
    assert s["completed"] == 4
    assert s["ttft_ms"] is None and s["itl_ms"] is None
    e2e = FIRST_MS + (OSL - 1) * ITL_MS
    assert e2e <= s["e2e_ms"]["min"] <= e2e + OVERHEAD_MS
    assert s["osl"]["mean"] == OSL


def test_errors_are_counted_by_kind() -> None:
    with fake_server(5, 1, "--fail-every", "3") as url:
        lv = bench(url, LoadConfig(concurrency=1, num_requests=9))
    assert lv.summary["completed"] == 6 and lv.summary["failed"] == 3
    assert lv.summary["errors"] == {"http_500": 3}
    assert all(r.error_detail == "injected failure" for r in lv.records if r.error)


def test_unreachable_server_is_a_connect_error() -> None:
    cfg = ClientConfig(base_url="http://127.0.0.1:9/v1", model="m", endpoint="chat")
    lv = run_bench(
        cfg, WorkloadConfig(isl=5, osl=2), [LoadConfig(concurrency=1, num_requests=2)], [], None, noop
    ).levels[0]
    assert lv.summary["failed"] == 2 and lv.summary["errors"] == {"connect": 2}


def test_multi_turn_resends_the_history(server_url) -> None:
    lv = bench(server_url, LoadConfig(concurrency=2, num_requests=6), turns=3, isl=10)
    by_conv: dict[int, list] = {}
    for r in lv.records:
        by_conv.setdefault(r.conversation, []).append(r)
    assert len(by_conv) == 2
    for turns in by_conv.values():
        assert [r.turn for r in turns] == [0, 1, 2]
        # The server counts prompt words: each turn carries the previous turns and answers too.
        assert turns[0].isl < turns[1].isl < turns[2].isl


def test_shared_prefix_groups(server_url) -> None:
    lv = bench(
        server_url,
        LoadConfig(concurrency=2, num_requests=4),
        endpoint="completions",
        isl=10,
        prefix_groups=2,
        prefix_tokens=40,
    )
    # 40 prefix tokens at 0.75 words/token = 30 words, plus ~8 of the request's own.
    assert all(r.isl >= 30 + 7 for r in lv.records)


def test_cli_writes_summary_records_and_plots(server_url, tmp_path) -> None:
    out = tmp_path / "run"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "--url",
            server_url.removesuffix("/v1"),
            "--concurrency",
            "2",
            "--num-requests",
            "6",
            "--isl",
            "16",
            "--osl",
            str(OSL),
            "--tokenizer",
            "none",
            "--slo",
            "ttft=1s,itl=100ms",
            "--output",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    s = json.loads((out / "summary.json").read_text())
    for key in ("ttft_ms", "ttst_ms", "itl_ms", "e2e_ms"):
        assert set(s[key]) == {"mean", "min", "max", "std", "p50", "p90", "p95", "p99"}
    for key in ("request_throughput", "output_token_throughput", "input_token_throughput", "goodput"):
        assert s[key] > 0
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["config"]["load"]["concurrency"] == 2 and s["config"]["model"] == "fake-model"
    run = json.loads((out / "run.json").read_text())
    assert len(run["records"]) == 6 and "chunk_times" in run["records"][0]
    assert (out / "records.csv").read_text().count("\n") == 7
    assert (out / "latency_distributions.png").stat().st_size > 10_000

    sweep = tmp_path / "sweep"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "--url",
            server_url,
            "--concurrency",
            "1,2",
            "--num-requests",
            "4",
            "--osl",
            "4",
            "--tokenizer",
            "none",
            "--output",
            str(sweep),
        ],
    )
    assert res.exit_code == 0, res.output
    top = json.loads((sweep / "summary.json").read_text())
    assert [r["label"] for r in top["runs"]] == ["concurrency1", "concurrency2"]
    assert (sweep / "throughput_vs_interactivity.png").stat().st_size > 10_000
    assert (sweep / "concurrency2" / "summary.json").exists()

    # A single run against a sweep: the level they share (concurrency 2) is compared.
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "compare",
            str(out / "summary.json"),
            str(sweep / "summary.json"),
            "--json",
            str(tmp_path / "cmp.json"),
        ],
    )
    assert res.exit_code == 0 and "ttft_ms p99" in res.output, res.output
    cmp = json.loads((tmp_path / "cmp.json").read_text())
    assert [lv["level"] for lv in cmp["levels"]] == ["concurrency2"]
    res = CliRunner().invoke(
        app, ["bench", "compare", str(out / "summary.json"), str(tmp_path / "nope.json")]
    )
    assert res.exit_code == 2 and "no such file" in res.output


def test_failed_run_says_so_and_exits_nonzero(tmp_path) -> None:
    with fake_server(1, 1, "--fail-every", "2") as url:
        res = CliRunner().invoke(
            app,
            [
                "bench",
                "--url",
                url,
                "--num-requests",
                "4",
                "--osl",
                "2",
                "--tokenizer",
                "none",
                "--output",
                str(tmp_path / "x"),
            ],
        )
    assert res.exit_code == 1
    assert "2 REQUESTS FAILED" in res.output and "http_500: 2" in res.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--url is required"),
        (["--url", "ftp://x"], "not an http(s) URL"),
        (["--url", "http://h:1", "--slo", "speed=1"], "unknown SLO metric"),
        (["--url", "http://h:1", "--concurrency", "1", "--request-rate", "2"], "not both"),
        (["--url", "http://h:1", "--concurrency", "0"], "positive"),
        (["--url", "http://h:1", "--preset", "poetry"], "--preset"),
        (["--url", "http://h:1", "--goodput-search"], "needs --slo"),
        (["--url", "http://h:1", "--extra-body", "[1]"], "JSON object"),
        (["--url", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9/v1/models"),
        (["--url", "http://h:1", "--input-file", "/nonexistent.jsonl"], "no such file"),
    ],
)
def test_bad_options_are_one_line_errors(args, message) -> None:
    res = CliRunner().invoke(app, ["bench", *args])
    assert res.exit_code == 2 and message in res.output, res.output
    assert "Traceback" not in res.output


def test_normalize_base_url() -> None:
    assert normalize_base_url("http://h:1") == "http://h:1/v1"
    assert normalize_base_url("http://h:1/v1/") == "http://h:1/v1"
    assert normalize_base_url("https://x.y/api/v1") == "https://x.y/api/v1"


def test_duration_longer_than_the_grace_period_runs_its_whole_duration(tmp_path) -> None:
    """The grace period starts when the duration ends (issue 50): requests of ~1 s under a 2.2 s duration
    and a 0.5 s grace complete, where a grace timed from the level's start cut them all at 0.5 s."""
    with fake_server(1000, 5) as url:
        res = CliRunner().invoke(
            app,
            [
                "bench",
                "--url",
                url,
                "--concurrency",
                "2",
                "--duration",
                "2.2",
                "--grace-period",
                "0.5",
                "--osl",
                "2",
                "--tokenizer",
                "none",
                "--output",
                str(tmp_path / "run"),
            ],
        )
    assert res.exit_code == 0, res.output
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["completed"] >= 2 and s["failed"] == 0, s
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    # Requests were sent after the first ones completed, ~1 s in: past the grace period's length.
    assert max(r["t_send"] for r in run["records"]) > 0.9


def test_a_level_that_completes_nothing_says_so_and_fails(tmp_path) -> None:
    """Requests slower than --duration + --grace-period are cancelled, not failed; a level left with no
    completed request is reported as such in the table, and the command exits non-zero with one line."""
    with fake_server(5000, 5) as url:
        res = CliRunner().invoke(
            app,
            [
                "bench",
                "--url",
                url,
                "--concurrency",
                "1,2",
                "--duration",
                "0.6",
                "--grace-period",
                "0.3",
                "--osl",
                "2",
                "--tokenizer",
                "none",
                "--output",
                str(tmp_path / "sweep"),
            ],
        )
    assert res.exit_code == 1, res.output
    top = json.loads((tmp_path / "sweep" / "summary.json").read_text())
    assert [(r["completed"], r["cancelled_at_end"]) for r in top["runs"]] == [(0, 1), (0, 2)]
    assert "concurrency1: NO REQUEST COMPLETED" in res.stdout and "concurrency2: NO REQUEST" in res.stdout
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "no request completed" in errors[0], res.stderr
    assert "Traceback" not in res.output


def test_piped_output_has_whole_tables_and_progress_on_stderr(server_url, tmp_path) -> None:
    """Not on a terminal (a pipe, a parent process), rich assumed 80 columns and cut the sweep table's
    headers and cells ("lev…", "TT…"); they must come whole, and the progress as plain lines on stderr."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # the width a pipe really has: none
    args = ["--concurrency", "1,2", "--num-requests", "2", "--osl", "4", "--tokenizer", "none"]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.cli.main",
            "bench",
            "--url",
            server_url,
            *args,
            "--output",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert "\u2026" not in r.stdout, r.stdout  # no cell or header cut with an ellipsis
    header = next(line for line in r.stdout.splitlines() if "level" in line)
    for col in (
        "level",
        "failed",
        "cancelled",
        "out tok/s",
        "TTFT p99",
        "ITL p50",
        "tok/s/user p50",
        "done/sent",
    ):
        assert col in header, header
    rows = [line for line in r.stdout.splitlines() if "concurrency" in line]
    assert len(rows) == 2 and "concurrency1" in rows[0] and "concurrency2" in rows[1], r.stdout
    assert "concurrency2: 2/2, done in" in r.stderr and "\x1b[" not in r.stderr, r.stderr
