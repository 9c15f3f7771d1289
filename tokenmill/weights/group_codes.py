"""4-bit weights as groups of 32 codes with a scale and a minimum each, w = q * scale + lo: the form of
tokenmill's int4 quantization, and of the 4-bit tensors of a GGUF file (Q4_0, Q4_1, Q4_K).

Read straight from a GGUF file's blocks, the codes are the file's own: an int4 model then computes with
the weights llama.cpp computes with, not with the file dequantized, rounded to bf16 and quantized again
(which moves most group scales and minima, and throws away the scale search a Q4_K file was made
with). Q4_0 and Q4_1 blocks hold float16 scales, kept exactly; a Q4_K group's scale is a float16 times
a 6-bit integer, which the kernels round back to float16 (a relative error of at most 2^-12).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from gguf import GGMLQuantizationType

GROUP = 32

# Block sizes in bytes (32 values; 256 for Q4_K) of the types read here.
_Q4_0_BYTES, _Q4_1_BYTES, _Q4_K_BYTES, _Q8_0_BYTES = 18, 20, 144, 34


@dataclass
class GroupCodes:
    """One [N, K] weight in 4-bit groups: `nibbles` uint8 [N, K / 2], the codes 0..15 two to a byte (even
    k in the low nibble, odd k in the high one: half the memory while a model's worth waits to be
    taken); `scale` and `lo` float32 [N, K / 32]. Rows cut or concatenated alike in all three stay one
    weight's codes."""

    nibbles: torch.Tensor
    scale: torch.Tensor
    lo: torch.Tensor

    @staticmethod
    def of(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> GroupCodes:
        """From codes one to a byte, q [N, K]."""
        q = q.to(torch.uint8)
        return GroupCodes((q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), scale, lo)

    @property
    def q(self) -> torch.Tensor:
        """The codes one to a byte, uint8 [N, K] (unpacked anew on each call)."""
        b = self.nibbles
        return torch.stack([b & 0x0F, b >> 4], dim=-1).view(b.shape[0], -1)

    @property
    def shape(self) -> tuple[int, int]:
        return self.nibbles.shape[0], 2 * self.nibbles.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the codes stand for."""
        n, k = self.shape
        groups = self.q.view(n, k // GROUP, GROUP).float()
        return (groups * self.scale[..., None] + self.lo[..., None]).view(n, k)


def quantize_groups(w: torch.Tensor) -> GroupCodes:
    """Asymmetric 4-bit codes of a float weight [N, K] (K a multiple of 32): each group's minimum and
    (max - min) / 15, as a Q4_1 block is made."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"in_features {k} is not a multiple of {GROUP}")
    groups = w.float().view(n, k // GROUP, GROUP)
    lo = groups.amin(-1, keepdim=True)
    scale = ((groups.amax(-1, keepdim=True) - lo) / 15).clamp(min=1e-10)
    q = torch.round((groups - lo) / scale).clamp(0, 15)
    return GroupCodes.of(q.view(n, k), scale.view(n, -1), lo.view(n, -1))


FOUR_BIT_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)


def codes_from_blocks(raw: np.ndarray, qtype: GGMLQuantizationType, n: int, k: int) -> GroupCodes:
    """The codes of a GGUF tensor of type Q4_0, Q4_1 or Q4_K: `raw` its blocks, [N, bytes per row]
    uint8, for a weight [N, K]."""
    if qtype not in FOUR_BIT_TYPES:
        raise ValueError(f"{qtype.name} is not a 4-bit group type")
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1)
    if qtype == GGMLQuantizationType.Q4_K:
        return _q4_k(raw, n, k)
    size = _Q4_0_BYTES if qtype == GGMLQuantizationType.Q4_0 else _Q4_1_BYTES
    blocks = raw.reshape(n, k // GROUP, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == GGMLQuantizationType.Q4_0:
        lo = -8 * d  # w = d * (q - 8); exact, a power of two times a float16
        packed = blocks[..., 2:]
    else:
        lo = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = blocks[..., 4:]
    return GroupCodes.of(_nibbles(packed, n, k), torch.from_numpy(d), torch.from_numpy(lo))


def _nibbles(packed: np.ndarray, n: int, k: int) -> torch.Tensor:
    """Codes from 16-byte runs holding a group of 32: values 0-15 in the low nibbles, 16-31 in the high."""
    packed = packed.reshape(n, -1, 1, 16)
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=2)
    return torch.from_numpy(np.ascontiguousarray(codes.reshape(n, k)))


