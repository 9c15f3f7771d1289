"""The Anthropic Messages API's request (`POST /v1/messages`, `/v1/messages/count_tokens`), its
translation to a chat request, and its error shape.

`system` becomes a system message; user `tool_result` blocks become tool messages (before the rest of
that user turn); assistant `tool_use` blocks become tool calls; `tools[].input_schema` is a function's
parameters; `tool_choice` any is chat's required, tool is a named function; a final assistant message
is the start of the reply (chat's continue_final_message)."""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.server.openai_protocol import (
    INT32_MAX,
    NAME_PATTERN,
    ChatCompletionRequest,
    RequestFieldError,
    first_error,
)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def anthropic_error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control and the like: hints for Anthropic's cache

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # server tools (web_search...) carry other types: refused


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Thinking(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    effort: str | None = None  # a hint for models trained on it; this server's model is not
    format: OutputFormat | None = None


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None


def _system_text(system: str | list[dict[str, Any]] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    texts = []
    for i, block in enumerate(system):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise RequestFieldError(f"system[{i}]: system blocks are text blocks", "system")
        texts.append(block["text"])
    return "\n".join(texts)


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RequestFieldError(f"{where}.content must be a string or a list of text blocks", "messages")
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise RequestFieldError(
                f"{where}.content[{j}]: blocks of type {kind!r} are not supported; this model reads text",
                "messages",
            )
        texts.append(str(block.get("text", "")))
    return "".join(texts)


def to_chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages. A tool_result must answer a tool_use of the assistant turn
    before it, as Anthropic's API requires."""
    out: list[dict[str, Any]] = []
    system = _system_text(req.system)
    if system:
        out.append({"role": "system", "content": system})
    open_calls: set[str] = set()  # tool_use ids of the last assistant turn, not yet answered
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise RequestFieldError(f"{at}.text must be a string", "messages")
                texts.append(block["text"])
            elif kind == "tool_use" and m.role == "assistant":
                tid, name, args = block.get("id"), block.get("name"), block.get("input", {})
                if not isinstance(tid, str) or not isinstance(name, str) or not isinstance(args, dict):
                    raise RequestFieldError(
                        f"{at}: a tool_use block needs an id, a name and an input object", "messages"
                    )
                arguments = json.dumps(args, ensure_ascii=False)
                calls.append(
                    {"id": tid, "type": "function", "function": {"name": name, "arguments": arguments}}
                )
            elif kind == "tool_result" and m.role == "user":
                tid = block.get("tool_use_id")
                if tid not in open_calls:
                    raise RequestFieldError(
                        f"{at}: tool_result for tool_use_id {tid!r}, which no tool_use block of the "
                        "assistant turn before it has",
                        "messages",
                    )
                open_calls.discard(tid)
                text = _result_text(block.get("content"), at)
                if block.get("is_error"):
                    text = f"Error: {text}"
                results.append({"role": "tool", "tool_call_id": tid, "content": text})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier reasoning: templates of open models leave it out of the prompt
            elif kind in ("tool_use", "tool_result"):
                side = "assistant" if kind == "tool_use" else "user"
                raise RequestFieldError(f"{at}: {kind} blocks belong in {side} messages", "messages")
            else:
                raise RequestFieldError(
                    f"{at}: content blocks of type {kind!r} are not supported; this model reads text",
                    "messages",
                )
        if m.role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
            open_calls = {c["id"] for c in calls}
        else:
            out += results
            if texts or not results:
                out.append({"role": "user", "content": "".join(texts)})
            open_calls = set()
    return out


def to_chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    messages = to_chat_messages(req)
    tools = []
    for i, tool in enumerate(req.tools or []):
        try:
            t = Tool.model_validate(tool)
        except ValueError as e:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise RequestFieldError(
                    f"tools[{i}]: server tools ({kind}) are not supported; this server runs client tools",
                    "tools",
                ) from e
            raise RequestFieldError(f"tools[{i}]: {first_error(e)}", "tools") from e
        function = {"name": t.name, "description": t.description, "parameters": t.input_schema}
        tools.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    choice: Any = None
    parallel = True
    if req.tool_choice is not None:
        parallel = not req.tool_choice.disable_parallel_tool_use
        kind = req.tool_choice.type
        if kind == "tool":
            if not req.tool_choice.name:
                raise RequestFieldError('tool_choice of type "tool" needs the tool\'s name', "tool_choice")
            choice = {"type": "function", "function": {"name": req.tool_choice.name}}
        else:
            choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "tools": tools or None,
        "tool_choice": choice if tools or choice not in ("auto", "none") else None,
        "parallel_tool_calls": parallel,
        # A final assistant message is the reply's beginning, which the model goes on from.
        "continue_final_message": messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"),
    }
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        body["stop"] = req.stop_sequences or None
        # Anthropic's default temperature is 1.0, as chat completions'.
        if req.temperature is not None:
            body["temperature"] = req.temperature
        if req.top_p is not None:
            body["top_p"] = req.top_p
        if req.top_k is not None:
            body["top_k"] = req.top_k
        fmt = req.output_config.format if req.output_config is not None else None
        if fmt is not None:
            schema = {"name": "output", "schema": fmt.schema_}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        user = (req.metadata or {}).get("user_id")
        body["user"] = str(user) if user is not None else None
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValueError as e:
        raise RequestFieldError(first_error(e), "messages") from e
