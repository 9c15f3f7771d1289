"""Decode attention over the paged KV cache: the C++ kernel against the plain-PyTorch backend.

SmolLM2-135M's shape (9 query heads, 3 kv heads, head size 64), 30 layers, bf16, blocks of 16 tokens
scattered over a 1 GB pool as they are after a while of serving, on huge pages as the engine's pool
is. The reference gathers each sequence's blocks and calls scaled_dot_product_attention; the kernel
reads the blocks in place.
Reports ms per step (all 30 layers), the KV bytes read per second, and the ratio in the same run.
A second table times the kernel on 8-bit caches (`--kv-cache-dtype int8|fp8`: rows of 64 codes and a
float32 scale, 68 bytes against 128) against the same kernel on the bf16 cache, same block tables.

    python benchmarks/decode_attention.py [--level avx2]

`--level`: time that instruction-set build of the kernel rather than the best this CPU runs (avx2 is a
laptop's build: its plain loops, without the AVX-512 register kernel).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from tokenmill.models.attention.backend import AttentionMetadata
from tokenmill.models.attention.kv_quant import quantize_rows
from tokenmill.models.attention.registry import get_backend
from tokenmill.worker import huge_pages

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description  # noqa: E402

H, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30
CASES = [(1, 2000), (1, 8000), (8, 500), (32, 50), (32, 175), (64, 300)]  # (sequences, mean context length)


def make_step(b: int, ctx_mean: int, pool_blocks: int, g: torch.Generator) -> AttentionMetadata:
    ctx = torch.randint(int(ctx_mean * 0.7), int(ctx_mean * 1.3) + 1, (b,), generator=g)
    width = int((ctx.max() + BS - 1) // BS)
    tables = torch.randperm(pool_blocks, generator=g)[: b * width].view(b, width)
    return AttentionMetadata(torch.empty(0, dtype=torch.long), b, tables, ctx, [], BS)


def pooled(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into memory allocated as the engine allocates its pool (transparent huge pages: 15-20%
    more KV per second than 4 KB pages here)."""
    out = huge_pages.zeros(tuple(t.shape), t.dtype, t.device)
    return out.copy_(t)


def time_ms(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--level", default="cpu", help="a kernel build (avx2, ...); default: the best here")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    pool_blocks = 2**30 // (LAYERS * 2 * BS * HKV * D * 2)
    k_cache = pooled(torch.randn(LAYERS, pool_blocks, BS, HKV, D, generator=g).to(torch.bfloat16))
    v_cache = pooled(torch.randn(LAYERS, pool_blocks, BS, HKV, D, generator=g).to(torch.bfloat16))
    ref, cpu = get_backend("torch"), get_backend(args.level)
    print(f"CPU: {cpu_description()}")
    print(f"threads: {torch.get_num_threads()}; kernel build: {cpu.kernels.isa_level()}")
    print("| sequences | mean context | torch ms/step | kernel ms/step | kernel KV GB/s | ratio |")
    print("|---|---|---|---|---|---|")
    for b, ctx_mean in CASES:
        meta = make_step(b, ctx_mean, pool_blocks, g)
        q = torch.randn(b, H, D, generator=g).to(torch.bfloat16)
        out_ref = ref._decode(q, k_cache[0], v_cache[0], meta, D**-0.5)
        out_cpu = cpu._decode(q, k_cache[0], v_cache[0], meta, D**-0.5)
        torch.testing.assert_close(out_cpu.float(), out_ref.float(), atol=2e-2, rtol=2e-2)

        def step(backend=ref, meta=meta, q=q) -> None:
            for layer in range(LAYERS):
                backend._decode(q, k_cache[layer], v_cache[layer], meta, D**-0.5)

        reps = 5
        t_ref = time_ms(step, reps)
        t_cpu = time_ms(lambda meta=meta, q=q: step(cpu, meta, q), reps)
        kv_bytes = 2 * int(meta.decode_context_lens.sum()) * HKV * D * 2 * LAYERS
        print(
            f"| {b} | {ctx_mean} | {t_ref:.2f} | {t_cpu:.2f} | {kv_bytes / t_cpu / 1e6:.1f} "
            f"| {t_ref / t_cpu:.2f} |"
        )
    eight_bit(k_cache, v_cache, pool_blocks, g, args.level)


def eight_bit(
    k_cache: torch.Tensor, v_cache: torch.Tensor, pool_blocks: int, g: torch.Generator, level: str
) -> None:
    rows = {
        fmt: (
            pooled(torch.stack([quantize_rows(k_cache[i], fmt) for i in range(LAYERS)])),
            pooled(torch.stack([quantize_rows(v_cache[i], fmt) for i in range(LAYERS)])),
        )
        for fmt in ("int8", "fp8")
    }
    backends = {None: get_backend(level), **{fmt: get_backend(level, kv_format=fmt) for fmt in rows}}
    caches = {None: (k_cache, v_cache), **rows}
    print()
    print(
        "| sequences | mean context | bf16 ms/step | int8 ms/step | fp8 ms/step "
        "| int8 speed-up | fp8 speed-up | int8 KV GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for b, ctx_mean in CASES:
        meta = make_step(b, ctx_mean, pool_blocks, g)
        q = torch.randn(b, H, D, generator=g).to(torch.bfloat16)

        def step(fmt: str | None, meta=meta, q=q) -> None:
            kc, vc = caches[fmt]
            for layer in range(LAYERS):
                backends[fmt]._decode(q, kc[layer], vc[layer], meta, D**-0.5)

        # Alternated, three rounds, best of each: the machine's memory bandwidth drifts between runs.
        best = {fmt: float("inf") for fmt in caches}
        for _ in range(3):
            for fmt in caches:
                best[fmt] = min(best[fmt], time_ms(lambda fmt=fmt: step(fmt), 5))
        kv_bytes = 2 * int(meta.decode_context_lens.sum()) * HKV * (D + 4) * LAYERS
        print(
            f"| {b} | {ctx_mean} | {best[None]:.2f} | {best['int8']:.2f} | {best['fp8']:.2f} "
            f"| {best[None] / best['int8']:.2f} | {best[None] / best['fp8']:.2f} "
            f"| {kv_bytes / best['int8'] / 1e6:.1f} |"
        )


if __name__ == "__main__":
    main()
