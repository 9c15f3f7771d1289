"""8-bit KV cache rows: what `--kv-cache-dtype int8|fp8` stores, in plain PyTorch (the reference the
C++ kernels are tested against).

Each (token, kv head) row of D values is stored as D bytes followed by its own float32 scale (D + 4
bytes, against 2D in bfloat16): value = code * scale.
- int8: symmetric, scale = max|x| / 127, code = round(x / scale) in [-127, 127].
- fp8: e4m3 (float8_e4m3fn), scale = max|x| / 448, code = x / scale rounded to the nearest e4m3.
A scale per row rather than per tensor needs no calibration and follows outlier heads and tokens; the
scale living inside the row keeps a block one contiguous run of bytes, so offload tiers and KV transfer
move 8-bit blocks exactly as they move bfloat16 ones.
"""

from __future__ import annotations

import torch

KV_FORMATS = ("int8", "fp8")
SCALE_BYTES = 4  # one float32 after each row's codes
_CODE_MAX = {"int8": 127.0, "fp8": 448.0}


def check_format(fmt: str | None) -> None:
    if fmt is not None and fmt not in KV_FORMATS:
        raise ValueError(f"unknown KV cache format {fmt!r}; available: {', '.join(KV_FORMATS)}")


def quantize_rows(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """[..., D] floats -> [..., D + 4] uint8: each row's codes, then its float32 scale's bytes."""
    xf = x.float()
    top = _CODE_MAX[fmt]
    scale = xf.abs().amax(-1, keepdim=True) / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: codes 0, scale 1
    y = (xf / scale).clamp(-top, top)
    if fmt == "int8":
        codes = torch.round(y).to(torch.int8).view(torch.uint8)
    else:
        codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([codes, scale.contiguous().view(torch.uint8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] uint8 -> [..., D] of `dtype` (the product is formed in float32, rounded once)."""
    d = rows.shape[-1] - SCALE_BYTES
    raw = rows.contiguous()
    codes = raw[..., :d]
    scale = raw[..., d:].contiguous().view(torch.float32)  # [..., 1]
    if fmt == "int8":
        vals = codes.view(torch.int8).float()
    else:
        vals = codes.contiguous().view(torch.float8_e4m3fn).float()
    return (vals * scale).to(dtype)
