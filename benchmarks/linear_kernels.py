"""Linear-layer kernels on this CPU: time for all of SmolLM2-135M's matmuls at several batch sizes.

Compares plain bf16 `F.linear`, oneDNN-packed bf16 (`PackedLinear`) and the weight-only 4/8-bit
kernels (`QuantizedLinear`), relative to plain bf16 in the same run. This is where the packing
choice and the int4 row threshold (QUANT_MAX_ROWS) come from.

    python benchmarks/linear_kernels.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

from tokenmill.models.linear import PackedLinear, QuantizedLinear

# (out, in) of one SmolLM2 layer's fused qkv, o, gate_up, down; 30 layers; then the output head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def time_ms(mods: list[nn.Module], rows: int, reps: int = 5) -> float:
    xs = {i: torch.randn(rows, i, dtype=torch.bfloat16) for i in (576, 1536)}
    for _ in range(2):
        for m, (_, i) in zip(mods, SHAPES, strict=True):
            m(xs[i])
    t0 = time.perf_counter()
    for _ in range(reps):
        for m, (_, i) in zip(mods, SHAPES, strict=True):
            m(xs[i])
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    torch.manual_seed(0)
    plain = [nn.Linear(i, o, bias=False).to(torch.bfloat16) for o, i in SHAPES]
    packed = [PackedLinear(m) for m in plain]
    bits = [8 if o == 49152 else 4 for o, _ in SHAPES]  # the head at 8 bits, as quantization='int4' does
    quant = [QuantizedLinear(m, b, max_rows=10**6) for m, b in zip(plain, bits, strict=True)]
    print(f"{'rows':>5} {'bf16 ms':>9} {'packed ms':>10} {'ratio':>6} {'int4 ms':>9} {'ratio':>6}")
    for rows in (1, 2, 4, 8, 16, 64, 256):
        a, b, c = time_ms(plain, rows), time_ms(packed, rows), time_ms(quant, rows)
        print(f"{rows:5d} {a:9.2f} {b:10.2f} {a / b:6.2f} {c:9.2f} {a / c:6.2f}")


if __name__ == "__main__":
    main()
