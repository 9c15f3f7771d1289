"""Every instruction-set build of the C++ kernels against float64 references, on whatever CPU runs this.

The kernels are compiled per level (tokenmill/kernels/isa.py). Each level this CPU can run is built and
checked here; a level it cannot run is skipped, saying so. On the project's machines (AVX-512 with
BF16, with or without AMX) every level runs, so the AVX2 build a laptop gets is tested too.

Bounds: a bfloat16 result may differ from the exact value by the final rounding, half a unit in the
last place, at most 2**-8 of its size; everything before that rounding is float32, whose error is far
below it. A kernel that accumulated in bfloat16 would miss these bounds by an order of magnitude.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenmill.kernels import cpu_kernels
from tokenmill.kernels.isa import cpu_summary, get_level, level_names
from tokenmill.models.rope import RotaryEmbedding

BF16_RTOL = 2**-8 * 1.02  # the final rounding, plus float32's share
FP32_RTOL = 1e-5


@pytest.fixture(scope="module", params=level_names())
def kernels(request):
    level = get_level(request.param)
    if not level.supported():
        pytest.skip(f"this CPU cannot run the {level.name} build: it has {cpu_summary()}")
    return cpu_kernels(level.name)


def check(out: torch.Tensor, exact: torch.Tensor, atol: float) -> None:
    """|out - exact| <= rtol * |exact| + atol elementwise, rtol by out's dtype."""
    rtol = BF16_RTOL if out.dtype == torch.bfloat16 else FP32_RTOL
    err = (out.double() - exact).abs()
    bound = rtol * exact.abs() + atol
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"{int((err > bound).sum())} of {err.numel()} outside the bound; worst: got "
        f"{out.flatten()[worst].item()}, exact {exact.flatten()[worst].item()}"
    )


def test_the_build_is_the_level_asked_for(kernels, request) -> None:
    assert kernels.isa_level() == request.node.callspec.params["kernels"]


def test_bf16_rounding_is_pytorchs(kernels) -> None:
    g = torch.Generator().manual_seed(0)
    # Random bit patterns, exact ties (low half 0x8000) of both parities, and the special values.
    bits = torch.randint(0, 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int64)
    bits[:4096] = (bits[:4096] & ~0xFFFF) | 0x8000
    x = (bits.to(torch.int32)).view(torch.float32)
    x = torch.cat([x, -x, torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 3.4e38, -3.4e38])])
    x = x.contiguous()
    got, want = kernels.to_bf16(x), x.to(torch.bfloat16)
    normal = x.abs() >= torch.finfo(torch.float32).tiny
    nan = x.isnan()
    assert torch.equal(got.isnan(), nan)
    same = got.view(torch.int16) == want.view(torch.int16)
    assert bool(same[normal & ~nan].all()), "normal numbers round to nearest even, as PyTorch does"
    # float32 subnormals: PyTorch keeps them, the AVX512-BF16 instruction flushes them to zero;
    # either way the error is at most 2**-126.
    sub = ~normal & ~nan & (x != 0)
    assert bool(((got.float() - want.float()).abs()[sub] <= 2**-126).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_norms(kernels, dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)

    def exact_norm(v: torch.Tensor) -> torch.Tensor:
        v = v.double()
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()

    check(kernels.rms_norm(x, w, 1e-5), exact_norm(x), atol=1e-6)
    residual = torch.randn(rows, 576, generator=g).to(dtype)
    summed = residual + x  # PyTorch's own add in dtype: what the fused add must store
    out = kernels.add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(residual, summed), "the residual is updated in place, rounded as an unfused add"
    check(out, exact_norm(summed), atol=1e-6)
    # Strided rows (a slice of a wider tensor), as the model passes them.
    wide = torch.randn(rows, 700, generator=g).to(dtype)
    check(kernels.rms_norm(wide[:, :576], w, 1e-5), exact_norm(wide[:, :576]), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 33])
def test_silu_mul(kernels, dtype: torch.dtype, rows: int) -> None:
    gu = (torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    gate, up = gu.double().chunk(2, dim=-1)
    # Large |gate| too: exp's range clamp must not bend silu's tails.
    check(kernels.silu_mul(gu), gate * torch.sigmoid(gate) * up, atol=1e-6)
    tails = torch.tensor([[-100.0, -30.0, 30.0, 100.0, 1.0, 1.0, 1.0, 1.0]], dtype=dtype)
    g2, u2 = tails.double().chunk(2, dim=-1)
    check(kernels.silu_mul(tails), g2 * torch.sigmoid(g2) * u2, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 33, 300])
