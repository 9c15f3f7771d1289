"""The frameworks people build with, unchanged, against the real server with the embedded model: the
OpenAI Agents SDK (on the Responses model and on the chat-completions model), langchain-openai (chat
completions and `use_responses_api`) and instructor (JSON-schema and tools modes). Each answer is
checked against a reference: the same request through the plain `openai` client, or the schema."""

from __future__ import annotations

import asyncio

import instructor
import openai
import pydantic
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from server_fixture import running_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"


class City(pydantic.BaseModel):
    # Bounded, closed: the tiny model's strings would otherwise run to the token limit.
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)


@pytest.fixture(scope="module")
def server():
    with running_server("--max-num-seqs", "8") as proc:
        yield proc


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return f"{server.base_url}/v1"


def test_agents_sdk_runs_a_tool_on_both_models(base_url: str) -> None:
    set_tracing_disabled(True)
    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    async def run(model_cls: type) -> str:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        agent = Agent(
            name="weather",
            instructions="Answer with the tool's result.",
            tools=[get_weather],
            model=model_cls(MODEL, client),
            model_settings=ModelSettings(temperature=0, tool_choice="required", max_tokens=60),
        )
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        return result.final_output

    on_responses = asyncio.run(run(OpenAIResponsesModel))
    on_chat = asyncio.run(run(OpenAIChatCompletionsModel))
    # The tool ran on each, with arguments the model wrote; the two models are the same conversation,
    # sent through two APIs, so they end in the same answer.
    assert len(called) == 2 and called[0] == called[1] and called[0]
    assert on_responses == on_chat and on_responses


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_langchain(base_url: str, responses_api: bool) -> None:
    llm = ChatOpenAI(
        model=MODEL,
        base_url=base_url,
        api_key="unused",
        temperature=0,
        max_tokens=40,
        use_responses_api=responses_api,
        max_retries=0,
    )
    reference = openai.OpenAI(base_url=base_url, api_key="unused").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=40
    )
    answer = llm.invoke(QUESTION)
    assert answer.text == reference.choices[0].message.content
    assert "".join(chunk.text for chunk in llm.stream(QUESTION)) == answer.text

    @tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return "sunny"

    called = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True).invoke("Weather in Paris?")
    assert [c["name"] for c in called.tool_calls] == ["get_weather"]
    assert isinstance(called.tool_calls[0]["args"]["city"], str)
    history = [
        HumanMessage("Weather in Paris?"),
        called,
        ToolMessage("sunny", tool_call_id=called.tool_calls[0]["id"]),
    ]
    assert isinstance(llm.bind_tools([get_weather]).invoke(history).text, str)
    for method in ("function_calling", "json_schema"):
        city = llm.with_structured_output(City, method=method, strict=True).invoke("Name a city in Italy.")
        assert isinstance(city, City), method


@pytest.mark.parametrize(
    "mode", [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS], ids=["json_schema", "tools"]
)
def test_instructor(base_url: str, mode: instructor.Mode) -> None:
    client = instructor.from_openai(
        openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0), mode=mode
    )
    city = client.chat.completions.create(
        model=MODEL,
        response_model=City,
        messages=[{"role": "user", "content": "Name a city in Italy."}],
        temperature=0,
        max_tokens=60,
        max_retries=0,
    )
    assert isinstance(city, City) and city.name
