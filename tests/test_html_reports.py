"""report.html of `tokenmill bench`, `bench compare --html` and `tokenmill size --output`: one file that
parses, shows the numbers its JSON holds, embeds its plots, fetches nothing, leaks no credential and
escapes what it is given.

Bench runs are built from synthetic records (no server) and written by write_artifacts, as a run is;
one CLI run against the fake server checks that the command names the file. Sizing runs the CLI.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tokenmill.bench.html_report import masked, value_at
from tokenmill.bench.load import LoadConfig
from tokenmill.bench.records import RequestRecord
from tokenmill.bench.report import fmt, write_artifacts
from tokenmill.bench.runner import BenchResult, LevelResult
from tokenmill.bench.stats import parse_slos, summarize
from tokenmill.cli.main import app
from tokenmill.sizing.arch import CATALOG as MODELS
from tokenmill.sizing.hardware import CATALOG as GPUS
from tokenmill.sizing.hardware import Factors
from tokenmill.sizing.roofline import Deployment, predict

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
VOID = {"meta", "img", "br", "hr", "link", "input"}
SECRETS = ("sk-SECRET", "sk-BEARER", "sk-QUERY", "hunter2")


class Page(HTMLParser):
    """Checks that every tag opened is closed in order, and collects cells, links and images."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.tags: list[str] = []
        self.links: list[str] = []  # every src and href
        self.images: list[dict[str, str]] = []
        self.cells: list[dict[str, Any]] = []  # td with data-key: its attributes and text
        self.rows = 0
        self._cell: dict[str, Any] | None = None
        self.feed(text)
        self.close()
        assert not self.stack, f"unclosed tags: {self.stack}"

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.tags.append(tag)
        self.links += [a[k] for k in ("src", "href") if k in a]
        if tag == "img":
            self.images.append(a)
        if tag not in VOID:
            self.stack.append(tag)
        if tag == "td" and "data-key" in a:
            self._cell = {**a, "text": ""}
        if tag == "tr":
            self.rows += 1

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()
        if tag == "td" and self._cell is not None:
            self.cells.append(self._cell)
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell["text"] += data


def read_page(path: Path) -> tuple[str, Page]:
    text = path.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    return text, Page(text)


def check_self_contained(text: str, page: Page, plots: int) -> None:
    """Nothing is fetched: every src/href is a data: URL; each image is a PNG that decodes; no secret."""
    assert "Content-Security-Policy" in text
    assert all(link.startswith("data:image/png;base64,") for link in page.links), page.links
    assert not any("http://" in link or "https://" in link for link in page.links)
    assert len(page.images) == plots
    for image in page.images:
        assert base64.b64decode(image["src"].split(",", 1)[1], validate=True).startswith(PNG_SIGNATURE)
    assert "script" not in page.tags and "<script" not in text.lower()
    for secret in SECRETS:
        assert secret not in text


def check_numbers(page: Page, summary_of: Any) -> int:
    """Every summary cell shows its JSON value formatted as the console does; return the cells checked."""
    n = 0
    for cell in page.cells:
        value = value_at(summary_of(cell.get("data-level")), cell["data-key"])
        if "class" not in cell:  # a text cell: the label itself
            assert cell["text"] == str(value)
            continue
        spec = cell.get("data-format")
        shown = fmt(value) if spec is None or value is None else format(value, spec)
        assert cell["text"] == shown, (cell, value)
        if isinstance(value, int | float) and not spec:  # and the text reads back as the number
            assert float(cell["text"].replace(",", "")) == pytest.approx(
                value, abs=0.5 if value >= 1000 else 0.006
            )
        n += 1
    return n


