"""Tool-call parsers for the formats model families write when they choose to call (`tool_choice`
auto), chosen with `--tool-call-parser` (tool_calls.py has Hermes', the default, and the constrained
forms of `required` and named choices):

- `hermes` (Hermes, Qwen2.5, Qwen3, QwQ, SmolLM with this server's tool prompt):
  `<tool_call>{...}</tool_call>` blocks in free text.
- `llama3_json` (Llama 3.1 / 3.2): the whole reply is `{"name": ..., "parameters": {...}}`, optionally
  after `<|python_tag|>`, several separated by `;`.
- `mistral` (Mistral 7B v0.3, Mixtral, Mistral Small/Large): `[TOOL_CALLS]` then a JSON array of
  `{"name", "arguments"}`, or (tokenizer v11 and later) `[TOOL_CALLS]name[ARGS]{...}` per call.
- `pythonic` (Llama 3.2 small and Llama 4, ToolACE): the whole reply is a Python list of calls,
  `[f(a=1, b='x'), g()]`, optionally between `<|python_start|>` and `<|python_end|>`.

The three whole-reply formats are held back from the stream while the reply may still be calls, and
parsed when it ends; a reply that turns out not to be calls goes out as content, as written. The tags
are special tokens: these parsers read the text with special tokens kept (openai_serving.py sees to it).
"""

from __future__ import annotations

import ast
import json
from abc import abstractmethod
from typing import Any

from tokenmill.server.tool_calls import (
    NOT_JSON,
    CallFragment,
    HermesParser,
    ParsedDelta,
    ToolCallParser,
    dumps_arguments,
    loads_strict,
)

PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
PY_START, PY_END = "<|python_start|>", "<|python_end|>"
# Special tokens a reply may end with, which are no part of its calls (with special tokens kept).
_TRAILERS = ("<|eom_id|>", "<|eot_id|>", "</s>", PY_END, "<|im_end|>")


class WholeReplyParser(ToolCallParser):
    """A format in which calls are the whole reply: hold the text while it may be calls, parse at
    the end. `looks_like_calls` says whether a beginning can still be calls."""

    def __init__(self, names: set[str], parallel: bool = True) -> None:
        self.names, self.parallel = names, parallel
        self.text = ""
        self.holding: bool | None = None  # None: undecided yet

    def feed(self, text: str) -> ParsedDelta:
        self.text += text
        if self.holding is None:
            head = self.text.lstrip()
            if not head:
                return ParsedDelta()
            verdict = self.looks_like_calls(head)
            if verdict is None:
                return ParsedDelta()
            self.holding = verdict
            if not verdict:
                out, self.text = self.text, ""
                return ParsedDelta(content=out)
            return ParsedDelta()
        if self.holding:
            return ParsedDelta()
        out, self.text = self.text, ""
        return ParsedDelta(content=out)

    def finish(self) -> ParsedDelta:
        text, self.text = self.text, ""
        if not self.holding:
            return ParsedDelta(content=text)
        body = text.strip()
        for trailer in _TRAILERS:
            body = body.removesuffix(trailer).rstrip()
        calls = self.parse(body)
        known = [(n, a) for n, a in calls or [] if n in self.names]
        if not calls or len(known) != len(calls):
            return ParsedDelta(content=text)  # not calls of these tools: the reply as written
        if not self.parallel:
            known = known[:1]
        out = ParsedDelta()
        for name, arguments in known:
            out.calls += [self.header(name), CallFragment(self.calls_made - 1, arguments)]
        return out

    @abstractmethod
    def looks_like_calls(self, head: str) -> bool | None:
        """True if the reply's beginning is calls, False if it is not, None if it cannot tell yet."""

    @abstractmethod
    def parse(self, body: str) -> list[tuple[str, str]] | None:
        """(name, arguments as JSON text) of each call in the reply, or None if it is not calls."""


def _could_start(head: str, *prefixes: str) -> bool | None:
    """True if `head` starts with a prefix, None if it may still become one, False otherwise."""
    for p in prefixes:
        if head.startswith(p):
            return True
    if any(p.startswith(head) for p in prefixes):
        return None
    return False


