"""Which model code runs a checkpoint, keyed by the architecture name the checkpoint gives
(config.json's `architectures`, or its `model_type`, which is also what GGUF metadata names)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.models.architectures import HF_ARCHITECTURES
from tokenmill.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tokenmill.models.gemma3 import Gemma3ForCausalLM, gemma_weights
from tokenmill.models.llama import LlamaForCausalLM, build_model, to_fused_state_dict
from tokenmill.models.mixtures import MixtralForCausalLM, Qwen3MoeForCausalLM, mixtral_names, qwen_moe_names
from tokenmill.models.own_weights import own_remaining
from tokenmill.models.qwen3 import Qwen3ForCausalLM
from tokenmill.tokenizer.tokenizer import Tokenizer
from tokenmill.weights import loader
from tokenmill.weights.cache_inventory import note_source
from tokenmill.weights.cache_paths import weights_cache_root


@dataclass(frozen=True)
class Family:
    """One architecture: its module, and how its checkpoint's tensor names map to the module's (Llama's
    names, q/k/v and gate/up fused by models/llama.py's to_fused_state_dict) where they differ."""

    model_cls: type[LlamaForCausalLM]
    rename: Callable[[str], str] | None = None
    adjust: Callable[[str, torch.Tensor], torch.Tensor] | None = None


# Hugging Face's model_type -> the family. Llama, Mistral and Qwen2 are one decoder (Qwen2's q/k/v biases
# are ModelConfig.attention_bias); Phi-3's checkpoints hold q/k/v and gate/up fused already, in the
# module's order, and its partial rotary is ModelConfig.rotary_dim: both Llama's module.
FAMILIES: dict[str, Family] = {
    "llama": Family(LlamaForCausalLM),
    "mistral": Family(LlamaForCausalLM),
    "qwen2": Family(LlamaForCausalLM),
    "qwen3": Family(Qwen3ForCausalLM),
    "phi3": Family(LlamaForCausalLM),
    "mixtral": Family(MixtralForCausalLM, mixtral_names),
    "qwen3_moe": Family(Qwen3MoeForCausalLM, qwen_moe_names),
    "gemma3_text": Family(Gemma3ForCausalLM, adjust=gemma_weights),
}
assert set(FAMILIES) == SUPPORTED_ARCHITECTURES


def layout(model_type: str) -> loader.Layout:
    """How a family's checkpoint tensors become its module's state dict (and are cached)."""
    family = FAMILIES[model_type]
    return loader.Layout(
        "fused-qkv-gate-up",
        lambda tensors, cfg: to_fused_state_dict(
            tensors, ModelConfig.from_hf(cfg), family.rename, family.adjust
        ),
    )


def architecture_of(hf_config: dict[str, Any]) -> str:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    arch = hf_config.get("model_type", "llama")
    if arch not in FAMILIES:
        given = ", ".join(names) or arch
        raise ValueError(
            f"unsupported architecture {given}; supported: {', '.join(sorted(HF_ARCHITECTURES))} "
            "(tokenmill models)"
        )
    return arch


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # the architecture's layout, in the requested dtype
    tokenizer: Tokenizer
    source: Path
    codes: loader.CheckpointCodes  # the file's own quantized codes, each kind read on first ask


def load_checkpoint(path: Path, dtype: torch.dtype, cache_dir: Path | None) -> LoadedModel:
    """A checkpoint's config, weights (in its architecture's layout), tokenizer, and its quantized codes
    for the quantization methods to take (models/quant)."""
    arch = architecture_of(loader.read_hf_config(path, cache_dir))
    lay = layout(arch)
    ck = loader.load(path, dtype, cache_dir, lay)
    note_source(weights_cache_root(path, cache_dir), path)  # for `tokenmill cache`: in use, and when
    return LoadedModel(
        ModelConfig.from_hf(ck.hf_config),
        ck.state_dict,
        ck.tokenizer,
        ck.source,
        loader.CheckpointCodes(path, lay, cache_dir),
    )


def checkpoint_codes(path: Path, cache_dir: Path | None) -> loader.CheckpointCodes:
    """The quantized codes `path` holds (GGUF), named and fused in its architecture's layout."""
    lay = layout(architecture_of(loader.read_hf_config(path, cache_dir)))
    return loader.CheckpointCodes(path, lay, cache_dir)


def build(
    cfg: ModelConfig, state_dict: dict[str, torch.Tensor], *args: Any, **kwargs: Any
) -> torch.nn.Module:
    """The architecture's module from its state dict (arguments: models/llama.py's build_model), holding
    its own copies of what it still uses of the state dict where that is little of it (own_weights.py),
    so that a mapped checkpoint is freed once the caller drops it."""
    model = build_model(cfg, state_dict, *args, model_cls=FAMILIES[cfg.architecture].model_cls, **kwargs)
    own_remaining(model, state_dict)
    return model
