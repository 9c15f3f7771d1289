"""`quantization="int8"`: int8 weights (per output channel) times int8 activations (per row, quantized
as the step runs, stored as uint8 with zero point 128). The matmul's integer sums are exact, so the
reference is exact too: the same integers and scales multiplied in float64. The layer may differ from
it by rounding its output to bfloat16 (twice: after the matmul's column scales, and after the rows'
scales) and by float32's share of the zero point's correction, on every path: oneDNN's int8 kernels on
a CPU, a float matmul elsewhere; the panel kernel (AVX512-BF16 without AMX, every row count, the only
copy of the codes there) rounds once. Run under ONEDNN_MAX_CPU_ISA=AVX2 (as tests/test_isa_paths.py
does) the oneDNN cases are skipped: without VNNI the layer takes the exact float path, and the model
keeps bf16 weights (its AVX2 int8 kernels were not exact)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.models import linear as linear_mod
from tokenmill.models.linear import Int8Linear, row_bucket
from tokenmill.models.ops import TorchOps, get_ops

BOUND = 2 * 2**-8 * 1.02  # two bf16 roundings


def exact(lin: nn.Linear, layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """The same integers and scales, multiplied exactly. The weight codes are divided out in float32 as
    the layer does (in float64 a few codes fall on the other side of a rounding)."""
    ws = layer.w_scales
    wq = torch.round(lin.weight.detach().float() / ws[:, None]).clamp(-127, 127).double()
    xq, xs = TorchOps().quantize_rows_u8(x)
    return ((xq.double() - 128) @ wq.t()) * xs.double() * ws.double()


@pytest.mark.parametrize("ops_name", ["torch", "auto"])
@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 32, 130])
def test_int8_linear_is_the_exact_integer_product_rounded(ops_name: str, onednn: bool, rows: int) -> None:
    if onednn and not (linear_mod._onednn_int8_available() and linear_mod._onednn_vnni()):
        pytest.skip("no oneDNN int8 matmul with VNNI or AMX here (the layer takes the exact float path)")
    torch.manual_seed(rows)
    lin = nn.Linear(576, 960, bias=False)
    lin.weight.data = (lin.weight.data * 3).bfloat16()
    ops = get_ops(ops_name, "cpu")
    layer = Int8Linear(lin, ops.quantize_rows_u8, ops.scale_rows_)
    if not onednn:  # the path other devices take
        layer.onednn = False
        layer.qweight = (
            torch.round(lin.weight.detach().float() / layer.w_scales[:, None]).clamp(-127, 127).to(torch.int8)
        )
    x = (torch.randn(rows, 576) * torch.rand(rows, 1) * 4).bfloat16()
    y = layer(x)
    assert y.shape == (rows, 960) and y.dtype == torch.bfloat16
    ref = exact(lin, layer, x)
    err = (y.double() - ref).abs()
    # Besides the roundings, oneDNN applies the activations' zero point (128 x the weights' column sums)
    # in float32 on some paths: an absolute error far below a row's largest value (2**-10 of it).
    rowmax = ref.abs().amax(1, keepdim=True)
    assert bool((err <= BOUND * ref.abs() + 2**-10 * rowmax).all()), float((err / rowmax).max())
    if onednn:
        assert row_bucket(rows) >= rows  # padded rows were cut off again: the shape above says so


def test_bias_is_added_after_the_scales() -> None:
    lin = nn.Linear(64, 32, bias=True)
    lin.weight.data, lin.bias.data = lin.weight.data.bfloat16(), lin.bias.data.bfloat16()
    ops = TorchOps()
    layer = Int8Linear(lin, ops.quantize_rows_u8, ops.scale_rows_)
    x = torch.randn(3, 64).bfloat16()
    ref = exact(lin, layer, x) + lin.bias.double()
    assert torch.allclose(layer(x).double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 7, 32, 256, 257, 600])
@pytest.mark.parametrize("keep_onednn", [False, True])
def test_int8_panel_kernel_is_the_exact_integer_product_rounded_once(
    rows: int, keep_onednn: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the ops give an int8 panel kernel (AVX512-BF16 without AMX: kernels/csrc/panel_i8.cpp), every
    step takes it (256 rows a sweep) and rounds once, and the layer keeps no other copy of the codes. With
    oneDNN's copy kept (as benchmarks compare the two) and the kernel switched off, oneDNN rounds twice."""
    monkeypatch.setattr(linear_mod, "KEEP_ONEDNN_COPY", keep_onednn)
    ops = get_ops("auto", "cpu")
    torch.manual_seed(rows)
    lin = nn.Linear(576, 960, bias=False)
    lin.weight.data = (lin.weight.data * 3).bfloat16()
    layer = Int8Linear(lin, ops.quantize_rows_u8, ops.scale_rows_, ops.int8_matmul_for)
    if layer.small is None:
        pytest.skip("no few-row int8 kernel on this CPU (it needs an AVX512-BF16 build and no AMX)")
    assert layer.small_rows is None and layer.sole != keep_onednn
    # One copy of the codes: the panels', or with the copy kept oneDNN's (where its int8 matmul is exact:
    # VNNI or AMX; under ONEDNN_MAX_CPU_ISA=AVX2 the float path's codes instead).
    assert hasattr(layer, "packed") == (keep_onednn and layer.onednn)
    assert hasattr(layer, "qweight") == (keep_onednn and not layer.onednn)
    if keep_onednn:
        layer.small_rows = 0  # as benchmarks/int8_panels.py switches the kernel off
    x = (torch.randn(rows, 576) * torch.rand(rows, 1) * 4).bfloat16()
    y = layer(x)
    assert y.shape == (rows, 960) and y.dtype == torch.bfloat16
    ref = exact(lin, layer, x)
    err = (y.double() - ref).abs()
    rowmax = ref.abs().amax(1, keepdim=True)
    if layer.small_rows is None:
        assert bool((err <= 2**-8 * 1.02 * ref.abs()).all()), float((err / ref.abs()).max())
    else:
        assert bool((err <= BOUND * ref.abs() + 2**-10 * rowmax).all()), float((err / rowmax).max())
