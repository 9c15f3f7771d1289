"""The architectures tokenmill runs, as plain data (no torch): what `tokenmill models` lists and what
models/registry.py maps to model code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchitectureInfo:
    hf_name: str  # config.json's `architectures` entry
    model_type: str  # config.json's `model_type` (GGUF's general.architecture)
    examples: str  # models people serve with it
    gguf: bool  # whether its GGUF files load too (else its Hugging Face directory)


ARCHITECTURES = [
    ArchitectureInfo("LlamaForCausalLM", "llama", "Llama 2/3.x, SmolLM2", gguf=True),
    ArchitectureInfo("MistralForCausalLM", "mistral", "Mistral 7B", gguf=True),
    ArchitectureInfo("Qwen2ForCausalLM", "qwen2", "Qwen2, Qwen2.5", gguf=True),
    ArchitectureInfo("Qwen3ForCausalLM", "qwen3", "Qwen3 0.6B-32B", gguf=True),
    ArchitectureInfo("Gemma3ForCausalLM", "gemma3_text", "Gemma 3 1B (text)", gguf=False),
    ArchitectureInfo("Phi3ForCausalLM", "phi3", "Phi-3, Phi-3.5-mini, Phi-4", gguf=False),
    ArchitectureInfo("MixtralForCausalLM", "mixtral", "Mixtral 8x7B, 8x22B", gguf=False),
    ArchitectureInfo("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3-30B-A3B, Qwen3-235B-A22B", gguf=False),
]
HF_ARCHITECTURES = {a.hf_name: a.model_type for a in ARCHITECTURES}
GGUF_MODEL_TYPES = {a.model_type for a in ARCHITECTURES if a.gguf}
