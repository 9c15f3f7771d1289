"""Packed linears: rows padded to a few bucket sizes, results for the real rows only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.models.linear import PackedLinear, onednn_packing_available, row_bucket


def test_buckets_are_few_and_close() -> None:
    sizes = {row_bucket(m) for m in range(1, 2049)}
    assert len(sizes) < 128, "a bounded number of shapes whatever the step size"
    for m in range(1, 4097):
        b = row_bucket(m)
        assert b >= m and (m <= 16 and b == m or b - m < max(8, 0.07 * m))


@pytest.mark.skipif(
    not onednn_packing_available(torch.zeros(1, dtype=torch.bfloat16)), reason="needs oneDNN bf16 packing"
)
@pytest.mark.parametrize("rows", [1, 16, 17, 100, 300, 1100])
def test_padded_rows_give_the_unpadded_answer(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(576, 960, bias=True).to(torch.bfloat16)
    packed = PackedLinear(lin)
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    y = packed(x)
    assert y.shape == (rows, 960) and y.is_contiguous()
    exact = x.double() @ lin.weight.double().t() + lin.bias.double()
    assert float((y.double() - exact).norm() / exact.norm()) < 2**-8
