"""OpenAI-compatible wire schemas (pydantic): requests, responses, stream chunks and the error shape.

Field names follow the OpenAI API; engine options that OpenAI lacks are accepted as extra fields
(vLLM's names): top_k, min_p, repetition_penalty, min_tokens, ignore_eos, priority, cache_salt,
stop_token_ids, include_stop_str_in_output, skip_special_tokens, speculative (false opts the request
out of speculative decoding); and output constraints beside OpenAI's
`response_format`: `structured_outputs` and the older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenmill.sampling_params import SamplingParams, StructuredOutputs


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# Integer widths the engine carries (token ids are int32 in every tokenizer; seeds are 64-bit, as
# torch's generators take them; priorities int64): larger values are a 400 here, not a 500 later.
INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class RequestFieldError(ValueError):
    """A request that is well-formed JSON but asks for something inconsistent; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def first_error(e: ValueError) -> str:
    """A validation error in one line: the first problem pydantic found, with where it is."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        first = errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        return f"{loc}: {first.get('msg')}" if loc else str(first.get("msg"))
    return str(e)


# OpenAI's rule for names the model writes back (json_schema names, function names).
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    # `schema` would shadow a BaseModel attribute: kept under another name, spelled `schema` on the wire.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # every schema is enforced exactly, strict or not


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format of type "json_schema" needs a `json_schema` object')
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` body field: exactly one kind of constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # vLLM's tuning knobs: accepted and ignored (JSON output here never has free whitespace, and a
    # schema is enforced as written, so there is nothing to tune).
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Infinity and NaN (JSON numbers like 1e999) are no valid setting of any field.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    n: int = Field(default=1, ge=1, le=16)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extra (vLLM-style) fields.
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    cache_salt: str | None = None
    # vLLM's, from a prefill/decode proxy (server/kv_transfer_params.py).
    kv_transfer_params: dict[str, Any] | None = None
    speculative: bool = True  # false: this request is never given draft tokens (--speculative)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # the prompt tokens' logprobs
    # Output constraints (at most one per request).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_prompt_logprobs(self) -> _SamplingFields:
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are returned by requests that do not stream")
        return self

    def output_constraint(self) -> tuple[StructuredOutputs, str] | None:
        """The request's constraint on its output and the field it came from; None if unconstrained.
        RequestFieldError when more than one field constrains it."""
        found: list[tuple[StructuredOutputs, str]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append((StructuredOutputs(json_object=True), "response_format"))
        elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            found.append((StructuredOutputs(json=json.dumps(rf.json_schema.schema_)), "response_format"))
        if self.structured_outputs is not None:
            found.append((_structured_field(self.structured_outputs), "structured_outputs"))
        if self.guided_json is not None:
            found.append((_spec("guided_json", json=_schema_text(self.guided_json)), "guided_json"))
        if self.guided_regex is not None:
            found.append((_spec("guided_regex", regex=self.guided_regex), "guided_regex"))
        if self.guided_choice is not None:
            found.append((_spec("guided_choice", choice=self.guided_choice), "guided_choice"))
        if self.guided_grammar is not None:
            found.append((_spec("guided_grammar", grammar=self.guided_grammar), "guided_grammar"))
        if len(found) > 1:
            names = " and ".join(source for _, source in found)
            raise RequestFieldError(f"a request takes one output constraint, got {names}", found[1][1])
        return found[0] if found else None

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, structured: StructuredOutputs | None = None
    ) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = {}
        for k, v in (self.logit_bias or {}).items():
            try:
                token = int(k)
            except ValueError as e:
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from e
            if not 0 <= token <= INT32_MAX:
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
            bias[token] = max(-100.0, min(100.0, float(v)))
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias=bias,
            skip_special_tokens=self.skip_special_tokens,
            structured=structured,
            speculative=self.speculative,
            prompt_logprobs=self.prompt_logprobs,
        )


def _schema_text(schema: dict[str, Any] | bool | str) -> str:
    # A schema given as text stays text: the grammar backend reports text that is not JSON.
    return schema if isinstance(schema, str) else json.dumps(schema)


def _spec(field: str, **kind: Any) -> StructuredOutputs:
    (name, value), *_ = kind.items()
    if not value and value is not True:  # said here: StructuredOutputs would call it "none" given
        raise RequestFieldError(f"{field}: the {name} must not be empty", field)
    try:
        return StructuredOutputs(**kind)
    except ValueError as e:  # an empty regex, choice list or grammar
        raise RequestFieldError(f"{field}: {e}", field) from e


def _structured_field(f: StructuredOutputsField) -> StructuredOutputs:
    kinds = {
        "json": None if f.json_ is None else _schema_text(f.json_),
        "json_object": bool(f.json_object),
        "regex": f.regex,
        "choice": f.choice,
        "grammar": f.grammar,
    }
    set_kinds = [k for k, v in kinds.items() if v not in (None, False)]
    if len(set_kinds) != 1:
        raise RequestFieldError(
            f"structured_outputs takes exactly one of json, json_object, regex, choice, grammar; "
            f"got {', '.join(set_kinds) or 'none'}",
            "structured_outputs",
        )
    return _spec("structured_outputs", **{set_kinds[0]: kinds[set_kinds[0]]})


class CompletionRequest(_SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    # 0 reads the prompt and writes nothing: with echo and logprobs, the prompt's scores (lm-eval's way).
    max_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=16)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        if self.suffix:
            raise ValueError("suffix (fill in the middle) is not supported by this server's models")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > 1 and self.stream:
            raise ValueError("best_of cannot be streamed: the best are known only at the end")
        return self


class FunctionCall(BaseModel):
    name: str
    # OpenAI sends the arguments as JSON text; some clients send the object itself.
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    """A tool call an earlier assistant turn made, sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role} messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    # vLLM's: the final assistant message is the start of the reply, which goes on from its text.
    continue_final_message: bool = False
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        for m in self.messages:
            if isinstance(m.content, list):
                kinds = {part.get("type") for part in m.content} - {"text"}
                if kinds:
                    raise ValueError(f"only text content parts are supported, got {sorted(map(str, kinds))}")
        return self


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


def now() -> int:
    return int(time.time())
