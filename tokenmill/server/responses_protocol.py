"""The OpenAI Responses API's request (`POST /v1/responses`) and its translation to a chat request.

A Responses request is a chat turn in other clothes: `instructions` is a system message, input items
are messages, function calls and their outputs; function tools are flat rather than nested under
`function`; `text.format` is chat's `response_format`. Translating it to a ChatCompletionRequest
means every check and every feature of chat completions (tools, constraints, the template, context
length) applies unchanged. What the API has that this server cannot honour is refused by name."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenmill.server.openai_protocol import (
    INT32_MAX,
    NAME_PATTERN,
    ChatCompletionRequest,
    RequestFieldError,
    first_error,
)

# `include` values and what they mean here.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
# Values naming outputs this server never makes (built-in tools, encrypted reasoning): nothing to add.
INCLUDE_NOTHING_TO_ADD = {
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "message.input_image.image_url",
}


class FunctionTool(BaseModel):
    """A Responses function tool: flat, not nested under `function` as in chat completions."""

    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(default=None, pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError('text.format of type "json_schema" needs `name` and `schema`')
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: str | None = None  # a hint for models trained on it; this server's model is not


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # checked one by one: a built-in tool is refused by name
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    stream: bool = False
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # routes requests that share a prefix together (the router's key)
    # Engine options beside the API's (vLLM's names), as in chat completions.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    cache_salt: str | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.metadata is not None and len(self.metadata) > 16:
            raise ValueError("metadata takes at most 16 pairs")
        if self.background and not self.store:
            raise ValueError("background responses are stored: background needs store=true")
        if self.background and self.stream:
            raise ValueError("a background response is polled with GET; streaming one is not supported")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise ValueError("input must not be empty")
        if self.truncation == "auto":
            raise ValueError('truncation "auto" is not supported: a request over the context is refused')
        for value in self.include or []:
            if value != INCLUDE_LOGPROBS and value not in INCLUDE_NOTHING_TO_ADD:
                raise ValueError(f"include: unknown value {value!r}")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or []) or bool(self.top_logprobs)

    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind != "function":
                raise RequestFieldError(
                    f"tools[{i}]: tools of type {kind!r} are not supported; this server runs function tools",
                    "tools",
                )
            try:
                tools.append(FunctionTool.model_validate(tool))
            except ValueError as e:
                raise RequestFieldError(f"tools[{i}]: {first_error(e)}", "tools") from e
        return tools


# -- input items -> chat messages -------------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    """The text of a message's content: a string, or parts of which only text kinds are read."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestFieldError(f"{where}.content must be a string or a list of parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise RequestFieldError(f"{where}.content[{j}].text must be a string", "input")
            texts.append(text)
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            raise RequestFieldError(
                f"{where}.content[{j}]: content of type {kind!r} is not supported; this model reads text",
                "input",
            )
    return "".join(texts)


def input_items(input: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as items (a string is one user message)."""
    if isinstance(input, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": input}]}]
    return list(input)


def items_to_messages(items: list[dict[str, Any]], known_calls: set[str]) -> list[dict[str, Any]]:
    """Chat messages (the shape chat_message_dict gives) for input items. `known_calls` holds the
    call ids of function calls earlier in the conversation (a previous response's); a function call
    output must answer one of those or a call among these items."""
    messages: list[dict[str, Any]] = []
    calls = set(known_calls)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestFieldError(f"{where} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestFieldError(f"{where}.role must be user, assistant, system or developer", "input")
            text = _text_of(item.get("content"), where)
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
                raise RequestFieldError(
                    f"{where}: a function_call needs call_id, name and arguments (strings)", "input"
                )
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            calls.add(call_id)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # calls of one turn make one assistant message
            elif last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
                last["tool_calls"] = [call]  # the text the turn wrote before its calls
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise RequestFieldError(f"{where}: a function_call_output needs a call_id", "input")
            if call_id not in calls:
                raise RequestFieldError(
                    f"{where}: no function call with call_id {call_id!r} precedes this function_call_output",
                    "input",
                )
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue  # a model's earlier reasoning: templates of open models leave it out of the prompt
        elif kind == "item_reference":
            raise RequestFieldError(
                f"{where}: item_reference is not supported; send the item, or previous_response_id", "input"
            )
        else:
            raise RequestFieldError(f"{where}: input items of type {kind!r} are not supported", "input")
    return messages


def call_ids(messages: list[dict[str, Any]]) -> set[str]:
    return {c["id"] for m in messages for c in m.get("tool_calls") or []}


def to_chat_request(
    req: ResponsesRequest, history: list[dict[str, Any]], items: list[dict[str, Any]]
) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request this Responses request runs as, and the conversation without instructions
    (history, then this input) that a later previous_response_id continues."""
    conversation = history + items_to_messages(items, call_ids(history))
    if not conversation:
        raise RequestFieldError("the conversation is empty: send input", "input")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    tools = [
        {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
        for t in req.function_tools()
    ]
    choice: Any = req.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    body: dict[str, Any] = {
        "model": req.model,
        "messages": system + conversation,
        "tools": tools or None,
        "tool_choice": choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_completion_tokens": req.max_output_tokens,
        "logprobs": req.wants_logprobs,
        "top_logprobs": req.top_logprobs if req.wants_logprobs else None,
        "user": req.prompt_cache_key or req.safety_identifier or req.user,
        "seed": req.seed,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "priority": req.priority,
        "cache_salt": req.cache_salt,
        "ignore_eos": req.ignore_eos,
        "min_tokens": req.min_tokens,
    }
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {
            "name": fmt.name,
            "schema": fmt.schema_,
            "strict": fmt.strict,
            "description": fmt.description,
        }
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    try:
        return ChatCompletionRequest.model_validate(body), conversation
    except ValueError as e:
        raise RequestFieldError(first_error(e), "input") from e


def echo_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The tools as the Response object lists them (the request's, in the API's flat shape)."""
    out = []
    for t in req.function_tools():
        d = t.model_dump(exclude_none=True)
        d.setdefault("parameters", None)
        d.setdefault("strict", None)
        out.append(d)
    return out


def echo_tool_choice(req: ResponsesRequest) -> Any:
    if isinstance(req.tool_choice, FunctionToolChoice):
        return req.tool_choice.model_dump()
    return req.tool_choice or "auto"


def echo_text(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"format": {"type": "text"}}
    return {"format": json.loads(fmt.model_dump_json(by_alias=True, exclude_none=True))}
