"""What a decode step must read, and how fast this machine reads it: the bandwidth limit that issue #17
asks every throughput figure to be set against.

A decode step reads every weight its matmuls use and the KV cache of every stream it carries, so
(weight bytes + KV bytes) / read bandwidth is the fastest a step can be; a measured step time against
that limit is the share of the machine's bandwidth the engine uses. The weight bytes are counted per
engine as each one stores them: tokenmill's from its built model (what the kernels read at that row
count, weight_bytes), a GGUF file's from its tensors as stored, an HF directory's from its safetensors.
"""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import torch

# safetensors dtypes' sizes in bytes
_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


def read_bandwidth_gbs(reps: int = 5) -> float:
    """A sum over 1 GiB with the threads PyTorch uses: the read rate a decode step could reach."""
    x = torch.ones(2**28, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def weight_bytes(model: torch.nn.Module, rows: int) -> int:
    """Bytes of the weights a tokenmill decode step of `rows` rows reads through its linears (bf16: 2
    bytes each; int8: 1, plus a float16 scale per 32 in its group form; int4: half a byte plus its scales
    where its panel kernel runs, elsewhere up to 4 rows, above which the layer uses its bf16 copy; fp8: 1
    where its panel kernel runs, else its codes as bf16)."""
    from tokenmill.models.fp8_linear import Fp8Linear
    from tokenmill.models.linear import (
        GroupInt8Linear,
        Int8Linear,
        LinearBase,
        PackedLinear,
        QuantizedLinear,
        takes,
    )

    total = 0
    # A quantized layer's bf16 copy (QuantizedLinear's, above its row limit; Fp8Linear's codes as bf16,
    # above its panel kernel's) is counted with the layer.
    twins = {id(m.wide) for m in model.modules() if isinstance(m, (QuantizedLinear, Fp8Linear)) and m.wide}
    for m in model.modules():
        if id(m) in twins:
            continue
        if isinstance(m, QuantizedLinear):
            limit = rows if m.max_rows is None else m.max_rows  # None: the kernel takes every step
            if rows <= limit and m.small is not None:  # the panels: codes, and scales (and minima)
                total += m.small.panels.numel() * m.small.panels.element_size()
                scales = getattr(m.small, "scales", None)
                total += 0 if scales is None else scales.numel() * scales.element_size()
            elif rows <= limit:
                total += (
                    m.qweight.numel() * m.qweight.element_size() + m.scales.numel() * m.scales.element_size()
                )
            else:
                total += 2 * m.in_features * m.out_features
        elif isinstance(m, Fp8Linear):  # one byte a code in its panels, else its codes read as bf16
            if takes(m.small_rows, rows):
                total += m.in_features * m.out_features + 4 * m.out_features
            else:
                total += 2 * m.in_features * m.out_features
        elif isinstance(m, Int8Linear):
            total += m.in_features * m.out_features + 4 * m.out_features
        elif isinstance(m, GroupInt8Linear):  # its panels: codes and a float16 scale per group of 32
            total += m.kernel.panels.numel() * m.kernel.panels.element_size()
        elif isinstance(m, (PackedLinear, LinearBase, torch.nn.Linear)):
            total += 2 * m.in_features * m.out_features
    return total


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of a GGUF file's matmul weights as stored (its blocks' codes and scales): every 2-D tensor of
    the layers, and the output head (the embedding when the file ties them), which llama.cpp reads
    whole each step."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    total = sum(int(t.n_bytes) for n, t in tensors.items() if n.startswith("blk.") and len(t.shape) == 2)
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    return total + int(head.n_bytes)


def hf_weight_bytes(hf_dir: Path) -> int:
    """Bytes of an HF directory's matmul weights as stored: the layers' 2-D tensors, and the output head
    (the embedding when the config ties them). Read from the safetensors headers alone."""
    shapes: dict[str, tuple[list[int], str]] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        shapes.update({k: (v["shape"], v["dtype"]) for k, v in header.items() if k != "__metadata__"})

    def size(name: str) -> int:
        shape, dtype = shapes[name]
        return _DTYPE_BYTES[dtype] * math.prod(shape)

    total = sum(size(k) for k, (s, _) in shapes.items() if ".layers." in k and len(s) == 2)
    head = "lm_head.weight" if "lm_head.weight" in shapes else "model.embed_tokens.weight"
    return total + size(head)


def limit_ms(weights: int, kv_per_token: float, streams: int, context: float, bandwidth_gbs: float) -> float:
    """The fastest a decode step of `streams` streams of `context` tokens each can be at this bandwidth."""
    return (weights + streams * context * kv_per_token) / (bandwidth_gbs * 1e9) * 1e3
