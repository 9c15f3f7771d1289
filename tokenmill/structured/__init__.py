"""Structured output: a request's output constrained to a JSON schema, any JSON object, a regex, a list
of choices or a Lark grammar, by masking the tokens the grammar forbids at each position.

The server calls GrammarBackend.check() to refuse bad specs up front (GrammarError -> HTTP 400); the
worker holds one GrammarMatcher per request, fills a bitmask row per position before sampling
(apply_bitmask then sets forbidden logits to -inf) and advances the matcher on what was sampled."""

from tokenmill.structured.backend import GrammarBackend
from tokenmill.structured.bitmask import allocate_bitmask, apply_bitmask
from tokenmill.structured.errors import GrammarError
from tokenmill.structured.matcher import GrammarMatcher

__all__ = ["GrammarBackend", "GrammarError", "GrammarMatcher", "allocate_bitmask", "apply_bitmask"]