# -- synthetic runs ---------------------------------------------------------------------------------------
def records(n: int, ttft: float, itl: float, osl: int = 8, failures: int = 0) -> list[RequestRecord]:
    out = []
    for i in range(n):
        send = 0.1 * i
        chunks = [send + ttft + (k * itl) for k in range(osl)]
        out.append(
            RequestRecord(
                index=i,
                t_send=send,
                t_end=chunks[-1],
                chunk_times=chunks,
                isl=20 + i % 3,
                osl=osl,
                osl_source="usage",
            )
        )
    for j in range(failures):
        out.append(
            RequestRecord(
                index=n + j,
                t_send=0.05 * j,
                t_end=0.05 * j + 0.01,
                error="http_500",
                error_detail="<b>boom</b><script>x()</script>",
            )
        )
    return out


def level(concurrency: int, ttft: float, itl: float, n: int = 12, failures: int = 0) -> LevelResult:
    recs = records(n, ttft, itl, failures=failures)
    s = summarize(recs, parse_slos("ttft=500ms"))
    load = LoadConfig(concurrency=concurrency, num_requests=n + failures)
    s.update(label=load.label, concurrency=concurrency, request_rate=None, client_cpu_pct=3.25)
    return LevelResult(load, recs, s)


def config(model: str = "fake-model <script>alert(1)</script>") -> dict[str, Any]:
    return {
        "url": "http://bench:hunter2@127.0.0.1:8000/v1?api_key=sk-QUERY&x=1",
        "model": model,
        "endpoint": "chat",
        "stream": True,
        "extra_body": {"api_key": "sk-SECRET", "headers": {"Authorization": "Bearer sk-BEARER"}, "top_k": 5},
        "workload": {"isl": 20, "osl": 8, "prefix_tokens": 40, "preset": None},
        "tokenizer": "none (words)",
        "slos": ["ttft<=500ms"],
    }


def test_masked_hides_credentials_and_keeps_token_counts() -> None:
    m = masked({**config(), "access_token": "t0k", "auth": {"password": "p"}, "max_tokens": 16})
    assert m["extra_body"]["api_key"] == "********" and m["access_token"] == "********"
    assert m["extra_body"]["headers"]["Authorization"] == "********" and m["auth"]["password"] == "********"
    assert m["url"] == "http://bench:********@127.0.0.1:8000/v1?api_key=********&x=1"
    assert m["workload"]["prefix_tokens"] == 40 and m["max_tokens"] == 16 and m["tokenizer"] == "none (words)"
    assert m["extra_body"]["top_k"] == 5


def test_one_level_report(tmp_path: Path) -> None:
    paths = write_artifacts(BenchResult([level(2, 0.12, 0.03, failures=2)]), tmp_path, config())
    assert paths == [tmp_path / "summary.json", tmp_path / "report.html"]
    text, page = read_page(tmp_path / "report.html")
    check_self_contained(text, page, plots=1)
    summary = json.loads((tmp_path / "summary.json").read_text())
    # totals, and TTFT/TTST/ITL/chunk gap/E2E/tok/s per user/ISL/OSL x 8 statistics
    assert check_numbers(page, lambda _: summary) >= 12 + 8 * 8
    assert {c["data-key"] for c in page.cells} >= {"ttft_ms.p99", "itl_ms.p50", "e2e_ms.p90", "completed"}
    # What was given is shown as text, escaped: the label, the error details.
    assert "fake-model &lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "&lt;b&gt;boom&lt;/b&gt;&lt;script&gt;x()&lt;/script&gt;" in text and "http_500" in text
    assert "load.concurrency" in text and "workload.prefix_tokens" in text  # the configuration


def test_sweep_report_has_a_row_per_level_and_the_curve(tmp_path: Path) -> None:
    levels = [level(c, 0.1 * c, 0.02 * c) for c in (1, 2, 4)]
    write_artifacts(BenchResult(levels), tmp_path, config("m"))
    text, page = read_page(tmp_path / "report.html")
    check_self_contained(text, page, plots=1 + 3)  # the curve and each level's distributions
    assert any("throughput vs interactivity" in i["alt"] for i in page.images)
    runs = {r["label"]: r for r in json.loads((tmp_path / "summary.json").read_text())["runs"]}
    labels = [c["text"] for c in page.cells if c["data-key"] == "label"]
    assert labels == ["concurrency1", "concurrency2", "concurrency4"]  # one sweep row per level
    assert check_numbers(page, lambda lv: runs[lv]) > 3 * (12 + 8 * 8)
    # The curve's PNG is the one write_artifacts saved beside the JSON.
    curve = next(i for i in page.images if "throughput vs interactivity" in i["alt"])
    assert (
        base64.b64decode(curve["src"].split(",", 1)[1])
        == (tmp_path / "throughput_vs_interactivity.png").read_bytes()
    )


