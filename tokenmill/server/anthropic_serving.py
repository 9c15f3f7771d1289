"""`/v1/messages`: an Anthropic Messages request runs as a chat turn (anthropic_protocol.py); its
reply becomes content blocks (text, tool_use), returned whole or streamed as Anthropic's events
(message_start, content_block_start/delta/stop, message_delta, message_stop). Both come from one
builder, so the stream and the whole reply always agree."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.server.admission import Admission, Ticket
from tokenmill.server.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_body,
    to_chat_request,
)
from tokenmill.server.errors import APIError
from tokenmill.server.openai_protocol import ChatCompletionRequest, RequestFieldError
from tokenmill.server.openai_serving import OpenAIServing, PreparedChat, TurnStep, sse_event
from tokenmill.server.tool_calls import NOT_JSON, loads_strict


def tool_use_id(call_id: str) -> str:
    """Anthropic's id for a tool call (`toolu_...`), from the parser's (`call_...`)."""
    return "toolu_" + call_id.removeprefix("call_")


class BlockBuilder:
    """Turns a reply's steps into content blocks and the stream events that build them."""

    def __init__(self, stop_sequences: list[str]) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.arguments: list[str] = []  # a tool_use block's input as JSON text, as it streams
        self.open = False  # the last block is still being written
        self.stop_sequences = stop_sequences
        self.output_tokens = self.cached_tokens = 0
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def step(self, step: TurnStep) -> list[dict[str, Any]]:
        o, parsed, events = step.output, step.parsed, []
        if parsed.reasoning:  # with --reasoning-parser: a thinking block (unsigned: nothing to verify)
            if not (self.open and self.blocks[-1]["type"] == "thinking"):
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            self.blocks[-1]["thinking"] += parsed.reasoning
            delta = {"type": "thinking_delta", "thinking": parsed.reasoning}
            events.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})
        if parsed.content:
            if not (self.open and self.blocks[-1]["type"] == "text"):
                events += self._start({"type": "text", "text": ""})
            self.blocks[-1]["text"] += parsed.content
            delta = {"type": "text_delta", "text": parsed.content}
            events.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})
        for fragment in parsed.calls:
            if fragment.id is not None:
                events += self._start(
                    {"type": "tool_use", "id": tool_use_id(fragment.id), "name": fragment.name, "input": {}}
                )
            if fragment.arguments and self.open and self.blocks[-1]["type"] == "tool_use":
                self.arguments[-1] += fragment.arguments
                delta = {"type": "input_json_delta", "partial_json": fragment.arguments}
                events.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})
        self.output_tokens = len(o.token_ids)
        self.cached_tokens = step.cached_tokens
        if o.finished:
            events += self._stop()
            self.stop_reason, self.stop_sequence = self._reason(
                o.finish_reason, o.stop_reason, step.calls_made
            )
        return events

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._stop()
        self.blocks.append(block)
        if block["type"] == "tool_use":
            self.arguments.append("")
        self.open = True
        return [
            *events,
            {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)},
        ]

    def _stop(self) -> list[dict[str, Any]]:
        if not self.open:
            return []
        self.open = False
        block = self.blocks[-1]
        if block["type"] == "tool_use":
            try:
                block["input"] = loads_strict(self.arguments[-1] or "{}")
            except NOT_JSON:  # cut off by max_tokens: what was written is kept, unparsed, under a key
                block["input"] = {"_partial_json": self.arguments[-1]}
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _reason(self, finish: str | None, stop: str | int | None, calls: int) -> tuple[str, str | None]:
        if finish == "length":
            return "max_tokens", None
        if calls:
            return "tool_use", None
        if isinstance(stop, str) and stop in self.stop_sequences:
            return "stop_sequence", stop
        return "end_turn", None

    def usage(self, prompt_tokens: int) -> dict[str, Any]:
        # Anthropic counts cache reads apart: input_tokens are the prompt tokens computed anew.
        return {
            "input_tokens": prompt_tokens - self.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
        }


class MessagesServing:
    def __init__(self, serving: OpenAIServing, admission: Admission) -> None:
        self.serving, self.admission = serving, admission

    async def _prepare(self, req: CountTokensRequest) -> tuple[ChatCompletionRequest, PreparedChat]:
        try:
            chat = to_chat_request(req)
        except RequestFieldError as e:
            raise APIError(400, str(e), e.param) from e
        return chat, await self.serving.prepare_chat(chat)

    async def create(self, req: MessagesRequest, ticket: Ticket) -> dict | AsyncIterator[str]:
        chat, prep = await self._prepare(req)
        self.admission.add_work(ticket, 1, len(prep.ids))
        return self.stream(chat, prep) if req.stream else await self.complete(chat, prep)

    async def count_tokens(self, req: CountTokensRequest) -> int:
        """The prompt's length as /v1/messages would build it (its context-length check included)."""
        return len((await self._prepare(req))[1].ids)

    def _message(self, mid: str, builder: BlockBuilder, prompt_tokens: int) -> dict[str, Any]:
        return {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": self.serving.model_name,
            "content": builder.blocks,
            "stop_reason": builder.stop_reason,
            "stop_sequence": builder.stop_sequence,
            "usage": builder.usage(prompt_tokens),
        }

    async def complete(self, chat: ChatCompletionRequest, prep: PreparedChat) -> dict[str, Any]:
        mid = f"msg_{uuid.uuid4().hex}"
        builder = BlockBuilder(chat.stop if isinstance(chat.stop, list) else [])
        async for step in self.serving.turn(mid, chat, prep):
            builder.step(step)
        return self._message(mid, builder, len(prep.ids))

    async def stream(self, chat: ChatCompletionRequest, prep: PreparedChat) -> AsyncIterator[str]:
        mid = f"msg_{uuid.uuid4().hex}"
        builder = BlockBuilder(chat.stop if isinstance(chat.stop, list) else [])
        start = self._message(mid, builder, len(prep.ids))
        yield sse_event({"type": "message_start", "message": start})
        yield sse_event({"type": "ping"})
        try:
            async for step in self.serving.turn(mid, chat, prep):
                for payload in builder.step(step):
                    yield sse_event(payload)
        except APIError as e:
            yield sse_event(anthropic_error_body(e.status, e.message))
            return
        delta = {"stop_reason": builder.stop_reason, "stop_sequence": builder.stop_sequence}
        yield sse_event({"type": "message_delta", "delta": delta, "usage": builder.usage(len(prep.ids))})
        yield sse_event({"type": "message_stop"})
