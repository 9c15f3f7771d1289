"""The fused C++ element-wise ops against their plain-PyTorch definitions."""

from __future__ import annotations

import pytest
import torch

from tokenmill.models.ops import CpuFusedOps, TorchOps
from tokenmill.models.rope import RotaryEmbedding

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def ops() -> tuple[TorchOps, CpuFusedOps]:
    return TorchOps(), CpuFusedOps()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_norms(ops, dtype: torch.dtype, rows: int) -> None:
    ref, fused = ops
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    tol = TOL[dtype]
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), atol=tol, rtol=tol)
    res_a = torch.randn(rows, 576, generator=g).to(dtype)
    res_b = res_a.clone()
    out_ref = ref.add_rms_norm(x, res_a, w, 1e-5)
    out_fused = fused.add_rms_norm(x, res_b, w, 1e-5)
    assert torch.equal(res_a, res_b), "the residual add is rounded like an unfused add"
    torch.testing.assert_close(out_fused, out_ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(ops, dtype: torch.dtype) -> None:
    ref, fused = ops
    x = (torch.randn(33, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    tol = TOL[dtype]
    torch.testing.assert_close(fused.silu_mul(x), ref.silu_mul(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place(ops, dtype: torch.dtype) -> None:
    ref, fused = ops
    rope = RotaryEmbedding(64, 512, 10000.0)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(20, (4 + 2 + 2) * 64, generator=g).to(dtype)
    pos = torch.randint(0, 512, (20,), generator=g)
    a, b = qkv.clone(), qkv.clone()
    ref.rope_(a, 6, 64, pos, rope.cos, rope.sin_signed)
    fused.rope_(b, 6, 64, pos, rope.cos, rope.sin_signed)
    tol = TOL[dtype]
    torch.testing.assert_close(b, a, atol=tol, rtol=tol)
    assert torch.equal(b[:, 6 * 64 :], qkv[:, 6 * 64 :]), "v is left alone"
    assert not torch.equal(b[:, : 6 * 64], qkv[:, : 6 * 64])
