"""The web console at /ui (issue 58), driven in a real headless Chromium (Debian's, through Playwright's
Python API) against real `tokenmill serve` processes: one with an API key and a KServe model repository,
one fleet of two workers under a planner, and one whose engine is killed.

What is checked is what a user sees: the page loads without errors in its console; the charts move while
load runs; the playground streams the greedy answer; unloading a model from the page unloads it, and
without the key it cannot; the fleet view shows a killed worker go down and come back; a dead engine
shows a banner, cleared when the fleet is back. And what must not be seen: the key, or any path of the
server, in the page or in the live endpoint's JSON.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from browser import CHROMIUM, CHROMIUM_ARGS
from procs import session_processes
from server_fixture import example_repository, running_server

from tokenmill.weights import catalog

KEY = "console-test-key-5f0c"
AUTH = {"Authorization": f"Bearer {KEY}"}
TABS = ("overview", "fleet", "models", "playground", "bench")


def wait_until(cond: Callable[[], object], timeout: float, what: str, every: float = 0.25) -> object:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(every)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """Debian's Chromium (no browser download), driven by Playwright; the tests that need it skip, saying
    why, where either is missing."""
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (apt install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a dev dependency")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


class Page:
    """A page of a fresh browser context, with the errors its console and scripts reported."""

    def __init__(self, browser: object, base: str, key: str | None = None) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 800})  # type: ignore[attr-defined]
        if key is not None:
            # As if typed in earlier in this tab: the page's first call already carries it.
            self.context.add_init_script(f"sessionStorage.setItem('tokenmill.apiKey', {json.dumps(key)})")
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.base = base

    def open(self, tab: str = "overview") -> object:
        self.page.goto(f"{self.base}/ui#{tab}")
        self.wait("window.tokenmillConsole && window.tokenmillConsole.polls >= 1", 30)
        return self.page

    def js(self, expr: str) -> object:
        return self.page.evaluate(expr)

    def wait(self, expr: str, timeout: float) -> None:
        # Polled from here: Playwright's wait_for_function evaluates its string with eval() in the page,
        # which the page's own Content-Security-Policy refuses (and should).
        wait_until(lambda: self.page.evaluate(expr), timeout, expr, every=0.2)

    def close(self) -> None:
        self.context.close()


@pytest.fixture()
def make_page(browser) -> Iterator[Callable[..., Page]]:
    pages: list[Page] = []

    def make(base: str, key: str | None = None) -> Page:
        pages.append(Page(browser, base, key))
        return pages[-1]

    yield make
    for p in pages:
        p.close()


# -- a server with an API key and a KServe model repository ------------------------------------------
@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    pytest.importorskip("onnxruntime", reason="the triton extra serves the model repository")
    return example_repository(tmp_path_factory.mktemp("console-repo"))


@pytest.fixture(scope="module")
def keyed(repo: Path):
    args = ["--model-repository", str(repo), "--model-control-mode", "explicit",
            "--load-model", "linear_onnx", "--grpc-port", "0"]  # fmt: skip
    with running_server(*args, api_key=KEY) as proc:
        yield proc


def test_the_live_figures_against_a_hand_count() -> None:
    """Percentiles by nearest rank, the window's cut-off, and engine counters keyed per engine life."""
    from types import SimpleNamespace

    from tokenmill.server.console.fleet import worker_name
    from tokenmill.server.console.live import engine_counters, latency_window, percentiles
    from tokenmill.server.metrics import Metrics

    assert percentiles([float(x) for x in range(100, 0, -1)]) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    assert percentiles([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0}
    stats = SimpleNamespace(prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1, kv_connector={})
    m = Metrics(SimpleNamespace(stats=stats, info={}), "m")  # type: ignore[arg-type]
    now = time.monotonic()
    # (finished at, tokens, TTFT, ITL) and (finished at, queue, compute): two inside the window, one out.
    m._latencies.extend([(now - 100, 5, 9.0, 9.0), (now - 2, 5, 0.1, 0.02), (now - 1, 5, 0.3, 0.04)])
    m._recent.extend([(now - 100, 1.0, 9.0), (now - 2, 0.05, 0.5), (now - 1, 0.15, 0.7)])
    lat = latency_window(m, 30.0)
    assert lat["finished"] == 2
    assert lat["ttft_s"] == {"p50": 0.1, "p90": 0.3, "p99": 0.3}
    assert lat["itl_s"]["p50"] == 0.02 and lat["e2e_s"]["p99"] == pytest.approx(0.85)
    assert engine_counters(SimpleNamespace(stats=stats), worker_name)["engine"]["prefix_cache_hits"] == 4
    w = [
        SimpleNamespace(
            name="local-0", url="u0", up=True, retired=False, joins=2, client=SimpleNamespace(stats=stats)
        ),
        SimpleNamespace(
            name="local-1", url="u1", up=False, retired=False, joins=1, client=SimpleNamespace(stats=stats)
        ),
    ]
    fleet = engine_counters(SimpleNamespace(workers=w, worker_stats=lambda: {}), worker_name)
    assert list(fleet) == ["local-0#2"], "a worker down is left out; a restarted one is a new key"


def test_the_page_needs_no_key_and_its_data_does() -> None:
    """In process, no model: build_app wires routes only (the frontend is read when a request comes)."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from tokenmill.server.app import build_app
    from tokenmill.server.config import ServerConfig

    stand_in = SimpleNamespace(client=SimpleNamespace(info={}), tokenizer=SimpleNamespace(chat_template=None))
    client = TestClient(build_app(stand_in, ServerConfig(api_key=KEY)))  # type: ignore[arg-type]
    root = client.get("/")
    assert root.status_code == 200 and 'href="ui"' in root.text
    page = client.get("/ui")
    assert page.status_code == 200 and "tokenmill console" in page.text and KEY not in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    for asset in (
        "console.js",
        "console.css",
        "vendor/uPlot.iife.min.js",
        "vendor/uPlot.min.css",
        "vendor/LICENSE",
    ):
        r = client.get(f"/ui/static/{asset}")
        assert r.status_code == 200 and KEY not in r.text, asset
    assert client.get("/ui/static/nothing.js").status_code == 404
    # Never a file outside static/: httpx folds a literal "..", so the dots go encoded, as a browser can.
    for escape in (
        "/ui/static/%2e%2e/__init__.py",
        "/ui/static/%2E%2E%2F__init__.py",
        "/ui/static/..%2fassets.py",
    ):
        r = client.get(escape)
        assert r.status_code == 404 and "ConsoleAssets" not in r.text, escape
    assert client.get("/ui/static/index.html").status_code == 404, "the page is at /ui only"
    head = client.head("/ui/static/console.js")
    assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0
    assert client.post("/ui").status_code == 405
    assert client.get("/ui", headers={"If-None-Match": page.headers["etag"]}).status_code == 304
    assert client.get("/v1/console/live").status_code == 401
    assert client.get("/v1/console/live", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert "/v1/console/live" not in client.get("/openapi.json", headers=AUTH).json()["paths"]


@pytest.mark.slow
def test_the_live_endpoint_is_behind_the_key_and_names_no_secret(keyed, repo: Path) -> None:
    base = keyed.base_url
    assert httpx.get(f"{base}/v1/console/live").status_code == 401
    assert httpx.get(f"{base}/v1/console/live", headers={"Authorization": "Bearer wrong"}).status_code == 401
    httpx.post(f"{base}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, headers=AUTH, timeout=60)
    r = httpx.get(f"{base}/v1/console/live", headers=AUTH)
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    live = r.json()
    assert live["engine"] == {"healthy": True, "reason": None, "draining": False}
    assert live["counters"]["output_tokens"] >= 4 and live["latency"]["finished"] >= 1
    assert live["latency"]["ttft_s"]["p50"] > 0 and live["fleet"] is None
    assert live["server"]["repository"] and live["server"]["model_control_mode"] == "explicit"
    model_file = catalog.installed_file(catalog.CATALOG[catalog.DEFAULT_MODEL])
    for secret in (KEY, str(repo), str(model_file), str(Path(str(model_file)).parent), "/tmp", "ipc://"):
        assert secret not in r.text, secret


@pytest.mark.slow
def test_the_page_loads_every_tab_without_console_errors_or_secrets(keyed, repo: Path, make_page) -> None:
    p = make_page(keyed.base_url, KEY)
    page = p.open()
    p.wait("window.tokenmillConsole.polls >= 3", 30)
    assert p.js("window.tokenmillConsole.banner") == ""
    for tab in TABS:
        page.goto(f"{keyed.base_url}/ui#{tab}")
        p.wait(f"!document.querySelector('#tab-{tab}').hidden", 10)
        p.wait(f"window.tokenmillConsole.polls >= {p.js('window.tokenmillConsole.polls') + 2}", 30)
    p.wait("document.querySelectorAll('#models tbody tr').length > 0", 30)
    assert p.errors == [], p.errors
    html = page.content()
    model_file = catalog.installed_file(catalog.CATALOG[catalog.DEFAULT_MODEL])
    for secret in (KEY, str(repo), str(model_file), "/tmp"):
        assert secret not in html, secret


@pytest.mark.slow
def test_the_charts_move_while_load_runs(keyed, make_page) -> None:
    p = make_page(keyed.base_url, KEY)
    p.open("overview")
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=120, headers=AUTH) as c:
            while not stop.is_set():
                c.post(
                    f"{keyed.base_url}/v1/completions",
                    json={"prompt": "Count:", "max_tokens": 24, "ignore_eos": True},
                )

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        series = "window.tokenmillConsole.series.output_tps"
        p.wait(f"{series}.filter(v => v > 0).length >= 3", 90)
        first = p.js(f"{series}.slice()")
        p.wait(f"{series}.length > {len(first)} + 3", 30)  # (the series keeps 300 points: far from full)
        later = p.js(f"{series}.slice()")
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    rates = [v for v in later if v is not None]
    assert len(set(rates)) >= 3, f"the tokens/s series hardly changes: {rates}"
    chart = p.page.locator("#chart-tps")
    assert int(chart.get_attribute("data-points")) >= len(later) - 1
    assert p.js("window.tokenmillConsole.series.ttft_p50.some(v => v > 0)")
    assert p.errors == [], p.errors


@pytest.mark.slow
def test_the_playground_streams_the_greedy_answer(keyed, make_page) -> None:
    p = make_page(keyed.base_url, KEY)
    page = p.open("playground")
    prompt = "List the colours of the rainbow."
    page.fill("#play-prompt", prompt)
    page.fill("#play-max", "40")
    page.fill("#play-temp", "0")
    page.click("#play-send")
    p.wait("window.tokenmillConsole.play && window.tokenmillConsole.play.state !== 'streaming'", 120)
    play = p.js("(({state, lengths, text}) => ({state, lengths, text}))(tokenmillConsole.play)")
    assert play["state"] == "done", play
    lengths = play["lengths"]
    assert len(lengths) > 3 and lengths == sorted(lengths) and lengths[0] < lengths[-1], (
        "the text did not grow"
    )
    assert float(page.get_attribute("#play-ttft", "data-ms")) > 0
    assert page.inner_text("#play-tps") not in ("", "-")
    shown = page.eval_on_selector("#play-out", "e => e.textContent")
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0}
    r = httpx.post(f"{keyed.base_url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert shown == play["text"] == r.json()["choices"][0]["message"]["content"]
    assert page.inner_text("#play-tokens") == str(r.json()["usage"]["completion_tokens"])
    assert page.inner_text("#play-finish") == r.json()["choices"][0]["finish_reason"]
    assert p.errors == [], p.errors


def model_state(base: str, name: str) -> str:
    index = httpx.post(f"{base}/v2/repository/index", json={}, headers=AUTH).json()
    return next(m["state"] for m in index if m["name"] == name)


@pytest.mark.slow
def test_unloading_a_model_from_the_page_unloads_it(keyed, make_page) -> None:
    base = keyed.base_url
    assert model_state(base, "linear_onnx") == "READY"
    p = make_page(base, KEY)
    page = p.open("models")
    p.wait("document.querySelector('#models tr[data-model=linear_onnx][data-state=READY]')", 30)
    page.click("#models button[data-action=unload][data-model=linear_onnx]")
    p.wait("document.querySelector('#models-msg').dataset.status === 'ok'", 60)
    assert model_state(base, "linear_onnx") == "UNAVAILABLE"
    p.wait("document.querySelector('#models tr[data-model=linear_onnx][data-state=UNAVAILABLE]')", 30)
    page.click("#models button[data-action=load][data-model=linear_onnx]")  # and back, from the page too
    p.wait("document.querySelector('#models tr[data-model=linear_onnx][data-state=READY]')", 60)
    assert model_state(base, "linear_onnx") == "READY"
    assert p.errors == [], p.errors


@pytest.mark.slow
def test_without_the_key_the_page_cannot_unload(keyed, make_page) -> None:
    base = keyed.base_url
    p = make_page(base, KEY)
    page = p.open("models")
    p.wait("document.querySelector('#models tr[data-model=linear_onnx][data-state=READY]')", 30)
    page.click("#key-forget")  # the key is gone; the buttons are still there
    page.click("#models button[data-action=unload][data-model=linear_onnx]")
    p.wait("document.querySelector('#models-msg').dataset.status === 'error'", 30)
    assert "401" in page.inner_text("#models-msg")
    p.wait("window.tokenmillConsole.banner === 'auth'", 30)
    assert "API key" in page.inner_text("#banner")
    assert model_state(base, "linear_onnx") == "READY"
    # A page opened without any key lists nothing and says why.
    q = make_page(base)
    q.open("models")
    q.wait("window.tokenmillConsole.banner === 'auth'", 30)
    assert q.js("document.querySelectorAll('#models tbody tr').length") == 0
    assert KEY not in q.page.content()


@pytest.mark.slow
def test_the_bench_viewer_plots_sweeps_side_by_side(keyed, make_page, tmp_path: Path) -> None:
    def level(label: str, conc: int, user_tps: float, tps: float) -> dict:
        stats = {"p50": 10.0, "p90": 12.0, "p99": 15.0}
        return {"label": label, "concurrency": conc, "request_rate": None, "completed": 20, "failed": 0,
                "request_throughput": tps / 64, "output_token_throughput": tps, "tps_user": {"p50": user_tps},
                "ttft_ms": stats, "itl_ms": stats, "e2e_ms": stats, "goodput": 1.0, "slos": []}  # fmt: skip

    sweep = {
        "config": {},
        "runs": [level("c1", 1, 30.0, 30.0), level("c2", 2, 25.0, 50.0), level("c4", 4, 18.0, 72.0)],
    }
    run = {"config": {}, "summary": level("c2", 2, 22.0, 44.0), "records": []}
    (tmp_path / "summary.json").write_text(json.dumps(sweep))
    (tmp_path / "run.json").write_text(json.dumps(run))
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    p = make_page(keyed.base_url, KEY)
    page = p.open("bench")
    page.set_input_files(
        "#bench-files", [str(tmp_path / n) for n in ("summary.json", "run.json", "other.json")]
    )
    p.wait("window.tokenmillConsole.bench.files === 2", 10)
    assert p.js("window.tokenmillConsole.bench.points") == 4
    assert "other.json" in page.inner_text("#bench-msg")
    header = page.inner_text("#bench-table thead")
    assert header.count("summary.json") == 3 and "run.json" in header
    assert page.locator("#bench-chart canvas").count() == 1
    assert p.errors == [], p.errors


# -- a fleet of two workers under a planner -------------------------------------------------------------
@pytest.fixture(scope="module")
def fleet():
    args = ["--workers", "2..2", "--planner", "load", "--planner-interval-s", "1"]
    with running_server(*args, new_session=True) as proc:
        yield proc


def worker_pids(proc) -> list[int]:  # noqa: ANN001
    return [int(line.split()[0]) for line in session_processes(proc.pid) if "spawn_main" in line]


@pytest.mark.slow
def test_the_fleet_view_shows_a_killed_worker_go_down_and_come_back(fleet, make_page) -> None:
    base = fleet.base_url
    p = make_page(base)
    page = p.open("fleet")
    rows = "document.querySelectorAll('#workers tbody tr')"
    up = f"[...{rows}].filter(r => r.dataset.state === 'up').length"
    p.wait(f"{rows}.length === 2 && {up} === 2", 60)
    for i in range(4):
        httpx.post(f"{base}/v1/completions", json={"prompt": f"Request {i}:", "max_tokens": 4}, timeout=60)
    p.wait("document.querySelectorAll('#placements tbody tr td code').length >= 4", 30)
    p.wait("document.querySelector('#planner .planner-target')?.textContent === '2'", 30)
    assert "steady" in page.inner_text("#planner") or "keep" in page.inner_text("#planner")
    pids = worker_pids(fleet)
    assert len(pids) == 2, session_processes(fleet.pid)
    os.kill(pids[0], signal.SIGKILL)
    p.wait(f"{up} === 1", 30)
    down = p.js(f"[...{rows}].filter(r => r.dataset.state !== 'up').map(r => r.dataset.state)")
    assert down in (["down"], ["starting"]), down
    p.wait(f"{up} === 2", 180)  # the router starts it again, and it rejoins
    assert p.js("window.tokenmillConsole.live.fleet.router.restarts") >= 1
    assert p.errors == [], p.errors
    live = httpx.get(f"{base}/v1/console/live").text
    assert "ipc://" not in live and "/tmp" not in live


@pytest.mark.slow
def test_a_fleet_without_workers_shows_the_banner_and_recovers(fleet, make_page) -> None:
    base = fleet.base_url
    p = make_page(base)
    p.open("overview")
    p.wait("window.tokenmillConsole.live.fleet.workers.every(w => w.state === 'up')", 180)
    assert p.js("window.tokenmillConsole.banner") == ""
    for pid in worker_pids(fleet):
        os.kill(pid, signal.SIGKILL)
    p.wait("window.tokenmillConsole.banner === 'engine-down'", 30)
    text = p.page.inner_text("#banner")
    assert "engine" in text and "/tmp" not in text and "ipc://" not in text, text
    p.wait("window.tokenmillConsole.banner === ''", 180)  # both restarted: the banner goes
    assert p.js("window.tokenmillConsole.live.engine.healthy")
    assert p.errors == [], p.errors


# -- one engine, killed --------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_killed_engine_shows_the_banner(make_page) -> None:
    with running_server() as srv:
        pid = httpx.get(f"{srv.base_url}/v1/metadata").json()["engine_pid"]
        p = make_page(srv.base_url)
        p.open("overview")
        p.wait("window.tokenmillConsole.live && window.tokenmillConsole.live.engine.healthy", 30)
        os.kill(pid, signal.SIGKILL)
        p.wait("window.tokenmillConsole.banner === 'engine-down'", 60)
        text = p.page.inner_text("#banner")
        assert "engine" in text and "/tmp" not in text and "ipc://" not in text, text
        assert p.page.get_attribute("#engine-pill", "data-state") == "down"
        # The page itself keeps working: it still polls, and says nothing of a script error.
        polls = p.js("window.tokenmillConsole.polls")
        p.wait(f"window.tokenmillConsole.polls > {polls + 1}", 30)
        assert p.errors == [], p.errors
