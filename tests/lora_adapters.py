"""LoRA adapters made with peft on the embedded model, and greedy references from peft's merged models.

An adapter's B starts at zero in peft (a fresh adapter changes nothing); here A and B are drawn at random,
B scaled so each adapter visibly changes what the model says without wrecking it. The reference is the
adapter merged into the weights by peft (merge_and_unload), in transformers, float32.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    targets: tuple[str, ...]
    rslora: bool = False
    seed: int = 0


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECS = [
    AdapterSpec("all16", 16, ALL, seed=1),
    AdapterSpec("attn8", 8, ("q_proj", "v_proj", "o_proj"), seed=2),
    AdapterSpec("mlp4rs", 4, ("gate_proj", "up_proj", "down_proj"), rslora=True, seed=3),
    AdapterSpec("kv16", 16, ("k_proj", "v_proj", "down_proj"), seed=4),
]


def make_adapter(hf_model: torch.nn.Module, spec: AdapterSpec, where: Path) -> torch.nn.Module:
    """Save the adapter under `where`; return the merged reference model."""
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(hf_model)
    cfg = LoraConfig(
        r=spec.rank, lora_alpha=2 * spec.rank, target_modules=list(spec.targets), use_rslora=spec.rslora
    )
    peft_model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    peft_model.save_pretrained(str(where))
    return peft_model.merge_and_unload().eval()
