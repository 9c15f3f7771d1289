"""What a step must compute, and how fast this machine computes it: the other side of the roofline.

step_bytes.py sets a step against the time it takes to read its bytes. That limit says nothing once a
step carries many rows: at 32 streams a 135M model's bf16 decode step reads 270 MB of weights but
computes 2 x 134.5 M x 32 = 8.6 GFLOP, and on these 2-core machines the arithmetic takes longer than
the reads. The fastest a step can be is the larger of the two times, reading its bytes at the read
bandwidth and doing its arithmetic at the best matmul rate this machine reaches:

- bf16 arithmetic (bf16 or dequantized weights with bf16 activations) at oneDNN's bf16 matmul rate on a
  2048-cube with the weight prepacked (vdpbf16ps, or AMX tiles where the CPU has them);
- int8 arithmetic (weights and activations both in 8 bits: tokenmill's int8 and int4's W4A8, llama.cpp's
  quantized types against its 8-bit activation blocks) at PyTorch's int8 matmul rate (oneDNN u8s8 or
  s8s8 with VNNI or AMX).

The rates are measured, not taken from a datasheet: a virtual CPU's clock is not known here, and the
measured rate is what a kernel can actually reach on it (the panels of kernels/csrc reach it within a few
percent: docs/history/benchmarks.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

CUBE = 2048  # M = K = N of the timed matmul: big enough to be bound by arithmetic, ~20 ms a call in bf16


def _best_seconds(f: Callable[[], object], reps: int) -> float:
    f()  # first call: oneDNN builds its kernel
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_rate_gflops(arithmetic: str, reps: int = 5) -> float:
    """GFLOP/s (int8: GOP/s) of a CUBE^3 matmul with the threads PyTorch uses: "bf16", "float32" or "int8"
    ("bf16" is float32's rate on a CPU without a bf16 matmul)."""
    gen = torch.Generator().manual_seed(0)
    if arithmetic == "bf16":
        x = torch.randn(CUBE, CUBE, generator=gen).to(torch.bfloat16)
        w = torch.randn(CUBE, CUBE, generator=gen).to(torch.bfloat16)
        if torch.backends.mkldnn.is_available():
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            except RuntimeError:
                # No bf16 matmul on this CPU (AVX2 only: neither AVX512-BF16 nor AVX-NE-CONVERT): every
                # engine widens bf16 weights and multiplies in float32 there, so float32's rate is the limit.
                return matmul_rate_gflops("float32", reps)
            secs = _best_seconds(
                lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), reps
            )
        else:
            secs = _best_seconds(lambda: x @ w.t(), reps)
    elif arithmetic == "float32":
        x = torch.randn(CUBE, CUBE, generator=gen)
        w = torch.randn(CUBE, CUBE, generator=gen)
        secs = _best_seconds(lambda: x @ w.t(), reps)
    elif arithmetic == "int8":
        a = torch.randint(-128, 128, (CUBE, CUBE), dtype=torch.int8, generator=gen)
        b = torch.randint(-128, 128, (CUBE, CUBE), dtype=torch.int8, generator=gen)
        secs = _best_seconds(lambda: torch._int_mm(a, b), reps)
    else:
        raise ValueError(f"arithmetic must be bf16, float32 or int8, got {arithmetic!r}")
    return 2 * CUBE**3 / secs / 1e9


def flop(
    body_params: float,
    head_params: float,
    attn_width: int,
    layers: int,
    prompt_tokens: float,
    output_tokens: float,
    attended: float,
) -> float:
    """FLOPs of running tokens through a model: prompt and output tokens through the layers' matmuls (2
    a weight), output tokens through the head as well (a prompt token skips it), and attention over
    `attended` (query, cached token) pairs: QK^T and PV, 4 FLOP a pair and query head dimension.

    body_params: the parameters a token's matmuls go through in the layers; head_params: vocab x hidden;
    attn_width: heads x head_dim."""
    return (
        2 * body_params * (prompt_tokens + output_tokens)
        + 2 * head_params * output_tokens
        + 4 * attn_width * layers * attended
    )


def decode_step_gflop(
    body_params: int, head_params: int, attn_width: int, layers: int, streams: int, isl: int, osl: int
) -> float:
    """GFLOP of one decode step of `streams` closed-loop streams, each request `isl` prompt tokens then
    `osl` output tokens: every stream's output token, its share of its prompt (isl / osl prompt tokens
    an output token) with the prompt's own causal attention shared out the same way, and attention over
    the stream's mean context."""
    context = isl + osl / 2  # a stream's mean context over its decode steps
    attended = context + isl * isl / 2 / osl  # causal: half the prompt's square
    return streams * flop(body_params, head_params, attn_width, layers, isl / osl, 1, attended) / 1e9
