"""A reasoning parser on the real server: reasoning reaches each API in its own shape (chat's
`reasoning_content`, a Responses reasoning item, a Messages thinking block), streamed and not.

The embedded model does not think, so under `--reasoning-parser deepseek_r1` (whose template opens the
reasoning in the prompt) its whole reply is reasoning that never closes: the reference is the same
request's text from the offline engine, float32, greedy."""

from __future__ import annotations

import anthropic
import openai
import pytest
from server_fixture import running_server

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "Name a primary color."}]


@pytest.fixture(scope="module")
def server():
    with running_server("--dtype", "float32", "--reasoning-parser", "deepseek_r1") as proc:
        yield proc


@pytest.fixture(scope="module")
def reference(llm_fp32: LLM) -> str:
    return llm_fp32.chat(CHAT, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text


def test_chat_reasoning_content(server, reference: str) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24)
    message = r.choices[0].message
    assert message.reasoning_content == reference and not message.content  # type: ignore[attr-defined]
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24, stream=True)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reference
    assert not "".join(d.content or "" for d in deltas)
    # Constrained output holds no reasoning: it is constrained from its first token.
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
        "additionalProperties": False}}}]  # fmt: skip
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=tools, tool_choice="required", temperature=0, max_tokens=40
    )
    assert r.choices[0].message.tool_calls[0].function.name == "pick"


def test_responses_reasoning_item(server, reference: str) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    r = client.responses.create(model=MODEL, input=CHAT, temperature=0, max_output_tokens=24)
    assert [o.type for o in r.output] == ["reasoning"] and r.output[0].content[0].text == reference
    events = list(
        client.responses.create(model=MODEL, input=CHAT, temperature=0, max_output_tokens=24, stream=True)
    )
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e.text for e in events if e.type == "response.reasoning_text.done"]
    assert streamed == reference and done == [reference]


def test_messages_thinking_block(server, reference: str) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    m = client.messages.create(model=MODEL, max_tokens=24, messages=CHAT, extra_body={"temperature": 0})
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking == reference
    with client.messages.stream(
        model=MODEL, max_tokens=24, messages=CHAT, extra_body={"temperature": 0}
    ) as s:
        final = s.get_final_message()
    assert final.content[0].thinking == reference
