"""fp8 (e4m3) linears against a float64 product of the same e4m3 numbers, and the rounding itself."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.config import EngineConfig
from tokenmill.models.fp8_linear import E4M3, Fp8Linear, to_e4m3
from tokenmill.models.ops import get_ops


def test_e4m3_rounding_is_pytorchs_and_maps_each_rows_largest_to_448() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 100, generator=g) * torch.logspace(-3, 3, 8)[:, None]
    x[3] = 0.0  # an all-zero row: scale floored, codes zero
    codes, scale = to_e4m3(x, dim=-1)
    assert codes.dtype == E4M3 and scale.shape == (8, 1)
    assert torch.equal(codes.float(), (x / scale).to(E4M3).float())  # PyTorch's round-to-nearest-even
    nonzero = [r for r in range(8) if r != 3]
    assert torch.equal(codes.float().abs().amax(-1)[nonzero], torch.full((7,), 448.0))
    assert torch.equal(codes[3].float(), torch.zeros(100))
    # e4m3 keeps three mantissa bits: every element within 2^-4 of itself (normal range) or of the
    # row's smallest step.
    back = codes.float() * scale
    assert ((back - x).abs() <= x.abs() * 2**-4 + scale * 2**-9).all()


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_computes_the_product_of_the_e4m3_numbers(ops: str, rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(256, 96, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 256, generator=g) * 0.05)
    x = (torch.randn(rows, 256, generator=g) * 3).to(torch.bfloat16)
    o = get_ops(ops, "cpu")
    y = Fp8Linear(lin, o.e4m3_rows, o.scale_rows_cols)(x)

    w_codes, w_scale = to_e4m3(lin.weight.detach(), dim=1)
    x_codes, x_scale = to_e4m3(x, dim=-1)
    exact = (x_codes.double() * x_scale.double()) @ (w_codes.double() * w_scale.double()).t()
    if bias:
        exact = exact + lin.bias.detach().double()
    # Codes exact in bf16, products summed in float32; the output rounded to bf16 before the scales
    # and after: two roundings of 2^-9 relative each (a sum that cancels shows it as absolute error).
    torch.testing.assert_close(y.double(), exact, atol=2e-3 * exact.abs().max().item(), rtol=2**-7)
    # And it is a quantization: away from the bf16 linear by e4m3's share, not by nothing or by much.
    rel = (y.float() - lin(x).float()).norm() / lin(x).float().norm()
    assert 1e-3 < rel < 0.1, rel


@pytest.mark.parametrize("rows", [1, 7, 64, 256, 257, 600])
@pytest.mark.parametrize("keep_onednn", [False, True])
def test_fp8_panel_kernel_computes_the_product_of_the_e4m3_numbers_rounded_once(
    rows: int, keep_onednn: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the ops give an fp8 panel kernel (AVX512-BF16 without AMX: kernels/csrc/panel_f8.cpp), every
    step reads the one-byte codes (256 rows a sweep) and rounds once, with no bf16 copy of the codes kept.
    With that copy kept (as a benchmark comparing the two asks) and the kernel switched off, the copy's
    oneDNN matmul rounds twice."""
    from tokenmill.models import linear

    monkeypatch.setattr(linear, "KEEP_ONEDNN_COPY", keep_onednn)
    o = get_ops("auto", "cpu")
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(576, 96, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 576, generator=g) * 0.05)
    layer = Fp8Linear(lin, o.e4m3_rows, o.scale_rows_cols, o.fp8_matmul_for)
    if layer.small is None:
        pytest.skip("no fp8 panel kernel on this CPU (it needs an AVX512-BF16 build and no AMX)")
    assert layer.small_rows is None and (layer.wide is not None) == keep_onednn
    if keep_onednn:
        layer.small_rows = 0
    x = (torch.randn(rows, 576, generator=g) * 3).to(torch.bfloat16)
    y = layer(x)
    w_codes, w_scale = to_e4m3(lin.weight.detach(), dim=1)
    x_codes, x_scale = to_e4m3(x, dim=-1)
    scales = x_scale.double() * w_scale.double().t()
    exact = (x_codes.double() @ w_codes.double().t()) * scales
    err = (y.double() - exact).abs()
    if layer.small_rows is None:  # float32 sums of exact products (error ~K * 2^-24 of the magnitudes)
        magnitude = (x_codes.double().abs() @ w_codes.double().abs().t()) * scales
        assert bool((err <= 2**-8 * 1.02 * exact.abs() + 576 * 2**-24 * magnitude).all())
    else:
        torch.testing.assert_close(y.double(), exact, atol=2e-3 * exact.abs().max().item(), rtol=2**-7)


def test_config_names_fp8_among_the_choices() -> None:
    assert EngineConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match='"int4", "int8" or "fp8"'):
        EngineConfig(quantization="fp4")


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_activation_codes_are_pytorchs_e4m3_bit_for_bit(ops: str) -> None:
    """Every e4m3 value, the ties between them, the subnormal range and the largest: rounded as
    PyTorch's float8_e4m3fn conversion rounds, and held in bf16 exactly."""
    finite = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    finite = finite[finite.isfinite()].unique()  # 253 values, -448..448
    mids = (finite[1:] + finite[:-1]) / 2  # ties: round half to even
    g = torch.Generator().manual_seed(2)
    rand = (torch.rand(4000, generator=g) * 2 - 1) * 448 * torch.logspace(-6, 0, 4000)
    row = torch.cat([finite, mids, rand])
    x = torch.stack([row, -row, row / 448 * 3.5])  # scales 1, 1 and 3.5 / 448
    codes, scale = get_ops(ops, "cpu").e4m3_rows(x)
    assert codes.dtype == torch.bfloat16 and scale.dtype == torch.float32
    ref = (x / scale).to(E4M3).float()
    assert torch.equal(codes.float(), ref)
