"""The whole-prompt attention kernel (brgemm) against float64 attention and against PyTorch's SDPA in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.models.attention.backend import PrefillSegment
from tokenmill.models.attention.cpu_paged import brgemm_prefill_available
from tokenmill.models.attention.registry import get_backend

needs_kernel = pytest.mark.skipif(
    not brgemm_prefill_available(), reason="the whole-prompt kernel is used only on CPUs with AMX"
)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], dtype) -> torch.Tensor:
    """Causal attention of each segment on its own, by SDPA in `dtype`."""
    out, start = torch.empty(q.shape, dtype=dtype), 0
    for n in lens:
        part = [x[start : start + n].to(dtype).transpose(0, 1)[None] for x in (q, k, v)]
        o = F.scaled_dot_product_attention(*part, is_causal=True, scale=q.shape[-1] ** -0.5, enable_gqa=True)
        out[start : start + n] = o[0].transpose(0, 1)
        start += n
    return out


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_size", "lens"),
    [
        (9, 3, 64, [1, 5, 63, 64, 65, 130, 272, 511]),  # SmolLM2-135M: panels' edges and tails
        (8, 8, 64, [200, 3]),  # no grouping
        (8, 2, 128, [100, 257]),  # Llama-style head size 128
    ],
)
def test_kernel_matches_float64_attention_as_closely_as_sdpa(
    heads: int, kv_heads: int, head_size: int, lens: list[int]
) -> None:
    g = torch.Generator().manual_seed(0)
    t = sum(lens)
    # One fused qkv tensor, q/k/v as views of it, as the model passes them.
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_size, generator=g).to(torch.bfloat16)
    q = qkv[:, : heads * head_size].view(t, heads, head_size)
    k = qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(t, kv_heads, head_size)
    v = qkv[:, (heads + kv_heads) * head_size :].view(t, kv_heads, head_size)
    segments, start = [], 0
    for n in lens:
        segments.append(PrefillSegment(start, n, 0, torch.zeros(0, dtype=torch.long)))
        start += n
    backend = get_backend("cpu")
    out = torch.empty(t, heads, head_size, dtype=torch.bfloat16)
    starts = torch.tensor([s.q_start for s in segments])
    backend.kernels.prefill_attention(q, k, v, out, starts, torch.tensor(lens), head_size**-0.5)
    # The backend sends whole prompts to this kernel.
    routed = torch.empty_like(out)
    backend._prefill(q, k, v, None, None, segments, head_size**-0.5, routed)
    assert torch.equal(routed, out)

    exact = reference(q, k, v, lens, torch.float64)
    sdpa = reference(q, k, v, lens, torch.bfloat16)
    err = (out.double() - exact).abs()
    sdpa_err = (sdpa.double() - exact).abs()
    # bf16 output rounding alone is up to 2^-9 relative; the kernel's weights are bf16 as SDPA's are.
    torch.testing.assert_close(out.double(), exact, atol=2e-2, rtol=1e-2)
    assert err.mean() <= 1.25 * sdpa_err.mean(), (err.mean().item(), sdpa_err.mean().item())
    assert err.max() <= 2 * sdpa_err.max() + 1e-3, (err.max().item(), sdpa_err.max().item())


@needs_kernel
def test_segments_that_continue_a_cached_context_still_take_the_reference_path() -> None:
    """A prompt chunk after cached tokens reads the cache: the kernel leaves it to SDPA, and both kinds
    of segment in one step land in their own rows."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, bs = 4, 2, 64, 16
    k_cache = torch.randn(8, bs, kv_heads, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(8, bs, kv_heads, d, generator=g).to(torch.bfloat16)
    q = torch.randn(40, heads, d, generator=g).to(torch.bfloat16)
    k = torch.randn(40, kv_heads, d, generator=g).to(torch.bfloat16)
    v = torch.randn(40, kv_heads, d, generator=g).to(torch.bfloat16)
    # Rows 0-29: a whole prompt; rows 30-39: 10 new tokens after 20 cached ones in blocks 3 and 5.
    k_cache[3], v_cache[3] = torch.randn(2, bs, kv_heads, d, generator=g).to(torch.bfloat16)
    whole = PrefillSegment(0, 30, 0, torch.zeros(0, dtype=torch.long))
    cont = PrefillSegment(30, 10, 20, torch.tensor([3, 5]))
    # The continuation's own keys go to slots 20..29 of its table (block 5, offsets 4..13).
    k_cache[5, 4:14], v_cache[5, 4:14] = k[30:], v[30:]
    outs = {}
    for name in ("cpu", "torch"):
        out = torch.empty_like(q)
        get_backend(name)._prefill(q, k, v, k_cache, v_cache, [whole, cont], d**-0.5, out)
        outs[name] = out
    torch.testing.assert_close(outs["cpu"][30:], outs["torch"][30:], atol=0, rtol=0)  # same path
    torch.testing.assert_close(outs["cpu"][:30].float(), outs["torch"][:30].float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("var", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
def test_a_limit_on_onednn_below_amx_turns_the_kernel_off(monkeypatch, var: str) -> None:
    """PyTorch refuses the kernel's packed layout below AVX-512, and it is slower than SDPA without AMX:
    an ISA limit set on oneDNN (as tests/isa_paths.py sets to play a laptop) must be obeyed."""
    for limit in ("AVX2", "avx512_core_bf16"):
        monkeypatch.setenv(var, limit)
        assert not brgemm_prefill_available()
    monkeypatch.setenv(var, "AVX512_CORE_AMX")
    assert brgemm_prefill_available() == bool(torch.cpu._is_amx_tile_supported())
