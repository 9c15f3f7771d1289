"""Screenshots of the web console's tabs for docs/guides/console.md: docs/img/console-<tab>.png, 1280x800.

Starts one `tokenmill serve` with everything the tabs show (a fleet of two workers under the load
planner, a KServe model repository, an API key), runs two small `tokenmill bench` sweeps against it
(traffic for the charts, and results for the Bench tab), then drives Debian's Chromium through each tab.

    python scripts/console_screenshots.py [--out docs/img] [--chromium /usr/bin/chromium]

Needs the embedded model (`tokenmill models pull`), the triton and bench extras, playwright and chromium.
Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from browser import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from server_fixture import example_repository, running_server  # noqa: E402

KEY = "screenshot-key"  # a throwaway: the page never shows it


def wait_for(cond: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.3)


@contextlib.contextmanager
def server(repository: Path) -> Iterator[str]:
    """A fleet of two workers under the load planner, with the repository and the key."""
    args = ["--workers", "2..2", "--planner", "load", "--planner-interval-s", "2",
            "--model-repository", str(repository), "--model-control-mode", "explicit", "--load-model", "*",
            "--grpc-port", "0"]  # fmt: skip
    with running_server(*args, api_key=KEY, timeout=300) as proc:
        yield proc.base_url


def bench(base: str, out: Path, isl: int) -> Path:
    """A three-level concurrency sweep; its top-level summary.json."""
    cmd = [sys.executable, "-m", "tokenmill.cli.main", "bench", "--url", f"{base}/v1",
           "--concurrency", "1,2,4", "--num-requests", "8", "--isl", str(isl), "--osl", "32",
           "--output", str(out)]  # fmt: skip
    subprocess.run(cmd, env={**os.environ, "TOKENMILL_API_KEY": KEY}, check=True, capture_output=True)
    return out / "summary.json"


def background_load(base: str, stop: threading.Event) -> None:
    """A steady trickle of completions of varied length: what the overview's charts draw. They share a
    preamble of a few KV blocks, so that the prefix cache and the KV-aware router have something to find."""
    preamble = "You answer questions about an old water mill by the river, briefly and plainly. " * 5
    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
        i = 0
        while not stop.is_set():
            prompt = f"{preamble}Question {i}: what does the mill grind?"
            body = {"prompt": prompt, "max_tokens": 16 + 8 * (i % 4), "ignore_eos": True}
            c.post(f"{base}/v1/completions", json=body)
            i += 1


def shoot(base: str, out: Path, chromium: str, sweeps: list[Path]) -> list[Path]:
    from playwright.sync_api import sync_playwright

    shots: list[Path] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 800}, device_scale_factor=1)
        context.add_init_script(f"sessionStorage.setItem('tokenmill.apiKey', {json.dumps(KEY)})")
        page = context.new_page()

        def until(expr: str, timeout: float = 60) -> None:
            wait_for(lambda: page.evaluate(expr), timeout, expr)

        def snap(tab: str) -> None:
            path = out / f"console-{tab}.png"
            page.screenshot(path=str(path))
            shots.append(path)

        page.goto(f"{base}/ui#overview")
        until("window.tokenmillConsole && window.tokenmillConsole.polls >= 1")
        stop = threading.Event()
        threads = [threading.Thread(target=background_load, args=(base, stop)) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            time.sleep(45)  # the charts fill in under load
            page.mouse.move(5, 790)  # no chart cursor in the picture
            snap("overview")
            page.goto(f"{base}/ui#fleet")
            until("document.querySelectorAll('#placements tbody tr td code').length >= 5")
            snap("fleet")
        finally:
            stop.set()
            for t in threads:
                t.join(120)

        page.goto(f"{base}/ui#models")
        until("document.querySelector('#models tr[data-model=sleeper][data-state=READY]')")
        page.click("#models button[data-action=unload][data-model=sleeper]")
        until("document.querySelector('#models tr[data-model=sleeper][data-state=UNAVAILABLE]')")
        page.mouse.move(5, 790)  # no button under the pointer
        snap("models")

        page.goto(f"{base}/ui#playground")
        page.fill("#play-prompt", "Explain in three sentences what a KV cache is for.")
        page.fill("#play-max", "96")
        page.click("#play-send")
        until("window.tokenmillConsole.play && window.tokenmillConsole.play.state !== 'streaming'", 180)
        snap("playground")

        page.goto(f"{base}/ui#bench")
        page.set_input_files("#bench-files", [str(s) for s in sweeps])
        until(f"window.tokenmillConsole.bench.files === {len(sweeps)}")
        page.mouse.move(5, 790)
        snap("bench")
        browser.close()
    return shots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    parser.add_argument("--chromium", default=str(CHROMIUM))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="console-shots-") as tmp:
        work = Path(tmp)
        with server(example_repository(work)) as base:
            sweeps = []
            for isl in (64, 384):
                # Named for the reader: the Bench tab labels each curve with its file's name.
                got = bench(base, work / f"bench-isl{isl}", isl)
                named = work / f"sweep-isl{isl}.json"
                shutil.copy(got, named)
                sweeps.append(named)
            for path in shoot(base, args.out, args.chromium, sweeps):
                print(path.relative_to(REPO) if path.is_relative_to(REPO) else path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
