"""Tool-call parsers per model family and reasoning parsers, on replies as each family writes them, fed
whole, token by token (the embedded tokenizer's tokens) and cut in two at every character: the pieces
must add up to the same content, reasoning and calls as the whole, and to what the format says."""

from __future__ import annotations

import json

import pytest

from tokenmill.server.reasoning import DeepSeekR1Parser, Qwen3Parser, ReplyParser, reasoning_parser
from tokenmill.server.tool_calls import CallFragment, ParsedDelta, ToolCallParser
from tokenmill.server.tool_parsers import make_parser, tool_format

NAMES = {"get_weather", "get_time"}
PARIS = {"city": "Paris", "unit": "celsius"}


def assemble(parts: list[ParsedDelta]) -> tuple[str, str, list[tuple[str, dict]]]:
    """(reasoning, content, [(name, arguments)]) from a stream of deltas; fragments joined by index."""
    reasoning = "".join(p.reasoning for p in parts)
    content = "".join(p.content for p in parts)
    calls: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for p in parts:
        for f in p.calls:
            assert isinstance(f, CallFragment)
            if f.id is not None:
                assert f.index not in names, "a call's header came twice"
                names[f.index] = f.name  # type: ignore[assignment]
            calls.setdefault(f.index, []).append(f.arguments)
    return reasoning, content, [(names[i], json.loads("".join(calls[i]))) for i in sorted(calls)]


def run(make, pieces: list[str]) -> tuple[str, str, list[tuple[str, dict]]]:
    parser: ToolCallParser = make()
    parts = [parser.feed(p) for p in pieces]
    parts.append(parser.finish())
    return assemble(parts)


def every_way(make, text: str, tokenizer) -> tuple[str, str, list[tuple[str, dict]]]:
    """The parse of `text` whole; asserts that token by token and every two-piece cut agree."""
    whole = run(make, [text])
    ids = tokenizer.encode(text, add_special_tokens=False)
    tokens, prev = [], ""
    for i in range(1, len(ids) + 1):  # the text each token adds, as the detokenizer hands it out
        now = tokenizer.decode(ids[:i], skip_special_tokens=False)
        tokens.append(now[len(prev) :])
        prev = now
    assert "".join(tokens) == text
    assert run(make, tokens) == whole, "token by token"
    for cut in range(1, len(text)):
        assert run(make, [text[:cut], text[cut:]]) == whole, f"cut at {cut}"
    return whole


@pytest.fixture(scope="module")
def tokenizer(llm_fp32):
    return llm_fp32.tokenizer


CASES = [
    # (format, reply as the family writes it, expected content, expected calls)
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me check.",
        [("get_weather", PARIS), ("get_time", {})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {}}<|eom_id|>',
        "",
        [("get_weather", PARIS), ("get_time", {})],
    ),
    (
        "llama3_json",
        '{"name": "get_time", "parameters": {"zone": "UTC"}}',
        "",
        [("get_time", {"zone": "UTC"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {}}]</s>',
        "",
        [("get_weather", PARIS), ("get_time", {})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        [("get_weather", PARIS), ("get_time", {})],
    ),
    (
        "pythonic",
        "[get_weather(city='Paris', unit='celsius'), get_time()]",
        "",
        [("get_weather", PARIS), ("get_time", {})],
    ),
    (
        "pythonic",
        '<|python_start|>[get_time(zone="UTC", utc=True, offsets=[1, 2])]<|python_end|>',
        "",
        [("get_time", {"zone": "UTC", "utc": True, "offsets": [1, 2]})],
    ),
    # Replies that are not calls go out as written.
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    (
        "llama3_json",
        '{"name": "unknown_tool", "parameters": {}}',
        '{"name": "unknown_tool", "parameters": {}}',
        [],
    ),
    ("mistral", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("pythonic", "[not a call]", "[not a call]", []),
    ("pythonic", "[get_time(__import__('os'))]", "[get_time(__import__('os'))]", []),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_tool_parsers_stream_as_they_parse(tokenizer, fmt: str, text: str, content: str, calls: list) -> None:
    reasoning, got_content, got_calls = every_way(lambda: make_parser(fmt, NAMES, True), text, tokenizer)
    assert reasoning == "" and got_content == content and got_calls == calls


def test_one_call_when_parallel_calls_are_off() -> None:
    text = "[get_weather(city='Paris'), get_time()]"
    _, _, calls = run(lambda: make_parser("pythonic", NAMES, False), [text])
    assert calls == [("get_weather", {"city": "Paris"})]


REASONING_CASES = [
    # (parser, reply, reasoning, content)
    (
        DeepSeekR1Parser,
        "The user greets me.\nI answer.\n</think>\n\nHello!",
        "The user greets me.\nI answer.\n",
        "Hello!",
    ),
    (DeepSeekR1Parser, "<think>\nShort.</think>Hi", "\nShort.", "Hi"),
    (
        DeepSeekR1Parser,
        "Still thinking when the tokens ran out",
        "Still thinking when the tokens ran out",
        "",
    ),
    (Qwen3Parser, "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "Paris."),
    (Qwen3Parser, "Paris.", "", "Paris."),
    (Qwen3Parser, "<thinking is not the tag", "", "<thinking is not the tag"),
]


@pytest.mark.parametrize(("cls", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_parsers(tokenizer, cls, text: str, reasoning: str, content: str) -> None:
    got = every_way(lambda: ReplyParser(cls(), None), text, tokenizer)
    assert got == (reasoning, content, [])


def test_calls_are_looked_for_in_the_answer_only(tokenizer) -> None:
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    text = f"<think>\nMaybe {call} would help.\n</think>\n\nSure.\n{call}"
    got = every_way(lambda: ReplyParser(Qwen3Parser(), make_parser("hermes", NAMES, True)), text, tokenizer)
    assert got == (f"\nMaybe {call} would help.\n", "Sure.", [("get_time", {})])


def test_the_format_comes_from_the_chat_template() -> None:
    assert tool_format("auto", "{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert tool_format("auto", "{{ '[TOOL_CALLS]' }}") == "mistral"
    assert tool_format("auto", "{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert tool_format("auto", "<|python_start|>") == "pythonic"
    assert tool_format("auto", "{{ messages }}") == tool_format("auto", None) == "hermes"
    assert tool_format("mistral", "<tool_call>") == "mistral"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_format("gpt5", None)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser("o3")
