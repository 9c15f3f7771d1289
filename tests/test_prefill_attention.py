"""The whole-prompt attention kernel (brgemm) against float64 attention and against PyTorch's SDPA in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.models.attention.backend import PrefillSegment
from tokenmill.models.attention.kv_quant import dequantize_rows, quantize_rows
from tokenmill.models.attention.registry import get_backend
from tokenmill.models.linear import bf16_brgemm_available

needs_kernel = pytest.mark.skipif(
    not bf16_brgemm_available(),
    reason="the whole-prompt kernel needs oneDNN's bf16 brgemm: AMX or AVX512-BF16 (this CPU has neither)",
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
@pytest.mark.parametrize("fmt", [None, "int8", "fp8"])
def test_chunks_after_a_cached_context_read_it_through_their_block_tables(fmt: str | None) -> None:
    """Chunked prefill, prefix hits and draft verification: the chunk's queries at positions past..,
    keys and values read from shuffled cache blocks (8-bit rows dequantized), against float64 attention
    over the same cached values, as closely as SDPA; a whole prompt in the same step lands in its rows."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, bs, blocks = 9, 3, 64, 16, 64
    # (cached tokens before, new tokens): two chunks long enough for the kernel, one left to SDPA.
    chunks = [(100, 200), (5, 1), (64, 256)]
    whole_len = 33
    t = whole_len + sum(n for _, n in chunks)
    q = torch.randn(t, heads, d, generator=g).to(torch.bfloat16)
    k = torch.randn(t, kv_heads, d, generator=g).to(torch.bfloat16)
    v = torch.randn(t, kv_heads, d, generator=g).to(torch.bfloat16)
    # Context rows of every chunk (cached ones random, then the chunk's own), written into its blocks.
    raw_k = torch.randn(blocks, bs, kv_heads, d, generator=g).to(torch.bfloat16)
    raw_v = torch.randn(blocks, bs, kv_heads, d, generator=g).to(torch.bfloat16)
    perm = torch.randperm(blocks, generator=g).tolist()
    segments = [PrefillSegment(0, whole_len, 0, torch.zeros(0, dtype=torch.long))]
    row, used = whole_len, 0
    for past, n in chunks:
        nb = -(-(past + n) // bs)
        table = torch.tensor(perm[used : used + nb])
        used += nb
        slots = table[torch.arange(past, past + n) // bs] * bs + torch.arange(past, past + n) % bs
        raw_k.view(-1, kv_heads, d)[slots] = k[row : row + n]
        raw_v.view(-1, kv_heads, d)[slots] = v[row : row + n]
        segments.append(PrefillSegment(row, n, past, table))
        row += n
    k_cache = raw_k if fmt is None else quantize_rows(raw_k, fmt)
    v_cache = raw_v if fmt is None else quantize_rows(raw_v, fmt)
    outs = {}
    for name in ("cpu", "torch"):
        out = torch.empty_like(q)
        get_backend(name, kv_format=fmt)._prefill(q, k, v, k_cache, v_cache, segments, d**-0.5, out)
        outs[name] = out
    values_k = raw_k if fmt is None else dequantize_rows(k_cache, fmt, torch.float64)
    values_v = raw_v if fmt is None else dequantize_rows(v_cache, fmt, torch.float64)
    for seg in segments[1:]:
        ctx = torch.arange(seg.start_pos + seg.q_len)
        slots = seg.block_ids[ctx // bs] * bs + ctx % bs
        ks = values_k.reshape(-1, kv_heads, d)[slots].double().repeat_interleave(heads // kv_heads, 1)
        vs = values_v.reshape(-1, kv_heads, d)[slots].double().repeat_interleave(heads // kv_heads, 1)
        qs = q[seg.q_start : seg.q_start + seg.q_len].double()
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * d**-0.5
        hidden = ctx[None, :] > torch.arange(seg.start_pos, seg.context_len)[:, None]
        exact = torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), vs)
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        err = (outs["cpu"][rows].double() - exact).abs()
        sdpa_err = (outs["torch"][rows].double() - exact).abs()
        torch.testing.assert_close(outs["cpu"][rows].double(), exact, atol=2e-2, rtol=1e-2)
        # Routing: long chunks went to the kernel (other roundings), the short one stayed with SDPA.
        same = torch.equal(outs["cpu"][rows], outs["torch"][rows])
        assert same == (seg.q_len < get_backend("cpu").cached_min_queries), seg
        assert err.mean() <= 1.25 * sdpa_err.mean() + 1e-4, (seg, err.mean().item(), sdpa_err.mean().item())
    torch.testing.assert_close(
        outs["cpu"][:whole_len].float(), outs["torch"][:whole_len].float(), atol=2e-2, rtol=1e-2
    )


@pytest.mark.parametrize("var", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
def test_a_limit_on_onednn_is_obeyed(monkeypatch, var: str) -> None:
    """PyTorch refuses the kernel's packed layout below AVX512-BF16: an ISA limit set on oneDNN (as
    tests/isa_paths.py sets to play a laptop) turns the kernel off; a limit that still allows bf16
    pairs leaves it to the CPU's own features."""
    has_bf16 = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    for limit in ("AVX2", "avx512_core", "AVX512_CORE_VNNI"):
        monkeypatch.setenv(var, limit)
        assert not bf16_brgemm_available()
    monkeypatch.setenv(var, "avx512_core_bf16")
    assert bf16_brgemm_available() == bool(torch.cpu._is_avx512_bf16_supported())
    monkeypatch.setenv(var, "AVX512_CORE_AMX")
    assert bf16_brgemm_available() == has_bf16
    monkeypatch.delenv(var)
    assert bf16_brgemm_available() == has_bf16
