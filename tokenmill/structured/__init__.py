"""Structured output: a request's output constrained to a JSON schema, any JSON object, a regex, a list
of choices or a Lark grammar, by masking the tokens the grammar forbids at each position.

The server calls GrammarBackend.check() to refuse bad specs up front (GrammarError -> HTTP 400); the
worker holds one GrammarMatcher per request, fills a bitmask row per position before sampling
(apply_bitmask then sets forbidden logits to -inf) and advances the matcher on what was sampled."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tokenmill.structured.backend import GrammarBackend
from tokenmill.structured.errors import GrammarError

if TYPE_CHECKING:
    from tokenmill.structured.bitmask import allocate_bitmask, apply_bitmask
    from tokenmill.structured.matcher import GrammarMatcher

__all__ = ["GrammarBackend", "GrammarError", "GrammarMatcher", "allocate_bitmask", "apply_bitmask"]

# The worker's side (torch tensors) is imported on first use, so that the API server, which only
# checks specs, never imports torch.
_LAZY = {
    "GrammarMatcher": "tokenmill.structured.matcher",
    "allocate_bitmask": "tokenmill.structured.bitmask",
    "apply_bitmask": "tokenmill.structured.bitmask",
}


def __getattr__(name: str) -> Any:  # noqa: ANN401
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
