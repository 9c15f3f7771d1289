"""What generate() and the streaming frontend hand back (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.worker.step import TokenLogprobs


@dataclass
class RequestMetrics:
    """Engine timestamps (time.monotonic()) of one sequence."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[TokenLogprobs] | None = None
    delta_text: str = ""  # new since the previous RequestOutput of this request
    delta_token_ids: list[int] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    # An embedding request's pooled final hidden state, as the engine made it (not normalized).
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: each prompt token's logprob given those before it; None for
    # the first, which nothing predicts (vLLM's shape).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # A prefill server's finished request under disaggregation: where its KV blocks can be read
    # (tokenmill's plain data; the server writes it in vLLM's kv_transfer_params shape).
    kv_transfer: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed hands back for each prompt (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
