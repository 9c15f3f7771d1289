"""The Llama family (Llama 2/3, Mistral, SmolLM2, Qwen2/2.5) in plain PyTorch over a flat token batch.

Q/K/V and gate/up projections are fused into one matmul each: on a CPU at small batch the number of
kernel launches, not FLOPs, dominates the step time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenmill.models.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.models.config import ModelConfig
from tokenmill.models.linear import pack_linears, quantize_linears
from tokenmill.models.ops import TorchOps, get_ops
from tokenmill.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """Holds the weight; the computation is an op of the model's `ops` (fused with the residual add)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        ops: TorchOps,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self._qkv(x)
        # Rope on the q and k heads together, in place in the projection's output.
        ops.rope_(qkv, self.num_heads + self.num_kv, self.head_dim, positions, rope.cos, rope.sin_signed)
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv, self.head_dim)
        o = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self._o(o.reshape(t, self.q_size))

    def finalize(self) -> None:
        # Bound methods in the instance dict skip nn.Module's __getattr__ and __call__ machinery,
        # which costs more than the kernels themselves at batch 1 on a CPU.
        self._qkv, self._o = self.qkv_proj.forward, self.o_proj.forward


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        return self._down(ops.silu_mul(self._gate_up(x)))

    def finalize(self) -> None:
        self._gate_up, self._down = self.gate_up_proj.forward, self.down_proj.forward


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class LlamaForCausalLM(nn.Module):
    """Parameter names follow Hugging Face's, except the fused `qkv_proj` and `gate_up_proj`."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = rope
        self.ops: TorchOps = TorchOps()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,  # [S]: rows whose next-token logits are wanted
    ) -> torch.Tensor:  # [S, vocab] float32
        ops, eps, rope = self.ops, self.config.rms_norm_eps, self.rope
        plan = self._plan
        residual = self.embed_tokens(input_ids)
        x = ops.rms_norm(residual, plan[0][2], eps)
        for i, (attn, mlp, _, post_norm_w, next_norm_w) in enumerate(plan):
            a = attn(x, positions, rope, ops, kv_caches[i], meta, backend)
            # Each residual add is fused with the norm that follows it (the next layer's, or the final).
            x = ops.add_rms_norm(a, residual, post_norm_w, eps)
            m = mlp(x, ops)
            if next_norm_w is not None:
                x = ops.add_rms_norm(m, residual, next_norm_w, eps)
        residual.add_(m)
        h = ops.rms_norm(residual[logits_indices], self.norm.weight, eps)
        return self._lm_head(h).float()

    def finalize(self) -> None:
        """Resolve the per-layer calls once (after weights are packed or quantized)."""
        layers = list(self.layers)
        self._plan = []
        for i, layer in enumerate(layers):
            layer.self_attn.finalize()
            layer.mlp.finalize()
            nxt = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else None
            self._plan.append(
                (
                    layer.self_attn.forward,
                    layer.mlp.forward,
                    layer.input_layernorm.weight,
                    layer.post_attention_layernorm.weight,
                    nxt,
                )
            )
        self._lm_head = self.lm_head.forward

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight


def to_fused_state_dict(
    hf_tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """Map Hugging Face parameter names/tensors to this module's (fusing q/k/v and gate/up)."""
    pending: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_tensors:
        name = name.removeprefix("model.")
        if name.startswith("lm_head.") and cfg.tie_word_embeddings:
            continue
        if any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            pending[name] = t
            continue
        if "rotary_emb" in name:
            continue
        out[name] = t
    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        for kind in ("weight", "bias"):
            parts = [pending.pop(f"{pre}self_attn.{p}_proj.{kind}", None) for p in "qkv"]
            if all(p is not None for p in parts):
                out[f"{pre}self_attn.qkv_proj.{kind}"] = torch.cat(parts, dim=0)
            elif any(p is not None for p in parts):
                raise ValueError(f"layer {i}: q/k/v {kind} tensors are incomplete")
        gate = pending.pop(f"{pre}mlp.gate_proj.weight", None)
        up = pending.pop(f"{pre}mlp.up_proj.weight", None)
        if gate is None or up is None:
            raise ValueError(f"layer {i}: missing mlp gate/up weights")
        out[f"{pre}mlp.gate_up_proj.weight"] = torch.cat([gate, up], dim=0)
    if pending:
        raise ValueError(f"unexpected tensors: {sorted(pending)[:5]}")
    return out


# Up to this many rows per step the int4 kernel beats bf16 here (benchmarks/linear_kernels.py).
QUANT_MAX_ROWS = 4


@contextlib.contextmanager
def _skip_init() -> Iterator[None]:
    # Random initialization is wasted work when real weights follow, and on the meta device it
    # imports torch's reference-op machinery (about a second of start-up).
    names = ["normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_"]
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def build_model(
    cfg: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    ops: str = "auto",
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """Create the module without initializing random weights, then assign the given ones."""
    rope = RotaryEmbedding(
        cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.extra.get("rope_freq_factors")
    ).to(device)
    with _skip_init(), torch.device("meta"):
        model = LlamaForCausalLM(cfg, rope)
    sd = {k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the architecture: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.tie_weights()
    model.ops = get_ops(ops, device.type)
    if quantization == "int4":
        # The output head stays at 8 bits: it is the embedding (Q8_0 in GGUF files), and every
        # logit depends on it.
        quantize_linears(model, max_rows=QUANT_MAX_ROWS, bits_for={"lm_head": 8}, default_bits=4)
    elif quantization is not None:
        raise ValueError(f"unknown quantization {quantization!r}; available: int4")
    pack_linears(model)
    model.finalize()
    return model.eval()
