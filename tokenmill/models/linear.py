"""Linear layers prepared for the device they run on.

On a CPU with oneDNN, bfloat16 weights are reordered once into oneDNN's blocked layout: a matmul then
skips the per-call weight reorder, which measured 1.5x faster here at batch 1 and at batch 256
(benchmarks/linear_kernels.py). Elsewhere (CUDA, float32) the plain PyTorch linear is used.
"""

from __future__ import annotations

import torch
from torch import nn


def onednn_packing_available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """A bf16 linear whose weight lives in oneDNN's blocked layout (CPU inference only)."""

    # The batch size oneDNN tunes the layout for; measured best across 1..256 rows (see module doc).
    PACK_HINT = 64

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), self.PACK_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear that can be packed; return how many were."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and onednn_packing_available(child.weight):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
