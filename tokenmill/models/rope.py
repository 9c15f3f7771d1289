"""Rotary position embeddings (HF "rotate half" layout), with Llama 3, linear and LongRoPE scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenmill.models.config import ROPE_TYPES


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    freq_factors: list[float] | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the position scale for one rope configuration."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    position_scale = 1.0
    if freq_factors is not None:
        # GGUF files of Llama 3.1 carry the scaled frequencies as a tensor of divisors.
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float64)
    rope_type = (scaling or {}).get("rope_type", "default")
    if freq_factors is not None or rope_type == "default":
        pass
    elif rope_type == "linear":
        position_scale = 1.0 / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif rope_type == "longrope":
        inv_freq = inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float64)
    else:
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    return inv_freq.float(), position_scale


def longrope_attention_factor(scaling: dict[str, Any]) -> float:
    """LongRoPE's scale of cos and sin: given, or from how far the context was stretched."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_scale(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies rope to q and k of a flat token batch, looking cos/sin up by absolute position."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        freq_factors: list[float] | None = None,
    ) -> None:
        super().__init__()
        inv_freq, pos_scale = rope_inv_freq(head_dim, theta, scaling, freq_factors)
        pos = torch.arange(max_positions, dtype=torch.float32) * pos_scale
        freqs = torch.outer(pos, inv_freq)
        scale = 1.0
        if (scaling or {}).get("rope_type") == "longrope":
            assert scaling is not None
            # LongRoPE (Phi-3.5, Phi-4-mini): positions within the pretrained context turn at the short
            # factors' frequencies, those past it at the long ones'. Transformers switches a whole forward
            # pass to the long factors once any position passes it; by position, a key's rotation never
            # depends on what else is in the batch, so cached keys and prefix hits stay valid. Identical to
            # transformers within original_max_position_embeddings.
            original = int(scaling["original_max_position_embeddings"])
            base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
            long = (1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float64) * base)).float()
            freqs[original:] = torch.outer(pos[original:], long)
            scale = longrope_attention_factor(scaling)
        emb = torch.cat([freqs, freqs], dim=-1)
        # Not parameters: rebuilt from the config, never saved with the weights.
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        sin = emb.sin() * scale
        half = head_dim // 2
        sin[:, :half] = -sin[:, :half]  # rotate_half(x) = [-x2, x1] = roll(x, half) * [-1, +1]
        self.register_buffer("sin_signed", sin, persistent=False)