def test_quantize_rows_is_the_reference_bit_for_bit(kernels, dtype: torch.dtype, rows: int) -> None:
    from tokenmill.models.ops import TorchOps

    g = torch.Generator().manual_seed(rows)
    # Rows of very different sizes (per-row scales), an all-zero row, and strided rows.
    x = (torch.randn(rows, 1600, generator=g) * torch.rand(rows, 1, generator=g) * 10).to(dtype)
    x[0] = 0
    for v in (x, x[:, :1536]):
        q, s = kernels.quantize_rows_u8(v)
        q_ref, s_ref = TorchOps().quantize_rows_u8(v)
        assert torch.equal(s, s_ref) and torch.equal(q, q_ref)
    signed = q.int() - 128
    assert int(signed[0].abs().max()) == 0 and (rows == 1 or int(signed.abs().max()) == 127)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_rows_in_place(kernels, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    y = (torch.randn(33, 3072, generator=g) * 5).to(dtype)
    s = torch.rand(33, 1, generator=g) * 0.1
    exact = y.double() * s.double()
    kernels.scale_rows_(y, s)
    check(y, exact, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place(kernels, dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(64, 4096, 10000.0)
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(40, (4 + 2 + 2) * 64, generator=g) * 2).to(dtype)
    pos = torch.randint(0, 4096, (40,), generator=g)
    x = qkv[:, : 6 * 64].double().view(40, 6, 64)
    c = rope.cos[pos].double().unsqueeze(1)
    s = rope.sin_signed[pos].double().unsqueeze(1)
    exact = (x * c + x.roll(32, dims=-1) * s).view(40, -1)
    out = qkv.clone()
    kernels.rope_(out, 6, 64, pos, rope.cos, rope.sin_signed)
    check(out[:, : 6 * 64], exact, atol=1e-6)
    assert torch.equal(out[:, 6 * 64 :], qkv[:, 6 * 64 :]), "v is left alone"


def paged_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, n: int
) -> torch.Tensor:
    """One sequence's decode attention in float64: its n cached rows gathered through its block table,
    each kv head repeated for its query heads, softmax(q k^T / sqrt(d)) v."""
    _, bs, kv_heads, d = k_cache.shape
    heads = q.shape[0]
    slots = torch.tensor([int(table[t // bs]) * bs + t % bs for t in range(n)])
    k = k_cache.view(-1, kv_heads, d)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
    v = v_cache.view(-1, kv_heads, d)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
    p = (torch.einsum("hd,thd->ht", q.double(), k) * d**-0.5).softmax(-1)
    return torch.einsum("ht,thd->hd", p, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "d", "bs"),
    [
        (1, 9, 3, 64, 16),
        (6, 9, 3, 64, 16),
        (40, 8, 8, 64, 16),
        (3, 32, 8, 64, 16),
        (5, 12, 2, 64, 32),  # 6 query heads a kv head: two register chunks; 32-token blocks
        (4, 8, 2, 128, 16),  # head size 128 (Llama 3 8B's)
        (3, 4, 2, 32, 16),  # a head size without a register path: the plain loops, in blocks of rows
        (3, 4, 2, 20, 16),  # not a multiple of 8: the plain loops token by token
    ],
)
def test_paged_decode(
    kernels, dtype: torch.dtype, batch: int, heads: int, kv_heads: int, d: int, bs: int
) -> None:
    pool = 512
    g = torch.Generator().manual_seed(batch * heads)
    k_cache = (torch.randn(pool, bs, kv_heads, d, generator=g) * 2).to(dtype)
    v_cache = torch.randn(pool, bs, kv_heads, d, generator=g).to(dtype)
    q = (torch.randn(batch, heads, d, generator=g) * 2).to(dtype)
    ctx = torch.randint(1, 8 * bs, (batch,), generator=g)
    ctx[0] = 1  # a sequence of one token, and one ending exactly on a block edge
    ctx[-1] = 2 * bs
    width = int((ctx.max() + bs - 1) // bs)
    tables = torch.randperm(pool, generator=g)[: batch * width].view(batch, width).long()
    out = kernels.paged_decode(q, k_cache, v_cache, tables, ctx, d**-0.5)
    for b in range(batch):
        check(out[b], paged_reference(q[b], k_cache, v_cache, tables[b], int(ctx[b])), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "d", "bs"),
    [
        (1, 9, 3, 64, 16),  # one long sequence: its kv heads and context chunks share the threads
        (3, 9, 3, 64, 16),
        (5, 8, 2, 128, 32),
        (2, 4, 2, 32, 16),  # a head size without a register path: the plain loops, chunked alike
    ],
)
def test_paged_decode_long_contexts_in_chunks(
    kernels, dtype: torch.dtype, batch: int, heads: int, kv_heads: int, d: int, bs: int
) -> None:
    """Contexts past the kernel's 512-token chunks (each with its own softmax, merged after) against
    float64, and each sequence's result bit for bit the same alone as in the batch: the chunks depend
    on its context alone."""
    pool = 1024
    g = torch.Generator().manual_seed(batch * d)
    k_cache = (torch.randn(pool, bs, kv_heads, d, generator=g) * 2).to(dtype)
    v_cache = torch.randn(pool, bs, kv_heads, d, generator=g).to(dtype)
    q = (torch.randn(batch, heads, d, generator=g) * 2).to(dtype)
    ctx = torch.randint(400, 1600, (batch,), generator=g)
    ctx[0] = 1024 + 1  # one token past two whole chunks
    if batch > 1:
        ctx[1] = 512  # exactly one chunk
    width = int((ctx.max() + bs - 1) // bs)
    tables = torch.randperm(pool, generator=g)[: batch * width].view(batch, width).long()
    out = kernels.paged_decode(q, k_cache, v_cache, tables, ctx, d**-0.5)
    for b in range(batch):
        check(out[b], paged_reference(q[b], k_cache, v_cache, tables[b], int(ctx[b])), atol=1e-5)
        one = slice(b, b + 1)
        alone = kernels.paged_decode(q[one], k_cache, v_cache, tables[one], ctx[one], d**-0.5)
        assert torch.equal(alone[0], out[b])


# -- the 8-bit KV cache (models/attention/kv_quant.py is the reference) -----------------------------


def _e4m3_grid() -> torch.Tensor:
    """Every finite e4m3 value (both signs), and every midpoint between neighbours: the ties that
    round-to-nearest-even must settle as PyTorch does."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    pos = vals[(vals >= 0) & vals.isfinite()].unique().sort().values
    mids = (pos[1:] + pos[:-1]) / 2
    grid = torch.cat([pos, mids])
    return torch.cat([grid, -grid])


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_q8_is_the_reference_bit_for_bit(kernels, fmt: str, dtype: torch.dtype) -> None:
    from tokenmill.models.attention.kv_quant import quantize_rows

    g = torch.Generator().manual_seed(7)
    hkv, d, pool, bs = 3, 64, 40, 16
    # Keys and values are views into one fused row, as the model's qkv split leaves them.
    fused = (torch.randn(50, 4 + 2 * hkv, d, generator=g) * torch.rand(50, 1, 1, generator=g) * 20).to(dtype)
    fused[3] = 0  # all-zero rows: scale 1, codes 0
    fused[4, 4, 5] = 300.0  # an outlier sets its row's scale
    if fmt == "fp8" and dtype == torch.float32:
        # Rows whose largest value is 448 have scale 1: their codes are the grid's own roundings.
        grid = _e4m3_grid()
        n = grid.numel() // (d - 1)
        fused[10 : 10 + n, 4, 1:] = grid[: n * (d - 1)].view(n, d - 1)
        fused[10 : 10 + n, 4, 0] = 448.0
    k, v = fused[:, 4 : 4 + hkv], fused[:, 4 + hkv :]
    slots = torch.randperm(pool * bs, generator=g)[:50]
    k_cache = torch.zeros(pool, bs, hkv, d + 4, dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    kernels.kv_write_q8(k, v, k_cache, v_cache, slots, fmt == "fp8")
    assert torch.equal(k_cache.view(-1, hkv, d + 4)[slots], quantize_rows(k, fmt))
    assert torch.equal(v_cache.view(-1, hkv, d + 4)[slots], quantize_rows(v, fmt))
    untouched = torch.ones(pool * bs, dtype=torch.bool)
    untouched[slots] = False
    assert int(k_cache.view(-1, hkv, d + 4)[untouched].count_nonzero()) == 0, (
        "only the given slots are written"
    )


def test_kv_write_q8_rejects_a_slot_outside_the_cache(kernels) -> None:
    k = torch.randn(2, 1, 64)
    cache = torch.zeros(4, 16, 1, 68, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.kv_write_q8(k, k, cache, cache.clone(), torch.tensor([0, 64]), False)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "d", "bs"),
    [
        (6, 9, 3, 64, 16),  # SmolLM2-135M's heads
        (40, 8, 8, 64, 16),  # batch enough for one item a sequence
        (5, 12, 2, 64, 32),  # two register chunks a kv head; 32-token blocks
        (4, 8, 2, 128, 16),
        (3, 4, 2, 32, 16),  # the plain loops
    ],
)
def test_paged_decode_8bit_cache(
    kernels, fmt: str, dtype: torch.dtype, batch: int, heads: int, kv_heads: int, d: int, bs: int
) -> None:
    """Attention over 8-bit rows equals float64 attention over the rows' dequantized values: the kernel
    adds no error of its own beyond float32 arithmetic and the final rounding."""
    from tokenmill.models.attention.kv_quant import dequantize_rows, quantize_rows

    pool = 320
    g = torch.Generator().manual_seed(batch * heads + d)
    k_rows = quantize_rows(torch.randn(pool, bs, kv_heads, d, generator=g) * 3, fmt)
    v_rows = quantize_rows(torch.randn(pool, bs, kv_heads, d, generator=g), fmt)
    q = (torch.randn(batch, heads, d, generator=g) * 2).to(dtype)
    ctx = torch.randint(1, 8 * bs, (batch,), generator=g)
    ctx[0] = 1
    ctx[-1] = 2 * bs
    width = int((ctx.max() + bs - 1) // bs)
    tables = torch.randperm(pool, generator=g)[: batch * width].view(batch, width).long()
    out = kernels.paged_decode(q, k_rows, v_rows, tables, ctx, d**-0.5, {"int8": 1, "fp8": 2}[fmt])
    k_all = dequantize_rows(k_rows, fmt, torch.float64).view(-1, kv_heads, d)
    v_all = dequantize_rows(v_rows, fmt, torch.float64).view(-1, kv_heads, d)
    for b in range(batch):
        n = int(ctx[b])
        slots = torch.tensor([int(tables[b, t // bs]) * bs + t % bs for t in range(n)])
        k = k_all[slots].repeat_interleave(heads // kv_heads, dim=1)
        v = v_all[slots].repeat_interleave(heads // kv_heads, dim=1)
        p = (torch.einsum("hd,thd->ht", q[b].double(), k) * d**-0.5).softmax(-1)
        check(out[b], torch.einsum("ht,thd->hd", p, v), atol=1e-5)


def test_paged_decode_rejects_a_cache_of_the_wrong_layout(kernels) -> None:
    q = torch.randn(1, 2, 64)
    plain = torch.zeros(4, 16, 1, 64)
    rows = torch.zeros(4, 16, 1, 68, dtype=torch.uint8)
    one = torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="8-bit cache rows"):
        kernels.paged_decode(q, plain, plain, torch.zeros(1, 1, dtype=torch.long), one, 0.125, 1)
    with pytest.raises(RuntimeError, match="D values"):
        kernels.paged_decode(q, rows, rows, torch.zeros(1, 1, dtype=torch.long), one, 0.125, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [49152, 301, 7])
def test_argmax_rows_is_pytorchs_max_indices(kernels, dtype: torch.dtype, vocab: int) -> None:
    """Greedy decoding's pick: the first maximum, a NaN (its first occurrence) counting as the largest,
    as `max(dim=-1).indices` gives it; strided rows read in place."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(12, vocab + 5, generator=g) * 4).to(dtype)
    x[1, 2] = x[1, vocab - 1] = 60  # a tie: the first one
    x[2, vocab - 1] = 60  # the maximum in the scalar tail
    x[3, 1] = float("nan")
    x[3, 0] = x[3, vocab - 2] = float("nan")
    x[4, :] = float("-inf")
    x[5, 3] = float("inf")
    x[6, :] = 1.0  # all equal: index 0
    x[7, vocab - 1] = float("nan")  # a NaN after the maximum
    x[7, 0] = 60
    for rows in (x[:, :vocab], x[:, :vocab].contiguous()):
        assert torch.equal(kernels.argmax_rows(rows), rows.max(dim=-1).indices)


@pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(), reason="the whole-prompt kernel is used only on CPUs with AMX"
)
def test_prefill_attention(kernels) -> None:
    """Every build's softmax (AVX-512 lanes, or the scalar loop of the AVX2 build) around the brgemm
    products: causal attention of three prompts against float64, within bf16 weights' error."""
    torch.manual_seed(0)
    heads, kv_heads, d, lens = 6, 2, 64, [1, 70, 129]
    t = sum(lens)
    q = torch.randn(t, heads, d).to(torch.bfloat16)
    k = torch.randn(t, kv_heads, d).to(torch.bfloat16)
    v = torch.randn(t, kv_heads, d).to(torch.bfloat16)
    starts = torch.tensor([0, 1, 71])
    out = torch.empty(t, heads, d, dtype=torch.bfloat16)
    kernels.prefill_attention(q, k, v, out, starts, torch.tensor(lens), d**-0.5)
    for s, n in zip(starts.tolist(), lens, strict=True):
        qs, ks, vs = (x[s : s + n].double().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(heads // kv_heads, 0), vs.repeat_interleave(heads // kv_heads, 0)
        scores = (qs @ ks.transpose(1, 2)) * d**-0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        exact = (scores.softmax(-1) @ vs).transpose(0, 1)
        # The weights are rounded to bf16 before the value sum (as SDPA's are): ~2**-9 of each term.
        torch.testing.assert_close(out[s : s + n].double(), exact, atol=1e-2, rtol=2e-2)


def test_e4m3_rows_are_pytorchs_float8_bit_for_bit(kernels) -> None:
    """fp8 activation codes (quantization="fp8"): each e4m3 value, the ties between neighbours (half to
    even), subnormals and random magnitudes, as torch's float8_e4m3fn conversion rounds them."""
    e4m3 = torch.float8_e4m3fn
    finite = torch.arange(256, dtype=torch.uint8).view(e4m3).float()
    finite = finite[finite.isfinite()].unique()
    row = torch.cat([finite, (finite[1:] + finite[:-1]) / 2, torch.randn(1000) * torch.logspace(-4, 2, 1000)])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.stack([row, -row * 0.37]).to(dtype)
        codes, scale = kernels.e4m3_rows_bf16(x)
        assert torch.equal(codes.float(), (x.float() / scale).to(e4m3).float())


def test_scale_rows_cols_rounds_once(kernels) -> None:
    y = torch.randn(5, 300).to(torch.bfloat16)
    rows, cols = torch.rand(5, 1) + 0.5, torch.rand(1, 300) + 0.5
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(kernels.scale_rows_cols(y, rows, cols, dtype), (y.float() * rows * cols).to(dtype))


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 130), (16, 2), (40, 1538)])
def test_panel_matmul_vector_loops(kernels, x_dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    """The few-row matmul against float64: sums in float32, one final rounding to x's dtype."""
    g = torch.Generator().manual_seed(rows * n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    wide = torch.randn(rows, k + 5, generator=g).to(x_dtype)
    x = wide[:, 2 : 2 + k]  # rows k + 5 apart, as a slice of a fused projection would be
    panels = kernels.panel_pack(w)
    assert panels.shape == ((n + 31) // 32, k // 2, 32, 2)
    out = kernels.panel_matmul(x, panels, n, 4)
    assert out.shape == (rows, n) and out.dtype == x_dtype
    exact = x.double() @ w.double().T
    # float32 sums of k products: error up to ~k * 2**-24 of the sum of |products|, plus the rounding.
    atol = k * 2**-23 * float((x.double().abs() @ w.double().abs().T).max())
    check(out, exact, atol=atol)


@pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(), reason="the brgemm path of the panel matmul is used only with AMX"
)
@pytest.mark.parametrize("rows", [3, 17, 96])
def test_panel_matmul_brgemm(kernels, rows: int) -> None:
    """More rows than the vector loops take: oneDNN's brgemm on the same panels, against float64."""
    g = torch.Generator().manual_seed(rows)
    n, k = 70, 578
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k + 6, generator=g).to(torch.bfloat16)[:, 3 : 3 + k]
    out = kernels.panel_matmul(x, kernels.panel_pack(w), n, 2)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    atol = k * 2**-23 * float((x.double().abs() @ w.double().abs().T).max())
    check(out, x.double() @ w.double().T, atol=atol)
    with pytest.raises(RuntimeError, match="up to 96"):
        kernels.panel_matmul(torch.zeros(97, k, dtype=torch.bfloat16), kernels.panel_pack(w), n, 2)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 96, 256, 300, 600])
def test_panel_matmul_dot_loops(kernels, rows: int) -> None:
    """The AVX512-BF16 dot loops (vdpbf16ps, every step on CPUs without AMX, 256 rows a sweep of the
    weights: 300 and 600 cross sweeps) against float64, and each row's result the same bits whatever rows
    share its step."""
    if not kernels.panel_dot_available():
        pytest.skip(f"the dot loops are only in the avx512_bf16 build, not {kernels.isa_level()}")
    g = torch.Generator().manual_seed(rows)
    n, k = 70, 578
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k + 6, generator=g).to(torch.bfloat16)[:, 3 : 3 + k]
    panels = kernels.panel_pack(w)
    out = kernels.panel_matmul_dot(x, panels, n)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    atol = k * 2**-23 * float((x.double().abs() @ w.double().abs().T).max())
    check(out, x.double() @ w.double().T, atol=atol)
    for r in {0, rows // 2, rows - 1}:
        assert torch.equal(kernels.panel_matmul_dot(x[r : r + 1], panels, n)[0], out[r])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 64, 65, 200])
