"""Debian's Chromium, as the console's tests, its screenshot script and the observability benchmark
launch it through Playwright (never a browser Playwright downloads)."""

from __future__ import annotations

from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")

# Without the background-networking flags Chromium's own connections (updates, sync) fail on a closed
# network and log errors; none of them is wanted here.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
