"""bfloat16 weights with float32 arithmetic, for CPUs without BF16 instructions.

On such CPUs (AVX2: AMD Zen 3 and older, Intel's client CPUs; AVX-512 without BF16) a bf16 matmul is
emulated: oneDNN and PyTorch widen both sides, multiply, and round back at every step. Measured on an
AMD EPYC Zen 3 (issue 52), SmolLM2-135M offline ran 44.6 tok/s at one stream and 23.0 at 32 (slower at a
batch than alone), float32 weights 18.9 and 106.9. Here a bf16 model computes in float32 (its activations,
norms, attention and KV cache), while each linear keeps its weight as bf16 panels that the kernel widens
to float32 as it reads them (kernels/csrc/panel_wide.cpp): bf16's bytes at decode, float32's FMAs at
batches and prompts. Only the C++ kernels' builds without the BF16 loops (levels avx2 and avx512) take
this path; `kernels="torch"` keeps the plain bf16 reference everywhere.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tokenmill.models.linear import LinearBase, plain_linears

log = logging.getLogger(__name__)

# The kernel builds whose CPUs lack BF16 instructions: their bf16 models compute in float32.
WIDENING_LEVELS = ("avx2", "avx512")


class WideLinear(LinearBase):
    """A linear whose weight is held as bf16 panels and computed in float32 (any number of rows)."""

    prepared = True

    def __init__(self, linear: nn.Module, kernels: object) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.out_features, self.in_features = w.shape
        self.k = kernels
        self.panels = kernels.panel_pack(w.to(torch.bfloat16).contiguous())  # type: ignore[attr-defined]
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1:  # a step's rows, as ever
            y = self.k.panel_matmul_wide(x, self.panels, self.out_features)  # type: ignore[attr-defined]
        else:
            rows = x.reshape(-1, self.in_features).float().contiguous()
            y = self.k.panel_matmul_wide(rows, self.panels, self.out_features)  # type: ignore[attr-defined]
            y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)


class WideEmbedding(nn.Module):
    """An embedding table kept in bf16 (half float32's bytes: a vocabulary's table is a large share of a
    small model), its rows looked up as float32, exactly (a bf16 number is a float32 one)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = nn.Parameter(embedding.weight.detach().to(torch.bfloat16), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight).float()


def widen_linears(model: nn.Module, kernels: object) -> int:
    """Replace every linear still computed by a plain matmul (and whose K the panels pair) by a WideLinear
    of the kernels `kernels`; return how many were."""
    sites = plain_linears(model, lambda _, child: child.weight.dim() == 2 and child.weight.shape[1] % 2 == 0)
    for parent, name, _, child in sites:
        setattr(parent, name, WideLinear(child, kernels))
    return len(sites)
