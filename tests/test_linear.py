"""Packed linears: rows padded to a few bucket sizes, results for the real rows only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.models.linear import PackedLinear, amx_brgemm_available, onednn_packing_available, row_bucket


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


@pytest.mark.skipif(
    not onednn_packing_available(torch.zeros(1, dtype=torch.bfloat16)), reason="needs oneDNN bf16 packing"
)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 32, 96, 97, 256, 257, 700])
def test_few_row_kernel_and_onednn_agree(rows: int) -> None:
    """Steps of up to `small.max_rows` rows (every count on AVX512-BF16 without AMX, 256 rows a sweep) go
    through the C++ panel kernels, larger ones through oneDNN: both within bf16 rounding of the float64
    product, bias added."""
    from tokenmill.models.ops import get_ops

    ops = get_ops("cpu", "cpu")
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(1536, 576, bias=True).to(torch.bfloat16)
    small = ops.small_matmul_for(lin.weight.detach())
    dot = not amx_brgemm_available() and ops.k.panel_dot_available()  # type: ignore[attr-defined]
    assert small is not None and small.max_rows == (96 if amx_brgemm_available() else None if dot else 4)
    assert ops.panels_take_every_row() == dot
    with_small, onednn_only = PackedLinear(lin, small), PackedLinear(lin)
    x = torch.randn(rows, 1536, generator=g).to(torch.bfloat16)
    exact = x.double() @ lin.weight.double().t() + lin.bias.double()
    for y in (with_small(x), onednn_only(x)):
        assert y.shape == (rows, 576) and y.dtype == torch.bfloat16
        assert float((y.double() - exact).norm() / exact.norm()) < 2**-8
    gap = (with_small(x).double() - onednn_only(x).double()).abs().max()
    assert float(gap) <= 2**-6 * float(exact.abs().max())


def _dot_ops():  # noqa: ANN202 - the CPU ops where the panels take every row count, else a skip
    from tokenmill.models.ops import get_ops

    ops = get_ops("auto", "cpu")
    if not ops.panels_take_every_row():
        pytest.skip("the bf16 panels take every row count only on AVX512-BF16 builds without AMX")
    return ops


def test_panels_of_every_row_count_are_the_only_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the panels take every row count, a packed linear keeps no oneDNN copy of the weight (unless
    a benchmark asks for one to compare), takes rows of any shape, and the model's copy limit, which is
    for a second copy, does not drop them."""
    from tokenmill.models import linear

    ops = _dot_ops()
    lin = nn.Linear(576, 960, bias=True).to(torch.bfloat16)
    sole = PackedLinear(lin, ops.small_matmul_for(lin.weight.detach()))
    assert sole.packed is None
    x = torch.randn(2, 300, 576).to(torch.bfloat16)  # three dimensions, two sweeps of rows
    exact = x.double() @ lin.weight.double().t() + lin.bias.double()
    y = sole(x)
    assert y.shape == (2, 300, 960) and float((y.double() - exact).norm() / exact.norm()) < 2**-8
    xt = x[0].t().contiguous().t()  # elements strided: oneDNN took such rows, the panels copy them first
    assert torch.equal(sole(xt), y[0])
    monkeypatch.setattr(linear, "KEEP_ONEDNN_COPY", True)
    assert PackedLinear(lin, ops.small_matmul_for(lin.weight.detach())).packed is not None
    monkeypatch.setattr(linear, "KEEP_ONEDNN_COPY", False)

    monkeypatch.setattr(linear, "SMALL_COPY_LIMIT_BYTES", 0)
    for sole_flag, kernel in ((True, True), (False, False)):
        model = nn.Sequential(nn.Linear(576, 960).to(torch.bfloat16))
        linear.pack_linears(model, ops.small_matmul_for, sole=sole_flag)
        assert (model[0].small is not None) == kernel
        assert (model[0].packed is None) == kernel