def _json_calls(values: list[Any], key: str) -> list[tuple[str, str]] | None:
    calls = []
    for v in values:
        if not isinstance(v, dict) or not isinstance(v.get("name"), str):
            return None
        args = v.get(key, v.get("arguments", v.get("parameters", {})))
        if isinstance(args, str):
            try:
                args = loads_strict(args)
            except NOT_JSON:
                return None
        try:
            calls.append((v["name"], dumps_arguments(args)))
        except ValueError:
            return None
    return calls


def _split_json_objects(text: str) -> list[Any] | None:
    """JSON values one after another, separated by `;` or whitespace: the values, or None."""
    decoder = json.JSONDecoder(parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    values, pos = [], 0
    while pos < len(text):
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos >= len(text):
            break
        try:
            value, pos = decoder.raw_decode(text, pos)
        except NOT_JSON:
            return None
        values.append(value)
    return values


class Llama3JsonParser(WholeReplyParser):
    def looks_like_calls(self, head: str) -> bool | None:
        return _could_start(head, PYTHON_TAG, "{")

    def parse(self, body: str) -> list[tuple[str, str]] | None:
        values = _split_json_objects(body.removeprefix(PYTHON_TAG))
        return _json_calls(values, "parameters") if values else None


class MistralParser(WholeReplyParser):
    def looks_like_calls(self, head: str) -> bool | None:
        return _could_start(head, TOOL_CALLS, "[{")

    def parse(self, body: str) -> list[tuple[str, str]] | None:
        if ARGS in body:  # v11: [TOOL_CALLS]name[ARGS]{...} per call
            calls = []
            for part in body.split(TOOL_CALLS):
                if not part.strip():
                    continue
                name, sep, args = part.partition(ARGS)
                if not sep:
                    return None
                try:
                    calls.append((name.strip(), dumps_arguments(loads_strict(args))))
                except NOT_JSON:
                    return None
            return calls
        try:
            value = loads_strict(body.removeprefix(TOOL_CALLS).strip())
        except NOT_JSON:
            return None
        return _json_calls(value if isinstance(value, list) else [value], "arguments")


class PythonicParser(WholeReplyParser):
    def looks_like_calls(self, head: str) -> bool | None:
        return _could_start(head, PY_START, "[")

    def parse(self, body: str) -> list[tuple[str, str]] | None:
        body = body.removeprefix(PY_START).strip()
        try:
            tree = ast.parse(body, mode="eval")
        except (SyntaxError, ValueError, RecursionError):
            return None
        if not isinstance(tree.body, ast.List):
            return None
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:
                args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
                calls.append((node.func.id, dumps_arguments(args)))
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
        return calls


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen3": HermesParser,  # Qwen3's templates ask for Hermes blocks
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}
# Formats whose tags are special tokens: the text must keep them to be parsed.
NEEDS_SPECIAL_TOKENS = {"llama3_json", "mistral", "pythonic"}

_TEMPLATE_MARKS = [
    ("<tool_call>", "hermes"),
    (TOOL_CALLS, "mistral"),
    (PY_START, "pythonic"),
    (PYTHON_TAG, "llama3_json"),
]


def tool_format(name: str, chat_template: str | None) -> str:
    """The parser to use: the one named, or for `auto` the one the chat template's own markup names
    (Hermes when it names none: this server's tool prompt asks for Hermes blocks)."""
    if name != "auto":
        if name not in TOOL_PARSERS:
            choices = ", ".join(["auto", *sorted(TOOL_PARSERS)])
            raise ValueError(f"unknown tool-call parser {name!r}; choose one of {choices}")
        return name
    for mark, fmt in _TEMPLATE_MARKS:
        if chat_template and mark in chat_template:
            return fmt
    return "hermes"


def make_parser(fmt: str, names: set[str], parallel: bool) -> ToolCallParser:
    return TOOL_PARSERS[fmt](names, parallel)  # type: ignore[call-arg]
