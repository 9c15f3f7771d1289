"""Per-request sampling parameters (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StructuredOutputs:
    """A constraint on a request's output, as plain data (it crosses the engine protocol as it is).
    Exactly one kind is set. The worker compiles it to a grammar and masks the tokens it forbids."""

    json: str | None = None  # a JSON schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # a Lark-syntax grammar (llguidance's dialect; EBNF-like rules)

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, k)]
        if len(kinds) != 1:
            raise ValueError(
                "structured output needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {kinds or 'none'}"
            )
        if self.choice is not None:
            self.choice = list(self.choice)
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured output choice must be a list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, k))


POOLING_TYPES = (None, "last", "mean", "cls")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style: >1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0  # OpenAI style, on output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # Token sequences that end the request when the output ends with one; the sequence stays in the
    # output (TensorRT-LLM's stop_words_list: words of several tokens, matched on tokens, not text).
    stop_token_sequences: list[list[int]] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16  # None: up to the context length; 0: read the prompt, sample nothing
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each token's logprob
    # The prompt's own tokens' logprobs (each given the tokens before it), with this many alternatives.
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    structured: StructuredOutputs | None = None  # constrain the output to a schema, regex, choice, grammar
    speculative: bool = True  # False: this request opts out of speculative decoding
    # An embedding request: its prompt is read and its final hidden states pooled ("last" token,
    # "mean" of all, "cls": the first), in place of any token being sampled.
    pooling: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop_token_sequences = [[int(t) for t in s] for s in self.stop_token_sequences or []]
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if isinstance(self.structured, dict):
            self.structured = StructuredOutputs(**self.structured)
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field."""
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1, 0 (off) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 0,
                f"max_tokens must be >= 0, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                f"logprobs must be in [0, 20], got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
            ),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (all(self.stop_token_sequences), "stop token sequences must not be empty"),
            (
                self.pooling in POOLING_TYPES,
                f"pooling must be one of {', '.join(map(str, POOLING_TYPES))}, got {self.pooling!r}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def prompt_only(self) -> bool:
        """Read the prompt and sample nothing: an embedding, or max_tokens 0 (prompt scoring)."""
        return self.pooling is not None or self.max_tokens == 0

    @property
    def reads_every_prompt_row(self) -> bool:
        """Whether the request needs a computed row for each prompt token (not K/V from the cache)."""
        return self.pooling in ("mean", "cls") or self.prompt_logprobs is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
