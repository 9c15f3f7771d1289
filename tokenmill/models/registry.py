"""Which model code runs a checkpoint, keyed by the architecture name the checkpoint gives
(config.json's `architectures`, or its `model_type`, which is also what GGUF metadata names)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tokenmill.models.llama import build_model, to_fused_state_dict
from tokenmill.models.own_weights import own_remaining
from tokenmill.tokenizer.tokenizer import Tokenizer
from tokenmill.weights import loader
from tokenmill.weights.cache_inventory import note_source
from tokenmill.weights.cache_paths import weights_cache_root

# Hugging Face class names -> model_type. All three are Llama-shaped: one implementation covers them
# (Qwen2 adds q/k/v biases, which ModelConfig.attention_bias carries).
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class Architecture:
    layout: loader.Layout  # how its weights are laid out (and cached)
    build: Callable[..., torch.nn.Module]  # models/llama.py's build_model signature


FUSED = loader.Layout(
    "fused-qkv-gate-up", lambda tensors, cfg: to_fused_state_dict(tensors, ModelConfig.from_hf(cfg))
)
ARCHITECTURES = {name: Architecture(FUSED, build_model) for name in SUPPORTED_ARCHITECTURES}


def architecture_of(hf_config: dict[str, Any]) -> str:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    arch = hf_config.get("model_type", "llama")
    if arch not in ARCHITECTURES:
        given = ", ".join(names) or arch
        raise ValueError(
            f"unsupported architecture {given!r}; supported: "
            f"{', '.join(sorted(HF_ARCHITECTURES))} (model types {', '.join(sorted(ARCHITECTURES))})"
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
    arch = ARCHITECTURES[architecture_of(loader.read_hf_config(path, cache_dir))]
    ck = loader.load(path, dtype, cache_dir, arch.layout)
    note_source(weights_cache_root(path, cache_dir), path)  # for `tokenmill cache`: in use, and when
    return LoadedModel(
        ModelConfig.from_hf(ck.hf_config),
        ck.state_dict,
        ck.tokenizer,
        ck.source,
        loader.CheckpointCodes(path, arch.layout, cache_dir),
    )


def checkpoint_codes(path: Path, cache_dir: Path | None) -> loader.CheckpointCodes:
    """The quantized codes `path` holds (GGUF), named and fused in its architecture's layout."""
    arch = ARCHITECTURES[architecture_of(loader.read_hf_config(path, cache_dir))]
    return loader.CheckpointCodes(path, arch.layout, cache_dir)


def build(
    cfg: ModelConfig, state_dict: dict[str, torch.Tensor], *args: Any, **kwargs: Any
) -> torch.nn.Module:
    """The architecture's module from its state dict (arguments: models/llama.py's build_model), holding
    its own copies of what it still uses of the state dict where that is little of it (own_weights.py),
    so that a mapped checkpoint is freed once the caller drops it."""
    model = ARCHITECTURES[cfg.architecture].build(cfg, state_dict, *args, **kwargs)
    own_remaining(model, state_dict)
    return model
