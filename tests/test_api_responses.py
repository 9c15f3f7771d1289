"""The Responses API (/v1/responses) against the real server with the embedded model, driven only by the
official `openai` client. The reference for every reply is the same conversation sent as a chat
completion (itself checked against transformers in test_server_openai / test_correctness_hf), greedy."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pydantic
import pytest
from server_fixture import running_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
KEYS = ("key-a", "key-b")
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]


@pytest.fixture(scope="module")
def server():
    # float32: the reference is another request on the same server, and in bf16 the same prompt's
    # logits can differ a little from one request to the next (a cached prefix, another batch), so
    # greedy texts can part ways (seen on Sapphire Rapids).
    with running_server("--max-num-seqs", "8", "--dtype", "float32", api_key=",".join(KEYS)) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS[0], max_retries=0)


@pytest.fixture(scope="module")
def other(server) -> openai.OpenAI:
    """A client with the server's other API key: it must see none of the first key's responses."""
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS[1], max_retries=0)


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int, **kw) -> str | None:
    r = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **kw
    )
    return r.choices[0].message.content


def test_text_input_equals_chat_completion(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL,
        input="Name a primary color.",
        instructions="Answer in one word.",
        temperature=0,
        max_output_tokens=24,
    )
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Name a primary color."},
    ]
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat_text(client, messages, 24)
    assert r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Answer in one word." and r.max_output_tokens == 24


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL, input="Tell me a long story.", temperature=0, max_output_tokens=5
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"


def test_item_input_and_previous_response_chain(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "My name is Ada."}]}],
        instructions="Be brief.",
        temperature=0,
        max_output_tokens=16,
    )
    second = client.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=16,
    )
    # The chain carries the input and output, not the first request's instructions.
    messages = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.output_text == chat_text(client, messages, 16)
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_stream_events_build_the_same_response(client: openai.OpenAI) -> None:
    kw = {
        "model": MODEL,
        "input": "What is the capital of France?",
        "temperature": 0,
        "max_output_tokens": 40,
    }
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    order = [k for k in kinds if k != "response.output_text.delta"]
    assert order[2:-1] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens


def test_stream_helper_and_final_response(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=40
    ) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == deltas


def test_function_call_round_trip(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for c in calls:
        assert c.call_id.startswith("call_") and c.id.startswith("fc_")
        jsonschema.validate(json.loads(c.arguments), WEATHER)
    # The same calls as chat completions make for the same conversation.
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=CHAT_TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=60,
    )
    assert [c.function.arguments for c in chat.choices[0].message.tool_calls] == [c.arguments for c in calls]
    # Its output goes back with previous_response_id; the reply equals chat with the tool turn.
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 21 C"} for c in calls]
    follow = client.responses.create(
        model=MODEL,
        previous_response_id=r.id,
        input=outputs,
        tools=TOOLS,
        temperature=0,
        max_output_tokens=24,
    )
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ],
        },
        *({"role": "tool", "tool_call_id": c.call_id, "content": "sunny, 21 C"} for c in calls),
    ]
    ref = (
        client.chat.completions.create(
            model=MODEL, messages=messages, tools=CHAT_TOOLS, temperature=0, max_tokens=24
        )
        .choices[0]
        .message
    )
    got_calls = [o for o in follow.output if o.type == "function_call"]
    assert follow.output_text == (ref.content or "")
    assert [c.arguments for c in got_calls] == [c.function.arguments for c in ref.tool_calls or []]


def test_streamed_function_call_arguments(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL,
            input="Weather in Rome?",
            tools=TOOLS,
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            max_output_tokens=40,
            stream=True,
        )
    )
    added = [e for e in events if e.type == "response.output_item.added"]
    assert len(added) == 1 and added[0].item.type == "function_call" and added[0].item.name == "get_weather"
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done[0].arguments == streamed and events[-1].response.output[0].arguments == streamed
    jsonschema.validate(json.loads(streamed), WEATHER)


class City(pydantic.BaseModel):
    name: str
    country: str


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    r = client.responses.parse(
        model=MODEL, input="Name a city in Italy.", text_format=City, temperature=0, max_output_tokens=60
    )
    assert isinstance(r.output_parsed, City)
    raw = client.responses.create(
        model=MODEL,
        input="Give a JSON object with a field n, a number.",
        temperature=0,
        max_output_tokens=30,
        text={"format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(raw.output_text), dict)


def test_logprobs_included(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL,
        input="Hi!",
        temperature=0,
        max_output_tokens=8,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
    )
    part = r.output[0].content[0]
    assert len(part.logprobs) == r.usage.output_tokens
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)


def test_background_polls_to_the_same_output(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "input": "Name a primary color.", "temperature": 0, "max_output_tokens": 20}
    fg = client.responses.create(**kw)
    bg = client.responses.create(background=True, **kw)
    assert bg.status in ("queued", "in_progress") and bg.background
    deadline = time.monotonic() + 60
    while bg.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
        bg = client.responses.retrieve(bg.id)
    assert bg.status == fg.status and bg.output_text == fg.output_text


def test_background_cancel(client: openai.OpenAI, server) -> None:
    bg = client.responses.create(
        model=MODEL,
        input="Write a long story.",
        background=True,
        max_output_tokens=900,
        extra_body={"ignore_eos": True},
    )
    cancelled = client.responses.cancel(bg.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(bg.id).status == "cancelled"
    # Its admission ticket went back: the server is ready again at once.
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.base_url}/v1/health/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).id)


def test_store_get_delete_and_keys(client: openai.OpenAI, other: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Hi!", temperature=0, max_output_tokens=4)
    items = client.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"]
    # Another key sees nothing of it: not GET, not chaining, not DELETE.
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=MODEL, input="Hi", previous_response_id=r.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(r.id)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=MODEL, input="Hi!", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input": [{"type": "mystery", "x": 1}]}, "type 'mystery' are not supported"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            "no function call",
        ),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "'web_search' are not supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input_image",
        ),
        ({"input": "hi", "background": True, "store": False}, "store=true"),
        ({"input": "hi", "previous_response_id": "resp_nope"}, "not found"),
        ({"input": "hi", "model": "gpt-9"}, "does not exist"),
        ({"input": "hi", "include": ["nonsense"]}, "unknown value"),
    ],
)
def test_bad_input_is_4xx_in_openai_shape(server, body: dict, needle: str) -> None:
    r = httpx.post(
        f"{server.base_url}/v1/responses",
        json={"model": MODEL, **body},
        headers={"Authorization": f"Bearer {KEYS[0]}"},
    )
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert needle in error["message"] and set(error) >= {"message", "type", "param", "code"}


def test_model_retrieve(client: openai.OpenAI) -> None:
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_expired_and_over_the_cap_in_a_small_store() -> None:
    # A store of 64 kB (16 kB per response) whose responses live 2 s.
    with running_server("--responses-store-ttl-s", "2", "--responses-store-mb", "0.0625") as proc:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0)
        r = client.responses.create(model=MODEL, input="Hi!", max_output_tokens=2)
        assert client.responses.retrieve(r.id).id == r.id
        with pytest.raises(openai.BadRequestError, match="over the response store's cap") as e:
            client.responses.create(model=MODEL, input="word " * 4000, max_output_tokens=2)
        assert e.value.body["param"] == "store"
        # Not stored, the same request runs.
        client.responses.create(model=MODEL, input="word " * 400, max_output_tokens=2, store=False)
        time.sleep(2.5)
        with pytest.raises(openai.NotFoundError, match="expired"):
            client.responses.create(
                model=MODEL, input="Again", previous_response_id=r.id, max_output_tokens=1
            )
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r.id)
