"""Architecture hyper-parameters of a decoder-only model, read from a Hugging Face config.json dict
(weights/ translates GGUF metadata into one). The fields beyond Llama's are each one family's twist: per-head
windows (Mistral, Gemma 3), partial rotary, mixtures of experts (Mixtral, Qwen3-MoE); a family's module
(models/registry.py) holds what needs no field (Qwen3's q/k norms)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tokenmill.models.architectures import ARCHITECTURES, HF_DEFAULTS

# Rope scaling types models/rope.py computes.
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# HF `model_type` / GGUF `general.architecture` values a model file covers (models/registry.py).
SUPPORTED_ARCHITECTURES = {a.model_type for a in ARCHITECTURES}


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
    # Rope on the first rotary_dim of each head's dimensions, the rest passed through (partial_rotary_factor:
    # Phi-4-mini); 0: all of them.
    rotary_dim: int = 0
    # A mixture of experts in place of the MLP (0 experts: dense): each token's top `experts_per_token`
    # experts by the router's softmax, their outputs summed with those probabilities, renormalized to sum
    # to 1 over the chosen ones where `renormalize_experts`. Layers listed in dense_layers keep an MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    renormalize_experts: bool = True
    dense_layers: tuple[int, ...] = ()
    # Sliding-window attention: the layers listed in window_layers see the last `sliding_window` positions
    # (Mistral's and Phi-3's layers all; Gemma 3's local layers), the others all of them. Gemma 3's local
    # layers turn rope at their own base (local_rope_theta; 0: rope_theta).
    sliding_window: int = 0
    window_layers: tuple[int, ...] = ()
    local_rope_theta: float = 0.0
    # Gemma's: the attention's scale (0: head_dim ** -0.5), and a soft cap on the output logits
    # (cap * tanh(logits / cap); 0: none).
    attention_scale: float = 0.0
    final_logit_softcap: float = 0.0
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
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:  # refused before any weight is read
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})"
            )
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim}: not even, or above head_dim {self.head_dim}")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token {self.experts_per_token} must be in 1..num_experts {self.num_experts}"
            )

    @property
    def rope_dim(self) -> int:
        """How many of a head's dimensions rope rotates."""
        return self.rotary_dim or self.head_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.dense_layers

    def window_of(self, i: int) -> int:
        """Layer i's sliding window (global index), 0 where it sees its whole context (a local layer of
        a config whose sliding_window is null too)."""
        return self.sliding_window if i in self.window_layers else 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        tuples = {k: tuple(d.get(k, ())) for k in ("dense_layers", "window_layers")}
        return cls(**{**d, **tuples})

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json dict (a key it leaves out: its family's default)."""
        model_type = cfg.get("model_type", "llama")
        cfg = {**HF_DEFAULTS.get(model_type, {}), **cfg}
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # transformers < 5 writes rope_theta + rope_scaling; 5.x nests both in rope_parameters, by layer type
        # where those differ (Gemma 3: full_attention, sliding_attention).
        params = cfg.get("rope_parameters") or {}
        local_params = params.get("sliding_attention") or {}
        params = params.get("full_attention", params)
        rope_scaling = cfg.get("rope_scaling") or (
            params if params.get("rope_type", "default") != "default" else None
        )
        if rope_scaling is not None and "rope_type" not in rope_scaling and "type" in rope_scaling:
            rope_scaling = {**rope_scaling, "rope_type": rope_scaling["type"]}
        if rope_scaling is not None and rope_scaling.get("rope_type") == "default":
            rope_scaling = None
        if rope_scaling is not None and rope_scaling.get("rope_type") == "longrope":
            # Phi-3's config keeps the pretrained context beside rope_scaling; the factor is how far the
            # context was stretched from it.
            original = (
                rope_scaling.get("original_max_position_embeddings")
                or cfg["original_max_position_embeddings"]
            )
            factor = rope_scaling.get("factor") or cfg["max_position_embeddings"] / original
            rope_scaling = {**rope_scaling, "original_max_position_embeddings": original, "factor": factor}
        rope_theta = params.get("rope_theta") or cfg.get("rope_theta") or 10000.0
        head_dim = cfg.get("head_dim") or hidden // num_heads
        partial = float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)
        rotary_dim = int(head_dim * partial) if partial < 1.0 else 0
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        layers = cfg["num_hidden_layers"]
        window, window_layers = _windows(cfg, model_type, layers)
        if cfg.get("attn_logit_softcapping"):
            raise ValueError("attention logit soft-capping (Gemma 2) is not supported")
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama exposes it as attention_bias.
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            rotary_dim=rotary_dim,
            num_experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            # Mixtral's intermediate_size is its experts'; Qwen3-MoE names theirs apart.
            expert_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
            if experts
            else 0,
            # Mixtral always renormalizes the chosen experts' probabilities; Qwen3-MoE says whether.
            renormalize_experts=bool(cfg.get("norm_topk_prob", False)),
            dense_layers=_dense_layers(cfg, layers) if experts else (),
            sliding_window=window,
            window_layers=window_layers,
            local_rope_theta=float(local_params.get("rope_theta") or cfg.get("rope_local_base_freq") or 0.0),
            attention_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5
            if cfg.get("query_pre_attn_scalar")
            else 0.0,
            final_logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
            extra={"rope_freq_factors": cfg["rope_freq_factors"]} if "rope_freq_factors" in cfg else {},
        )


def _dense_layers(cfg: dict[str, Any], layers: int) -> tuple[int, ...]:
    """Qwen-MoE's layers that keep a dense MLP: those listed in mlp_only_layers, and all but every
    decoder_sparse_step-th."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or [])
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


def _windows(cfg: dict[str, Any], model_type: str, layers: int) -> tuple[int, tuple[int, ...]]:
    """The sliding window and the layers of the sliding kind (listed even when the window is null: Gemma's
    local layers keep their own rope): as `layer_types` lists them (transformers 5 writes it for the
    families that mix them), else as transformers 4 derived them: every layer of Mistral, Phi-3 and
    Mixtral; Gemma 3's all but every sliding_window_pattern-th; Qwen's only with use_sliding_window (from
    max_window_layers on for Qwen2/3, every layer for Qwen3-MoE)."""
    window = int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types")
    if types is not None:
        chosen = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif model_type in ("mistral", "phi3", "mixtral"):
        chosen = tuple(range(layers))
    elif model_type == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        chosen = tuple(i for i in range(layers) if (i + 1) % pattern)
    elif model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        chosen = tuple(range(int(cfg.get("max_window_layers") or 0), layers))
    elif model_type == "qwen3_moe" and cfg.get("use_sliding_window"):
        chosen = tuple(range(layers))
    else:
        chosen = ()
    return window, chosen
