"""Column- and row-parallel linear layers: each holds its tensor-parallel rank's part of a weight, and
cuts that part from the full checkpoint tensor itself when weights are loaded (`load`).

A column-parallel layer keeps rows of its output; a fused one (qkv, gate_up) keeps rows of each of
its parts: q heads, then k heads, then v heads; gate columns, then the same up columns. A
row-parallel layer keeps the matching columns of its input; its output is a partial sum, which its
block all-reduces (there, not here, so that packing or quantizing the layer keeps the reduction).
Without tensor parallelism every part is whole, and `load` returns the tensor itself (no copy).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.models.linear import LinearBase
from tokenmill.weights.group_codes import GROUP, C, GroupCodes, Int8Groups


@dataclass(frozen=True)
class Part:
    """One fused part of a column-parallel output: `size` rows in the full tensor, of which this rank
    keeps units `keep` (a unit is `unit` rows: a head's head_dim, or 1)."""

    size: int
    keep: range
    unit: int = 1

    @property
    def whole(self) -> bool:
        return self.keep.start == 0 and len(self.keep) * self.unit == self.size


class ParallelLinear(LinearBase, ABC):
    """y = x W^T + b with this rank's part of W (and b)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    @abstractmethod
    def load(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full checkpoint tensor for parameter `name` ("weight" or "bias")."""

    @abstractmethod
    def load_codes(self, full: C) -> C | None:
        """This rank's part of the full weight's codes (4-bit or 8-bit groups, weights/group_codes.py), or
        None where the cut would split a group of 32."""


class ColumnParallelLinear(ParallelLinear):
    def __init__(self, in_features: int, parts: list[Part], bias: bool = False) -> None:
        super().__init__(in_features, sum(len(p.keep) * p.unit for p in parts), bias)
        self.parts = parts

    def load(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if sum(p.size for p in self.parts) != full.shape[0]:
            sizes = [p.size for p in self.parts]
            raise ValueError(f"{name}: {full.shape[0]} rows, but the parts add up to {sizes}")
        if all(p.whole for p in self.parts):
            return full
        pieces, start = [], 0
        for p in self.parts:
            pieces.append(full[start + p.keep.start * p.unit : start + p.keep.stop * p.unit])
            start += p.size
        return torch.cat(pieces)

    def load_codes(self, full: C) -> C:
        if isinstance(full, Int8Groups):
            return Int8Groups(self.load("weight", full.q), self.load("weight", full.scale))
        return GroupCodes(*(self.load("weight", t) for t in (full.nibbles, full.scale, full.lo)))


class RowParallelLinear(ParallelLinear):
    def __init__(self, keep: range, unit: int, full_in: int, out_features: int) -> None:
        # A bias would be added once per rank and summed tp times: row-parallel layers take none.
        super().__init__(len(keep) * unit, out_features, bias=False)
        self.part = Part(full_in, keep, unit)

    def load(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name != "weight":
            raise ValueError("a bias on a row-parallel layer is not supported")
        if full.shape[1] != self.part.size:
            raise ValueError(f"weight has {full.shape[1]} input columns, expected {self.part.size}")
        if self.part.whole:
            return full
        p = self.part
        return full[:, p.keep.start * p.unit : p.keep.stop * p.unit]

    def load_codes(self, full: C) -> C | None:
        if full.shape[1] != self.part.size:
            raise ValueError(f"codes have {full.shape[1]} input columns, expected {self.part.size}")
        start, stop = self.part.keep.start * self.part.unit, self.part.keep.stop * self.part.unit
        if start % GROUP or stop % GROUP:
            return None
        groups = slice(start // GROUP, stop // GROUP)
        if isinstance(full, Int8Groups):
            return Int8Groups(full.q[:, start:stop], full.scale[:, groups])
        return GroupCodes(full.nibbles[:, start // 2 : stop // 2], full.scale[:, groups], full.lo[:, groups])
