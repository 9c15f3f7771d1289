"""Prompt attention: the whole-prompt brgemm kernel against PyTorch's SDPA (the reference backend's path).

SmolLM2-135M's shape (9 query heads, 3 kv heads, head size 64), bf16, one layer of a prompt step: a
2048-token step made of whole prompts, as offline serving schedules them. Cases: the offline
benchmark's prompts (32-512 tokens, uniform), single prompts of 128 to 1024 tokens, and chunks that
continue a cached context (chunked prefill of a long prompt, a prefix hit), read from a paged bf16
cache of 16-token blocks in shuffled order. Both paths
run in the same process, alternated, best of three rounds; GFLOPS counts the causal products only
(2 * 2 * D flops for each query-key pair a query sees).

    python benchmarks/prefill_attention.py [--cached 300:8,3000:16] [--cached-min-queries 1]

--cached replaces the cached-chunk cases (cached tokens:new tokens); --cached-min-queries overrides the
backend's threshold under which such chunks stay with SDPA, to measure where it should be.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_attention import time_ms  # noqa: E402
from machine import cpu_description  # noqa: E402

from tokenmill.models.attention.backend import PrefillSegment  # noqa: E402
from tokenmill.models.attention.registry import get_backend  # noqa: E402
from tokenmill.models.linear import bf16_brgemm_available  # noqa: E402

H, HKV, D, STEP = 9, 3, 64, 2048


def offline_lengths(rng: random.Random) -> list[int]:
    """Prompts of 32-512 tokens until the next would overflow a 2048-token step."""
    lens: list[int] = []
    while True:
        n = rng.randint(32, 512)
        if sum(lens) + n > STEP:
            return lens
        lens.append(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cached", help="cached-chunk cases as cached:new pairs, e.g. 300:8,3000:16")
    ap.add_argument("--cached-min-queries", type=int, help="override the backend's threshold")
    args = ap.parse_args()
    print(cpu_description(), f"threads: {torch.get_num_threads()}")
    if not bf16_brgemm_available():
        print("the whole-prompt kernel needs AMX or AVX512-BF16, which this CPU lacks; nothing to compare")
        return
    rng = random.Random(0)
    cases = [("offline mix", offline_lengths(rng)), ("offline mix", offline_lengths(rng))]
    cases += [(f"1 x {n}", [n]) for n in (128, 256, 512, 1024)]
    backends = {"ref": get_backend("torch"), "cpu": get_backend("cpu")}
    # Chunks under the backend's cached_min_queries (192 with AMX, 16 without) stay with SDPA: with AMX
    # the last case shows that routing, about 1.0.
    later = ((512, 512), (2048, 2048), (3000, 256), (3000, 64))
    if args.cached:
        cases = []
        later = tuple(tuple(int(v) for v in c.split(":")) for c in args.cached.split(","))
    if args.cached_min_queries is not None:
        backends["cpu"].cached_min_queries = args.cached_min_queries  # type: ignore[attr-defined]
    print(f"cached chunks from {backends['cpu'].cached_min_queries} queries on the kernel")  # type: ignore[attr-defined]
    cases += [(f"{n} after {past} cached", [(past, n)]) for past, n in later]
    print("| prompts | tokens | SDPA ms | kernel ms | SDPA GFLOPS | kernel GFLOPS | speed-up |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, lens in cases:
        t = sum(x[1] if isinstance(x, tuple) else x for x in lens)
        qkv = torch.randn(t, (H + 2 * HKV) * D, generator=g).to(torch.bfloat16)
        q = qkv[:, : H * D].view(t, H, D)
        k = qkv[:, H * D : (H + HKV) * D].view(t, HKV, D)
        v = qkv[:, (H + HKV) * D :].view(t, HKV, D)
        segs, start = [], 0
        k_cache = v_cache = None
        for n in lens:
            if isinstance(n, tuple):  # (cached tokens, new tokens): a paged cache holds the context
                past, n = n
                blocks = -(-(past + n) // 16)
                k_cache = torch.randn(blocks, 16, HKV, D, generator=g).to(torch.bfloat16)
                v_cache = torch.randn(blocks, 16, HKV, D, generator=g).to(torch.bfloat16)
                table = torch.randperm(blocks, generator=g)
                segs.append(PrefillSegment(start, n, past, table))
            else:
                segs.append(PrefillSegment(start, n, 0, torch.zeros(0, dtype=torch.long)))
            start += n
        outs = {w: torch.empty(t, H, D, dtype=torch.bfloat16) for w in backends}

        def run(which: str, segs=segs, q=q, k=k, v=v, outs=outs, kc=k_cache, vc=v_cache) -> None:
            backends[which]._prefill(q, k, v, kc, vc, segs, D**-0.5, outs[which])

        run("ref")
        run("cpu")
        torch.testing.assert_close(outs["cpu"].float(), outs["ref"].float(), atol=2e-2, rtol=2e-2)
        best = {w: float("inf") for w in backends}
        for _ in range(3):
            for w in backends:
                best[w] = min(best[w], time_ms(lambda w=w: run(w), 5))
        flops = sum(4 * D * H * (s.q_len * s.start_pos + s.q_len * (s.q_len + 1) / 2) for s in segs)
        ref, cpu = best["ref"], best["cpu"]
        print(
            f"| {name} ({len(lens)}) | {t} | {ref:.2f} | {cpu:.2f} "
            f"| {flops / ref / 1e6:.0f} | {flops / cpu / 1e6:.0f} | {ref / cpu:.2f} |"
        )


if __name__ == "__main__":
    main()