def test_goodput_search_report_shows_the_probes(tmp_path: Path) -> None:
    probes = [
        {"request_rate": r, "slo_attainment": a, "goodput": g, "keeps_up": k}
        for r, a, g, k in ((1.0, 1.0, 1.0, True), (2.0, 0.95, 1.9, True), (4.0, 0.5, 2.0, False))
    ]
    search = {"target_attainment": 0.9, "max_good_rate": 2.0, "first_failing_rate": 4.0, "probes": probes}
    write_artifacts(BenchResult([level(c, 0.1, 0.02) for c in (1, 2, 4)], search), tmp_path, config("m"))
    text, page = read_page(tmp_path / "report.html")
    check_self_contained(text, page, plots=1 + 3)
    assert "Goodput search" in text and "at least 90% of requests meeting every SLO: 2.00 req/s." in text
    assert page.rows >= 4 + 1 + 3  # the probes' table among the others


def test_compare_report_holds_both_runs(tmp_path: Path) -> None:
    write_artifacts(BenchResult([level(2, 0.12, 0.03)]), tmp_path / "a", config("model-a"))
    write_artifacts(
        BenchResult([level(c, 0.06 * c, 0.015 * c) for c in (1, 2)]), tmp_path / "b", config("model-b")
    )
    out, js = tmp_path / "cmp.html", tmp_path / "cmp.json"
    args = ["bench", "compare", str(tmp_path / "a" / "summary.json"), str(tmp_path / "b" / "summary.json")]
    res = CliRunner().invoke(app, [*args, "--json", str(js), "--html", str(out)])
    assert res.exit_code == 0, res.output
    assert f"report: {out}" in res.output
    text, page = read_page(out)
    check_self_contained(text, page, plots=1)  # both curves on one plot
    assert str(tmp_path / "a" / "summary.json") in text and str(tmp_path / "b" / "summary.json") in text
    assert "model-a" in text and "model-b" in text and '<tr class="diff">' in text
    cmp = json.loads(js.read_text())
    assert [lv["level"] for lv in cmp["levels"]] == ["concurrency2"]  # the level they share
    rows = cmp["levels"][0]["rows"]
    cells = page.cells
    assert len(cells) == 3 * len(rows)
    for row, (a, b, ratio) in zip(rows, zip(cells[::3], cells[1::3], cells[2::3], strict=True), strict=True):
        assert (a["text"], b["text"], ratio["text"]) == (
            fmt(row["a"]),
            fmt(row["b"]),
            fmt(row["ratio_b_over_a"]),
        )


def test_cli_run_names_its_report(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.bench.fake_server",
        "--port",
        "0",
        "--first-token-ms",
        "5",
        "--itl-ms",
        "2",
    ]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().split()[-1]
        args = ["bench", "--url", url, "--num-requests", "3", "--osl", "4", "--tokenizer", "none"]
        res = CliRunner().invoke(app, [*args, "--output", str(tmp_path / "run")])
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert res.exit_code == 0, res.output
    assert f"report: {tmp_path / 'run' / 'report.html'}" in res.output
    text, page = read_page(tmp_path / "run" / "report.html")
    check_self_contained(text, page, plots=1)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert check_numbers(page, lambda _: summary) > 60