@pytest.mark.parametrize(("n", "k"), [(70, 578), (16, 2), (40, 1538)])
def test_panel_matmul_wide(kernels, rows: int, n: int, k: int) -> None:
    """bf16 panels widened to float32 in the kernel, float32 rows and output (the path of CPUs without BF16
    instructions), at every level: against float64, and each row's result the same bits whatever rows
    share its step (1-4 rows widen in registers, more widen each panel once a sweep of 64 rows)."""
    g = torch.Generator().manual_seed(rows * n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k + 6, generator=g)[:, 3 : 3 + k]
    panels = kernels.panel_pack(w)
    out = kernels.panel_matmul_wide(x, panels, n)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    atol = k * 2**-23 * float((x.double().abs() @ w.double().abs().T).max())
    check(out, x.double() @ w.double().T, atol=atol)
    for r in sorted({0, rows // 2, rows - 1}):
        assert torch.equal(kernels.panel_matmul_wide(x[r : r + 1], panels, n)[0], out[r])
    with pytest.raises(RuntimeError, match="float32"):
        kernels.panel_matmul_wide(x.to(torch.bfloat16), panels, n)


def q4_case(rows: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """Random 4-bit codes, scales and minima as a Q4_1 block holds them, and bf16 rows strided as a fused
    slice."""
    g = torch.Generator().manual_seed(rows * n + k)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    lo = -8 * scale * (torch.rand(n, k // 32, generator=g) + 0.5)
    x = torch.randn(rows, k + 6, generator=g).to(torch.bfloat16)[:, 3 : 3 + k]
    return q, scale, lo, x


EXACT = 2**62  # q4_matmul's exact_rows for bf16 activations at every row count


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 64), (70, 1536)])
def test_q4_panels(kernels, rows: int, n: int, k: int) -> None:
    """4-bit panels (quantization="int4" on AVX512-BF16 without AMX) with bf16 activations (W4A16), up to
    16 rows exact products: against float64 with the same codes, scales and minima (both rounded to
    float16 as the panels hold them)."""
    if not kernels.panel_dot_available():
        pytest.skip(f"the 4-bit panel loops are only in the avx512_bf16 build, not {kernels.isa_level()}")
    from tokenmill.models.ops import q4_pack

    q, scale, lo, x = q4_case(rows, n, k)
    out = kernels.q4_matmul(x, q4_pack(q, scale, lo), n, EXACT)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    if rows <= 4:  # what the int8 activations' setting leaves to this path: the same sums
        assert torch.equal(kernels.q4_matmul(x, q4_pack(q, scale, lo), n, 4), out)
    s64, lo64 = (v.to(torch.float16).double().repeat_interleave(32, dim=1) for v in (scale, lo))
    w = q.double() * s64 + lo64
    # float32 sums of the group's products x (128 + q), then the terms scale * sum and (lo - 128 scale) *
    # sum(x): bounded by the magnitudes summed.
    summed = (q.double() + 128) * s64 + (lo64 - 128 * s64).abs()
    atol = k * 2**-23 * float((x.double().abs() @ summed.T).max())
    check(out, x.double() @ w.T, atol=atol)
    for r in {0, rows // 2, rows - 1}:  # a row alone gives what it gave beside the others
        assert torch.equal(kernels.q4_matmul(x[r : r + 1], q4_pack(q, scale, lo), n, EXACT)[0], out[r])


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 64), (70, 1536)])
def test_q4_wide_loops(kernels, x_dtype: torch.dtype, symmetric: bool, rows: int, n: int, k: int) -> None:
    """The AVX2 4-bit loops (W4A8 by vpmaddubsw; quantization="int4" on builds without the BF16 loops):
    against float64 of the activations as their int8 group codes stand for them (round(x / a) a, a =
    max|x| / 127 per row and group of 32) times the weights as the panels hold them, with and without
    minima (a Q4_0 file's form); each row's result the same alone as beside the others."""
    if not kernels.q4_wide_available():
        pytest.skip(f"the {kernels.isa_level()} build has no AVX2 4-bit loops")
    from tokenmill.models.ops import q4_pack

    q, scale, lo, x = q4_case(rows, n, k)
    x = x.to(x_dtype)
    if symmetric:
        lo = -8 * scale.to(torch.float16).float()
    panels = q4_pack(q, scale, None if symmetric else lo)
    out = kernels.q4_matmul_wide(x, panels, n)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    # The codes as the kernel rounds them: x * (127 / max) in float32, to nearest even.
    xg = x.float().view(rows, k // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    codes = torch.round(xg * torch.where(amax > 0, 127 / amax, 0))
    x_hat = (codes.double() * (amax / 127).double()).view(rows, k)
    s64, lo64 = (v.to(torch.float16).double().repeat_interleave(32, dim=1) for v in (scale, lo))
    w = q.double() * s64 + lo64
    # Exact integer sums per group; float32 scalings and sums of the groups' terms.
    magnitude = x_hat.abs() @ (q.double() * s64 + lo64.abs()).T
    check(out, x_hat @ w.T, atol=k * 2**-23 * float(magnitude.max()))
    for r in {0, rows - 1}:
        assert torch.equal(kernels.q4_matmul_wide(x[r : r + 1], panels, n)[0], out[r])


@pytest.mark.parametrize("rows", [17, 33, 300])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 64), (70, 1536)])
def test_q4_panels_dequantized_above_16_rows(kernels, rows: int, n: int, k: int) -> None:
    """Above 16 rows with bf16 activations each panel is dequantized to bf16 and the bf16 dot loops run
    over it: against float64 of the weights rounded to bf16 (each within half a bf16 step of q * scale +
    lo), as a dequantized copy would hold them. 300 rows cross the kernel's 256-row sweeps."""
    if not kernels.panel_dot_available():
        pytest.skip(f"the 4-bit panel loops are only in the avx512_bf16 build, not {kernels.isa_level()}")
    from tokenmill.models.ops import q4_pack

    q, scale, lo, x = q4_case(rows, n, k)
    panels = q4_pack(q, scale, lo)
    out = kernels.q4_matmul(x, panels, n, EXACT)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    s64, lo64 = (v.to(torch.float16).double().repeat_interleave(32, dim=1) for v in (scale, lo))
    w = q.double() * s64 + lo64
    magnitude = x.double().abs() @ w.abs().T
    # Each weight's bf16 rounding (2^-9 of it), float32 sums of exact products, the output's rounding.
    exact = x.double() @ w.T
    bound = 2**-9 * 1.01 * magnitude + k * 2**-23 * magnitude + 2**-8 * exact.abs()
    assert bool(((out.double() - exact).abs() <= bound).all())
    for r in {0, rows // 2, rows - 1}:  # a row gives the same in any step of more than 16 rows
        rows17 = torch.cat([x[r : r + 1], x[:16]]) if r >= 16 else x[:17]
        assert torch.equal(kernels.q4_matmul(rows17, panels, n, EXACT)[0 if r >= 16 else r], out[r])


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 300])
@pytest.mark.parametrize("exact_rows", [EXACT, 2])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 64)])
def test_q4_panels_without_minima(kernels, rows: int, exact_rows: int, n: int, k: int) -> None:
    """A Q4_0 block's weights, w = (q - 8) scale, in the panels without minima (576 bytes a group, 10%
    fewer): the bf16-activation paths (products up to 16 rows, dequantized above) give the same bits as
    the panels that hold the minima, which the tests above check against float64. With int8 activations
    (above exact_rows) the sums start at -8 x the codes' sum, so each group is scaled once: against
    float64 of y = sum over groups of scale * x_scale * sum(x codes (q - 8)), the integer sums exact.
    Scales span float16's range down to its subnormals, where -8 scale still holds exactly."""
    if not kernels.panel_dot_available():
        pytest.skip(f"the 4-bit panel loops are only in the avx512_bf16 build, not {kernels.isa_level()}")
    from tokenmill.models.ops import q4_pack, q4_symmetric

    q, _, _, x = q4_case(rows, n, k)
    g = torch.Generator().manual_seed(rows + n)
    powers = 2.0 ** torch.randint(-24, 4, (n, k // 32), generator=g)
    scale = (powers * (1 + torch.rand(n, k // 32, generator=g))).to(torch.float16).float()
    lo = -8 * scale
    assert q4_symmetric(scale, lo) and not q4_symmetric(scale, lo * 1.001)
    short, full = q4_pack(q, scale, None), q4_pack(q, scale, lo)
    assert short.shape == (-(-n // 32), k // 32, 576) and full.shape[-1] == 640
    out = kernels.q4_matmul(x, short, n, exact_rows)
    assert bool(out.isfinite().all())
    if rows <= exact_rows:
        assert torch.equal(out, kernels.q4_matmul(x, full, n, exact_rows))
        return
    codes, x_scale = group_codes_of(x)
    ints = torch.einsum("mgi,ngi->mng", codes.double(), q.double().view(n, k // 32, 32) - 8)  # exact
    # float32 products of the two scales, then of the sum: a relative rounding each.
    terms = ints * (scale.double().view(1, n, k // 32) * x_scale.view(rows, 1, k // 32))
    exact = terms.sum(-1)
    atol = 4 * (k // 32) * 2**-23 * float(terms.abs().sum(-1).max())
    check(out, exact, atol=atol)


def test_q4_panels_reject_other_widths(kernels) -> None:
    """Panels of neither width are a clear error, not a read past the weights."""
    if not kernels.panel_dot_available():
        pytest.skip(f"the 4-bit panel loops are only in the avx512_bf16 build, not {kernels.isa_level()}")
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="q4_pack"):
        kernels.q4_matmul(x, torch.zeros(1, 2, 600, dtype=torch.uint8), 32, EXACT)


def group_codes_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codes and scales the group panels quantize bf16 rows [M, K] to, per row and group of 32:
    scale max|x| / 127, codes rounded half to even, 127 / max|x| divided in float32 as the kernel does
    (numpy's division; `127 / tensor` in PyTorch multiplies by a reciprocal, which rounds differently).
    Returns (codes float [M, K/32, 32], scales float64 [M, K/32])."""
    groups = x.float().reshape(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.from_numpy(np.float32(127) / np.where(amax.numpy() > 0, amax.numpy(), np.float32(np.inf)))
    codes = torch.round(groups * inv)
    assert int(codes.abs().max()) <= 127
    return codes, (amax / 127).double().squeeze(-1)


@pytest.mark.parametrize("rows", [3, 5, 8, 33, 300])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 64), (70, 1536)])
def test_q4_panels_with_int8_activations(kernels, rows: int, n: int, k: int) -> None:
    """With int8 activations (int4_activations="int8", W4A8) steps above exact_rows rows (2 in the
    model) quantize the activations to int8 per row and group of 32 (scale max|x| / 127, codes rounded
    half to even) and sum codes times codes exactly: against float64 of the same formula, y = sum over
    groups of scale * x_scale * sum(codes x codes) + lo * x_scale * sum(x codes) (the weights times the
    rounded activations, as llama.cpp's Q4_1 x Q8_1), from the codes computed here. 300 rows cross the
    kernel's 256-row sweeps."""
    if not kernels.panel_dot_available():
        pytest.skip(f"the 4-bit panel loops are only in the avx512_bf16 build, not {kernels.isa_level()}")
    from tokenmill.models.ops import q4_pack

    q, scale, lo, x = q4_case(rows, n, k)
    panels = q4_pack(q, scale, lo)
    out = kernels.q4_matmul(x, panels, n, 2)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    codes, x_scale = group_codes_of(x)
    x_scale = x_scale[..., None]
    s64, lo64 = (v.to(torch.float16).double().view(n, k // 32, 1) for v in (scale, lo))
    ints = torch.einsum("mgi,ngi->mng", codes.double(), q.double().view(n, k // 32, 32))  # exact integers
    terms = ints * (s64.squeeze(-1) * x_scale.squeeze(-1)[:, None, :])
    code_sums = (x_scale.squeeze(-1) * codes.double().sum(-1)).float().double()  # float32, as the kernel
    terms = terms + lo64.squeeze(-1) * code_sums[:, None, :]
    exact = terms.sum(-1)
    # float32 products of the scales and sums over the groups: bounded by the magnitudes summed.
    atol = 4 * (k // 32) * 2**-23 * float(terms.abs().sum(-1).max())
    check(out, exact, atol=atol)
    # And near the bf16 activations' product: each activation's int8 rounding is at most half a level,
    # and meets the weight (q * scale + lo).
    w = (q.double().view(n, k // 32, 32) * s64 + lo64).view(n, k)
    level = (x_scale / 2).expand(-1, -1, 32).reshape(rows, k)
    gap = (out.double() - x.double() @ w.T).abs()
    assert bool((gap <= level @ w.abs().T + 2**-8 * exact.abs() + atol).all())
    for r in {0, rows // 2, rows - 1}:  # a row gives the same in any step of more than exact_rows rows
        for others in (2, 4):  # first of 3 rows, and of 5 (one past a pass of 4)
            step = torch.cat([x[r : r + 1], x.flip(0)[:others].roll(1, 1)])
            assert torch.equal(kernels.q4_matmul(step, panels, n, 2)[0], out[r])


@pytest.mark.parametrize("rows", [1, 3, 5, 8, 33, 300])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 64), (70, 1536)])
def test_g8_panels(kernels, rows: int, n: int, k: int) -> None:
    """8-bit weights with a float16 scale per group of 32 (a Q8_0 block) times the rows quantized per
    group of 32 (W8A8 as llama.cpp multiplies Q8_0 by Q8_0): against float64 of y = sum over groups of
    scale * x_scale * sum(codes x codes), the integer sums exact, from the codes computed here. The
    codes span -128..127 (a Q8_0 file may hold -128); 300 rows cross the kernel's 256-row sweeps."""
    if not kernels.panel_dot_available():
        pytest.skip(f"the 8-bit group panels are only in the avx512_bf16 build, not {kernels.isa_level()}")
    from tokenmill.models.ops import g8_pack

    g = torch.Generator().manual_seed(rows * n + k)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4).to(torch.float16).float()
    x = torch.randn(rows, k + 6, generator=g).to(torch.bfloat16)[:, 3 : 3 + k]
    x[0, :32] = 0  # a group of zeros: codes 0, scale 0
    panels = g8_pack(q, scale)
    out = kernels.g8_matmul(x, panels, n, 0)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    codes, x_scale = group_codes_of(x)
    ints = torch.einsum("mgi,ngi->mng", codes.double(), q.double().view(n, k // 32, 32))  # exact integers
    terms = ints * (scale.double()[None] * x_scale[:, None, :])
    exact = terms.sum(-1)
    # float32 products of the scales and sums over the groups: bounded by the magnitudes summed.
    atol = 4 * (k // 32) * 2**-23 * float(terms.abs().sum(-1).max())
    check(out, exact, atol=atol)
    # And near the bf16 activations' product: each activation's rounding is at most half a level.
    w = (q.double().view(n, k // 32, 32) * scale.double()[..., None]).view(n, k)
    level = (x_scale / 2)[..., None].expand(-1, -1, 32).reshape(rows, k)
    gap = (out.double() - x.double() @ w.T).abs()
    assert bool((gap <= level @ w.abs().T + 2**-8 * exact.abs() + atol).all())
    for r in {0, rows // 2, rows - 1}:  # a row gives the same alone and in a step of five
        assert torch.equal(kernels.g8_matmul(x[r : r + 1], panels, n, 0)[0], out[r])
        assert torch.equal(kernels.g8_matmul(torch.cat([x[r : r + 1], x[:4]]), panels, n, 0)[0], out[r])


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 5, 33])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 64), (70, 1536)])
def test_g8_wide_loops(kernels, x_dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    """The AVX2 8-bit loops (W8A8 by vpmaddubsw with the sign trick; quantization="int8" on builds without
    the BF16 loops) over the group panels: against float64 of y = sum over groups of scale * x_scale *
    sum(codes x codes), the integer sums exact, from the codes computed here. The weight codes span
    -128..127 (a Q8_0 file may hold -128: |q| x 127 x 2 still fits vpmaddubsw's 16 bits); a row's
    result the same alone as beside the others."""
    if not kernels.g8_wide_available():
        pytest.skip(f"the {kernels.isa_level()} build has no AVX2 8-bit loops")
    from tokenmill.models.ops import g8_pack

    g = torch.Generator().manual_seed(rows * n + k + 2)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    q[0, :32] = -128  # the extreme pair sums: 2 x 128 x 127
    scale = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4).to(torch.float16).float()
    x = torch.randn(rows, k + 6, generator=g).to(x_dtype)[:, 3 : 3 + k]
    x[0, :32] = 0  # a group of zeros: codes 0, scale 0
    x[-1, 32:64] = -x[-1, 32:64].abs()  # every code negative: -127 against q = -128 where they meet
    panels = g8_pack(q, scale)
    out = kernels.g8_matmul_wide(x, panels, n)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    codes, x_scale = group_codes_of(x)
    ints = torch.einsum("mgi,ngi->mng", codes.double(), q.double().view(n, k // 32, 32))  # exact integers
    terms = ints * (scale.double()[None] * x_scale[:, None, :])
    # float32 products of the scales and sums over the groups: bounded by the magnitudes summed.
    check(out, terms.sum(-1), atol=4 * (k // 32) * 2**-23 * float(terms.abs().sum(-1).max()))
    for r in {0, rows // 2, rows - 1}:  # a row gives the same alone and in a step of five
        assert torch.equal(kernels.g8_matmul_wide(x[r : r + 1], panels, n)[0], out[r])
        assert torch.equal(kernels.g8_matmul_wide(torch.cat([x[r : r + 1], x[:4]]), panels, n)[0], out[r])


def group_codes16_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 16-bit codes and scales the group panels' wide rows take, per row and group of 32: scale
    2^(e - 15) with max|x| = f 2^e (0.5 <= f < 1), codes x / scale rounded half to even. Returns (codes
    float64 [M, K/32, 32], scales float64 [M, K/32])."""
    groups = x.double().reshape(x.shape[0], -1, 32)
    _, e = torch.frexp(groups.abs().amax(-1))
    scale = torch.where(groups.abs().amax(-1) > 0, torch.ldexp(torch.ones_like(groups[..., 0]), e - 15), 0)
    codes = torch.round(groups / torch.where(scale > 0, scale, 1)[..., None])
    assert float(codes.abs().max()) < 2**15
    return codes, scale


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 64), (70, 1536)])
def test_g8_panels_with_16bit_rows(kernels, rows: int, n: int, k: int) -> None:
    """Steps of up to wide_rows rows (int4's output head at every row count, with either int4_activations)
    take the activations as 16-bit codes per group of 32 with a power-of-two scale, summed with the
    weights' codes exactly by vpdpwssd: against float64 of y = sum over groups of scale * x_scale *
    sum(codes x codes), from the codes computed here; and against the bf16 activations' own product,
    which it matches but for a rounding at 2^-16 of each group's largest value (every element within
    2^7 of it exactly, so far closer than the 8-bit codes' half level). A step above wide_rows rows
    takes the 8-bit codes of test_g8_panels."""
    if not kernels.panel_dot_available():
        pytest.skip(f"the 8-bit group panels are only in the avx512_bf16 build, not {kernels.isa_level()}")
    from tokenmill.models.ops import g8_pack

    g = torch.Generator().manual_seed(rows * n + k + 1)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4).to(torch.float16).float()
    x = torch.randn(rows, k + 6, generator=g).to(torch.bfloat16)[:, 3 : 3 + k]
    x[0, :32] = 0  # a group of zeros: codes 0, scale 0
    x[-1, 32:64] *= torch.logspace(-12, 0, 32, base=2).to(torch.bfloat16)  # values 2^12 apart in a group
    panels = g8_pack(q, scale)
    out = kernels.g8_matmul(x, panels, n, rows)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    codes, x_scale = group_codes16_of(x)
    ints = torch.einsum("mgi,ngi->mng", codes, q.double().view(n, k // 32, 32))  # exact integers
    terms = ints * (scale.double()[None] * x_scale[:, None, :])
    exact = terms.sum(-1)
    atol = 4 * (k // 32) * 2**-23 * float(terms.abs().sum(-1).max())
    check(out, exact, atol=atol)
    w = (q.double().view(n, k // 32, 32) * scale.double()[..., None]).view(n, k)
    # The codes' rounding: half a level, at most 2^-15 of the group's largest; none within 2^7 of it.
    groups = x.double().reshape(rows, k // 32, 32)
    amax = groups.abs().amax(-1)
    assert bool((x_scale <= 2**-14 * amax).all())
    near = groups.abs() * 2**7 >= amax[..., None]
    assert torch.equal((codes * x_scale[..., None])[near], groups[near])
    level = (x_scale / 2)[..., None].expand(-1, -1, 32).reshape(rows, k)
    gap = (out.double() - x.double() @ w.T).abs()
    assert bool((gap <= level @ w.abs().T + 2**-8 * exact.abs() + atol).all())
    for r in {0, rows - 1}:  # a row gives the same alone and in any step of up to wide_rows rows
        assert torch.equal(kernels.g8_matmul(x[r : r + 1], panels, n, 5)[0], out[r])
        assert torch.equal(kernels.g8_matmul(torch.cat([x[r : r + 1], x[:4]]), panels, n, 5)[0], out[r])
    if rows > 1:  # above wide_rows: the 8-bit codes
        assert torch.equal(kernels.g8_matmul(x, panels, n, rows - 1), kernels.g8_matmul(x, panels, n, 0))


def q8_case(rows: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """Random int8 codes with one scale per column, as int4's per-channel output head holds them, and bf16
    rows strided as a fused slice."""
    g = torch.Generator().manual_seed(rows * n + k)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-4
    x = torch.randn(rows, k + 6, generator=g).to(torch.bfloat16)[:, 3 : 3 + k]
    return q, scale, x


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "k"), [(49152 // 16, 576), (37, 64)])
def test_q8_panels(kernels, rows: int, n: int, k: int) -> None:
    """8-bit weight-only panels (the per-channel form of int4's output head) against float64:
    exact products, float32 sums, the column's scale, one rounding."""
    if not kernels.panel_dot_available():
        pytest.skip(f"the 8-bit panel loops are only in the avx512_bf16 build, not {kernels.isa_level()}")
    from tokenmill.models.ops import Q8Panels

    q, scale, x = q8_case(rows, n, k)
    kernel = Q8Panels(kernels, q, scale)
    out = kernel(x)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    w = q.double() * scale.double()[:, None]
    atol = k * 2**-23 * float((x.double().abs() @ w.abs().T).max())
    check(out, x.double() @ w.T, atol=atol)


@pytest.mark.parametrize("rows", [5, 33, 300])
@pytest.mark.parametrize(("n", "k"), [(49152 // 16, 576), (37, 64)])
def test_q8_panels_dequantized_above_4_rows(kernels, rows: int, n: int, k: int) -> None:
    """Above 4 rows each 8-bit panel is dequantized to bf16 (q * scale rounded to nearest even, as
    PyTorch rounds) and the bf16 dot loops run over it: the same bits as the bf16 panel matmul over
    those weights (the copy the layer held before), so no copy is needed. 300 rows cross the kernel's
    256-row sweeps; rows strided as a fused slice."""
    if not kernels.panel_dot_available():
        pytest.skip(f"the 8-bit panel loops are only in the avx512_bf16 build, not {kernels.isa_level()}")
    from tokenmill.models.ops import PanelMatmul, Q8Panels

    q, scale, x = q8_case(rows, n, k)
    out = Q8Panels(kernels, q, scale)(x)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    w = (q.float() * scale[:, None]).to(torch.bfloat16)
    copy = PanelMatmul(kernels, w, brgemm=False)
    assert torch.equal(out, copy(x))  # the copy's dot loops: the same 256-row sweeps
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    assert bool(((out.double() - exact).abs() <= k * 2**-23 * magnitude + 2**-8 * exact.abs()).all())


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 256, 300])
@pytest.mark.parametrize(("n", "k"), [(70, 576), (37, 1540)])
def test_i8_panels(kernels, rows: int, n: int, k: int) -> None:
    """W8A8 int8 panels (quantization="int8" on AVX512-BF16 without AMX; vpdpbusd) against float64: the
    integer products exact (x as q + 128, the offset taken off per column), both scales, one rounding;
    each row's result the same bits whatever rows share its step (300 rows: two sweeps of the weights);
    rows strided as a fused slice."""
    if not kernels.panel_dot_available():
        pytest.skip(f"the int8 panel loops are only in the avx512_bf16 build, not {kernels.isa_level()}")
    from tokenmill.models.ops import I8Panels

    g = torch.Generator().manual_seed(rows * n + k)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    q[0] = 127  # a column of extreme codes, and extreme activations below: the offset at its largest
    w_scale = torch.rand(n, generator=g) * 0.01 + 1e-4
    xq = torch.randint(1, 256, (rows, k + 8), generator=g, dtype=torch.uint8)[:, 4 : 4 + k]
    xq[0, :] = 255
    x_scale = torch.rand(rows, 1, generator=g) * 0.05 + 1e-3
    kernel = I8Panels(kernels, q, w_scale)
    out = kernel(xq, x_scale)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    exact = ((xq.double() - 128) @ q.double().T) * x_scale.double() * w_scale.double()
    check(out, exact, atol=0.0)
    for r in {0, rows // 2, rows - 1}:
        assert torch.equal(kernel(xq[r : r + 1], x_scale[r : r + 1])[0], out[r])
    with pytest.raises(RuntimeError, match="group 4|K/4"):  # bf16-style pairs are not the vpdpbusd layout
        kernels.i8_matmul(xq, x_scale, kernels.panel_pack(q), kernel.offsets, kernel.scales, n)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 256, 300])
def test_f8_panels(kernels, rows: int) -> None:
    """fp8 panels (quantization="fp8" on AVX512-BF16 without AMX): every e4m3 code widened to bf16
    exactly, then the products of the codes summed in float32 and scaled by the row and column scales,
    one rounding; each row's result the same bits whatever rows share its step (300 rows: two sweeps)."""
    if not kernels.panel_dot_available():
        pytest.skip(f"the fp8 panel loops are only in the avx512_bf16 build, not {kernels.isa_level()}")
    from tokenmill.models.fp8_linear import E4M3
    from tokenmill.models.ops import F8Panels

    every = torch.arange(256, dtype=torch.uint8).view(E4M3)
    every = every[every.float().isfinite()]  # the 254 codes that are numbers (rounding never makes NaN)
    g = torch.Generator().manual_seed(rows)
    n, k = 70, 578
    pick = torch.randint(0, every.numel(), (n, k), generator=g)
    codes = every[pick]
    codes[:, : every.numel() // 2] = every[: every.numel() // 2]  # half the codes in every row, in order
    codes[1, :] = every[-1]
    w_scale = torch.rand(n, generator=g) * 0.01 + 1e-4
    x = torch.randint(0, every.numel(), (rows, k + 6), generator=g)
    x_codes = every[x].float().to(torch.bfloat16)[:, 3 : 3 + k]  # e4m3 values, exact in bf16
    x_scale = torch.rand(rows, 1, generator=g) * 0.05 + 1e-3
    kernel = F8Panels(kernels, codes, w_scale)
    out = kernel(x_codes, x_scale)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    w64 = codes.double()
    exact = (x_codes.double() @ w64.T) * x_scale.double() * w_scale.double()
    magnitude = (x_codes.double().abs() @ w64.abs().T) * x_scale.double() * w_scale.double()
    err = (out.double() - exact).abs()
    assert bool((err <= BF16_RTOL * exact.abs() + k * 2**-24 * magnitude).all())
    one_hot = torch.zeros(1, k, dtype=torch.bfloat16)
    one_hot[0, 0] = 1.0
    unit = F8Panels(kernels, every.view(-1, 1).repeat(1, 2), torch.ones(every.numel()))
    assert torch.equal(unit(one_hot[:, :2], torch.ones(1, 1))[0].float(), every.float())  # widened exactly
    for r in {0, rows // 2, rows - 1}:
        assert torch.equal(kernel(x_codes[r : r + 1], x_scale[r : r + 1])[0], out[r])


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load() -> None:
    """PyTorch's build lock is a file; a build killed midway (Ctrl-C during a first start) leaves it, and
    every later load used to wait for it forever. Now the load removes it under a lock of its own."""
    import subprocess
    import sys

    from tokenmill.kernels import build_dir, cpu_kernels, default_level

    try:
        cpu_kernels()  # built (or taken from the cache) first, so the load below has nothing to compile
    except RuntimeError as e:
        pytest.skip(f"no kernel build on this machine: {e}")
    stale = build_dir(default_level()) / "lock"
    stale.touch()
    code = "from tokenmill.kernels import cpu_kernels; cpu_kernels(); print('loaded')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert "loaded" in out.stdout, out.stderr[-2000:]
    assert not stale.exists()


def test_a_second_checkout_of_the_same_sources_loads_the_build_without_compiling(tmp_path: Path) -> None:
    """The build folder is keyed by the sources' contents (and the flags, Python and PyTorch versions), so
    checkouts of the same sources share it. A finished build is imported as it is: ninja would rebuild it
    for another checkout or virtualenv (its commands record their paths), ~3 minutes a level here."""
    import shutil
    import subprocess
    import sys

    import tokenmill
    from tokenmill.kernels import build_dir, cpu_kernels, default_level

    try:
        cpu_kernels()
    except RuntimeError as e:
        pytest.skip(f"no kernel build on this machine: {e}")
    d = build_dir(default_level())
    built = sorted(d.glob("*.so"))
    assert built, f"no library in {d}"
    before = {p: p.stat().st_mtime_ns for p in built}
    other = tmp_path / "checkout"
    shutil.copytree(
        Path(tokenmill.__file__).parent, other / "tokenmill", ignore=shutil.ignore_patterns("__pycache__")
    )
    # PyTorch's builder must not even be asked (it would run ninja, which sees other paths).
    code = (
        "import torch.utils.cpp_extension as ext\n"
        "def refuse(*a, **k): raise AssertionError('the kernels were built again')\n"
        "ext.load = refuse\n"
        "import tokenmill, tokenmill.kernels as k\n"
        f"assert tokenmill.__file__.startswith({str(other)!r}), tokenmill.__file__\n"
        "m = k.cpu_kernels(); print(k.build_dir(k.default_level()), m.isa_level())"
    )
    env = {**os.environ, "PYTHONPATH": str(other)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(d), default_level().name]
    assert {p: p.stat().st_mtime_ns for p in built} == before
