"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "Error"), "param": param, "code": status}
    }


def error_response(
    status: int, message: str, param: str | None = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


# Engine addresses (ipc:// names a socket file in the server's temporary folder) and file paths.
_ADDRESS = re.compile(r"(?:\s+at)?\s*\b(?:ipc|tcp|inproc)://\S*")
_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.+-]+/)*[\w.+-]+")


def engine_unavailable(reason: object = None) -> str:
    """The message a client gets when the engine is gone: why, without the engine's socket address or
    any file path of the server (which the reasons the engine client records name)."""
    text = _PATH.sub("<path>", _ADDRESS.sub("", str(reason or ""))).strip()
    return f"the engine is not available: {text}" if text else "the engine is not available"
