"""Tool calling for /v1/chat/completions: what the request asks for (a ToolPlan), how tools and earlier
calls reach the prompt, the output constraint that makes a required call parse, and the parsers that
turn model text into OpenAI tool calls, fragment by fragment so that streaming and non-streaming
answers are the same thing assembled differently.

The output format is Hermes': a model calling tools writes `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` blocks. A chat template that lists `tools` itself (Hermes and Qwen style) gets them
as they are; for one that does not (plain ChatML, the embedded SmolLM2's), the tools are described in
the system prompt here and earlier calls and their results are written as text. (Templates that ask
for another output format, such as Llama 3.1's bare JSON, get their `required` and named calls right,
since those are constrained, but `auto` only finds Hermes blocks.)

- `auto`: unconstrained; `<tool_call>` blocks are cut out of the text, the rest is content.
- `required`: the output is constrained to a JSON array of `{"name": <a tool>, "arguments": <its
  parameters>}` (one element when parallel_tool_calls is false).
- a named function: the output is constrained to that function's parameters: it IS the arguments.
- `none`: no tools in the prompt, nothing parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenmill.sampling_params import StructuredOutputs
from tokenmill.server.openai_protocol import RequestFieldError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# A tool declared without parameters takes an object with no particular fields.
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

ChoiceMode = Literal["none", "auto", "required", "named"]
# What json.loads raises on text that is not JSON, including text nested deeper than Python recurses
# and integers past Python's digit limit (a bare ValueError).
NOT_JSON = (ValueError, RecursionError)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str) -> Any:
    """JSON as RFC 8259 has it: Python's json.loads also takes NaN, Infinity and -Infinity, which are
    not JSON, and a call's arguments written with them would reach the client as text no JSON parser
    reads. Raises one of NOT_JSON on anything else."""
    return json.loads(text, parse_constant=_no_constant)


def dumps_arguments(value: Any) -> str:
    """A call's arguments as the text the client gets: always JSON (raises ValueError for NaN or an
    infinity, which a value from loads_strict never holds)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- what the request asks for ------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolPlan:
    """The request's tools (OpenAI shape: {"type": "function", "function": {...}}) and how to use them."""

    tools: tuple[dict[str, Any], ...]
    mode: ChoiceMode
    name: str | None = None  # the function tool_choice names (mode "named")
    parallel: bool = True
    format: str = "hermes"  # how the model writes calls it chooses to make (tool_parsers.py)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def parameters(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or EMPTY_PARAMETERS
        raise KeyError(name)

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools to show the model; none for tool_choice "none" (so it has nothing to call)."""
        return list(self.tools) if self.mode != "none" and self.tools else None

    def constraint(self) -> StructuredOutputs | None:
        """The output constraint that makes the calls parse; None when the model chooses freely."""
        if self.mode == "named":
            assert self.name is not None
            return StructuredOutputs(json=json.dumps(self.parameters(self.name)))
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                # `name` first: the engine writes properties in this order, so the name is known before
                # the arguments start and they can be streamed as they grow.
                "properties": {"name": {"const": name}, "arguments": self.parameters(name)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name in self.names
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputs(json=json.dumps(schema))

    def parser(self) -> ToolCallParser | None:
        if self.mode == "auto":
            from tokenmill.server.tool_parsers import make_parser  # it builds on this module

            return make_parser(self.format, set(self.names), self.parallel)
        if self.mode == "required":
            return ArrayParser(set(self.names))
        if self.mode == "named":
            assert self.name is not None
            return NamedParser(self.name)
        return None


def plan_tools(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel_tool_calls: bool = True,
    fmt: str = "hermes",
) -> ToolPlan | None:
    """The plan for a request's `tools`, `tool_choice` and `parallel_tool_calls` (already shape-checked);
    None when it has no tools. RequestFieldError for choices that cannot be honoured."""
    named = None
    if isinstance(tool_choice, Mapping):
        named = str(tool_choice["function"]["name"])
    if not tools:
        if named is not None or tool_choice == "required":
            what = f"names function {named!r}" if named is not None else "is 'required'"
            raise RequestFieldError(f"tool_choice {what} but the request has no tools", "tool_choice")
        return None
    normal = tuple(_tool_dict(t) for t in tools)
    names = [t["function"]["name"] for t in normal]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise RequestFieldError(f"tool names must be unique; repeated: {', '.join(duplicates)}", "tools")
    if named is not None:
        if named not in names:
            raise RequestFieldError(
                f"tool_choice names function {named!r}, which is not among the tools ({', '.join(names)})",
                "tool_choice",
            )
        return ToolPlan(normal, "named", named, parallel_tool_calls, fmt)
    mode: ChoiceMode = "auto" if tool_choice is None else tool_choice  # type: ignore[assignment]
    return ToolPlan(normal, mode, None, parallel_tool_calls, fmt)


def _tool_dict(tool: Mapping[str, Any]) -> dict[str, Any]:
    function = {k: v for k, v in dict(tool["function"]).items() if v is not None}
    return {"type": "function", "function": function}


def finish_reason(reason: str | None, calls_made: int) -> str | None:
    """OpenAI says "tool_calls" when the turn ended in calls; running out of tokens stays "length"."""
    return "tool_calls" if calls_made and reason == "stop" else reason


# -- the prompt -----------------------------------------------------------------------------------------


def template_messages(
    messages: Sequence[Mapping[str, Any]], plan: ToolPlan | None, template_has_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (and the `tools` template variable) to render, given whether the chat template
    lists tools itself. Messages are chat_message_dict()s: text content, OpenAI tool_calls."""
    tools = plan.prompt_tools() if plan is not None else None
    if template_has_tools:
        # Such templates write the arguments with `tojson`: they expect the object, not its JSON text.
        return [_with_argument_objects(m) for m in messages], tools
    return hermes_messages(messages, tools), None


