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
    # Request bodies, compressed or after decompression (KServe's gzip/deflate), are capped at this.
    max_request_body_mb: float = 64.0
    # KServe v2 model repository (Triton's flags); None: the OpenAI API only.
    model_repository: str | None = None
    model_control_mode: str = "none"
    load_models: list[str] = field(default_factory=list)
    repository_poll_secs: float = 15.0
    model_memory_budget_mb: float | None = None
    grpc_port: int = 8001  # KServe v2 over gRPC, with a model repository; 0: off
    engine: EngineConfig = field(default_factory=EngineConfig)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model
