"""ASGI middlewares that guard every route: the API key, and the size of request bodies.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would wrap every response stream (adding
per-chunk overhead) and hide client disconnects from the endpoints, which need them to abort
generation. Each answers in the error shape of the protocol the path belongs to: KServe's
`{"error": "..."}` under /v2 (tritonclient cannot read any other), OpenAI's elsewhere.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.anthropic_protocol import anthropic_error_response, is_anthropic_path
from tokenmill.server.errors import error_response
from tokenmill.server.tenants import KEY_NAME_SCOPE

OPEN_PATHS = {
    "/health",
    "/v1/health/live",
    "/v1/health/ready",
    "/metrics",
    "/v1/version",
    "/version",
    "/v1/metadata",
    "/v2/health/live",
    "/v2/health/ready",
}


def protocol_error(path: str, status: int, message: str) -> JSONResponse:
    if path.startswith("/v2"):
        return JSONResponse({"error": message}, status_code=status)
    if is_anthropic_path(path):
        return anthropic_error_response(status, message)
    return error_response(status, message)


def presented_key(headers: dict[bytes, bytes]) -> str | None:
    """The API key a request carries: OpenAI clients send `Authorization: Bearer`, Anthropic's
    `x-api-key`."""
    auth = headers.get(b"authorization", b"")
    if auth[:7].lower() == b"bearer ":
        return auth[7:].decode("latin-1").strip()
    key = headers.get(b"x-api-key")
    return key.decode("latin-1").strip() if key is not None else None


class ApiKeyMiddleware:
    """An API key on every path but health, metrics and version, as `Authorization: Bearer <key>` or
    `x-api-key: <key>`: one of `keys` (server/tenants.py key_table: --api-key's plain keys, matched
    whole, and --named-api-key's, whose name becomes the request's tenant)."""

    def __init__(self, app: ASGIApp, keys: list[tuple[str | None, bytes]]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            key = (presented_key(dict(scope["headers"])) or "").encode("latin-1", "replace")
            # Every key compared, in constant time each: which one matched does not show in the timing.
            matched = [hmac.compare_digest(key, k) for _, k in self.keys]
            if not any(matched):
                msg = "invalid or missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`"
                await protocol_error(scope["path"], 401, msg)(scope, receive, send)
                return
            name = self.keys[matched.index(True)][0]
            if name is not None:
                scope[KEY_NAME_SCOPE] = name
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Request bodies above `max_bytes` get 413 before they are read (by Content-Length), or are cut
    off while they stream in (chunked uploads): the server never buffers more than the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            msg = f"the request body is larger than the limit of {self.max_bytes} bytes"
            await protocol_error(scope["path"], 413, msg)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # The endpoint sees the client as gone and stops; nothing more is read.
                    return {"type": "http.disconnect"}
            return message

        await self.app(scope, counted, send)
