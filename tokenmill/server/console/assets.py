"""The console's page and its static files, served by a middleware in front of the API key's.

The page and its scripts hold no data (every figure comes from an API call that carries the key), so
they are served without the key: a browser cannot send a bearer token with a page load, and the page is
where the key is typed in. Only the files shipped in static/ are served, by name from a fixed table read
once at start-up: a request path never reaches the file system, so no path can escape the folder.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

STATIC = Path(__file__).resolve().parent / "static"
PAGE = "/ui"
PREFIX = "/ui/static/"
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".md": "text/plain; charset=utf-8",
    "": "text/plain; charset=utf-8",  # LICENSE
}
# The page runs only its own scripts and talks only to this server: an injected <script> or a
# third-party request is refused by the browser. uPlot sizes its elements through the CSSOM, which
# style-src does not govern.
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
ROOT_PAGE = b"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tokenmill</title>
<link rel="icon" href="data:,"></head>
<body>
<h1>tokenmill</h1>
<p>The <a href="ui">web console</a>: live figures, the fleet, models, a playground and bench results.</p>
<p>The OpenAI-compatible API is under <code>/v1</code>; its reference is at <a href="docs">/docs</a>.</p>
</body></html>
"""


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: bytes


def load_assets() -> dict[str, Asset]:
    """Every file of static/ (and static/vendor/), keyed by the URL path it is served at."""
    table: dict[str, Asset] = {}
    for path in sorted(STATIC.rglob("*")):
        if not path.is_file() or path.name.startswith("."):
            continue
        body = path.read_bytes()
        rel = path.relative_to(STATIC).as_posix()
        etag = b'"' + hashlib.sha256(body).hexdigest()[:20].encode() + b'"'
        table[PREFIX + rel] = Asset(body, TYPES.get(path.suffix, "application/octet-stream"), etag)
    # The page at /ui only: its relative links would be wrong from /ui/static/index.html.
    page = table.pop(PREFIX + "index.html", None)
    if page is not None:
        table[PAGE] = page
    root_tag = b'"' + hashlib.sha256(ROOT_PAGE).hexdigest()[:20].encode() + b'"'
    table["/"] = Asset(ROOT_PAGE, TYPES[".html"], root_tag)
    return table


class ConsoleAssets:
    """Answers GET and HEAD for the console's page and files; every other request goes on to the app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.assets = load_assets()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path == PAGE + "/":
            # The page's links are relative to /ui (so that a proxy's path prefix carries over).
            await self._send(send, 308, [(b"location", b"../ui")], b"")
            return
        asset = self.assets.get(path)
        if asset is None and not path.startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        if scope["method"] not in ("GET", "HEAD"):
            await self._send(send, 405, [(b"allow", b"GET, HEAD")], b"")
            return
        if asset is None:
            await self._send(send, 404, [(b"content-type", TYPES[""].encode())], b"no such console file\n")
            return
        headers = [
            (b"content-type", asset.content_type.encode()),
            (b"etag", asset.etag),
            # The page may change with the server's version: always checked, cheap when unchanged.
            (b"cache-control", b"no-cache"),
            *SECURITY_HEADERS,
        ]
        if dict(scope["headers"]).get(b"if-none-match") == asset.etag:
            await self._send(send, 304, headers, b"")
            return
        await self._send(
            send, 200, headers, b"" if scope["method"] == "HEAD" else asset.body, len(asset.body)
        )

    @staticmethod
    async def _send(
        send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes, length: int | None = None
    ) -> None:
        if status != 304:  # (a 304 has no body, and says nothing of its length)
            headers = [*headers, (b"content-length", str(len(body) if length is None else length).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
