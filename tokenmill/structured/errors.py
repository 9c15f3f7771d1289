"""The one error a structured-output spec can raise: the server turns it into an HTTP 400."""

from __future__ import annotations

import re

# Source excerpts the engine appends under a message ("   1 | start: /[a-z/") and caret lines under them.
_EXCERPT = re.compile(r"^\d+ \|")
_CARETS = re.compile(r"^[\^~\s-]*$")
_POSITION = re.compile(r"^(at )?\d+\(\d+\): ")
_MAX_CHARS = 300


class GrammarError(ValueError):
    """A spec that cannot be compiled or enforced; the message is one line naming what is wrong."""


def one_line(message: str, *, drop_position: bool = False) -> str:
    """The engine's (multi-line) message as one short line. `drop_position` removes a leading
    "at LINE(COL): " when it points into a grammar the user never wrote (one generated from a regex)."""
    # A panic's stack (addresses, nothing for a client) and the tag of llguidance's short messages.
    message = message.split("<backtrace>")[0].replace("<non-verbose/>", "")
    kept = [s for s in (line.strip() for line in message.splitlines()) if s]
    text = " ".join(s for s in kept if not _EXCERPT.match(s) and not _CARETS.match(s))
    if drop_position:
        text = _POSITION.sub("", text)
    return text if len(text) <= _MAX_CHARS else text[: _MAX_CHARS - 3] + "..."
