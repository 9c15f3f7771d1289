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
    ArchitectureInfo("Phi3ForCausalLM", "phi3", "Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini", gguf=False),
    ArchitectureInfo("MixtralForCausalLM", "mixtral", "Mixtral 8x7B, 8x22B", gguf=False),
    ArchitectureInfo("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3-30B-A3B, Qwen3-235B-A22B", gguf=False),
]
HF_ARCHITECTURES = {a.hf_name: a.model_type for a in ARCHITECTURES}

# The defaults of each family's transformers config class where they differ from Llama's, for the fields
# tokenmill reads: transformers 4 left a key equal to its class's default out of config.json (the released
# Gemma-3-1b-it's has no tie_word_embeddings, and ties them), so a missing key means the family's default.
HF_DEFAULTS: dict[str, dict[str, object]] = {
    "gemma3_text": {
        "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "head_dim": 256, "query_pre_attn_scalar": 256,
        "sliding_window": 4096, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "max_position_embeddings": 131_072,
    },
    "qwen3_moe": {"norm_topk_prob": False, "decoder_sparse_step": 1, "num_experts_per_tok": 8},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True},
}  # fmt: skip
GGUF_MODEL_TYPES = {a.model_type for a in ARCHITECTURES if a.gguf}
# GGUF's names (general.architecture) of the families tokenmill reads only from their HF directories.
HF_FAMILY_OF_GGUF = {"gemma3": "gemma3_text", "phi3": "phi3", "qwen3moe": "qwen3_moe", "mixtral": "mixtral"}
