"""A StructuredOutputs spec as an llguidance grammar definition (text the matcher compiles).

JSON layout: exactly `", "` between items and `": "` between a key and its value, and no other
whitespace anywhere, so one value has one spelling. That is json.dumps' default layout, the most common
in training data, so a small model's likely tokens (`": "`, `", "`) stay allowed; with no free-form
whitespace it cannot loop on blanks or newlines, and once the top-level value closes only EOS is
allowed (no trailing whitespace). The options are overrides, not defaults, so a schema's own
"x-guidance" key cannot bring back free whitespace or `lenient` (which ignores keywords the engine
cannot enforce instead of refusing the schema). Strings take characters as they are: the engine's
default allows "\\u" escapes only for control characters, so a string has one spelling too and no
lone surrogate halves can come out."""

from __future__ import annotations

import json

import llguidance

from tokenmill.sampling_params import StructuredOutputs
from tokenmill.structured.errors import GrammarError, one_line

JSON_LAYOUT: dict[str, bool | str] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}
MAX_CHOICES = 2000  # llguidance refuses a longer alternative anyway ("row has N items; max is 2000")

ANY_OBJECT_SCHEMA = '{"type": "object"}'

# What each kind's errors are called in messages.
WHAT = {
    "json": "invalid JSON schema",
    "json_object": "invalid JSON object grammar",
    "regex": "invalid regex",
    "choice": "invalid choice",
    "grammar": "invalid grammar",
}


def spec_key(spec: StructuredOutputs) -> tuple[str, str | tuple[str, ...]]:
    """A hashable identity of the spec (the compiled-grammar cache key)."""
    kind = _kind(spec)
    if kind == "json_object":
        return kind, ""
    value = getattr(spec, kind)
    if kind == "choice":
        if not isinstance(value, list | tuple) or not all(isinstance(c, str) for c in value):
            raise GrammarError("invalid choice: must be a list of strings")
        return kind, tuple(value)
    if not isinstance(value, str):  # plain data: a dict where JSON text belongs, say
        raise GrammarError(f"{WHAT[kind]}: must be a string, got {type(value).__name__}")
    return kind, value


def grammar_of(spec: StructuredOutputs) -> str:
    """The llguidance grammar for the spec; GrammarError for what can be told without compiling."""
    kind = _kind(spec)
    if kind == "json":
        return _json_grammar(spec.json or "")
    if kind == "json_object":
        return _json_grammar(ANY_OBJECT_SCHEMA)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex or "")
    if kind == "choice":
        choices = spec.choice or []
        if not choices:
            raise GrammarError("invalid choice: the list of choices is empty")
        if not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("invalid choice: every choice must be a non-empty string")
        if len(choices) > MAX_CHOICES:
            # 100,000 choices took llguidance 58 s of the API process's CPU to refuse with a panic.
            raise GrammarError(f"invalid choice: {len(choices)} choices; at most {MAX_CHOICES} are accepted")
        return llguidance.grammar_from("choice", json.dumps(choices))
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar or "")


def _kind(spec: StructuredOutputs) -> str:
    # StructuredOutputs validates itself on construction, but it is plain mutable data: check again.
    # Set means not None (not False for json_object): an empty choice list or regex gets its own message.
    kinds = [k for k in WHAT if getattr(spec, k, None) not in (None, False)]
    if len(kinds) != 1:
        raise GrammarError(f"structured output needs exactly one of {', '.join(WHAT)}; got {kinds or 'none'}")
    return kinds[0]


def _json_grammar(schema_text: str) -> str:
    # Parsed here first so that bad JSON gets a message about the user's text, not positions in the
    # wrapper the engine builds around it.
    try:
        schema = json.loads(schema_text)
    except (json.JSONDecodeError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: not valid JSON: {e}") from None
    if schema is False:
        raise GrammarError("invalid JSON schema: `false` allows no value")
    if schema is True:
        schema_text = "{}"  # any value; the engine applies layout options to object schemas only
    elif not isinstance(schema, dict):
        kind = type(schema).__name__
        raise GrammarError(f"invalid JSON schema: must be an object or a boolean, got {kind}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema_text, overrides=JSON_LAYOUT)
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {one_line(str(e))}") from None
