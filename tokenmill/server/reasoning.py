"""Reasoning parsers (`--reasoning-parser`): a thinking model writes its reasoning between `<think>` and
`</think>`, then its answer. The parser splits the output into the two as it streams, so that chat
completions can return `reasoning_content`, the Responses API a reasoning item and the Messages API a
thinking block, and so that tool calls are looked for in the answer only.

- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ): the chat template opens `<think>` in the prompt,
  so the output starts inside the reasoning: everything up to `</think>` is reasoning (all of it when
  `</think>` never comes; a `<think>` the model writes anyway is dropped).
- `qwen3` (Qwen3, and models in its style): reasoning only when the output opens with `<think>`; with
  thinking off, the template closes an empty block in the prompt and the output is all answer.

Tags are held back while they may be arriving, so no piece of one reaches either side.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.server.tool_calls import ParsedDelta, ToolCallParser, tag_prefix_length

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def extend(self, other: Split) -> None:
        self.reasoning += other.reasoning
        self.content += other.content


class ReasoningParser:
    """Output text in, reasoning and content out, as the text streams."""

    # Whether the output begins inside the reasoning (the template opened it) or only if it says so.
    starts_inside = False

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "start"  # start -> reasoning -> content (or start -> content)
        self.tokens_in_reasoning = 0

    def feed(self, text: str) -> Split:
        self.buffer += text
        return self._drain(final=False)

    def finish(self) -> Split:
        return self._drain(final=True)

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def _drain(self, final: bool) -> Split:
        out = Split()
        while True:
            if self.state == "start":
                stripped = self.buffer.lstrip()
                if stripped.startswith(OPEN):
                    self.buffer = stripped[len(OPEN) :]
                    self.state = "reasoning"
                    continue
                if not final and OPEN.startswith(stripped):  # `<thi`... or nothing yet: wait
                    return out
                self.state = "reasoning" if self.starts_inside else "content"
                continue
            if self.state == "reasoning":
                end = self.buffer.find(CLOSE)
                if end >= 0:
                    out.reasoning += self.buffer[:end]
                    self.buffer = self.buffer[end + len(CLOSE) :].lstrip("\n")
                    self.state = "after"
                    continue
                held = 0 if final else tag_prefix_length(self.buffer, CLOSE)
                out.reasoning += self.buffer[: len(self.buffer) - held]
                self.buffer = self.buffer[len(self.buffer) - held :]
                return out
            if self.state == "after":  # the blank lines between the reasoning and the answer are layout
                if not final and not self.buffer.strip("\n"):
                    return out
                self.buffer = self.buffer.lstrip("\n")
                self.state = "content"
                continue
            out.content += self.buffer
            self.buffer = ""
            return out


class DeepSeekR1Parser(ReasoningParser):
    starts_inside = True


class Qwen3Parser(ReasoningParser):
    starts_inside = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1Parser,
    "qwen3": Qwen3Parser,
}


def reasoning_parser(name: str | None) -> type[ReasoningParser] | None:
    if name is None:
        return None
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}"
        ) from None


class ReplyParser(ToolCallParser):
    """A reply's text split three ways as it streams: reasoning (when the server has a reasoning
    parser), then the answer, in which tool calls are looked for (when the request has a tool
    parser). What the chat, Responses and Messages APIs all read their replies through."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None) -> None:
        self.reasoning, self.tools = reasoning, tools

    @property  # type: ignore[override]
    def calls_made(self) -> int:
        return self.tools.calls_made if self.tools is not None else 0

    def feed(self, text: str) -> ParsedDelta:
        return self._answer(self.reasoning.feed(text) if self.reasoning else Split(content=text), False)

    def finish(self) -> ParsedDelta:
        return self._answer(self.reasoning.finish() if self.reasoning else Split(), True)

    def _answer(self, split: Split, final: bool) -> ParsedDelta:
        if self.tools is None:
            return ParsedDelta(content=split.content, reasoning=split.reasoning)
        out = self.tools.feed(split.content) if split.content else ParsedDelta()
        if final:
            out.extend(self.tools.finish())
        out.reasoning = split.reasoning + out.reasoning
        return out


def reply_parser(
    reasoning: type[ReasoningParser] | None, tools: ToolCallParser | None
) -> ToolCallParser | None:
    """The parser a reply goes through: None when there is nothing to split (plain text)."""
    if reasoning is None:
        return tools
    return ReplyParser(reasoning(), tools)
