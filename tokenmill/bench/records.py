"""One request as the client saw it, and the per-request metrics derived from it.

The record keeps raw times (seconds on the client's monotonic clock, relative to the run's start)
and derives every metric from them, so that any definition can be recomputed later from run.json.
Definitions (../shared/reference/bench_and_sizing.md, section 1.6):

- TTFT: first non-empty streamed chunk - send.
- TTST (time to second token): second non-empty chunk - first non-empty chunk (GenAI-Perf's
  time_to_second_token).
- ITL: (E2E - TTFT) / (OSL - 1), one value per request. This is GenAI-Perf/AIPerf "ITL", vLLM "TPOT".
- Chunk gaps: the time between consecutive non-empty chunks (vLLM's pooled "ITL"); a chunk may carry
  more than one token.
- E2E: last chunk (or the whole response, when not streaming) - send.
- Output tokens/s per user: 1 / ITL.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    index: int  # order of sending within the run
    t_send: float
    t_end: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each non-empty chunk
    isl: int | None = None  # prompt tokens (the server's usage count when it gives one)
    osl: int | None = None  # output tokens (usage, else counted with the tokenizer, else chunks)
    osl_source: str = ""  # "usage" | "tokenizer" | "chunks"
    requested_osl: int | None = None
    error: str | None = None  # kind of failure, e.g. "http_429", "timeout", "connect"; None if ok
    error_detail: str | None = None
    warmup: bool = False
    conversation: int | None = None
    turn: int | None = None
    output_text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and self.t_end is not None

    @property
    def e2e_s(self) -> float | None:
        return None if self.t_end is None else self.t_end - self.t_send

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.t_send if self.chunk_times else None

    @property
    def ttst_s(self) -> float | None:
        return self.chunk_times[1] - self.chunk_times[0] if len(self.chunk_times) > 1 else None

    @property
    def itl_s(self) -> float | None:
        e2e, ttft = self.e2e_s, self.ttft_s
        if e2e is None or ttft is None or self.osl is None or self.osl < 2:
            return None
        return (e2e - ttft) / (self.osl - 1)

    @property
    def chunk_gaps_s(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tps_user(self) -> float | None:
        itl = self.itl_s
        return 1.0 / itl if itl else None

    def metric_ms(self, name: str) -> float | None:
        """A latency metric in milliseconds by its summary name (ttft, ttst, itl, e2e)."""
        value = {"ttft": self.ttft_s, "ttst": self.ttst_s, "itl": self.itl_s, "e2e": self.e2e_s}[name]
        return None if value is None else value * 1e3

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("ttft", "ttst", "itl", "e2e"):
            d[f"{name}_ms"] = self.metric_ms(name)
        d["tps_user"] = self.tps_user
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})