# -- sizing --------------------------------------------------------------------------------------------
def size(tmp_path: Path, *args: str) -> tuple[Any, dict[str, Any], str, Page]:
    res = CliRunner().invoke(app, ["size", *args, "--json", "--output", str(tmp_path)])
    s = json.loads(res.stdout)  # the report's path goes to stderr: stdout stays one JSON document
    assert f"report: {tmp_path / 'report.html'}" in res.stderr
    assert json.loads((tmp_path / "sizing.json").read_text()) == s
    text, page = read_page(tmp_path / "report.html")
    return res, s, text, page


def test_size_report(tmp_path: Path) -> None:
    args = [
        "--model",
        "llama3-8b",
        "--gpu",
        "h100-sxm",
        "--precision",
        "fp8",
        "--isl",
        "2000",
        "--osl",
        "200",
    ]
    res, s, text, page = size(tmp_path, *args, "--ttft-ms", "500", "--avg-rps", "64")
    assert res.exit_code == 0, res.output
    check_self_contained(text, page, plots=1)
    assert page.images[0]["src"].endswith(base64.b64encode((tmp_path / "frontier.png").read_bytes()).decode())
    assert check_numbers(page, lambda _: s) >= 19 + 7
    alternatives = {
        c["data-key"].split(".")[1] for c in page.cells if c["data-key"].startswith("alternatives.")
    }
    assert len(alternatives) == len(s["alternatives"]) > 1
    assert "2 servers (16 x h100-sxm)" in text and s["factors"]["source"] in text
    assert "carry no measured error" in text and s["factor_fit_error"] is None


def test_size_report_shows_the_calibration_error(tmp_path: Path) -> None:
    """Factors fitted by `size calibrate` carry the fit's error; a sizing made from them reports it."""
    truth = Factors(mfu=0.3, mbu_weights=0.5, mbu_kv=0.4, overhead_per_layer_s=200e-6, client_s=10e-3)
    d = Deployment(MODELS["smollm2-135m"], GPUS["cpu-2c"], "bf16", truth)
    runs = []
    for c in (1, 2, 4, 8):
        p = predict(d, c, 160, 64)
        runs.append(
            {
                "label": f"concurrency{c}",
                "concurrency": c,
                "isl": {"mean": 160},
                "osl": {"mean": 64},
                "ttft_ms": {"mean": p.ttft_s * 1e3 * (1.1 if c == 4 else 1)},  # one level off: a real error
                "itl_ms": {"mean": p.itl_s * 1e3},
                "e2e_ms": {"mean": p.e2e_s * 1e3},
                "request_throughput": p.rps,
            }
        )
    (tmp_path / "summary.json").write_text(json.dumps({"runs": runs}))
    factors = tmp_path / "factors.json"
    cal = ["size", "calibrate", str(tmp_path / "summary.json"), "--model", "smollm2-135m", "--gpu", "cpu-2c"]
    res = CliRunner().invoke(app, [*cal, "--output", str(factors)])
    assert res.exit_code == 0, res.output
    args = [
        "--model",
        "smollm2-135m",
        "--gpu",
        "cpu-2c",
        "--precision",
        "bf16",
        "--isl",
        "160",
        "--osl",
        "64",
    ]
    res, s, text, page = size(tmp_path / "out", *args, "--rps", "1", "--factors", str(factors))
    assert res.exit_code == 0, res.output
    assert s["factor_fit_error"]["ttft"]["max"] > 0.01
    fit_cells = [c for c in page.cells if c["data-key"].startswith("factor_fit_error.")]
    assert len(fit_cells) == 2 * len(s["factor_fit_error"]) == 6
    check_numbers(page, lambda _: s)
    assert "calibrated from measurements" in text and "carry no measured error" not in text


def test_size_report_when_nothing_fits(tmp_path: Path) -> None:
    args = ["--model", "llama3-8b", "--isl", "2000", "--osl", "200", "--rps", "10", "--ttft-ms", "0.001"]
    res, s, text, page = size(tmp_path, *args)
    assert res.exit_code == 1 and s["servers"] is None
    check_self_contained(text, page, plots=0)
    assert "no shape meets the latency limits" in text and "nothing to plot" in text
