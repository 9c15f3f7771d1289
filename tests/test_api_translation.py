"""The Responses and Messages APIs' translation to chat requests, and the response store's bounds:
units, no server (the protocol itself is tested through the official clients in test_api_responses.py
and test_api_messages.py)."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest

from tokenmill.server.anthropic_protocol import MessagesRequest
from tokenmill.server.anthropic_protocol import to_chat_request as anthropic_to_chat
from tokenmill.server.errors import APIError
from tokenmill.server.openai_protocol import RequestFieldError
from tokenmill.server.response_store import ResponseStore, StoredResponse, owner_of
from tokenmill.server.responses_protocol import ResponsesRequest, items_to_messages, to_chat_request
from tokenmill.server.responses_serving import ResponsesServing


def entry(owner: str = "a", text: str = "x", ttl: float = 60.0) -> StoredResponse:
    response = {"id": "r", "status": "completed", "output": [text]}
    return StoredResponse(owner, response, [], [], time.monotonic() + ttl)


def test_store_bounds_count_bytes_and_age() -> None:
    store = ResponseStore(max_responses=3, max_bytes=10_000, ttl_s=60)
    for i in range(5):
        assert store.put(f"r{i}", entry())
    assert len(store) == 3 and store.get("r0", "a") is None and store.get("r4", "a") is not None
    # Bytes: each of these is ~2 kB, the store holds 10 kB: the oldest go.
    store = ResponseStore(max_responses=100, max_bytes=10_000, ttl_s=60)
    for i in range(10):
        assert store.put(f"r{i}", entry(text="y" * 2000))
    assert store.bytes <= 10_000 and store.get("r9", "a") is not None and store.get("r0", "a") is None
    # One response over a quarter of the store is not kept at all.
    assert not store.put("big", entry(text="z" * 3000)) and store.get("big", "a") is None
    # Age.
    store = ResponseStore(max_responses=100, max_bytes=10_000, ttl_s=60)
    store.put("old", entry(ttl=-1))
    store.put("new", entry())
    assert store.get("old", "a") is None and store.get("new", "a") is not None and len(store) == 1


def test_store_keeps_keys_apart() -> None:
    store = ResponseStore(10, 10_000, 60)
    store.put("r", entry(owner=owner_of("key-a")))
    assert store.get("r", owner_of("key-b")) is None and not store.delete("r", owner_of("key-b"))
    assert store.get("r", owner_of("key-a")) is not None and store.delete("r", owner_of("key-a"))
    assert store.bytes == 0
    assert owner_of("key-a") != owner_of("key-b") and "key-a" not in owner_of("key-a")


def test_dropping_a_running_background_response_cancels_it() -> None:
    async def main() -> None:
        store = ResponseStore(1, 10_000, 60)
        e = entry()
        e.task = asyncio.create_task(asyncio.sleep(60))
        store.put("bg", e)
        store.put("next", entry())  # the count bound evicts the running one
        await asyncio.sleep(0)
        assert e.task.cancelled() or e.task.cancelling()

    asyncio.run(main())


def test_a_conversation_over_the_cap_is_refused_before_it_runs() -> None:
    store = ResponseStore(10, 4_000, 60)  # 1000 bytes per response at most
    serving = ResponsesServing(None, store, None)  # type: ignore[arg-type]
    req = ResponsesRequest(input="word " * 400)
    with pytest.raises(APIError) as e:
        asyncio.run(serving.prepare(req, owner_of(None)))
    assert e.value.status == 400 and e.value.param == "store" and "store=false" in e.value.message


def test_items_become_chat_messages() -> None:
    items = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me look."}],
        },
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
    ]
    assert items_to_messages(items, set()) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather ?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"a": 1}'}},
                {"id": "c2", "type": "function", "function": {"name": "w", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]
    # An output may answer a call of an earlier response (previous_response_id).
    assert items_to_messages([{"type": "function_call_output", "call_id": "old", "output": "1"}], {"old"})
    for bad, needle in [
        ([{"type": "function_call_output", "call_id": "c9", "output": "1"}], "no function call"),
        ([{"type": "computer_call", "id": "x"}], "'computer_call' are not supported"),
        ([{"type": "item_reference", "id": "x"}], "item_reference"),
        ([{"role": "tool", "content": "x"}], "role must be"),
        ([{"role": "user", "content": [{"type": "input_audio"}]}], "'input_audio' is not supported"),
    ]:
        with pytest.raises(RequestFieldError, match=needle):
            items_to_messages(bad, set())


def test_responses_request_maps_to_chat_fields() -> None:
    req = ResponsesRequest(
        model="m",
        input="hi",
        instructions="sys",
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
        max_output_tokens=7,
        temperature=0.5,
        top_logprobs=3,
        prompt_cache_key="tenant-1",
    )
    chat, conversation = to_chat_request(req, [], [{"role": "user", "content": "hi"}])
    assert [m.role for m in chat.messages] == ["system", "user"] and conversation == [
        {"role": "user", "content": "hi"}
    ]
    assert chat.tools[0].function.name == "f" and chat.tool_choice.function.name == "f"
    assert not chat.parallel_tool_calls and chat.max_completion_tokens == 7 and chat.temperature == 0.5
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    assert chat.logprobs and chat.top_logprobs == 3 and chat.user == "tenant-1"
    with pytest.raises(ValueError, match="truncation"):
        ResponsesRequest(input="hi", truncation="auto")


def test_anthropic_request_maps_to_chat_fields() -> None:
    req = MessagesRequest(
        model="m",
        max_tokens=9,
        system=[{"type": "text", "text": "sys"}],
        tools=[{"name": "f", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        top_k=5,
        metadata={"user_id": "u1"},
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "ok"}],
                    },
                    {"type": "text", "text": "and now?"},
                ],
            },
        ],
    )
    chat = anthropic_to_chat(req)
    dumped = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert dumped == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "content": "ok", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "and now?"},
    ]
    assert chat.tool_choice == "required" and not chat.parallel_tool_calls
    assert chat.stop == ["END"] and chat.top_k == 5 and chat.max_tokens == 9 and chat.user == "u1"
    assert not chat.continue_final_message
    prefill = MessagesRequest(
        model="m",
        max_tokens=3,
        messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    )
    assert anthropic_to_chat(prefill).continue_final_message
    # A tool_result must answer a tool_use of the assistant turn just before it.
    stale = MessagesRequest(
        model="m",
        max_tokens=3,
        messages=[
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"}]},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"}]},
        ],
    )
    with pytest.raises(RequestFieldError, match="toolu_1"):
        anthropic_to_chat(stale)


def test_running_background_responses_are_not_evicted_and_age_from_their_end() -> None:
    store = ResponseStore(max_responses=2, max_bytes=10_000, ttl_s=60)
    running = entry()
    running.response["status"] = "in_progress"
    store.put("bg", running)
    for i in range(5):  # another client fills the store
        store.put(f"r{i}", entry(owner="b"))
    assert store.get("bg", "a") is running and running.expires == math.inf
    store.update("bg", {**running.response, "status": "completed"})
    assert running.expires < math.inf and list(store._entries)[-1] == "bg"  # its time starts now


def test_a_background_task_cancelled_before_it_starts_gives_its_ticket_back() -> None:
    from tokenmill.server.admission import Admission

    async def main() -> None:
        admission = Admission(10, 10_000)
        ticket = admission.admit()
        store = ResponseStore(10, 100_000, 60)
        serving = ResponsesServing(SimpleNamespace(model_name="m", served=lambda _: "m"), store, admission)  # type: ignore[arg-type]
        req = ResponsesRequest(input="hi", background=True)
        chat, conversation = to_chat_request(req, [], [{"role": "user", "content": "hi"}])
        from tokenmill.server.responses_serving import ResponseRun

        run = ResponseRun("resp_x", req, chat, None, owner_of(None), conversation, [])  # type: ignore[arg-type]
        serving.start_background(run, ticket)
        store.get("resp_x", owner_of(None)).task.cancel()  # before its first step
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert ticket.released and admission.sequences == 0
        assert store.get("resp_x", owner_of(None)).response["status"] == "cancelled"

    asyncio.run(main())


def test_stream_events_are_snapshots_of_their_moment() -> None:
    from tokenmill.outputs import CompletionOutput
    from tokenmill.server.openai_serving import TurnStep
    from tokenmill.server.responses_serving import OutputBuilder
    from tokenmill.server.tool_calls import ParsedDelta

    builder = OutputBuilder(None)
    out = CompletionOutput(0, "Hello", [1], delta_text="Hello", delta_token_ids=[1])
    events = builder.step(TurnStep(out, ParsedDelta(content="Hello", reasoning="think"), 0, 0))
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert added[0]["item"]["content"] == [{"type": "reasoning_text", "text": ""}]
    assert added[1]["item"]["content"] == []
    part = next(e for e in events if e["type"] == "response.content_part.added")["part"]
    assert part["text"] == ""
