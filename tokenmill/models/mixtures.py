"""Mixtures of experts on Llama's decoder: Mixtral (every layer's MLP a mixture, its experts' w1/w3/w2 the
gate/up/down of a gated MLP) and Qwen3-MoE (Qwen3's attention, q/k norms included; its mixture's layers
set by decoder_sparse_step and mlp_only_layers, the others a dense MLP). The block is models/moe.py's."""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn

from tokenmill.models.config import ModelConfig
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.moe import FusedMoE
from tokenmill.models.parallel import Shard
from tokenmill.models.qwen3 import QKNormAttention

_MIXTRAL_NAMES = [
    (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.router."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
]
_QWEN_MOE_NAMES = [(re.compile(r"\.mlp\.gate\.weight$"), ".mlp.router.weight")]


def _renamer(rules: list[tuple[re.Pattern[str], str]]) -> Callable[[str], str]:
    def rename(name: str) -> str:
        for pattern, to in rules:
            name = pattern.sub(to, name)
        return name

    return rename


mixtral_names = _renamer(_MIXTRAL_NAMES)
qwen_moe_names = _renamer(_QWEN_MOE_NAMES)


class MixtralForCausalLM(LlamaForCausalLM):
    float32_routing = True  # its experts' outputs scaled by float32 weights (models/moe.py)

    def make_mlp(self, cfg: ModelConfig, layer: int, shard: Shard) -> nn.Module:
        if cfg.is_moe_layer(layer):
            return FusedMoE(cfg, shard, self.comm, self.float32_routing)
        return super().make_mlp(cfg, layer, shard)


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    attention_cls = QKNormAttention
    float32_routing = False