def _with_argument_objects(message: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(message)
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {**call, "function": {**call["function"], "arguments": _arguments_value(call["function"])}}
            for call in message["tool_calls"]
        ]
    return out


def _arguments_value(function: Mapping[str, Any]) -> Any:
    args = function.get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args)
        except NOT_JSON:
            return args  # not JSON: the model sees it as written
    return args


def _result_value(content: str) -> Any:
    # A result that is a JSON object or array is shown as one, not as a string full of escaped quotes.
    if content.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(content)
        except NOT_JSON:
            pass
    return content


def tools_system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to help with the user's request. Their signatures are the "
        "JSON objects between <tools> and </tools>:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and arguments between <tool_call> and "
        "</tool_call>, one block per call:\n"
        f'{CALL_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CALL_CLOSE}'
    )


def hermes_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation for a template that knows nothing of tools: the tools described in the system
    message, earlier calls written as the `<tool_call>` blocks the model is asked to write, and tool
    results as a user turn of `<tool_response>` blocks (a user turn, not a "tool" one: templates that
    insist on alternating user and assistant turns accept it)."""
    names: dict[str, str] = {}  # tool_call_id -> function name, to label results
    out: list[dict[str, Any]] = []
    results_open = False  # the last message is a user turn of tool results
    for m in messages:
        message = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        is_result = m.get("role") == "tool"
        if m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = []
            for call in m["tool_calls"]:
                function = call["function"]
                names[call.get("id", "")] = function["name"]
                body = {"name": function["name"], "arguments": _arguments_value(function)}
                blocks.append(f"{CALL_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CALL_CLOSE}")
            text = str(m.get("content") or "")
            message["content"] = "\n".join([text, *blocks] if text else blocks)
        elif is_result:
            name = names.get(str(m.get("tool_call_id")), m.get("name"))
            result = {"name": name, "content": _result_value(str(m.get("content") or ""))}
            block = f"<tool_response>\n{json.dumps(result, ensure_ascii=False)}\n</tool_response>"
            if results_open:  # the results of one turn's calls make one user message
                out[-1]["content"] += "\n" + block
                continue
            message = {"role": "user", "content": block}
        results_open = is_result
        out.append(message)
    if tools:
        text = tools_system_text(tools)
        if out and out[0].get("role") in ("system", "developer"):
            first = str(out[0].get("content") or "")
            out[0] = {**out[0], "content": f"{first}\n\n{text}" if first else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


# -- parsing the output ---------------------------------------------------------------------------------


@dataclass
class CallFragment:
    """A piece of tool call `index`: its first piece has the id and name, every piece a part of the
    arguments text (the pieces of one index concatenated are its arguments)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[CallFragment] = field(default_factory=list)
    reasoning: str = ""  # text of the model's reasoning (reasoning.py), apart from its answer

    def extend(self, other: ParsedDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls

    def deltas(self) -> list[dict[str, Any]]:
        """As chat.completion.chunk deltas: reasoning (under vLLM's present name and its former one,
        which DeepSeek's API and many clients read), content, then one delta per call fragment."""
        out: list[dict[str, Any]] = []
        if self.reasoning:
            out.append({"reasoning_content": self.reasoning, "reasoning": self.reasoning})
        if self.content:
            out.append({"content": self.content})
        return out + [{"tool_calls": [c.to_openai()]} for c in self.calls]


class ToolCallParser(ABC):
    """Model text in, content and call fragments out, as the text streams."""

    calls_made = 0

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta: ...

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """The output ended: what was held back."""

    def header(self, name: str) -> CallFragment:
        """A new call's first fragment (OpenAI's: id, type and name, arguments empty)."""
        self.calls_made += 1
        return CallFragment(self.calls_made - 1, "", new_call_id(), name)


def parse_complete(parser: ToolCallParser, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output as a message's content (None when it only made calls) and its tool_calls."""
    _, content, calls = parse_reply(parser, text)
    return content, calls


def parse_reply(parser: ToolCallParser, text: str) -> tuple[str, str | None, list[dict[str, Any]]]:
    """A whole output as its reasoning, a message's content (None when it only made calls) and its
    tool_calls."""
    parsed = parser.feed(text)
    parsed.extend(parser.finish())
    calls: list[dict[str, Any]] = []
    for fragment in parsed.calls:
        if fragment.id is not None:
            function = {"name": fragment.name, "arguments": fragment.arguments}
            calls.append({"id": fragment.id, "type": "function", "function": function})
        else:
            calls[fragment.index]["function"]["arguments"] += fragment.arguments
    content: str | None = parsed.content
    if calls and not parsed.content.strip():
        content = None
    return parsed.reasoning, content, calls


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in free text (tool_choice auto).

    Text that may be the start of `<tool_call>` is held back until it is known not to be, so no piece of
    a tag reaches the content; a block is parsed once it closes (or the output ends). A block that is
    not a call of a known tool stays in the content as written. Whitespace between the text and a call
    is the tags' layout and is dropped."""

    def __init__(self, names: set[str], parallel: bool = True) -> None:
        self.names = names
        self.parallel = parallel
        self.buffer = ""  # text not yet handed out
        self.in_call = False  # inside <tool_call> ... (the opening tag consumed)
        self.pending_space = ""  # trailing whitespace of the content, held in case a call follows
        self.after_call = False  # drop the whitespace that follows a call

    def feed(self, text: str) -> ParsedDelta:
        self.buffer += text
        return self._drain(final=False)

    def finish(self) -> ParsedDelta:
        out = self._drain(final=True)
        if not self.calls_made:
            out.content += self.pending_space
        self.pending_space = ""
        return out

    def _drain(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if not self.in_call:
                start = self.buffer.find(CALL_OPEN)
                if start >= 0:
                    out.content += self._text(self.buffer[:start])
                    self.buffer = self.buffer[start + len(CALL_OPEN) :]
                    self.in_call = True
                    continue
                held = 0 if final else tag_prefix_length(self.buffer, CALL_OPEN)
                out.content += self._text(self.buffer[: len(self.buffer) - held])
                self.buffer = self.buffer[len(self.buffer) - held :]
                return out
            end = self.buffer.find(CALL_CLOSE)
            if end < 0 and not final:
                return out
            body = self.buffer if end < 0 else self.buffer[:end]
            raw = CALL_OPEN + body + ("" if end < 0 else CALL_CLOSE)
            self.buffer = "" if end < 0 else self.buffer[end + len(CALL_CLOSE) :]
            self.in_call = False
            call = self._call(body)
            if call is None:
                out.content += self._text(raw)
            elif self.parallel or not self.calls_made:
                self.pending_space = ""
                self.after_call = True
                out.calls += [self.header(call[0]), CallFragment(self.calls_made - 1, call[1])]
            else:  # parallel_tool_calls false: one call per turn, later ones dropped
                self.after_call = True
            if end < 0:
                return out

    def _text(self, text: str) -> str:
        """Content to hand out now; trailing whitespace waits to see whether a call follows."""
        if self.after_call:
            text = text.lstrip()
            if not text:
                return ""
            self.after_call = False
        text = self.pending_space + text
        core = text.rstrip()
        self.pending_space = text[len(core) :]
        return core

    def _call(self, body: str) -> tuple[str, str] | None:
        try:
            obj = loads_strict(body)
        except NOT_JSON:
            return None
        if not isinstance(obj, dict) or not _known(obj.get("name"), self.names):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # arguments written as a JSON string: they must hold JSON themselves
            try:
                loads_strict(args)
            except NOT_JSON:
                return None
            return obj["name"], args
        return obj["name"], dumps_arguments(args)


def tag_prefix_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class NamedParser(ToolCallParser):
    """The output is the named function's arguments (tool_choice names one): every piece of text is
    a piece of them."""

    def __init__(self, name: str) -> None:
        self.name = name

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        fragments = [] if self.calls_made else [self.header(self.name)]
        return ParsedDelta(calls=[*fragments, CallFragment(0, text)])

    def finish(self) -> ParsedDelta:
        return ParsedDelta()


# The start of an array element up to its arguments: {"name": "<name>", "arguments":
_ELEMENT_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


class ArrayParser(ToolCallParser):
    """A JSON array of {"name", "arguments"} objects (tool_choice required). Scans the JSON as it grows:
    a call starts once its name is read, and its arguments go out as they are written (the constraint
    writes `name` first). An element whose keys come in the other order (only without the constraint)
    goes out whole when it closes. Output that holds no call at all is handed back as content."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.text = ""
        self.pos = 0  # scanned up to here
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.element = -1  # where the element being read starts (-1: between elements)
        self.args_from = -1  # where its arguments start, once its head is read
        self.args_sent = -1  # how far they have been handed out
        self.args_done = False

    def feed(self, text: str) -> ParsedDelta:
        self.text += text
        out = ParsedDelta()
        while self.pos < len(self.text):
            self._scan(self.text[self.pos], out)
            self.pos += 1
        self._send_arguments(self.pos, out)
        return out

    def finish(self) -> ParsedDelta:
        return ParsedDelta() if self.calls_made else ParsedDelta(content=self.text)

    def _scan(self, ch: str, out: ParsedDelta) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return
        if ch == '"':
            self.in_string = True
        elif ch in "[{":
            if ch == "{" and self.depth == 1:
                self.element, self.args_from, self.args_done = self.pos, -1, False
            self.depth += 1
        elif ch in "]}":
            if self.depth == 2 and self.element >= 0:  # the element closes
                self._end_arguments(out)
                self._end_element(out)
            self.depth = max(0, self.depth - 1)
        elif ch == "," and self.depth == 2:
            self._end_arguments(out)
        elif ch == ":" and self.depth == 2 and self.element >= 0 and self.args_from < 0:
            head = _ELEMENT_HEAD.fullmatch(self.text, self.element, self.pos + 1)
            name = _json_string(head.group(1)) if head else None
            if _known(name, self.names):
                out.calls.append(self.header(name))
                self.args_from = self.args_sent = self.pos + 1

    def _send_arguments(self, upto: int, out: ParsedDelta) -> None:
        if self.args_from < 0 or self.args_done:
            return
        if self.args_sent == self.args_from:  # nothing sent yet: the space after the colon is layout
            while self.args_sent < upto and self.text[self.args_sent].isspace():
                self.args_sent += 1
            self.args_from = self.args_sent
        if upto > self.args_sent:
            out.calls.append(CallFragment(self.calls_made - 1, self.text[self.args_sent : upto]))
            self.args_sent = upto

    def _end_arguments(self, out: ParsedDelta) -> None:
        if self.args_from >= 0 and not self.args_done:
            self._send_arguments(self.pos, out)
            self.args_done = True

    def _end_element(self, out: ParsedDelta) -> None:
        start, self.element = self.element, -1
        if self.args_from >= 0:
            return
        try:
            obj = loads_strict(self.text[start : self.pos + 1])
        except NOT_JSON:
            return
        if isinstance(obj, dict) and _known(obj.get("name"), self.names) and "arguments" in obj:
            out.calls.append(self.header(obj["name"]))
            arguments = dumps_arguments(obj["arguments"])
            out.calls.append(CallFragment(self.calls_made - 1, arguments))


def _known(name: Any, names: set[str]) -> bool:
    return isinstance(name, str) and name in names


def _json_string(text: str) -> str | None:
    try:
        return loads_strict(text)
    except NOT_JSON:  # an escape JSON does not have
        return None
