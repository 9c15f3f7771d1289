"""Gemma 3 (text): Llama's parts arranged Gemma's way.

- Every sub-block is normed on both sides: input and post-attention norms around attention, pre- and
  post-feed-forward norms around the MLP, each output normed before it joins the residual stream.
- Norm weights are stored as offsets from 1 (Hugging Face computes x * (1 + w)); the checkpoint's are
  turned into 1 + w when loaded (`gemma_weights`), so the model's ops are the usual RMSNorm.
- The embedding is scaled by sqrt(hidden); the MLP gates with tanh-approximated GELU.
- Attention has per-head q/k norms (as Qwen3's), a scale of query_pre_attn_scalar ** -0.5, and
  interleaved layers: local ones see a sliding window and turn rope at their own base, every sixth
  layer (`layer_types`) sees the whole context at the global base.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.models.config import ModelConfig
from tokenmill.models.llama import MLP, DecoderLayer, LlamaForCausalLM, RMSNorm
from tokenmill.models.ops import TorchOps
from tokenmill.models.parallel import Shard
from tokenmill.models.qwen3 import QKNormAttention
from tokenmill.models.rope import RotaryEmbedding


def gemma_weights(name: str, t: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor as the module holds it: norms' offsets as the weights themselves (1 + w). In a
    bf16 model 1 + w is rounded to bf16 once here, where transformers adds it in float32 at every call:
    a relative difference up to 2^-9 in each norm's scale, none in float32."""
    return (1.0 + t.float()).to(t.dtype) if name.endswith("norm.weight") else t


class GeluMLP(MLP):
    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        gate, up = self._gate_up(x).chunk(2, dim=-1)
        return self._reduce(self._down(F.gelu(gate, approximate="tanh") * up))


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__(cfg, attn, mlp)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GemmaQKNormAttention(QKNormAttention):
    weight_in_float32 = True  # its RMSNorm multiplies by (1 + w) in float32, then rounds


class Gemma3ForCausalLM(LlamaForCausalLM):
    attention_cls = GemmaQKNormAttention

    def make_layer(self, cfg: ModelConfig, layer: int, shard: Shard) -> DecoderLayer:
        attn = self.attention_cls(cfg, shard, self.comm, layer)
        return GemmaDecoderLayer(cfg, attn, GeluMLP(cfg, shard, self.comm))

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = super()._embed(ids)
        # Hugging Face rounds the scale to the weights' dtype before multiplying.
        return h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype)

    def run_layers(
        self,
        residual: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        ops, eps = self.ops, self.config.rms_norm_eps
        x = ops.rms_norm(residual, self.layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            rope = self.local_rope if i in self._local else self.rope
            a = attn(x, positions, rope, ops, kv_caches[i], meta, backend)
            x = ops.add_rms_norm(
                ops.rms_norm(a, layer.post_attention_layernorm.weight, eps),
                residual,
                layer.pre_feedforward_layernorm.weight,
                eps,
            )
            m = ops.rms_norm(layer.mlp(x, ops), layer.post_feedforward_layernorm.weight, eps)
            if i + 1 < len(self.layers):
                x = ops.add_rms_norm(m, residual, self.layers[i + 1].input_layernorm.weight, eps)
        return residual.add_(m)

    def finalize(self) -> None:
        super().finalize()
        cfg = self.config
        # Local layers by the config: their window may have been dropped (longer than any context), their
        # rope stays local: its own base, without the global one's scaling. Built here, not in __init__,
        # which runs on the meta device.
        self._local = {i for i, g in enumerate(self.shard.layers) if g in cfg.window_layers}
        if cfg.local_rope_theta:
            positions, device = self.rope.cos.shape[0], self.rope.cos.device
            self.local_rope = RotaryEmbedding(cfg.rope_dim, positions, cfg.local_rope_theta).to(device)
        else:
            self.local_rope = self.rope
