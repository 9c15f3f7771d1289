"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) against the real server with the
embedded model, driven by the official `anthropic` client. The reference for every reply is the same
conversation sent as an OpenAI chat completion (itself checked against transformers), greedy."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from server_fixture import running_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
KEY = "key-m"
GREEDY = {"temperature": 0}  # this SDK has no temperature argument: it goes in the body as is
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    }
]


@pytest.fixture(scope="module")
def server():
    with running_server("--max-num-seqs", "8", api_key=KEY) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)


def test_message_equals_chat_completion(client: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    m = client.messages.create(
        model=MODEL,
        max_tokens=24,
        system="Answer briefly.",
        extra_body=GREEDY,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a primary color."}]}],
    )
    chat = oai.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=24,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a primary color."},
        ],
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    expected = {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert m.stop_reason == expected and m.stop_sequence is None
    usage = m.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens


def test_stream_events_build_the_same_message(client: anthropic.Anthropic) -> None:
    kw = {
        "model": MODEL,
        "max_tokens": 30,
        "extra_body": GREEDY,
        "messages": [{"role": "user", "content": "Hi!"}],
    }
    whole = client.messages.create(**kw)
    events = list(client.messages.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with client.messages.stream(**kw) as stream:
        assert "".join(stream.text_stream) == whole.content[0].text
        assert stream.get_final_message().content[0].text == whole.content[0].text


def test_stop_sequence(client: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    ref = (
        oai.chat.completions.create(
            model=MODEL,
            temperature=0,
            max_tokens=30,
            messages=[{"role": "user", "content": "Count from 1 to 9."}],
        )
        .choices[0]
        .message.content
    )
    stop = ref.split()[2]  # a word the greedy reply is known to write
    m = client.messages.create(
        model=MODEL,
        max_tokens=30,
        stop_sequences=[stop],
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Count from 1 to 9."}],
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == ref[: ref.index(stop)]


def test_tool_use_round_trip(client: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    m = client.messages.create(
        model=MODEL,
        max_tokens=60,
        tools=TOOLS,
        tool_choice={"type": "any"},
        extra_body=GREEDY,
        messages=[question],
    )
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses
    for u in uses:
        assert u.id.startswith("toolu_") and u.name == "get_weather"
        jsonschema.validate(u.input, WEATHER)
    chat = oai.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=60,
        tools=CHAT_TOOLS,
        tool_choice="required",
        messages=[question],
    )
    assert [json.loads(c.function.arguments) for c in chat.choices[0].message.tool_calls] == [
        u.input for u in uses
    ]
    # The results go back as tool_result blocks; the reply equals chat with tool messages.
    follow = client.messages.create(
        model=MODEL,
        max_tokens=24,
        tools=TOOLS,
        extra_body=GREEDY,
        messages=[
            question,
            {
                "role": "assistant",
                "content": [
                    u.model_dump(exclude_none=True, include={"type", "id", "name", "input"}) for u in uses
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "sunny"} for u in uses],
            },
        ],
    )
    calls = [
        {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}}
        for u in uses
    ]
    ref = (
        oai.chat.completions.create(
            model=MODEL,
            temperature=0,
            max_tokens=24,
            tools=CHAT_TOOLS,
            messages=[
                question,
                {"role": "assistant", "content": "", "tool_calls": calls},
                *({"role": "tool", "tool_call_id": u.id, "content": "sunny"} for u in uses),
            ],
        )
        .choices[0]
        .message
    )
    assert "".join(b.text for b in follow.content if b.type == "text") == (ref.content or "")


def test_streamed_tool_use_input(client: anthropic.Anthropic) -> None:
    events = list(
        client.messages.create(
            model=MODEL,
            max_tokens=40,
            tools=TOOLS,
            tool_choice={"type": "tool", "name": "get_weather"},
            extra_body=GREEDY,
            stream=True,
            messages=[{"role": "user", "content": "Weather in Rome?"}],
        )
    )
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"] and starts[0].content_block.input == {}
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    jsonschema.validate(json.loads(partial), WEATHER)
    assert events[-2].delta.stop_reason == "tool_use"


def test_structured_output(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    m = client.messages.create(
        model=MODEL,
        max_tokens=30,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Give a number."}],
    )
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_prefill_continues_the_assistant_turn(client: anthropic.Anthropic) -> None:
    m = client.messages.create(
        model=MODEL,
        max_tokens=8,
        extra_body=GREEDY,
        messages=[
            {"role": "user", "content": "Name a primary color."},
            {"role": "assistant", "content": "The color"},
        ],
    )
    plain = client.messages.create(
        model=MODEL,
        max_tokens=8,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Name a primary color."}],
    )
    assert m.content[0].text and not m.content[0].text.startswith("The color")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > plain.usage.input_tokens


def test_count_tokens_equals_tokenize(client: anthropic.Anthropic, server) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages, tools=TOOLS)
    ref = httpx.post(
        f"{server.base_url}/tokenize",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"messages": [{"role": "system", "content": "Be brief."}, *messages], "tools": CHAT_TOOLS},
    ).json()
    assert counted.input_tokens == ref["count"]


def test_errors_in_anthropic_shape(client: anthropic.Anthropic, server) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=MODEL,
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}],
                }
            ],
        )
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "toolu_x" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-9", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    for body, needle in [
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            "'image' are not supported",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "server tools",
        ),
    ]:
        r = httpx.post(f"{server.base_url}/v1/messages", json=body, headers=headers)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert needle in r.json()["error"]["message"]
    r = httpx.get(f"{server.base_url}/v1/messages/nope", headers=headers)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
