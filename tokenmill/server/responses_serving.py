"""`/v1/responses`: a Responses request runs as a chat turn (responses_protocol.py); its reply becomes
output items (a message, function calls), streamed as the API's typed events or returned whole, and
kept in the response store when `store` is true, for previous_response_id, GET, DELETE and background
polling. The streamed events and the returned object come from one builder, so they always agree."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tokenmill.server.admission import Admission, Ticket
from tokenmill.server.errors import APIError
from tokenmill.server.openai_protocol import ChatCompletionRequest, RequestFieldError
from tokenmill.server.openai_serving import OpenAIServing, PreparedChat, TurnStep, sse_event
from tokenmill.server.response_store import ResponseStore, StoredResponse
from tokenmill.server.responses_protocol import (
    ResponsesRequest,
    echo_text,
    echo_tool_choice,
    echo_tools,
    input_items,
    to_chat_request,
)

log = logging.getLogger(__name__)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """Turns a reply's steps into output items and the stream events that build them."""

    def __init__(self, logprobs: Any | None) -> None:
        self.items: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None  # the item being written (its index: the last)
        self.logprobs = logprobs  # token logprobs -> the API's entries; None when not asked for
        self.pending_logprobs: list[Any] = []  # of tokens whose text the tool parser still holds
        self.input_tokens = self.output_tokens = self.cached_tokens = 0
        self.finish_reason: str | None = None

    def step(self, step: TurnStep) -> list[dict[str, Any]]:
        o, parsed, events = step.output, step.parsed, []
        if self.logprobs is not None and o.logprobs is not None and o.delta_token_ids:
            self.pending_logprobs += o.logprobs[-len(o.delta_token_ids) :]
        if parsed.reasoning:
            events += self._reasoning(parsed.reasoning)
        if parsed.content:
            events += self._text(parsed.content)
        for fragment in parsed.calls:
            if fragment.id is not None:
                events += self._close("completed")
                self.pending_logprobs = []  # the call's own tokens
                item = {
                    "type": "function_call",
                    "id": _id("fc"),
                    "call_id": fragment.id,
                    "name": fragment.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                events += self._open(item)
            if fragment.arguments and self.current is not None:
                self.current["arguments"] += fragment.arguments
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": self.current["id"],
                        "output_index": len(self.items) - 1,
                        "delta": fragment.arguments,
                    }
                )
        self.output_tokens = len(o.token_ids)
        self.cached_tokens = step.cached_tokens
        if o.finished:
            self.finish_reason = o.finish_reason
            events += self._close("incomplete" if o.finish_reason == "length" else "completed")
        return events

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self.current = item
        # A copy as it is now: the event goes out after the rest of the step has written into the item.
        added = copy.deepcopy(item)
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": added}]

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        """The model's reasoning (with --reasoning-parser): a reasoning item, its text as
        reasoning_text content, as open models' reasoning is given in this API."""
        events = []
        if self.current is None or self.current["type"] != "reasoning":
            events += self._close("completed")
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "in_progress"}
            events += self._open({**item, "content": [{"type": "reasoning_text", "text": ""}]})
        assert self.current is not None
        self.current["content"][0]["text"] += text
        events.append({**self._where(self.current), "type": "response.reasoning_text.delta", "delta": text})
        self.pending_logprobs = []  # the reasoning's own tokens: not the answer text's
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.current is None or self.current["type"] != "message":
            events += self._close("completed")
            message = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant"}
            events += self._open({**message, "content": []})
            part = {"type": "output_text", "text": "", "annotations": []}
            if self.logprobs is not None:
                part["logprobs"] = []
            self.current["content"].append(part)
            events.append(
                {
                    **self._where(self.current),
                    "type": "response.content_part.added",
                    "part": copy.deepcopy(part),
                }
            )
        part = self.current["content"][0]
        part["text"] += text
        delta = {**self._where(self.current), "type": "response.output_text.delta", "delta": text}
        if self.logprobs is not None:
            entries = self.logprobs(self.pending_logprobs)
            part["logprobs"] += entries
            delta["logprobs"] = entries
            self.pending_logprobs = []
        events.append(delta)
        return events

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        """Where a message's text is: the item (always the last one written) and its one part."""
        return {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self.current = self.current, None
        if item is None:
            return []
        events: list[dict[str, Any]] = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append({**self._where(item), "type": "response.reasoning_text.done", "text": text})
        elif item["type"] == "message":
            part = item["content"][0]
            done = {**self._where(item), "type": "response.output_text.done", "text": part["text"]}
            if self.logprobs is not None:
                done["logprobs"] = part["logprobs"]
            events.append(done)
            events.append({**self._where(item), "type": "response.content_part.done", "part": part})
        else:
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": len(self.items) - 1,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        item["status"] = status
        events.append(
            {"type": "response.output_item.done", "output_index": len(self.items) - 1, "item": item}
        )
        return events

    def usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        }

    def assistant_messages(self) -> list[dict[str, Any]]:
        """The output as chat messages, for a later previous_response_id: one assistant turn."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [
            {
                "id": i["call_id"],
                "type": "function",
                "function": {"name": i["name"], "arguments": i["arguments"]},
            }
            for i in self.items
            if i["type"] == "function_call"
        ]
        if not text and not calls:
            return []
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


@dataclass
class ResponseRun:
    """One response being made: its request, what it runs as, and where its output goes."""

    id: str
    req: ResponsesRequest
    chat: ChatCompletionRequest
    prep: PreparedChat
    owner: str
    conversation: list[dict[str, Any]]  # without instructions, up to this response's input
    items: list[dict[str, Any]]  # this request's input items, with ids
    created_at: int = field(default_factory=lambda: int(time.time()))


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store: ResponseStore, admission: Admission) -> None:
        self.serving, self.store, self.admission = serving, store, admission

    async def prepare(self, req: ResponsesRequest, owner: str) -> ResponseRun:
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id, owner)
            if previous is None:
                raise APIError(
                    404,
                    f"previous response {req.previous_response_id!r} not found: it was never stored, "
                    "was deleted or has expired",
                    "previous_response_id",
                )
            if not previous.terminal:
                raise APIError(400, "the previous response has not finished yet", "previous_response_id")
            history = previous.messages
        items = [{**item, "id": item.get("id") or _id("msg")} for item in input_items(req.input)]
        try:
            chat, conversation = to_chat_request(req, history, items)
        except RequestFieldError as e:
            raise APIError(400, str(e), e.param) from e
        if req.store:
            size = len(json.dumps([conversation, items], separators=(",", ":")))
            if size > self.store.max_entry_bytes:
                raise APIError(
                    400,
                    f"the conversation ({size} bytes) is over the response store's cap of "
                    f"{self.store.max_entry_bytes} bytes per response: send store=false, or start anew",
                    "store",
                )
        prep = await self.serving.prepare_chat(chat, "input")
        return ResponseRun(_id("resp"), req, chat, prep, owner, conversation, items)

    async def create(self, req: ResponsesRequest, ticket: Ticket, owner: str) -> dict | AsyncIterator[str]:
        run = await self.prepare(req, owner)
        self.admission.add_work(ticket, 1, len(run.prep.ids))
        return self.stream(run) if req.stream else await self.complete(run)

    def response(
        self, run: ResponseRun, status: str, builder: OutputBuilder | None = None, error: dict | None = None
    ) -> dict[str, Any]:
        req = run.req
        incomplete = None
        if builder is not None and builder.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        return {
            "id": run.id,
            "object": "response",
            "created_at": run.created_at,
            "status": status,
            "background": req.background,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.serving.served(req.model),
            "output": [] if builder is None else builder.items,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": req.store,
            "temperature": run.chat.temperature,
            "text": echo_text(req),
            "tool_choice": echo_tool_choice(req),
            "tools": echo_tools(req),
            "top_logprobs": req.top_logprobs,
            "top_p": run.chat.top_p,
            "truncation": req.truncation or "disabled",
            "usage": None if builder is None else builder.usage(),
            "user": req.user,
        }

    def _builder(self, run: ResponseRun) -> OutputBuilder:
        builder = OutputBuilder(self.serving._chat_logprobs if run.req.wants_logprobs else None)
        builder.input_tokens = len(run.prep.ids)
        return builder

    def _keep(self, run: ResponseRun, response: dict[str, Any], builder: OutputBuilder) -> None:
        """Store a finished response (when asked); if it is over the cap, it says store: false."""
        if not run.req.store:
            return
        messages = run.conversation + builder.assistant_messages()
        entry = StoredResponse(run.owner, response, run.items, messages, self.store.expiry())
        if not self.store.put(run.id, entry):
            response["store"] = False

    # -- a response returned whole ---------------------------------------------------------------
    async def complete(self, run: ResponseRun) -> dict[str, Any]:
        builder = self._builder(run)
        async for step in self.serving.turn(run.id, run.chat, run.prep):
            builder.step(step)
        response = self.response(run, "completed", builder)
        self._keep(run, response, builder)
        return response

    # -- streamed ----------------------------------------------------------------------------------
    async def stream(self, run: ResponseRun) -> AsyncIterator[str]:
        builder = self._builder(run)
        sequence = 0

        def event(payload: dict[str, Any]) -> str:
            nonlocal sequence
            payload["sequence_number"] = sequence
            sequence += 1
            return sse_event(payload)

        yield event({"type": "response.created", "response": self.response(run, "in_progress")})
        yield event({"type": "response.in_progress", "response": self.response(run, "in_progress")})
        try:
            async for step in self.serving.turn(run.id, run.chat, run.prep):
                for payload in builder.step(step):
                    yield event(payload)
        except APIError as e:
            error = {"code": "server_error" if e.status >= 500 else "invalid_request", "message": e.message}
            response = self.response(run, "failed", builder, error)
            response["usage"] = None
            yield event({"type": "response.failed", "response": response})
            return
        response = self.response(run, "completed", builder)
        self._keep(run, response, builder)
        yield event({"type": f"response.{response['status']}", "response": response})

    # -- background ---------------------------------------------------------------------------------
    def start_background(self, run: ResponseRun, ticket: Ticket) -> dict[str, Any]:
        """Store the response as queued, generate it in a task, and answer now. The task holds the
        admission ticket until it ends, however it ends."""
        response = self.response(run, "queued")
        entry = StoredResponse(run.owner, response, run.items, run.conversation, self.store.expiry())
        if not self.store.put(run.id, entry):
            self.admission.release(ticket)
            raise APIError(400, "the request is over the response store's cap per response", "store")
        entry.task = asyncio.create_task(self._background(run))
        entry.task.add_done_callback(lambda _: self._ended(run, ticket))
        return response

    def _ended(self, run: ResponseRun, ticket: Ticket) -> None:
        """A background task ended, however: its ticket goes back, and a response cancelled before
        its task's first step (which never ran its own handlers) says it was cancelled."""
        self.admission.release(ticket)
        entry = self.store.get(run.id, run.owner)
        if entry is not None and not entry.terminal:
            self.store.update(run.id, self.response(run, "cancelled"))

    async def _background(self, run: ResponseRun) -> None:
        builder = self._builder(run)
        try:
            self.store.update(run.id, self.response(run, "in_progress"))
            async for step in self.serving.turn(run.id, run.chat, run.prep):
                builder.step(step)
            response = self.response(run, "completed", builder)
            self.store.update(run.id, response, run.conversation + builder.assistant_messages())
        except asyncio.CancelledError:
            self.store.update(run.id, self.response(run, "cancelled", builder))
        except APIError as e:
            code = "server_error" if e.status >= 500 else "invalid_request"
            self.store.update(
                run.id, self.response(run, "failed", builder, {"code": code, "message": e.message})
            )
        except Exception as e:  # a bug, not a request's fault: the response says so and the log has it
            log.exception("background response %s failed", run.id)
            error = {"code": "server_error", "message": f"internal error: {type(e).__name__}"}
            self.store.update(run.id, self.response(run, "failed", builder, error))

    async def cancel(self, rid: str, owner: str) -> dict[str, Any]:
        entry = self.store.get(rid, owner)
        if entry is None:
            raise APIError(404, f"response {rid!r} not found", "response_id")
        if entry.task is None:
            raise APIError(400, "only background responses can be cancelled", "response_id")
        if not entry.task.done():
            entry.task.cancel()
            await asyncio.wait([entry.task], timeout=5)
        return entry.response
