"""Tool calling without a model: the plan a request's tool fields make, the constraint schemas, the
prompt rendering for templates with and without tools, and the parsers on hand-written model texts
(streamed piece by piece they must give exactly what the whole text gives)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import tokenizers

from tokenmill.server.openai_protocol import RequestFieldError
from tokenmill.server.tool_calls import (
    CALL_CLOSE,
    CALL_OPEN,
    ArrayParser,
    HermesParser,
    NamedParser,
    ParsedDelta,
    ToolCallParser,
    finish_reason,
    hermes_messages,
    parse_complete,
    plan_tools,
    template_messages,
)
from tokenmill.tokenizer.chat_template import DEFAULT_CHAT_TEMPLATE, render_chat_template
from tokenmill.tokenizer.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
TOOLS = [WEATHER, TIME]
NAMES = {"get_weather", "get_time"}


# -- the plan ---------------------------------------------------------------------------------------------


def test_plan_modes_and_defaults() -> None:
    assert plan_tools(None, None) is None
    assert plan_tools([], "auto") is None and plan_tools(None, "none") is None
    plan = plan_tools(TOOLS, None)
    assert (
        plan is not None
        and plan.mode == "auto"
        and plan.parallel
        and plan.names == ["get_weather", "get_time"]
    )
    assert plan_tools(TOOLS, "required").mode == "required"  # type: ignore[union-attr]
    none = plan_tools(TOOLS, "none")
    assert (
        none is not None
        and none.prompt_tools() is None
        and none.parser() is None
        and none.constraint() is None
    )
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False)
    assert named is not None and (named.mode, named.name, named.parallel) == ("named", "get_time", False)


@pytest.mark.parametrize(
    ("tools", "choice", "param", "words"),
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "'nope'"),
        (None, "required", "tool_choice", "no tools"),
        (None, {"type": "function", "function": {"name": "get_time"}}, "tool_choice", "no tools"),
        ([WEATHER, WEATHER], "auto", "tools", "unique"),
    ],
)
def test_plan_errors_name_the_field(tools: Any, choice: Any, param: str, words: str) -> None:
    with pytest.raises(RequestFieldError, match=words) as e:
        plan_tools(tools, choice)
    assert e.value.param == param


def test_required_constraint_is_an_array_of_calls() -> None:
    for parallel, most in ((True, None), (False, 1)):
        plan = plan_tools(TOOLS, "required", parallel)
        assert plan is not None
        spec = plan.constraint()
        assert spec is not None and spec.json is not None
        schema = json.loads(spec.json)
        assert schema["minItems"] == 1 and schema.get("maxItems") == most
        good = [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]
        jsonschema.validate(good[:1], schema)
        if parallel:
            jsonschema.validate(good, schema)
        bad = [
            [],
            [{"name": "get_weather", "arguments": {"town": "Oslo"}}],  # not its parameters
            [{"name": "other", "arguments": {}}],
            [{"arguments": {}, "name": "get_time", "extra": 1}],
        ]
        for value in bad:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(value, schema)
        # `name` before `arguments` in every alternative: the parser relies on that order.
        assert all(list(alt["properties"]) == ["name", "arguments"] for alt in schema["items"]["anyOf"])


def test_named_constraint_is_the_parameters() -> None:
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert plan is not None and json.loads(plan.constraint().json) == WEATHER["function"]["parameters"]  # type: ignore[union-attr,arg-type]
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert json.loads(plan.constraint().json) == {"type": "object", "properties": {}}  # type: ignore[union-attr,arg-type]


def test_finish_reason() -> None:
    assert finish_reason("stop", 1) == "tool_calls"
    assert finish_reason("length", 2) == "length"
    assert finish_reason("stop", 0) == "stop"


# -- the prompt -------------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]


def test_hermes_messages_put_tools_calls_and_results_in_text() -> None:
    out = hermes_messages(CONVERSATION, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n") and "<tools>" in system and "</tools>" in system
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == TOOLS
    blocks = out[2]["content"].split(CALL_CLOSE)
    calls = [json.loads(b.split(CALL_OPEN)[1]) for b in blocks if CALL_OPEN in b]
    assert calls == [
        {"name": "get_weather", "arguments": {"city": "Oslo"}},
        {"name": "get_weather", "arguments": {"city": "Rome"}},
    ]
    results = out[3]["content"]
    assert results.count("<tool_response>") == 2  # one user turn for both results
    assert '{"name": "get_weather", "content": {"temp": 3}}' in results
    assert '{"name": "get_weather", "content": "sunny"}' in results
    assert all("tool_calls" not in m and "tool_call_id" not in m for m in out)


def test_hermes_messages_without_system_or_tools() -> None:
    out = hermes_messages([{"role": "user", "content": "hi"}], [WEATHER])
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"] and out[1]["content"] == "hi"
    # No tools (tool_choice none): earlier calls are still written out, no system message is added.
    out = hermes_messages(CONVERSATION[1:], None)
    assert out[0]["role"] == "user" and CALL_OPEN in out[1]["content"]


def test_chatml_renders_the_hermes_conversation() -> None:
    plan = plan_tools(TOOLS, "auto")
    messages, tools = template_messages(CONVERSATION, plan, template_has_tools=False)
    assert tools is None
    text = render_chat_template(DEFAULT_CHAT_TEMPLATE, messages, add_generation_prompt=True)
    assert "<tools>" in text and "<tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    assert text.count("<|im_start|>") == 5


def test_tool_aware_template_gets_tools_and_argument_objects() -> None:
    plan = plan_tools(TOOLS, "auto")
    messages, tools = template_messages(CONVERSATION, plan, template_has_tools=True)
    assert tools == TOOLS
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[3] == CONVERSATION[3]
    none = plan_tools(TOOLS, "none")
    assert template_messages(CONVERSATION, none, template_has_tools=True)[1] is None


def _tokenizer(template: str) -> Tokenizer:
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"<unk>": 0, "<|im_end|>": 1}, unk_token="<unk>")
    )
    return Tokenizer(backend, {"chat_template": template, "eos_token": "<|im_end|>"})


def test_tokenizer_knows_whether_its_template_lists_tools() -> None:
    assert not _tokenizer(DEFAULT_CHAT_TEMPLATE).supports_tools
    lists = "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}" + DEFAULT_CHAT_TEMPLATE
    assert _tokenizer(lists).supports_tools
    assert not _tokenizer("{{ raise_exception('no tools') if tools else '' }}").supports_tools


# -- parsing ----------------------------------------------------------------------------------------------


def _streamed(parser: ToolCallParser, text: str, step: int = 1) -> tuple[str | None, list[dict], list[str]]:
    """The text fed `step` characters at a time, assembled the way a client assembles a stream; also the
    content pieces as they were released."""
    parsed, pieces = ParsedDelta(), []
    for i in range(0, len(text), step):
        delta = parser.feed(text[i : i + step])
        pieces.append(delta.content)
        parsed.extend(delta)
    end = parser.finish()
    pieces.append(end.content)
    parsed.extend(end)
    calls: dict[int, dict] = {}
    for f in parsed.calls:
        if f.id is not None:
            assert (
                f.index not in calls and f.arguments == ""
            )  # a call's first fragment: id, name, no arguments
            calls[f.index] = {"id": f.id, "type": "function", "function": {"name": f.name, "arguments": ""}}
        calls[f.index]["function"]["arguments"] += f.arguments
    content: str | None = parsed.content
    if calls and not content.strip():
        content = None
    return content, [calls[i] for i in sorted(calls)], [p for p in pieces if p]


def _same_both_ways(make, text: str) -> tuple[str | None, list[dict], list[str]]:
    whole_content, whole_calls = parse_complete(make(), text)
    for step in (1, 2, 5, 1000):
        content, calls, pieces = _streamed(make(), text, step)
        assert content == whole_content
        assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
    return _streamed(make(), text)


def _functions(calls: list[dict]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


HERMES_CASES: list[tuple[str, str | None, list[tuple[str, Any]]]] = [
    ("Just text, a < b and <tool or <tool_cal.", "Just text, a < b and <tool or <tool_cal.", []),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        None,
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
        "Let me check.",
        [("get_weather", {"city": "Oslo"}), ("get_time", {})],
    ),
    (  # "parameters" for "arguments", and no closing tag before the output ends
        '<tool_call>{"name": "get_time", "parameters": {"tz": "UTC"}}',
        None,
        [("get_time", {"tz": "UTC"})],
    ),
    (  # not JSON, and an unknown tool: they stay text, as written
        'A <tool_call>{"name": oops}</tool_call> B <tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        'A <tool_call>{"name": oops}</tool_call> B <tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        [],
    ),
    ('text then <tool_call>{"name": "get_ti', 'text then <tool_call>{"name": "get_ti', []),  # cut off
    (  # text after a call
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\nDone, see above.',
        "Done, see above.",
        [("get_time", {})],
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_parser(text: str, content: str | None, calls: list) -> None:
    got_content, got_calls, pieces = _same_both_ways(lambda: HermesParser(NAMES), text)
    assert got_content == content and _functions(got_calls) == calls
    assert all(c["id"].startswith("call_") for c in got_calls)
    if calls:  # pieces of a tag never reach the content, even fed one character at a time
        assert not any(p.endswith(CALL_OPEN[:n]) for p in pieces for n in range(2, len(CALL_OPEN) + 1))


def test_hermes_parser_one_call_when_not_parallel() -> None:
    text = "".join(
        f'<tool_call>{{"name": "get_time", "arguments": {{"n": {i}}}}}</tool_call>' for i in range(3)
    )
    content, calls = parse_complete(HermesParser(NAMES, parallel=False), text)
    assert content is None and _functions(calls) == [("get_time", {"n": 0})]


def test_hermes_arguments_keep_unicode_and_string_arguments() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>'
    _, calls = parse_complete(HermesParser(NAMES), text)
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich"}'
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    _, calls = parse_complete(HermesParser(NAMES), text)
    assert calls[0]["function"]["arguments"] == '{"city": "Oslo"}'


ARRAY_CASES: list[tuple[str, list[tuple[str, Any]]]] = [
    (
        '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]',
        [("get_weather", {"city": "Oslo", "unit": "c"})],
    ),
    (
        '[{"name": "get_weather", "arguments": {"city": "a \\" } ] { ,"}}, '
        '{"name": "get_time", "arguments": {}}]',
        [("get_weather", {"city": 'a " } ] { ,'}), ("get_time", {})],
    ),
    (
        '[{"arguments": {"x": [1, {"y": 2}]}, "name": "get_time"}]',
        [("get_time", {"x": [1, {"y": 2}]})],
    ),  # other order
    ('[{"name":"get_time","arguments":{"deep":{"a":[{}]}}}]', [("get_time", {"deep": {"a": [{}]}})]),
]


@pytest.mark.parametrize(("text", "calls"), ARRAY_CASES)
def test_array_parser(text: str, calls: list) -> None:
    content, got, _ = _same_both_ways(lambda: ArrayParser(NAMES), text)
    assert content is None and _functions(got) == calls


def test_array_parser_streams_arguments_as_they_grow() -> None:
    parser = ArrayParser(NAMES)
    first = parser.feed('[{"name": "get_weather", "arguments": {"ci')
    assert first.calls[0].name == "get_weather" and first.calls[0].arguments == ""
    assert "".join(f.arguments for f in first.calls) == '{"ci'
    more = parser.feed('ty": "Oslo"}}, {"name": "get_ti')
    assert "".join(f.arguments for f in more.calls) == 'ty": "Oslo"}'
    assert not parser.finish().content  # a truncated second element: no content, the first call stands


def test_array_parser_gives_back_text_without_calls() -> None:
    for text in ("I cannot do that.", '[{"name": "unknown", "arguments": {}}]', '[{"name": "get_wea'):
        content, calls = parse_complete(ArrayParser(NAMES), text)
        assert content == text and calls == []


def test_named_parser_output_is_the_arguments() -> None:
    content, calls, _ = _same_both_ways(lambda: NamedParser("get_weather"), '{"city": "Oslo"}')
    assert content is None and _functions(calls) == [("get_weather", {"city": "Oslo"})]
    assert parse_complete(NamedParser("get_weather"), "") == ("", [])


def test_deltas_are_openai_chunk_deltas() -> None:
    parsed = ParsedDelta()
    parser = HermesParser(NAMES)
    parsed.extend(parser.feed('Hi <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'))
    parsed.extend(parser.finish())
    deltas = parsed.deltas()
    assert deltas[0] == {"content": "Hi"}
    first = deltas[1]["tool_calls"][0]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "get_time", "arguments": ""}
    assert deltas[2] == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
