"""Model architectures for sizing: the numbers that decide FLOPs, bytes and KV memory.

A catalog of common models, or any config.json / GGUF file. Parameter counts are computed from the
shapes (attention q/k/v/o, the MLP with 3 matrices for SwiGLU or 2 for GELU, embeddings once if
tied, twice if not), so they can be checked: Llama-3-8B comes out at 8.03 B, Mixtral 8x7B at 46.7 B
total and 12.9 B active per token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from tokenmill.models.architectures import HF_DEFAULTS


@dataclass(frozen=True)
class Arch:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False
    mlp_matrices: int = 3  # 3 for SwiGLU (gate, up, down), 2 for a GELU MLP
    experts: int = 1  # mixture of experts: experts per layer
    active_experts: int = 1  # experts each token goes through

    @property
    def attn_params_per_layer(self) -> int:
        return 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def expert_params(self) -> int:
        return self.mlp_matrices * self.hidden * self.ffn

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params_total(self) -> int:
        router = self.hidden * self.experts if self.experts > 1 else 0
        per_layer = self.attn_params_per_layer + self.experts * self.expert_params + router
        return self.layers * per_layer + self.embedding_params

    @property
    def params_active(self) -> int:
        """Parameters a token goes through (all of them for a dense model)."""
        router = self.hidden * self.experts if self.experts > 1 else 0
        per_layer = self.attn_params_per_layer + self.active_experts * self.expert_params + router
        return self.layers * per_layer + self.embedding_params

    @property
    def params_active_nonembedding(self) -> int:
        """What a prompt token costs in matmuls (the output head runs only for the last token)."""
        return self.params_active - self.embedding_params

    def kv_bytes_per_token(self, bytes_per_element: float) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_element

    @property
    def is_moe(self) -> bool:
        return self.experts > 1


def _a(
    name, layers, hidden, heads, kv, ffn, vocab, tied=False, head_dim=None, mlp=3, experts=1, active=1
) -> Arch:
    return Arch(
        name, layers, hidden, heads, kv, head_dim or hidden // heads, ffn, vocab, tied, mlp, experts, active
    )


# Shapes from the models' published config.json files.
CATALOG: dict[str, Arch] = {
    a.name: a
    for a in [
        _a("llama2-7b", 32, 4096, 32, 32, 11008, 32000),
        _a("llama2-13b", 40, 5120, 40, 40, 13824, 32000),
        _a("llama2-70b", 80, 8192, 64, 8, 28672, 32000),
        _a("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
        _a("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
        _a("llama3.1-8b", 32, 4096, 32, 8, 14336, 128256),
        _a("llama3.1-70b", 80, 8192, 64, 8, 28672, 128256),
        _a("llama3.1-405b", 126, 16384, 128, 8, 53248, 128256),
        _a("mistral-7b", 32, 4096, 32, 8, 14336, 32000),
        _a("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, experts=8, active=2),
        # The source documents' "43B GPT" (NeMo): its architecture is not published; this is the
        # NeMo-Megatron shape for 25-52 B GPTs (../shared/reference/bench_and_sizing.md, section 5).
        _a("gpt-43b", 48, 8192, 64, 64, 32768, 256000, mlp=2),
        _a("smollm2-135m", 30, 576, 9, 3, 1536, 49152, tied=True),
        _a("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, tied=True),
        _a("qwen2.5-1.5b", 28, 1536, 12, 2, 8960, 151936, tied=True, head_dim=128),
        _a("qwen2.5-3b", 36, 2048, 16, 2, 11008, 151936, tied=True),
        _a("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064),
        _a("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064),
        _a("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064),
        _a("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064),
    ]
}


def from_config_json(path: Path) -> Arch:
    """Any Hugging Face config.json of a family tokenmill runs (models/architectures.py)."""
    try:
        c = json.loads(path.read_text())
        c = {**HF_DEFAULTS.get(c.get("model_type", ""), {}), **c}  # keys transformers 4 left out
        hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        return Arch(
            name=path.parent.name or path.stem,
            layers=int(c["num_hidden_layers"]),
            hidden=hidden,
            heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads),
            # A mixture's experts' width where the family names it apart (Qwen-MoE's moe_intermediate_size).
            ffn=int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 4 * hidden),
            vocab=int(c["vocab_size"]),
            tied=bool(c.get("tie_word_embeddings", False)),
            mlp_matrices=2 if str(c.get("hidden_act", "silu")).startswith("gelu") else 3,
            experts=int(c.get("num_local_experts") or c.get("num_experts") or 1),
            active_experts=int(c.get("num_experts_per_tok") or 1),
        )
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a usable config.json ({type(e).__name__}: {e})") from None


def from_gguf(path: Path) -> Arch:
    from tokenmill.weights.gguf_file import GGUFFile

    g = GGUFFile(path)

    def key(name: str, default=None):
        return g.arch_value(name, default)

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    vocab = len(g.metadata.get("tokenizer.ggml.tokens", [])) or int(key("vocab_size", 0))
    return Arch(
        name=path.stem,
        layers=int(key("block_count")),
        hidden=hidden,
        heads=heads,
        kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        ffn=int(key("feed_forward_length")),
        vocab=vocab,
        tied="output.weight" not in g.tensor_names(),
        experts=int(key("expert_count", 1) or 1),
        active_experts=int(key("expert_used_count", 1) or 1),
    )


def resolve(spec: str) -> Arch:
    """A catalog name, a config.json (or a directory holding one), or a .gguf file."""
    if spec in CATALOG:
        return CATALOG[spec]
    p = Path(spec)
    if p.is_dir() and (p / "config.json").is_file():
        return replace(from_config_json(p / "config.json"), name=p.name)
    if p.is_file() and p.suffix == ".json":
        return from_config_json(p)
    if p.is_file() and p.suffix == ".gguf":
        return from_gguf(p)
    raise ValueError(
        f"model {spec!r} is not in the sizing catalog ({', '.join(CATALOG)}) nor a config.json/.gguf"
    )
