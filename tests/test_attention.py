"""Attention backends against a naive attention over contiguous K/V, and against each other."""

from __future__ import annotations

import pytest
import torch

from tokenmill.models.attention.backend import AttentionMetadata, PrefillSegment
from tokenmill.models.attention.registry import get_backend

H, HKV, D, BS, NUM_BLOCKS = 6, 2, 32, 4, 64


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, H, D] at positions start.., k/v [start+n, HKV, D]: causal attention in float64."""
    rep = H // HKV
    k = k.double().repeat_interleave(rep, dim=1)
    v = v.double().repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * D**-0.5
    qpos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_case(dtype: torch.dtype, seed: int):
    """Three decode rows and two prefill segments (one with cached prefix) over shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g).to(dtype)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    # (context before this step, new tokens): decode rows first, then prefill segments.
    shapes = [(0, 1), (6, 1), (13, 1), (0, 9), (7, 5)]
    seqs, cursor = [], 0
    for before, new in shapes:
        nblocks = -(-(before + new) // BS)
        seqs.append((before, new, perm[cursor : cursor + nblocks]))
        cursor += nblocks
    t = sum(n for _, n, _ in seqs)
    q = torch.randn(t, H, D, generator=g).to(dtype)
    k = torch.randn(t, HKV, D, generator=g).to(dtype)
    v = torch.randn(t, HKV, D, generator=g).to(dtype)
    slots, segments, row = [], [], 0
    for before, new, blocks in seqs:
        slots += [blocks[p // BS] * BS + p % BS for p in range(before, before + new)]
        if new > 1:
            segments.append(PrefillSegment(row, new, before, torch.tensor(blocks)))
        row += new
    decodes = [s for s in seqs if s[1] == 1]
    width = max(len(b) for _, _, b in decodes)
    bt = torch.zeros(len(decodes), width, dtype=torch.long)
    for i, (_, _, b) in enumerate(decodes):
        bt[i, : len(b)] = torch.tensor(b)
    ctx = torch.tensor([before + 1 for before, _, _ in decodes])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode=len(decodes),
        decode_block_tables=bt,
        decode_context_lens=ctx,
        prefills=segments,
        block_size=BS,
    )
    return q, k, v, k_cache, v_cache, meta, seqs


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_backend_matches_naive_attention(backend: str, dtype: torch.dtype, tol: float) -> None:
    q, k, v, k_cache, v_cache, meta, seqs = make_case(dtype, seed=0)
    out = get_backend(backend).forward(q, k, v, k_cache, v_cache, meta, D**-0.5)
    # The reference: the full K/V of each sequence, cached part then this step's part.
    flat_k, flat_v = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
    row = 0
    for before, new, blocks in seqs:
        slots = [blocks[p // BS] * BS + p % BS for p in range(before + new)]
        expect = naive(q[row : row + new], flat_k[slots], flat_v[slots], before)
        torch.testing.assert_close(out[row : row + new].double(), expect, atol=tol, rtol=tol)
        assert torch.equal(flat_k[slots[before:]], k[row : row + new]), "new keys are written to the cache"
        row += new


def test_cpu_kernel_equals_reference_on_large_batch() -> None:
    g = torch.Generator().manual_seed(1)
    b, width = 32, 8
    k_cache = torch.randn(NUM_BLOCKS * 4, BS, HKV, D, generator=g, dtype=torch.float32)
    v_cache = torch.randn(NUM_BLOCKS * 4, BS, HKV, D, generator=g, dtype=torch.float32)
    bt = torch.randint(0, NUM_BLOCKS * 4, (b, width), generator=g)
    ctx = torch.randint(1, width * BS + 1, (b,), generator=g)
    q = torch.randn(b, H, D, generator=g)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), b, bt, ctx, [], BS)
    ref = get_backend("torch")._decode(q, k_cache, v_cache, meta, D**-0.5)
    cpu = get_backend("cpu")._decode(q, k_cache, v_cache, meta, D**-0.5)
    torch.testing.assert_close(cpu, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_backend_with_8bit_cache_matches_naive_attention(backend: str, fmt: str) -> None:
    """With an 8-bit cache, every query attends to the dequantized rows of the cache, except a prompt's
    first chunk, which attends to its own keys and values as computed (nothing is cached before it)."""
    from tokenmill.models.attention.kv_quant import dequantize_rows, quantize_rows

    q, k, v, k_cache, v_cache, meta, seqs = make_case(torch.float32, seed=3)
    k_rows, v_rows = quantize_rows(k_cache, fmt), quantize_rows(v_cache, fmt)
    out = get_backend(backend, kv_format=fmt).forward(q, k, v, k_rows, v_rows, meta, D**-0.5)
    flat_k = dequantize_rows(k_rows, fmt, torch.float32).view(-1, HKV, D)
    flat_v = dequantize_rows(v_rows, fmt, torch.float32).view(-1, HKV, D)
    row = 0
    for before, new, blocks in seqs:
        slots = [blocks[p // BS] * BS + p % BS for p in range(before + new)]
        written = slots[before:]
        assert torch.equal(k_rows.view(-1, HKV, D + 4)[written], quantize_rows(k[row : row + new], fmt))
        assert torch.equal(v_rows.view(-1, HKV, D + 4)[written], quantize_rows(v[row : row + new], fmt))
        if before == 0 and new > 1:
            ks, vs = k[row : row + new], v[row : row + new]
        else:
            ks, vs = flat_k[slots], flat_v[slots]
        expect = naive(q[row : row + new], ks, vs, before)
        torch.testing.assert_close(out[row : row + new].double(), expect, atol=1e-5, rtol=1e-5)
        row += new
    # Rows hold what they stand for, within the format's resolution (half a step of the largest value
    # for int8; half a unit in the last place of 3 mantissa bits, relative, for fp8).
    back = dequantize_rows(quantize_rows(k_cache, fmt), fmt, torch.float32)
    err = (back - k_cache).abs() / (k_cache.abs() if fmt == "fp8" else k_cache.abs().amax(-1, keepdim=True))
    assert float(err.max()) <= {"int8": 0.5 / 127 * 1.01, "fp8": 2**-4 * 1.01}[fmt]
