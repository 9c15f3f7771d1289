"""OpenAI-compatible wire schemas (pydantic): requests, responses, stream chunks and the error shape.

Field names follow the OpenAI API; engine options that OpenAI lacks are accepted as extra fields
(vLLM's names): top_k, min_p, repetition_penalty, min_tokens, ignore_eos, priority, cache_salt,
stop_token_ids, include_stop_str_in_output, skip_special_tokens.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenmill.sampling_params import SamplingParams


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

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
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
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    # Not supported yet: declared so that a request using them gets a 400 saying so, rather than an
    # answer that silently ignored them.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.tools:
            raise ValueError("tools (tool calling) are not supported by this server yet")
        if self.tool_choice not in (None, "none"):
            raise ValueError("tool_choice is not supported by this server yet")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ValueError(
                f"response_format {self.response_format.get('type')!r} (structured output) is not supported "
                "by this server yet"
            )
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
