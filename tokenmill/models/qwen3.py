"""Qwen3 (dense): Llama's decoder with an RMSNorm over each query and key head, after the projection and
before rope. Its MoE sibling is models/mixtures.py's Qwen3MoeForCausalLM."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.models.config import ModelConfig
from tokenmill.models.llama import Attention, LlamaForCausalLM, RMSNorm
from tokenmill.models.ops import TorchOps
from tokenmill.models.parallel import Collectives, Shard
from tokenmill.models.rope import RotaryEmbedding


class QKNormAttention(Attention):
    weight_in_float32 = False

    def __init__(self, cfg: ModelConfig, shard: Shard, comm: Collectives, layer: int = 0) -> None:
        super().__init__(cfg, shard, comm, layer)
        # One weight of head_dim for all heads: the same on every tensor-parallel rank.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def rotate_(
        self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ops: TorchOps
    ) -> None:
        t, d = qkv.shape[0], self.head_dim
        q = qkv[:, : self.q_size].view(t, self.num_heads, d)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv, d)
        # Normalized in float32 whatever the model's dtype, as transformers does; Qwen3 rounds to the model's
        # dtype before the weight multiplies, Gemma after (`weight_in_float32`).
        for x, norm in ((q, self.q_norm), (k, self.k_norm)):
            if self.weight_in_float32:
                x.copy_(F.rms_norm(x.float(), (d,), norm.weight.float(), norm.eps))
            else:
                x.copy_(F.rms_norm(x.float(), (d,), None, norm.eps).to(x.dtype) * norm.weight)
        super().rotate_(qkv, positions, rope, ops)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = QKNormAttention
