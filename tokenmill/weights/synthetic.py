"""A GGUF file of a real model's shape filled with seeded random weights, for measuring speed and
memory on models bigger than any this machine can install (no model hub; the one embedded model is
135M parameters).

The file keeps the tokenizer and chat template of a source GGUF (the embedded SmolLM2-135M by default)
and takes the architecture of a named shape (SHAPES: the SmolLM2 family, whose members share that
tokenizer). Its weights are normal with a standard deviation of 0.02 (the usual initialisation), its
norms ones, quantized into the chosen block type by the gguf package, so tokenmill, llama.cpp and
transformers read the same values from it. What it says is noise; how fast an engine computes it is
not, since a dense model's step does the same work whatever the values (decoding with `ignore_eos`).

Tensors are generated and written one at a time (each from a seed of its own name), so making a
3.4 GB file holds one tensor in memory, not the model.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import quant_shape_to_byte_shape, quantize

INIT_STD = 0.02


@dataclass(frozen=True)
class Shape:
    """A llama-architecture model's dimensions (Hugging Face config.json names in comments)."""

    name: str
    hidden: int  # hidden_size
    layers: int  # num_hidden_layers
    ffn: int  # intermediate_size
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    rope_theta: float = 100000.0
    context: int = 8192  # max_position_embeddings
    tied: bool = True  # tie_word_embeddings: no output.weight

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self, vocab: int) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        layer = attn + 3 * self.hidden * self.ffn + 2 * self.hidden
        head = 0 if self.tied else vocab * self.hidden
        return vocab * self.hidden + self.layers * layer + self.hidden + head


# The SmolLM2 family's published configurations (all share the embedded model's 49152-token tokenizer).
SHAPES = {
    s.name: s
    for s in (
        Shape("smollm2-135m", hidden=576, layers=30, ffn=1536, heads=9, kv_heads=3),
        Shape("smollm2-360m", hidden=960, layers=32, ffn=2560, heads=15, kv_heads=5),
        Shape("smollm2-1.7b", hidden=2048, layers=24, ffn=8192, heads=32, kv_heads=32, rope_theta=130000.0),
    )
}

TYPES = {
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (GGMLQuantizationType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
}

# Source metadata carried over: the tokenizer and chat template; the rest (architecture, names, sizes,
# the reader's bookkeeping) describes the source model and is written anew from the shape.
_KEPT_PREFIX = "tokenizer."


def _tensors(shape: Shape, vocab: int) -> Iterator[tuple[str, tuple[int, int] | tuple[int], bool]]:
    """(GGUF name, PyTorch shape [out, in] or [n], is a matrix) in file order."""
    h, d = shape.hidden, shape.head_dim
    yield "token_embd.weight", (vocab, h), True
    for i in range(shape.layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (h,), False
        yield b + "attn_q.weight", (shape.heads * d, h), True
        yield b + "attn_k.weight", (shape.kv_heads * d, h), True
        yield b + "attn_v.weight", (shape.kv_heads * d, h), True
        yield b + "attn_output.weight", (h, shape.heads * d), True
        yield b + "ffn_norm.weight", (h,), False
        yield b + "ffn_gate.weight", (shape.ffn, h), True
        yield b + "ffn_up.weight", (shape.ffn, h), True
        yield b + "ffn_down.weight", (h, shape.ffn), True
    yield "output_norm.weight", (h,), False
    if not shape.tied:
        yield "output.weight", (vocab, h), True


def _values(name: str, dims: tuple[int, ...], seed: int, std: float) -> np.ndarray:
    """A matrix's random values, the same for the same (seed, name) whatever else the file holds."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    return rng.standard_normal(dims, dtype=np.float32) * np.float32(std)


def default_path(
    shape: Shape, type_name: str, seed: int, cache_dir: Path, head_type: str | None = None
) -> Path:
    """Where make_synthetic.py keeps a file: named by shape, seed and types, so one is made once."""
    head = f"-head-{head_type}" if head_type and head_type != type_name else ""
    return cache_dir / "synthetic" / f"{shape.name}-random{seed}-{type_name}{head}.gguf"


def synthesize(
    tokenizer_src: Path,
    dst: Path,
    shape: Shape,
    type_name: str = "bf16",
    seed: int = 0,
    std: float = INIT_STD,
    head_type: str | None = None,
) -> Path:
    """Write a `shape` model with random weights in `type_name` (TYPES) to `dst`, its tokenizer and
    chat template from `tokenizer_src` (a llama-architecture GGUF); norms and other vectors float32.
    `head_type`: another type for the embedding and output head, as llama.cpp's quantizer keeps them
    (a tied embedding is the head: Q6_K in its Q4 files, which the gguf package cannot write; Q8_0
    stands in for it).
    `std` other than INIT_STD is for tests: in a tiny model 0.02 leaves every layer's contribution
    too small to tell apart from the embedding. The file appears whole or not at all. Returns dst."""
    for t in (type_name, head_type or type_name):
        if t not in TYPES:
            raise ValueError(f"unknown type {t!r}; choose from {', '.join(TYPES)}")
    qtype, file_type = TYPES[type_name]
    head_qtype = TYPES[head_type or type_name][0]

    def type_of(name: str) -> GGMLQuantizationType:
        return head_qtype if name in ("token_embd.weight", "output.weight") else qtype

    if shape.hidden % shape.heads:
        raise ValueError(f"{shape.name}: hidden size {shape.hidden} is not a multiple of {shape.heads} heads")
    reader = GGUFReader(tokenizer_src)
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{tokenizer_src}: no tokenizer.ggml.tokens to borrow")
    vocab = len(tokens.data)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
    writer = GGUFWriter(str(tmp), "llama")
    writer.add_name(f"{shape.name} (random weights, seed {seed})")
    writer.add_file_type(int(file_type))
    writer.add_vocab_size(vocab)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    for field in reader.fields.values():
        if not field.name.startswith(_KEPT_PREFIX):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)

    layout = list(_tensors(shape, vocab))
    for name, dims, matrix in layout:
        if matrix:
            q = type_of(name)
            byte_shape = quant_shape_to_byte_shape(dims, q)
            nbytes = int(np.prod(byte_shape))
            if q == GGMLQuantizationType.F16:
                writer.add_tensor_info(name, dims, np.dtype(np.float16), nbytes)
            else:
                writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=q)
        else:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, matrix in layout:
        if matrix:
            values = _values(name, dims, seed, std)
            writer.write_tensor_data(np.ascontiguousarray(quantize(values, type_of(name))))
        else:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
    writer.close()
    os.replace(tmp, dst)
    return dst
