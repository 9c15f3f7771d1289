"""Architecture hyper-parameters of a Llama-family model, read from a Hugging Face config.json dict
(weights/ translates GGUF metadata into one)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# HF `model_type` / GGUF `general.architecture` values this implementation covers.
SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict ({"rope_type": "llama3", "factor": 8.0, ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        return cls(**d)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json dict."""
        model_type = cfg.get("model_type", "llama")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # transformers < 5 writes rope_theta + rope_scaling; 5.x nests both in rope_parameters.
        params = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling") or (
            params if params.get("rope_type", "default") != "default" else None
        )
        if rope_scaling is not None and "rope_type" not in rope_scaling and "type" in rope_scaling:
            rope_scaling = {**rope_scaling, "rope_type": rope_scaling["type"]}
        if rope_scaling is not None and rope_scaling.get("rope_type") == "default":
            rope_scaling = None
        rope_theta = cfg.get("rope_theta") or params.get("rope_theta", 10000.0)
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama exposes it as attention_bias.
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            extra={"rope_freq_factors": cfg["rope_freq_factors"]} if "rope_freq_factors" in cfg else {},
        )
