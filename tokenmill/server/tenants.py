"""Who a request is served for, and how urgent it may say it is (docs/guides/fairness.md).

The tenant: the name of the API key the request presented (`--named-api-key NAME=KEY`), else the value
of `--tenant-header` when that is set and the request carries it, else none (the engine's tenant
`default`). A named key wins over the header, so a client holding a named key cannot speak for
another tenant; and the header may not name a named key's tenant, `default` or `other` (400), so a
client without a named key cannot speak for those either. The header is for a trusted gateway in front
of the server that knows its users.

The band: a request's `priority`, clamped to its tenant's floor (`--tenant-priority-floor alice=-5`; 0
for a tenant not named): a client may always ask for a less urgent band, never for a more urgent one
than its tenant is allowed.
"""

from __future__ import annotations

import re

from tokenmill.engine.fairness import DEFAULT_TENANT, MAX_TENANT_NAME, OTHER_TENANT, TENANT_NAME, name_values
from tokenmill.server.errors import APIError

# Set by the API key middleware: the name of the key the request presented (none for an unnamed key).
KEY_NAME_SCOPE = "tokenmill.api_key_name"
RESERVED = frozenset({DEFAULT_TENANT, OTHER_TENANT})
# Headers that carry credentials: never a tenant's name.
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie"})
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")


def plain_keys(text: str | None) -> list[str]:
    """`--api-key`: comma-separated keys, each matched whole."""
    return [k.strip() for k in (text or "").split(",") if k.strip()]


def parse_named_key(entry: str) -> tuple[str, str]:
    """`--named-api-key NAME=KEY` (split at the first `=`; the key may hold more) -> (name, key)."""
    name, sep, key = entry.partition("=")
    name, key = name.strip(), key.strip()
    if not sep or not key or not TENANT_NAME.fullmatch(name):
        raise ValueError(
            f"--named-api-key takes NAME=KEY (NAME 1 to {MAX_TENANT_NAME} letters, digits or ._@/+-; KEY "
            "not empty)"
        )
    if name in RESERVED:
        raise ValueError(f"--named-api-key: {name!r} is a tenant of its own, not a key's name")
    return name, key


def key_table(api_key: str | None, named: list[str]) -> list[tuple[str | None, bytes]]:
    """Every accepted key with its tenant's name (None for a plain key); ValueError for a malformed
    named key or a key configured twice. Entries never name the key itself (it is a secret)."""
    table: list[tuple[str | None, bytes]] = [(None, k.encode()) for k in plain_keys(api_key)]
    for entry in named:
        name, key = parse_named_key(entry)
        table.append((name, key.encode()))
    seen: dict[bytes, str | None] = {}
    for name, key in table:
        if key in seen:
            which = [f"{n!r}" if n else "--api-key" for n in (seen[key], name)]
            raise ValueError(f"one key is configured twice ({' and '.join(which)}): each key must be unique")
        seen[key] = name
    return table


def named_tenants(named: list[str]) -> set[str]:
    return {parse_named_key(entry)[0] for entry in named}


def parse_priority_floors(text: str | None) -> dict[str, int]:
    """`--tenant-priority-floor alice=-5,bob=-1` -> {"alice": -5, "bob": -1}; ValueError naming a bad
    entry. A tenant not named has the floor 0."""
    floors: dict[str, int] = {}
    for entry, name, value in name_values(text):
        try:
            floor = int(value) if value is not None else None
        except ValueError:
            floor = None
        if floor is None or not TENANT_NAME.fullmatch(name) or name == OTHER_TENANT:
            raise ValueError(
                f"tenant priority floors are NAME=PRIORITY (an integer; NAME a tenant's name, `default` "
                f"for requests with none), comma-separated: {entry!r}"
            )
        floors[name] = floor
    return floors


def check_tenant_header(header: str | None) -> None:
    if header is None:
        return
    if not _HEADER_NAME.fullmatch(header):
        raise ValueError(f"--tenant-header {header!r} is not a header's name")
    if header.lower() in CREDENTIAL_HEADERS:
        raise ValueError(f"--tenant-header may not be {header!r}: that header carries credentials")


def tenant_of(scope: dict, header: str | None, reserved: frozenset[str] | set[str] = RESERVED) -> str | None:
    """The tenant of an HTTP request (its ASGI scope), or None for the default one; 400 for a header
    value that is not a tenant name, or names one of the `reserved` tenants (named keys' and the
    engine's own)."""
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
            if text in reserved:
                raise APIError(400, f"the {header} header may not name the tenant {text!r}: it is reserved")
            return text
    return None
