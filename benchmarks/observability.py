"""What watching costs: served throughput at 32 streams with tracing on, and with the console watching,
each against the same server setup with neither, in one run.

Two `tokenmill serve` processes run side by side, idle in turn: a plain one, and one sending its spans
(`--otlp-traces-endpoint`) to a sink in this process that answers each export at once (a collector's
cost is its own machine's). Each repeat has a round of each kind, in an order that turns with the
repeat:

- plain: the plain server;
- traced: the traced one;
- polled: the plain one while a client asks /v1/console/live once a second, as an open console does:
  the server's cost of being watched (a browser runs on its user's machine, not on the server);
- browser: the plain one while Debian's Chromium shows the console's Overview on this machine too, so
  its drawing competes for the server's two cores: an upper bound, reported beside the goal.

Each round is 32 concurrent completions of 128 tokens; a figure is the median of its rounds' output
tokens/s, and every round's is printed. Rounds on these shared machines vary by 10-15%, more than
either cost: so the time one poll of the live figures takes on the idle server is measured too
(`live_poll_ms`, the median of 200), the cost of a watching console being that time once a second.

Goals (issue 58): tracing on costs under 3%, one console watching under 2%.

    python benchmarks/observability.py [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from browser import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from machine import cpu_description  # noqa: E402
from results_log import add_flag, record  # noqa: E402
from served import serving  # noqa: E402

WORDS = [
    "the", "engine", "keeps", "a", "cache", "of", "keys", "and", "values", "for", "every", "token", "it",
    "has", "seen", "so", "far",
]  # fmt: skip


class Sink:
    """An OTLP/HTTP endpoint that takes every export and counts its bytes (nothing decoded)."""

    def __init__(self) -> None:
        self.exports = self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                n = int(self.headers["Content-Length"])
                self.rfile.read(n)
                sink.exports, sink.bytes = sink.exports + 1, sink.bytes + n
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def prompt(i: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed + k) % len(WORDS)] for k in range(48))


async def round_rate(base: str, streams: int, tokens: int, seed: int) -> float:
    """Output tokens/s of `streams` completions sent at once."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def one(i: int) -> int:
            body = {"model": "smollm2-135m", "prompt": prompt(i, seed), "max_tokens": tokens,
                    "temperature": 0.0, "ignore_eos": True}  # fmt: skip
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(i) for i in range(streams)))
        return sum(done) / (time.perf_counter() - t0)


class Poller:
    """Asks /v1/console/live once a second, as the console's page does, until close()."""

    def __init__(self, base: str) -> None:
        self._stop = threading.Event()
        self.polls = 0
        self._thread = threading.Thread(target=self._poll, args=(base,), daemon=True)
        self._thread.start()

    def _poll(self, base: str) -> None:
        with httpx.Client(base_url=base, timeout=10) as client:
            while not self._stop.wait(1.0):
                client.get("/v1/console/live", params={"window": 30}).raise_for_status()
                self.polls += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(15)


class Watcher:
    """Chromium with the console's Overview open on `base` until close(). Playwright's sync API runs an
    event loop of its own: it lives on a thread, apart from the load's."""

    def __init__(self, base: str) -> None:
        self._opened, self._stop = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._watch, args=(base,), daemon=True)
        self._thread.start()
        self._opened.wait(120)
        if self._error is not None:
            raise self._error

    def _watch(self, base: str) -> None:
        from playwright.sync_api import sync_playwright

        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
                page = browser.new_page()
                page.goto(f"{base}/ui")
                page.wait_for_load_state("networkidle")
                self._opened.set()
                while not self._stop.is_set():
                    page.wait_for_timeout(200)  # the page's own timers run meanwhile
                browser.close()
        except BaseException as e:  # said by the thread that waits for the page
            self._error = e
            self._opened.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a smoke test: 8 streams, one repeat, not recorded")
    add_flag(ap)
    args = ap.parse_args()
    if args.quick:
        args.streams, args.tokens, args.repeats, args.no_record = 8, 16, 1, True
    watch = shutil.which(CHROMIUM) is not None
    if not watch:
        print(f"no {CHROMIUM}: the browser round is left out (apt-get install chromium)")
    print(f"{cpu_description()}; {args.streams} streams x {args.tokens} tokens, {args.repeats} rounds each")
    logs = Path(tempfile.mkdtemp(prefix="observability-"))
    serve_args = ["--max-model-len", "512"]
    ready = lambda base, proc: True  # noqa: E731
    rates: dict[str, list[float]] = {"plain": [], "traced": [], "polled": [], "browser": []}
    sink = Sink()
    with ExitStack() as stack:
        plain, _ = stack.enter_context(serving(serve_args, logs / "plain.log", ready))
        traced, _ = stack.enter_context(
            serving([*serve_args, "--otlp-traces-endpoint", sink.url], logs / "traced.log", ready)
        )

        def run(base: str, seed: int) -> float:
            return asyncio.run(round_rate(base, args.streams, args.tokens, seed))

        for base in (plain, traced):  # warm: kernels, pages, the first export
            run(base, -1)
        with httpx.Client(base_url=plain, timeout=10) as client:
            polls = []
            for _ in range(200):
                t0 = time.perf_counter()
                client.get("/v1/console/live", params={"window": 30}).raise_for_status()
                polls.append(time.perf_counter() - t0)
        live_poll_ms = 1000 * statistics.median(polls)
        kinds = ["plain", "traced", "polled", *(["browser"] if watch else [])]
        for rep in range(args.repeats):
            # Each round's place in the order turns with the repeat: no kind always follows the browser.
            for i in range(len(kinds)):
                kind = kinds[(rep + i) % len(kinds)]
                seed = 100 * rep + i
                if kind in ("plain", "traced"):
                    time.sleep(2)  # every round starts after the same pause
                    rates[kind].append(run(plain if kind == "plain" else traced, seed))
                    continue
                watcher = Poller(plain) if kind == "polled" else Watcher(plain)
                try:
                    time.sleep(2)  # watching before the round starts
                    rates[kind].append(run(plain, seed))
                finally:
                    watcher.close()
                time.sleep(2)  # the browser's processes gone before the next round
    sink.close()
    for kind, values in rates.items():
        if values:
            print(f"{kind:8s} rounds: " + ", ".join(f"{v:.1f}" for v in values))
    med = {k: statistics.median(v) for k, v in rates.items() if v}
    res = {
        "streams": args.streams,
        "plain_tok_s": round(med["plain"], 1),
        "traced_tok_s": round(med["traced"], 1),
        "traced_over_plain": round(med["traced"] / med["plain"], 3),
        "span_exports": sink.exports,
        "span_bytes": sink.bytes,
        "live_poll_ms": round(live_poll_ms, 2),
        "polled_tok_s": round(med["polled"], 1),
        "watched_over_plain": round(med["polled"] / med["plain"], 3),
    }
    if "browser" in med:
        res["browser_tok_s"] = round(med["browser"], 1)
        res["browser_here_over_plain"] = round(med["browser"] / med["plain"], 3)
    for key, v in res.items():
        print(f"{key:20s} {v}")
    record("observability", res, args=args)


if __name__ == "__main__":
    main()