def _q4_k(raw: np.ndarray, n: int, k: int) -> GroupCodes:
    # A super-block of 256: float16 d and dmin, 12 bytes of 6-bit scales and minima for its 8 groups
    # (w = d * sc * q - dmin * m), then 128 bytes of codes: each 32 bytes hold two groups, the first in
    # the low nibbles, the second in the high ones.
    blocks = raw.reshape(n, k // 256, _Q4_K_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = blocks[..., 4:16]
    # Bytes 0-3: scales of groups 0-3 (low 6 bits); 4-7: minima of groups 0-3; 8-11: low nibble the
    # scale, high nibble the minimum of groups 4-7, whose top two bits are the top bits of bytes 0-7.
    sc = np.concatenate([s[..., 0:4] & 0x3F, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 0x3F, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    scale = d[..., None] * sc.astype(np.float32)  # exact in float32: 11 bits times 6
    lo = -(dmin[..., None] * mn.astype(np.float32))
    q = blocks[..., 16:].reshape(n, k // 256, 4, 1, 32)
    codes = np.concatenate([q & 0x0F, q >> 4], axis=3).reshape(n, k)
    return GroupCodes.of(
        torch.from_numpy(np.ascontiguousarray(codes)),
        torch.from_numpy(scale.reshape(n, -1)),
        torch.from_numpy(lo.reshape(n, -1)),
    )


@dataclass
class Int8Groups:
    """One [N, K] weight as int8 codes with a scale per output row and group of 32 k, w = q * scale: the
    form of a Q8_0 GGUF tensor (whose codes span -128..127 and whose scales are float16). `q` int8
    [N, K]; `scale` float32 [N, K / 32], values float16 holds exactly (the kernels keep float16)."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the codes stand for."""
        n, k = self.shape
        return (self.q.float().view(n, k // GROUP, GROUP) * self.scale[..., None]).view(n, k)


def quantize_int8_groups(w: torch.Tensor) -> Int8Groups:
    """Symmetric 8-bit codes of a float weight [N, K] (K a multiple of 32) in a Q8_0 block's form: per
    group d = max|w| / 127 in float16, and q = round(w / d) against that rounded d (halves to even;
    llama.cpp divides by the unrounded d and rounds halves away from zero, which can differ by one in a
    code). A Q8_0 tensor's dequantized values come back to its own codes and scales."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"in_features {k} is not a multiple of {GROUP}")
    groups = w.float().view(n, k // GROUP, GROUP)
    d = (groups.abs().amax(-1) / 127).to(torch.float16).float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(groups * inv[..., None]).clamp(-128, 127).to(torch.int8)
    return Int8Groups(q.view(n, k), d)


def int8_groups_from_blocks(raw: np.ndarray, n: int, k: int) -> Int8Groups:
    """The codes and scales of a Q8_0 GGUF tensor: `raw` its blocks (a float16 scale, then 32 int8
    codes), [N, bytes per row] uint8, for a weight [N, K]."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // GROUP, _Q8_0_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return Int8Groups(torch.from_numpy(q), torch.from_numpy(d))


# A linear weight's codes as a file gives them and a layer takes them: 4-bit groups (int4) or 8-bit
# groups (int8 in Q8_0's form); C: one of the two, the same through a function.
Codes = GroupCodes | Int8Groups
C = TypeVar("C", GroupCodes, Int8Groups)
