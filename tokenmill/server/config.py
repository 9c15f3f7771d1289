"""Server settings (one dataclass, built from CLI flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.config import EngineConfig


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the --model value
    api_key: str | None = None
    # Admission: requests beyond max_num_seqs that may wait in the engine; more get 429.
    max_queued_requests: int = 256
    max_pending_tokens: int = 1_000_000  # prompt tokens in flight (a lone request may exceed it)
    drain_timeout_s: float = 30.0
    engine: EngineConfig = field(default_factory=EngineConfig)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model
