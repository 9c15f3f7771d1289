"""Who a request is served for: its tenant, from the API key's name or a header (docs/guides/fairness.md).

Precedence: the name of the API key the request presented (`--api-key name:key`), else the value of
`--tenant-header` when that is set and the request carries it, else none (the engine's tenant
`default`). A named key wins over the header, so a client holding a named key cannot speak for
another tenant; the header is for a trusted gateway in front of the server that knows its users.
"""

from __future__ import annotations

import re

from tokenmill.engine.fairness import MAX_TENANT_NAME
from tokenmill.server.errors import APIError

# What a tenant may be called (a key's name or a header's value): no spaces, commas or quotes, so that
# it reads the same in a flag, a log line and a Prometheus label.
TENANT_NAME = re.compile(rf"[A-Za-z0-9._@/+-]{{1,{MAX_TENANT_NAME}}}")
# Set by the API key middleware: the name of the key the request presented (none for an unnamed key).
KEY_NAME_SCOPE = "tokenmill.api_key_name"


def parse_api_keys(text: str | None) -> list[tuple[str | None, str]]:
    """`--api-key`: comma-separated entries, each a plain KEY or NAME:KEY (NAME as TENANT_NAME, KEY not
    empty); (name or None, key) each."""
    keys: list[tuple[str | None, str]] = []
    for entry in (text or "").split(","):
        entry = entry.strip()
        if not entry:
            continue
        name, sep, key = entry.partition(":")
        if sep and key and TENANT_NAME.fullmatch(name):
            keys.append((name, key))
        else:
            keys.append((None, entry))
    return keys


def tenant_of(scope: dict, header: str | None) -> str | None:
    """The tenant of an HTTP request (its ASGI scope), or None for the default one; 400 for a header
    value that is not a tenant name."""
    name = scope.get(KEY_NAME_SCOPE)
    if name:
        return name
    if not header:
        return None
    wanted = header.lower().encode("latin-1")
    for key, value in scope.get("headers", ()):
        if key == wanted:
            text = value.decode("latin-1").strip()
            if not text:
                return None
            if not TENANT_NAME.fullmatch(text):
                raise APIError(
                    400,
                    f"the {header} header names a tenant: 1 to {MAX_TENANT_NAME} letters, digits or ._@/+-",
                )
            return text
    return None
