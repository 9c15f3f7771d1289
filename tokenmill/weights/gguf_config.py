"""A model's architecture from GGUF metadata (`<arch>.block_count` and friends), as the Hugging Face
config.json dict it stands for, so that weights/ hands models/ the one format both already read."""

from __future__ import annotations

from typing import Any

from tokenmill.models.architectures import GGUF_MODEL_TYPES, HF_FAMILY_OF_GGUF
from tokenmill.weights.gguf_file import GGUFFile


def hf_config_from_gguf(gguf: GGUFFile, has_output_tensor: bool) -> dict[str, Any]:
    """config.json keys from GGUF metadata (a model without an output tensor ties it to the embedding)."""
    arch = gguf.architecture
    if arch not in GGUF_MODEL_TYPES:  # before its fields: another family's are named otherwise
        if arch in HF_FAMILY_OF_GGUF:
            raise ValueError(
                f"{gguf.path.name}: GGUF files of {arch} are not read yet; serve its HF directory"
            )
        raise ValueError(f"{gguf.path.name}: unsupported architecture {arch} (tokenmill models)")
    if gguf.arch_value("expert_count"):  # a Mixtral file says llama, with its experts' tensors merged
        raise ValueError(
            f"{gguf.path.name}: GGUF files of mixtures of experts are not read yet; serve its HF directory"
        )
    hidden = int(gguf.arch_value("embedding_length"))
    num_heads = int(gguf.arch_value("attention.head_count"))
    num_kv = int(gguf.arch_value("attention.head_count_kv", num_heads))
    vocab = gguf.arch_value("vocab_size")
    if vocab is None:
        vocab = len(gguf.metadata["tokenizer.ggml.tokens"])
    rope_scaling = None
    if gguf.arch_value("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(gguf.arch_value("rope.scaling.factor"))}
    return {
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(gguf.arch_value("feed_forward_length")),
        "num_hidden_layers": int(gguf.arch_value("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv,
        "head_dim": int(gguf.arch_value("attention.key_length", hidden // num_heads)),
        "rms_norm_eps": float(gguf.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(gguf.arch_value("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(gguf.arch_value("context_length", 4096)),
        "tie_word_embeddings": not has_output_tensor,
        "attention_bias": arch == "qwen2",
    }
